// Reading one sequence's K or V rows from the paged KV cache, shared by the attention kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "bf16.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace inferq_cpu {

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * int64_t(sizeof(scalar_t)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, 2);
  }
}

// One sequence's context in a cache tensor: tokens begin .. len - 1 of the `len` spread over
// the blocks of `table` (begin > 0 under a sliding window: the blocks wholly before it are never
// read, so they may be freed). Visitors see tokens numbered from `begin` (t = 0 is token begin).
template <typename scalar_t>
struct ContextRows {
  const int32_t* table;
  int64_t len, block_size, block_stride, token_stride;
  int64_t row_offset;  // where this work item's KV heads start within a token's row
  int64_t row_size;    // how many elements of a token's row this work item reads
  int64_t begin = 0;   // the first token read

  int64_t count() const { return len - begin; }

  // visit(row, t) for every token t in order. Blocks lie anywhere in the cache, beyond the
  // hardware prefetcher's sight, so the next block's rows are requested while this one's are
  // visited: into L2, not L1, since L1 has few slots for misses in flight and a prefetch that
  // finds them all taken stalls the core (measured: L1 prefetches left decode attention at
  // about half the memory bandwidth that L2 prefetches reach).
  template <typename Visit>
  void visit(const scalar_t* cache, Visit&& visit_row) const {
    for (int64_t block = begin / block_size, first = block * block_size; first < len;
         ++block, first += block_size) {
      const scalar_t* rows = cache + table[block] * block_stride + row_offset;
      const int64_t count = std::min(block_size, len - first);
      const bool has_next = first + block_size < len;
      const scalar_t* next = has_next ? cache + table[block + 1] * block_stride + row_offset : rows;
      for (int64_t i = std::max<int64_t>(0, begin - first); i < count; ++i) {
        if (has_next) prefetch_row(next + i * token_stride, row_size);
        visit_row(rows + i * token_stride, first + i - begin);
      }
    }
  }

  // The rows of the context's first block read in `cache`.
  const scalar_t* first_block(const scalar_t* cache) const {
    return cache + table[begin / block_size] * block_stride + row_offset;
  }

  // visit_block(rows, next_rows, first, count) for every block in order: its `count` token
  // rows from `rows` (one every token_stride elements), tokens first .. first + count - 1;
  // `next_rows` is the next block's, for the caller to prefetch row by row as it goes, as
  // `visit` does. For the last block it is `after_last` (nullptr: nothing), the block the
  // caller reads next, so that a sweep does not start on a cold block; its rows past a short
  // last block's `count` are requested here.
  // A first block entered part way (begin inside it) is visited from token begin on.
  template <typename VisitBlock>
  void visit_blocks(const scalar_t* cache, VisitBlock&& visit_block,
                    const scalar_t* after_last = nullptr) const {
    for (int64_t block = begin / block_size, first = block * block_size; first < len;
         ++block, first += block_size) {
      const int64_t skip = std::max<int64_t>(0, begin - first);
      const scalar_t* rows = cache + table[block] * block_stride + row_offset;
      const bool has_next = first + block_size < len;
      const scalar_t* next = has_next ? cache + table[block + 1] * block_stride + row_offset
                                      : after_last;
      const int64_t count = std::min(block_size, len - first);
      visit_block(rows + skip * token_stride, next, first + skip - begin, count - skip);
      if (!has_next && after_last != nullptr) {
        for (int64_t i = count; i < block_size; ++i) {
          prefetch_row(after_last + i * token_stride, row_size);
        }
      }
    }
  }
};

// f(std::integral_constant<int64_t, D>{}) with D the head size where the kernels specialise it
// (64, 128: loops over a head unroll into a few full-width vector instructions), else D = 0,
// meaning "read it at run time".
template <typename F>
void with_head_dim(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int64_t, 64>{});
    case 128:
      return f(std::integral_constant<int64_t, 128>{});
    default:
      return f(std::integral_constant<int64_t, 0>{});
  }
}

// The attention kernels' optional sink logits: [num_heads] contiguous float32, or nullptr.
inline const float* sink_logits(const std::optional<at::Tensor>& sinks, int64_t num_heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                  sinks->numel() == num_heads,
              "sinks must be contiguous float32, one per query head");
  return sinks->data_ptr<float>();
}

}  // namespace inferq_cpu
