// Causal attention over the paged KV cache, one query row at a time, for CPUs.
//
// Each output row (token t, query head h) is computed by the same fixed sequence of operations
// over its keys 0..position[t] and never reads another row's data: keys are taken 16 positions at a
// time, in order; a tile's scores are dot products of 16-lane partial sums, the running maximum and
// the softmax sum and numerator are rescaled once per tile (online softmax), the tile's weights are
// added to the sum as one 16-lane sum, and each key's value is added in key order. The tile boundaries are absolute positions, so a row's bits
// do not depend on the batch, the chunking of the prompt, or how many other tokens the step
// computes: batch invariance by construction. Registered as torch.ops.shoal.paged_attention_rows;
// the fused decoder layer calls paged_attention_into.
#include "paged_attention_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>

#include "vec.h"

namespace shoal {
namespace {

inline Vec load_lanes(const float* p) { return Vec::load(p); }
inline Vec load_lanes(const c10::BFloat16* p) { return Vec::bfloats(reinterpret_cast<const uint16_t*>(p)); }
inline Vec load_lanes(const c10::Half* p) { return Vec::halves(reinterpret_cast<const uint16_t*>(p)); }

// Asks for a cache row in L2 (without waiting for it).
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T1);
}

// Writes `dim` floats to out, converted to its dtype (16-bit rounded to nearest even).
inline void store(const float* values, int64_t dim, at::ScalarType type, void* out) {
  if (type == at::kFloat) {
    std::copy(values, values + dim, static_cast<float*>(out));
  } else if (type == at::kBFloat16) {
    for (int64_t d = 0; d < dim; ++d) static_cast<uint16_t*>(out)[d] = to_bfloat16(values[d]);
  } else {
    for (int64_t d = 0; d < dim; ++d) static_cast<uint16_t*>(out)[d] = c10::Half(values[d]).x;
  }
}

// The running softmax of G query heads (consecutive, sharing one KV head) of one token: per head the
// largest score so far, the sum of e^(score - max) and the numerator sum of e^(score - max) * value.
// Each key's K and V lanes are widened once and used by all G heads.
template <int G, typename cache_t>
struct Heads {
  const float* q;  // [G, dim]
  int64_t dim;
  float scale;
  float* acc;  // [G, dim]
  float running_max[G], total[G];

  void reset() {
    std::fill(acc, acc + G * dim, 0.f);
    std::fill(running_max, running_max + G, -std::numeric_limits<float>::infinity());
    std::fill(total, total + G, 0.f);
  }

  // Adds the keys of one tile: count present keys first, the rest (up to 16) any readable rows.
  // Per head: each score is the 16-lane partial sums of q . k over whole lanes (Vec::sums), then the
  // rest of dim in order, times scale; the running max becomes max(old, tile max); the old sums are
  // multiplied by e^(old max - new max); the tile's e^(score - max) (0 for absent keys) are added to
  // the softmax sum as one Vec::sum, and each, times its key's value, to the numerator, key after key.
  void add_tile(const cache_t* const (&keys)[kLanes], const cache_t* const (&values)[kLanes], int64_t count) {
    const int64_t whole = dim / kLanes * kLanes;
    Vec partial[G][kLanes];
    for (int i = 0; i < kLanes; ++i) {
      Vec sum[G];
      for (int g = 0; g < G; ++g) sum[g] = Vec::zero();
      for (int64_t d = 0; d < whole; d += kLanes) {
        const Vec k = load_lanes(keys[i] + d);
        for (int g = 0; g < G; ++g) sum[g] = Vec::fma(Vec::load(q + g * dim + d), k, sum[g]);
      }
      for (int g = 0; g < G; ++g) partial[g][i] = sum[g];
    }
    Vec scores[G];
    float shifts[kLanes] = {};
    for (int g = 0; g < G; ++g) {
      scores[g] = Vec::sums(partial[g]);
      if (whole < dim) {
        float lanes[kLanes];
        scores[g].store(lanes);
        for (int i = 0; i < kLanes; ++i)
          for (int64_t d = whole; d < dim; ++d) lanes[i] += q[g * dim + d] * static_cast<float>(keys[i][d]);
        scores[g] = Vec::load(lanes);
      }
      scores[g] = Vec::mul(scores[g], Vec::broadcast(scale)).first_lanes(count, -std::numeric_limits<float>::infinity());
      const float new_max = std::max(running_max[g], scores[g].max_lane());
      shifts[g] = running_max[g] - new_max;  // -inf for the first tile: its sums are rescaled by 0
      running_max[g] = new_max;
    }
    float shrink[kLanes], weights[G][kLanes];
    exp(Vec::load(shifts)).store(shrink);
    for (int g = 0; g < G; ++g) {
      const Vec w = exp(Vec::sub(scores[g], Vec::broadcast(running_max[g])));
      w.store(weights[g]);
      total[g] = total[g] * shrink[g] + w.sum();
    }
    int64_t d = 0;
    for (; d < whole; d += kLanes) {
      Vec sum[G];
      for (int g = 0; g < G; ++g) {
        sum[g] = Vec::load(acc + g * dim + d);
        if (shrink[g] != 1.f) sum[g] = Vec::mul(sum[g], Vec::broadcast(shrink[g]));
      }
      for (int64_t i = 0; i < count; ++i) {
        const Vec v = load_lanes(values[i] + d);
        for (int g = 0; g < G; ++g) sum[g] = Vec::fma(Vec::broadcast(weights[g][i]), v, sum[g]);
      }
      for (int g = 0; g < G; ++g) sum[g].store(acc + g * dim + d);
    }
    for (; d < dim; ++d)
      for (int g = 0; g < G; ++g) {
        float sum = shrink[g] != 1.f ? acc[g * dim + d] * shrink[g] : acc[g * dim + d];
        for (int64_t i = 0; i < count; ++i) sum += weights[g][i] * static_cast<float>(values[i][d]);
        acc[g * dim + d] = sum;
      }
  }

  // Head g's output, numerator / sum (times 1 / sum), to out in its dtype.
  void finish(int g, at::ScalarType type, void* out) {
    float* a = acc + g * dim;
    const Vec inverse = Vec::broadcast(1.f / total[g]);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) Vec::mul(Vec::load(a + d), inverse).store(a + d);
    for (; d < dim; ++d) a[d] *= 1.f / total[g];
    store(a, dim, type, out);
  }
};

struct Layout {
  const int64_t* block_tables;
  const int64_t* token_sequences;
  const int64_t* positions;
  char* out;
  int64_t out_row_bytes;
  at::ScalarType out_type;
  int64_t tokens, heads, kv_heads, block_size, dim, v_stride, table_width;
  float scale;
};

// Tasks of G query heads each (all of one KV head's, or one), keys 16 positions a tile (tiles at
// multiples of 16, whatever the block size).
template <int G, typename cache_t>
void attend(const float* q, const cache_t* k_cache, const cache_t* v_cache, const Layout& l) {
  const int64_t group = l.heads / l.kv_heads, tasks_per_token = l.heads / G;
  const int64_t element = c10::elementSize(l.out_type);
  auto token_of = [&](int64_t task) { return task / tasks_per_token; };
  auto first_head_of = [&](int64_t task) { return task % tasks_per_token * G; };
  auto visible_of = [&](int64_t task) { return l.positions[token_of(task)] + 1; };
  auto slot_of = [&](int64_t task, int64_t j) {  // the cache row of key j of the task's sequence and KV head
    const int64_t* table = l.block_tables + l.token_sequences[token_of(task)] * l.table_width;
    return (table[j / l.block_size] * l.kv_heads + first_head_of(task) / group) * l.block_size + j % l.block_size;
  };
  // The cache rows are read once per step, from memory: the next tile's (the next task's first tile
  // after a task's last) are fetched into L2 while this one is computed.
  auto prefetch = [&](int64_t task, int64_t first, int64_t last) {
    for (int64_t j = first; j < std::min(visible_of(task), last); ++j) {
      const int64_t slot = slot_of(task, j);
      prefetch_row(k_cache + slot * l.dim, l.dim * sizeof(cache_t));
      prefetch_row(v_cache + slot * l.v_stride, l.v_stride * sizeof(cache_t));
    }
  };
  at::parallel_for(0, l.tokens * tasks_per_token, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * l.dim);
    const cache_t* keys[kLanes];
    const cache_t* values[kLanes];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = token_of(task), first_head = first_head_of(task), visible = visible_of(task);
      Heads<G, cache_t> heads{q + (t * l.heads + first_head) * l.dim, l.dim, l.scale, acc.data()};
      heads.reset();
      if (task == begin) prefetch(task, 0, kLanes);
      for (int64_t first = 0; first < visible; first += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, visible - first);
        for (int64_t i = 0; i < kLanes; ++i) {
          const int64_t slot = slot_of(task, first + std::min(i, count - 1));  // absent keys: the last present one
          keys[i] = k_cache + slot * l.dim;
          values[i] = v_cache + slot * l.v_stride;
        }
        if (first + kLanes < visible) {
          prefetch(task, first + kLanes, first + 2 * kLanes);
        } else if (task + 1 < end) {
          prefetch(task + 1, 0, kLanes);
        }
        heads.add_tile(keys, values, count);
      }
      for (int g = 0; g < G; ++g)
        heads.finish(g, l.out_type, l.out + t * l.out_row_bytes + (first_head + g) * l.dim * element);
    }
  });
}

// One token's query heads of a KV head share a task (and its keys' loads) when the group has at
// most 8 heads and that leaves enough tasks for the threads; else each head is a task. Every head
// computes the same bits either way.
template <typename cache_t>
void attend_grouped(const float* q, const cache_t* k_cache, const cache_t* v_cache, const Layout& l) {
  const int64_t group = l.heads / l.kv_heads;
  if (l.tokens * l.kv_heads < 4 * at::get_num_threads()) return attend<1>(q, k_cache, v_cache, l);
  switch (group) {
    case 1: return attend<1>(q, k_cache, v_cache, l);
    case 2: return attend<2>(q, k_cache, v_cache, l);
    case 3: return attend<3>(q, k_cache, v_cache, l);
    case 4: return attend<4>(q, k_cache, v_cache, l);
    case 5: return attend<5>(q, k_cache, v_cache, l);
    case 6: return attend<6>(q, k_cache, v_cache, l);
    case 7: return attend<7>(q, k_cache, v_cache, l);
    case 8: return attend<8>(q, k_cache, v_cache, l);
    default: return attend<1>(q, k_cache, v_cache, l);
  }
}

}  // namespace

void paged_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& token_sequences,
                          const at::Tensor& positions, double scale, const at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32 [T, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches differ in dtype");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == tokens && out.size(1) == heads * dim && out.stride(1) == 1,
              "out must be [T, H * D] with unit column stride");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && token_sequences.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "block tables, token sequences and positions must be int64");
  auto tables = block_tables.contiguous();
  auto sequences = token_sequences.contiguous();
  auto pos = positions.contiguous();
  TORCH_CHECK(sequences.size(0) == tokens && pos.size(0) == tokens, "one sequence and position per token");
  const int64_t block_size = k_cache.size(2), width = tables.size(1), blocks = k_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = sequences.data_ptr<int64_t>()[t], p = pos.data_ptr<int64_t>()[t];
    TORCH_CHECK(s >= 0 && s < tables.size(0) && p >= 0 && p / block_size < width,
                "token ", t, ": sequence or position outside the block tables");
  }
  const int64_t* entries = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(entries[i] >= 0 && entries[i] < blocks, "block table entry ", entries[i], " is not a cache block");
  char* target = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = out.stride(0) * out.element_size();
  const Layout layout{tables.data_ptr<int64_t>(), sequences.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), target,
                      row_bytes, out.scalar_type(), tokens, heads, k_cache.size(1), k_cache.size(2), dim,
                      v_cache.size(3), tables.size(1), static_cast<float>(scale)};
  auto run = [&](auto* cache_type) {
    using cache_t = std::remove_pointer_t<decltype(cache_type)>;
    attend_grouped<cache_t>(q.data_ptr<float>(), static_cast<const cache_t*>(k_cache.data_ptr()),
                            static_cast<const cache_t*>(v_cache.data_ptr()), layout);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "the KV cache must be float32, bfloat16 or float16");
  }
}

}  // namespace shoal

namespace {

// Returns [T, H, D] float32 (see paged_attention_into).
at::Tensor paged_attention_rows(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                at::Tensor token_sequences, at::Tensor positions, double scale) {
  auto out = at::empty_like(q);
  shoal::paged_attention_into(q, k_cache, v_cache, block_tables, token_sequences, positions, scale,
                              out.view({q.size(0), -1}));
  return out;
}

}  // namespace

TORCH_LIBRARY(shoal, m) {
  m.def("paged_attention_rows", &paged_attention_rows);
}
