// The elementwise glue between a CPU decoder layer's matmuls, one C++ call per group of ops.
//
// At decode sizes (a few rows of a few hundred values) each eager torch op costs more in dispatch
// and allocation than in arithmetic, and a layer runs a few dozen of them: residual add and
// RMSNorm, the rotary rotation of q and k, the KV-cache store, SiLU times up. Each function here
// does one group in a single pass over the rows, arithmetic in float32, rounding to the tensor's
// dtype where the eager ops round (so bf16 results match theirs up to float summation order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "bf16.h"
#include "vec_math.h"

namespace {

using inferq_cpu::as_float;
using inferq_cpu::from_float;

// Runs body.template operator()<scalar_t>() for float32 or bfloat16 tensors.
template <typename Body>
void dispatch_float_or_bf16(at::ScalarType dtype, const char* name, Body&& body) {
  if (dtype == at::kFloat) {
    body(float{});
  } else if (dtype == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, name, " supports float32 and bfloat16");
  }
}

// Rows per parallel task: small steps run inline on the calling thread (no pool wake-up).
inline int64_t row_grain(int64_t row_size) { return std::max<int64_t>(1, 32768 / row_size); }

template <typename scalar_t>
inline void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t width,
                         float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) squares += as_float(x[i]) * as_float(x[i]);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    out[i] = from_float<scalar_t>(as_float(x[i]) * inv * as_float(weight[i]));
  }
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows,
                   int64_t width, float eps) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row(x + r * width, weight, out + r * width, width, eps);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  TORCH_CHECK(x.size(-1) == weight.numel(), "weight size must match the last dimension");
}

// rms_norm(x) * weight over the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t width = x.size(-1);
  dispatch_float_or_bf16(x.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    rms_norm_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                  x.numel() / width, width, static_cast<float>(eps));
  });
  return out;
}

// (rms_norm(x + residual) * weight, x + residual), the sum rounded to x's dtype before the norm
// as the eager add does.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous and match x");
  at::Tensor summed = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const int64_t width = x.size(-1);
  const int64_t rows = x.numel() / width;
  dispatch_float_or_bf16(x.scalar_type(), "add_rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* sp = summed.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // one pass over each row while it is in L1: the sum, then its norm
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t row = r * width;
#pragma omp simd
        for (int64_t i = row; i < row + width; ++i) {
          sp[i] = from_float<scalar_t>(as_float(xp[i]) + as_float(rp[i]));
        }
        rms_norm_row(sp + row, wp, op + row, width, static_cast<float>(eps));
      }
    });
  });
  return {out, summed};
}

// [..., 2 * d] holding gate then up -> silu(gate) * up [..., d], silu rounded to the dtype
// before the product as the eager pair of ops does.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const int64_t width = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = x.numel() / (2 * width);
  dispatch_float_or_bf16(x.scalar_type(), "silu_and_mul", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(2 * width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * width;
        const scalar_t* up = gate + width;
        scalar_t* outr = op + r * width;
        int64_t i = 0;
#if defined(__AVX512F__)
        // exp in registers: the loop below calls the C library's exp per element
        for (; i + 16 <= width; i += 16) {
          const __m512 silu = inferq_cpu::as_stored(
              inferq_cpu::silu512(inferq_cpu::load16(gate + i)), scalar_t{});
          inferq_cpu::store16(outr + i, _mm512_mul_ps(silu, inferq_cpu::load16(up + i)));
        }
#endif
        for (; i < width; ++i) {
          const float g = as_float(gate[i]);
          const scalar_t silu = from_float<scalar_t>(g / (1.f + std::exp(-g)));
          outr[i] = from_float<scalar_t>(as_float(silu) * as_float(up[i]));
        }
      }
    });
  });
  return out;
}

// Neox rotation of `heads` heads of one token in place of `out` (src may alias out):
// out[i] = x[i] cos[i] - x[i + h] sin[i], out[i + h] = x[i + h] cos[i] + x[i] sin[i].
template <typename scalar_t>
inline void rotate_heads(const scalar_t* src, scalar_t* out, int64_t heads, int64_t head_dim,
                         const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* x = src + h * head_dim;
    scalar_t* o = out + h * head_dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float lo = as_float(x[i]), hi = as_float(x[i + half]);
      o[i] = from_float<scalar_t>(lo * cos[i] - hi * sin[i]);
      o[i + half] = from_float<scalar_t>(hi * cos[i] + lo * sin[i]);
    }
  }
}

// For a step's fused projection qkv [T, (H + 2 Hkv) * D] (rows of q, k, v): returns q rotated,
// [T, H, D], and stores k rotated and v into their cache slots (slot_mapping [T] int64, -1
// skips; caches [num_blocks, block_size, Hkv, D]). cos_sin_cache [max_position, D] float32
// holds cat(cos, sin) per position.
at::Tensor rotary_store_kv(const at::Tensor& qkv, const at::Tensor& positions,
                           const at::Tensor& cos_sin_cache, const at::Tensor& slot_mapping,
                           at::Tensor key_cache, at::Tensor value_cache, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, width] with unit stride");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == qkv.scalar_type() &&
                  value_cache.scalar_type() == qkv.scalar_type(),
              "qkv and cache dtypes differ");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be contiguous float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous(),
              "positions and slot_mapping must be contiguous int64");
  const int64_t num_tokens = qkv.size(0);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  const int64_t q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "qkv width must be (H + 2 Hkv) * D");
  TORCH_CHECK(cos_sin_cache.size(1) == head_dim, "cos_sin_cache rows must be head_dim long");
  at::Tensor q_out = at::empty({num_tokens, num_heads, head_dim}, qkv.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* table = cos_sin_cache.data_ptr<float>();
  const int64_t row_stride = qkv.stride(0);
  const int64_t half = head_dim / 2;
  dispatch_float_or_bf16(qkv.scalar_type(), "rotary_store_kv", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    scalar_t* q = q_out.data_ptr<scalar_t>();
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, row_grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = src + t * row_stride;
        const float* cos = table + pos[t] * head_dim;
        const float* sin = cos + half;
        rotate_heads(row, q + t * q_size, num_heads, head_dim, cos, sin);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        rotate_heads(row + q_size, kc + slot * kv_size, num_kv_heads, head_dim, cos, sin);
        std::copy(row + q_size + kv_size, row + q_size + 2 * kv_size, vc + slot * kv_size);
      }
    });
  });
  return q_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_store_kv(Tensor qkv, Tensor positions, Tensor cos_sin_cache, Tensor slot_mapping, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, int num_heads) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary_store_kv", c10::DispatchKey::CPU, &rotary_store_kv);
}
