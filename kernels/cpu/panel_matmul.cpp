// Dense fp32 matmul out = x @ W^T (+ bias) over a weight packed once into column panels.
//
// Panel p holds output features [16p, 16p + 16) as [in][16] floats (zero rows past out), so for
// each input the micro-kernel reads 64 contiguous bytes of weight and keeps a tile of 6 rows x 16
// outputs in 12 AVX2 registers: per input, 2 weight loads and 6 broadcasts of x feed 12 FMAs,
// which keeps both FMA pipes busy (the register shape BLIS uses on AVX2 cores). On the 2-core
// machines we measured, oneDNN's and MKL's fp32 GEMMs reach this rate only for prefill-sized
// calls; at decode batches of 8-64 rows they stall on their own blocking, while this tile runs at
// the same rate from 24 rows up. The start-up measurement (engine/layers/matmul_tuning.py) decides
// per machine whether it is used.
//
// Threads split the panels. Inside a thread the inputs go in slices of kDepth, so that a panel's
// slice (16 KiB) stays in L1 while every row of a block of x passes over it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INFERQ_PANEL_GEMM 1
#endif

namespace {

constexpr int64_t kPanel = 16;     // output features per panel (two AVX2 registers)
constexpr int64_t kTileRows = 6;   // rows of x per micro-kernel call
constexpr int64_t kDepth = 256;    // inputs per pass over a panel
constexpr int64_t kRowBlock = 1 << 20;  // rows of x per pass: blocking rows measured no gain

#ifdef INFERQ_PANEL_GEMM

// out[R, 16] (row stride ldo) = or += x[R, depth] (row stride ldx) @ w[depth, 16], where the
// first pass over the inputs starts from `init` (the bias, or zero when null).
template <int R>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t depth, float* out,
                 int64_t ldo, bool accumulate, const float* init) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (accumulate) {
      lo[r] = _mm256_loadu_ps(out + r * ldo);
      hi[r] = _mm256_loadu_ps(out + r * ldo + 8);
    } else if (init != nullptr) {
      lo[r] = _mm256_loadu_ps(init);
      hi[r] = _mm256_loadu_ps(init + 8);
    } else {
      lo[r] = _mm256_setzero_ps();
      hi[r] = _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    const __m256 w_lo = _mm256_loadu_ps(w + k * kPanel);
    const __m256 w_hi = _mm256_loadu_ps(w + k * kPanel + 8);
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, lo[r]);
    _mm256_storeu_ps(out + r * ldo + 8, hi[r]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool,
                        const float*);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>,
                                         tile<4>,  tile<5>, tile<6>};

// Panels [first, last) of out [M, ldo] from x [M, K].
void panel_range(const float* x, int64_t M, int64_t K, const float* panels, const float* bias,
                 float* out, int64_t ldo, int64_t first, int64_t last) {
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, K - k0);
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t block_end = std::min(M, m0 + kRowBlock);
      for (int64_t p = first; p < last; ++p) {
        const float* w = panels + (p * K + k0) * kPanel;
        const float* init = bias == nullptr ? nullptr : bias + p * kPanel;
        for (int64_t m = m0; m < block_end; m += kTileRows) {
          const int64_t rows = std::min(kTileRows, block_end - m);
          kTiles[rows](x + m * K + k0, K, w, depth, out + m * ldo + p * kPanel, ldo, k0 > 0,
                       init);
        }
      }
    }
  }
}

#endif

bool panel_matmul_supported() {
#ifdef INFERQ_PANEL_GEMM
  return true;
#else
  return false;
#endif
}

// x [..., K] fp32; panels [ceil(N / 16), K, 16] fp32 (kernels.cpu_ops.pack_panels); bias [N].
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(panel_matmul_supported(), "panel_linear needs a CPU with AVX2 and FMA");
  const int64_t K = x.size(-1);
  const int64_t N = out_features;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel_linear computes in float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == num_panels && panels.size(1) == K &&
                  panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be contiguous [", num_panels, ", ", K, ", ", kPanel, "] for ", N,
              " outputs of ", K, " inputs");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->numel() == N && bias->scalar_type() == at::kFloat),
              "bias must be float32 [", N, "]");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  // A last, partial panel is computed into padded rows and cut to N afterwards.
  const int64_t padded = num_panels * kPanel;
  at::Tensor out = at::empty({M, padded}, x.options());
  if (M == 0) return out.narrow(1, 0, N).reshape(out_shape);
  at::Tensor padded_bias;
  if (has_bias) {
    padded_bias = bias->contiguous();
    if (padded != N) padded_bias = at::constant_pad_nd(padded_bias, {0, padded - N});
  }
#ifdef INFERQ_PANEL_GEMM
  const float* x_data = x2.data_ptr<float>();
  const float* w_data = panels.data_ptr<float>();
  const float* b_data = has_bias ? padded_bias.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
    panel_range(x_data, M, K, w_data, b_data, out_data, padded, first, last);
  });
#endif
  if (padded != N) out = out.narrow(1, 0, N).contiguous();
  return out.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def("panel_matmul_supported() -> bool", &panel_matmul_supported);
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
}
