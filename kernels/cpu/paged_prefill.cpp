// Paged attention for prefill chunks on the CPU: every chunk of a step (several query tokens of
// one sequence, after any context it has cached) in one call, causal, reading K/V straight from
// the cache blocks through each chunk's block table.
//
// A work item is one tile of a chunk's queries against one KV head: kRows rows, each a (query,
// query head of that KV head's group) pair, padded with unused rows. Its context (every key up
// to the tile's last query) is widened to fp32 once into contiguous rows, then two register-
// blocked passes run over it: scores for 4 keys x kRows rows at a time (16 accumulators of 16
// lanes), softmax down each row, and the weighted sum for a few rows' whole heads at a time.
// All arithmetic is fp32, whatever the cache's dtype. Items are handed out one at a time to the
// threads, since their costs differ (later tiles see longer contexts). Under a sliding window of
// W tokens a query sees only the last W positions (itself included): an item's context starts
// at its first query's earliest key, and keys too old for a later query are masked for it.
// With a soft cap c > 0 (Gemma 2) each scaled score s becomes c * tanh(s / c). With attention
// sinks (gpt-oss) each head's sink logit is one more term of its softmax (max and denominator).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "paged_context.h"
#include "vec_math.h"

namespace {

using inferq_cpu::as_float;
using inferq_cpu::from_float;
using inferq_cpu::ContextRows;

constexpr int64_t kRows = 64;    // rows of one work item: 4 vectors of 16 lanes
constexpr int64_t kBlocked = 4;  // keys (scores) or output dims (weighted sum) per register block

struct Item {
  int64_t chunk, kv_head, first_query, num_queries;
};

struct Workspace {
  std::vector<float> q;       // [D][kRows] scaled queries, transposed
  std::vector<float> keys;    // [context][D]
  std::vector<float> values;  // [context][D]
  std::vector<float> scores;  // [context][kRows], then the softmax numerators
};

// dst[t][d] = src row t, widened to fp32, for the item's `len` keys.
template <typename scalar_t>
void widen_rows(const ContextRows<scalar_t>& rows, const scalar_t* cache, int64_t head_dim,
                float* dst) {
  rows.visit(cache, [&](const scalar_t* row, int64_t t) {
    float* out = dst + t * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) out[d] = as_float(row[d]);
  });
}

// Output row r = sum_t p[t][r] v[t] / sums[r] for the item's used rows, written straight to
// the output. With the head size fixed at compile time, a few rows' whole heads stay in
// registers (4 x 64 or 2 x 128 floats: 16 accumulators) while the keys stream past, and every
// output row leaves in full-width stores.
template <typename scalar_t, int64_t kHeadDim, typename RowOf>
void weighted_sum(const Workspace& ws, int64_t head_dim, int64_t len, int64_t rows_used,
                  const float* sums, RowOf&& row_of) {
  if constexpr (kHeadDim == 0) {
    std::vector<float> acc(head_dim);
    for (int64_t r = 0; r < rows_used; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float p = ws.scores[t * kRows + r];
        const float* v = ws.values.data() + t * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * v[d];
      }
      scalar_t* dst = row_of(r);
      const float inv_sum = 1.f / sums[r];
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<scalar_t>(acc[d] * inv_sum);
    }
  } else {
    constexpr int64_t kRowBlock = kHeadDim >= 128 ? 2 : 4;
    for (int64_t r0 = 0; r0 < rows_used; r0 += kRowBlock) {
      float acc[kRowBlock][kHeadDim] = {};
      for (int64_t t = 0; t < len; ++t) {
        const float* p = ws.scores.data() + t * kRows + r0;
        const float* v = ws.values.data() + t * kHeadDim;
#pragma GCC unroll 4
        for (int64_t i = 0; i < kRowBlock; ++i) {
          const float pi = p[i];
#pragma omp simd
          for (int64_t d = 0; d < kHeadDim; ++d) acc[i][d] += pi * v[d];
        }
      }
      for (int64_t i = 0; i < kRowBlock && r0 + i < rows_used; ++i) {
        scalar_t* dst = row_of(r0 + i);
        const float inv_sum = 1.f / sums[r0 + i];
#pragma omp simd
        for (int64_t d = 0; d < kHeadDim; ++d) dst[d] = from_float<scalar_t>(acc[i][d] * inv_sum);
      }
    }
  }
}

// scores[t][r] = exp(scores[t][r] - top[r]) for the `len` keys, summed over t into sums[r].
inline void exponentiate(float* scores, int64_t len, const float* top, float* sums) {
#ifdef __AVX512F__
  // kRows scores per key are a few vectors: the C library's vector exp costs a call per vector.
  constexpr int64_t kVectors = kRows / 16;
  __m512 top_v[kVectors], sum_v[kVectors];
  for (int64_t j = 0; j < kVectors; ++j) {
    top_v[j] = _mm512_loadu_ps(top + 16 * j);
    sum_v[j] = _mm512_loadu_ps(sums + 16 * j);
  }
  for (int64_t t = 0; t < len; ++t) {
    float* row = scores + t * kRows;
#pragma GCC unroll 4
    for (int64_t j = 0; j < kVectors; ++j) {
      const __m512 e = inferq_cpu::exp512(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * j), top_v[j]));
      _mm512_storeu_ps(row + 16 * j, e);
      sum_v[j] = _mm512_add_ps(sum_v[j], e);
    }
  }
  for (int64_t j = 0; j < kVectors; ++j) _mm512_storeu_ps(sums + 16 * j, sum_v[j]);
#else
  for (int64_t t = 0; t < len; ++t) {
    float* row = scores + t * kRows;
#pragma omp simd
    for (int64_t r = 0; r < kRows; ++r) {
      row[r] = std::exp(row[r] - top[r]);
      sums[r] += row[r];
    }
  }
#endif
}

template <typename scalar_t, int64_t kHeadDim>
void attend_item(const Item& item, Workspace& ws, at::Tensor& out, const at::Tensor& query,
                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const int32_t* tables, int64_t table_width, const int32_t* starts,
                 const int32_t* query_lens, const int32_t* seq_lens, float scale,
                 int64_t window, float softcap, const float* sinks) {
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t rows_used = item.num_queries * group;
  // Query i of the chunk sits at position cached + i and sees keys 0..cached + i.
  const int64_t cached = seq_lens[item.chunk] - query_lens[item.chunk];
  const int64_t first_pos = cached + item.first_query;
  const int64_t end = first_pos + item.num_queries;
  const int64_t begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t len = end - begin;  // keys read; key t of the workspace is token begin + t
  const int64_t first_row = starts[item.chunk] + item.first_query;

  ws.q.assign(head_dim * kRows, 0.f);
  const scalar_t* q = query.data_ptr<scalar_t>();
  for (int64_t r = 0; r < rows_used; ++r) {
    const scalar_t* src = q + ((first_row + r / group) * num_heads +
                               item.kv_head * group + r % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) ws.q[d * kRows + r] = as_float(src[d]) * scale;
  }
  const int64_t padded = (len + kBlocked - 1) / kBlocked * kBlocked;
  ws.keys.resize(padded * head_dim);  // zero keys fill the scores pass's last group of 4
  ws.values.resize(len * head_dim);
  ws.scores.resize(padded * kRows);
  std::fill(ws.keys.begin() + len * head_dim, ws.keys.end(), 0.f);
  const ContextRows<scalar_t> rows{tables + item.chunk * table_width, end, block_size,
                                   block_size * token_stride, token_stride,
                                   item.kv_head * head_dim, head_dim, begin};
  widen_rows(rows, key_cache.data_ptr<scalar_t>(), head_dim, ws.keys.data());
  widen_rows(rows, value_cache.data_ptr<scalar_t>(), head_dim, ws.values.data());

  // scores[t][r] = q_r . k_t, four keys at a time.
  const float* qt = ws.q.data();
  for (int64_t t0 = 0; t0 < padded; t0 += kBlocked) {
    float acc[kBlocked][kRows] = {};
    const float* k = ws.keys.data() + t0 * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float* qd = qt + d * kRows;
#pragma GCC unroll 4
      for (int64_t b = 0; b < kBlocked; ++b) {
        const float kd = k[b * head_dim + d];
#pragma omp simd
        for (int64_t r = 0; r < kRows; ++r) acc[b][r] += qd[r] * kd;
      }
    }
    for (int64_t b = 0; b < kBlocked; ++b) {
      float* dst = ws.scores.data() + (t0 + b) * kRows;
#pragma omp simd
      for (int64_t r = 0; r < kRows; ++r) dst[r] = acc[b][r];
    }
  }
  if (softcap > 0.f) {
    const float inv = 1.f / softcap;
    for (int64_t i = 0; i < len * kRows; ++i) {
      ws.scores[i] = softcap * std::tanh(ws.scores[i] * inv);
    }
  }
  // Causal: row r (query first_pos + r / group) sees keys up to its own position, so token
  // p is hidden from the rows of the tile's first p - first_pos queries.
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  for (int64_t p = first_pos + 1; p < end; ++p) {
    float* row = ws.scores.data() + (p - begin) * kRows;
    std::fill(row, row + (p - first_pos) * group, kMasked);
  }
  // Window: token p is hidden from the queries at positions p + window on.
  if (window > 0) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first_hidden = (p + window - first_pos) * group;
      if (first_hidden >= rows_used) break;
      float* row = ws.scores.data() + (p - begin) * kRows;
      std::fill(row + first_hidden, row + rows_used, kMasked);
    }
  }

  float top[kRows], sums[kRows];
  std::fill(top, top + kRows, kMasked);
  std::fill(sums, sums + kRows, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const float* row = ws.scores.data() + t * kRows;
#pragma omp simd
    for (int64_t r = 0; r < kRows; ++r) top[r] = std::max(top[r], row[r]);
  }
  if (sinks != nullptr) {
    for (int64_t r = 0; r < rows_used; ++r) {
      top[r] = std::max(top[r], sinks[item.kv_head * group + r % group]);
    }
  }
  exponentiate(ws.scores.data(), len, top, sums);
  if (sinks != nullptr) {
    for (int64_t r = 0; r < rows_used; ++r) {
      sums[r] += std::exp(sinks[item.kv_head * group + r % group] - top[r]);
    }
  }

  weighted_sum<scalar_t, kHeadDim>(ws, head_dim, len, rows_used, sums, [&](int64_t r) {
    return out.data_ptr<scalar_t>() +
           ((first_row + r / group) * num_heads + item.kv_head * group + r % group) * head_dim;
  });
}

template <typename scalar_t, int64_t kHeadDim>
void paged_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& starts, const at::Tensor& query_lens,
                   const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                   const float* sinks) {
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = query.size(1) / num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, kRows / group);
  const int32_t* lens = query_lens.data_ptr<int32_t>();
  std::vector<Item> items;
  for (int64_t c = 0; c < starts.size(0); ++c) {
    for (int64_t first = 0; first < lens[c]; first += tile) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        items.push_back(Item{c, h, first, std::min(tile, lens[c] - first)});
      }
    }
  }
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Workspace ws;
    for (int64_t i = next++; i < num_items; i = next++) {
      attend_item<scalar_t, kHeadDim>(items[i], ws, out, query, key_cache, value_cache,
                                      block_tables.data_ptr<int32_t>(), block_tables.size(1),
                                      starts.data_ptr<int32_t>(), lens,
                                      seq_lens.data_ptr<int32_t>(), static_cast<float>(scale),
                                      window, static_cast<float>(softcap), sinks);
    }
  });
}

// out [T, H, D] rows of every prefill chunk = causal softmax(q k^T * scale) v, for query
// [T, H, D] whose chunk c holds rows starts[c] .. starts[c] + query_lens[c] and ends its
// sequence at seq_lens[c] tokens, all in the cache (key/value_cache [num_blocks, block_size,
// Hkv, D], block_tables [C, W] int32). Rows of no chunk are left as they are. window > 0: each
// query sees only the last `window` positions up to its own. sinks: [H] float32 sink logits,
// one more term of each head's softmax denominator.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& starts, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  for (const at::Tensor* t : {&block_tables, &starts, &query_lens, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "block_tables, starts, query_lens and seq_lens must be contiguous int32");
  }
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_prefill_attention supports float32 and bfloat16");
  const float* sink_logits = inferq_cpu::sink_logits(sinks, query.size(1));
  inferq_cpu::with_head_dim(query.size(2), [&](auto head_dim) {
    if (query.scalar_type() == at::kFloat) {
      paged_prefill<float, head_dim>(out, query, key_cache, value_cache, block_tables, starts,
                                     query_lens, seq_lens, scale, window, softcap, sink_logits);
    } else {
      paged_prefill<c10::BFloat16, head_dim>(out, query, key_cache, value_cache, block_tables,
                                             starts, query_lens, seq_lens, scale, window,
                                             softcap, sink_logits);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor starts, Tensor query_lens, "
      "Tensor seq_lens, float scale, int window=0, float softcap=0, Tensor? sinks=None) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}
