// The bf16 panel matmul on AMX tiles, for CPUs that have them (Intel Xeon from Sapphire Rapids).
//
// A bf16 panel ([in / 2][32][2], see panel_matmul.cpp) is already the layout an AMX B tile
// wants: 16 rows of input pairs x 16 features, 64 bytes a row, one row every 128 bytes of the
// panel; the panel's other 16 features are the same rows 64 bytes further on. A tile of x is 16
// rows of 32 inputs read in place. So one TDPBF16PS multiplies 16 rows x 32 inputs x 16
// features, the work of 32 vdpbf16ps, and a step over 32 inputs of a panel runs 2 or 4 of them
// (one or two row tiles of x against its two halves) into 4 accumulator tiles of 16 x 16 fp32.
//
// Threads split the panels; a thread's panels go in groups that fit in L2, and each pair of row
// tiles of x passes over a whole group before the next pair starts, so that the pair's rows of x
// stay in L1 while the panels stream past them (with the non-temporal hint, so as not to push x
// out).
//
// Measured on a 2-core Xeon over SmolLM2-135M's 30 layers (ms per pass, these tiles against
// oneDNN's AMX GEMM on its own packed weights): 10.3 / 12.3 at 1 row, 10.4 / 13.0 at 16, 11.2 /
// 14.8 at 32, 16.1 / 19.0 at 64; the AVX-512 panels lose to oneDNN from 16 rows on. At 2,048
// rows the two are even for inputs of 576 (3.1 TFLOP/s), and oneDNN leads by 10% for 1,536.
// Inputs must come in whole steps of 32 (every model we serve has hidden and intermediate
// sizes that are multiples of 32); other shapes take the AVX-512 tiles.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#define INFERQ_PANEL_AMX 1

namespace inferq_cpu {

constexpr int64_t kAmxRows = 16;    // rows of x per tile
constexpr int64_t kAmxInputs = 32;  // inputs per tile step (16 pairs)
constexpr int64_t kAmxPanelGroupBytes = 512 << 10;  // a thread's panels per group (in L2)

// Linux hands out AMX's 8 KiB of tile state per process only when asked for it.
inline bool amx_usable() {
  static const bool usable = [] {
    constexpr long kArchRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;                    // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kArchRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// Tiles 0-3 accumulate (row tile r, panel half h) in tile 2r + h, 4 and 5 hold the row tiles of
// x, 6 and 7 the panel's halves; all 16 rows x 64 bytes.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  AmxTileConfig() {
    for (int t = 0; t < 8; ++t) {
      bytes_per_row[t] = 64;
      rows[t] = kAmxRows;
    }
  }
};

// c [16 * R][32] fp32 = R row tiles of x (rows of `x_stride` bytes) @ a panel of `pairs` input
// pairs (a multiple of 16). Spread over its steps, the tile also requests `prefetch_lines`
// 64-byte lines from `prefetch` into L2 (the panel read next, or none).
template <int R>
inline void amx_panel_tile(const at::BFloat16* x0, const at::BFloat16* x1, int64_t x_stride,
                           const uint32_t* panel, int64_t pairs, float* c, const char* prefetch,
                           int64_t prefetch_lines) {
  constexpr int64_t kPanelRowBytes = 32 * sizeof(uint32_t);
  constexpr int64_t kCRowBytes = 32 * sizeof(float);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t steps = pairs / (kAmxInputs / 2);
  const int64_t lines_per_step = (prefetch_lines + steps - 1) / steps;
  for (int64_t pair = 0, line = 0; pair < pairs; pair += kAmxInputs / 2) {
    for (const int64_t end = std::min(prefetch_lines, line + lines_per_step); line < end; ++line) {
      _mm_prefetch(prefetch + 64 * line, _MM_HINT_T1);
    }
    // The panel with the non-temporal hint: the pair's rows of x are what the next panels read
    // again (see amx_panel_range).
    _tile_stream_loadd(6, panel + pair * 32, kPanelRowBytes);
    _tile_stream_loadd(7, panel + pair * 32 + 16, kPanelRowBytes);
    _tile_loadd(4, x0 + 2 * pair, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, x1 + 2 * pair, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, kCRowBytes);
  _tile_stored(1, c + 16, kCRowBytes);
  if constexpr (R == 2) {
    _tile_stored(2, c + kAmxRows * 32, kCRowBytes);
    _tile_stored(3, c + kAmxRows * 32 + 16, kCRowBytes);
  }
}

// x [M, K] in row tiles of 16: the full ones read in place, a last partial one from a copy
// padded with zero rows (a tile always loads 16 rows).
class AmxRowTiles {
 public:
  AmxRowTiles(const at::BFloat16* x, int64_t M, int64_t K)
      : x_(x), K_(K), count_((M + kAmxRows - 1) / kAmxRows), full_(M / kAmxRows) {
    if (full_ < count_) {
      padded_.assign(kAmxRows * K, at::BFloat16(0.f));
      std::memcpy(padded_.data(), x + full_ * kAmxRows * K,
                  (M - full_ * kAmxRows) * K * sizeof(at::BFloat16));
    }
  }
  int64_t count() const { return count_; }
  const at::BFloat16* tile(int64_t t) const {
    return t < full_ ? x_ + t * kAmxRows * K_ : padded_.data();
  }

 private:
  const at::BFloat16* x_;
  int64_t K_, count_, full_;
  std::vector<at::BFloat16> padded_;
};

// Panels [first, last) of out [M, ldo] from x's row tiles, each panel's 32 x 16R results handed
// to store_rows(c, first_row, rows, panel) as fp32 [rows][32].
template <typename StoreRows>
void amx_panel_range(const AmxRowTiles& tiles, int64_t M, int64_t K, const uint32_t* panels,
                     int64_t first, int64_t last, StoreRows&& store_rows) {
  static const AmxTileConfig config;
  _tile_loadconfig(&config);
  alignas(64) float c[2 * kAmxRows * 32];
  const int64_t pairs = K / 2;
  const int64_t x_stride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t panel_lines = pairs * 32 * static_cast<int64_t>(sizeof(uint32_t)) / 64;
  // The thread's panels go in groups that fit in L2 with room to spare; every pair of row tiles
  // passes over a group before the next pair does, so that the pair's rows of x stay in L1
  // while the group's panels come from L2 (from memory, for the first pair).
  const int64_t group = std::max<int64_t>(1, kAmxPanelGroupBytes / (panel_lines * 64));
  for (int64_t g = first; g < last; g += group) {
    const int64_t g_end = std::min(last, g + group);
    for (int64_t t = 0; t < tiles.count(); t += 2) {
      const bool two = t + 1 < tiles.count();
      for (int64_t p = g; p < g_end; ++p) {
        const uint32_t* panel = panels + p * pairs * 32;
        // The first pass over a panel fetches the next one, so that memory stays busy.
        const char* next = reinterpret_cast<const char*>(panel + pairs * 32);
        const int64_t lines = t == 0 && p + 1 < last ? panel_lines : 0;
        if (two) {
          amx_panel_tile<2>(tiles.tile(t), tiles.tile(t + 1), x_stride, panel, pairs, c, next,
                            lines);
        } else {
          amx_panel_tile<1>(tiles.tile(t), nullptr, x_stride, panel, pairs, c, next, lines);
        }
        const int64_t row = t * kAmxRows;
        store_rows(c, row, std::min<int64_t>(M - row, (two ? 2 : 1) * kAmxRows), p);
      }
    }
  }
  _tile_release();
}

}  // namespace inferq_cpu

#endif
