// Matmuls out = x @ W^T (+ bias) for the CPU linear layers, with W quantized (int8, int4) or
// dense (fp32, bf16), x fp32 or bf16 [rows, in].
//
// Decode-sized calls (a few rows) are bound by how fast the weight streams from memory, so the
// small-row path reads each weight row once per call: a tile of output rows is dequantized
// 32 inputs at a time into registers and multiplied into every row of x (a few x rows at a time,
// held in L1), accumulating in fp32. Nothing quantizes the activations, so the result is
// x @ dequantize(W)^T up to float summation order, as the fp32 reference model computes it.
//
// Prefill-sized calls are bound by arithmetic instead: there a tile of output rows is
// dequantized to fp32 and handed to at::addmm (MKL / oneDNN), so a quantized prefill costs about
// what an fp32 one does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "onednn_linear.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INFERQ_AVX2 1
// AVX-512 halves the instructions of the one-row (decode) path, which is bound by converting
// codes to floats rather than by memory; the multi-row tiles keep AVX2's register layout.
#if defined(__AVX512F__)
#define INFERQ_AVX512 1
#endif
#endif

namespace {

constexpr int64_t kBlock = 32;  // inputs every weight source yields at a time
// Above this many rows of x a small-row call dequantizes each tile of 4 output rows once into an
// L1 buffer instead of again for every 4 rows of x.
constexpr int64_t kBufferedMinRows = 8;
// Weight rows are short (a few hundred bytes), too short for the hardware prefetcher to run ahead
// of 4 interleaved row streams, so each block of a row also requests the same block of the row
// kPrefetchRows further on (two tiles of 4 rows ahead, about 1-2 KiB, a memory latency's worth
// at ~10 GB/s per core). Prefetches never fault, so reading past the last row is harmless.
constexpr int64_t kPrefetchRows = 8;

inline void prefetch(const void* address) { __builtin_prefetch(address, 0, 3); }

inline float half_to_float(at::Half h) {
#ifdef INFERQ_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

#ifdef INFERQ_AVX2
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 broadcast_half(const at::Half* h) {
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h->x)));
}
#endif

#ifdef INFERQ_AVX512
inline __m512 broadcast_half512(const at::Half* h) {
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h->x)));
}
#endif

// Weight sources: row n's inputs k..k+31 (k a multiple of 32, in group g) as fp32 (load32).
// Quantized ones (kScaled) also give the raw codes q as fp32 (raw32) and each group's scale, so a
// one-row tile sums q * x over a group and scales once per group, and the 4-bit minimum's share,
// sum over groups of min * (sum of x over the group), is added once per row (min_dot): two
// multiply-adds per 8 weights fewer than dequantizing every weight.
template <bool kPrefetch>
struct F32RowsOf {
  static constexpr bool kScaled = false;
  const float* data;
  int64_t stride;
  inline void prefetch_ahead(int64_t n, int64_t k) const {
    if constexpr (kPrefetch) {
      const float* p = data + (n + kPrefetchRows) * stride + k;
      prefetch(p);
      prefetch(p + 16);
    }
  }
#ifdef INFERQ_AVX2
  inline void load32(int64_t n, int64_t k, int64_t, __m256 w[4]) const {
    const float* p = data + n * stride + k;
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps(p + 8 * j);
  }
#endif
#ifdef INFERQ_AVX512
  inline void load32(int64_t n, int64_t k, int64_t, __m512 w[2]) const {
    const float* p = data + n * stride + k;
    w[0] = _mm512_loadu_ps(p);
    w[1] = _mm512_loadu_ps(p + 16);
  }
#endif
  inline void scalar32(int64_t n, int64_t k, int64_t, float* w) const {
    std::memcpy(w, data + n * stride + k, kBlock * sizeof(float));
  }
};
using F32Rows = F32RowsOf<true>;     // a weight streaming from memory
using BufferRows = F32RowsOf<false>;  // a tile dequantized into L1

struct BF16Rows {
  static constexpr bool kScaled = false;
  const uint16_t* data;
  int64_t stride;
  inline void prefetch_ahead(int64_t n, int64_t k) const {
    prefetch(data + (n + kPrefetchRows) * stride + k);
  }
#ifdef INFERQ_AVX2
  inline void load32(int64_t n, int64_t k, int64_t, __m256 w[4]) const {
    const uint16_t* p = data + n * stride + k;
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * j));
      w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
  }
#endif
#ifdef INFERQ_AVX512
  inline void load32(int64_t n, int64_t k, int64_t, __m512 w[2]) const {
    const uint16_t* p = data + n * stride + k;
    for (int j = 0; j < 2; ++j) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * j));
      w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
  }
#endif
  inline void scalar32(int64_t n, int64_t k, int64_t, float* w) const {
    const uint16_t* p = data + n * stride + k;
    for (int i = 0; i < kBlock; ++i) {
      const uint32_t bits = uint32_t(p[i]) << 16;
      std::memcpy(w + i, &bits, sizeof(float));
    }
  }
};

// 8 bits: weight = q * scale.
struct Int8Rows {
  static constexpr bool kScaled = true;
  const int8_t* data;
  const at::Half* scales;
  int64_t stride, groups;
  inline void prefetch_ahead(int64_t n, int64_t k) const {
    prefetch(data + (n + kPrefetchRows) * stride + k);
    if (k == 0) prefetch(scales + (n + kPrefetchRows) * groups);
  }
#ifdef INFERQ_AVX2
  inline void raw32(int64_t n, int64_t k, __m256 w[4]) const {
    const int8_t* p = data + n * stride + k;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j));
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
  }
  inline __m256 group_scale(int64_t n, int64_t g) const {
    return broadcast_half(scales + n * groups + g);
  }
  inline float min_dot(int64_t, const float*) const { return 0.f; }
  inline void load32(int64_t n, int64_t k, int64_t g, __m256 w[4]) const {
    const __m256 scale = group_scale(n, g);
    raw32(n, k, w);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(w[j], scale);
  }
#endif
#ifdef INFERQ_AVX512
  inline void raw32(int64_t n, int64_t k, __m512 w[2]) const {
    const int8_t* p = data + n * stride + k;
    for (int j = 0; j < 2; ++j) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j));
      w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    }
  }
  inline __m512 group_scale512(int64_t n, int64_t g) const {
    return broadcast_half512(scales + n * groups + g);
  }
#endif
  inline void scalar32(int64_t n, int64_t k, int64_t g, float* w) const {
    const float scale = half_to_float(scales[n * groups + g]);
    const int8_t* p = data + n * stride + k;
    for (int i = 0; i < kBlock; ++i) w[i] = float(p[i]) * scale;
  }
};

// 4 bits, GGUF block order: 16 bytes per 32 inputs, low nibbles inputs 0..15, high nibbles
// 16..31; weight = q * scale + min.
struct Int4Rows {
  static constexpr bool kScaled = true;
  const uint8_t* data;
  const at::Half* scales;
  const at::Half* mins;
  int64_t stride, groups;
  inline void prefetch_ahead(int64_t n, int64_t k) const {
    prefetch(data + (n + kPrefetchRows) * stride + k / 2);
    if (k == 0) {
      prefetch(scales + (n + kPrefetchRows) * groups);
      prefetch(mins + (n + kPrefetchRows) * groups);
    }
  }
#ifdef INFERQ_AVX2
  // Zero-extending 8 bytes to 32-bit lanes leaves each byte's low nibble (inputs j..j+7) under
  // a mask and its high nibble (inputs j+16..j+23) a shift away.
  inline void raw32(int64_t n, int64_t k, __m256 w[4]) const {
    const uint8_t* p = data + n * stride + k / 2;
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i second =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, nibble));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, nibble));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
  }
  inline __m256 group_scale(int64_t n, int64_t g) const {
    return broadcast_half(scales + n * groups + g);
  }
  // sum over groups of min[n, g] * xsum[g]
  inline float min_dot(int64_t n, const float* xsum) const {
    const at::Half* row = mins + n * groups;
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g)));
      acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + g), acc);
    }
    float sum = horizontal_sum(acc);
    for (; g < groups; ++g) sum += half_to_float(row[g]) * xsum[g];
    return sum;
  }
  inline void load32(int64_t n, int64_t k, int64_t g, __m256 w[4]) const {
    const __m256 scale = group_scale(n, g);
    const __m256 low = broadcast_half(mins + n * groups + g);
    raw32(n, k, w);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(w[j], scale, low);
  }
#endif
#ifdef INFERQ_AVX512
  // The block's 16 bytes widen to 16 lanes: low nibbles are inputs 0..15, high ones 16..31.
  inline void raw32(int64_t n, int64_t k, __m512 w[2]) const {
    const uint8_t* p = data + n * stride + k / 2;
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
  inline __m512 group_scale512(int64_t n, int64_t g) const {
    return broadcast_half512(scales + n * groups + g);
  }
#endif
  inline void scalar32(int64_t n, int64_t k, int64_t g, float* w) const {
    const float scale = half_to_float(scales[n * groups + g]);
    const float low = half_to_float(mins[n * groups + g]);
    const uint8_t* p = data + n * stride + k / 2;
    for (int i = 0; i < kBlock / 2; ++i) {
      w[i] = float(p[i] & 0x0F) * scale + low;
      w[i + kBlock / 2] = float(p[i] >> 4) * scale + low;
    }
  }
};

// Where one call's output goes: out[m * out_stride + n] (+ bias[n]), x rows of K floats.
struct Problem {
  const float* x;
  int64_t rows, K, group_size;
  const float* xsum;  // [rows, K / group_size] sums of x over each group (4-bit weights only)
  const float* bias;
  float* out;
  int64_t out_stride;
  // [rows, 3 * 2 * K] x split into three bfloat16 parts in the 4-bit dot-product order (see
  // split_rows_bf16); nullptr where the bfloat16 path does not run.
  const uint16_t* x_bf16 = nullptr;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INFERQ_AVX512_BF16 1
// 4-bit codes against one row of x with bfloat16 dot products (vdpbf16ps: 32 products a
// instruction, against 16 for an fp32 FMA, and no int-to-float conversion of the codes): a
// table lookup turns each code into the bfloat16 of its value exactly, and x is split into three
// bfloat16 parts whose sum is x to 24 bits, so the result is x's fp32 product up to summation
// order. Per 64 inputs: one widening load, two lookups, one shift, six dot products; the fp32
// path spends fourteen instructions on the same 64.
constexpr int64_t kPairInputs = 64;  // two 32-input blocks: one 512-bit vector of 16-bit codes

// bfloat16 lanes of a 512-bit vector (low or high 16) back to fp32, exactly.
inline __m512 widen_bf16(__m512bh v, int upper) {
  const __m512i bits = (__m512i)v;
  const __m256i half = upper ? _mm512_extracti64x4_epi64(bits, 1) : _mm512_castsi512_si256(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// x row [K] -> for each 64 inputs, the parts (hi, mid, lo) of the low-nibble inputs (block 0
// inputs 0..15, block 1 inputs 0..15) then of the high-nibble ones (16..31 of each block), each
// part 32 bfloat16: 6 * 32 values per 64 inputs. hi + mid + lo == x to fp32's 24 bits.
void split_rows_bf16(const float* x, int64_t rows, int64_t K, uint16_t* out) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * K;
    uint16_t* dst = out + m * 6 * K;
    for (int64_t k = 0; k < K; k += kPairInputs, dst += 6 * 32) {
      for (int half = 0; half < 2; ++half) {
        __m512 first = _mm512_loadu_ps(row + k + half * 16);
        __m512 second = _mm512_loadu_ps(row + k + 32 + half * 16);
        uint16_t* parts = dst + half * 3 * 32;
        for (int part = 0; part < 3; ++part) {
          const __m512bh rounded = _mm512_cvtne2ps_pbh(second, first);  // lanes: first, second
          _mm512_storeu_si512(parts + part * 32, (__m512i)rounded);
          first = _mm512_sub_ps(first, widen_bf16(rounded, 0));
          second = _mm512_sub_ps(second, widen_bf16(rounded, 1));
        }
      }
    }
  }
}
#endif

#ifdef INFERQ_AVX2

// out rows m0..m0+MR, columns n_out..n_out+NR <- x rows . source rows n_src..n_src+NR. With few
// One accumulator per (row, column) pair: with 4 or more pairs the FMA latency chains overlap,
// and more accumulators would spill to the stack.
template <int NR, int MR, class Source>
inline void tile(const Source& source, int64_t n_src, int64_t n_out, int64_t m0, const Problem& p) {
  __m256 acc[NR][MR];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) acc[i][m] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  int64_t group = 0, in_group = 0;
  for (int64_t k = 0; k < p.K; k += kBlock) {
    // Fully unrolled (the compiler's size heuristics would stop short), so every accumulator
    // stays in a register instead of an array on the stack.
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      source.prefetch_ahead(n_src + i, k);
      __m256 w[4];
      source.load32(n_src + i, k, group, w);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const float* xk = x + m * p.K + k;
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          acc[i][m] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xk + 8 * j), acc[i][m]);
        }
      }
    }
    in_group += kBlock;
    if (in_group == p.group_size) {
      in_group = 0;
      ++group;
    }
  }
  for (int i = 0; i < NR; ++i) {
    const float b = p.bias ? p.bias[n_out + i] : 0.f;
    for (int m = 0; m < MR; ++m) {
      p.out[(m0 + m) * p.out_stride + n_out + i] = horizontal_sum(acc[i][m]) + b;
    }
  }
}

// One row of x (decode's common case) against NR source rows: for quantized sources the codes
// multiply x as they are and each group's sum is scaled once (see the sources above).
#ifdef INFERQ_AVX512
template <int NR, class Source>
inline void tile_row(const Source& source, int64_t n_src, int64_t n_out, int64_t m0,
                     const Problem& p) {
  __m512 total[NR], part[NR];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i) total[i] = _mm512_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const int64_t groups = p.K / p.group_size;
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) part[i] = _mm512_setzero_ps();
    for (int64_t k = g * p.group_size; k < (g + 1) * p.group_size; k += kBlock) {
      const __m512 x0 = _mm512_loadu_ps(x + k);
      const __m512 x1 = _mm512_loadu_ps(x + k + 16);
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) {
        source.prefetch_ahead(n_src + i, k);
        __m512 w[2];
        if constexpr (Source::kScaled) {
          source.raw32(n_src + i, k, w);
        } else {
          source.load32(n_src + i, k, g, w);
        }
        part[i] = _mm512_fmadd_ps(w[0], x0, part[i]);
        part[i] = _mm512_fmadd_ps(w[1], x1, part[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      if constexpr (Source::kScaled) {
        total[i] = _mm512_fmadd_ps(source.group_scale512(n_src + i, g), part[i], total[i]);
      } else {
        total[i] = _mm512_add_ps(total[i], part[i]);
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    float value = _mm512_reduce_add_ps(total[i]) + (p.bias ? p.bias[n_out + i] : 0.f);
    if constexpr (Source::kScaled) value += source.min_dot(n_src + i, p.xsum + m0 * groups);
    p.out[m0 * p.out_stride + n_out + i] = value;
  }
}
#else
template <int NR, class Source>
inline void tile_row(const Source& source, int64_t n_src, int64_t n_out, int64_t m0,
                     const Problem& p) {
  __m256 total[NR], part[NR];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i) total[i] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const int64_t groups = p.K / p.group_size;
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) part[i] = _mm256_setzero_ps();
    for (int64_t k = g * p.group_size; k < (g + 1) * p.group_size; k += kBlock) {
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        source.prefetch_ahead(n_src + i, k);
        __m256 w[4];
        if constexpr (Source::kScaled) {
          source.raw32(n_src + i, k, w);
        } else {
          source.load32(n_src + i, k, g, w);
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          part[i] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + k + 8 * j), part[i]);
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      if constexpr (Source::kScaled) {
        total[i] = _mm256_fmadd_ps(source.group_scale(n_src + i, g), part[i], total[i]);
      } else {
        total[i] = _mm256_add_ps(total[i], part[i]);
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    float value = horizontal_sum(total[i]) + (p.bias ? p.bias[n_out + i] : 0.f);
    if constexpr (Source::kScaled) value += source.min_dot(n_src + i, p.xsum + m0 * groups);
    p.out[m0 * p.out_stride + n_out + i] = value;
  }
}
#endif  // INFERQ_AVX512
#else
// Portable fallback: the same tiling, one 32-input block of weights at a time through a buffer.
template <int NR, int MR, class Source>
inline void tile(const Source& source, int64_t n_src, int64_t n_out, int64_t m0, const Problem& p) {
  float acc[NR][MR] = {};
  const float* x = p.x + m0 * p.K;
  float w[kBlock];
  int64_t group = 0, in_group = 0;
  for (int64_t k = 0; k < p.K; k += kBlock) {
    for (int i = 0; i < NR; ++i) {
      source.prefetch_ahead(n_src + i, k);
      source.scalar32(n_src + i, k, group, w);
      for (int m = 0; m < MR; ++m) {
        const float* xk = x + m * p.K + k;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j < kBlock; ++j) dot += w[j] * xk[j];
        acc[i][m] += dot;
      }
    }
    in_group += kBlock;
    if (in_group == p.group_size) {
      in_group = 0;
      ++group;
    }
  }
  for (int i = 0; i < NR; ++i) {
    const float b = p.bias ? p.bias[n_out + i] : 0.f;
    for (int m = 0; m < MR; ++m) p.out[(m0 + m) * p.out_stride + n_out + i] = acc[i][m] + b;
  }
}
#endif

#ifdef INFERQ_AVX512_BF16
// One row of x against NR rows of 4-bit codes through bfloat16 dot products (see
// split_rows_bf16). Each 64 inputs: the codes of two blocks widen to 16-bit lanes, a lookup
// makes them bfloat16 values, and six dot products with x's parts sum them into 16 fp32 lanes,
// lanes 0..7 from the first block and 8..15 from the second, which its group's scale then
// weighs. The minimum's share is added at the end from x's exact group sums, as the fp32 path does.
template <int NR>
inline void tile_row_int4_bf16(const Int4Rows& source, int64_t n_src, int64_t n_out, int64_t m0,
                               const Problem& p) {
  // bfloat16 of 0..15, twice over: a lookup reads the low 5 bits of each 16-bit lane.
  alignas(64) static constexpr uint16_t kCodeValues[32] = {
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kCodeValues);
  __m512 total[NR];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i) total[i] = _mm512_setzero_ps();
  const uint16_t* xb = p.x_bf16 + m0 * 6 * p.K;
  for (int64_t k = 0; k < p.K; k += kPairInputs, xb += 6 * 32) {
    __m512bh xs[6];
#pragma GCC unroll 6
    for (int j = 0; j < 6; ++j) xs[j] = (__m512bh)_mm512_loadu_si512(xb + 32 * j);
    const int64_t g0 = k / p.group_size, g1 = (k + kBlock) / p.group_size;
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const int64_t n = n_src + i;
      source.prefetch_ahead(n, k);
      const uint8_t* codes = source.data + n * source.stride + k / 2;
      const __m512i words =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
      const __m512bh low = (__m512bh)_mm512_permutexvar_epi16(words, table);
      const __m512bh high = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
      __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), low, xs[0]);
      part = _mm512_dpbf16_ps(part, low, xs[1]);
      part = _mm512_dpbf16_ps(part, low, xs[2]);
      part = _mm512_dpbf16_ps(part, high, xs[3]);
      part = _mm512_dpbf16_ps(part, high, xs[4]);
      part = _mm512_dpbf16_ps(part, high, xs[5]);
      const at::Half* scales = source.scales + n * source.groups;
      const __m256i halves = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_set1_epi16(static_cast<short>(scales[g0].x))),
          _mm_set1_epi16(static_cast<short>(scales[g1].x)), 1);
      total[i] = _mm512_fmadd_ps(part, _mm512_cvtph_ps(halves), total[i]);
    }
  }
  const int64_t groups = p.K / p.group_size;
  for (int i = 0; i < NR; ++i) {
    float value = _mm512_reduce_add_ps(total[i]) + (p.bias ? p.bias[n_out + i] : 0.f);
    value += source.min_dot(n_src + i, p.xsum + m0 * groups);
    p.out[m0 * p.out_stride + n_out + i] = value;
  }
}
#endif

template <int NR, class Source>
inline void row_tile(const Source& source, int64_t n_src, int64_t n_out, int64_t m0,
                     const Problem& p) {
#ifdef INFERQ_AVX512_BF16
  if constexpr (std::is_same_v<Source, Int4Rows>) {
    if (p.x_bf16 != nullptr) {
      tile_row_int4_bf16<NR>(source, n_src, n_out, m0, p);
      return;
    }
  }
#endif
#ifdef INFERQ_AVX2
  tile_row<NR>(source, n_src, n_out, m0, p);
#else
  tile<NR, 1>(source, n_src, n_out, m0, p);
#endif
}

// Output columns n_out..n_out+count (count <= 4) for every row of x, from source rows n_src...
// Register budget (16 AVX2 vectors): 4 weight vectors plus at most 8 accumulators.
template <class Source>
void column_quad(const Source& source, int64_t n_src, int64_t n_out, int64_t count,
                 const Problem& p) {
  for (int64_t m0 = 0; m0 < p.rows; m0 += 4) {
    const int64_t mr = std::min<int64_t>(4, p.rows - m0);
    if (count == 4) {
      switch (mr) {
        case 1: row_tile<4>(source, n_src, n_out, m0, p); break;
        case 2: tile<4, 2>(source, n_src, n_out, m0, p); break;
        case 3:
          tile<2, 3>(source, n_src, n_out, m0, p);
          tile<2, 3>(source, n_src + 2, n_out + 2, m0, p);
          break;
        default:
          tile<2, 4>(source, n_src, n_out, m0, p);
          tile<2, 4>(source, n_src + 2, n_out + 2, m0, p);
      }
      continue;
    }
    for (int64_t i = 0; i < count; ++i) {
      switch (mr) {
        case 1: row_tile<1>(source, n_src + i, n_out + i, m0, p); break;
        case 2: tile<1, 2>(source, n_src + i, n_out + i, m0, p); break;
        case 3: tile<1, 3>(source, n_src + i, n_out + i, m0, p); break;
        default: tile<1, 4>(source, n_src + i, n_out + i, m0, p);
      }
    }
  }
}

template <class Source>
void dequantize_rows(const Source& source, int64_t n0, int64_t count, int64_t K,
                     int64_t group_size, float* dst) {
  for (int64_t i = 0; i < count; ++i) {
    int64_t group = 0, in_group = 0;
    float* row = dst + i * K;
    for (int64_t k = 0; k < K; k += kBlock) {
      source.prefetch_ahead(n0 + i, k);
#ifdef INFERQ_AVX2
      __m256 w[4];
      source.load32(n0 + i, k, group, w);
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(row + k + 8 * j, w[j]);
#else
      source.scalar32(n0 + i, k, group, row + k);
#endif
      in_group += kBlock;
      if (in_group == group_size) {
        in_group = 0;
        ++group;
      }
    }
  }
}

// The small-row path: output columns in quads, split across threads.
template <class Source>
void small_rows(const Source& source, int64_t N, const Problem& p, bool buffered) {
  const int64_t quads = (N + 3) / 4;
  at::parallel_for(0, quads, 1, [&](int64_t q0, int64_t q1) {
    std::vector<float> buffer(buffered ? 4 * p.K : 0);
    const BufferRows buffer_rows{buffer.data(), p.K};
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t n0 = 4 * q;
      const int64_t count = std::min<int64_t>(4, N - n0);
      if (buffered) {
        dequantize_rows(source, n0, count, p.K, p.group_size, buffer.data());
        column_quad(buffer_rows, 0, n0, count, p);
      } else {
        column_quad(source, n0, n0, count, p);
      }
    }
  });
}

// The large-row path: tiles of output rows dequantized to fp32, then a GEMM into out's columns
// (out [rows, N] fp32): at::addmm in place through a strided view, or oneDNN's (onednn_gemm),
// which on some CPUs (AMD's, where torch's fp32 GEMM is MKL's) runs several times faster; the
// engine measures which at start-up (engine.platforms.cpu.matmul_tuning).
template <class Source>
void large_rows(const Source& source, int64_t N, const at::Tensor& x, const at::Tensor& bias,
                at::Tensor& out, int64_t group_size, bool onednn_gemm) {
  const int64_t K = x.size(1);
  // About 4 MiB of fp32 weights per tile: few enough tiles that the parallel regions (one to
  // dequantize, one GEMM per tile) cost little, small enough to stay in the last-level cache
  // between dequantization and use.
  const int64_t tile_rows = std::max<int64_t>(64, ((1 << 20) / K + 3) / 4 * 4);
  // Kept between calls: a fresh multi-MiB buffer per call is fresh pages from the OS, and their
  // first-touch faults cost as much as a small GEMM.
  static thread_local at::Tensor kept_tiles;
  const int64_t tile_numel = std::min(tile_rows, N) * K;
  if (!kept_tiles.defined() || kept_tiles.numel() < tile_numel) {
    kept_tiles = at::empty({tile_numel}, x.options());
  }
  at::Tensor tile_buffer = kept_tiles.narrow(0, 0, tile_numel).view({std::min(tile_rows, N), K});
  float* tile_data = tile_buffer.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += tile_rows) {
    const int64_t count = std::min(tile_rows, N - n0);
    at::parallel_for(0, count, 16, [&](int64_t r0, int64_t r1) {
      dequantize_rows(source, n0 + r0, r1 - r0, K, group_size, tile_data + r0 * K);
    });
    at::Tensor columns = out.narrow(1, n0, count);
    if (onednn_gemm) {
      columns.copy_(inferq_cpu::onednn_linear(x, tile_buffer.narrow(0, 0, count),
                                  bias.defined() ? bias.narrow(0, n0, count) : at::Tensor()));
      continue;
    }
    at::Tensor weight = tile_buffer.narrow(0, 0, count).t();
    if (bias.defined()) {
      at::addmm_out(columns, bias.narrow(0, n0, count), x, weight);
    } else {
      at::mm_out(columns, x, weight);
    }
  }
}

at::Tensor float_or_undefined(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  return t->to(at::kFloat).contiguous();
}

// Runs `body(x2d_f32, bias_f32, out_f32)` on x flattened to [rows, K], returning x's dtype and
// leading shape with N outputs.
template <class Body>
at::Tensor with_float_io(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias,
                         Body&& body) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t K = x.size(-1);
  at::Tensor x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  at::Tensor b = float_or_undefined(bias);
  if (b.defined()) TORCH_CHECK(b.numel() == N, "bias must have one value per output");
  at::Tensor out = at::empty({x2.size(0), N}, x2.options());
  body(x2, b, out);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.to(x.scalar_type()).reshape(shape);
}

// out = x @ dequantize(W)^T + bias for a quantized weight (see engine.quantization.weights):
// bits 8: data int8 [N, K]; bits 4: data uint8 [N, K/2] in 32-input GGUF blocks, with mins.
// scales (and mins) float16 [N, K / group_size]. Calls with at least gemm_min_rows rows of x
// dequantize tiles and use at::addmm.
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t bits, int64_t group_size,
                        const std::optional<at::Tensor>& bias, int64_t gemm_min_rows,
                        bool onednn_gemm) {
  const int64_t K = x.size(-1);
  const int64_t N = data.size(0);
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "group_size must be a multiple of 32 that divides in_features");
  TORCH_CHECK(data.is_contiguous() && scales.is_contiguous(), "weights must be contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "scales must be float16");
  const int64_t groups = K / group_size;
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == groups, "scales must be [out, in/group]");
  const at::Half* scale_ptr = scales.data_ptr<at::Half>();

  auto run = [&](const auto& source) {
    return with_float_io(x, N, bias, [&](const at::Tensor& x2, const at::Tensor& b, at::Tensor& out) {
      const int64_t rows = x2.size(0);
      if (rows == 0) return;
      if (rows >= gemm_min_rows) {
        large_rows(source, N, x2, b, out, group_size, onednn_gemm);
        return;
      }
      // The 4-bit minimum's share of each output needs x's sum over every group (a plain loop:
      // an aten reduction here costs more in dispatch than the sums themselves).
      std::vector<float> xsum(bits == 4 ? rows * groups : 0);
      const float* x_data = x2.data_ptr<float>();
      for (size_t i = 0; i < xsum.size(); ++i) {
        const float* chunk = x_data + i * group_size;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < group_size; ++j) sum += chunk[j];
        xsum[i] = sum;
      }
      Problem p{x_data, rows, K, group_size, xsum.empty() ? nullptr : xsum.data(),
                b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
#ifdef INFERQ_AVX512_BF16
      std::vector<uint16_t> x_bf16;
      if (bits == 4 && rows == 1 && K % kPairInputs == 0) {
        x_bf16.resize(6 * K);
        split_rows_bf16(x_data, rows, K, x_bf16.data());
        p.x_bf16 = x_bf16.data();
      }
#endif
      small_rows(source, N, p, rows >= kBufferedMinRows);
    });
  };

  if (bits == 8) {
    TORCH_CHECK(data.scalar_type() == at::kChar && data.size(1) == K, "8-bit data must be int8 [out, in]");
    return run(Int8Rows{data.data_ptr<int8_t>(), scale_ptr, K, groups});
  }
  TORCH_CHECK(data.scalar_type() == at::kByte && data.size(1) == K / 2,
              "4-bit data must be uint8 [out, in/2]");
  TORCH_CHECK(mins.has_value() && mins->defined(), "4-bit weights need mins");
  TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                  mins->sizes() == scales.sizes(),
              "mins must be float16 shaped like scales");
  return run(Int4Rows{data.data_ptr<uint8_t>(), scale_ptr, mins->data_ptr<at::Half>(), K / 2, groups});
}

// The fp32 [N, K] weight of a quantized one (for callers that keep a dense copy, and tests).
at::Tensor quant_dequantize(const at::Tensor& data, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, int64_t bits, int64_t group_size) {
  const int64_t N = data.size(0);
  const int64_t K = bits == 4 ? data.size(1) * 2 : data.size(1);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "group_size must be a multiple of 32 that divides in_features");
  TORCH_CHECK(data.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf,
              "weights must be contiguous, scales float16");
  const int64_t groups = K / group_size;
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  auto fill = [&](const auto& source) {
    at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
      dequantize_rows(source, r0, r1 - r0, K, group_size, dst + r0 * K);
    });
  };
  if (bits == 8) {
    TORCH_CHECK(data.scalar_type() == at::kChar, "8-bit data must be int8");
    fill(Int8Rows{data.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), K, groups});
  } else {
    TORCH_CHECK(bits == 4 && data.scalar_type() == at::kByte, "4-bit data must be uint8");
    TORCH_CHECK(mins.has_value() && mins->defined() && mins->scalar_type() == at::kHalf &&
                    mins->is_contiguous(),
                "4-bit weights need float16 mins");
    fill(Int4Rows{data.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                  mins->data_ptr<at::Half>(), K / 2, groups});
  }
  return out;
}

// out = x @ weight^T + bias for a dense fp32 or bf16 weight [N, K], aimed at decode-sized calls;
// in_features not a multiple of 32 falls back to at::linear.
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1);
  const int64_t N = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K, "weight must be [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "weight must be float32 or bfloat16");
  if (K % kBlock != 0 || !weight.is_contiguous()) {
    at::Tensor w = weight.to(x.scalar_type());
    std::optional<at::Tensor> b;
    if (bias.has_value() && bias->defined()) b = bias->to(x.scalar_type());
    return at::linear(x, w, b);
  }
  return with_float_io(x, N, bias, [&](const at::Tensor& x2, const at::Tensor& b, at::Tensor& out) {
    const Problem p{x2.data_ptr<float>(), x2.size(0), K, K, nullptr,
                    b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
    if (p.rows == 0) return;
    if (weight.scalar_type() == at::kFloat) {
      small_rows(F32Rows{weight.data_ptr<float>(), K}, N, p, false);
    } else {
      const auto* bits = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
      small_rows(BF16Rows{bits, K}, N, p, false);
    }
  });
}

}  // namespace

// The crossover's default is kernels/cpu_ops.py's QUANT_GEMM_MIN_ROWS, which the build passes in.
#ifndef INFERQ_QUANT_GEMM_MIN_ROWS
#error "build through kernels.cpu_ops, which defines INFERQ_QUANT_GEMM_MIN_ROWS"
#endif
#define INFERQ_TEXT_OF(value) #value
#define INFERQ_TEXT(value) INFERQ_TEXT_OF(value)

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def(
      "quant_matmul(Tensor x, Tensor data, Tensor scales, Tensor? mins, int bits, int group_size, "
      "Tensor? bias, int gemm_min_rows=" INFERQ_TEXT(INFERQ_QUANT_GEMM_MIN_ROWS) ", "
      "bool onednn_gemm=False) -> Tensor");
  m.impl("quant_matmul", c10::DispatchKey::CPU, &quant_matmul);
  m.def(
      "quant_dequantize(Tensor data, Tensor scales, Tensor? mins, int bits, int group_size) -> "
      "Tensor");
  m.impl("quant_dequantize", c10::DispatchKey::CPU, &quant_dequantize);
  m.def("dense_matmul(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("dense_matmul", c10::DispatchKey::CPU, &dense_matmul);
}
