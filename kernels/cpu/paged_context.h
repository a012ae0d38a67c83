// Reading one sequence's K or V rows from the paged KV cache, shared by the attention kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include "bf16.h"

#include <algorithm>
#include <cstdint>

namespace inferq_cpu {

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * int64_t(sizeof(scalar_t)); offset += 64) {
    __builtin_prefetch(bytes + offset);
  }
}

// One sequence's context in a cache tensor: `len` tokens spread over the blocks of `table`.
template <typename scalar_t>
struct ContextRows {
  const int32_t* table;
  int64_t len, block_size, block_stride, token_stride;
  int64_t row_offset;  // where this work item's KV heads start within a token's row
  int64_t row_size;    // how many elements of a token's row this work item reads

  // visit(row, t) for every token t in order. Blocks lie anywhere in the cache, beyond the
  // hardware prefetcher's sight, so the next block's rows are requested while this one's are
  // visited.
  template <typename Visit>
  void visit(const scalar_t* cache, Visit&& visit_row) const {
    for (int64_t block = 0, first = 0; first < len; ++block, first += block_size) {
      const scalar_t* rows = cache + table[block] * block_stride + row_offset;
      const int64_t count = std::min(block_size, len - first);
      const bool has_next = first + block_size < len;
      const scalar_t* next = has_next ? cache + table[block + 1] * block_stride + row_offset : rows;
      for (int64_t i = 0; i < count; ++i) {
        if (has_next) prefetch_row(next + i * token_stride, row_size);
        visit_row(rows + i * token_stride, first + i);
      }
    }
  }
};

}  // namespace inferq_cpu
