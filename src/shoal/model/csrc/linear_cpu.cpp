// Batch-invariant matrix multiply for CPUs: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
//
// Invariant: each output element is computed by one thread, as one fixed sequence of
// floating-point operations over k that is the same for every row count M, every place of the row
// in the batch and every thread count. Threads split the output's rows and 16-column panels, never
// k, and how many rows and panels a thread computes together (register blocking) changes which
// elements share a loop, not the operations of any element. So row m's bits depend on x[m] and W
// alone, and no row is ever padded to a tile height.
//
// Weights are packed once into panels of 16 output columns (panel_layout.h, linear_packing_cpu.cpp);
// quantized GGUF blocks stay quantized and are widened in registers. Accumulation is float32. Per
// element: f32 is one fused multiply-add chain over k; bf16 adds the odd then the even product of
// each pair of k (VDPBF16PS's order, emulated with two FMAs where the instruction is not used);
// quantized blocks keep two chains (k < 16 and k >= 16) of x*q, added and scaled into the running
// sum once per block (q4_1 and q4_k then add m * sum(x over the block); q6_k scales the two chains
// apart, its halves having scales of their own). Quantized blocks against bfloat16 x run as bf16 dot
// products instead: a block's integer values are exact in bfloat16, so each block is one chain of
// its 16 pairs of k (pair j: k = j and j + 16; q6_k: j and j + 8 within each half), each pair adding
// its second product then its first (VDPBF16PS's order, two FMAs where the instruction is not used),
// scaled into the running sum as above: the weights stay quantized and exact, and the multiply-adds
// run at bfloat16's rate. Where the CPU has AMX, bf16 weights run on its
// tiles instead, for every row count (amx_run): one path per format and machine, never two for one
// matrix. The vector width follows the compiler flags (AVX-512 or AVX2); the flags are the effective
// instruction set's (cpu_features), so forcing a narrower set builds and runs the narrower path.
// AVX2 is the floor (vec.h). Built with -ffp-contract=off: the only fused operations are the
// explicit ones. The output goes to any column range of a wider matrix, optionally plus a residual
// (forward_into), so the fused decoder layer writes projections where they belong without copies.
#include "linear_cpu.h"

#include "panel_layout.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace shoal {
namespace {

// bf16 weights use VDPBF16PS where the CPU has it but no AMX: on a Sapphire Rapids core it ran
// SmolLM2's projections at 64 rows 1.3x slower than widening the weights and using both FMA units.
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define SHOAL_BF16_DOT 1
#else
#define SHOAL_BF16_DOT 0
#endif
// Quantized blocks against bf16 x use VDPBF16PS wherever the CPU has it, AMX machines included (their
// tiles take bf16 weights only).
#if defined(__AVX512BF16__)
#define SHOAL_QUANTIZED_BF16_DOT 1
#else
#define SHOAL_QUANTIZED_BF16_DOT 0
#endif
// Where AMX is present, bf16 weights run on its tiles for every row count (amx_run below).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SHOAL_AMX 1
#else
#define SHOAL_AMX 0
#endif

// What one call multiplies. x rows are float32 (`xf`, row stride ldx) for every format but bf16
// with hardware dot products, which reads bf16 pairs (`xpairs`, one uint32 per pair of k: adjacent
// k for bf16 weights, each quantized block's pairs in their order for quantized ones).
struct Problem {
  Format format;
  int64_t m, n, k;
  const uint8_t* packed;
  int64_t panel_bytes;
  const float* xf;
  const uint32_t* xpairs;
  int64_t ldx;         // floats (or pairs) per row of x
  bool block_pairs;    // quantized weights against bf16 x: the pairs path (tile_quantized_pairs)
  const float* xsums;  // q4_1: [m][k / 32] sums of x over each block
  const float* bias;   // [n padded to a panel] or null
  void* out;           // [m][ldo] results in x's dtype, from column 0 of this pointer
  int64_t ldo;
  const void* residual;  // [m][ldr] added to the results (in the output's dtype) or null
  int64_t ldr;
  at::ScalarType out_type;
};

constexpr int64_t kPrefetchPairs = 32;  // weight pairs ahead (2 KiB of bf16 per panel)
constexpr int64_t kPrefetchBlocks = 4;  // quantized blocks ahead (1.3-2.2 KiB per panel)

inline const uint8_t* panel_at(const Problem& pr, int64_t panel) { return pr.packed + panel * pr.panel_bytes; }

inline Vec widen(const float* p) { return Vec::load(p); }
inline Vec widen(const uint16_t* p) { return Vec::halves(p); }

// f32 and f16 weights: one fused multiply-add chain over k per element.
template <int R, int P, typename weight_t>
void tile_float(const Problem& pr, int64_t row, int64_t panel, Vec (&acc)[R][P]) {
  const weight_t* w[P];
  for (int p = 0; p < P; ++p) w[p] = reinterpret_cast<const weight_t*>(panel_at(pr, panel + p));
  for (int64_t k = 0; k < pr.k; ++k) {
    Vec wk[P];
    for (int p = 0; p < P; ++p) wk[p] = widen(w[p] + k * kPanel);
    for (int r = 0; r < R; ++r) {
      const Vec xk = Vec::broadcast(pr.xf[(row + r) * pr.ldx + k]);
      for (int p = 0; p < P; ++p) acc[r][p] = Vec::fma(xk, wk[p], acc[r][p]);
    }
  }
}

template <int R, int P>
void tile_bf16(const Problem& pr, int64_t row, int64_t panel, Vec (&acc)[R][P]) {
  const uint16_t* w[P];
  for (int p = 0; p < P; ++p) w[p] = reinterpret_cast<const uint16_t*>(panel_at(pr, panel + p));
  const int64_t pairs = (pr.k + 1) / 2;
#if SHOAL_BF16_DOT
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh wj[P];
    for (int p = 0; p < P; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(w[p] + (j + kPrefetchPairs) * 2 * kPanel), _MM_HINT_T0);
      wj[p] = (__m512bh)_mm512_loadu_si512(w[p] + j * 2 * kPanel);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr.xpairs[(row + r) * pr.ldx + j]));
      for (int p = 0; p < P; ++p) acc[r][p].v = _mm512_dpbf16_ps(acc[r][p].v, wj[p], xj);
    }
  }
#else
  for (int64_t j = 0; j < pairs; ++j) {
    Vec even[P], odd[P];
    for (int p = 0; p < P; ++p) Vec::bf16_pairs(w[p] + j * 2 * kPanel, even[p], odd[p]);
    for (int r = 0; r < R; ++r) {
      const float* xr = pr.xf + (row + r) * pr.ldx + 2 * j;
      const Vec x_even = Vec::broadcast(xr[0]), x_odd = Vec::broadcast(xr[1]);
      for (int p = 0; p < P; ++p) acc[r][p] = Vec::fma(x_even, even[p], Vec::fma(x_odd, odd[p], acc[r][p]));
    }
  }
#endif
}

// Where block b of panels panel .. panel + P - 1 starts; with `ahead`, the blocks kPrefetchBlocks on
// are asked for.
template <int P>
inline void block_starts(const Problem& pr, int64_t panel, int64_t b, int64_t block_bytes, bool ahead,
                         const uint8_t* (&w)[P]) {
  for (int p = 0; p < P; ++p) {
    w[p] = panel_at(pr, panel + p) + b * block_bytes;
    if (ahead) prefetch_lines<Prefetch::kNear>(w[p] + kPrefetchBlocks * block_bytes, block_bytes);
  }
}

// A quantized block's 16 columns at k = first and k = second, widened to floats: byte row j's two
// nibbles (k = j and j + 16) for 4-bit blocks, else the two int8 rows.
inline void block_values(const BlockLayout& layout, const uint8_t* block, int64_t j, int64_t first, int64_t second,
                         Vec& at_first, Vec& at_second) {
  const uint8_t* values = block + layout.scale_bytes;
  if (layout.nibbles) return Vec::nibbles(values + j * kPanel, at_first, at_second);
  const int8_t* q = reinterpret_cast<const int8_t*>(values);
  at_first = Vec::int8s(q + first * kPanel);
  at_second = Vec::int8s(q + second * kPanel);
}

template <int R, int P>
void tile_quantized(const Problem& pr, int64_t row, int64_t panel, Vec (&acc)[R][P]) {
  const BlockLayout layout = block_layout(pr.format);
  const int64_t block_bytes = layout.bytes(), blocks = pr.k / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w[P];
    block_starts(pr, panel, b, block_bytes, true, w);
    Vec low[R][P], high[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) low[r][p] = high[r][p] = Vec::zero();
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      Vec wl[P], wh[P];
      for (int p = 0; p < P; ++p) block_values(layout, w[p], j, j, j + kBlock / 2, wl[p], wh[p]);
      for (int r = 0; r < R; ++r) {
        const float* xr = pr.xf + (row + r) * pr.ldx + b * kBlock;
        const Vec xl = Vec::broadcast(xr[j]), xh = Vec::broadcast(xr[j + kBlock / 2]);
        for (int p = 0; p < P; ++p) {
          low[r][p] = Vec::fma(xl, wl[p], low[r][p]);
          high[r][p] = Vec::fma(xh, wh[p], high[r][p]);
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      Vec first, second;  // d and m, or the two halves' d
      if (layout.float_scales) {
        first = Vec::load(reinterpret_cast<const float*>(w[p]));
        second = Vec::load(reinterpret_cast<const float*>(w[p]) + kPanel);
      } else {
        first = Vec::halves(reinterpret_cast<const uint16_t*>(w[p]));
        second = layout.minimum ? Vec::halves(reinterpret_cast<const uint16_t*>(w[p]) + kPanel) : Vec::zero();
      }
      for (int r = 0; r < R; ++r) {
        if (layout.two_scales) {
          acc[r][p] = Vec::fma(second, high[r][p], Vec::fma(first, low[r][p], acc[r][p]));
          if (layout.minimum)  // each half's m times the sum of x over that half
            for (int half = 0; half < 2; ++half)
              acc[r][p] = Vec::fma(Vec::load(reinterpret_cast<const float*>(w[p]) + (2 + half) * kPanel),
                                   Vec::broadcast(pr.xsums[(row + r) * 2 * blocks + 2 * b + half]), acc[r][p]);
          continue;
        }
        acc[r][p] = Vec::fma(first, Vec::add(low[r][p], high[r][p]), acc[r][p]);
        if (layout.minimum) acc[r][p] = Vec::fma(second, Vec::broadcast(pr.xsums[(row + r) * blocks + b]), acc[r][p]);
      }
    }
  }
}

// The two k of pair j (0 to 15) of a quantized block on the pairs path: a byte's two nibbles, k = j
// and j + 16; where the halves are scaled apart (q6_k), k = j and j + 8 within each half.
inline int64_t first_k(const BlockLayout& layout, int64_t j) { return layout.two_scales ? j / 8 * 16 + j % 8 : j; }
inline int64_t second_k(const BlockLayout& layout, int64_t j) { return first_k(layout, j) + (layout.two_scales ? 8 : 16); }

#if SHOAL_QUANTIZED_BF16_DOT
// Pair j of a quantized block's 16 columns as VDPBF16PS reads them: per column, the bf16 value of
// k = first_k(j) in the low half and of second_k(j) in the high half (exact: small integers).
inline __m512i pair_lanes(const BlockLayout& layout, const uint8_t* block, int64_t j) {
  // bf16 bits of the integers 0 to 15, in a lane's low half, and in its high half.
  const __m512 integers = _mm512_cvtepi32_ps(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i high_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const uint8_t* values = block + layout.scale_bytes;
  if (layout.nibbles) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values + j * kPanel)));
    const __m512i low = _mm512_permutexvar_epi32(bytes, _mm512_srli_epi32(_mm512_castps_si512(integers), 16));
    const __m512i high = _mm512_permutexvar_epi32(_mm512_srli_epi32(bytes, 4), _mm512_castps_si512(integers));
    return _mm512_or_si512(low, _mm512_and_si512(high, high_mask));
  }
  const int8_t* q = reinterpret_cast<const int8_t*>(values);
  const __m128i* first = reinterpret_cast<const __m128i*>(q + first_k(layout, j) * kPanel);
  const __m128i* second = reinterpret_cast<const __m128i*>(q + second_k(layout, j) * kPanel);
  const __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(first))));
  const __m512i c = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(second))));
  return _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(c, high_mask));
}
#endif

// Quantized blocks against x rounded to bfloat16: per block, one chain over its 16 pairs (the
// second product, then the first), from zero; a block's chain is scaled into the running sum (d, then
// m * sum(x over the block)), or, for q6_k, each half's chain with that half's d. With `expanded`
// ([P][blocks][16 pairs][16 columns], pair_lanes of each block), the lanes are read from there
// instead of expanded again: the same values, so the same bits.
template <int R, int P>
void tile_quantized_pairs(const Problem& pr, int64_t row, int64_t panel, Vec (&acc)[R][P], const uint32_t* expanded) {
  const BlockLayout layout = block_layout(pr.format);
  const int64_t block_bytes = layout.bytes(), blocks = pr.k / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w[P];
    block_starts(pr, panel, b, block_bytes, !expanded, w);
    Vec chain[R][P];
    for (int64_t half = 0; half < 2; ++half) {  // pairs 0-7, then 8-15
      if (half == 0 || layout.two_scales)
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) chain[r][p] = Vec::zero();
#pragma GCC unroll 8
      for (int64_t j = half * 8; j < half * 8 + 8; ++j) {
#if SHOAL_QUANTIZED_BF16_DOT
        __m512bh wj[P];
        for (int p = 0; p < P; ++p)
          wj[p] = (__m512bh)(expanded ? _mm512_loadu_si512(expanded + ((p * blocks + b) * kBlock / 2 + j) * kPanel)
                                      : pair_lanes(layout, w[p], j));
        for (int r = 0; r < R; ++r) {
          const int xj_bits = static_cast<int>(pr.xpairs[(row + r) * pr.ldx + b * kBlock / 2 + j]);
          const __m512bh xj = (__m512bh)_mm512_set1_epi32(xj_bits);
          for (int p = 0; p < P; ++p) chain[r][p].v = _mm512_dpbf16_ps(chain[r][p].v, wj[p], xj);
        }
#else
        const int64_t first = first_k(layout, j), second = second_k(layout, j);
        Vec wf[P], ws[P];
        for (int p = 0; p < P; ++p) block_values(layout, w[p], j, first, second, wf[p], ws[p]);
        for (int r = 0; r < R; ++r) {
          const float* xr = pr.xf + (row + r) * pr.ldx + b * kBlock;
          const Vec xa = Vec::broadcast(xr[first]), xb = Vec::broadcast(xr[second]);
          for (int p = 0; p < P; ++p) chain[r][p] = Vec::fma(xa, wf[p], Vec::fma(xb, ws[p], chain[r][p]));
        }
#endif
      }
      if (half == 0 && !layout.two_scales) continue;
      for (int p = 0; p < P; ++p) {  // a block's chain (or a half's) into the running sums
        Vec scale, minimum = Vec::zero();
        int64_t sum_at = b;  // x's sum over the block, or over this half of it
        if (layout.two_scales) {
          scale = Vec::load(reinterpret_cast<const float*>(w[p]) + half * kPanel);
          if (layout.minimum) minimum = Vec::load(reinterpret_cast<const float*>(w[p]) + (2 + half) * kPanel);
          sum_at = 2 * b + half;
        } else if (layout.float_scales) {
          scale = Vec::load(reinterpret_cast<const float*>(w[p]));
          minimum = Vec::load(reinterpret_cast<const float*>(w[p]) + kPanel);
        } else {
          scale = Vec::halves(reinterpret_cast<const uint16_t*>(w[p]));
          if (layout.minimum) minimum = Vec::halves(reinterpret_cast<const uint16_t*>(w[p]) + kPanel);
        }
        for (int r = 0; r < R; ++r) {
          acc[r][p] = Vec::fma(scale, chain[r][p], acc[r][p]);
          const int64_t sums_per_row = layout.two_scales ? 2 * blocks : blocks;
          if (layout.minimum)
            acc[r][p] = Vec::fma(minimum, Vec::broadcast(pr.xsums[(row + r) * sums_per_row + sum_at]), acc[r][p]);
        }
      }
    }
  }
}

// Writes one row's sums of one panel (plus bias) to the output, in the output's dtype (16-bit
// results rounded to nearest even); columns past N are dropped. With a residual, the rounded result
// and the residual are added and rounded again: what adding the two tensors would give.
inline void store_row(const Problem& pr, int64_t row, int64_t panel, Vec sum) {
  const int64_t col = panel * kPanel, width = std::min(kPanel, pr.n - col);
  if (pr.bias) sum = Vec::add(sum, Vec::load(pr.bias + col));
  uint16_t halves[kPanel], residual_tail[kPanel];
  float lanes[kPanel];
  if (pr.out_type == at::kFloat) {
    float* o = static_cast<float*>(pr.out) + row * pr.ldo + col;
    if (pr.residual) {
      const float* r = static_cast<const float*>(pr.residual) + row * pr.ldr + col;
      if (width < kPanel) {
        std::memcpy(lanes, r, width * sizeof(float));
        r = lanes;
      }
      sum = Vec::add(sum, Vec::load(r));
    }
    if (width == kPanel) {
      sum.store(o);
    } else {
      sum.store(lanes);
      std::memcpy(o, lanes, width * sizeof(float));
    }
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(pr.out) + row * pr.ldo + col;
  const uint16_t* r = pr.residual ? static_cast<const uint16_t*>(pr.residual) + row * pr.ldr + col : nullptr;
  if (r && width < kPanel) {
    std::memcpy(residual_tail, r, width * sizeof(uint16_t));
    r = residual_tail;
  }
  uint16_t* target = width == kPanel ? o : halves;
  if (pr.out_type == at::kBFloat16) {
    Vec rounded = sum.rounded_to_bfloat16();
    if (r) rounded = Vec::add(rounded, Vec::bfloats(r)).rounded_to_bfloat16();
    rounded.store_bfloat16(target);
  } else {
    sum.store_half(target);
    if (r) Vec::add(Vec::halves(target), Vec::halves(r)).store_half(target);
  }
  if (target != o) std::memcpy(o, halves, width * sizeof(uint16_t));
}

template <int R, int P>
void tile(const Problem& pr, int64_t row, int64_t panel, const uint32_t* expanded) {
  Vec acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = Vec::zero();
  switch (pr.format) {
    case kF32: tile_float<R, P, float>(pr, row, panel, acc); break;
    case kF16: tile_float<R, P, uint16_t>(pr, row, panel, acc); break;
    case kBF16: tile_bf16<R, P>(pr, row, panel, acc); break;
    default:
      if (pr.block_pairs) {
        tile_quantized_pairs<R, P>(pr, row, panel, acc, expanded);
      } else {
        tile_quantized<R, P>(pr, row, panel, acc);
      }
      break;
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) store_row(pr, row + r, panel + p, acc[r][p]);
}

// Register blocking: a thread walks its panels `wide` at a time and, for each group, every row of
// its chunk `tall` rows at a time, so a group's weights are read from memory once per chunk and
// then from cache. Quantized weights are widened once per (row block, k) and used by `tall` rows,
// so they get tall tiles; a single row gets wide ones, for independent chains (two panels of
// quantized blocks: their widening keeps the vector units busy, and fewer streams load faster).
struct Blocking {
  int tall, wide;
};

Blocking blocking(const Problem& pr) {
#if defined(__AVX512F__)
  if (pr.block_pairs) return pr.m == 1 ? Blocking{1, 4} : Blocking{6, 2};  // a chain and a sum per tile element
  if (pr.format >= kQ8_0) return pr.m == 1 ? Blocking{1, 2} : Blocking{6, 1};
  return {6, 4};
#else
  if (pr.format >= kQ8_0) return pr.m == 1 ? Blocking{1, 2} : Blocking{2, 1};
  return {2, 2};
#endif
}

#if SHOAL_QUANTIZED_BF16_DOT
// The pairs path's lanes of `count` panels from `panel` ([count][blocks][16 pairs][16 columns]), in a
// buffer of this thread's, for the row tiles of a chunk to share.
const uint32_t* expand_panels(const Problem& pr, int64_t panel, int count) {
  thread_local std::vector<uint32_t> buffer;
  const BlockLayout layout = block_layout(pr.format);
  const int64_t blocks = pr.k / kBlock, per_panel = blocks * (kBlock / 2) * kPanel;
  buffer.resize(count * per_panel);
  for (int p = 0; p < count; ++p)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = panel_at(pr, panel + p) + b * layout.bytes();
      for (int64_t j = 0; j < kBlock / 2; ++j)
        _mm512_storeu_si512(buffer.data() + p * per_panel + (b * kBlock / 2 + j) * kPanel, pair_lanes(layout, block, j));
    }
  return buffer.data();
}
#endif

template <int P>
void panel_group(const Problem& pr, int64_t row, int64_t rows, int64_t panel, int tall) {
  const uint32_t* expanded = nullptr;
#if SHOAL_QUANTIZED_BF16_DOT
  if (pr.block_pairs && rows > 2 * tall) expanded = expand_panels(pr, panel, P);  // three row tiles or more read them
#endif
  for (int64_t end = row + rows; row < end;) {
    const int64_t left = std::min<int64_t>(end - row, tall);
    switch (left) {
      case 1: tile<1, P>(pr, row, panel, expanded); break;
      case 2: tile<2, P>(pr, row, panel, expanded); break;
      case 3: tile<3, P>(pr, row, panel, expanded); break;
      case 4: tile<4, P>(pr, row, panel, expanded); break;
      case 5: tile<5, P>(pr, row, panel, expanded); break;
      default: tile<6, P>(pr, row, panel, expanded); break;
    }
    row += std::min<int64_t>(left, 6);
  }
}

void rows_block(const Problem& pr, int64_t row, int64_t rows, int64_t panel, int64_t panels) {
  const Blocking shape = blocking(pr);
  while (panels > 0) {
    if (panels >= 4 && shape.wide >= 4) {
      panel_group<4>(pr, row, rows, panel, shape.tall);
      panel += 4, panels -= 4;
    } else if (panels >= 2 && shape.wide >= 2) {
      panel_group<2>(pr, row, rows, panel, shape.tall);
      panel += 2, panels -= 2;
    } else {
      panel_group<1>(pr, row, rows, panel, shape.tall);
      panel += 1, panels -= 1;
    }
  }
}

// At most this many rows' x stay in cache while a thread walks its panels. 64 decoding rows are one
// chunk, whose panels the threads share out: each weight is read from memory once. The pairs path
// reads half the bytes of x a row, and expands each panel's weights once a chunk: twice the rows.
constexpr int64_t kRowChunk = 64;
constexpr int64_t kPairsRowChunk = 128;

// A problem's tasks are (row chunk, panel) pairs, chunk-major; a thread takes a contiguous range.
struct Tasks {
  int64_t panels, chunk_rows, count;
  explicit Tasks(const Problem& pr) {
    const int64_t limit = pr.block_pairs ? kPairsRowChunk : kRowChunk;
    const int64_t chunks = (pr.m + limit - 1) / limit;
    panels = (pr.n + kPanel - 1) / kPanel;
    chunk_rows = (pr.m + chunks - 1) / chunks;
    count = chunks * panels;
  }
};

// Tasks [begin, end) of `pr`.
void run_tasks(const Problem& pr, const Tasks& tasks, int64_t begin, int64_t end) {
  for (int64_t task = begin; task < end;) {
    const int64_t chunk = task / tasks.panels, panel = task % tasks.panels;
    const int64_t count = std::min(tasks.panels - panel, end - task);
    const int64_t row = chunk * tasks.chunk_rows;
    rows_block(pr, row, std::min(tasks.chunk_rows, pr.m - row), panel, count);
    task += count;
  }
}

void run(const Problem& pr) {
  const Tasks tasks(pr);
  at::parallel_for(0, tasks.count, 1, [&](int64_t begin, int64_t end) { run_tasks(pr, tasks, begin, end); });
}

// Several problems in one parallel region: their tasks one problem after another, a thread taking
// a contiguous range of them (each element computed as run() computes it).
void run_all(const std::vector<const Problem*>& problems) {
  std::vector<Tasks> tasks;
  std::vector<int64_t> first{0};  // first[i]: problem i's first task in the joint range
  for (const Problem* pr : problems) {
    tasks.emplace_back(*pr);
    first.push_back(first.back() + tasks.back().count);
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (; i < problems.size() && first[i] < end; ++i) {
      const int64_t from = std::max(begin, first[i]), to = std::min(end, first[i + 1]);
      if (from < to) run_tasks(*problems[i], tasks[i], from - first[i], to - first[i]);
    }
  });
}

#if SHOAL_AMX
// AMX: C[16 rows x 16 columns] += A[16 rows x 32 k] . B[16 pairs of k x 16 columns] per TDPBF16PS.
// B tiles are 16 consecutive pairs of a bf16 panel (1 KiB, contiguous); A tiles are 16 rows of x,
// zero-padded to whole tiles. Each element adds its k pairs in order, each as TDPBF16PS defines
// it, and no element reads another row, so padding rows or columns changes no row's bits.
// Tiles 0-3 accumulate, 4-5 hold x, 6-7 weights.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// The sums of rows [row, row + 16 * blocks) and panels [panel, panel + panels), blocks and panels
// each 1 or 2, written through store_row (rows past M dropped).
void amx_tiles(const Problem& pr, int64_t row, int blocks, int64_t panel, int panels) {
  const int64_t steps = pr.panel_bytes / 1024, lda = pr.ldx * 4;
  const uint8_t* a = reinterpret_cast<const uint8_t*>(pr.xpairs) + row * lda;
  const uint8_t* b0 = panel_at(pr, panel);
  const uint8_t* b1 = panel_at(pr, panel + panels - 1);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t step = 0; step < steps; ++step) {
    prefetch_lines<Prefetch::kNear>(b0 + (step + 2) * 1024, 1024);  // the weights two steps ahead
    if (panels == 2) prefetch_lines<Prefetch::kNear>(b1 + (step + 2) * 1024, 1024);
    _tile_loadd(4, a + step * 64, lda);
    _tile_loadd(6, b0 + step * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (panels == 2) {
      _tile_loadd(7, b1 + step * 1024, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (blocks == 2) {
      _tile_loadd(5, a + 16 * lda + step * 64, lda);
      _tile_dpbf16ps(2, 5, 6);
      if (panels == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[4][16 * kPanel];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  for (int bl = 0; bl < blocks; ++bl)
    for (int p = 0; p < panels; ++p)
      for (int64_t r = 0; r < 16 && row + bl * 16 + r < pr.m; ++r)
        store_row(pr, row + bl * 16 + r, panel + p, Vec::load(sums[bl * 2 + p] + r * kPanel));
}

// As run(), on 32-row chunks: each thread configures its own tiles and walks its panels in pairs.
void amx_run(const Problem& pr) {
  const int64_t panels = (pr.n + kPanel - 1) / kPanel, blocks = (pr.m + 15) / 16, chunks = (blocks + 1) / 2;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    for (int64_t task = begin; task < end;) {
      const int64_t chunk = task / panels, panel = task % panels;
      const int64_t count = std::min(panels - panel, end - task);
      const int tall = std::min<int64_t>(2, blocks - chunk * 2);
      for (int64_t p = panel; p < panel + count; p += 2)
        amx_tiles(pr, chunk * 32, tall, p, std::min<int64_t>(2, panel + count - p));
      task += count;
    }
    _tile_release();
  });
}
#endif

// Sums of x over each block of 32 k, [M][K / 32] float32, or with `by_half` over each 16 k of it,
// [M][K / 16], from x's [M, K] rows (float32 with any row stride, or contiguous bfloat16). With
// `tree` (the pairs path), each as one fixed tree: a block's two halves added lane by lane (a half's
// lanes as they are), then the lanes (Vec::sum); else one chain from its first k.
at::Tensor block_sums(const at::Tensor& x, bool tree, bool by_half) {
  const int64_t m = x.size(0), span = by_half ? kLanes : kBlock, spans = x.size(1) / span, ldx = x.stride(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(tree || !bf16, "block_sums: bfloat16 rows are summed as a tree");
  at::Tensor sums = at::empty({m, spans}, x.options().dtype(at::kFloat));
  float* s = sums.data_ptr<float>();
  const uint16_t* bf16_rows = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const float* floats = bf16 ? nullptr : x.data_ptr<float>();
  auto lanes = [&](int64_t at) { return bf16 ? Vec::bfloats(bf16_rows + at) : Vec::load(floats + at); };
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < spans; ++b) {
        const int64_t at = r * ldx + b * span;
        if (tree) {
          s[r * spans + b] = (by_half ? lanes(at) : Vec::add(lanes(at), lanes(at + kLanes))).sum();
          continue;
        }
        float total = 0.f;
        for (int64_t i = 0; i < span; ++i) total += floats[at + i];
        s[r * spans + b] = total;
      }
  });
  return sums;
}

// One multiply, ready to run: its problem and the tensors the problem points into.
struct Prepared {
  Problem pr;
  at::Tensor x, xsums;
  bool amx = false;
};

#if SHOAL_QUANTIZED_BF16_DOT
// The pairs path with hardware dot products: x's bf16 rows rearranged into each block's pairs (pair j
// holds k = first_k(j) in its low half and second_k(j) in its high half), and the blocks' sums.
void prepare_block_pairs(const at::Tensor& x, Prepared& prepared) {
  Problem& pr = prepared.pr;
  const BlockLayout layout = block_layout(pr.format);
  const int64_t m = pr.m, k = pr.k;
  uint16_t order[kBlock];  // lane 2j takes k first_k(j), lane 2j + 1 second_k(j)
  for (int64_t j = 0; j < kBlock / 2; ++j) order[2 * j] = first_k(layout, j), order[2 * j + 1] = second_k(layout, j);
  const __m512i index = _mm512_loadu_si512(order);
  const at::Tensor xc = x.contiguous();
  prepared.x = at::empty({m, k / 2}, x.options().dtype(at::kInt));
  const uint16_t* source = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  uint32_t* target = reinterpret_cast<uint32_t*>(prepared.x.data_ptr<int32_t>());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const __m512i block = _mm512_loadu_si512(source + r * k + b * kBlock);
        _mm512_storeu_si512(target + r * (k / 2) + b * kBlock / 2, _mm512_permutexvar_epi16(index, block));
      }
  });
  if (layout.minimum) {
    prepared.xsums = block_sums(xc, true, layout.two_scales);
    pr.xsums = prepared.xsums.data_ptr<float>();
  }
  pr.xpairs = target;
  pr.ldx = k / 2;
}
#endif

// out[:, 0 : n] (row stride ldo) = x @ W.T (+ bias) (+ residual) for one packed matrix, prepared.
Prepared prepare(const at::Tensor& x, const at::Tensor& packed, Format format, int64_t n, const at::Tensor& bias,
                 void* out, int64_t ldo, const void* residual, int64_t ldr) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(format != kBF16 || x.scalar_type() == at::kBFloat16,
              "PackedLinear: bf16 weights multiply bfloat16 rows only, not ", x.scalar_type());
  Prepared prepared;
  Problem& pr = prepared.pr;
  pr = Problem{format, m, n, k, packed.data_ptr<uint8_t>(), panel_bytes(format, k)};
  pr.out = out;
  pr.ldo = ldo;
  pr.residual = residual;
  pr.ldr = ldr;
  pr.out_type = x.scalar_type();
  pr.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  // x as the kernel reads it: bf16 pairs for hardware bf16 dot products, float32 otherwise; a
  // copy only where x is not in that form already (an odd K is padded with one zero). Quantized
  // weights against bf16 x take the pairs path, with each block's pairs in their order.
  pr.block_pairs = format >= kQ8_0 && x.scalar_type() == at::kBFloat16;
#if SHOAL_QUANTIZED_BF16_DOT
  if (pr.block_pairs) {
    prepare_block_pairs(x, prepared);
    return prepared;
  }
#endif
#if SHOAL_AMX
  prepared.amx = format == kBF16 && x.scalar_type() == at::kBFloat16 && amx_permitted();
#endif
  const bool amx = prepared.amx;
#if SHOAL_BF16_DOT
  const bool pairs = format == kBF16 && x.scalar_type() == at::kBFloat16;
#else
  const bool pairs = amx;
#endif
  const at::ScalarType wanted = pairs ? at::kBFloat16 : at::kFloat;
  const int64_t width = amx ? (k + kBlock - 1) / kBlock * kBlock : format == kBF16 ? (k + 1) / 2 * 2 : k;
  const int64_t height = amx ? (m + 31) / 32 * 32 : m;  // AMX: whole 32-row chunks
  if (x.scalar_type() == wanted && width == k && height == m && x.stride(1) == 1 && x.stride(0) == k) {
    prepared.x = x;
  } else {
    prepared.x = at::zeros({height, width}, x.options().dtype(wanted));
    prepared.x.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
  }
  if (pairs) {
    pr.xpairs = reinterpret_cast<const uint32_t*>(prepared.x.data_ptr<at::BFloat16>());
    pr.ldx = width / 2;
  } else {
    pr.xf = prepared.x.data_ptr<float>();
    pr.ldx = width;
  }
  if (format >= kQ8_0 && block_layout(format).minimum) {
    prepared.xsums = block_sums(prepared.x, pr.block_pairs, block_layout(format).two_scales);
    pr.xsums = prepared.xsums.data_ptr<float>();
  }
  return prepared;
}

void execute(const Prepared& prepared) {
#if SHOAL_AMX
  if (prepared.amx) return amx_run(prepared.pr);
#endif
  run(prepared.pr);
}

// Executes every prepared multiply: those on the vector units in one parallel region, AMX ones alone.
void execute_all(const std::vector<Prepared>& group) {
  std::vector<const Problem*> problems;
  for (const Prepared& prepared : group) {
    if (prepared.amx)
      execute(prepared);
    else if (prepared.pr.m > 0)
      problems.push_back(&prepared.pr);
  }
  run_all(problems);
}

}  // namespace

PackedLinear::PackedLinear(std::vector<at::Tensor> weights, std::vector<std::string> sources, int64_t k,
                           c10::optional<at::Tensor> bias)
    : sources_(std::move(sources)), k_(k), n_(0) {
  TORCH_CHECK(!weights.empty() && weights.size() == sources_.size(), "PackedLinear: one source per weight");
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t width = weights[i].size(0);
    packed_.push_back(pack_panels(weights[i], sources_[i], k));
    widths_.push_back(width);
    at::Tensor panels;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->dim() == 1, "PackedLinear: bias must be one-dimensional");
      panels = at::zeros({(width + kPanel - 1) / kPanel * kPanel}, bias->options().dtype(at::kFloat));
      panels.narrow(0, 0, width).copy_(bias->narrow(0, n_, width));
    }
    bias_panels_.push_back(panels);
    n_ += width;
  }
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->size(0) == n_, "PackedLinear: bias must have ", n_,
              " values");
}

int64_t PackedLinear::packed_bytes() const {
  int64_t total = 0;
  for (const auto& part : packed_) total += part.numel();
  return total;
}

at::Tensor PackedLinear::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2, "PackedLinear: x must be [M, K]");
  auto out = at::empty({x.size(0), n_}, x.options());
  forward_into(x, out, 0, at::Tensor());
  return out;
}

void PackedLinear::forward_into(const at::Tensor& x, const at::Tensor& out, int64_t column,
                                const at::Tensor& residual) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k_, "PackedLinear: x must be [M, ", k_, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "PackedLinear: x must be float32, bfloat16 or float16");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) >= column + n_,
              "PackedLinear: out must be [M, >= ", column + n_, "] in x's dtype with unit column stride");
  const bool has_residual = residual.defined();
  TORCH_CHECK(!has_residual || (residual.scalar_type() == x.scalar_type() && residual.dim() == 2 &&
                                residual.stride(1) == 1 && residual.size(0) == x.size(0) && residual.size(1) == n_),
              "PackedLinear: residual must be [M, ", n_, "] in x's dtype with unit column stride");
  if (x.size(0) == 0) return;
  const int64_t element = out.element_size();
  int64_t offset = 0;
  for (size_t i = 0; i < packed_.size(); ++i) {
    char* target = static_cast<char*>(out.data_ptr()) + (column + offset) * element;
    const void* added = has_residual ? static_cast<const char*>(residual.data_ptr()) + offset * element : nullptr;
    execute(prepare(x, packed_[i], kernel_format(sources_[i]), widths_[i], bias_panels_[i], target, out.stride(0),
                    added, has_residual ? residual.stride(0) : 0));
    offset += widths_[i];
  }
}

std::vector<at::Tensor> PackedLinear::forward_group(const std::vector<const PackedLinear*>& linears,
                                                    const std::vector<at::Tensor>& xs) {
  TORCH_CHECK(linears.size() == xs.size(), "PackedLinear: one x per matrix of a group");
  std::vector<at::Tensor> outs;
  std::vector<Prepared> group;
  for (size_t j = 0; j < linears.size(); ++j) {
    const PackedLinear& linear = *linears[j];
    const at::Tensor& x = xs[j];
    TORCH_CHECK(x.dim() == 2 && x.size(1) == linear.k_, "PackedLinear: x must be [M, ", linear.k_, "]");
    outs.push_back(at::empty({x.size(0), linear.n_}, x.options()));
    int64_t offset = 0;
    for (size_t i = 0; i < linear.packed_.size(); ++i) {
      char* target = static_cast<char*>(outs.back().data_ptr()) + offset * outs.back().element_size();
      group.push_back(prepare(x, linear.packed_[i], kernel_format(linear.sources_[i]), linear.widths_[i],
                              linear.bias_panels_[i], target, outs.back().stride(0), nullptr, 0));
      offset += linear.widths_[i];
    }
  }
  execute_all(group);
  return outs;
}

}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) {
  m.class_<shoal::PackedLinear>("PackedLinear")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::string>, int64_t, c10::optional<at::Tensor>>())
      .def("forward", &shoal::PackedLinear::forward)
      .def("sources", &shoal::PackedLinear::sources)
      .def("out_features", &shoal::PackedLinear::out_features)
      .def("packed_bytes", &shoal::PackedLinear::packed_bytes);
}
