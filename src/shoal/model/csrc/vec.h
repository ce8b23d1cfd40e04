// Sixteen float lanes for shoal's CPU kernels: one zmm where the build has AVX-512, two ymm with
// AVX2. Every operation is a fixed sequence of IEEE float32 operations for a given build, so a
// kernel written with Vec computes the same bits for an element whatever the rest of the batch is.
// The kernels are built with -ffp-contract=off: the only fused multiply-adds are Vec::fma.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "shoal's CPU kernels need AVX2, FMA and F16C (native_kernels builds them only there)"
#endif

namespace shoal {

constexpr int kLanes = 16;

// Asks for the cache lines of [start, start + bytes) without waiting for them: into L1 and L2
// (kNear) or into L2 (kFar). The empty asm statement matters: GCC deletes a loop of nothing but
// _mm_prefetch calls as one without effects, and with it every prefetch.
enum class Prefetch { kNear, kFar };
template <Prefetch level>
inline void prefetch_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    _mm_prefetch(p + offset, level == Prefetch::kNear ? _MM_HINT_T0 : _MM_HINT_T1);
    asm volatile("");  // keeps the loop
  }
}

struct Vec {
#if defined(__AVX512F__)
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec broadcast(float s) { return {_mm512_set1_ps(s)}; }
  static Vec halves(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Vec bfloats(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static Vec int8s(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static void nibbles(const uint8_t* p, Vec& low, Vec& high) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    low.v = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    high.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
  static void bf16_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    const __m512i pairs = _mm512_loadu_si512(p);
    even.v = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    odd.v = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  static Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
  static Vec nearest_integer(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  // a * 2^n for whole n whose result stays a normal number (n added to the exponent field).
  static Vec times_power_of_two(Vec a, Vec n) {
    const __m512i shift = _mm512_slli_epi32(_mm512_cvtps_epi32(n.v), 23);
    return {_mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a.v), shift))};
  }
  // a where keep >= limit, else 0.
  static Vec zero_below(Vec a, Vec keep, float limit) {
    return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(keep.v, _mm512_set1_ps(limit), _CMP_GE_OQ), a.v)};
  }
  // The lanes rounded to the nearest bfloat16 (ties to even; NaN stays NaN), as float32.
  Vec rounded_to_bfloat16() const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
    __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, bias), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
    return {_mm512_castsi512_ps(rounded)};
  }
  // The upper halves of the lanes (bfloat16 bits of lanes already rounded to bfloat16).
  void store_bfloat16(uint16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
  }
  // The lanes as float16, rounded to nearest even.
  void store_half(uint16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Lane i of the result is the sum of v[i]'s lanes, each in one fixed order (a transposing tree).
  static Vec sums(const Vec (&in)[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in[i].v, in[i + 8].v, 0x44), _mm512_shuffle_f32x4(in[i].v, in[i + 8].v, 0xEE));
    for (int i = 0; i < 4; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u, w, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(u, w, _MM_SHUFFLE(3, 2, 3, 2)));
    return {_mm512_shuffle_f32x4(r, r, _MM_SHUFFLE(3, 1, 2, 0))};
  }
  // Lane i + lane i + 8 for i < 8 (and the larger of the two).
  __m256 eighths() const { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
  __m256 max_eighths() const { return _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
  // The first `count` lanes, the others `fill`.
  Vec first_lanes(int64_t count, float fill) const {
    const __mmask16 keep = static_cast<__mmask16>(count >= 16 ? 0xffff : (1u << count) - 1);
    return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), keep, v)};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
#else
  __m256 lo, hi;
  static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec broadcast(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
  static Vec halves(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static Vec bfloats(const uint16_t* p) {
    const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
  }
  static Vec int8s(const int8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  }
  static void nibbles(const uint8_t* p, Vec& low, Vec& high) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i a = _mm256_cvtepu8_epi32(bytes), b = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    const __m256i mask = _mm256_set1_epi32(15);
    low = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
    high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
  }
  static void bf16_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(a, mask)), _mm256_castsi256_ps(_mm256_and_si256(b, mask))};
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  static Vec nearest_integer(Vec a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
  }
  static Vec times_power_of_two(Vec a, Vec n) {
    auto scale = [](__m256 x, __m256 e) {
      const __m256i shift = _mm256_slli_epi32(_mm256_cvtps_epi32(e), 23);
      return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(x), shift));
    };
    return {scale(a.lo, n.lo), scale(a.hi, n.hi)};
  }
  static Vec zero_below(Vec a, Vec keep, float limit) {
    const __m256 bound = _mm256_set1_ps(limit);
    return {_mm256_and_ps(a.lo, _mm256_cmp_ps(keep.lo, bound, _CMP_GE_OQ)),
            _mm256_and_ps(a.hi, _mm256_cmp_ps(keep.hi, bound, _CMP_GE_OQ))};
  }
  Vec rounded_to_bfloat16() const {
    auto round = [](__m256 x) {
      const __m256i bits = _mm256_castps_si256(x);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
      const __m256i rounded =
          _mm256_and_si256(_mm256_add_epi32(bits, bias), _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
      const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
    };
    return {round(lo), round(hi)};
  }
  void store_bfloat16(uint16_t* p) const {
    const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(lo), 16), b = _mm256_srli_epi32(_mm256_castps_si256(hi), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
  }
  void store_half(uint16_t* p) const {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, mode));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, mode));
  }
  static Vec sums(const Vec (&in)[16]) {
    float out[16];
    for (int i = 0; i < 16; ++i) out[i] = in[i].sum();
    return load(out);
  }
  __m256 eighths() const { return _mm256_add_ps(lo, hi); }
  __m256 max_eighths() const { return _mm256_max_ps(lo, hi); }
  Vec first_lanes(int64_t count, float fill) const {
    const __m256i low_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i n = _mm256_set1_epi32(static_cast<int>(count));
    const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, low_index));
    const __m256 keep_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_add_epi32(low_index, _mm256_set1_epi32(8))));
    const __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, lo, keep_lo), _mm256_blendv_ps(f, hi, keep_hi)};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
#endif

  // The sum of the lanes by pairwise halving: lane i + lane i + 8, then i + 4, i + 2, i + 1 (so
  // ((l0 + l8) + (l4 + l12)) + ...), always in that order.
  float sum() const {
    const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(eighths()), _mm256_extractf128_ps(eighths(), 1));
    const __m128 pairs = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
  }
  float max_lane() const {
    const __m256 half = max_eighths();
    const __m128 quarter = _mm_max_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    const __m128 pairs = _mm_max_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
  }
};

// e^x to about one unit in the last place: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts),
// a degree-6 polynomial for e^r, and n added to the exponent. Inputs below -86.5 give 0 (softmax's
// vanishing terms, and -inf); inputs above 88.3 give e^88.3 (finite).
inline Vec exp(Vec x) {
  const Vec clamped = Vec::max(Vec::min(x, Vec::broadcast(88.3f)), Vec::broadcast(-86.5f));
  const Vec n = Vec::nearest_integer(Vec::mul(clamped, Vec::broadcast(1.44269504088896341f)));
  Vec r = Vec::fma(n, Vec::broadcast(-0.693359375f), clamped);
  r = Vec::fma(n, Vec::broadcast(2.12194440e-4f), r);
  Vec p = Vec::broadcast(1.3981999507e-3f);
  p = Vec::fma(p, r, Vec::broadcast(8.3334519073e-3f));
  p = Vec::fma(p, r, Vec::broadcast(4.1665795894e-2f));
  p = Vec::fma(p, r, Vec::broadcast(1.6666665459e-1f));
  p = Vec::fma(p, r, Vec::broadcast(5.0000001201e-1f));
  p = Vec::fma(Vec::mul(p, r), r, Vec::add(r, Vec::broadcast(1.f)));
  return Vec::zero_below(Vec::times_power_of_two(p, n), x, -86.5f);
}

// tanh x as 1 - 2 / (e^2x + 1): within about 1e-7 of it in absolute terms (relative error grows
// near 0, where tanh x is x); beyond +-43 it is +-1 exactly.
inline Vec tanh(Vec x) {
  const Vec one = Vec::broadcast(1.f);
  return Vec::sub(one, Vec::div(Vec::broadcast(2.f), Vec::add(exp(Vec::add(x, x)), one)));
}

// Float32 to bfloat16 bits, rounded to nearest even (NaN stays NaN), as c10::BFloat16 does.
inline uint16_t to_bfloat16(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float from_bfloat16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  __builtin_memcpy(&value, &wide, 4);
  return value;
}

}  // namespace shoal
