// Packing weights into the panels of panel_layout.h, once per matrix: float matrices transposed
// into panels, GGUF blocks rearranged (and K-quant super-blocks unpacked) without changing a value.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#include <cstring>

#include "panel_layout.h"

namespace shoal {
namespace {

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// A GGML block of a weight row: how many k it holds, in how many bytes.
struct GgmlBlock {
  int64_t columns, bytes;
};

GgmlBlock ggml_block(const std::string& source) {
  if (source == "q8_0") return {32, 34};
  if (source == "q4_0" || source == "iq4_nl") return {32, 18};
  if (source == "q4_1") return {32, 20};
  if (source == "q5_0") return {32, 22};
  if (source == "q5_1") return {32, 24};
  if (source == "mxfp4") return {32, 17};
  if (source == "q2_k") return {256, 84};
  if (source == "q3_k") return {256, 110};
  if (source == "q4_k") return {256, 144};
  if (source == "q5_k") return {256, 176};
  if (source == "iq4_xs") return {256, 136};
  return {256, 210};  // q6_k
}

// IQ4_NL's and IQ4_XS's 16 values, indexed by a nibble (ggml's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's e2m1 values, doubled (so integers): its nibble's value is kMxfp4Values[nibble] * 2^(e - 128).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E8M0 scale byte's 2^(e - 127), halved (the doubled values' factor): ggml's e8m0_to_fp32_half,
// subnormal below e = 2.
float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block `sub` (0 to 7) from their 12 bytes.
void k_scale_min(const uint8_t* sc, int sub, int& scale, int& minimum) {
  scale = sub < 4 ? sc[sub] & 63 : (sc[sub + 4] & 0xF) | ((sc[sub - 4] >> 6) << 4);
  minimum = sub < 4 ? sc[sub + 4] & 63 : (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
}

uint16_t float_to_half_bits(float value) { return c10::Half(value).x; }

// Writes kernel block b (k = 32b .. 32b + 31) of panel column c, at `o`, from a weight row of GGML
// blocks. K-quant super-blocks (256 k) give eight kernel blocks, their sub-block scales and minimums
// multiplied out exactly in float32 (an fp16 times a 6- or 8-bit integer).
void pack_block(const std::string& source, Format format, const uint8_t* row, int64_t b, uint8_t* o, int64_t c) {
  const BlockLayout layout = block_layout(format);
  uint8_t* values = o + layout.scale_bytes;
  auto put_half = [&](int index, uint16_t bits) { std::memcpy(o + (index * kPanel + c) * 2, &bits, 2); };
  auto put_float = [&](int index, float value) { std::memcpy(o + (index * kPanel + c) * 4, &value, 4); };
  // Q4_K's and Q5_K's d and dmin (fp16) at the super-block's start, then their 12 bytes of 6-bit
  // scales and minimums: sub-block `sub`'s d * scale and -(dmin * minimum), exact in float32.
  auto put_k_scale_and_minimum = [&](const uint8_t* super, int sub) {
    uint16_t d, dmin;
    std::memcpy(&d, super, 2);
    std::memcpy(&dmin, super + 2, 2);
    int scale, minimum;
    k_scale_min(super + 4, sub, scale, minimum);
    put_float(0, half_to_float(d) * static_cast<float>(scale));
    put_float(1, -(half_to_float(dmin) * static_cast<float>(minimum)));
  };
  auto put_int8 = [&](int64_t k, int value) { values[k * kPanel + c] = static_cast<uint8_t>(static_cast<int8_t>(value)); };
  if (source == "q8_0") {
    const uint8_t* block = row + b * 34;
    uint16_t d;
    std::memcpy(&d, block, 2);
    put_half(0, d);
    for (int64_t i = 0; i < kBlock; ++i) values[i * kPanel + c] = block[2 + i];
  } else if (source == "q5_0" || source == "q5_1") {
    // d (fp16), for q5_1 m (fp16), 4 bytes of high bits (bit k of value k), 16 bytes of low nibbles
    // (byte j: k = j low, j + 16 high); q5_0's value d * (q - 16), q5_1's d * q + m.
    const bool q5_1 = source == "q5_1";
    const uint8_t* block = row + b * (q5_1 ? 24 : 22);
    uint16_t d, m = 0;
    std::memcpy(&d, block, 2);
    if (q5_1) std::memcpy(&m, block + 2, 2);
    uint32_t high;
    std::memcpy(&high, block + (q5_1 ? 4 : 2), 4);
    const uint8_t* low = block + (q5_1 ? 8 : 6);
    for (int64_t k = 0; k < kBlock; ++k) {
      const int q = (k < 16 ? low[k] & 0xF : low[k - 16] >> 4) | (((high >> k) & 1) << 4);
      put_int8(k, q5_1 ? q : q - 16);
    }
    if (q5_1) {
      put_float(0, half_to_float(d));
      put_float(1, half_to_float(m));
    } else {
      put_half(0, d);
    }
  } else if (source == "iq4_nl") {
    const uint8_t* block = row + b * 18;
    uint16_t d;
    std::memcpy(&d, block, 2);
    put_half(0, d);
    for (int64_t k = 0; k < kBlock; ++k) put_int8(k, kIq4Values[k < 16 ? block[2 + k] & 0xF : block[2 + k - 16] >> 4]);
  } else if (source == "q5_k") {
    // d, dmin (fp16); Q4_K's 12 bytes of scales and minimums; 32 bytes of high bits (bit `sub` of
    // byte l is value l of sub-block sub's fifth bit); 128 bytes of nibbles as Q4_K's.
    const uint8_t* super = row + b / 8 * 176;
    const int sub = static_cast<int>(b % 8);
    put_k_scale_and_minimum(super, sub);
    const uint8_t* high = super + 16;
    const uint8_t* qs = super + 48 + 32 * (sub / 2);
    for (int64_t l = 0; l < kBlock; ++l)
      put_int8(l, (sub % 2 ? qs[l] >> 4 : qs[l] & 0xF) | (((high[l] >> sub) & 1) << 4));
  } else if (source == "q3_k") {
    // 32 bytes of high-bit masks, 64 of 2-bit values, 12 of 6-bit scales, d (fp16). Value i: half
    // n = i / 128, j = i % 128 / 32; 2 bits at 2j of byte 32n + i % 32, minus 4 where bit 4n + j of
    // mask byte i % 32 is clear; scale 8n + 2j (+ 1 for the second 16) minus 32, times d.
    const uint8_t* super = row + b / 8 * 110;
    const uint8_t* mask = super;
    const uint8_t* qs = super + 32;
    const uint8_t* sc = super + 96;
    uint16_t d;
    std::memcpy(&d, super + 108, 2);
    const int64_t n = b % 8 / 4, j = b % 4;
    for (int half = 0; half < 2; ++half) {
      const int64_t s = 8 * n + 2 * j + half;
      const int scale = (s < 8 ? sc[s] & 0xF : sc[s - 8] >> 4) | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4);
      put_float(half, half_to_float(d) * static_cast<float>(scale - 32));
    }
    for (int64_t l = 0; l < kBlock; ++l) {
      const int q = (qs[32 * n + l] >> (2 * j)) & 3;
      put_int8(l, q - ((mask[l] >> (4 * n + j)) & 1 ? 0 : 4));
    }
  } else if (source == "q2_k") {
    // 16 bytes of scales (low nibble d's factor, high nibble dmin's, one a 16 k), 64 of 2-bit values,
    // d, dmin (fp16). Value i: half n = i / 128, j = i % 128 / 32; 2 bits at 2j of byte 32n + i % 32;
    // scale byte 8n + 2j (+ 1 for the second 16): d * low nibble * q - dmin * high nibble.
    const uint8_t* super = row + b / 8 * 84;
    const uint8_t* qs = super + 16;
    uint16_t d, dmin;
    std::memcpy(&d, super + 80, 2);
    std::memcpy(&dmin, super + 82, 2);
    const int64_t n = b % 8 / 4, j = b % 4;
    for (int half = 0; half < 2; ++half) {
      const uint8_t scale = super[8 * n + 2 * j + half];
      put_float(half, half_to_float(d) * static_cast<float>(scale & 0xF));
      put_float(2 + half, -(half_to_float(dmin) * static_cast<float>(scale >> 4)));
    }
    for (int64_t l = 0; l < kBlock; ++l) put_int8(l, (qs[32 * n + l] >> (2 * j)) & 3);
  } else if (source == "mxfp4") {
    // e (E8M0), then 16 bytes of nibbles (byte j: k = j low, j + 16 high) indexing the e2m1 values.
    const uint8_t* block = row + b * 17;
    put_float(0, e8m0_half(block[0]));
    put_float(1, e8m0_half(block[0]));
    for (int64_t k = 0; k < kBlock; ++k) put_int8(k, kMxfp4Values[k < 16 ? block[1 + k] & 0xF : block[1 + k - 16] >> 4]);
  } else if (source == "iq4_xs") {
    // d (fp16), 2 bytes of the scales' high bit pairs, 4 of their low nibbles, 128 of nibbles (16 a
    // sub-block: byte j, k = j low, j + 16 high) indexing the IQ4 table; sub-block scale ls - 32.
    const uint8_t* super = row + b / 8 * 136;
    const int sub = static_cast<int>(b % 8);
    uint16_t d, scales_high;
    std::memcpy(&d, super, 2);
    std::memcpy(&scales_high, super + 2, 2);
    const int ls = ((super[4 + sub / 2] >> (4 * (sub % 2))) & 0xF) | (((scales_high >> (2 * sub)) & 3) << 4);
    const float scale = half_to_float(d) * static_cast<float>(ls - 32);
    put_float(0, scale);
    put_float(1, scale);
    const uint8_t* qs = super + 8 + 16 * sub;
    for (int64_t k = 0; k < kBlock; ++k) put_int8(k, kIq4Values[k < 16 ? qs[k] & 0xF : qs[k - 16] >> 4]);
  } else if (source == "q4_0" || source == "q4_1") {
    const bool q4_1 = source == "q4_1";
    const uint8_t* block = row + b * (q4_1 ? 20 : 18);
    uint16_t d, m;
    std::memcpy(&d, block, 2);
    if (q4_1) {
      std::memcpy(&m, block + 2, 2);
    } else {
      const float min = -8.f * half_to_float(d);
      m = float_to_half_bits(min);
      TORCH_CHECK(half_to_float(m) == min, "PackedLinear q4_0: scale ", half_to_float(d), " overflows float16 * 8");
    }
    put_half(0, d);
    put_half(1, m);
    for (int64_t j = 0; j < kBlock / 2; ++j) values[j * kPanel + c] = block[(q4_1 ? 4 : 2) + j];  // GGML's order
  } else if (source == "q4_k") {
    // d, dmin (fp16); 12 bytes of 6-bit sub-block scales and minimums; 128 bytes of nibbles, the low
    // ones sub-block 2i, the high ones 2i + 1, of bytes 32i .. 32i + 31.
    const uint8_t* super = row + b / 8 * 144;
    const int sub = static_cast<int>(b % 8);
    put_k_scale_and_minimum(super, sub);
    const uint8_t* qs = super + 16 + 32 * (sub / 2);
    auto q = [&](int64_t i) { return sub % 2 ? qs[i] >> 4 : qs[i] & 0xF; };
    for (int64_t j = 0; j < kBlock / 2; ++j) values[j * kPanel + c] = static_cast<uint8_t>(q(j) | (q(j + 16) << 4));
  } else {
    // q6_k: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 k), d (fp16).
    // Value i of the super-block: half h = i / 128, j = i % 128; low 4 bits from byte 64h + j % 64
    // (low nibble for j < 64), high 2 bits from byte 32h + j % 32 at bit 2 (j / 32); minus 32.
    const uint8_t* super = row + b / 8 * 210;
    uint16_t d;
    std::memcpy(&d, super + 208, 2);
    const int8_t* scales = reinterpret_cast<const int8_t*>(super + 192);
    const int64_t first = b % 8 * kBlock;
    put_float(0, half_to_float(d) * static_cast<float>(scales[first / 16]));
    put_float(1, half_to_float(d) * static_cast<float>(scales[first / 16 + 1]));
    for (int64_t k = 0; k < kBlock; ++k) {
      const int64_t i = first + k, h = i / 128, j = i % 128;
      const uint8_t low = super[64 * h + j % 64], high = super[128 + 32 * h + j % 32];
      put_int8(k, ((j < 64 ? low & 0xF : low >> 4) | (((high >> (2 * (j / 32))) & 3) << 4)) - 32);
    }
  }
}


}  // namespace

at::Tensor pack_panels(const at::Tensor& weight, const std::string& source, int64_t k) {
  const Format format = kernel_format(source);
  const int64_t n = weight.size(0), panels = (n + kPanel - 1) / kPanel, bytes = panel_bytes(format, k);
  const GgmlBlock ggml = format >= kQ8_0 ? ggml_block(source) : GgmlBlock{1, 0};
  TORCH_CHECK(k % ggml.columns == 0, "PackedLinear: ", source, " rows need K divisible by ", ggml.columns, ", got ", k);
  auto w = weight.contiguous();
  if (format == kF32) TORCH_CHECK(w.scalar_type() == at::kFloat, "PackedLinear f32 needs float32 weights");
  if (format == kF16) TORCH_CHECK(w.scalar_type() == at::kHalf, "PackedLinear f16 needs float16 weights");
  if (format == kBF16) TORCH_CHECK(w.scalar_type() == at::kBFloat16, "PackedLinear bf16 needs bfloat16 weights");
  if (format >= kQ8_0)
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) == k / ggml.columns * ggml.bytes, "PackedLinear ", source,
                " needs uint8 rows of GGML blocks");
  TORCH_CHECK(format >= kQ8_0 || w.size(1) == k, "PackedLinear: weights have ", w.size(1), " columns, not ", k);
  auto packed = at::zeros({panels, bytes}, w.options().dtype(at::kByte));
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const uint8_t* src_bytes = static_cast<const uint8_t*>(w.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      uint8_t* out = dst + panel * bytes;
      for (int64_t c = 0; c < kPanel && panel * kPanel + c < n; ++c) {
        const int64_t col = panel * kPanel + c;
        if (format == kF32) {
          const float* src = reinterpret_cast<const float*>(src_bytes) + col * k;
          for (int64_t i = 0; i < k; ++i) reinterpret_cast<float*>(out)[i * kPanel + c] = src[i];
        } else if (format == kF16) {
          const uint16_t* src = reinterpret_cast<const uint16_t*>(src_bytes) + col * k;
          for (int64_t i = 0; i < k; ++i) reinterpret_cast<uint16_t*>(out)[i * kPanel + c] = src[i];
        } else if (format == kBF16) {
          const uint16_t* src = reinterpret_cast<const uint16_t*>(src_bytes) + col * k;
          for (int64_t i = 0; i < k; ++i)
            reinterpret_cast<uint16_t*>(out)[(i / 2) * 2 * kPanel + c * 2 + i % 2] = src[i];
        } else {
          const uint8_t* row = src_bytes + col * w.size(1);
          for (int64_t b = 0; b < k / kBlock; ++b) pack_block(source, format, row, b, out + b * block_layout(format).bytes(), c);
        }
      }
    }
  });
  return packed;
}

}  // namespace shoal
