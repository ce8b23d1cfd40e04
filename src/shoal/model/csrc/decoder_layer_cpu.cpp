// One decoder layer on CPUs, with no Python between its operations:
//
//   attention: (RMSNorm) -> QKV projection -> (q/k RMSNorm) -> (RoPE on q and k) -> K/V
//              written to the paged cache ->
//              paged attention, scaled and soft-capped                 (this rank's heads)
//   output:    residual + O projection                                 (fused into its epilogue), or
//              residual + (RMSNorm of O) x multiplier                  (norms after: Gemma; Granite)
//   mlp:       (RMSNorm) -> gate/up projection -> act(gate) * up       (SiLU or GELU-tanh; this
//                                                                       rank's columns)
//   down:      as output, with the down projection
//
// forward() runs the four segments in turn; a tensor-parallel layer calls them one by one and
// gathers between them (model/sharding.py), so both compute the same bits. Every element is a fixed
// sequence of operations on its own row: RMSNorm sums 16-lane partial squares in Vec::sum's order,
// the projections are PackedLinear's, attention is paged_attention_cpu's, and activations are
// rounded to the model's dtype after each operation, as the same operations on tensors would be.
// Invariant: a token's outputs depend on its own row (and, in attention, its sequence's cache)
// only, never on the batch.
#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "linear_cpu.h"
#include "paged_attention_cpu.h"
#include "vec.h"

namespace shoal {
namespace {

// Activations in the model's dtype, read as float32 and written rounded to nearest even, one
// element or 16 lanes at a time (both round alike).
template <typename T>
struct Element;
template <>
struct Element<float> {
  static float read(const float* p) { return *p; }
  static void write(float* p, float value) { *p = value; }
  static Vec read16(const float* p) { return Vec::load(p); }
  static Vec round16(Vec v) { return v; }
  static void write16(float* p, Vec v) { v.store(p); }
};
template <>
struct Element<c10::BFloat16> {
  static float read(const c10::BFloat16* p) { return from_bfloat16(p->x); }
  static void write(c10::BFloat16* p, float value) { p->x = to_bfloat16(value); }
  static Vec read16(const c10::BFloat16* p) { return Vec::bfloats(reinterpret_cast<const uint16_t*>(p)); }
  static Vec round16(Vec v) { return v.rounded_to_bfloat16(); }
  static void write16(c10::BFloat16* p, Vec v) { v.rounded_to_bfloat16().store_bfloat16(reinterpret_cast<uint16_t*>(p)); }
};
template <>
struct Element<c10::Half> {
  static float read(const c10::Half* p) { return static_cast<float>(*p); }
  static void write(c10::Half* p, float value) { *p = c10::Half(value); }
  static Vec read16(const c10::Half* p) { return Vec::halves(reinterpret_cast<const uint16_t*>(p)); }
  static Vec round16(Vec v) {
    uint16_t bits[kLanes];
    v.store_half(bits);
    return Vec::halves(bits);
  }
  static void write16(c10::Half* p, Vec v) { v.store_half(reinterpret_cast<uint16_t*>(p)); }
};

template <typename F>
void for_each_dtype(at::ScalarType type, F&& body) {
  switch (type) {
    case at::kFloat: body(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: body(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: body(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "activations must be float32, bfloat16 or float16");
  }
}

// out[t] = weight * round(x[t] / sqrt(mean(x[t]^2) + eps)), both products rounded to the dtype.
// One row of it (o may be the row itself: each element is read before it is written).
template <typename T>
void rms_norm_row(const T* row, const T* weight, float eps, T* o, int64_t width) {
  using E = Element<T>;
  Vec squares = Vec::zero();
  int64_t c = 0;
  for (; c + kLanes <= width; c += kLanes) {
    const Vec v = E::read16(row + c);
    squares = Vec::fma(v, v, squares);
  }
  float total = squares.sum();
  for (; c < width; ++c) total += E::read(row + c) * E::read(row + c);
  const float inverse = 1.f / std::sqrt(total / static_cast<float>(width) + eps);
  const Vec scale = Vec::broadcast(inverse);
  for (c = 0; c + kLanes <= width; c += kLanes)
    E::write16(o + c, Vec::mul(E::read16(weight + c), E::round16(Vec::mul(E::read16(row + c), scale))));
  for (; c < width; ++c) {
    T normed;
    E::write(&normed, E::read(row + c) * inverse);
    E::write(o + c, E::read(weight + c) * E::read(&normed));
  }
}

template <typename T>
void rms_norm(const T* x, int64_t ldx, const T* weight, float eps, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * ldx, weight, eps, out + r * width, width);
  });
}

// RMSNorm of the queries and keys of qkv [T, (H + 2 Hkv) * D], in place, before RoPE: per head
// (Qwen3's and Gemma 3's q_norm and k_norm, [D] each), or over each whole projection (OLMo 2's,
// [H * D] and [Hkv * D]).
template <typename T>
void norm_queries_and_keys(T* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, const T* q_weight,
                           const T* k_weight, float eps, bool whole_projections) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * width;
      if (whole_projections) {
        rms_norm_row(row, q_weight, eps, row, heads * dim);
        rms_norm_row(row + heads * dim, k_weight, eps, row + heads * dim, kv_heads * dim);
        continue;
      }
      for (int64_t h = 0; h < heads + kv_heads; ++h) rms_norm_row(row + h * dim, h < heads ? q_weight : k_weight, eps, row + h * dim, dim);
    }
  });
}

// RoPE (half-split layout: x * cos + roll(x, D/2) * signed_sin, each product rounded, then the sum)
// on the q and k heads of qkv [T, (H + 2 Hkv) * D], each rotated head rounded to the dtype (without
// `rotary`, the heads as they are: a layer without RoPE); keys and
// values go to their cache rows (slot_rows[t * Hkv + h] in the caches viewed as rows of D and D + 1),
// queries to q [T, H, D] as float32.
template <typename T>
void rotate_and_store(const T* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, const float* cos,
                      const float* signed_sin, const int64_t* positions, const int64_t* slot_rows, T* k_cache,
                      T* v_cache, float* q, bool rotary) {
  using E = Element<T>;
  const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
  const bool whole_lanes = half % kLanes == 0;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const float* c = cos + positions[t] * dim;
      const float* s = signed_sin + positions[t] * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* x = row + h * dim;
        int64_t d = rotary ? 0 : dim;
        if (!rotary)
          for (int64_t e = 0; e < dim; ++e) rotated[e] = E::read(x + e);
        for (; whole_lanes && d < dim; d += kLanes) {
          const Vec partner = E::read16(x + (d < half ? d + half : d - half));
          const Vec a = Vec::mul(E::read16(x + d), Vec::load(c + d)), b = Vec::mul(partner, Vec::load(s + d));
          E::round16(Vec::add(a, b)).store(rotated.data() + d);
        }
        for (; d < dim; ++d) {
          const float a = E::read(x + d) * c[d], b = E::read(x + (d < half ? d + half : d - half)) * s[d];
          T value;
          E::write(&value, a + b);
          rotated[d] = E::read(&value);
        }
        if (h < heads) {
          std::copy(rotated.begin(), rotated.end(), q + (t * heads + h) * dim);
        } else {
          T* key = k_cache + slot_rows[t * kv_heads + h - heads] * dim;
          for (d = 0; d < dim; ++d) E::write(key + d, rotated[d]);  // exact: already rounded
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* v = row + (heads + kv_heads + h) * dim;
        std::copy(v, v + dim, v_cache + slot_rows[t * kv_heads + h] * (dim + 1));
      }
    }
  });
}

// How an MLP's gate meets its up projection: act(gate) * up with SiLU or GELU's tanh approximation,
// or gpt-oss's clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
// g = min(gate, limit).
struct Gate {
  enum Kind : int64_t { kSilu = 0, kGeluTanh = 1, kClampedSwiglu = 2 } kind;
  float alpha = 0.f, limit = 0.f;
};

// The gate activation on 16 lanes: silu(g) = g / (1 + e^-g), or GELU's tanh approximation
// g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))).
inline Vec activate(Vec g, bool gelu) {
  if (!gelu) return Vec::div(g, Vec::add(Vec::broadcast(1.f), exp(Vec::sub(Vec::zero(), g))));
  const Vec cubic = Vec::mul(Vec::mul(Vec::mul(g, g), g), Vec::broadcast(0.044715f));
  const Vec inner = Vec::mul(Vec::add(g, cubic), Vec::broadcast(0.7978845608028654f));
  return Vec::mul(Vec::mul(g, Vec::broadcast(0.5f)), Vec::add(Vec::broadcast(1.f), tanh(inner)));
}

// out[t, j] = round(round(act(gate[t, j])) * up[t, j]) for gate_up [T, 2I] = [gate | up], out [T, I]
// (the clamped SwiGLU rounded after each of its operations, as torch computes it in the dtype);
// 16 lanes at a time (a row's last lanes through a padded copy).
template <typename T>
void activate_and_multiply(const T* gate_up, int64_t tokens, int64_t width, Gate gate_kind, T* out) {
  using E = Element<T>;
  auto lanes_of = [gate_kind](Vec g, Vec up) {
    if (gate_kind.kind != Gate::kClampedSwiglu)
      return Vec::mul(E::round16(activate(g, gate_kind.kind == Gate::kGeluTanh)), up);
    const Vec limit = Vec::broadcast(gate_kind.limit), one = Vec::broadcast(1.f);
    g = Vec::min(g, limit);
    up = Vec::max(Vec::min(up, limit), Vec::sub(Vec::zero(), limit));
    const Vec scaled = E::round16(Vec::mul(g, Vec::broadcast(gate_kind.alpha)));
    const Vec sigmoid = E::round16(Vec::div(one, Vec::add(one, exp(Vec::sub(Vec::zero(), scaled)))));
    const Vec glu = E::round16(Vec::mul(g, sigmoid));
    return Vec::mul(E::round16(Vec::add(up, one)), glu);
  };
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = gate_up + t * 2 * width;
      const T* up = gate + width;
      T* o = out + t * width;
      int64_t j = 0;
      for (; j + kLanes <= width; j += kLanes) E::write16(o + j, lanes_of(E::read16(gate + j), E::read16(up + j)));
      if (j < width) {
        float g[kLanes] = {}, u[kLanes] = {}, r[kLanes];
        for (int64_t l = 0; j + l < width; ++l) g[l] = E::read(gate + j + l), u[l] = E::read(up + j + l);
        lanes_of(Vec::load(g), Vec::load(u)).store(r);
        for (int64_t l = 0; j + l < width; ++l) E::write(o + j + l, r[l]);
      }
    }
  });
}

// out[t] = round(residual[t] + round(x[t] * multiplier)) (without the inner rounding where the
// multiplier is 1), x [T, N] contiguous, residual and out [T, >= N] with their own row strides.
template <typename T>
void add_to_residual(const T* x, const T* residual, int64_t ldr, float multiplier, T* out, int64_t ldo,
                     int64_t tokens, int64_t width) {
  using E = Element<T>;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < width; ++c) {
        float value = E::read(x + t * width + c);
        if (multiplier != 1.f) {
          T scaled;
          E::write(&scaled, value * multiplier);
          value = E::read(&scaled);
        }
        E::write(out + t * ldo + c, E::read(residual + t * ldr + c) + value);
      }
  });
}

}  // namespace

// RMSNorm of every row (the layers' norms, and the final norm before the LM head): see rms_norm.
at::Tensor rms_norm_rows(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1 && hidden.size(1) == weight.size(0) &&
                  weight.scalar_type() == hidden.scalar_type() && weight.is_contiguous(),
              "rms_norm_rows: hidden [T, H] and weight [H] must share a dtype");
  auto out = at::empty(hidden.sizes(), hidden.options());
  for_each_dtype(hidden.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm<T>(hidden.data_ptr<T>(), hidden.stride(0), weight.data_ptr<T>(), static_cast<float>(eps),
                out.data_ptr<T>(), hidden.size(0), hidden.size(1));
  });
  return out;
}

// A decoder layer's weights and shape; see the file header. `qkv`, `o` and `mlp` (gate_up and down,
// or none for a layer whose MLP runs elsewhere: a mixture of experts, moe_cpu.cpp) hold this rank's
// output columns (all of them without tensor parallelism), the norms and RoPE tables
// (cos and signed sin, [positions, D] float32) are whole. `norms` are the RMSNorm weights before
// attention, after it, before the MLP and after it, each [hidden] or empty (none there); a norm
// after attention or the MLP covers whole rows, so under tensor parallelism such a layer projects,
// gathers and joins in separate calls. `scale` multiplies the scores, `softcap` caps them (0: none),
// `sinks` are this rank's heads' attention-sink logits (float32 [heads], or empty), `gate` (with
// `alpha` and `limit`) is the MLP's Gate kind, and `residual_multiplier` scales each output before it joins the residual.
struct DecoderLayerCpu : torch::CustomClassHolder {
  DecoderLayerCpu(c10::intrusive_ptr<PackedLinear> qkv, c10::intrusive_ptr<PackedLinear> o,
                  std::vector<c10::intrusive_ptr<PackedLinear>> mlp, std::vector<at::Tensor> norms, at::Tensor cos, at::Tensor signed_sin, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, double eps, int64_t window, at::Tensor q_norm, at::Tensor k_norm,
                  bool rotary, double scale, double softcap, at::Tensor sinks, int64_t gate, double alpha,
                  double limit, double residual_multiplier)
      : qkv_(std::move(qkv)),
        o_(std::move(o)),
        cos_(cos.contiguous()),
        signed_sin_(signed_sin.contiguous()),
        heads_(heads),
        kv_heads_(kv_heads),
        dim_(head_dim),
        eps_(static_cast<float>(eps)),
        window_(window),
        q_norm_(q_norm.contiguous()),
        k_norm_(k_norm.contiguous()),
        rotary_(rotary),
        scale_(scale),
        softcap_(softcap),
        sinks_(sinks.contiguous()),
        gate_{static_cast<Gate::Kind>(gate), static_cast<float>(alpha), static_cast<float>(limit)},
        residual_multiplier_(static_cast<float>(residual_multiplier)) {
    TORCH_CHECK(norms.size() == 4, "DecoderLayer: four norms (before and after attention and the MLP), empty or not");
    TORCH_CHECK(mlp.size() == 2 || mlp.empty(), "DecoderLayer: the MLP is gate_up and down, or none");
    TORCH_CHECK(gate >= Gate::kSilu && gate <= Gate::kClampedSwiglu, "DecoderLayer: unknown gate kind ", gate);
    if (!mlp.empty()) gate_up_ = mlp[0], down_ = mlp[1];
    for (auto& norm : norms) norm = norm.contiguous();
    before_attention_norm_ = norms[0], after_attention_norm_ = norms[1];
    before_mlp_norm_ = norms[2], after_mlp_norm_ = norms[3];
    TORCH_CHECK(qkv_->out_features() == (heads + 2 * kv_heads) * head_dim, "DecoderLayer: qkv has ",
                qkv_->out_features(), " outputs, not (", heads, " + 2 x ", kv_heads, ") x ", head_dim);
    TORCH_CHECK(!gate_up_ || gate_up_->out_features() % 2 == 0,
                "DecoderLayer: gate_up must have an even number of outputs");
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && signed_sin_.scalar_type() == at::kFloat &&
                    cos_.size(1) == head_dim && signed_sin_.sizes() == cos_.sizes(),
                "DecoderLayer: RoPE tables must be float32 [positions, head_dim]");
    const bool per_head = q_norm_.numel() == head_dim && k_norm_.numel() == head_dim;
    const bool whole = q_norm_.numel() == heads * head_dim && k_norm_.numel() == kv_heads * head_dim;
    TORCH_CHECK((q_norm_.numel() == 0 && k_norm_.numel() == 0) || per_head || whole,
                "DecoderLayer: q and k norms must be [head_dim] each, [heads x head_dim] and [kv heads x head_dim], "
                "or both empty");
  }

  // The attention output [T, heads * D] of this rank's heads for hidden [T, hidden]; writes the
  // tokens' keys and values into the caches.
  at::Tensor attention(const at::Tensor& hidden, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& positions, const at::Tensor& slot_rows, const at::Tensor& block_tables,
                       const at::Tensor& token_sequences) const {
    return attention_with_deltas(hidden, k_cache, v_cache, positions, slot_rows, block_tables, token_sequences,
                                 no_rows(), no_rows());
  }

  // attention() with LoRA: `delta` [R, (H + 2 Hkv) * D] (float32) added to the q/k/v projection of
  // the rows `rows` [R] (int64) before their norms and RoPE; the other rows as attention() has them.
  at::Tensor attention_with_deltas(const at::Tensor& hidden, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& positions, const at::Tensor& slot_rows,
                                   const at::Tensor& block_tables, const at::Tensor& token_sequences,
                                   const at::Tensor& rows, const at::Tensor& delta) const {
    const int64_t tokens = hidden.size(0);
    TORCH_CHECK(k_cache.scalar_type() == hidden.scalar_type() && v_cache.scalar_type() == hidden.scalar_type(),
                "DecoderLayer: the KV cache must be in the activations' dtype");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(3) == dim_ &&
                    v_cache.size(3) == dim_ + 1,
                "DecoderLayer: caches must be contiguous [blocks, kv heads, block size, D (+1)]");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == tokens &&
                    slot_rows.scalar_type() == at::kLong && slot_rows.is_contiguous() &&
                    slot_rows.size(0) == tokens * kv_heads_,
                "DecoderLayer: positions [T] and slot rows [T x kv heads] must be contiguous int64");
    const int64_t* p = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(p[t] >= 0 && p[t] < cos_.size(0), "DecoderLayer: position ", p[t], " is past the RoPE tables");
    const int64_t* slots = slot_rows.data_ptr<int64_t>();
    const int64_t cache_rows = k_cache.numel() / dim_;
    for (int64_t i = 0; i < tokens * kv_heads_; ++i)
      TORCH_CHECK(slots[i] >= 0 && slots[i] < cache_rows, "DecoderLayer: slot row ", slots[i], " is outside the cache");
    const at::Tensor qkv = qkv_->forward(normed(hidden, before_attention_norm_));
    add_to_rows(qkv, rows, delta);
    auto q = at::empty({tokens, heads_, dim_}, hidden.options().dtype(at::kFloat));
    for_each_dtype(hidden.scalar_type(), [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      if (q_norm_.numel() > 0) {
        TORCH_CHECK(q_norm_.scalar_type() == hidden.scalar_type() && k_norm_.scalar_type() == hidden.scalar_type(),
                    "DecoderLayer: q/k norms must be in the activations' dtype");
        norm_queries_and_keys<T>(qkv.data_ptr<T>(), tokens, heads_, kv_heads_, dim_, q_norm_.data_ptr<T>(),
                                 k_norm_.data_ptr<T>(), eps_, q_norm_.numel() != dim_);
      }
      rotate_and_store<T>(qkv.data_ptr<T>(), tokens, heads_, kv_heads_, dim_, cos_.data_ptr<float>(),
                          signed_sin_.data_ptr<float>(), positions.data_ptr<int64_t>(),
                          slot_rows.data_ptr<int64_t>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                          q.data_ptr<float>(), rotary_);
    });
    auto out = at::empty({tokens, heads_ * dim_}, hidden.options());
    paged_attention_into(q, k_cache, v_cache, block_tables, token_sequences, positions, scale_, window_, softcap_,
                         sinks_, out);
    return out;
  }

  // residual + O(heads), for the attention output of every head [T, all heads * D] and residual
  // [T, O's outputs] (this rank's columns of the hidden state).
  at::Tensor output(const at::Tensor& heads, const at::Tensor& residual) const {
    return joined(*o_, heads, after_attention_norm_, residual);
  }

  // Under tensor parallelism with norms after attention and the MLP, which need whole rows: this
  // rank's columns of the O (down) projection, and, once gathered, the residual plus their norm
  // times the multiplier; the same operations output() and down() run in one process.
  at::Tensor project_output(const at::Tensor& heads) const { return o_->forward(heads); }
  at::Tensor join_attention(const at::Tensor& part, const at::Tensor& residual) const {
    return join(part, after_attention_norm_, residual);
  }
  at::Tensor project_down(const at::Tensor& activation) const { return dense_down().forward(activation); }
  at::Tensor join_mlp(const at::Tensor& part, const at::Tensor& residual) const {
    return join(part, after_mlp_norm_, residual);
  }

  // output() with LoRA: for the rows `rows`, `delta` [R, O's outputs] (float32) added to O(heads)
  // before its norm and the residual; the other rows as output() has them.
  at::Tensor output_with_deltas(const at::Tensor& heads, const at::Tensor& residual, const at::Tensor& rows,
                                const at::Tensor& delta) const {
    return with_row_deltas(output(heads, residual), *o_, heads, after_attention_norm_, residual, rows, delta);
  }

  // act(gate) * up [T, this rank's intermediate columns] for hidden [T, hidden].
  at::Tensor mlp(const at::Tensor& hidden) const { return mlp_with_deltas(hidden, no_rows(), no_rows()); }

  // mlp() with LoRA: `delta` [R, 2 x intermediate] (float32) added to gate_up of the rows `rows`
  // before the gate meets up.
  at::Tensor mlp_with_deltas(const at::Tensor& hidden, const at::Tensor& rows, const at::Tensor& delta) const {
    dense_down();
    const at::Tensor gate_up = gate_up_->forward(normed(hidden, before_mlp_norm_));
    add_to_rows(gate_up, rows, delta);
    const int64_t width = gate_up_->out_features() / 2;
    auto out = at::empty({hidden.size(0), width}, hidden.options());
    for_each_dtype(hidden.scalar_type(), [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      activate_and_multiply<T>(gate_up.data_ptr<T>(), hidden.size(0), width,
                               gate_, out.data_ptr<T>());
    });
    return out;
  }

  // residual + down(activation), for the activation of every intermediate column.
  at::Tensor down(const at::Tensor& activation, const at::Tensor& residual) const {
    return joined(dense_down(), activation, after_mlp_norm_, residual);
  }

  // down() with LoRA: for the rows `rows`, `delta` [R, hidden] (float32) added to down(activation)
  // before its norm and the residual.
  at::Tensor down_with_deltas(const at::Tensor& activation, const at::Tensor& residual, const at::Tensor& rows,
                              const at::Tensor& delta) const {
    return with_row_deltas(down(activation, residual), dense_down(), activation, after_mlp_norm_, residual, rows,
                           delta);
  }

  // The whole layer without tensor parallelism: hidden [T, hidden] -> [T, hidden].
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& positions, const at::Tensor& slot_rows, const at::Tensor& block_tables,
                     const at::Tensor& token_sequences) const {
    const at::Tensor attended =
        output(attention(hidden, k_cache, v_cache, positions, slot_rows, block_tables, token_sequences), hidden);
    return down(mlp(attended), attended);
  }

 private:
  // The dense MLP's down projection; an error in a layer without one.
  const PackedLinear& dense_down() const {
    TORCH_CHECK(down_, "DecoderLayer: this layer's MLP runs elsewhere (a mixture of experts)");
    return *down_;
  }

  static at::Tensor no_rows() { return at::empty({0}, at::TensorOptions().dtype(at::kLong)); }

  // x's rows `rows` plus `delta`'s (float32 [R, x's columns]), in place, rounded to x's dtype. Each
  // row's result depends on that row alone.
  static void add_to_rows(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& delta) {
    if (rows.numel() == 0) return;
    TORCH_CHECK(rows.scalar_type() == at::kLong && delta.scalar_type() == at::kFloat && delta.dim() == 2 &&
                    delta.size(0) == rows.size(0) && delta.size(1) == x.size(1) && x.is_contiguous() &&
                    delta.is_contiguous(),
                "DecoderLayer: LoRA deltas must be float32 [rows, outputs] for int64 rows");
    const int64_t width = x.size(1), count = rows.size(0);
    const int64_t* row = rows.data_ptr<int64_t>();
    const float* added = delta.data_ptr<float>();
    for_each_dtype(x.scalar_type(), [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      using E = Element<T>;
      T* values = static_cast<T*>(x.data_ptr());  // the tensor's handle is const, its values are this step's own
      for (int64_t i = 0; i < count; ++i) {
        TORCH_CHECK(row[i] >= 0 && row[i] < x.size(0), "DecoderLayer: LoRA row ", row[i], " out of range");
        T* target = values + row[i] * width;
        const float* d = added + i * width;
        int64_t c = 0;
        for (; c + kLanes <= width; c += kLanes) E::write16(target + c, Vec::add(E::read16(target + c), Vec::load(d + c)));
        for (; c < width; ++c) E::write(target + c, E::read(target + c) + d[c]);
      }
    });
  }

  // `out` (the projection joined for every row) with the rows `rows` given their deltas:
  // residual + norm(projection(x) + delta) x multiplier. Without a norm after the projection or a
  // multiplier that is out + delta; otherwise those rows are joined again from their projection.
  at::Tensor with_row_deltas(at::Tensor out, const PackedLinear& projection, const at::Tensor& x,
                             const at::Tensor& after_norm, const at::Tensor& residual, const at::Tensor& rows,
                             const at::Tensor& delta) const {
    if (rows.numel() == 0) return out;
    if (after_norm.numel() == 0 && residual_multiplier_ == 1.f) {
      add_to_rows(out, rows, delta);
      return out;
    }
    const at::Tensor part = projection.forward(x.index_select(0, rows).contiguous());
    add_to_rows(part, at::arange(rows.size(0), rows.options()), delta);
    out.index_copy_(0, rows, join(part, after_norm, residual.index_select(0, rows).contiguous()));
    return out;
  }

  // The RMSNorm of hidden's rows by `weight`, or hidden itself where the weight is empty.
  at::Tensor normed(const at::Tensor& hidden, const at::Tensor& weight) const {
    return weight.numel() == 0 ? hidden : rms_norm_rows(hidden, weight, eps_);
  }

  // residual + the projection of x, normalised by `after_norm` (if not empty) and times the
  // residual multiplier; the residual add is the projection's epilogue where neither applies.
  at::Tensor joined(const PackedLinear& projection, const at::Tensor& x, const at::Tensor& after_norm,
                    const at::Tensor& residual) const {
    if (after_norm.numel() == 0 && residual_multiplier_ == 1.f) {
      auto out = at::empty({x.size(0), projection.out_features()}, x.options());
      projection.forward_into(x, out, 0, residual);
      return out;
    }
    return join(projection.forward(x), after_norm, residual);
  }

  // residual + (the RMSNorm of part by `after_norm`, if not empty) x the residual multiplier.
  at::Tensor join(const at::Tensor& part, const at::Tensor& after_norm, const at::Tensor& residual) const {
    const int64_t tokens = part.size(0), width = part.size(1);
    TORCH_CHECK(part.is_contiguous() && part.scalar_type() == residual.scalar_type(),
                "DecoderLayer: a projection's output must be contiguous, in the residual's dtype");
    TORCH_CHECK(residual.dim() == 2 && residual.size(0) == tokens && residual.size(1) == width &&
                    residual.stride(1) == 1,
                "DecoderLayer: the residual must be [T, outputs] with unit column stride");
    TORCH_CHECK(after_norm.numel() == 0 || after_norm.size(0) == width,
                "DecoderLayer: a norm after a projection covers whole rows (gathered under tensor parallelism)");
    const at::Tensor normalised = normed(part, after_norm);
    auto out = at::empty({tokens, width}, part.options());
    for_each_dtype(part.scalar_type(), [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      add_to_residual<T>(normalised.data_ptr<T>(), residual.data_ptr<T>(), residual.stride(0), residual_multiplier_,
                         out.data_ptr<T>(), out.stride(0), tokens, width);
    });
    return out;
  }

  c10::intrusive_ptr<PackedLinear> qkv_, o_, gate_up_, down_;  // gate_up_ and down_ null without a dense MLP
  at::Tensor before_attention_norm_, after_attention_norm_, before_mlp_norm_, after_mlp_norm_;
  at::Tensor cos_, signed_sin_;
  int64_t heads_, kv_heads_, dim_;
  float eps_;
  int64_t window_;  // the attention's sliding window (paged_attention_into), 0 for none
  at::Tensor q_norm_, k_norm_;  // q and k RMSNorm weights, per head [D] or per projection, or empty
  bool rotary_;                 // whether the layer applies RoPE
  double scale_, softcap_;      // of the attention scores (paged_attention_into)
  at::Tensor sinks_;            // this rank's heads' attention-sink logits (float32), or empty
  Gate gate_;                   // how the MLP's gate meets its up projection
  float residual_multiplier_;   // each output's factor before the residual add
};

}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) {
  m.class_<shoal::DecoderLayerCpu>("DecoderLayer")
      .def(torch::init<c10::intrusive_ptr<shoal::PackedLinear>, c10::intrusive_ptr<shoal::PackedLinear>,
                       std::vector<c10::intrusive_ptr<shoal::PackedLinear>>, std::vector<at::Tensor>, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, int64_t,
                       at::Tensor, at::Tensor, bool, double, double, at::Tensor, int64_t, double, double, double>())
      .def("attention", &shoal::DecoderLayerCpu::attention)
      .def("attention_with_deltas", &shoal::DecoderLayerCpu::attention_with_deltas)
      .def("output_with_deltas", &shoal::DecoderLayerCpu::output_with_deltas)
      .def("mlp_with_deltas", &shoal::DecoderLayerCpu::mlp_with_deltas)
      .def("down_with_deltas", &shoal::DecoderLayerCpu::down_with_deltas)
      .def("output", &shoal::DecoderLayerCpu::output)
      .def("mlp", &shoal::DecoderLayerCpu::mlp)
      .def("down", &shoal::DecoderLayerCpu::down)
      .def("project_output", &shoal::DecoderLayerCpu::project_output)
      .def("join_attention", &shoal::DecoderLayerCpu::join_attention)
      .def("project_down", &shoal::DecoderLayerCpu::project_down)
      .def("join_mlp", &shoal::DecoderLayerCpu::join_mlp)
      .def("forward", &shoal::DecoderLayerCpu::forward);
  m.def("rms_norm_rows", &shoal::rms_norm_rows);
}
