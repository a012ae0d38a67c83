// Paged attention for decode steps on the CPU: one query token per sequence, attending over its
// context read straight from the KV-cache blocks through its block table (no gathered copy).
//
// The query heads that share a KV head (GQA) are scored together, so every K and V row is read
// from memory once per step. Scores are kept
// for the whole context (at most max_model_len floats per head), then softmaxed and used to
// weight V in a second pass: two sequential sweeps over the blocks, accumulated in float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "paged_context.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INFERQ_DECODE_BF16_DOT 1
#endif

namespace {

using inferq_cpu::as_float;
using inferq_cpu::from_float;
using inferq_cpu::ContextRows;

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

// kHeadDim > 0 fixes the head size at compile time, so the per-row loops over it unroll into a
// few full-width vector instructions (a runtime bound of 64 costs loop set-up per row).
template <typename scalar_t, int64_t kHeadDim>
void paged_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;

  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k_base = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float scale_f = static_cast<float>(scale);

  // A work item is one sequence with all its KV heads, so each token's K and V rows are read
  // as one contiguous run of the cache; with fewer sequences than threads to keep busy, items
  // split a sequence by KV head instead.
  const int64_t splits = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t kv_per_item = num_kv_heads / splits;
  const int64_t q_per_item = kv_per_item * group;

  at::parallel_for(0, num_seqs * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_rows(q_per_item * head_dim);
    std::vector<float> acc(q_per_item * head_dim);
    std::vector<float> scores;
    std::vector<float> inv_sums(q_per_item);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits;
      const int64_t first_kv = (item % splits) * kv_per_item;
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * table_width;
      const scalar_t* q_seq = q + (seq * num_heads + first_kv * group) * head_dim;
      for (int64_t i = 0; i < q_per_item * head_dim; ++i) {
        q_rows[i] = as_float(q_seq[i]) * scale_f;
      }
      scores.resize(q_per_item * len);

      // Rows of this item's KV heads, token by token through the block table.
      const ContextRows<scalar_t> rows{table, len, block_size, block_stride, token_stride,
                                       first_kv * head_dim, kv_per_item * head_dim};
      rows.visit(k_base, [&](const scalar_t* k_token, int64_t t) {
#ifdef INFERQ_DECODE_BF16_DOT
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kHeadDim == 64) {
          for (int64_t h = 0; h < q_per_item; ++h) {
            const scalar_t* k_row = k_token + (h / group) * head_dim;
            scores[h * len + t] = dot64_bf16(q_seq + h * head_dim, k_row) * scale_f;
          }
          return;
        }
#endif
        for (int64_t h = 0; h < q_per_item; ++h) {
          const scalar_t* k_row = k_token + (h / group) * head_dim;
          const float* qh = q_rows.data() + h * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * as_float(k_row[d]);
          scores[h * len + t] = dot;
        }
      });
      for (int64_t h = 0; h < q_per_item; ++h) {
        float* row = scores.data() + h * len;
        const float top = *std::max_element(row, row + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          row[t] = std::exp(row[t] - top);
          sum += row[t];
        }
        inv_sums[h] = 1.f / sum;
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      rows.visit(v_base, [&](const scalar_t* v_token, int64_t t) {
        for (int64_t h = 0; h < q_per_item; ++h) {
          const scalar_t* v_row = v_token + (h / group) * head_dim;
          const float p = scores[h * len + t];
          float* ah = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * as_float(v_row[d]);
        }
      });
      scalar_t* o_seq = o + (seq * num_heads + first_kv * group) * head_dim;
      for (int64_t h = 0; h < q_per_item; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          o_seq[h * head_dim + d] = from_float<scalar_t>(acc[h * head_dim + d] * inv_sums[h]);
        }
      }
    }
  });
}

// out [S, H, D] = softmax(q k^T * scale) v for q [S, H, D] over each sequence's cached context
// (key/value_cache [num_blocks, block_size, Hkv, D], block_tables [S, W] int32, seq_lens [S] int32).
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16");
  inferq_cpu::with_head_dim(query.size(2), [&](auto head_dim) {
    if (query.scalar_type() == at::kFloat) {
      paged_decode<float, head_dim>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                    scale);
    } else {
      paged_decode<c10::BFloat16, head_dim>(out, query, key_cache, value_cache, block_tables,
                                            seq_lens, scale);
    }
  });
}

}  // namespace

TORCH_LIBRARY(inferq_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
