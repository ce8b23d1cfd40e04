// The row-wise paged attention (paged_attention_cpu.cpp), as other kernels call it.
#pragma once

#include <ATen/core/Tensor.h>

namespace shoal {

// q: [T, H, D] float32, contiguous. k_cache: [NB, Hkv, bs, D]; v_cache: [NB, Hkv, bs, Dv >= D] (same
// dtype). block_tables: [S, W] int64; token_sequences, positions: [T] int64. window: the keys a
// token sees, itself included (a sliding window), or 0 for all before it. softcap: scaled scores
// become softcap * tanh(score / softcap) (0: as they are). sinks: empty, or each query head's
// attention-sink logit, float32 [H] (gpt-oss: a logit in the softmax's sum with no value). Writes
// each token's attention output to out [T, H * D] (float32, bfloat16 or float16, any row stride).
void paged_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& token_sequences,
                          const at::Tensor& positions, double scale, int64_t window, double softcap,
                          const at::Tensor& sinks, const at::Tensor& out);

}  // namespace shoal
