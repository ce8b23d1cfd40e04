// Greedy token choice for CPUs: the index of each row's largest logit, the first one where several
// are equal and the first NaN where there is one (torch.argmax's answer), 16 lanes at a time.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "vec.h"

namespace shoal {
namespace {

int64_t first_equal(const float* row, int64_t width, float value) {
  for (int64_t j = 0; j < width; ++j)
    if (row[j] == value) return j;
  return 0;
}

int64_t argmax_of(const float* row, int64_t width) {
  Vec best = Vec::broadcast(-INFINITY), poison = Vec::zero();  // poison: NaN once a NaN or inf was seen
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const Vec x = Vec::load(row + i);
    best = Vec::max(x, best);
    poison = Vec::add(poison, Vec::sub(x, x));
  }
  float lanes[kLanes], top = -INFINITY, tail_poison = 0.f;
  best.store(lanes);
  for (float lane : lanes) top = std::max(top, lane);
  for (; i < width; ++i) top = std::max(top, row[i]), tail_poison += row[i] - row[i];
  if (!std::isnan(poison.sum() + tail_poison)) return first_equal(row, width, top);
  for (int64_t j = 0; j < width; ++j)  // NaN or inf present: the first NaN, else the exact maximum
    if (std::isnan(row[j])) return j;
  top = -INFINITY;
  for (int64_t j = 0; j < width; ++j) top = std::max(top, row[j]);
  return first_equal(row, width, top);
}

// logits [N, V] float32 -> [N] int64.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits must be float32 [N, V > 0] with unit column stride");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* picked = out.data_ptr<int64_t>();
  const float* data = logits.data_ptr<float>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) picked[r] = argmax_of(data + r * logits.stride(0), logits.size(1));
  });
  return out;
}

}  // namespace
}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) { m.def("argmax_rows", &shoal::argmax_rows); }
