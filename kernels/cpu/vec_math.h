// Vector math in AVX-512 registers, for the kernels' inner loops.
#pragma once

#if defined(__AVX512F__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace inferq_cpu {

// 16 values widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The bits of x rounded to bf16 (to nearest, ties to even, as from_float in bf16.h) in the
// upper halves of the lanes, lower halves zero.
inline __m512i bf16_rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_and_si512(sum, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// x rounded to bf16, as 16 bf16 values.
inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);  // one instruction, same rounding
#else
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16));
#endif
}

// x as the dtype holds it: unchanged for float32, rounded to bf16 (and widened back).
inline __m512 as_stored(__m512 x, float) { return x; }
inline __m512 as_stored(__m512 x, c10::BFloat16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
}

// exp(x) for 16 floats in registers, within 2 ulp: 2^n * e^r with n = round(x / ln 2) and
// |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (the next term is below 2^-27 there). For
// loops where a call to the C library's vector exp would cost more than the work around it: a
// matmul tile's epilogue, a softmax over a few vectors.
// Below -87 (e^x under float's smallest normal) it returns 0, so a masked score of -inf
// weighs nothing.
inline __m512 exp512(__m512 x) {
  const __mmask16 representable = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);       // ln 2, the rest
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(representable, p, n);
}

// silu(g) = g / (1 + e^-g). The reciprocal is rcp14's estimate refined by one Newton step
// (relative error ~2^-28): a vector division alone costs more than the rest of the function.
inline __m512 silu512(__m512 g) {
  const __m512 exp_minus_g = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), exp_minus_g);
  const __m512 estimate = _mm512_rcp14_ps(denominator);
  const __m512 reciprocal = _mm512_mul_ps(
      estimate, _mm512_fnmadd_ps(denominator, estimate, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(g, reciprocal);
}

}  // namespace inferq_cpu

#endif
