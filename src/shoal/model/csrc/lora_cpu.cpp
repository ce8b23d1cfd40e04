// LoRA deltas for the rows of a step that run adapters, as Punica's SGMV computes them on GPUs
// ("shrink" by A, "expand" by B), each row from its own adapter alone: row i's delta is
// B (A x_i) of adapter owners[i], every shrunk value a 16-lane dot product over the input in one
// fixed order (lanes summed by Vec::sum's tree, the tail added after), every output the sum over the
// rank in order. So a row's bits depend on its input and its adapter only, never on the other rows.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace shoal {
namespace {

constexpr size_t kBlock = 4;  // rows of one adapter computed together

// x [R, K] (float32, bfloat16 or float16), owners [R] int64 indices into `a` and `bt`; a[n] [r_n, K]
// and bt[n] [r_n, N] float32 (A, and B transposed), or both empty where adapter n leaves this
// projection alone -> float32 [R, N].
at::Tensor lora_rows(const at::Tensor& x, const at::Tensor& owners, const std::vector<at::Tensor>& a,
                     const std::vector<at::Tensor>& bt, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && owners.scalar_type() == at::kLong && owners.dim() == 1 && owners.size(0) == x.size(0),
              "lora_rows: x must be [R, K] and owners int64 [R]");
  TORCH_CHECK(a.size() == bt.size(), "lora_rows: one A and one B per adapter");
  const int64_t rows = x.size(0), inputs = x.size(1);
  for (size_t n = 0; n < a.size(); ++n) {
    if (a[n].numel() == 0 && bt[n].numel() == 0) continue;
    TORCH_CHECK(a[n].scalar_type() == at::kFloat && bt[n].scalar_type() == at::kFloat && a[n].is_contiguous() &&
                    bt[n].is_contiguous() && a[n].dim() == 2 && bt[n].dim() == 2 && a[n].size(1) == inputs &&
                    bt[n].size(0) == a[n].size(0) && bt[n].size(1) == width,
                "lora_rows: adapter ", n, " needs contiguous float32 A [r, ", inputs, "] and B^T [r, ", width, "]");
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t* owner = owners.data_ptr<int64_t>();
  // Work in blocks of up to kBlock rows of one adapter, which share each load of its A and B.
  std::vector<std::vector<int64_t>> blocks;
  for (size_t n = 0; n < a.size(); ++n) {
    std::vector<int64_t> mine;
    for (int64_t i = 0; i < rows; ++i) {
      TORCH_CHECK(owner[i] >= 0 && owner[i] < static_cast<int64_t>(a.size()), "lora_rows: owner ", owner[i], " out of range");
      if (owner[i] == static_cast<int64_t>(n)) mine.push_back(i);
    }
    if (a[n].numel() == 0) continue;
    for (size_t b = 0; b < mine.size(); b += kBlock)
      blocks.emplace_back(mine.begin() + b, mine.begin() + std::min(mine.size(), b + kBlock));
  }
  auto out = at::zeros({rows, width}, x.options().dtype(at::kFloat));
  const float* input = xf.data_ptr<float>();
  float* output = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const std::vector<int64_t>& members = blocks[block];
      const int64_t count = static_cast<int64_t>(members.size());
      const at::Tensor& down = a[owner[members[0]]];
      const int64_t rank = down.size(0);
      const float* ai = down.data_ptr<float>();
      const float* bi = bt[owner[members[0]]].data_ptr<float>();
      // A block of fewer rows repeats its last one in the empty places (computed, never stored), so
      // every loop over the block has a fixed length and its accumulators stay in registers.
      const float* xs[kBlock];
      for (size_t m = 0; m < kBlock; ++m) xs[m] = input + members[std::min<int64_t>(m, count - 1)] * inputs;
      std::vector<float> shrunk(kBlock * rank);
      for (int64_t j = 0; j < rank; ++j) {  // each member's A x: its own 16 lanes over the input, in order
        const float* row = ai + j * inputs;
        Vec acc[kBlock];
        for (size_t m = 0; m < kBlock; ++m) acc[m] = Vec::zero();
        int64_t k = 0;
        for (; k + kLanes <= inputs; k += kLanes) {
          const Vec weights = Vec::load(row + k);
          for (size_t m = 0; m < kBlock; ++m) acc[m] = Vec::fma(weights, Vec::load(xs[m] + k), acc[m]);
        }
        for (size_t m = 0; m < kBlock; ++m) {
          float value = acc[m].sum();
          for (int64_t t = k; t < inputs; ++t) value += row[t] * xs[m][t];
          shrunk[m * rank + j] = value;
        }
      }
      // Each member's B (A x), 16 outputs at a time held in registers: summed over the rank in order.
      int64_t o = 0;
      for (; o + kLanes <= width; o += kLanes) {
        Vec acc[kBlock];
        for (size_t m = 0; m < kBlock; ++m) acc[m] = Vec::zero();
        for (int64_t j = 0; j < rank; ++j) {
          const Vec weights = Vec::load(bi + j * width + o);
          for (size_t m = 0; m < kBlock; ++m) acc[m] = Vec::fma(weights, Vec::broadcast(shrunk[m * rank + j]), acc[m]);
        }
        for (int64_t m = 0; m < count; ++m) acc[m].store(output + members[m] * width + o);
      }
      for (; o < width; ++o)
        for (int64_t m = 0; m < count; ++m)
          for (int64_t j = 0; j < rank; ++j) output[members[m] * width + o] += bi[j * width + o] * shrunk[m * rank + j];
    }
  });
  return out;
}

}  // namespace
}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) { m.def("lora_rows", &shoal::lora_rows); }
