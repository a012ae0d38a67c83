// Paged attention for decode steps on the CPU: one query token per sequence, attending over its
// context read straight from the KV-cache blocks through its block table (no gathered copy).
//
// The query heads that share a KV head (GQA) are scored together, so every K and V row is read
// from memory once per step. Scores are kept
// for the whole context (at most max_model_len floats per head), then softmaxed and used to
// weight V in a second pass: two sequential sweeps over the blocks, accumulated in float32.
// Under a sliding window of W tokens a query sees only the last W positions of its context
// (itself included): the sweeps start there and never touch the blocks before. With a soft cap
// c > 0 (Gemma 2) each scaled score s becomes c * tanh(s / c) before the softmax. With attention
// sinks (gpt-oss) each head's sink logit joins the softmax's denominator (and its maximum) as
// one more score with no value row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_context.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INFERQ_DECODE_BF16_DOT 1
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"
#define INFERQ_DECODE_AVX512 1
#endif

namespace {

using inferq_cpu::as_float;
using inferq_cpu::from_float;
using inferq_cpu::ContextRows;
using inferq_cpu::prefetch_row;

#ifdef INFERQ_DECODE_BF16_DOT
// q . k over 64 bfloat16 inputs in two vdpbf16ps: the products of two bfloat16 are exact in
// fp32, so this is the widened dot product up to summation order, at a quarter of the
// instructions of widening both rows and multiplying in fp32.
inline float dot64_bf16(const c10::BFloat16* a, const c10::BFloat16* b) {
  const __m512bh a0 = (__m512bh)_mm512_loadu_si512(a), a1 = (__m512bh)_mm512_loadu_si512(a + 32);
  const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32);
  return _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), a0, b0), a1, b1));
}
#endif

// One work item of a decode call: a sequence with the KV heads it covers (all of them, or one
// when there are too few sequences to keep the threads busy), and the thread's scratch.
template <typename scalar_t>
struct DecodeItem {
  const scalar_t* q;                // the item's query rows [q_heads, head_dim]
  ContextRows<scalar_t> context;    // its rows of each cache, through the block table
  const scalar_t* key_cache;
  const scalar_t* value_cache;
  const scalar_t* next_item_keys;  // the thread's next item's first K block (nullptr: none)
  int64_t len, q_heads, group, head_dim, token_stride;  // len: the tokens attended
  float scale;
  float softcap;          // > 0: scores become softcap * tanh(score / softcap)
  const float* sinks;     // [q_heads] the item's heads' sink logits (nullptr: none)
  const float* q_scaled;  // q * scale in float32
  float* scores;          // [q_heads, len]
  float* acc;             // [q_heads, head_dim], zero: softmax(scores) v, unnormalised
  float* inv_sums;        // [q_heads]: 1 / each row's softmax denominator
  c10::BFloat16* probs;   // [q_heads, probs_stride] scratch (bf16 items only)
  int64_t probs_stride;   // len rounded up to 32
};

// Runs attend(item) for every work item of a decode call over the threads, then writes each
// item's output rows acc * inv_sums.
//
// A work item is one sequence with all its KV heads, so each token's K and V rows are read as
// one contiguous run of the cache; with fewer sequences than threads to keep busy, items split
// a sequence by KV head instead.
template <typename scalar_t, typename Attend>
void for_each_decode_item(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, int64_t head_dim, double scale,
                          int64_t window, double softcap, const float* sinks,
                          Attend&& attend) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const int64_t splits = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t kv_per_item = num_kv_heads / splits;
  const int64_t q_per_item = kv_per_item * group;

  const scalar_t* q = query.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float scale_f = static_cast<float>(scale);
  // the first context token a sequence's query sees
  const auto begin_of = [&](int64_t seq) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, lens[seq] - window) : 0;
  };
  const auto attended = [&](int64_t seq) { return lens[seq] - begin_of(seq); };

  const int64_t num_items = num_seqs * splits;
  // Each thread takes one run of items, the runs holding equal shares of the context to read
  // (contexts differ in length, so equal counts of items leave one thread waiting on the other).
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), num_items);
  std::vector<int64_t> part_start(parts + 1, num_items);
  {
    constexpr int64_t kItemCost = 16;  // tokens' worth of fixed work per item
    int64_t total = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) total += splits * (attended(seq) + kItemCost);
    int64_t done = 0;
    for (int64_t item = 0, part = 0; item < num_items; ++item) {
      while (part < parts && done * parts >= total * part) part_start[part++] = item;
      done += attended(item / splits) + kItemCost;
    }
  }
  const scalar_t* k_data = key_cache.data_ptr<scalar_t>();
  const auto item_context = [&](int64_t item) {
    const int64_t seq = item / splits;
    return ContextRows<scalar_t>{tables + seq * table_width, lens[seq], block_size,
                                 block_stride, token_stride, (item % splits) * kv_per_item * head_dim,
                                 kv_per_item * head_dim, begin_of(seq)};
  };

  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> q_scaled(q_per_item * head_dim);
    std::vector<float> acc(q_per_item * head_dim);
    std::vector<float> scores;
    std::vector<float> inv_sums(q_per_item);
    std::vector<c10::BFloat16> probs;
    const int64_t end = part_start[part_end];
    for (int64_t item = part_start[part_begin]; item < end; ++item) {
      const int64_t seq = item / splits;
      const int64_t first_kv = (item % splits) * kv_per_item;
      const int64_t len = attended(seq);
      const int64_t first_row = (seq * num_heads + first_kv * group) * head_dim;
      for (int64_t i = 0; i < q_per_item * head_dim; ++i) {
        q_scaled[i] = as_float(q[first_row + i]) * scale_f;
      }
      scores.resize(q_per_item * len);
      const int64_t probs_stride = (len + 31) / 32 * 32;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        probs.resize(q_per_item * probs_stride);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const scalar_t* next_keys =
          item + 1 < end && lens[(item + 1) / splits] > 0
              ? item_context(item + 1).first_block(k_data)
              : nullptr;
      attend(DecodeItem<scalar_t>{q + first_row, item_context(item), k_data,
                                  value_cache.data_ptr<scalar_t>(), next_keys, len, q_per_item,
                                  group, head_dim, token_stride, scale_f,
                                  static_cast<float>(softcap),
                                  sinks == nullptr ? nullptr : sinks + first_kv * group,
                                  q_scaled.data(),
                                  scores.data(), acc.data(), inv_sums.data(), probs.data(),
                                  probs_stride});
      for (int64_t h = 0; h < q_per_item; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          o[first_row + h * head_dim + d] =
              from_float<scalar_t>(acc[h * head_dim + d] * inv_sums[h]);
        }
      }
    }
  });
}

// scores[i] = softcap * tanh(scores[i] / softcap) for the first n (softcap > 0 only).
inline void cap_scores(float* scores, int64_t n, float softcap) {
  if (softcap <= 0.f) return;
  const float inv = 1.f / softcap;
  for (int64_t i = 0; i < n; ++i) scores[i] = softcap * std::tanh(scores[i] * inv);
}

// kHeadDim > 0 fixes the head size at compile time, so the per-row loops over it unroll into a
// few full-width vector instructions (a runtime bound of 64 costs loop set-up per row).
template <typename scalar_t, int64_t kHeadDim>
void attend_portable(const DecodeItem<scalar_t>& item) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : item.head_dim;
  const int64_t len = item.len, group = item.group;
  item.context.visit(item.key_cache, [&](const scalar_t* k_token, int64_t t) {
#ifdef INFERQ_DECODE_BF16_DOT
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kHeadDim == 64) {
      for (int64_t h = 0; h < item.q_heads; ++h) {
        const scalar_t* k_row = k_token + (h / group) * head_dim;
        item.scores[h * len + t] = dot64_bf16(item.q + h * head_dim, k_row) * item.scale;
      }
      return;
    }
#endif
    for (int64_t h = 0; h < item.q_heads; ++h) {
      const scalar_t* k_row = k_token + (h / group) * head_dim;
      const float* qh = item.q_scaled + h * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * as_float(k_row[d]);
      item.scores[h * len + t] = dot;
    }
  });
  cap_scores(item.scores, item.q_heads * len, item.softcap);
  for (int64_t h = 0; h < item.q_heads; ++h) {
    float* row = item.scores + h * len;
    float top = *std::max_element(row, row + len);
    if (item.sinks != nullptr) top = std::max(top, item.sinks[h]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - top);
      sum += row[t];
    }
    if (item.sinks != nullptr) sum += std::exp(item.sinks[h] - top);
    item.inv_sums[h] = 1.f / sum;
  }
  item.context.visit(item.value_cache, [&](const scalar_t* v_token, int64_t t) {
    for (int64_t h = 0; h < item.q_heads; ++h) {
      const scalar_t* v_row = v_token + (h / group) * head_dim;
      const float p = item.scores[h * len + t];
      float* ah = item.acc + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * as_float(v_row[d]);
    }
  });
}

#ifdef INFERQ_DECODE_AVX512
using inferq_cpu::load16;

// [sum(a), sum(b), sum(c), sum(d)]: four dot products finished together, a few shuffles for
// all four where reducing each vector on its own costs as many per vector.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a, b, c, d] summed over that lane
  const __m512 lanes = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 halves = _mm256_add_ps(
      _mm512_castps512_ps256(lanes),
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

// q . k as a vector of partial sums. With `kDotBf16`, q and k are bfloat16 multiplied by
// vdpbf16ps (exact products, float32 sums); otherwise q is the scaled float32 query and k is
// widened.
template <int64_t kHeadDim, bool kDotBf16, typename scalar_t>
inline __m512 dot_partial(const void* q, const scalar_t* k) {
  __m512 acc = _mm512_setzero_ps();
#ifdef INFERQ_DECODE_BF16_DOT
  if constexpr (kDotBf16) {
    const auto* qb = static_cast<const c10::BFloat16*>(q);
    for (int64_t d = 0; d < kHeadDim; d += 32) {
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qb + d),
                             (__m512bh)_mm512_loadu_si512(k + d));
    }
    return acc;
  }
#endif
  const auto* qf = static_cast<const float*>(q);
  for (int64_t d = 0; d < kHeadDim; d += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16(k + d), acc);
  }
  return acc;
}

// softmax of each of `heads` rows of `len` scores in place (unnormalised: e^(s - max)); the
// reciprocal of each row's sum goes to inv_sums. sinks (nullptr: none): each row's sink logit,
// counted in the maximum and the sum.
inline void softmax_rows(float* scores, int64_t heads, int64_t len, float* inv_sums,
                         const float* sinks) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % 16)) - 1);
  const int64_t full = len - len % 16;
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores + h * len;
    __m512 top = _mm512_set1_ps(std::numeric_limits<float>::lowest());
    for (int64_t t = 0; t < full; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + t));
    if (tail) top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, row + full));
    float row_max = _mm512_reduce_max_ps(top);
    if (sinks != nullptr) row_max = std::max(row_max, sinks[h]);
    const __m512 max = _mm512_set1_ps(row_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < full; t += 16) {
      const __m512 e = inferq_cpu::exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), max));
      _mm512_storeu_ps(row + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e =
          inferq_cpu::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), max));
      _mm512_mask_storeu_ps(row + full, tail, e);
      sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    float total = _mm512_reduce_add_ps(sum);
    if (sinks != nullptr) total += std::exp(sinks[h] - row_max);
    inv_sums[h] = 1.f / total;
  }
}

// The V sweep of the AVX-512 items: for every block, each KV head and each group of its query
// heads that fits in registers, the group's accumulators are loaded into `a`, then
// weigh(a, heads, h0, v_rows, prefetch, first, count) adds the block's weighted V rows for query
// heads h0 .. h0 + heads - 1, and `a` goes back to item.acc. v_rows is the KV head's part of the
// block's first token row; prefetch is the rows of the block read next, for the first group of
// the block to request as it goes (nullptr for the others).
template <int64_t kHeadDim, typename scalar_t, typename Weigh>
void sweep_values(const DecodeItem<scalar_t>& item, Weigh&& weigh) {
  constexpr int64_t kVecs = kHeadDim / 16;
  constexpr int64_t kHeadsInRegisters = 16 / kVecs;  // 16 accumulators
  const int64_t group = item.group, kv_heads = item.q_heads / group;
  item.context.visit_blocks(item.value_cache, [&](const scalar_t* rows, const scalar_t* next,
                                                  int64_t first, int64_t count) {
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      for (int64_t h0 = kv * group; h0 < (kv + 1) * group; h0 += kHeadsInRegisters) {
        const int64_t heads = std::min(kHeadsInRegisters, (kv + 1) * group - h0);
        float* acc = item.acc + h0 * kHeadDim;
        __m512 a[kHeadsInRegisters][kVecs];
        for (int64_t h = 0; h < kHeadsInRegisters; ++h) {
          for (int64_t v = 0; v < kVecs; ++v) {
            a[h][v] = h < heads ? _mm512_loadu_ps(acc + h * kHeadDim + 16 * v)
                                : _mm512_setzero_ps();
          }
        }
        const scalar_t* prefetch = kv == 0 && h0 == 0 ? next : nullptr;
        weigh(a, heads, h0, rows + kv * kHeadDim, prefetch, first, count);
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t v = 0; v < kVecs; ++v) {
            _mm512_storeu_ps(acc + h * kHeadDim + 16 * v, a[h][v]);
          }
        }
      }
    }
  }, item.next_item_keys);
}

#ifdef INFERQ_DECODE_BF16_DOT
// Each of `heads` rows of `len` float scores rounded to bf16, into rows of item.probs_stride
// (zero past len). Tokens t and t + 1 of a row then sit side by side as the 32-bit pair that
// vdpbf16ps multiplies a pair of V rows by; the padding zero pairs an odd last token.
inline void scores_to_bf16(const float* scores, int64_t heads, int64_t len, int64_t stride,
                           c10::BFloat16* probs) {
  const auto mask_below = [](int64_t n) -> __mmask16 {
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
  };
  for (int64_t h = 0; h < heads; ++h) {
    const float* row = scores + h * len;
    for (int64_t t = 0; t < stride; t += 16) {
      inferq_cpu::store16(probs + h * stride + t,
                          _mm512_maskz_loadu_ps(mask_below(len - t), row + t));
    }
  }
}

// acc += softmax weights x V for a bf16 item, two tokens per vdpbf16ps: the V rows of tokens t
// and t + 1 interleaved element by element (one unpack per 32 values) against the broadcast pair
// of their weights rounded to bf16, as SDPA rounds them before its P @ V. Half the multiplies
// of widening V and weighting it in float32, and no widening. Needs an even block size, so
// that every block starts on a pair.
//
// The unpacks interleave within 128-bit lanes, so the accumulators hold a row's dimensions
// permuted (the low unpack covers d = 8l .. 8l + 3 of each lane l, the high one 8l + 4 .. 8l + 7);
// the permutation is undone once, after the last block.
template <int64_t kHeadDim>
void weigh_values_in_pairs(const DecodeItem<c10::BFloat16>& item) {
  constexpr int64_t kVecs = kHeadDim / 16;      // accumulators per head
  constexpr int64_t kRowVecs = kHeadDim / 32;   // vectors per bf16 row
  constexpr int64_t kHeadsInRegisters = 16 / kVecs;
  const int64_t token_stride = item.token_stride;
  const int64_t row_size = item.context.row_size, stride = item.probs_stride;
  scores_to_bf16(item.scores, item.q_heads, item.len, stride, item.probs);

  sweep_values<kHeadDim>(item, [&](auto& a, int64_t heads, int64_t h0,
                                   const c10::BFloat16* v_rows, const c10::BFloat16* prefetch,
                                   int64_t first, int64_t count) {
    for (int64_t i = 0; i < count; i += 2) {
      const bool pair = i + 1 < count;
      if (prefetch != nullptr) {
        prefetch_row(prefetch + i * token_stride, row_size);
        if (pair) prefetch_row(prefetch + (i + 1) * token_stride, row_size);
      }
      const c10::BFloat16* row = v_rows + i * token_stride;
      __m512i low[kRowVecs], high[kRowVecs];
      for (int64_t j = 0; j < kRowVecs; ++j) {
        const __m512i x0 = _mm512_loadu_si512(row + 32 * j);
        const __m512i x1 =
            pair ? _mm512_loadu_si512(row + token_stride + 32 * j) : _mm512_setzero_si512();
        low[j] = _mm512_unpacklo_epi16(x0, x1);
        high[j] = _mm512_unpackhi_epi16(x0, x1);
      }
      for (int64_t h = 0; h < kHeadsInRegisters; ++h) {
        if (h >= heads) break;
        const __m512i p = _mm512_broadcastd_epi32(
            _mm_loadu_si32(item.probs + (h0 + h) * stride + first + i));
        for (int64_t j = 0; j < kRowVecs; ++j) {
          a[h][2 * j] = _mm512_dpbf16_ps(a[h][2 * j], (__m512bh)low[j], (__m512bh)p);
          a[h][2 * j + 1] = _mm512_dpbf16_ps(a[h][2 * j + 1], (__m512bh)high[j], (__m512bh)p);
        }
      }
    }
  });

  const __m512i first_half =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < item.q_heads; ++h) {
    for (int64_t j = 0; j < kRowVecs; ++j) {
      float* dims = item.acc + h * kHeadDim + 32 * j;
      const __m512 low = _mm512_loadu_ps(dims), high = _mm512_loadu_ps(dims + 16);
      _mm512_storeu_ps(dims, _mm512_permutex2var_ps(low, first_half, high));
      _mm512_storeu_ps(dims + 16, _mm512_permutex2var_ps(low, second_half, high));
    }
  }
}
#endif

// The decode work item for head sizes of 64 and 128 in AVX-512 registers, same passes as
// `attend_portable`, reshaped for the vector unit: scores are finished four tokens at a time
// (`sum4`), and the weighted sum of V keeps each group of query heads' accumulators in
// registers over a block of tokens, widening each V row once for all the heads that share it.
template <typename scalar_t, int64_t kHeadDim>
void attend_avx512(const DecodeItem<scalar_t>& item) {
  constexpr int64_t kVecs = kHeadDim / 16;
  constexpr int64_t kHeadsInRegisters = 16 / kVecs;  // 16 accumulators
#ifdef INFERQ_DECODE_BF16_DOT
  constexpr bool kDotBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
#else
  constexpr bool kDotBf16 = false;
#endif
  const int64_t len = item.len, group = item.group, token_stride = item.token_stride;
  const int64_t row_size = item.context.row_size;
  float* scores = item.scores;
  // the query row of head h as dot_partial takes it; bf16 dot products scale afterwards
  const auto query_of = [&](int64_t h) -> const void* {
    if constexpr (kDotBf16) return item.q + h * kHeadDim;
    return item.q_scaled + h * kHeadDim;
  };
  const __m128 after_dot = _mm_set1_ps(kDotBf16 ? item.scale : 1.f);

  item.context.visit_blocks(item.key_cache, [&](const scalar_t* rows, const scalar_t* next,
                                                int64_t first, int64_t count) {
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      if (next != nullptr) {
        for (int64_t j = i; j < i + 4; ++j) prefetch_row(next + j * token_stride, row_size);
      }
      const scalar_t* k0 = rows + i * token_stride;
      for (int64_t h = 0; h < item.q_heads; ++h) {
        const scalar_t* k = k0 + (h / group) * kHeadDim;
        const void* qh = query_of(h);
        const __m128 dots = sum4(dot_partial<kHeadDim, kDotBf16>(qh, k),
                                 dot_partial<kHeadDim, kDotBf16>(qh, k + token_stride),
                                 dot_partial<kHeadDim, kDotBf16>(qh, k + 2 * token_stride),
                                 dot_partial<kHeadDim, kDotBf16>(qh, k + 3 * token_stride));
        _mm_storeu_ps(scores + h * len + first + i, _mm_mul_ps(dots, after_dot));
      }
    }
    for (; i < count; ++i) {
      if (next != nullptr) prefetch_row(next + i * token_stride, row_size);
      for (int64_t h = 0; h < item.q_heads; ++h) {
        const scalar_t* k = rows + i * token_stride + (h / group) * kHeadDim;
        scores[h * len + first + i] =
            _mm512_reduce_add_ps(dot_partial<kHeadDim, kDotBf16>(query_of(h), k)) *
            _mm_cvtss_f32(after_dot);
      }
    }
  }, item.context.first_block(item.value_cache));

  cap_scores(scores, item.q_heads * len, item.softcap);
  softmax_rows(scores, item.q_heads, len, item.inv_sums, item.sinks);

#ifdef INFERQ_DECODE_BF16_DOT
  if constexpr (kDotBf16) {
    if (item.context.block_size % 2 == 0) return weigh_values_in_pairs<kHeadDim>(item);
  }
#endif
  sweep_values<kHeadDim>(item, [&](auto& a, int64_t heads, int64_t h0, const scalar_t* v_rows,
                                   const scalar_t* prefetch, int64_t first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      if (prefetch != nullptr) prefetch_row(prefetch + i * token_stride, row_size);
      const scalar_t* v_row = v_rows + i * token_stride;
      __m512 values[kVecs];
      for (int64_t v = 0; v < kVecs; ++v) values[v] = load16(v_row + 16 * v);
      for (int64_t h = 0; h < kHeadsInRegisters; ++h) {
        if (h >= heads) break;
        const __m512 p = _mm512_set1_ps(scores[(h0 + h) * len + first + i]);
        for (int64_t v = 0; v < kVecs; ++v) a[h][v] = _mm512_fmadd_ps(p, values[v], a[h][v]);
      }
    }
  });
}
#endif

// out [S, H, D] = softmax(q k^T * scale) v for q [S, H, D] over each sequence's cached context
// (key/value_cache [num_blocks, block_size, Hkv, D], block_tables [S, W] int32, seq_lens [S] int32).
// window > 0: each query sees only the last `window` tokens of its context. sinks: [H] float32
// sink logits, one more term of each head's softmax denominator.
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16");
  const float* sink_logits = inferq_cpu::sink_logits(sinks, query.size(1));
  const auto run = [&](auto zero, auto head_dim) {
    using scalar_t = decltype(zero);
    constexpr int64_t kHeadDim = decltype(head_dim)::value;
    const auto attend = [](const DecodeItem<scalar_t>& item) {
#ifdef INFERQ_DECODE_AVX512
      if constexpr (kHeadDim > 0) return attend_avx512<scalar_t, kHeadDim>(item);
#endif
      attend_portable<scalar_t, kHeadDim>(item);
    };
    for_each_decode_item<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                   query.size(2), scale, window, softcap, sink_logits, attend);
  };
  inferq_cpu::with_head_dim(query.size(2), [&](auto head_dim) {
    if (query.scalar_type() == at::kFloat) {
      run(float{}, head_dim);
    } else {
      run(c10::BFloat16{}, head_dim);
    }
  });
}

}  // namespace

TORCH_LIBRARY(inferq_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window=0, float softcap=0, "
      "Tensor? sinks=None) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
