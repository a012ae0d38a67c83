// The LoRA terms of a step's adapted rows, added to a base layer's output in one call.
//
// From Python, or as batched torch ops, each layer's terms cost a gather, two matmuls per slot
// (or two batched ones over a padded block) and a scatter: at decode sizes (a few rows per
// adapter, rank 16) the matmuls run far below the machine's speed and the ops' overhead
// dominates. Here the rows, sorted by slot (engine/lora/batched.py), are read in place: each
// slot's a is streamed once per block of its rows (shrink), then its b_t once per block of
// outputs (expand), skipping the zeros of a fused layer's block-diagonal b_t, with the shrink
// in float and every row's term summed apart before it is added.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kOutBlock = 256;  // outputs per expand task: its b_t rows stay in L1/L2
constexpr int64_t kRowBlock = 8;    // rows per shrink task: they stay in L1 over every column

template <typename T>
void add_terms(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
               const int64_t* spans, const int64_t* order, const int64_t* slots,
               const int64_t* starts, int64_t segments) {
  const int64_t in = x.size(1), width = out.size(1), columns = a.size(1);
  const int64_t rows = starts[segments];
  std::vector<float> hidden(static_cast<size_t>(rows * columns));
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b_t.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  float* hp = hidden.data();

  // Shrink tasks: blocks of kRowBlock rows of one segment (a segment's last may be short).
  std::vector<int64_t> block_segment, block_first;
  for (int64_t segment = 0; segment < segments; ++segment) {
    for (int64_t i = starts[segment]; i < starts[segment + 1]; i += kRowBlock) {
      block_segment.push_back(segment);
      block_first.push_back(i);
    }
  }
  const int64_t row_blocks = static_cast<int64_t>(block_first.size());
  at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t segment = block_segment[task], first = block_first[task];
      const int64_t last = std::min(first + kRowBlock, starts[segment + 1]);
      for (int64_t column = 0; column < columns; ++column) {
        const T* a_row = ap + (slots[segment] * columns + column) * in;
        for (int64_t i = first; i < last; ++i) {
          const T* x_row = xp + order[i] * x_stride;
          float sum = 0.f;
          for (int64_t k = 0; k < in; ++k) {
            sum += static_cast<float>(x_row[k]) * static_cast<float>(a_row[k]);
          }
          hp[i * columns + column] = sum;
        }
      }
    }
  });

  const int64_t blocks = (width + kOutBlock - 1) / kOutBlock;
  at::parallel_for(0, segments * blocks, 1, [&](int64_t begin, int64_t end) {
    float term[kOutBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t segment = task / blocks, first = (task % blocks) * kOutBlock;
      const int64_t count = std::min(kOutBlock, width - first);
      const T* b = bp + slots[segment] * columns * width + first;
      const int64_t* span = spans + slots[segment] * columns * 2;
      for (int64_t i = starts[segment]; i < starts[segment + 1]; ++i) {
        std::fill(term, term + count, 0.f);
        const float* h = hp + i * columns;
        for (int64_t column = 0; column < columns; ++column) {
          const float weight = h[column];
          if (weight == 0.f) continue;  // a rank below the slots' width leaves zero columns
          // A fused layer's column feeds only its own shard's outputs (b_t is zero elsewhere).
          const int64_t lo = std::max(span[2 * column] - first, int64_t{0});
          const int64_t hi = std::min(span[2 * column + 1] - first, count);
          const T* b_row = b + column * width;
          for (int64_t o = lo; o < hi; ++o) term[o] += weight * static_cast<float>(b_row[o]);
        }
        T* out_row = op + order[i] * out_stride + first;
        for (int64_t o = 0; o < count; ++o) {
          out_row[o] = static_cast<T>(static_cast<float>(out_row[o]) + term[o]);
        }
      }
    }
  });
}

// out [T, width] += each adapted row's term: order [n] the adapted rows sorted by slot, in
// segments[s] = order[starts[s]:starts[s + 1]] of slot slots[s]; a [slots, columns, in] and
// b_t [slots, columns, width] every slot's stacks, spans [slots, columns, 2] the outputs
// [lo, hi) each slot's column reaches (b_t is zero outside them).
at::Tensor lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& b_t, const at::Tensor& spans, const at::Tensor& order,
                    const at::Tensor& slots, const at::Tensor& starts) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0),
              "lora_add: x [T, in] and out [T, width]");
  TORCH_CHECK(a.dim() == 3 && b_t.dim() == 3 && a.size(0) == b_t.size(0) &&
                  a.size(1) == b_t.size(1) && a.size(2) == x.size(1) &&
                  b_t.size(2) == out.size(1),
              "lora_add: a [slots, columns, in] and b_t [slots, columns, width]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && a.scalar_type() == out.scalar_type() &&
                  b_t.scalar_type() == out.scalar_type(),
              "lora_add: one dtype");
  TORCH_CHECK(a.is_contiguous() && b_t.is_contiguous() && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_add: contiguous stacks and rows");
  TORCH_CHECK(order.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  starts.scalar_type() == at::kLong && starts.numel() == slots.numel() + 1 &&
                  order.is_contiguous() && slots.is_contiguous() && starts.is_contiguous(),
              "lora_add: int64 order, slots and starts (one more than slots)");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() &&
                  spans.numel() == 2 * a.size(0) * a.size(1),
              "lora_add: int64 spans [slots, columns, 2]");
  const int64_t segments = slots.numel();
  if (segments == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lora_add", [&] {
    add_terms<scalar_t>(out, x, a, b_t, spans.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                        slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), segments);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def(
      "lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor b_t, Tensor spans, Tensor order, "
      "Tensor slots, Tensor starts) -> Tensor(a!)");
  m.impl("lora_add", c10::DispatchKey::CPU, &lora_add);
}
