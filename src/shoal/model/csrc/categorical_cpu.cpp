// Random token choice for CPUs: row r draws token i with probability exp(s_i / T_r) / sum_j exp(s_j / T_r),
// s being the row's logits (-inf for tokens filtered out), by inverting its cumulative distribution at
// the row's uniform u_r in [0, 1): the first token whose running sum of weights exceeds u_r times
// their total. Weights are exp((s_i - max s) / T), computed 16 lanes at a time (vec.h's exp); each
// 16-token chunk is summed in Vec::sum's fixed order, and chunk sums are added in row order in double
// precision, for the total and for the search alike. So a row's token depends on its logits, T and u
// alone, never on the other rows, the thread count or the build's vector width (AVX2 and AVX-512
// compute the same lanes).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "vec.h"

namespace shoal {
namespace {

// The row's 16-token chunk `c` as weights exp((s - top) * inverse_temperature); lanes past the row's end
// (a last, partial chunk) weigh 0.
Vec chunk_weights(const float* row, int64_t width, int64_t c, float top, float inverse_temperature) {
  const int64_t start = c * kLanes, count = std::min<int64_t>(kLanes, width - start);
  Vec scores;
  if (count == kLanes) {
    scores = Vec::load(row + start);
  } else {
    float lanes[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) lanes[i] = i < count ? row[start + i] : -INFINITY;
    scores = Vec::load(lanes);
  }
  return exp(Vec::mul(Vec::sub(scores, Vec::broadcast(top)), Vec::broadcast(inverse_temperature)));
}

int64_t draw(const float* row, int64_t width, float inverse_temperature, double uniform) {
  Vec highest = Vec::broadcast(-INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) highest = Vec::max(Vec::load(row + i), highest);
  float top = highest.max_lane();
  for (; i < width; ++i) top = row[i] > top ? row[i] : top;
  if (!std::isfinite(top)) {  // nothing left to draw from (every score -inf), or +inf / NaN scores
    for (int64_t j = 0; j < width; ++j)
      if (!(row[j] < top) && !(row[j] > top)) return j;  // the first maximal (or NaN) score
    return 0;
  }
  const int64_t chunks = (width + kLanes - 1) / kLanes;
  thread_local std::vector<double> sums;
  sums.resize(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    sums[c] = chunk_weights(row, width, c, top, inverse_temperature).sum();
    total += sums[c];
  }
  const double target = uniform * total;
  double running = 0.0;
  int64_t last = 0;  // the last token of positive weight: where rounding leaves the target past the end
  for (int64_t c = 0; c < chunks; ++c) {
    if (sums[c] > 0.0) last = c;
    if (running + sums[c] <= target) {
      running += sums[c];
      continue;
    }
    float lanes[kLanes];
    chunk_weights(row, width, c, top, inverse_temperature).store(lanes);
    for (int64_t j = 0; j < kLanes; ++j) {
      running += lanes[j];
      if (lanes[j] > 0.f && running > target) return c * kLanes + j;
    }
    last = c;
  }
  float lanes[kLanes];
  chunk_weights(row, width, last, top, inverse_temperature).store(lanes);
  for (int64_t j = kLanes - 1; j >= 0; --j)
    if (lanes[j] > 0.f) return last * kLanes + j;
  return last * kLanes;
}

// logits [N, V] float32 (unit column stride), inverse_temperatures [N] float32 (> 0), uniforms [N]
// float64 in [0, 1) -> [N] int64.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inverse_temperatures, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_rows: logits must be float32 [N, V > 0] with unit column stride");
  const int64_t n = logits.size(0);
  TORCH_CHECK(inverse_temperatures.scalar_type() == at::kFloat && inverse_temperatures.numel() == n &&
                  inverse_temperatures.is_contiguous(),
              "sample_rows: inverse_temperatures must be float32 [N]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.numel() == n && uniforms.is_contiguous(),
              "sample_rows: uniforms must be float64 [N]");
  auto out = at::empty({n}, logits.options().dtype(at::kLong));
  int64_t* picked = out.data_ptr<int64_t>();
  const float* data = logits.data_ptr<float>();
  const float* inverse = inverse_temperatures.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) picked[r] = draw(data + r * logits.stride(0), logits.size(1), inverse[r], u[r]);
  });
  return out;
}

}  // namespace
}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) { m.def("sample_rows", &shoal::sample_rows); }
