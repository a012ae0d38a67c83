// The LoRA terms of a step's adapted rows, added to a base layer's output in one call.
//
// From Python, or as batched torch ops, each layer's terms cost a gather, two matmuls per slot
// (or two batched ones over a padded block) and a scatter: at decode sizes (a few rows per
// adapter, rank 16) the matmuls run far below the machine's speed and the ops' overhead
// dominates. Here the rows, sorted by slot (engine/lora/batched.py), are read in place.
//
// Both halves are register tiles in the vector width the build targets (GCC vector types:
// 16 floats under AVX-512, 8 under AVX2), with several independent sums in flight so the adds
// do not wait on one another: the shrink (h = x @ a.T) takes up to four rows against several
// of a's columns at once, each summed along the input, and the expand (term = h @ b_t) up to
// four rows against several vectors of outputs, over the columns. Columns whose span is empty
// (a rank below the slots' width, a shard of a fused layer the adapter leaves alone) are
// skipped by both, and so are a fused layer's columns outside the outputs at hand (b_t is zero
// there). The shrink is kept in float and every row's term is summed apart before it is added
// to the row.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

// Register tiles: kAccumulators independent sums in flight hide the adds' latency; with the
// operands of one step they fit the 32 vector registers of AVX-512, or the 16 of AVX2. A tile
// of R rows takes kAccumulators / R columns (shrink) or output vectors (expand), so a segment
// of one row (a decode step's lone sequence of an adapter) keeps as many sums in flight.
constexpr int kAccumulators = kLanes == 16 ? 16 : 8;
constexpr int kTileRows = 4;
constexpr int64_t kChunk = 8 * kLanes;   // outputs that share one list of active columns
constexpr int64_t kOutBlock = 256;       // outputs per expand task
static_assert(kOutBlock % kChunk == 0, "an expand task takes whole chunks");
constexpr int64_t kExpandRowGroup = 16;  // rows per expand task: tasks of alike cost

inline Vec load_vec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename T>
inline Vec load_vec(const T* p) {
  Vec v;
  for (int j = 0; j < kLanes; ++j) v[j] = static_cast<float>(p[j]);
  return v;
}
inline void store_vec(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
template <typename T>
inline void store_vec(T* p, Vec v) {
  for (int j = 0; j < kLanes; ++j) p[j] = static_cast<T>(v[j]);
}
inline float total(Vec v) {
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += v[j];
  return sum;
}

// h[r][column[c]] = x[r] . a[c] for R rows and C columns.
template <int R, int C, typename T>
void shrink_tile(const T* const* x, const T* const* a, const int32_t* column, int64_t in,
                 float* const* h) {
  Vec acc[R][C] = {};
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes) {
    Vec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = load_vec(x[r] + k);
    for (int c = 0; c < C; ++c) {
      const Vec av = load_vec(a[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] += xv[r] * av;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float sum = total(acc[r][c]);
      for (int64_t j = k; j < in; ++j) {
        sum += static_cast<float>(x[r][j]) * static_cast<float>(a[c][j]);
      }
      h[r][column[c]] = sum;
    }
  }
}

// R rows' h against every column of `used` (a slot's a rows, `in` long, from a).
template <int R, typename T>
void shrink_rows(const T* const* x, const T* a, const int32_t* used, int num_used, int64_t in,
                 float* const* h) {
  constexpr int kColumns = kAccumulators / R;
  const T* a_rows[kColumns];
  int n = 0;
  for (; n + kColumns <= num_used; n += kColumns) {
    for (int c = 0; c < kColumns; ++c) a_rows[c] = a + used[n + c] * in;
    shrink_tile<R, kColumns>(x, a_rows, used + n, in, h);
  }
  for (; n < num_used; ++n) {
    a_rows[0] = a + used[n] * in;
    shrink_tile<R, 1>(x, a_rows, used + n, in, h);
  }
}

// out[r][first + o] += sum over the `active` columns c of h[r][c] * b[c][first + o], for
// V vectors of outputs o.
template <int R, int V, typename T>
void expand_tile(const float* const* h, const T* b, int64_t width, const int32_t* active,
                 int num_active, int64_t first, T* const* out) {
  Vec acc[R][V] = {};
  for (int n = 0; n < num_active; ++n) {
    const int32_t c = active[n];
    const T* b_row = b + c * width + first;
    Vec bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load_vec(b_row + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec weight = Vec{} + h[r][c];
      for (int v = 0; v < V; ++v) acc[r][v] += weight * bv[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      T* o = out[r] + first + v * kLanes;
      store_vec(o, load_vec(o) + acc[r][v]);
    }
  }
}

// R rows' terms over outputs [first, end), from the `active` columns.
template <int R, typename T>
void expand_rows(const float* const* h, const T* b, int64_t width, const int32_t* active,
                 int num_active, int64_t first, int64_t end, T* const* out) {
  constexpr int kVectors = std::min<int>(kAccumulators / R, kChunk / kLanes);
  for (; first + kVectors * kLanes <= end; first += kVectors * kLanes) {
    expand_tile<R, kVectors>(h, b, width, active, num_active, first, out);
  }
  for (; first + kLanes <= end; first += kLanes) {
    expand_tile<R, 1>(h, b, width, active, num_active, first, out);
  }
  for (int r = 0; r < R && first < end; ++r) {
    float term[kLanes] = {};
    for (int n = 0; n < num_active; ++n) {
      const int32_t c = active[n];
      for (int64_t o = first; o < end; ++o) {
        term[o - first] += h[r][c] * static_cast<float>(b[c * width + o]);
      }
    }
    for (int64_t o = first; o < end; ++o) {
      out[r][o] = static_cast<T>(static_cast<float>(out[r][o]) + term[o - first]);
    }
  }
}

template <typename T>
void add_terms(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
               const int64_t* spans, const int64_t* order, const int64_t* slots,
               const int64_t* starts, int64_t segments) {
  const int64_t in = x.size(1), width = out.size(1), columns = a.size(1);
  const int64_t rows = starts[segments];
  std::vector<float> hidden(static_cast<size_t>(rows * columns));
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b_t.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  float* hp = hidden.data();

  // Each segment's columns that reach any output (its slot's adapter uses them).
  std::vector<int32_t> used(static_cast<size_t>(segments * columns));
  std::vector<int32_t> num_used(static_cast<size_t>(segments));
  for (int64_t segment = 0; segment < segments; ++segment) {
    const int64_t* span = spans + slots[segment] * columns * 2;
    int32_t count = 0;
    for (int64_t column = 0; column < columns; ++column) {
      if (span[2 * column] < span[2 * column + 1]) {
        used[segment * columns + count++] = static_cast<int32_t>(column);
      }
    }
    num_used[segment] = count;
  }

  // Shrink tasks: kTileRows rows of one segment (a segment's last may be short).
  std::vector<int64_t> tile_segment, tile_first;
  for (int64_t segment = 0; segment < segments; ++segment) {
    if (num_used[segment] == 0) continue;
    for (int64_t i = starts[segment]; i < starts[segment + 1]; i += kTileRows) {
      tile_segment.push_back(segment);
      tile_first.push_back(i);
    }
  }
  const int64_t tiles = static_cast<int64_t>(tile_first.size());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t segment = tile_segment[task], first = tile_first[task];
      const int64_t count = std::min<int64_t>(kTileRows, starts[segment + 1] - first);
      const T* x_rows[kTileRows];
      float* h_rows[kTileRows];
      for (int64_t r = 0; r < count; ++r) {
        x_rows[r] = xp + order[first + r] * x_stride;
        h_rows[r] = hp + (first + r) * columns;
      }
      const T* a = ap + slots[segment] * columns * in;
      const int32_t* used_here = used.data() + segment * columns;
      const int num = num_used[segment];
      switch (count) {
        case 1: shrink_rows<1>(x_rows, a, used_here, num, in, h_rows); break;
        case 2: shrink_rows<2>(x_rows, a, used_here, num, in, h_rows); break;
        case 3: shrink_rows<3>(x_rows, a, used_here, num, in, h_rows); break;
        default: shrink_rows<4>(x_rows, a, used_here, num, in, h_rows); break;
      }
    }
  });

  // Expand tasks: up to kExpandRowGroup rows of one segment against kOutBlock outputs.
  const int64_t blocks = (width + kOutBlock - 1) / kOutBlock;
  std::vector<int64_t> group_segment, group_first;
  for (int64_t segment = 0; segment < segments; ++segment) {
    if (num_used[segment] == 0) continue;
    for (int64_t i = starts[segment]; i < starts[segment + 1]; i += kExpandRowGroup) {
      group_segment.push_back(segment);
      group_first.push_back(i);
    }
  }
  const int64_t groups = static_cast<int64_t>(group_first.size());
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> active(static_cast<size_t>(columns));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t group = task / blocks, block_first = (task % blocks) * kOutBlock;
      const int64_t segment = group_segment[group], group_start = group_first[group];
      const int64_t group_end = std::min(group_start + kExpandRowGroup, starts[segment + 1]);
      const int64_t block_end = std::min(block_first + kOutBlock, width);
      const T* b = bp + slots[segment] * columns * width;
      const int64_t* span = spans + slots[segment] * columns * 2;
      const int32_t* used_here = used.data() + segment * columns;
      for (int64_t first = block_first; first < block_end; first += kChunk) {
        const int64_t last = std::min(first + kChunk, block_end);
        // A fused layer's column feeds only its own shard's outputs (b_t is zero elsewhere).
        int num_active = 0;
        for (int32_t n = 0; n < num_used[segment]; ++n) {
          const int32_t c = used_here[n];
          if (span[2 * c] < last && span[2 * c + 1] > first) active[num_active++] = c;
        }
        if (num_active == 0) continue;
        for (int64_t i = group_start; i < group_end; i += kTileRows) {
          const int64_t count = std::min<int64_t>(kTileRows, group_end - i);
          const float* h_rows[kTileRows];
          T* out_rows[kTileRows];
          for (int64_t r = 0; r < count; ++r) {
            h_rows[r] = hp + (i + r) * columns;
            out_rows[r] = op + order[i + r] * out_stride;
          }
          const int32_t* cols = active.data();
          switch (count) {
            case 1: expand_rows<1>(h_rows, b, width, cols, num_active, first, last, out_rows); break;
            case 2: expand_rows<2>(h_rows, b, width, cols, num_active, first, last, out_rows); break;
            case 3: expand_rows<3>(h_rows, b, width, cols, num_active, first, last, out_rows); break;
            default: expand_rows<4>(h_rows, b, width, cols, num_active, first, last, out_rows); break;
          }
        }
      }
    }
  });
}

// out [T, width] += each adapted row's term: order [n] the adapted rows sorted by slot, in
// segments[s] = order[starts[s]:starts[s + 1]] of slot slots[s]; a [slots, columns, in] and
// b_t [slots, columns, width] every slot's stacks, spans [slots, columns, 2] the outputs
// [lo, hi) each slot's column reaches (b_t is zero outside them; an empty span: the column is
// unused).
at::Tensor lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& b_t, const at::Tensor& spans, const at::Tensor& order,
                    const at::Tensor& slots, const at::Tensor& starts) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0),
              "lora_add: x [T, in] and out [T, width]");
  TORCH_CHECK(a.dim() == 3 && b_t.dim() == 3 && a.size(0) == b_t.size(0) &&
                  a.size(1) == b_t.size(1) && a.size(2) == x.size(1) &&
                  b_t.size(2) == out.size(1),
              "lora_add: a [slots, columns, in] and b_t [slots, columns, width]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && a.scalar_type() == out.scalar_type() &&
                  b_t.scalar_type() == out.scalar_type(),
              "lora_add: one dtype");
  TORCH_CHECK(a.is_contiguous() && b_t.is_contiguous() && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_add: contiguous stacks and rows");
  TORCH_CHECK(order.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  starts.scalar_type() == at::kLong && starts.numel() == slots.numel() + 1 &&
                  order.is_contiguous() && slots.is_contiguous() && starts.is_contiguous(),
              "lora_add: int64 order, slots and starts (one more than slots)");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() &&
                  spans.numel() == 2 * a.size(0) * a.size(1),
              "lora_add: int64 spans [slots, columns, 2]");
  const int64_t segments = slots.numel();
  if (segments == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lora_add", [&] {
    add_terms<scalar_t>(out, x, a, b_t, spans.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                        slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), segments);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferq_cpu, m) {
  m.def(
      "lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor b_t, Tensor spans, Tensor order, "
      "Tensor slots, Tensor starts) -> Tensor(a!)");
  m.impl("lora_add", c10::DispatchKey::CPU, &lora_add);
}
