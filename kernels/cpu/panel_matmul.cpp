// Dense fp32 matmul out = x @ W^T (+ bias) over a weight packed once into column panels.
//
// Panel p holds output features [16p, 16p + 16) as [in][16] floats (zero rows past out), so for
// each input the micro-kernel reads 64 contiguous bytes of weight and keeps a tile of 6 rows x 16
// outputs in 12 AVX2 registers: per input, 2 weight loads and 6 broadcasts of x feed 12 FMAs,
// which keeps both FMA pipes busy (the register shape BLIS uses on AVX2 cores). On the 2-core
// machines we measured, oneDNN's and MKL's fp32 GEMMs reach this rate only for prefill-sized
// calls; at decode batches of 8-64 rows they stall on their own blocking, while this tile runs at
// the same rate from 24 rows up. The start-up measurement (engine/platforms/cpu/matmul_tuning.py) decides
// per machine whether it is used.
//
// Threads split the panels. Inside a thread the inputs go in slices of kDepth, so that a panel's
// slice (16 KiB) stays in L1 while every row of a block of x passes over it. On CPUs with
// AVX-512 one register holds a panel, and a tile of 8 rows x 2 panels accumulates over all
// inputs in registers instead (tile512).
//
// bf16 (CPUs with AVX512-BF16): a panel holds 32 output features as [in / 2][32][2] bf16, each
// feature's two consecutive inputs side by side, the pairs `vdpbf16ps` multiplies and adds into
// one fp32 lane. A tile of 8 rows x 32 outputs keeps 16 fp32 accumulators in AVX-512 registers
// over all inputs (2 weight loads and 8 broadcast pairs of x feed 16 dot products), then adds the
// bias and rounds to bf16 once, as oneDNN does. Rows go in blocks of kRowBlockBf16 so that a block
// of x stays in L2 while the thread's panels stream past it. On CPUs with AMX the same panels
// feed AMX tiles instead (panel_amx.h).
//
// Gated (an MLP's [gate; up] projection followed by SiLU-and-mul): with the weight's gate and up
// rows interleaved 16 at a time before packing, a tile's two 16-feature halves (the AVX-512 fp32
// tile's two panels, a bf16 panel's two registers) hold the gate and the up of the same 16
// features, so the tile writes silu(gate) * up straight from its accumulators: no [rows, 2 x I]
// output is written and read back, and no separate pass runs over it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "panel_amx.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INFERQ_PANEL_GEMM 1
#endif
#if defined(__AVX512F__)
#define INFERQ_PANEL_GEMM_512 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define INFERQ_PANEL_GEMM_BF16 1
#endif

namespace {

constexpr int64_t kPanel = 16;     // output features per panel (two AVX2 registers)
constexpr int64_t kTileRows = 6;   // rows of x per micro-kernel call
constexpr int64_t kDepth = 256;    // inputs per pass over a panel

#if defined(INFERQ_PANEL_GEMM) && !defined(INFERQ_PANEL_GEMM_512)

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
  // Every row in one pass over a panel: blocking the rows as well measured no gain.
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, K - k0);
    for (int64_t p = first; p < last; ++p) {
      const float* w = panels + (p * K + k0) * kPanel;
      const float* init = bias == nullptr ? nullptr : bias + p * kPanel;
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t rows = std::min(kTileRows, M - m);
        kTiles[rows](x + m * K + k0, K, w, depth, out + m * ldo + p * kPanel, ldo, k0 > 0, init);
      }
    }
  }
}

#endif

// Features per half of a gated tile: gate and up rows are interleaved this many at a time.
constexpr int64_t kGatedGroup = 16;

// Splits rows [first, last) into tiles of at most max_rows, as even as possible (36 rows are
// 12 + 12 + 12, 16 are 8 + 8), and calls tile_fn(first_row, rows) for each.
template <typename TileFn>
inline void for_each_row_tile(int64_t first, int64_t last, int64_t max_rows, TileFn&& tile_fn) {
  const int64_t count = last - first;
  const int64_t tiles = (count + max_rows - 1) / max_rows;
  for (int64_t t = 0, m = first; t < tiles; ++t) {
    const int64_t rows = count / tiles + (t < count % tiles ? 1 : 0);
    tile_fn(m, rows);
    m += rows;
  }
}

// The row tiles over the panels a thread is on also fetch the panels it reads next into L2, each
// tile its share of their lines, so that the first tile over the next panels does not wait on
// memory (measured: decode batches of 36-64 rows ran 15-20% faster in fp32 and bf16).
struct PrefetchShare {
  const char* first;  // the share's first 64-byte line
  int64_t lines;
};

inline PrefetchShare prefetch_share(const void* next, int64_t next_lines, int64_t tile,
                                    int64_t num_tiles) {
  const int64_t from = next_lines * tile / num_tiles;
  return {static_cast<const char*>(next) + 64 * from, next_lines * (tile + 1) / num_tiles - from};
}

#if defined(INFERQ_PANEL_GEMM)
// Two lines of a share per input the tile steps over (a share never holds more than that).
// Always inlined: left to itself, GCC built the tiles without a single prefetch.
[[gnu::always_inline]] inline void prefetch_two_lines(const char* first, int64_t lines, int64_t k) {
  if (2 * k < lines) _mm_prefetch(first + 128 * k, _MM_HINT_T1);
  if (2 * k + 1 < lines) _mm_prefetch(first + 128 * k + 64, _MM_HINT_T1);
}
#endif

#ifdef INFERQ_PANEL_GEMM_512

// With AVX-512 one register holds a whole 16-feature panel: a tile covers 8 rows x 2 panels in
// 16 accumulators over all inputs at once (2 weight loads and 8 broadcasts per 16 FMAs), and the
// rows go in blocks that keep their part of x in L2 while the thread's panels stream past. The
// blocks are as even as possible: every block streams all the thread's weights once more, so a
// decode step of 64 rows must not become 48 + 16 (measured: 15% slower than one block of 64).
// Eight rows, not the twelve that registers allow: on a Zen 4, tiles of 12 rows ran 8-10% below
// tiles of 6-8 at every row count from 36 to 2,048 (197 against 217 GFLOP/s at 2,048 rows, fp32,
// bench/micro/cpu_matmul.py; bf16 401 against 422-444), although both keep the FMA pipes fed on paper.
constexpr int64_t kTileRows512 = 8;
constexpr int64_t kRowBlock512 = 96;

// out[R, 16 * NP] (row stride ldo) = x[R, K] (row stride ldx) @ panels w, w + panel_stride, ...
// + init (the bias, or zero when null).
template <int R, int NP, bool Gated>
inline void tile512(const float* x, int64_t ldx, const float* w, int64_t panel_stride, int64_t K,
                    float* out, int64_t ldo, const float* init, const char* prefetch,
                    int64_t prefetch_lines) {
  __m512 acc[NP][R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      acc[j][r] = init == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(init + j * kPanel);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) wv[j] = _mm512_loadu_ps(w + j * panel_stride + k * kPanel);
    prefetch_two_lines(prefetch, prefetch_lines, k);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[j][r] = _mm512_fmadd_ps(a, wv[j], acc[j][r]);
    }
  }
  if constexpr (Gated) {
    static_assert(NP == 2, "a gated tile holds a gate panel and an up panel");
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(out + r * ldo, _mm512_mul_ps(inferq_cpu::silu512(acc[0][r]), acc[1][r]));
    }
  } else {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) _mm512_storeu_ps(out + r * ldo + j * kPanel, acc[j][r]);
    }
  }
}

template <int NP>
using Tile512Fn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                           const float*, const char*, int64_t);

template <int NP, bool Gated, std::size_t... R>
constexpr std::array<Tile512Fn<NP>, sizeof...(R) + 1> tiles512(std::index_sequence<R...>) {
  return {nullptr, tile512<R + 1, NP, Gated>...};
}

// Panels [first, last) of out [M, ldo] from x [M, K], two panels per tile; gated: the pairs are
// (gate, up) panels, and each writes its 16 features of silu(gate) * up.
template <bool Gated>
void panel_range512(const float* x, int64_t M, int64_t K, const float* panels, const float* bias,
                    float* out, int64_t ldo, int64_t first, int64_t last) {
  static constexpr auto kPairTiles = tiles512<2, Gated>(std::make_index_sequence<kTileRows512>());
  static constexpr auto kSingleTiles =
      tiles512<1, false>(std::make_index_sequence<kTileRows512>());
  constexpr int64_t kPanelsPerOutput = Gated ? 2 : 1;
  const int64_t panel_stride = K * kPanel;
  for_each_row_tile(0, M, kRowBlock512, [&](int64_t m0, int64_t block_rows) {
    const int64_t block_end = m0 + block_rows;
    for (int64_t p = first; p < last; p += 2) {
      const auto& tiles = p + 1 < last ? kPairTiles : kSingleTiles;
      const float* w = panels + p * panel_stride;
      const float* init = bias == nullptr ? nullptr : bias + p * kPanel;
      const int64_t next_lines = std::max<int64_t>(0, std::min<int64_t>(2, last - p - 2)) * K;
      const int64_t num_tiles = (block_rows + kTileRows512 - 1) / kTileRows512;
      int64_t tile = 0;
      for_each_row_tile(m0, block_end, kTileRows512, [&](int64_t m, int64_t rows) {
        const PrefetchShare share =
            prefetch_share(w + 2 * panel_stride, next_lines, tile++, num_tiles);
        tiles[rows](x + m * K, K, w, panel_stride, K,
                    out + m * ldo + p / kPanelsPerOutput * kPanel, ldo, init, share.first,
                    share.lines);
      });
    }
  });
}

#endif

#ifdef INFERQ_PANEL_GEMM_BF16

// x rounded to bf16 (to nearest, ties to even) and widened back to fp32.
inline __m512 round_to_bf16(__m512 x) { return inferq_cpu::as_stored(x, c10::BFloat16{}); }

// One row of a bf16 tile's 32 results (fp32, bias added) into out: 32 bf16, or gated (the first
// 16 the gate, the rest the up of the same features) 16 bf16 of silu(gate) * up.
template <bool Gated>
inline void store_row_bf16(__m512 lo, __m512 hi, at::BFloat16* out) {
  if constexpr (Gated) {
    // Rounded where the unfused ops round: the projection's outputs, the SiLU, the product.
    const __m512 silu = round_to_bf16(inferq_cpu::silu512(round_to_bf16(lo)));
    const __m512 product = _mm512_mul_ps(silu, round_to_bf16(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(product));
  } else {
    auto* row = reinterpret_cast<__m256i*>(out);
    _mm256_storeu_si256(row, (__m256i)_mm512_cvtneps_pbh(lo));
    _mm256_storeu_si256(row + 1, (__m256i)_mm512_cvtneps_pbh(hi));
  }
}

constexpr int64_t kPanelBf16 = 32;     // output features per bf16 panel (two AVX-512 registers)
constexpr int64_t kTileRowsBf16 = 8;   // rows per micro-kernel call (see kTileRows512)
constexpr int64_t kRowBlockBf16 = 96;  // rows of x per pass over the panels (~300 KiB of x)

// out[R, 32] (row stride ldo, bf16) = x[R, 2 * pairs] (row stride ldx pairs) @ w + bias, for a
// panel w [pairs][32] of bf16 pairs (one uint32 each); bias: 32 fp32 or null.
template <int R, bool Gated>
inline void tile_bf16(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t pairs,
                      at::BFloat16* out, int64_t ldo, const float* bias, const char* prefetch,
                      int64_t prefetch_lines) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    lo[r] = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
    hi[r] = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + 16);
  }
  for (int64_t k = 0; k < pairs; ++k) {
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(w + k * kPanelBf16);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(w + k * kPanelBf16 + 16);
    prefetch_two_lines(prefetch, prefetch_lines, k);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      lo[r] = _mm512_dpbf16_ps(lo[r], pair, w_lo);
      hi[r] = _mm512_dpbf16_ps(hi[r], pair, w_hi);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) store_row_bf16<Gated>(lo[r], hi[r], out + r * ldo);
}

using TileBf16Fn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, at::BFloat16*,
                            int64_t, const float*, const char*, int64_t);
template <bool Gated, std::size_t... R>
constexpr std::array<TileBf16Fn, sizeof...(R) + 1> tiles_bf16(std::index_sequence<R...>) {
  return {nullptr, tile_bf16<R + 1, Gated>...};
}

// Panels [first, last) of out [M, ldo] from x [M, 2 * pairs]; gated: each panel holds 16 gate
// and 16 up features, and writes those 16 features of silu(gate) * up.
template <bool Gated>
void panel_range_bf16(const uint32_t* x, int64_t M, int64_t pairs, const uint32_t* panels,
                      const float* bias, at::BFloat16* out, int64_t ldo, int64_t first,
                      int64_t last) {
  static constexpr auto kTilesBf16 = tiles_bf16<Gated>(std::make_index_sequence<kTileRowsBf16>());
  constexpr int64_t kOutputsPerPanel = Gated ? kGatedGroup : kPanelBf16;
  for_each_row_tile(0, M, kRowBlockBf16, [&](int64_t m0, int64_t block_rows) {
    const int64_t block_end = m0 + block_rows;
    for (int64_t p = first; p < last; ++p) {
      const uint32_t* w = panels + p * pairs * kPanelBf16;
      const float* init = bias == nullptr ? nullptr : bias + p * kPanelBf16;
      const int64_t next_lines = p + 1 < last ? 2 * pairs : 0;
      const int64_t num_tiles = (block_rows + kTileRowsBf16 - 1) / kTileRowsBf16;
      int64_t tile = 0;
      for_each_row_tile(m0, block_end, kTileRowsBf16, [&](int64_t m, int64_t rows) {
        const PrefetchShare share =
            prefetch_share(w + pairs * kPanelBf16, next_lines, tile++, num_tiles);
        kTilesBf16[rows](x + m * pairs, pairs, w, pairs, out + m * ldo + p * kOutputsPerPanel,
                         ldo, init, share.first, share.lines);
      });
    }
  });
}

#ifdef INFERQ_PANEL_AMX
// panel_range_bf16 on AMX tiles.
template <bool Gated>
void panel_range_amx(const inferq_cpu::AmxRowTiles& tiles, int64_t M, int64_t K,
                     const uint32_t* panels, const float* bias, at::BFloat16* out, int64_t ldo,
                     int64_t first, int64_t last) {
  constexpr int64_t kOutputsPerPanel = Gated ? kGatedGroup : kPanelBf16;
  inferq_cpu::amx_panel_range(
      tiles, M, K, panels, first, last,
      [&](const float* c, int64_t first_row, int64_t rows, int64_t p) {
        const __m512 bias_lo =
            bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + p * kPanelBf16);
        const __m512 bias_hi =
            bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + p * kPanelBf16 + 16);
        for (int64_t r = 0; r < rows; ++r) {
          store_row_bf16<Gated>(_mm512_add_ps(_mm512_loadu_ps(c + r * 32), bias_lo),
                                _mm512_add_ps(_mm512_loadu_ps(c + r * 32 + 16), bias_hi),
                                out + (first_row + r) * ldo + p * kOutputsPerPanel);
        }
      });
}
#endif

// The bf16 panel matmul of x [M, K] on AMX tiles where the CPU has them, the OS lets this
// process use them and K is whole tile steps; false (nothing done) elsewhere.
bool panel_matmul_amx(const at::Tensor& x, const uint32_t* panels, const float* bias,
                      at::BFloat16* out, int64_t ldo, int64_t num_panels, bool gated) {
#ifdef INFERQ_PANEL_AMX
  const int64_t M = x.size(0), K = x.size(1);
  if (K % inferq_cpu::kAmxInputs != 0 || !inferq_cpu::amx_usable()) return false;
  const inferq_cpu::AmxRowTiles tiles(x.data_ptr<at::BFloat16>(), M, K);
  const auto range = gated ? panel_range_amx<true> : panel_range_amx<false>;
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
    range(tiles, M, K, panels, bias, out, ldo, first, last);
  });
  return true;
#else
  return false;
#endif
}

#endif

bool panel_matmul_supported(c10::ScalarType dtype) {
  if (dtype == at::kFloat) {
#ifdef INFERQ_PANEL_GEMM
    return true;
#endif
  }
  if (dtype == at::kBFloat16) {
#ifdef INFERQ_PANEL_GEMM_BF16
    return true;
#endif
  }
  return false;
}

// The gated tiles are AVX-512 ones: fp32 pairs a gate and an up panel in one tile.
bool panel_gated_supported(c10::ScalarType dtype) {
  if (dtype == at::kFloat) {
#ifdef INFERQ_PANEL_GEMM_512
    return true;
#endif
  }
  return dtype == at::kBFloat16 && panel_matmul_supported(dtype);
}

// Whether bf16 panel matmuls whose inputs come in whole AMX steps run on AMX tiles here.
bool panel_amx_usable() {
#ifdef INFERQ_PANEL_AMX
  return inferq_cpu::amx_usable();
#else
  return false;
#endif
}

int64_t panel_width(c10::ScalarType dtype) { return dtype == at::kBFloat16 ? 32 : 16; }

// x @ W^T (+ bias) for the `packed_features` outputs of a weight W packed into panels; gated: W
// holds gate and up rows interleaved kGatedGroup at a time, and the result is
// silu(gate) * up [..., packed_features / 2].
at::Tensor panel_matmul(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t packed_features,
                        bool gated) {
  const c10::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(panel_matmul_supported(dtype), "panel_linear has no ", dtype,
              " kernel for this CPU (float32 needs AVX2 and FMA, bfloat16 AVX512-BF16)");
  TORCH_CHECK(!gated || panel_gated_supported(dtype), "panel_gated_linear has no ", dtype,
              " kernel for this CPU (it needs AVX-512)");
  TORCH_CHECK(panels.scalar_type() == dtype, "panels must be ", dtype, " like x");
  const int64_t K = x.size(-1);
  const int64_t N = packed_features;
  TORCH_CHECK(!gated || N % (2 * kGatedGroup) == 0, "a gated weight's halves must be multiples",
              " of ", kGatedGroup, " features, got ", N, " features in all");
  const int64_t width = panel_width(dtype);
  const int64_t num_panels = (N + width - 1) / width;
  const bool bf16 = dtype == at::kBFloat16;
  const std::vector<int64_t> panel_shape =
      bf16 ? std::vector<int64_t>{num_panels, (K + 1) / 2, width, 2}
           : std::vector<int64_t>{num_panels, K, width};
  TORCH_CHECK(panels.sizes() == at::IntArrayRef(panel_shape) && panels.is_contiguous(),
              "panels must be contiguous ", at::IntArrayRef(panel_shape), " for ", N,
              " outputs of ", K, " inputs, got ", panels.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || !gated, "a gated panel matmul takes no bias");
  TORCH_CHECK(!has_bias || (bias->numel() == N && bias->scalar_type() == dtype),
              "bias must be ", dtype, " [", N, "]");
  const int64_t out_features = gated ? N / 2 : N;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  // A last, partial panel is computed into padded rows and cut to N afterwards.
  const int64_t padded = gated ? out_features : num_panels * width;
  at::Tensor out = at::empty({M, padded}, x.options());
  if (M == 0) return out.narrow(1, 0, out_features).reshape(out_shape);
  at::Tensor padded_bias;
  if (has_bias) {
    padded_bias = bias->contiguous();
    if (bf16) padded_bias = padded_bias.to(at::kFloat);
    if (padded != N) padded_bias = at::constant_pad_nd(padded_bias, {0, padded - N});
  }
  if (bf16) {
#ifdef INFERQ_PANEL_GEMM_BF16
    if (K % 2 != 0) x2 = at::constant_pad_nd(x2, {0, 1});  // the packed weight's zero input
    const auto* x_data = reinterpret_cast<const uint32_t*>(x2.data_ptr<at::BFloat16>());
    const auto* w_data = reinterpret_cast<const uint32_t*>(panels.data_ptr<at::BFloat16>());
    const float* b_data = has_bias ? padded_bias.data_ptr<float>() : nullptr;
    at::BFloat16* out_data = out.data_ptr<at::BFloat16>();
    const int64_t pairs = (K + 1) / 2;
    if (!panel_matmul_amx(x2, w_data, b_data, out_data, padded, num_panels, gated)) {
      const auto range = gated ? panel_range_bf16<true> : panel_range_bf16<false>;
      at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
        range(x_data, M, pairs, w_data, b_data, out_data, padded, first, last);
      });
    }
#endif
  } else {
#ifdef INFERQ_PANEL_GEMM
    const float* x_data = x2.data_ptr<float>();
    const float* w_data = panels.data_ptr<float>();
    const float* b_data = has_bias ? padded_bias.data_ptr<float>() : nullptr;
    float* out_data = out.data_ptr<float>();
#ifdef INFERQ_PANEL_GEMM_512
    // Threads split pairs of panels, the AVX-512 tile's width.
    const auto range = gated ? panel_range512<true> : panel_range512<false>;
    at::parallel_for(0, (num_panels + 1) / 2, 1, [&](int64_t first, int64_t last) {
      range(x_data, M, K, w_data, b_data, out_data, padded, 2 * first,
            std::min(num_panels, 2 * last));
    });
#else
    at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
      panel_range(x_data, M, K, w_data, b_data, out_data, padded, first, last);
    });
#endif
#endif
  }
  if (padded != out_features) out = out.narrow(1, 0, out_features).contiguous();
  return out.view(out_shape);
}

// x [..., K] fp32 or bf16; panels as kernels.cpu_ops.pack_panels lays them out for x's dtype:
// fp32 [ceil(N / 16), K, 16], bf16 [ceil(N / 32), ceil(K / 2), 32, 2]; bias [N] of x's dtype.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  return panel_matmul(x, panels, bias, out_features, /*gated=*/false);
}

// silu(gate) * up [..., out_features] of x's projection through a [gate; up] weight whose rows
// were interleaved kGatedGroup at a time (gate 0-15, up 0-15, gate 16-31, ...) and then packed
// as for panel_linear.
at::Tensor panel_gated_linear(const at::Tensor& x, const at::Tensor& panels,
                              int64_t out_features) {
  return panel_matmul(x, panels, std::nullopt, 2 * out_features, /*gated=*/true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def("panel_matmul_supported(ScalarType dtype) -> bool", &panel_matmul_supported);
  m.def("panel_gated_supported(ScalarType dtype) -> bool", &panel_gated_supported);
  m.def("panel_amx_usable() -> bool", &panel_amx_usable);
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_gated_linear(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
  m.impl("panel_gated_linear", c10::DispatchKey::CPU, &panel_gated_linear);
}
