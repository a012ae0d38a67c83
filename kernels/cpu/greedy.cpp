// Greedy sampling's argmax over each row of a step's logits on the CPU, and the argmax of an
// fp32 LM head's logits found from a bf16 screen of them (screened_argmax).
//
// torch's argmax reduces a [rows, vocab] tensor on one thread and, for bf16 logits, after the
// sampler's float32 copy: ~2 ms a step for 64 rows of a 49k vocabulary. Here rows are split
// over the threads, bf16 is widened in registers, and the first of equal maxima wins, as in
// torch. A NaN wins too, as in torch (the first one in the row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// The screened argmax. A decode step's fp32 LM head streams V x K fp32 weights and does 2 V K
// FLOP per row; where the CPU computes bf16 natively, the same matmul in bf16 costs half the
// bytes and half the time. Its logits are not the fp32 ones, but each is within a bound of
// them, so the fp32 argmax is among the few tokens whose screened logit is within twice that
// bound of the row's best; only those get their exact fp32 logit.
//
// The bound, for s~ = bf16(sum bf16(h_i) bf16(w_i)) accumulated in fp32 against any fp32 sum
// of h_i w_i: each rounded product is off by (2u + u^2) |h_i w_i| (u = 2^-8, round to nearest),
// the fp32 sums by gamma_K sum |h_i w_i| each (gamma_K = K 2^-24 / (1 - K 2^-24)), and rounding
// the screened sum to bf16 by u / (1 - u) |s~|; sum |h_i w_i| <= ||h|| ||w|| (Cauchy-Schwarz).
// A safety factor covers the products' rounding inside the bound itself.
constexpr float kScreenSafety = 1.25f;
constexpr float kBf16Unit = 1.0f / 256.0f;
// Products of bf16 denormals may be flushed to zero: an absolute slack far above their size.
constexpr float kScreenAbsolute = 1e-30f;

inline bool is_finite(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// A screened logit s~_v is within per_norm ||w_v|| + per_logit |s~_v| + kScreenAbsolute of
// the fp32 one.
struct ScreenBound {
  float per_norm;   // the products' and sums' share
  float per_logit;  // the final rounding's share
};

ScreenBound screen_bound(float hidden_norm, int64_t K) {
  const double u = kBf16Unit;
  const double k_unit = static_cast<double>(K) * std::ldexp(1.0, -24);
  const double gamma = k_unit / (1.0 - k_unit);
  const double relative = 2.0 * u + u * u + 2.0 * gamma * (1.0 + u) * (1.0 + u);
  return {static_cast<float>(kScreenSafety * relative * hidden_norm),
          static_cast<float>(kScreenSafety * u / (1.0 - u))};
}

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The screen's two passes over a row, 16 tokens at a time: the best lower bound, then every
// token whose upper bound reaches it, into `out` in vocabulary order. False where it cannot
// settle the row: a screened logit not finite, or more than max_candidates candidates.
bool screen_candidates(const c10::BFloat16* approx, const float* norms, int64_t V,
                       const ScreenBound& bound, int64_t max_candidates,
                       std::vector<int32_t>& out) {
  const __m512 per_norm = _mm512_set1_ps(bound.per_norm);
  const __m512 per_logit = _mm512_set1_ps(bound.per_logit);
  const __m512 absolute = _mm512_set1_ps(kScreenAbsolute);
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const auto load = [&](int64_t v, __mmask16 valid, __m512& s, __m512& err) {
    s = load16(approx + v, valid);
    const __m512 n = _mm512_maskz_loadu_ps(valid, norms + v);
    err = _mm512_fmadd_ps(per_norm, n, _mm512_fmadd_ps(per_logit, _mm512_abs_ps(s), absolute));
  };
  __m512 best = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  __mmask16 not_finite = 0;
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 valid = V - v >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (V - v)) - 1);
    __m512 s, err;
    load(v, valid, s, err);
    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(s), exponent);
    not_finite |= _mm512_mask_cmpeq_epi32_mask(valid, bits, exponent);
    best = _mm512_mask_max_ps(best, valid, best, _mm512_sub_ps(s, err));
  }
  if (not_finite) return false;
  const __m512 best_lower = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  out.clear();
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 valid = V - v >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (V - v)) - 1);
    __m512 s, err;
    load(v, valid, s, err);
    uint32_t hits = _mm512_mask_cmp_ps_mask(valid, _mm512_add_ps(s, err), best_lower, _CMP_GE_OQ);
    for (; hits != 0; hits &= hits - 1) {
      if (static_cast<int64_t>(out.size()) == max_candidates) return false;
      out.push_back(static_cast<int32_t>(v + __builtin_ctz(hits)));
    }
  }
  return true;
}
#else
// The screen serves only CPUs with bf16 panels, all of which have AVX-512: elsewhere every row
// is left to the caller's full fp32 head.
bool screen_candidates(const c10::BFloat16*, const float*, int64_t, const ScreenBound&, int64_t,
                       std::vector<int32_t>&) {
  return false;
}
#endif

// The fp32 argmax of row h against weight [V, K], or -1 where the screen cannot settle it (h or
// the screened logits not finite, more than max_candidates candidates).
int64_t screened_row(const c10::BFloat16* approx, const float* h, const float* weight,
                     const float* norms, int64_t V, int64_t K, int64_t max_candidates,
                     std::vector<int32_t>& candidates) {
  double squares = 0.0;
  for (int64_t i = 0; i < K; ++i) squares += static_cast<double>(h[i]) * h[i];
  const float hidden_norm = static_cast<float>(std::sqrt(squares));
  if (!is_finite(hidden_norm)) return -1;
  if (!screen_candidates(approx, norms, V, screen_bound(hidden_norm, K), max_candidates,
                         candidates)) {
    return -1;
  }
  // Candidates are in vocabulary order: a strictly greater logit wins, so ties keep the first.
  int64_t best_at = -1;
  float best = std::numeric_limits<float>::lowest();
  for (const int32_t v : candidates) {
    const float exact = dot(h, weight + static_cast<int64_t>(v) * K, K);
    if (best_at < 0 || exact > best) {
      best = exact;
      best_at = v;
    }
  }
  return best_at;
}

// [rows] int64: the argmax over the first vocab_size columns of hidden [rows, K] @ weight^T
// (fp32), from approx [rows, >= vocab_size] = the same product in bf16 (bf16 inputs, fp32
// accumulation, rounded to bf16) and row_norms [>= vocab_size] = ||weight_v||; -1 for a row the
// screen could not settle, which the caller computes in full.
at::Tensor screened_argmax(const at::Tensor& approx, const at::Tensor& hidden,
                           const at::Tensor& weight, const at::Tensor& row_norms,
                           int64_t vocab_size, int64_t max_candidates) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kBFloat16 &&
                  approx.stride(1) == 1 && approx.size(1) >= vocab_size,
              "approx must be bf16 [rows, >= vocab_size] with contiguous rows");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  hidden.size(0) == approx.size(0),
              "hidden must be contiguous float32 [rows, K] with approx's rows");
  const int64_t K = hidden.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == K && weight.size(0) >= vocab_size,
              "weight must be contiguous float32 [>= vocab_size, K]");
  TORCH_CHECK(row_norms.dim() == 1 && row_norms.scalar_type() == at::kFloat &&
                  row_norms.is_contiguous() && row_norms.size(0) >= vocab_size,
              "row_norms must be contiguous float32 [>= vocab_size]");
  TORCH_CHECK(vocab_size > 0 && max_candidates > 0, "vocab_size and max_candidates must be > 0");
  const int64_t rows = hidden.size(0), stride = approx.stride(0);
  at::Tensor out = at::empty({rows}, hidden.options().dtype(at::kLong));
  int64_t* picked = out.data_ptr<int64_t>();
  const auto* approx_data = approx.data_ptr<c10::BFloat16>();
  const float* h = hidden.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* norms = row_norms.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> candidates;
    candidates.reserve(static_cast<size_t>(std::min<int64_t>(max_candidates, 1024)));
    for (int64_t r = begin; r < end; ++r) {
      picked[r] = screened_row(approx_data + r * stride, h + r * K, w, norms, vocab_size, K,
                               max_candidates, candidates);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.def(
      "screened_argmax(Tensor approx, Tensor hidden, Tensor weight, Tensor row_norms, "
      "int vocab_size, int max_candidates) -> Tensor");
  m.impl("screened_argmax", c10::DispatchKey::CPU, &screened_argmax);
}
