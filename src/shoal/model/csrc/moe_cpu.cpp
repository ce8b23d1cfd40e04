// A sparse layer's MLP on CPUs (model/moe.py's MixtureOfExperts, without Python between experts):
//
//   router:  logits = x @ router.T (PackedLinear), then per row the family's rule: softmax over the
//            experts and the best k ("softmax_topk"), or the best k logits and softmax over them
//            ("topk_softmax"); the k weights divided by their sum where `normalize`
//   experts: for each expert with rows routed to it, in ascending index: its rows gathered, then
//            act(gate) * up and down (PackedLinear, activate_and_multiply), and each row's output
//            times its weight added to the row's float32 sum
//   out:     each row's sum rounded once to x's dtype
//
// Invariant (batch invariance): a row's routing is computed from its own logits alone; PackedLinear's
// rows do not depend on how many rows share a call; and a row's sum starts at zero and adds its experts
// in ascending index, whatever other rows chose. So no bit of a row depends on the batch.
// Part of shoal_cpu_kernels.cpp's translation unit: it uses decoder_layer_cpu.cpp's
// for_each_dtype, Element and activate_and_multiply.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "linear_cpu.h"

namespace shoal {
namespace {

// Row r's experts (ascending index) and their weights, from its logits.
void route_row(const float* logits, int64_t experts, int64_t k, bool softmax_first, bool normalize, int64_t* chosen,
               float* weights) {
  std::vector<float> score(logits, logits + experts);
  auto softmax = [](float* values, int64_t n) {
    const float top = *std::max_element(values, values + n);
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) total += (values[i] = std::exp(values[i] - top));
    for (int64_t i = 0; i < n; ++i) values[i] /= total;
  };
  if (softmax_first) softmax(score.data(), experts);
  std::vector<int64_t> order(experts);
  std::iota(order.begin(), order.end(), 0);
  // The best k by score, ties to the lower index.
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  std::vector<float> best(k);
  for (int64_t i = 0; i < k; ++i) best[i] = score[order[i]];
  if (!softmax_first) softmax(best.data(), k);
  if (normalize) {
    float total = 0.f;
    for (int64_t i = 0; i < k; ++i) total += best[i];
    for (int64_t i = 0; i < k; ++i) best[i] /= total;
  }
  std::vector<int64_t> by_index(k);
  std::iota(by_index.begin(), by_index.end(), 0);
  std::sort(by_index.begin(), by_index.end(), [&](int64_t a, int64_t b) { return order[a] < order[b]; });
  for (int64_t i = 0; i < k; ++i) chosen[i] = order[by_index[i]], weights[i] = best[by_index[i]];
}

}  // namespace

// Which rows each expert held here runs (experts [held_from, held_from + held) of the router's; all
// of them but under expert parallelism): the held experts with rows (ascending, counted from
// held_from), where each one's rows start in the rows-by-expert order (expert ascending, then token
// ascending), and the place in that order of each (token, choice), -1 for an expert not held.
struct ExpertRows {
  std::vector<int64_t> active, first, place;
  ExpertRows(const at::Tensor& chosen, int64_t experts, int64_t held_from, int64_t held)
      : first(held + 1, 0), place(chosen.numel(), -1) {
    const int64_t* c = chosen.data_ptr<int64_t>();
    for (int64_t i = 0; i < chosen.numel(); ++i) {
      TORCH_CHECK(c[i] >= 0 && c[i] < experts, "MixtureOfExperts: expert ", c[i], " of ", experts);
      if (c[i] >= held_from && c[i] < held_from + held) ++first[c[i] - held_from + 1];
    }
    for (int64_t e = 0; e < held; ++e) {
      if (first[e + 1]) active.push_back(e);
      first[e + 1] += first[e];
    }
    std::vector<int64_t> filled(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < chosen.numel(); ++i)
      if (c[i] >= held_from && c[i] < held_from + held) place[i] = filled[c[i] - held_from]++;
  }
  int64_t rows() const { return first.back(); }
};

// `router` [experts, hidden]; per expert, `gate_up` [2 x intermediate, hidden] (gate rows first)
// and `down` [outputs, intermediate] (every expert alike); `rule` "softmax_topk" or
// "topk_softmax"; `gate` the gate's kind (decoder_layer_cpu.cpp's Gate: 0 SiLU, 1 GELU-tanh, 2
// clamped SwiGLU with `alpha` and `limit`). Under tensor parallelism each rank holds its
// columns of every expert's intermediate (gate_up's rows) and of the hidden state (down's rows):
// route, activations, the gather of the activations' columns, combine, then the gather of the
// output's columns compute what forward() does in one process, bit for bit. Under expert
// parallelism a rank holds whole experts, those from `held_from` (gate_up and down list them): route,
// expert_outputs, their sum over ranks (each output comes from one rank, the others add zeros) and
// weighted_sum compute forward()'s bits.
struct MixtureOfExpertsCpu : torch::CustomClassHolder {
  MixtureOfExpertsCpu(c10::intrusive_ptr<PackedLinear> router, std::vector<c10::intrusive_ptr<PackedLinear>> gate_up,
                      std::vector<c10::intrusive_ptr<PackedLinear>> down, int64_t held_from, int64_t experts_per_token,
                      std::string rule, bool normalize, int64_t gate, double alpha, double limit)
      : router_(std::move(router)),
        gate_up_(std::move(gate_up)),
        down_(std::move(down)),
        held_from_(held_from),
        k_(experts_per_token),
        softmax_first_(rule == "softmax_topk"),
        normalize_(normalize),
        gate_{static_cast<Gate::Kind>(gate), static_cast<float>(alpha), static_cast<float>(limit)} {
    TORCH_CHECK(gate >= Gate::kSilu && gate <= Gate::kClampedSwiglu, "MixtureOfExperts: unknown gate kind ", gate);
    const int64_t experts = router_->out_features();
    TORCH_CHECK(rule == "softmax_topk" || rule == "topk_softmax", "MixtureOfExperts: unknown routing rule ", rule);
    const int64_t held = static_cast<int64_t>(gate_up_.size());
    TORCH_CHECK(held >= 1 && static_cast<int64_t>(down_.size()) == held && held_from >= 0 && held_from + held <= experts,
                "MixtureOfExperts: the router scores ", experts, " experts, but ", gate_up_.size(), " and ",
                down_.size(), " projections were given from expert ", held_from);
    TORCH_CHECK(k_ >= 1 && k_ <= experts, "MixtureOfExperts: experts per token must be 1 to ", experts);
    for (int64_t e = 0; e < held; ++e)
      TORCH_CHECK(gate_up_[e]->out_features() == gate_up_[0]->out_features() && gate_up_[e]->out_features() % 2 == 0 &&
                      gate_up_[e]->in_features() == router_->in_features() &&
                      down_[e]->in_features() == down_[0]->in_features() &&
                      down_[e]->out_features() == down_[0]->out_features(),
                  "MixtureOfExperts: expert ", e, "'s projections differ from the others' or the hidden size");
  }

  // Each row's experts [T, k] (int64, ascending index) and their weights [T, k] (float32), by the
  // routing rule, from x [T, hidden] (normalised).
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x) const {
    const int64_t tokens = x.size(0), experts = router_->out_features();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == router_->in_features() && x.is_contiguous(),
                "MixtureOfExperts: x must be [T, ", router_->in_features(), "] contiguous");
    const at::Tensor logits = router_->forward(x).to(at::kFloat).contiguous();
    at::Tensor chosen = at::empty({tokens, k_}, x.options().dtype(at::kLong));
    at::Tensor weights = at::empty({tokens, k_}, x.options().dtype(at::kFloat));
    const float* l = logits.data_ptr<float>();
    int64_t* c = chosen.data_ptr<int64_t>();
    float* w = weights.data_ptr<float>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        route_row(l + t * experts, experts, k_, softmax_first_, normalize_, c + t * k_, w + t * k_);
    });
    return {chosen, weights};
  }

  // act(gate) * up of every (row, chosen expert) [T x k, this rank's intermediate columns], in the
  // rows-by-expert order (ExpertRows), in x's dtype.
  at::Tensor activations(const at::Tensor& x, const at::Tensor& chosen) const {
    check_all_held();
    return held_activations(x, chosen, rows_of(chosen));
  }

  // Each row's weighted sum of its experts' down projections [T, this rank's output columns], from
  // the activations of every intermediate column [T x k, intermediate] (rows by expert): each row's
  // sum from zero in float32, its experts in ascending index, rounded once to the dtype.
  at::Tensor combine(const at::Tensor& activation, const at::Tensor& chosen, const at::Tensor& weights) const {
    check_all_held();
    TORCH_CHECK(activation.dim() == 2 && activation.size(0) == chosen.numel() &&
                    activation.size(1) == down_[0]->in_features() && activation.is_contiguous(),
                "MixtureOfExperts: activations must be [T x k, ", down_[0]->in_features(), "] contiguous");
    const ExpertRows rows = rows_of(chosen);
    const std::vector<at::Tensor> projected = each_expert(down_, rows, activation);
    return sum_rows(projected, rows, chosen, 0, weights, activation.scalar_type());
  }

  // Under expert parallelism: the down projection of act(gate) * up of each (row, choice) whose
  // expert is held here, [T x k, hidden] in (row, choice) order, in x's dtype; zeros for the others.
  at::Tensor expert_outputs(const at::Tensor& x, const at::Tensor& chosen) const {
    const ExpertRows rows = rows_of(chosen);
    const int64_t outputs = down_[0]->out_features();
    at::Tensor out = at::zeros({chosen.numel(), outputs}, x.options());
    if (rows.rows() == 0) return out;
    const std::vector<at::Tensor> projected = each_expert(down_, rows, held_activations(x, chosen, rows));
    const int64_t bytes = outputs * x.element_size();
    std::vector<const char*> rows_of_expert(gate_up_.size(), nullptr);  // expert e's rows, from row first[e]
    for (size_t j = 0; j < rows.active.size(); ++j)
      rows_of_expert[rows.active[j]] =
          static_cast<const char*>(projected[j].data_ptr()) - rows.first[rows.active[j]] * bytes;
    const int64_t* c = chosen.data_ptr<int64_t>();
    char* target = static_cast<char*>(out.data_ptr());
    at::parallel_for(0, chosen.numel(), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (rows.place[i] >= 0)
          std::memcpy(target + i * bytes, rows_of_expert[c[i] - held_from_] + rows.place[i] * bytes, bytes);
    });
    return out;
  }

  // Each row's sum of its experts' outputs [T x k, hidden] ((row, choice) order, every expert's:
  // expert_outputs summed over the ranks) times their weights [T, k], as combine sums them.
  at::Tensor weighted_sum(const at::Tensor& outputs, const at::Tensor& weights) const {
    TORCH_CHECK(outputs.dim() == 2 && outputs.size(0) == weights.numel() && weights.size(1) == k_ &&
                    outputs.size(1) == down_[0]->out_features() && outputs.is_contiguous(),
                "MixtureOfExperts: outputs must be [T x ", k_, ", ", down_[0]->out_features(), "] contiguous");
    // As one expert whose rows are the slots in order.
    const at::Tensor one = at::zeros({outputs.size(0), 1}, weights.options().dtype(at::kLong));
    return sum_rows({outputs}, ExpertRows(one, 1, 0, 1), one, 0, weights, outputs.scalar_type());
  }

  // x [T, hidden] (normalised) -> [T, hidden] in x's dtype, in one process.
  at::Tensor forward(const at::Tensor& x) const {
    const auto [chosen, weights] = route(x);
    return combine(activations(x, chosen), chosen, weights);
  }

 private:
  ExpertRows rows_of(const at::Tensor& chosen) const {
    return ExpertRows(chosen, router_->out_features(), held_from_, static_cast<int64_t>(gate_up_.size()));
  }

  void check_all_held() const {
    TORCH_CHECK(held_from_ == 0 && static_cast<int64_t>(gate_up_.size()) == router_->out_features(),
                "MixtureOfExperts: this process holds some experts only (expert parallelism): use expert_outputs");
  }

  // act(gate) * up of each (row, choice) of a held expert [rows, intermediate], rows by expert.
  at::Tensor held_activations(const at::Tensor& x, const at::Tensor& chosen, const ExpertRows& rows) const {
    const int64_t hidden = router_->in_features();
    at::Tensor gathered = at::empty({rows.rows(), hidden}, x.options());
    const int64_t bytes = hidden * x.element_size();
    const char* source = static_cast<const char*>(x.data_ptr());
    char* target = static_cast<char*>(gathered.data_ptr());
    at::parallel_for(0, chosen.numel(), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (rows.place[i] >= 0) std::memcpy(target + rows.place[i] * bytes, source + i / k_ * bytes, bytes);
    });
    const std::vector<at::Tensor> projected = each_expert(gate_up_, rows, gathered);
    const int64_t width = gate_up_[0]->out_features() / 2;
    at::Tensor out = at::empty({rows.rows(), width}, x.options());
    for_each_dtype(x.scalar_type(), [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      at::parallel_for(0, static_cast<int64_t>(rows.active.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j)
          activate_and_multiply<T>(projected[j].data_ptr<T>(), projected[j].size(0), width, gate_,
                                   out.data_ptr<T>() + rows.first[rows.active[j]] * width);
      });
    });
    return out;
  }

  // Each row's weighted sum, from zero in float32 over its choices in order (ascending expert),
  // rounded once to `dtype`; choice i of row t reads row place[t x k + i] of the outputs of its
  // expert, chosen[t x k + i] - from (projected[j] holds active expert j's rows).
  static at::Tensor sum_rows(const std::vector<at::Tensor>& projected, const ExpertRows& rows, const at::Tensor& chosen,
                             int64_t from, const at::Tensor& weights, at::ScalarType dtype) {
    const int64_t k = weights.size(1);
    const int64_t tokens = weights.size(0), outputs = projected.empty() ? 0 : projected[0].size(1);
    at::Tensor sums = at::zeros({tokens, outputs}, weights.options());
    if (rows.active.empty()) return sums.to(dtype);
    float* s = sums.data_ptr<float>();
    const float* w = weights.data_ptr<float>();
    for_each_dtype(dtype, [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      using E = Element<T>;
      std::vector<const T*> output_of(rows.first.size() - 1, nullptr);  // expert e's rows, from first[e]
      for (size_t j = 0; j < rows.active.size(); ++j)
        output_of[rows.active[j]] = projected[j].data_ptr<T>() - rows.first[rows.active[j]] * outputs;
      const int64_t* c = chosen.data_ptr<int64_t>();
      at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          float* row = s + t * outputs;
          for (int64_t i = 0; i < k; ++i) {
            const int64_t slot = t * k + i;
            const T* y = output_of[c[slot] - from] + rows.place[slot] * outputs;
            const float weight = w[slot];
            for (int64_t col = 0; col < outputs; ++col) row[col] += weight * E::read(y + col);
          }
        }
      });
    });
    return sums.to(dtype);
  }

  // Each active expert's rows of `input` (rows by expert) through its matrix of `matrices`, all in
  // one parallel region (PackedLinear::forward_group).
  static std::vector<at::Tensor> each_expert(const std::vector<c10::intrusive_ptr<PackedLinear>>& matrices,
                                             const ExpertRows& rows, const at::Tensor& input) {
    std::vector<const PackedLinear*> linears;
    std::vector<at::Tensor> inputs;
    for (int64_t e : rows.active) {
      linears.push_back(matrices[e].get());
      inputs.push_back(input.narrow(0, rows.first[e], rows.first[e + 1] - rows.first[e]));
    }
    return PackedLinear::forward_group(linears, inputs);
  }

  c10::intrusive_ptr<PackedLinear> router_;
  std::vector<c10::intrusive_ptr<PackedLinear>> gate_up_, down_;
  int64_t held_from_;  // the first expert held here; gate_up_ and down_ hold the next ones
  int64_t k_;
  bool softmax_first_, normalize_;
  Gate gate_;
};

}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) {
  m.class_<shoal::MixtureOfExpertsCpu>("MixtureOfExperts")
      .def(torch::init<c10::intrusive_ptr<shoal::PackedLinear>, std::vector<c10::intrusive_ptr<shoal::PackedLinear>>,
                       std::vector<c10::intrusive_ptr<shoal::PackedLinear>>, int64_t, int64_t, std::string, bool,
                       int64_t, double, double>())
      .def("route", &shoal::MixtureOfExpertsCpu::route)
      .def("activations", &shoal::MixtureOfExpertsCpu::activations)
      .def("combine", &shoal::MixtureOfExpertsCpu::combine)
      .def("expert_outputs", &shoal::MixtureOfExpertsCpu::expert_outputs)
      .def("weighted_sum", &shoal::MixtureOfExpertsCpu::weighted_sum)
      .def("forward", &shoal::MixtureOfExpertsCpu::forward);
}
