// A Llama-family target's one-token decoding step, whole: every decoder layer's norms, rotary turn, residual adds
// and gated activation computed here, between its products on the weights the library holds (rows_linear.cpp) and
// its attention in the cache room the library holds (rows_attention.cpp).
//
// Why: between a step's 120 products, the lean forward (lean.py) runs about 30 small torch operations a layer, a few
// microseconds of Python and dispatch each for a few hundred numbers, while the memory waits; compiled, inductor's
// entry and its calls between kernels still left a millisecond or two of a SmolLM2 step idle (docs/benchmarks.md).
// Here they are loops over a row's few hundred numbers. Each rounds where torch's operation would (a bf16 result
// after every operation), so a step is the lean forward's but for the order of a few sums.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "rows.h"

namespace {

// `v` rounded to T, as a torch operation in T stores its result.
template <class T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// transformers' Llama RMSNorm of one row: x over its root mean square in fp32, rounded to T, times the weight.
template <class T>
void rms_norm(const T* x, const T* weight, int64_t H, float eps, T* out) {
  float sum = 0.0f;
  for (int64_t j = 0; j < H; ++j) sum += static_cast<float>(x[j]) * static_cast<float>(x[j]);
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j)
    out[j] = static_cast<T>(static_cast<float>(weight[j]) * round_to<T>(static_cast<float>(x[j]) * inverse));
}

// transformers' rotary turn of one head: x * cos + rotate_half(x) * sin.
template <class T>
void turn(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < D; ++j) {
    const float rotated = j < half ? -static_cast<float>(x[j + half]) : static_cast<float>(x[j - half]);
    out[j] = static_cast<T>(round_to<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j])) +
                            round_to<T>(rotated * static_cast<float>(sin[j])));
  }
}

// The MLP's silu(gate) * up over one row of the gate/up product [gate (I), up (I)].
template <class T>
void gate(const T* gate_up, int64_t I, T* out) {
  for (int64_t j = 0; j < I; ++j) {
    const float g = static_cast<float>(gate_up[j]);
    out[j] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * static_cast<float>(gate_up[I + j]));
  }
}

template <class T>
void add_into(T* x, const T* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = static_cast<T>(static_cast<float>(x[j]) + static_cast<float>(y[j]));
}

template <class T>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t B = x.size(0), H = x.size(-1);
  for (int64_t b = 0; b < B; ++b)
    rms_norm<T>(x.data_ptr<T>() + b * H, weight.data_ptr<T>(), H, static_cast<float>(eps), out.data_ptr<T>() + b * H);
}

struct Shape {
  int64_t heads, kv_heads, intermediate, near;
};

// One decoder layer over the residual stream x [B, 1, H], in place; h [B, 1, H] a norm's output.
template <class T>
void layer(at::Tensor& x, at::Tensor& h, int64_t index, at::IntArrayRef products, at::TensorList norms,
           at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin, int64_t room, int64_t length,
           const c10::optional<at::Tensor>& mask, double scale, const Shape& s) {
  using hf_eagle31_rows::product;
  const int64_t B = x.size(0), H = x.size(-1), D = cos.size(-1), turned_heads = s.heads + s.kv_heads;
  norm_rows<T>(x, norms[2 * index], eps[2 * index], h);
  const at::Tensor qkv = product(h, products[4 * index], (turned_heads + s.kv_heads) * D, s.near)
                             .view({B, turned_heads + s.kv_heads, D});
  at::Tensor turned = at::empty({B, turned_heads, D}, x.options());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t head = 0; head < turned_heads; ++head)
      turn<T>(qkv.data_ptr<T>() + (b * (turned_heads + s.kv_heads) + head) * D, cos.data_ptr<T>() + b * D,
              sin.data_ptr<T>() + b * D, D, turned.data_ptr<T>() + (b * turned_heads + head) * D);
  const at::Tensor query = turned.narrow(1, 0, s.heads).view({B, s.kv_heads, s.heads / s.kv_heads, D});
  const at::Tensor keys = turned.narrow(1, s.heads, s.kv_heads).unsqueeze(2);
  const at::Tensor values = qkv.narrow(1, turned_heads, s.kv_heads).unsqueeze(2);
  const at::Tensor attended = hf_eagle31_rows::attention_in_room(query, keys, values, room, index, length, mask, scale);
  const at::Tensor o = product(attended.view({B, 1, s.heads * D}), products[4 * index + 1], H, s.near);
  add_into<T>(x.data_ptr<T>(), o.data_ptr<T>(), B * H);
  norm_rows<T>(x, norms[2 * index + 1], eps[2 * index + 1], h);
  const at::Tensor gate_up = product(h, products[4 * index + 2], 2 * s.intermediate, s.near);
  at::Tensor gated = at::empty({B, 1, s.intermediate}, x.options());
  for (int64_t b = 0; b < B; ++b)
    gate<T>(gate_up.data_ptr<T>() + b * 2 * s.intermediate, s.intermediate,
            gated.data_ptr<T>() + b * s.intermediate);
  const at::Tensor down = product(gated, products[4 * index + 3], H, s.near);
  add_into<T>(x.data_ptr<T>(), down.data_ptr<T>(), B * H);
}

// The decoder layers and final norm over one token a row: x [B, 1, H] (the embedding's), `products` four keys a
// layer (q/k/v, o, gate/up, down: lean.py's `product_keys`), `norms` and `eps` two a layer and the final norm's,
// cos and sin [B, 1, (1,) D], the cache in `room` (`hold_room`) with `length` entries cached, the additive `mask`
// [B, 1, G, length + 1] (or none); the last hidden states [B, 1, H] and the states before each layer of `capture`
// (the final norm's output for the layer count) side by side [B, 1, len(capture) H].
std::tuple<at::Tensor, at::Tensor> step(const at::Tensor& x, at::IntArrayRef products, at::TensorList norms,
                                        at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                                        int64_t room, int64_t length, const c10::optional<at::Tensor>& mask,
                                        double scale, int64_t heads, int64_t kv_heads, int64_t intermediate,
                                        at::IntArrayRef capture, int64_t near) {
  const auto dtype = x.scalar_type();
  const int64_t layers = static_cast<int64_t>(products.size()) / 4, B = x.size(0), H = x.size(-1);
  const int64_t D = cos.size(-1);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "hf_eagle31_rows::step: fp32 or bf16 expected, got ",
              dtype);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1, "hf_eagle31_rows::step: one token a row [B, 1, H] expected");
  TORCH_CHECK(products.size() % 4 == 0 && norms.size() == static_cast<size_t>(2 * layers + 1) &&
                  eps.size() == norms.size(), "hf_eagle31_rows::step: four products and two norms a layer, and a final "
              "norm, expected");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && D % 2 == 0,
              "hf_eagle31_rows::step: query heads a multiple of the key/value heads, and an even head dim, expected");
  for (const auto& norm : norms)
    TORCH_CHECK(norm.scalar_type() == dtype && norm.numel() == H && norm.is_contiguous(),
                "hf_eagle31_rows::step: norm weights of ", H, " ", dtype, " features expected");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.numel() == B * D &&
                  sin.numel() == B * D, "hf_eagle31_rows::step: cos and sin [B, 1, D] in the input's dtype expected");
  for (const auto index : capture)
    TORCH_CHECK(index >= 0 && index <= layers, "hf_eagle31_rows::step: no state ", index, " to capture");
  const Shape shape{heads, kv_heads, intermediate, near};
  at::Tensor stream = x.contiguous().clone(), h = at::empty_like(stream);  // the residual stream, a norm's output
  const at::Tensor c = cos.contiguous().view({B, D}), s = sin.contiguous().view({B, D});
  at::Tensor features = at::empty({B, 1, static_cast<int64_t>(capture.size()) * H}, stream.options());
  auto keep = [&](int64_t index, const at::Tensor& state) {
    for (size_t i = 0; i < capture.size(); ++i)
      if (capture[i] == index) features.narrow(2, static_cast<int64_t>(i) * H, H).copy_(state);
  };
  for (int64_t index = 0; index < layers; ++index) {
    keep(index, stream);
    if (dtype == at::kFloat)
      layer<float>(stream, h, index, products, norms, eps, c, s, room, length, mask, scale, shape);
    else
      layer<at::BFloat16>(stream, h, index, products, norms, eps, c, s, room, length, mask, scale, shape);
  }
  if (dtype == at::kFloat) norm_rows<float>(stream, norms[2 * layers], eps[2 * layers], h);
  else norm_rows<at::BFloat16>(stream, norms[2 * layers], eps[2 * layers], h);
  keep(layers, h);
  return {h, features};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_eagle31_rows, m) {
  m.def("step(Tensor x, int[] products, Tensor[] norms, float[] eps, Tensor cos, Tensor sin, int room, int length, "
        "Tensor? mask, float scale, int heads, int kv_heads, int intermediate, int[] capture, int near) -> "
        "(Tensor, Tensor)");
  m.impl("step", c10::DispatchKey::CPU, TORCH_FN(step));
}
