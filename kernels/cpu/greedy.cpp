// Greedy sampling's argmax over each row of a step's logits on the CPU.
//
// torch's argmax reduces a [rows, vocab] tensor on one thread and, for bf16 logits, after the
// sampler's float32 copy: ~2 ms a step for 64 rows of a 49k vocabulary. Here rows are split
// over the threads, bf16 is widened in registers, and the first of equal maxima wins, as in
// torch. A NaN wins too, as in torch (the first one in the row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

namespace {

using inferq_cpu::as_float;

// NaN by its bits: the kernels build with -ffast-math, under which float tests for NaN may be
// folded away.
inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

template <typename scalar_t>
int64_t first_nan(const scalar_t* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (is_nan(as_float(row[i]))) return i;
  }
  return -1;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(std::numeric_limits<float>::lowest()), m, p);
}
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_mask_mov_ps(_mm512_set1_ps(std::numeric_limits<float>::lowest()), m, wide);
}

template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  __m512 best = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  __m512i best_at = _mm512_setzero_si512();
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf_bits = _mm512_set1_epi32(0x7F800000);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = load16(row + i, valid);
    // strictly greater: each lane keeps its first maximum
    const __mmask16 higher = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, higher, v);
    best_at = _mm512_mask_mov_epi32(best_at, higher, at);
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
    at = _mm512_add_epi32(at, step);
  }
  if (nan) return first_nan(row, n);
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)),
                                           _CMP_EQ_OQ);
  // of the lanes holding the maximum, the earliest position
  return _mm512_mask_reduce_min_epi32(top, best_at);
}
#else
template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  const int64_t nan = first_nan(row, n);
  if (nan >= 0) return nan;
  int64_t best_at = 0;
  float best = as_float(row[0]);
  for (int64_t i = 1; i < n; ++i) {
    const float v = as_float(row[i]);
    if (v > best) {
      best = v;
      best_at = i;
    }
  }
  return best_at;
}
#endif

// [rows] int64: the position of each row's maximum in logits [rows, width] (rows may be a
// wider tensor's leading columns: any row stride, unit column stride).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, width > 0] with contiguous rows");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "rows too wide");
  const int64_t rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* picked = out.data_ptr<int64_t>();
  const auto run = [&](auto* base) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) picked[r] = row_argmax(base + r * stride, width);
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(logits.data_ptr<float>());
  } else if (logits.scalar_type() == at::kBFloat16) {
    run(logits.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "argmax_rows supports float32 and bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
}
