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
// Part of the one translation unit (shoal_cpu_kernels.cpp): it uses decoder_layer_cpu.cpp's
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

// `router` [experts, hidden]; per expert, `gate_up` [2 x its intermediate, hidden] (gate rows
// first) and `down` [hidden, intermediate]; `rule` "softmax_topk" or "topk_softmax"; `gelu` picks
// GELU-tanh over SiLU.
struct MixtureOfExpertsCpu : torch::CustomClassHolder {
  MixtureOfExpertsCpu(c10::intrusive_ptr<PackedLinear> router, std::vector<c10::intrusive_ptr<PackedLinear>> gate_up,
                      std::vector<c10::intrusive_ptr<PackedLinear>> down, int64_t experts_per_token, std::string rule,
                      bool normalize, bool gelu)
      : router_(std::move(router)),
        gate_up_(std::move(gate_up)),
        down_(std::move(down)),
        k_(experts_per_token),
        softmax_first_(rule == "softmax_topk"),
        normalize_(normalize),
        gelu_(gelu) {
    const int64_t experts = router_->out_features();
    TORCH_CHECK(rule == "softmax_topk" || rule == "topk_softmax", "MixtureOfExperts: unknown routing rule ", rule);
    TORCH_CHECK(static_cast<int64_t>(gate_up_.size()) == experts && static_cast<int64_t>(down_.size()) == experts,
                "MixtureOfExperts: the router scores ", experts, " experts, but ", gate_up_.size(), " and ",
                down_.size(), " projections were given");
    TORCH_CHECK(k_ >= 1 && k_ <= experts, "MixtureOfExperts: experts per token must be 1 to ", experts);
    for (int64_t e = 0; e < experts; ++e)
      TORCH_CHECK(gate_up_[e]->out_features() == 2 * down_[e]->in_features() &&
                      down_[e]->out_features() == router_->in_features(),
                  "MixtureOfExperts: expert ", e, "'s projections do not fit each other or the hidden size");
  }

  // x [T, hidden] (normalised) -> [T, hidden] in x's dtype.
  at::Tensor forward(const at::Tensor& x) const {
    const int64_t tokens = x.size(0), hidden = router_->in_features(), experts = router_->out_features();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.is_contiguous(), "MixtureOfExperts: x must be [T, ", hidden,
                "] contiguous");
    const at::Tensor logits = router_->forward(x).to(at::kFloat).contiguous();
    std::vector<int64_t> chosen(tokens * k_);
    std::vector<float> weights(tokens * k_);
    const float* l = logits.data_ptr<float>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        route_row(l + t * experts, experts, k_, softmax_first_, normalize_, &chosen[t * k_], &weights[t * k_]);
    });
    // The experts with rows, ascending; each one's rows (ascending), gathered; and where each
    // (row, choice) finds its output.
    std::vector<int64_t> active, first_row(experts + 1, 0), place(tokens * k_);
    for (int64_t i = 0; i < tokens * k_; ++i) ++first_row[chosen[i] + 1];
    for (int64_t e = 0; e < experts; ++e) {
      if (first_row[e + 1]) active.push_back(e);
      first_row[e + 1] += first_row[e];
    }
    at::Tensor gathered = at::empty({tokens * k_, hidden}, x.options());
    std::vector<int64_t> filled(first_row.begin(), first_row.end() - 1);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < k_; ++i) place[t * k_ + i] = filled[chosen[t * k_ + i]]++;
    const int64_t bytes = hidden * x.element_size();
    const char* source = static_cast<const char*>(x.data_ptr());
    char* target = static_cast<char*>(gathered.data_ptr());
    at::parallel_for(0, tokens * k_, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) std::memcpy(target + place[i] * bytes, source + i / k_ * bytes, bytes);
    });
    std::vector<const PackedLinear*> gate_ups, downs;
    std::vector<at::Tensor> inputs;
    for (int64_t e : active) {
      gate_ups.push_back(gate_up_[e].get());
      downs.push_back(down_[e].get());
      inputs.push_back(gathered.narrow(0, first_row[e], first_row[e + 1] - first_row[e]));
    }
    const std::vector<at::Tensor> projected = PackedLinear::forward_group(gate_ups, inputs);
    std::vector<at::Tensor> activations(active.size());
    at::Tensor sums = at::empty({tokens, hidden}, x.options().dtype(at::kFloat));
    float* s = sums.data_ptr<float>();
    for_each_dtype(x.scalar_type(), [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      using E = Element<T>;
      at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j) {
          const int64_t n = projected[j].size(0), width = projected[j].size(1) / 2;
          activations[j] = at::empty({n, width}, x.options());
          activate_and_multiply<T>(projected[j].data_ptr<T>(), n, width, gelu_, activations[j].data_ptr<T>());
        }
      });
      const std::vector<at::Tensor> outputs = PackedLinear::forward_group(downs, activations);
      std::vector<const T*> output_of(experts, nullptr);  // expert e's output rows, from its first
      for (size_t j = 0; j < active.size(); ++j) output_of[active[j]] = outputs[j].data_ptr<T>() - first_row[active[j]] * hidden;
      // Each row's sum from zero, its experts in ascending index (`chosen` is sorted per row).
      at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          float* row = s + t * hidden;
          std::fill_n(row, hidden, 0.f);
          for (int64_t i = 0; i < k_; ++i) {
            const T* y = output_of[chosen[t * k_ + i]] + place[t * k_ + i] * hidden;
            const float w = weights[t * k_ + i];
            for (int64_t c = 0; c < hidden; ++c) row[c] += w * E::read(y + c);
          }
        }
      });
    });
    return sums.to(x.scalar_type());
  }

 private:
  c10::intrusive_ptr<PackedLinear> router_;
  std::vector<c10::intrusive_ptr<PackedLinear>> gate_up_, down_;
  int64_t k_;
  bool softmax_first_, normalize_, gelu_;
};

}  // namespace shoal

TORCH_LIBRARY_FRAGMENT(shoal, m) {
  m.class_<shoal::MixtureOfExpertsCpu>("MixtureOfExperts")
      .def(torch::init<c10::intrusive_ptr<shoal::PackedLinear>, std::vector<c10::intrusive_ptr<shoal::PackedLinear>>,
                       std::vector<c10::intrusive_ptr<shoal::PackedLinear>>, int64_t, std::string, bool, bool>())
      .def("forward", &shoal::MixtureOfExpertsCpu::forward);
}
