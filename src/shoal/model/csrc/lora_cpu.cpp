// LoRA deltas for the rows of a step that run adapters, as Punica's SGMV computes them on GPUs
// ("shrink" by A, "expand" by B), each row from its own adapter alone: row i's delta is
// B (A x_i) of adapter owners[i], every shrunk value a 16-lane dot product over the input in one
// fixed order (lanes summed by Vec::sum's tree, the tail added after), every output the sum over the
// rank in order. So a row's bits depend on its input and its adapter only, never on the other rows.
// One call computes the projections that share an input (q/k/v, or gate/up) side by side.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace shoal {
namespace {

constexpr size_t kBlock = 4;  // rows of one adapter computed together

// 16 weights as float32 lanes: float32 as they are, bfloat16 widened (exactly).
inline Vec weights_at(const float* p) { return Vec::load(p); }
inline Vec weights_at(const uint16_t* p) { return Vec::bfloats(p); }
inline float weight_at(const float* p) { return *p; }
inline float weight_at(const uint16_t* p) { return from_bfloat16(*p); }

// A's rows shrunk together: as many as the registers hold beside the block's accumulators (each
// member's dot product with each row is computed alone all the same, so the bits do not depend on it).
// Likewise B's panels expanded together.
#if defined(__AVX512F__)
constexpr int64_t kRanksTogether = 4;
constexpr int64_t kPanelsTogether = 4;
#else
constexpr int64_t kRanksTogether = 1;
constexpr int64_t kPanelsTogether = 1;
#endif

// Rows [first, first + J) of A dotted with each member's input: its own 16 lanes over the input in
// order, the lanes summed by Vec::sum, the tail added after; into shrunk[m * rank + j].
template <int64_t J, typename W>
void shrink(const float* const (&xs)[kBlock], int64_t inputs, const W* ai, int64_t first, int64_t rank,
            float* shrunk) {
  Vec acc[J][kBlock];
  for (int64_t r = 0; r < J; ++r)
    for (size_t m = 0; m < kBlock; ++m) acc[r][m] = Vec::zero();
  int64_t k = 0;
  for (; k + kLanes <= inputs; k += kLanes) {
    Vec inputs_k[kBlock];
    for (size_t m = 0; m < kBlock; ++m) inputs_k[m] = Vec::load(xs[m] + k);
    for (int64_t r = 0; r < J; ++r) {
      const Vec weights = weights_at(ai + (first + r) * inputs + k);
      for (size_t m = 0; m < kBlock; ++m) acc[r][m] = Vec::fma(weights, inputs_k[m], acc[r][m]);
    }
  }
  for (int64_t r = 0; r < J; ++r) {
    const W* row = ai + (first + r) * inputs;
    for (size_t m = 0; m < kBlock; ++m) {
      float value = acc[r][m].sum();
      for (int64_t t = k; t < inputs; ++t) value += weight_at(row + t) * xs[m][t];
      shrunk[m * rank + first + r] = value;
    }
  }
}

// Panels [first, first + P) of B times each member's shrunk values, summed over the rank in order,
// stored at columns offset + 16 p of the member's output row (the last panel's missing outputs not).
template <int64_t P, typename W>
void expand(const float* shrunk, const int64_t* members, int64_t count, const W* bp, int64_t first, int64_t rank,
            int64_t width, float* output, int64_t stride, int64_t offset) {
  Vec acc[P][kBlock];
  for (int64_t q = 0; q < P; ++q)
    for (size_t m = 0; m < kBlock; ++m) acc[q][m] = Vec::zero();
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t q = 0; q < P; ++q) {
      const Vec weights = weights_at(bp + ((first + q) * rank + j) * kLanes);
      for (size_t m = 0; m < kBlock; ++m) acc[q][m] = Vec::fma(weights, Vec::broadcast(shrunk[m * rank + j]), acc[q][m]);
    }
  for (int64_t q = 0; q < P; ++q) {
    const int64_t o = (first + q) * kLanes, lanes = std::min<int64_t>(kLanes, width - o);
    for (int64_t m = 0; m < count; ++m) {
      float* destination = output + members[m] * stride + offset + o;
      if (lanes == kLanes) {
        acc[q][m].store(destination);
      } else {
        float all[kLanes];
        acc[q][m].store(all);
        std::copy(all, all + lanes, destination);
      }
    }
  }
}

// One block of up to kBlock rows of one adapter: their deltas B (A x) of one projection, written into
// columns [offset, offset + width) of `output` (`stride` columns a row). A block of fewer rows
// repeats its last one in the empty places (computed, never stored), so every loop over the block has
// a fixed length and its accumulators stay in registers. W: the adapter's weight type; `bp` is B in
// panels of 16 outputs ([ceil(width / 16), rank, 16], the last panel's missing outputs zero), so the
// expand reads each panel's weights in one run.
template <typename W>
void block_deltas(const float* input, int64_t inputs, const int64_t* members, int64_t count, const W* ai,
                  const W* bp, int64_t rank, int64_t width, float* output, int64_t stride, int64_t offset) {
  const float* xs[kBlock];
  for (size_t m = 0; m < kBlock; ++m) xs[m] = input + members[std::min<int64_t>(m, count - 1)] * inputs;
  std::vector<float> shrunk(kBlock * rank);
  int64_t j = 0;
  for (; j + kRanksTogether <= rank; j += kRanksTogether) shrink<kRanksTogether>(xs, inputs, ai, j, rank, shrunk.data());
  for (; j < rank; ++j) shrink<1>(xs, inputs, ai, j, rank, shrunk.data());
  // Each member's B (A x), panels of 16 outputs at a time held in registers: summed over the rank in order.
  const int64_t panels = (width + kLanes - 1) / kLanes;
  int64_t p = 0;
  for (; p + kPanelsTogether <= panels; p += kPanelsTogether)
    expand<kPanelsTogether>(shrunk.data(), members, count, bp, p, rank, width, output, stride, offset);
  for (; p < panels; ++p) expand<1>(shrunk.data(), members, count, bp, p, rank, width, output, stride, offset);
}

// x [R, K] (float32, bfloat16 or float16), owners [R] int64 indices into the adapters; for each of
// the projections p (widths[p] outputs each), a and b hold one entry per adapter n at p * adapters + n:
// A [r_n, K] and B in panels [ceil(widths[p] / 16), r_n, 16] (float32, or bfloat16 for a bfloat16
// model), or both empty where adapter n leaves projection p alone -> float32 [R, sum of widths], the
// projections side by side.
at::Tensor lora_rows(const at::Tensor& x, const at::Tensor& owners, const std::vector<at::Tensor>& a,
                     const std::vector<at::Tensor>& b, const std::vector<int64_t>& widths) {
  TORCH_CHECK(x.dim() == 2 && owners.scalar_type() == at::kLong && owners.dim() == 1 && owners.size(0) == x.size(0),
              "lora_rows: x must be [R, K] and owners int64 [R]");
  const int64_t projections = static_cast<int64_t>(widths.size());
  TORCH_CHECK(projections > 0 && a.size() == b.size() && a.size() % widths.size() == 0,
              "lora_rows: one A and one B per projection and adapter");
  const int64_t adapters = static_cast<int64_t>(a.size()) / projections;
  const int64_t rows = x.size(0), inputs = x.size(1);
  std::vector<int64_t> offsets(projections + 1, 0);
  for (int64_t p = 0; p < projections; ++p) offsets[p + 1] = offsets[p] + widths[p];
  for (size_t e = 0; e < a.size(); ++e) {
    if (a[e].numel() == 0 && b[e].numel() == 0) continue;
    const auto type = a[e].scalar_type();
    const int64_t width = widths[e / adapters], rank = a[e].dim() == 2 ? a[e].size(0) : -1;
    TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) && b[e].scalar_type() == type &&
                    a[e].is_contiguous() && b[e].is_contiguous() && a[e].dim() == 2 && a[e].size(1) == inputs &&
                    b[e].dim() == 3 && b[e].size(0) == (width + kLanes - 1) / kLanes && b[e].size(1) == rank &&
                    b[e].size(2) == kLanes,
                "lora_rows: entry ", e, " needs contiguous A [r, ", inputs, "] and B panels [",
                (width + kLanes - 1) / kLanes, ", r, 16] of one type, float32 or bfloat16");
  }
  const int64_t* owner = owners.data_ptr<int64_t>();
  // Work in blocks of up to kBlock rows of one adapter, which share each load of its A and B.
  std::vector<std::vector<int64_t>> groups(adapters);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(owner[i] >= 0 && owner[i] < adapters, "lora_rows: owner ", owner[i], " out of range");
    groups[owner[i]].push_back(i);
  }
  struct Work {
    int64_t entry;
    std::vector<int64_t> members;
  };
  std::vector<Work> work;
  for (int64_t p = 0; p < projections; ++p)
    for (int64_t n = 0; n < adapters; ++n) {
      const std::vector<int64_t>& mine = groups[n];
      if (a[p * adapters + n].numel() == 0) continue;
      for (size_t first = 0; first < mine.size(); first += kBlock)
        work.push_back({p * adapters + n, {mine.begin() + first, mine.begin() + std::min(mine.size(), first + kBlock)}});
    }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  auto out = at::zeros({rows, offsets[projections]}, x.options().dtype(at::kFloat));
  const float* input = xf.data_ptr<float>();
  float* output = out.data_ptr<float>();
  const int64_t stride = offsets[projections];
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      if (item + 1 < end) {  // the next block's weights on their way to L2 while this one computes
        const Work& next = work[item + 1];
        prefetch_lines<Prefetch::kFar>(a[next.entry].data_ptr(), a[next.entry].nbytes());
        prefetch_lines<Prefetch::kFar>(b[next.entry].data_ptr(), b[next.entry].nbytes());
      }
      const Work& w = work[item];
      const int64_t p = w.entry / adapters, count = static_cast<int64_t>(w.members.size());
      const at::Tensor& down = a[w.entry];
      const at::Tensor& up = b[w.entry];
      if (down.scalar_type() == at::kBFloat16)
        block_deltas(input, inputs, w.members.data(), count, reinterpret_cast<const uint16_t*>(down.data_ptr()),
                     reinterpret_cast<const uint16_t*>(up.data_ptr()), down.size(0), widths[p], output, stride,
                     offsets[p]);
      else
        block_deltas(input, inputs, w.members.data(), count, down.data_ptr<float>(), up.data_ptr<float>(),
                     down.size(0), widths[p], output, stride, offsets[p]);
    }
  });
  return out;
}

}  // namespace
}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) { m.def("lora_rows", &shoal::lora_rows); }
