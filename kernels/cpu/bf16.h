// float <-> bf16 conversions the compiler can vectorize.
//
// c10::BFloat16's own conversions branch on NaN, which keeps loops over them scalar: a SiLU over
// a decode step's bf16 rows ran 10x slower than over fp32 ones. These are plain bit operations,
// exact for bf16 -> float and round-to-nearest-even for float -> bf16 like c10's, for the finite
// values the kernels see.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace inferq_cpu {

inline float as_float(float x) { return x; }

inline float as_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <typename scalar_t>
inline scalar_t from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

}  // namespace inferq_cpu
