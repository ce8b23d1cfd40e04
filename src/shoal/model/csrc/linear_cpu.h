// The batch-invariant matrix multiply's packed weights (linear_cpu.cpp), as other kernels call it.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <string>
#include <vector>

namespace shoal {

// W [N, K], the row-wise concatenation of one or more matrices ("parts", each in its own format:
// f32, bf16, f16 weights, or GGUF q8_0 / q4_0 / q4_1 / q4_k / q6_k blocks), packed once for linear_cpu.cpp's
// kernel, and an optional float32 bias [N]. Invariant: output row m of forward() depends only on
// x[m] and the weights, never on the other rows or the thread count.
struct PackedLinear : torch::CustomClassHolder {
  // weights[i]: float32 / bfloat16 / float16 [N_i, K] for sources[i] "f32" / "bf16" / "f16", or
  // uint8 [N_i, K / block columns * block bytes] of GGML blocks for "q8_0" / "q4_0" / "q4_1" (32
  // columns a block) or "q4_k" / "q6_k" (256).
  PackedLinear(std::vector<at::Tensor> weights, std::vector<std::string> sources, int64_t k,
               c10::optional<at::Tensor> bias);

  // x [M, K] (float32, bfloat16 or float16) -> [M, N] in x's dtype.
  at::Tensor forward(const at::Tensor& x) const;

  // Writes x @ W.T (+ bias) into out[:, column : column + N] (out [M, >= column + N], row-major with
  // any row stride, in x's dtype). With `residual` defined ([M, N], same dtype, any row stride), the
  // result rounded to the dtype plus the residual, rounded again, is written instead.
  void forward_into(const at::Tensor& x, const at::Tensor& out, int64_t column, const at::Tensor& residual) const;

  // outs[i] = linears[i]->forward(xs[i]) for each i (xs[i] in float32, bfloat16 or float16), all
  // in one parallel region: many small multiplies (a mixture's experts) without a barrier each.
  // The same bits as forward() one by one.
  static std::vector<at::Tensor> forward_group(const std::vector<const PackedLinear*>& linears,
                                               const std::vector<at::Tensor>& xs);

  int64_t in_features() const { return k_; }
  int64_t out_features() const { return n_; }
  std::vector<std::string> sources() const { return sources_; }
  int64_t packed_bytes() const;  // memory the packed weights take

 private:
  std::vector<at::Tensor> packed_;       // per part: uint8 [panels, panel bytes]
  std::vector<std::string> sources_;     // per part
  std::vector<int64_t> widths_;          // per part: N_i
  std::vector<at::Tensor> bias_panels_;  // per part: float32 [panels * 16], or undefined
  int64_t k_, n_;
};

}  // namespace shoal
