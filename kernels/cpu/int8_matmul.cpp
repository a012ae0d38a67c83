// x @ W^T with both sides in int8 (W8A8): each row of x quantized on the fly with its own scale.
//
// A call of many rows is bound by arithmetic; oneDNN's integer GEMM (VNNI, AMX) does several
// times the multiply-adds of its fp32 one. Around it, quantizing the rows and scaling the int32
// sums back are one pass each here, where eager torch ops take a dozen passes and allocations.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr float kInv127 = 1.f / 127.f;

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Rows of x -> int8 codes and one scale per row: scale = max|x| * (1/127), code =
// round_half_even(x * (1 / scale)), so the codes stay within -127..127. Multiplying by
// reciprocals (not dividing) is what -ffast-math would make of a division anyway; the torch
// fallback (engine.quantization.matmul) computes the same products, ties included.
template <typename scalar_t>
void quantize_rows(const scalar_t* x, int64_t rows, int64_t K, int8_t* codes, float* scales) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const scalar_t* row = x + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(as_float(row[k])));
      const float scale = std::max(amax, 1e-12f) * kInv127;
      const float inverse = 1.f / scale;
      scales[m] = scale;
      int8_t* out = codes + m * K;
      for (int64_t k = 0; k < K; ++k) {
        out[k] = static_cast<int8_t>(std::nearbyint(as_float(row[k]) * inverse));
      }
    }
  });
}

// out = int8(x) @ weight^T scaled back, + bias; weight int8 [N, K], weight_scales [N] (or
// [N, 1]) float16, one per output channel. Returns x's dtype and leading shape.
at::Tensor w8a8_matmul(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "weight must be int8 [out, in]");
  const int64_t K = x.size(-1);
  const int64_t N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must have x's in_features columns");
  TORCH_CHECK(weight_scales.numel() == N, "one weight scale per output channel");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t rows = x2.size(0);
  at::Tensor codes = at::empty({rows, K}, x.options().dtype(at::kChar));
  std::vector<float> row_scales(rows);
  if (x2.scalar_type() == at::kFloat) {
    quantize_rows(x2.data_ptr<float>(), rows, K, codes.data_ptr<int8_t>(), row_scales.data());
  } else {
    quantize_rows(x2.data_ptr<c10::BFloat16>(), rows, K, codes.data_ptr<int8_t>(),
                  row_scales.data());
  }
  const at::Tensor sums = at::_int_mm(codes, weight.t()).contiguous();
  const at::Tensor column_scales = weight_scales.reshape({N}).to(at::kFloat).contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have one value per output");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({rows, N}, x.options().dtype(at::kFloat));
  const int32_t* acc = sums.data_ptr<int32_t>();
  const float* cs = column_scales.data_ptr<float>();
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / N), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float rs = row_scales[m];
      for (int64_t n = 0; n < N; ++n) {
        float v = static_cast<float>(acc[m * N + n]) * rs * cs[n];
        if (b) v += b[n];
        o[m * N + n] = v;
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.to(x.scalar_type()).reshape(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def("w8a8_matmul(Tensor x, Tensor weight, Tensor weight_scales, Tensor? bias) -> Tensor");
  m.impl("w8a8_matmul", c10::DispatchKey::CPU, &w8a8_matmul);
}
