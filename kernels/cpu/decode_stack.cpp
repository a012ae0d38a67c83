// Every decoder layer of a decode step in one call from Python.
//
// A decode step's arithmetic per layer is a few matmuls and small kernels, but from Python each
// layer also costs a dozen module calls, argument checks and op dispatches: at one sequence that
// overhead is a fifth of a quantized model's step. Here the layers run back to back in C++,
// each op reached through the dispatcher (our kernels, oneDNN's and MKL's linears alike), in the
// order the Python forward runs them, so the numbers are the same ones.
//
// Linear layers arrive as a flat spec, LINEAR_SLOTS optional tensors and LINEAR_INTS ints each,
// four per layer in the order qkv, o, gate_up, down (see engine/platforms/cpu/decode_stack.py):
//   kind ATEN:   weight                                 -> at::linear
//   kind ONEDNN: weight (plain or packed by oneDNN)      -> mkldnn::_linear_pointwise
//   kind MKL:    packed weight, plain weight; int hint   -> mkl::_mkl_linear
//   kind QUANT:  codes, scales, mins; ints bits, group,
//                oneDNN for the dequantized tiles          -> inferq_cpu::quant_matmul
//   kind W8A8:   int8 codes, scales; ints the most rows
//                kept exact, oneDNN tiles                 -> inferq_cpu::w8a8_matmul above that
//   kind PANELS: weight packed in panels; int out         -> inferq_cpu::panel_linear
//   kind GATED_PANELS: [gate; up] weight interleaved and
//                packed in panels; ints the halves' width,
//                the interleave group                     -> inferq_cpu::panel_gated_linear,
//                which applies SiLU-and-mul itself (only as a gate_up projection)
// each with an optional input order (GPTQ act-order) and bias.
//
// LoRA adapters (engine/lora/batched.py) arrive as each linear's slot stacks a [slots, columns,
// in], b_t [slots, columns, out] and their spans (three optional tensors, see
// inferq_cpu::lora_add), and the step's adapted rows sorted by slot (order, slots, starts). Each adapted linear adds its terms through
// inferq_cpu::lora_add, as the Python forward does; an adapted gate_up packed for the gated
// kernel is projected, de-interleaved, adapted and activated apart, as in Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "onednn_linear.h"

namespace {

// The kinds' values and the spec's sizes are kernels/cpu_ops.py's (LinearKind, LINEAR_SLOTS,
// LINEAR_INTS), passed in by the build as INFERQ_LINEAR_* defines: one source for both sides.
#if !defined(INFERQ_LINEAR_SLOTS) || !defined(INFERQ_LINEAR_INTS)
#error "build through kernels.cpu_ops, which defines the linear spec (INFERQ_LINEAR_*)"
#endif
constexpr int64_t kLinearSlots = INFERQ_LINEAR_SLOTS;  // a, b, c, input_order, bias
constexpr int64_t kLinearInts = INFERQ_LINEAR_INTS;    // kind, p0, p1, p2
constexpr int64_t kLinearsPerLayer = 4;
enum LinearKind : int64_t {
  kAten = INFERQ_LINEAR_ATEN,
  kOneDnn = INFERQ_LINEAR_ONEDNN,
  kMkl = INFERQ_LINEAR_MKL,
  kQuant = INFERQ_LINEAR_QUANT,
  kW8A8 = INFERQ_LINEAR_W8A8,
  kPanels = INFERQ_LINEAR_PANELS,
  kGatedPanels = INFERQ_LINEAR_GATED_PANELS,
};

c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor call_op(const c10::OperatorHandle& op, std::vector<c10::IValue> stack) {
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

c10::IValue optional_tensor(const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) return *t;
  return c10::IValue();
}

struct Linear {
  int64_t kind, p0, p1, p2;
  std::optional<at::Tensor> a, b, c, input_order, bias;
};

// A step's adapted rows sorted by slot (engine.lora.batched.RowMapping).
struct LoRARows {
  at::Tensor order, slots, starts;
};

// One linear's slot stacks and their columns' output spans; a undefined: no LoRA here.
struct LoRAStacks {
  at::Tensor a, b_t, spans;
};

at::Tensor add_lora(at::Tensor out, const at::Tensor& x, const LoRAStacks& lora,
                    const LoRARows& rows) {
  static const c10::OperatorHandle lora_add = find_op("inferq_cpu::lora_add");
  if (!lora.a.defined()) return out;
  return call_op(lora_add, {out, x, lora.a, lora.b_t, lora.spans, rows.order, rows.slots, rows.starts});
}

// quant_gemm_min_rows: from this many rows on, quant_matmul runs its dequantized-tile GEMM.
at::Tensor run_linear(const Linear& spec, at::Tensor x, int64_t quant_gemm_min_rows) {
  static const c10::OperatorHandle mkl = find_op("mkl::_mkl_linear");
  static const c10::OperatorHandle quant = find_op("inferq_cpu::quant_matmul");
  static const c10::OperatorHandle w8a8 = find_op("inferq_cpu::w8a8_matmul");
  static const c10::OperatorHandle panels = find_op("inferq_cpu::panel_linear");
  static const c10::OperatorHandle gated_panels = find_op("inferq_cpu::panel_gated_linear");
  if (spec.input_order.has_value() && spec.input_order->defined()) {
    x = x.index_select(-1, *spec.input_order);
  }
  switch (spec.kind) {
    case kAten:
      return at::linear(x, *spec.a, spec.bias);
    case kOneDnn:
      return inferq_cpu::onednn_linear(x.contiguous(), *spec.a, spec.bias.value_or(at::Tensor()));
    case kMkl:
      return call_op(mkl, {x.contiguous(), *spec.a, *spec.b, optional_tensor(spec.bias),
                           c10::IValue(spec.p0)});
    case kQuant:
      return call_op(quant, {x.contiguous(), *spec.a, *spec.b, optional_tensor(spec.c),
                             c10::IValue(spec.p0), c10::IValue(spec.p1),
                             optional_tensor(spec.bias), c10::IValue(quant_gemm_min_rows),
                             c10::IValue(spec.p2 != 0)});
    case kW8A8:
      if (x.numel() > spec.p0 * x.size(-1)) {
        return call_op(w8a8, {x, *spec.a, *spec.b, optional_tensor(spec.bias)});
      }
      return call_op(quant, {x.contiguous(), *spec.a, *spec.b, c10::IValue(), c10::IValue(int64_t{8}),
                             c10::IValue(x.size(-1)), optional_tensor(spec.bias),
                             c10::IValue(quant_gemm_min_rows), c10::IValue(spec.p1 != 0)});
    case kPanels:
      return call_op(panels, {x, *spec.a, optional_tensor(spec.bias), c10::IValue(spec.p0)});
    case kGatedPanels:
      return call_op(gated_panels, {x, *spec.a, c10::IValue(spec.p0)});
    default:
      TORCH_CHECK(false, "unknown linear kind ", spec.kind);
  }
}

std::vector<Linear> read_linears(const c10::List<std::optional<at::Tensor>>& tensors,
                                 c10::ArrayRef<int64_t> ints, int64_t count) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == count * kLinearSlots &&
                  static_cast<int64_t>(ints.size()) == count * kLinearInts,
              "linear spec must hold ", kLinearSlots, " tensors and ", kLinearInts,
              " ints per linear");
  std::vector<Linear> linears;
  linears.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = i * kLinearSlots, n = i * kLinearInts;
    linears.push_back(Linear{ints[n], ints[n + 1], ints[n + 2], ints[n + 3], tensors.get(t),
                             tensors.get(t + 1), tensors.get(t + 2), tensors.get(t + 3),
                             tensors.get(t + 4)});
    TORCH_CHECK(linears.back().a.has_value(), "linear ", i, " has no weight");
  }
  return linears;
}

// hidden [T, hidden] (the embedded tokens) through every layer; returns (hidden, residual) for
// the final norm, as the Python forward's last layer leaves them.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos_sin_cache,
    at::TensorList key_caches, at::TensorList value_caches, at::TensorList norm_weights,
    const c10::List<std::optional<at::Tensor>>& linear_tensors, c10::IntArrayRef linear_ints,
    int64_t num_heads, double eps, double scale, int64_t quant_gemm_min_rows,
    c10::IntArrayRef windows, const c10::List<std::optional<at::Tensor>>& lora_tensors,
    at::TensorList lora_rows) {
  static const c10::OperatorHandle panels = find_op("inferq_cpu::panel_linear");
  static const c10::OperatorHandle rms_norm = find_op("inferq_cpu::rms_norm");
  static const c10::OperatorHandle rotary_store_kv = find_op("inferq_cpu::rotary_store_kv");
  static const c10::OperatorHandle attention = find_op("inferq_cpu::paged_decode_attention");
  static const c10::OperatorHandle silu_and_mul = find_op("inferq_cpu::silu_and_mul");
  static const c10::OperatorHandle add_rms_norm = find_op("inferq_cpu::add_rms_norm");

  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == num_layers &&
                  static_cast<int64_t>(norm_weights.size()) == 2 * num_layers,
              "one key cache, value cache and two norm weights per layer");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == num_layers,
              "one sliding window (0: none) per layer");
  const std::vector<Linear> linears =
      read_linears(linear_tensors, linear_ints, num_layers * kLinearsPerLayer);
  const int64_t num_tokens = hidden_in.size(0);
  const bool adapted = !lora_tensors.empty();
  std::vector<LoRAStacks> loras;
  LoRARows rows;
  if (adapted) {
    TORCH_CHECK(static_cast<int64_t>(lora_tensors.size()) == 3 * num_layers * kLinearsPerLayer,
                "LoRA: the stacks a, b_t and spans of every linear, or none");
    TORCH_CHECK(lora_rows.size() == 3, "LoRA: the rows' order, slots and starts");
    auto get = [](const c10::List<std::optional<at::Tensor>>& list, size_t i) {
      const std::optional<at::Tensor> t = list.get(i);
      return t.has_value() ? *t : at::Tensor();
    };
    for (int64_t i = 0; i < num_layers * kLinearsPerLayer; ++i) {
      loras.push_back(LoRAStacks{get(lora_tensors, 3 * i), get(lora_tensors, 3 * i + 1),
                                 get(lora_tensors, 3 * i + 2)});
    }
    rows = LoRARows{lora_rows[0], lora_rows[1], lora_rows[2]};
  }

  auto normed_sum = [&](const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight) {
    std::vector<c10::IValue> stack{x, residual, weight, c10::IValue(eps)};
    add_rms_norm.callBoxed(&stack);
    return std::make_tuple(stack[0].toTensor(), stack[1].toTensor());
  };

  at::Tensor hidden = hidden_in;
  at::Tensor residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const Linear* proj = linears.data() + layer * kLinearsPerLayer;
    const LoRAStacks* lora = adapted ? loras.data() + layer * kLinearsPerLayer : nullptr;
    auto lora_linear = [&](int64_t index, const at::Tensor& x) {
      at::Tensor out = run_linear(proj[index], x, quant_gemm_min_rows);
      return adapted ? add_lora(out, x, lora[index], rows) : out;
    };
    at::Tensor normed;
    if (layer == 0) {
      residual = hidden;
      normed = call_op(rms_norm, {hidden, norm_weights[0], c10::IValue(eps)});
    } else {
      std::tie(normed, residual) = normed_sum(hidden, residual, norm_weights[2 * layer]);
    }
    const at::Tensor qkv = lora_linear(0, normed);
    const at::Tensor q = call_op(rotary_store_kv, {qkv, positions, cos_sin_cache, slot_mapping,
                                                   key_caches[layer], value_caches[layer],
                                                   c10::IValue(num_heads)});
    at::Tensor attended = at::empty_like(q);
    std::vector<c10::IValue> stack{attended,          q,          key_caches[layer],
                                   value_caches[layer], block_tables, seq_lens,
                                   c10::IValue(scale), c10::IValue(windows[layer]),
                                   c10::IValue(0.0),   c10::IValue()};
    attention.callBoxed(&stack);
    const at::Tensor projected = lora_linear(1, attended.view({num_tokens, -1}));
    std::tie(normed, residual) = normed_sum(projected, residual, norm_weights[2 * layer + 1]);
    at::Tensor activated;
    if (adapted && lora[2].a.defined()) {
      at::Tensor projected_up;
      if (proj[2].kind == kGatedPanels) {
        // The plain projection through the same panels comes out interleaved by p1 features.
        const int64_t half = proj[2].p0, group = proj[2].p1;
        projected_up = call_op(panels, {normed, *proj[2].a, c10::IValue(), c10::IValue(2 * half)})
                           .view({num_tokens, -1, 2, group})
                           .transpose(1, 2)
                           .reshape({num_tokens, 2 * half});
      } else {
        projected_up = run_linear(proj[2], normed, quant_gemm_min_rows);
      }
      activated = call_op(silu_and_mul, {add_lora(projected_up, normed, lora[2], rows)});
    } else {
      activated = run_linear(proj[2], normed, quant_gemm_min_rows);
      if (proj[2].kind != kGatedPanels) activated = call_op(silu_and_mul, {activated});
    }
    hidden = lora_linear(3, activated);
  }
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor positions, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, Tensor cos_sin_cache, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
      "Tensor[] norm_weights, Tensor?[] linear_tensors, int[] linear_ints, int num_heads, "
      "float eps, float scale, int quant_gemm_min_rows, int[] windows, Tensor?[] lora_tensors, "
      "Tensor[] lora_rows) -> (Tensor, Tensor)");
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
  // oneDNN-packed weights are tensors of their own backend; dispatch sees them among the args.
  m.impl("decode_layers", c10::DispatchKey::MkldnnCPU, &decode_layers);
}
