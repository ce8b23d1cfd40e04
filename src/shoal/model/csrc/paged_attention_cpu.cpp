// Causal attention over the paged KV cache, one query row at a time, for CPUs.
//
// Each output row (token t, query head h) is computed by the same fixed sequence of operations
// over its keys 0..position[t] in order (online softmax, fixed 16-lane partial sums), and never
// reads another row's data. Its bits therefore do not depend on the batch, the chunking of the
// prompt, or how many other tokens the step computes: batch invariance by construction.
// Registered as the operator torch.ops.shoal.paged_attention_rows; it includes only the ATen and
// operator-registration headers it uses, which keeps the first-use build to seconds.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  float lanes[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int i = 0; i < kLanes; ++i) lanes[i] += q[d + i] * static_cast<float>(k[d + i]);
  }
  for (; d < dim; ++d) lanes[d % kLanes] += q[d] * static_cast<float>(k[d]);
  float sum = 0.f;
  for (int i = 0; i < kLanes; ++i) sum += lanes[i];
  return sum;
}

template <typename scalar_t>
void attend(const float* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_tables,
            const int64_t* token_sequences, const int64_t* positions, float* out, int64_t tokens, int64_t heads,
            int64_t kv_heads, int64_t block_size, int64_t dim, int64_t v_stride, int64_t table_width, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * dim), max_score(group), total(group), scores(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / kv_heads, kvh = task % kv_heads;
      const int64_t* table = block_tables + token_sequences[t] * table_width;
      const float* rows = q + (t * heads + kvh * group) * dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(max_score.begin(), max_score.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t j = 0; j <= positions[t]; ++j) {
        const int64_t slot = (table[j / block_size] * kv_heads + kvh) * block_size + j % block_size;
        const scalar_t* key = k_cache + slot * dim;
        const scalar_t* value = v_cache + slot * v_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float s = dot(rows + g * dim, key, dim) * scale;
          float* a = acc.data() + g * dim;
          if (s > max_score[g]) {
            const float shrink = std::exp(max_score[g] - s);
            total[g] *= shrink;
            for (int64_t d = 0; d < dim; ++d) a[d] *= shrink;
            max_score[g] = s;
          }
          const float p = std::exp(s - max_score[g]);
          total[g] += p;
          for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (t * heads + kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] / total[g];
      }
    }
  });
}

}  // namespace

// q: [T, H, D] float32. k_cache: [NB, Hkv, bs, D]; v_cache: [NB, Hkv, bs, Dv >= D] (same dtype).
// block_tables: [S, W] int64; token_sequences, positions: [T] int64. Returns [T, H, D] float32.
at::Tensor paged_attention_rows(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor token_sequences,
                                   at::Tensor positions, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches differ in dtype");
  auto tables = block_tables.contiguous();
  auto sequences = token_sequences.contiguous();
  auto pos = positions.contiguous();
  auto out = at::empty_like(q);
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention_rows", [&] {
    attend<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     tables.data_ptr<int64_t>(), sequences.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                     out.data_ptr<float>(), tokens, heads, k_cache.size(1), k_cache.size(2), dim,
                     v_cache.size(3), tables.size(1), static_cast<float>(scale));
  });
  return out;
}

TORCH_LIBRARY(shoal, m) {
  m.def("paged_attention_rows", &paged_attention_rows);
}
