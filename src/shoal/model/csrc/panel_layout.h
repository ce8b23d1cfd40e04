// How shoal's CPU matrix multiply (linear_cpu.cpp) lays out its weights: panels of 16 output
// columns, laid out for the vector unit, one after another; columns past N are zero.
//   f32   panel [K][16] float
//   f16   panel [K][16] float16 (widened in registers)
//   bf16  panel [K/2][16][2] bfloat16 (pairs of k, as AVX512-BF16's dot product reads them), K
//         padded to whole AMX tiles of 32
//   q8_0  panel, per block of 32 k: scale fp16[16], then q int8[32][16]            (value d*q)
//   q4_1  panel, per block of 32 k: scale fp16[16], min fp16[16], then byte [16][16] whose low
//         nibble is k = j and high nibble k = j + 16 (GGML's own nibble order)   (value d*q + m)
//   q4_0 is packed as q4_1 with m = -8d.
//   q4_k  as q4_1 with float32 d and m: each 32-k sub-block's own scale and minimum, exact
//   q6_k  panel, per block of 32 k: float32 d of k < 16 [16], of k >= 16 [16], then q - 32 as
//         int8[32][16] (value d*q); the 6-bit values widened to bytes, the scales exact
//   q5_k  panel, per block of 32 k: float32 d [16], m [16], then q as int8[32][16] (value d*q + m)
//   q2_k  panel, per block of 32 k: float32 d of k < 16 [16], of k >= 16 [16], m of k < 16 [16], of
//         k >= 16 [16], then q as int8[32][16] (value d*q + m, each half with its own d and m)
// Other GGML types are packed, exactly, as one of these: q5_0 (q - 16) and iq4_nl (its table's
// values) as q8_0; q5_1 as q5_k; q3_k (two scales a block), iq4_xs (one, twice) and mxfp4 (its e2m1
// values doubled, -12..12, and 2^(e - 128) twice, exact in float32) as q6_k.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

namespace shoal {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kBlock = 32;  // k per quantized block

// Quantized formats come after kQ8_0: `format >= kQ8_0` means blocks of 32 k.
enum Format : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2, kQ8_0 = 3, kQ4_1 = 4, kQ4_K = 5, kQ6_K = 6, kQ5_K = 7, kQ2_K = 8 };

// What a panel holds per block of 32 k: its scales (16 columns each), then its quantized values.
struct BlockLayout {
  int64_t scale_bytes;  // fp16 d (q8_0); fp16 d, m (q4_1); f32 d, m (q4_k, q5_k); f32 d of k < 16, of k >= 16 (q6_k)
  bool nibbles;         // 16 bytes a k pair (k = j low, j + 16 high), else 16 int8 a k
  bool float_scales;    // f32 rather than fp16
  bool minimum;         // adds m * sum(x over the block)
  bool two_scales;      // k < 16 and k >= 16 scaled apart (and, with a minimum, each half its own m)
  int64_t bytes() const { return scale_bytes + (nibbles ? kBlock / 2 : kBlock) * kPanel; }
};

inline BlockLayout block_layout(Format format) {
  switch (format) {
    case kQ8_0: return {2 * kPanel, false, false, false, false};  // 544 bytes
    case kQ4_1: return {4 * kPanel, true, false, true, false};    // 320
    case kQ4_K: return {8 * kPanel, true, true, true, false};     // 384
    case kQ5_K: return {8 * kPanel, false, true, true, false};    // 640
    case kQ2_K: return {16 * kPanel, false, true, true, true};    // 768
    default: return {8 * kPanel, false, true, false, true};       // q6_k: 640
  }
}

inline int64_t panel_bytes(Format format, int64_t k) {
  switch (format) {
    case kF32: return k * kPanel * 4;
    case kF16: return k * kPanel * 2;
    case kBF16: return (k + kBlock - 1) / kBlock * kBlock * kPanel * 2;  // k padded to whole AMX tiles
    default: return k / kBlock * block_layout(format).bytes();
  }
}

inline Format kernel_format(const std::string& source) {
  if (source == "f32") return kF32;
  if (source == "bf16") return kBF16;
  if (source == "f16") return kF16;
  if (source == "q8_0" || source == "q5_0" || source == "iq4_nl") return kQ8_0;
  if (source == "q4_0" || source == "q4_1") return kQ4_1;
  if (source == "q4_k") return kQ4_K;
  if (source == "q6_k" || source == "q3_k" || source == "iq4_xs" || source == "mxfp4") return kQ6_K;
  if (source == "q5_k" || source == "q5_1") return kQ5_K;
  if (source == "q2_k") return kQ2_K;
  TORCH_CHECK(false, "PackedLinear: unknown weight format ", source);
}

// Packs W [N, K] (`weight`: float32 / bfloat16 / float16 [N, K] for "f32" / "bf16" / "f16", or the
// GGML blocks of each row as uint8 for "q8_0" / "q4_0" / "q4_1" / "q5_0" / "q5_1" / "iq4_nl" / "mxfp4" (32 k
// a block) or "q2_k" / "q3_k" / "q4_k" / "q5_k" / "q6_k" / "iq4_xs" (256)) into uint8
// [panels, panel_bytes(format, K)] (linear_packing_cpu.cpp).
at::Tensor pack_panels(const at::Tensor& weight, const std::string& source, int64_t k);

}  // namespace shoal
