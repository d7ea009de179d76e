// The weights the rows library holds under each product's key, and its two product ops: `linear` on weights passed in,
// `product` on those held; whichever kernel multiplies (`product_into`: rows_linear.cpp on a CPU with AVX-512,
// rows_avx2.cpp on one with AVX2 alone, rows.py building this file with one of them).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "rows.h"

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// The weights a compiled graph multiplies by, held under each product's key (products.py's `product_key`), so that
// the graph names a product by its key instead of taking every weight as an input: inductor's entry into a graph
// gathered and checked each of its inputs, about 2 us apiece (lean.py: `hold_weights`). The weights are held weakly
// (a model deleted frees them; its entries are dropped at the next `hold`), a bias strongly, in fp32 (a product's
// stacked bias is a copy only the entry owns; fp32, as the products add it, converted once, not at each product).
struct Held {
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> weights;
  c10::optional<at::Tensor> bias;
  bool expired() const {
    for (const auto& w : weights)
      if (w.expired()) return true;
    return false;
  }
};
std::mutex held_lock;
std::unordered_map<int64_t, Held> held;

// Hold, under keys[i], the next counts[i] of `weights` and biases[i]; entries whose weights were freed are dropped.
void hold(at::IntArrayRef keys, at::IntArrayRef counts, at::TensorList weights,
          const c10::List<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(keys.size() == counts.size() && keys.size() == biases.size(), "hold: a count and a bias for each key");
  std::lock_guard<std::mutex> lock(held_lock);
  for (auto entry = held.begin(); entry != held.end();) entry = entry->second.expired() ? held.erase(entry) : ++entry;
  size_t next = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    Held entry;
    for (int64_t j = 0; j < counts[i]; ++j, ++next) {
      TORCH_CHECK(next < weights.size(), "hold: fewer weights than the counts add up to");
      entry.weights.emplace_back(weights[next].getIntrusivePtr());
    }
    const c10::optional<at::Tensor> bias = biases.get(i);
    if (bias.has_value()) entry.bias = bias->to(at::kFloat).contiguous();
    held[keys[i]] = std::move(entry);
  }
}

}  // namespace

namespace hf_eagle31_rows {

std::vector<Weights> held_weights(at::IntArrayRef keys) {
  std::vector<Weights> found(keys.size());
  std::lock_guard<std::mutex> lock(held_lock);
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto entry = held.find(keys[i]);
    TORCH_CHECK(entry != held.end(), "hf_eagle31_rows: no weights held under key ", keys[i]);
    for (const auto& w : entry->second.weights) {
      auto strong = w.lock();
      TORCH_CHECK(strong, "hf_eagle31_rows: the weights held under key ", keys[i], " were freed");
      found[i].weights.emplace_back(std::move(strong));
    }
    if (entry->second.bias.has_value()) found[i].bias = *entry->second.bias;
  }
  return found;
}

int64_t features_of(at::TensorList weights, int64_t K, at::ScalarType dtype, const char* who, int64_t key) {
  int64_t features = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 2 && w.size(1) == K && w.is_contiguous(), who,
                key < 0 ? "" : " (key ", key < 0 ? "" : std::to_string(key) + ")", ": contiguous ", dtype,
                " weights of ", K, " input features expected");
    features += w.size(0);
  }
  return features;
}

at::Tensor linear(const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>& bias, int64_t ways) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || (dtype == at::kBFloat16 && multiplies_bf16()), "hf_eagle31_rows.linear: fp32",
              multiplies_bf16() ? " or bf16" : "", " input expected, got ", dtype);
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1);
  const int64_t N = features_of(weights, K, dtype, "hf_eagle31_rows.linear");
  Weights given{weights.vec(), at::Tensor()};  // the bias in fp32: added before the one rounding of each output
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "hf_eagle31_rows.linear: a bias of ", N, " features expected");
    given.bias = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x2.options());
  product_into(x2, given, out, ways);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

// x times the weights held under `key` (`hold`), plus their bias: `linear` on them.
at::Tensor product(const at::Tensor& x, int64_t key, int64_t out_features, int64_t ways) {
  const Weights weights = std::move(held_weights({key})[0]);
  at::Tensor out = linear(x, weights.weights, weights.bias.defined() ? c10::optional<at::Tensor>(weights.bias)
                                                                     : c10::nullopt, ways);
  TORCH_CHECK(out.size(-1) == out_features, "hf_eagle31_rows::product: the weights held under key ", key, " give ",
              out.size(-1), " features, not ", out_features);
  return out;
}

}  // namespace hf_eagle31_rows

namespace {

at::Tensor product_shape(const at::Tensor& x, int64_t, int64_t out_features, int64_t) {
  std::vector<c10::SymInt> shape = x.sym_sizes().vec();
  shape.back() = out_features;
  return at::empty_symint(shape, x.options());
}

// The output's shape and type, not its values: what torch.compile traces a graph with (sizes may be symbolic).
at::Tensor linear_shape(const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>& bias, int64_t) {
  std::vector<c10::SymInt> shape = x.sym_sizes().vec();
  shape.back() = 0;
  for (const auto& w : weights) shape.back() = shape.back() + w.sym_size(0);
  return at::empty_symint(shape, x.options());
}

}  // namespace

TORCH_LIBRARY(hf_eagle31_rows, m) {
  m.def("linear(Tensor x, Tensor[] weights, Tensor? bias, int ways=0) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(hf_eagle31_rows::linear));
  m.impl("linear", c10::DispatchKey::Meta, TORCH_FN(linear_shape));
  m.def("bf16() -> bool", [] { return hf_eagle31_rows::multiplies_bf16(); });
  m.def("hold(int[] keys, int[] counts, Tensor[] weights, Tensor?[] biases) -> ()", hold);
  m.def("product(Tensor x, int key, int out_features, int ways) -> Tensor");
  m.impl("product", c10::DispatchKey::CPU, TORCH_FN(hf_eagle31_rows::product));
  m.impl("product", c10::DispatchKey::Meta, TORCH_FN(product_shape));
}
