// Causal attention over the paged KV cache, one query row's operations at a time, for CPUs.
//
// Each output row (token t, query head h) is computed by the same fixed sequence of operations
// over its keys (0..position[t], or the last `window` of them with a sliding window) and never reads
// another row's data: keys are taken 16 positions at a
// time, in order; a tile's scores are dot products of 16-lane partial sums, the running maximum and
// the softmax sum and numerator are rescaled once per tile (online softmax), the tile's weights are
// added to the sum as one 16-lane sum, and each key's value is added in key order. Consecutive
// tokens of one sequence (a prompt's chunk) share a task, so each tile's keys are loaded once for
// them, each token running its own operations. The tile boundaries are absolute positions, so a row's bits
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
template <int G>
struct Heads {
  const float* q;  // [G, dim]
  float* acc;      // [G, dim]
  float running_max[G], total[G];

  void reset(int64_t dim) {
    std::fill(acc, acc + G * dim, 0.f);
    std::fill(running_max, running_max + G, -std::numeric_limits<float>::infinity());
    std::fill(total, total + G, 0.f);
  }

  // Head g's output, numerator / sum (times 1 / sum), to out in its dtype; an attention sink's
  // logit `sink` (-inf: none) adds e^(sink - max) to the sum and nothing to the numerator.
  void finish(int g, int64_t dim, at::ScalarType type, void* out, float sink) {
    float* a = acc + g * dim;
    const float sum = total[g] + std::exp(sink - running_max[g]);
    const Vec inverse = Vec::broadcast(1.f / sum);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) Vec::mul(Vec::load(a + d), inverse).store(a + d);
    for (; d < dim; ++d) a[d] *= 1.f / sum;
    store(a, dim, type, out);
  }
};

// Adds one tile of keys to N tokens of one sequence (their G heads each): token n sees keys
// lows[n] .. counts[n] - 1 of it (keys below lows[n] are before its sliding window), the rest (up to
// 16) are any readable rows. Each key's K and V lanes are widened once and used
// by all N x G heads; every head's own operations are those it would run alone: each score is the
// 16-lane partial sums of q . k over whole lanes (Vec::sums), then the rest of dim in order, times
// scale; the running max becomes max(old, tile max); the old sums are multiplied by e^(old max - new
// max); the tile's e^(score - max) (0 for absent keys) are added to the softmax sum as one Vec::sum,
// and each, times its key's value, to the numerator, key after key.
template <int N, int G, typename cache_t>
void add_tile(Heads<G>* const* rows, const int64_t* lows, const int64_t* counts, const cache_t* const (&keys)[kLanes],
              const cache_t* const (&values)[kLanes], int64_t dim, float scale, float softcap) {
  const int64_t whole = dim / kLanes * kLanes;
  const float* qs[N];  // held in registers: the heads' own pointers would be reloaded at every multiply-add
  float* accs[N];
  for (int n = 0; n < N; ++n) qs[n] = rows[n]->q, accs[n] = rows[n]->acc;
  Vec partial[N][G][kLanes];
  for (int i = 0; i < kLanes; ++i) {
    Vec sum[N][G];
    for (int n = 0; n < N; ++n)
      for (int g = 0; g < G; ++g) sum[n][g] = Vec::zero();
    for (int64_t d = 0; d < whole; d += kLanes) {
      const Vec k = load_lanes(keys[i] + d);
      for (int n = 0; n < N; ++n)
        for (int g = 0; g < G; ++g) sum[n][g] = Vec::fma(Vec::load(qs[n] + g * dim + d), k, sum[n][g]);
    }
    for (int n = 0; n < N; ++n)
      for (int g = 0; g < G; ++g) partial[n][g][i] = sum[n][g];
  }
  float weights[N][G][kLanes], shrink[N][kLanes];
  for (int n = 0; n < N; ++n) {
    Heads<G>& h = *rows[n];
    Vec scores[G];
    float shifts[kLanes] = {};
    for (int g = 0; g < G; ++g) {
      scores[g] = Vec::sums(partial[n][g]);
      if (whole < dim) {
        float lanes[kLanes];
        scores[g].store(lanes);
        for (int i = 0; i < kLanes; ++i)
          for (int64_t d = whole; d < dim; ++d) lanes[i] += qs[n][g * dim + d] * static_cast<float>(keys[i][d]);
        scores[g] = Vec::load(lanes);
      }
      scores[g] = Vec::mul(scores[g], Vec::broadcast(scale));
      if (softcap > 0.f)
        scores[g] = Vec::mul(tanh(Vec::div(scores[g], Vec::broadcast(softcap))), Vec::broadcast(softcap));
      scores[g] = scores[g].first_lanes(counts[n], -std::numeric_limits<float>::infinity());
      if (lows[n] > 0) {  // the tile where the window starts
        float lanes[kLanes];
        scores[g].store(lanes);
        std::fill(lanes, lanes + lows[n], -std::numeric_limits<float>::infinity());
        scores[g] = Vec::load(lanes);
      }
      const float new_max = std::max(h.running_max[g], scores[g].max_lane());
      shifts[g] = h.running_max[g] - new_max;  // -inf for the first tile: its sums are rescaled by 0
      h.running_max[g] = new_max;
    }
    exp(Vec::load(shifts)).store(shrink[n]);
    for (int g = 0; g < G; ++g) {
      const Vec w = exp(Vec::sub(scores[g], Vec::broadcast(h.running_max[g])));
      w.store(weights[n][g]);
      h.total[g] = h.total[g] * shrink[n][g] + w.sum();
    }
  }
  int64_t most = 0;
  for (int n = 0; n < N; ++n) most = std::max(most, counts[n]);
  int64_t d = 0;
  for (; d < whole; d += kLanes) {
    Vec sum[N][G];
    for (int n = 0; n < N; ++n)
      for (int g = 0; g < G; ++g) {
        sum[n][g] = Vec::load(accs[n] + g * dim + d);
        if (shrink[n][g] != 1.f) sum[n][g] = Vec::mul(sum[n][g], Vec::broadcast(shrink[n][g]));
      }
    if (N == 1) {  // one token: every key it is given is present up to its count
      for (int64_t i = 0; i < counts[0]; ++i) {
        const Vec v = load_lanes(values[i] + d);
        for (int g = 0; g < G; ++g) sum[0][g] = Vec::fma(Vec::broadcast(weights[0][g][i]), v, sum[0][g]);
      }
    } else {
      for (int64_t i = 0; i < most; ++i) {
        const Vec v = load_lanes(values[i] + d);
        for (int n = 0; n < N; ++n) {
          if (i >= counts[n]) continue;
          for (int g = 0; g < G; ++g) sum[n][g] = Vec::fma(Vec::broadcast(weights[n][g][i]), v, sum[n][g]);
        }
      }
    }
    for (int n = 0; n < N; ++n)
      for (int g = 0; g < G; ++g) sum[n][g].store(accs[n] + g * dim + d);
  }
  for (; d < dim; ++d)
    for (int n = 0; n < N; ++n)
      for (int g = 0; g < G; ++g) {
        float* a = accs[n] + g * dim + d;
        float sum = shrink[n][g] != 1.f ? *a * shrink[n][g] : *a;
        for (int64_t i = 0; i < counts[n]; ++i) sum += weights[n][g][i] * static_cast<float>(values[i][d]);
        *a = sum;
      }
}

// Tokens of one sequence that share a task: up to this many consecutive ones (a prompt's chunk).
constexpr int kTokensPerTask = 4;

struct Layout {
  const int64_t* block_tables;
  const int64_t* token_sequences;
  const int64_t* positions;
  char* out;
  int64_t out_row_bytes;
  at::ScalarType out_type;
  int64_t tokens, heads, kv_heads, block_size, dim, v_stride, table_width;
  float scale;
  int64_t window;  // keys a token sees, itself included; 0: all before it
  float softcap;   // scores become softcap * tanh(score / softcap); 0: as they are
  const float* sinks;  // each query head's attention-sink logit, or null

  // The first key token t sees.
  int64_t first_key(int64_t t) const { return window > 0 ? std::max<int64_t>(0, positions[t] - window + 1) : 0; }
};

// Tasks of G query heads each (all of one KV head's, or one) for up to kTokensPerTask consecutive
// tokens of one sequence, keys 16 positions a tile (tiles at multiples of 16, whatever the block
// size), from the tile of the first token's first key. A tile's keys are loaded once for the task's
// tokens that see any of them.
template <int G, typename cache_t>
void attend(const float* q, const cache_t* k_cache, const cache_t* v_cache, const Layout& l) {
  const int64_t group = l.heads / l.kv_heads, tasks_per_token = l.heads / G;
  const int64_t element = c10::elementSize(l.out_type);
  std::vector<int64_t> runs;  // the first token of each run of consecutive tokens of one sequence
  for (int64_t t = 0; t < l.tokens; ++t)
    if (runs.empty() || t - runs.back() == kTokensPerTask || l.token_sequences[t] != l.token_sequences[t - 1] ||
        l.positions[t] != l.positions[t - 1] + 1)
      runs.push_back(t);
  runs.push_back(l.tokens);
  const int64_t run_count = static_cast<int64_t>(runs.size()) - 1;
  auto slot_of = [&](int64_t t, int64_t head, int64_t j) {  // the cache row of key j of token t's sequence
    const int64_t* table = l.block_tables + l.token_sequences[t] * l.table_width;
    return (table[j / l.block_size] * l.kv_heads + head / group) * l.block_size + j % l.block_size;
  };
  // The cache rows are read once per step, from memory: the next tile's (the next task's first tile
  // after a task's last) are fetched into L2 while this one is computed.
  auto prefetch = [&](int64_t t, int64_t head, int64_t first, int64_t last) {
    for (int64_t j = first; j < std::min(l.positions[t] + 1, last); ++j) {
      const int64_t slot = slot_of(t, head, j);
      prefetch_lines<Prefetch::kFar>(k_cache + slot * l.dim, l.dim * sizeof(cache_t));
      prefetch_lines<Prefetch::kFar>(v_cache + slot * l.v_stride, l.v_stride * sizeof(cache_t));
    }
  };
  // Later tokens of a prompt see more keys: runs are handed out first, last, second, second to last
  // ..., so each thread's contiguous range of tasks holds early and late ones alike.
  auto run_of = [&](int64_t task) {
    const int64_t k = task / tasks_per_token;
    return k % 2 == 0 ? k / 2 : run_count - 1 - k / 2;
  };
  at::parallel_for(0, run_count * tasks_per_token, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kTokensPerTask * G * l.dim);
    Heads<G> heads[kTokensPerTask];
    Heads<G>* rows[kTokensPerTask];
    int64_t lows[kTokensPerTask], counts[kTokensPerTask];
    const cache_t* keys[kLanes];
    const cache_t* values[kLanes];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = run_of(task), first_head = task % tasks_per_token * G;
      const int64_t first_token = runs[run], tokens = runs[run + 1] - first_token;
      const int64_t last_token = first_token + tokens - 1, visible = l.positions[last_token] + 1;
      for (int64_t n = 0; n < tokens; ++n) {
        heads[n].q = q + ((first_token + n) * l.heads + first_head) * l.dim;
        heads[n].acc = acc.data() + n * G * l.dim;
        heads[n].reset(l.dim);
      }
      const int64_t lowest = l.first_key(first_token), start = lowest / kLanes * kLanes;
      if (task == begin) prefetch(last_token, first_head, start, start + kLanes);
      for (int64_t first = start; first < visible; first += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, visible - first);
        for (int64_t i = 0; i < kLanes; ++i) {  // absent keys: the nearest present one
          const int64_t slot = slot_of(last_token, first_head, std::clamp(first + i, lowest, first + count - 1));
          keys[i] = k_cache + slot * l.dim;
          values[i] = v_cache + slot * l.v_stride;
        }
        if (first + kLanes < visible) {
          prefetch(last_token, first_head, first + kLanes, first + 2 * kLanes);
        } else if (task + 1 < end) {
          const int64_t next_run = run_of(task + 1), next = runs[next_run + 1] - 1;
          const int64_t next_start = l.first_key(runs[next_run]) / kLanes * kLanes;
          prefetch(next, (task + 1) % tasks_per_token * G, next_start, next_start + kLanes);
        }
        int present = 0;  // the run's tokens that see keys of this tile: its first ones see fewer, its last
        for (int64_t n = 0; n < tokens; ++n) {  // ones (with a window) may see none of an early tile
          const int64_t seen = std::min<int64_t>(kLanes, l.positions[first_token + n] + 1 - first);
          const int64_t low = std::max<int64_t>(0, l.first_key(first_token + n) - first);
          if (seen <= 0 || low >= seen) continue;
          rows[present] = &heads[n];
          lows[present] = low;
          counts[present++] = seen;
        }
        switch (present) {
          case 0: break;
          case 1: add_tile<1>(rows, lows, counts, keys, values, l.dim, l.scale, l.softcap); break;
          case 2: add_tile<2>(rows, lows, counts, keys, values, l.dim, l.scale, l.softcap); break;
          case 3: add_tile<3>(rows, lows, counts, keys, values, l.dim, l.scale, l.softcap); break;
          default: add_tile<4>(rows, lows, counts, keys, values, l.dim, l.scale, l.softcap); break;
        }
      }
      for (int64_t n = 0; n < tokens; ++n)
        for (int g = 0; g < G; ++g)
          heads[n].finish(g, l.dim, l.out_type,
                          l.out + (first_token + n) * l.out_row_bytes + (first_head + g) * l.dim * element,
                          l.sinks ? l.sinks[first_head + g] : -std::numeric_limits<float>::infinity());
    }
  });
}

// One token's query heads of a KV head share a task (and its keys' loads) when the group has at
// most 8 heads and that leaves enough tasks for the threads; else each head is a task. Every head
// computes the same bits either way.
template <typename cache_t>
void attend_grouped(const float* q, const cache_t* k_cache, const cache_t* v_cache, const Layout& l) {
  const int64_t group = l.heads / l.kv_heads;
  if (l.tokens * l.kv_heads < 4 * at::get_num_threads()) return attend<1>(q, k_cache, v_cache, l);  // decode: more tasks
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
                          const at::Tensor& positions, double scale, int64_t window, double softcap,
                          const at::Tensor& sinks, const at::Tensor& out) {
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
  TORCH_CHECK(window >= 0, "the sliding window must be 0 (none) or positive, got ", window);
  TORCH_CHECK(softcap >= 0, "the score soft cap must be 0 (none) or positive, got ", softcap);
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.dim() == 1 && sinks.size(0) == heads),
              "attention sinks must be empty or float32 [H]");
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
                      v_cache.size(3), tables.size(1), static_cast<float>(scale), window,
                      static_cast<float>(softcap), sinks.numel() ? sinks.data_ptr<float>() : nullptr};
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
                                at::Tensor token_sequences, at::Tensor positions, double scale, int64_t window,
                                double softcap, at::Tensor sinks) {
  auto out = at::empty_like(q);
  shoal::paged_attention_into(q, k_cache, v_cache, block_tables, token_sequences, positions, scale, window, softcap,
                              sinks, out.view({q.size(0), -1}));
  return out;
}

}  // namespace

TORCH_LIBRARY(shoal, m) {
  m.def("paged_attention_rows", &paged_attention_rows);
}
