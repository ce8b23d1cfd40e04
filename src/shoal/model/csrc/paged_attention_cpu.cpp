// Causal attention over the paged KV cache, one query row at a time, for CPUs.
//
// Each output row (token t, query head h) is computed by the same fixed sequence of operations
// over its keys 0..position[t] and never reads another row's data: keys are taken 16 positions at a
// time, in order; a tile's scores are dot products of 16-lane partial sums, the running maximum and
// the softmax sum and numerator are rescaled once per tile (online softmax), and each key's value
// is added in key order. The tile boundaries are absolute positions, so a row's bits
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

// Scores of query q against 16 keys (absent keys: any readable row), each the 16-lane partial sums
// of q . k over whole lanes of `dim`, summed by Vec::sums, then the rest of dim in order.
template <typename cache_t>
inline void scores_of(const float* q, const cache_t* const (&keys)[kLanes], int64_t dim, float scale, float* out) {
  Vec partial[kLanes];
  const int64_t whole = dim / kLanes * kLanes;
  for (int i = 0; i < kLanes; ++i) {
    Vec acc = Vec::zero();
    for (int64_t d = 0; d < whole; d += kLanes) acc = Vec::fma(Vec::load(q + d), load_lanes(keys[i] + d), acc);
    partial[i] = acc;
  }
  Vec::sums(partial).store(out);
  for (int i = 0; i < kLanes; ++i) {
    for (int64_t d = whole; d < dim; ++d) out[i] += q[d] * static_cast<float>(keys[i][d]);
    out[i] *= scale;
  }
}

// acc[0, dim) = acc * shrink + sum over i < count, in order, of weights[i] * values[i] (widened to
// float32); whole lanes keep their 16 sums in registers across the keys.
template <typename cache_t>
inline void accumulate(float* acc, float shrink, const float* weights, const cache_t* const (&values)[kLanes],
                       int64_t count, int64_t dim) {
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    Vec sum = Vec::load(acc + d);
    if (shrink != 1.f) sum = Vec::mul(sum, Vec::broadcast(shrink));
    for (int64_t i = 0; i < count; ++i) sum = Vec::fma(Vec::broadcast(weights[i]), load_lanes(values[i] + d), sum);
    sum.store(acc + d);
  }
  for (; d < dim; ++d) {
    float sum = shrink != 1.f ? acc[d] * shrink : acc[d];
    for (int64_t i = 0; i < count; ++i) sum += weights[i] * static_cast<float>(values[i][d]);
    acc[d] = sum;
  }
}

inline void scale(float* acc, float factor, int64_t dim) {
  const Vec f = Vec::broadcast(factor);
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) Vec::mul(Vec::load(acc + d), f).store(acc + d);
  for (; d < dim; ++d) acc[d] *= factor;
}

inline float exp_of(float x) {
  float lanes[kLanes];
  exp(Vec::broadcast(x)).store(lanes);
  return lanes[0];
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

// Keys are visited 16 positions at a time (tiles at multiples of 16, whatever the block size).
// Per tile and query head: the 16 scores, the new running maximum, the old sums rescaled by
// e^(old max - new max), then e^(score - max) of each present key added to the softmax sum and,
// times its value, to the numerator, in key order.
template <typename cache_t>
void attend(const float* q, const cache_t* k_cache, const cache_t* v_cache, const int64_t* block_tables,
            const int64_t* token_sequences, const int64_t* positions, char* out, int64_t out_row_bytes,
            at::ScalarType out_type, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t block_size, int64_t dim,
            int64_t v_stride, int64_t table_width, float scale_factor) {
  const int64_t group = heads / kv_heads, element = c10::elementSize(out_type);
  // A task is one token's query heads of one KV head (which share its keys), or a single query head
  // where that leaves too few tasks for the threads. Either way each head computes the same bits.
  const int64_t per_task = tokens * kv_heads >= 4 * at::get_num_threads() ? group : 1;
  const int64_t tasks_per_token = heads / per_task;
  at::parallel_for(0, tokens * tasks_per_token, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(per_task * dim), running_max(per_task), total(per_task);
    float scores[kLanes], weights[kLanes];
    const cache_t* keys[kLanes];
    const cache_t* values[kLanes];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / tasks_per_token, first_head = task % tasks_per_token * per_task;
      const int64_t kvh = first_head / group, visible = positions[t] + 1;
      const int64_t* table = block_tables + token_sequences[t] * table_width;
      const float* rows = q + (t * heads + first_head) * dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t first = 0; first < visible; first += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, visible - first);
        for (int64_t i = 0; i < kLanes; ++i) {
          const int64_t j = first + std::min(i, count - 1);  // absent keys repeat the last present one
          const int64_t slot = (table[j / block_size] * kv_heads + kvh) * block_size + j % block_size;
          keys[i] = k_cache + slot * dim;
          values[i] = v_cache + slot * v_stride;
        }
        for (int64_t g = 0; g < per_task; ++g) {
          scores_of(rows + g * dim, keys, dim, scale_factor, scores);
          for (int64_t i = count; i < kLanes; ++i) scores[i] = -std::numeric_limits<float>::infinity();
          const float new_max = std::max(running_max[g], *std::max_element(scores, scores + count));
          const float shrink = exp_of(running_max[g] - new_max);  // 0 for the first tile
          running_max[g] = new_max;
          exp(Vec::sub(Vec::load(scores), Vec::broadcast(new_max))).store(weights);
          float sum = total[g] * shrink;
          for (int64_t i = 0; i < count; ++i) sum += weights[i];
          total[g] = sum;
          accumulate(acc.data() + g * dim, shrink, weights, values, count, dim);
        }
      }
      for (int64_t g = 0; g < per_task; ++g) {
        float* a = acc.data() + g * dim;
        scale(a, 1.f / total[g], dim);
        store(a, dim, out_type, out + t * out_row_bytes + (first_head + g) * dim * element);
      }
    }
  });
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
  auto run = [&](auto* cache_type) {
    using cache_t = std::remove_pointer_t<decltype(cache_type)>;
    attend<cache_t>(q.data_ptr<float>(), static_cast<const cache_t*>(k_cache.data_ptr()),
                    static_cast<const cache_t*>(v_cache.data_ptr()), tables.data_ptr<int64_t>(),
                    sequences.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), target, row_bytes, out.scalar_type(),
                    tokens, heads, k_cache.size(1), k_cache.size(2), dim, v_cache.size(3), tables.size(1),
                    static_cast<float>(scale));
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
