// Vector math in AVX-512 registers, for the kernels' inner loops.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace inferq_cpu {

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

}  // namespace inferq_cpu

#endif
