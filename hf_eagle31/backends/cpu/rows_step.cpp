// A Llama-family target's forward over a few tokens a row (a decoding step's one, a verify block's), whole: every
// decoder layer's norms, rotary turn, residual adds and gated activation computed here, between its products on the
// weights the library holds (rows_linear.cpp) and its attention in the cache room the library holds
// (rows_attention.cpp).
//
// Why: between a forward's 120 products, the lean forward (lean.py) runs about 30 small torch operations a layer, a
// few microseconds of Python and dispatch each for a few hundred numbers, while the memory waits; compiled,
// inductor's entry and its calls between kernels still left a millisecond or two of a SmolLM2 step idle
// (docs/benchmarks.md). Here they are loops over a token's few hundred numbers. Each rounds where torch's operation
// would (a bf16 result after every operation), so a forward is the lean forward's but for the order of a few sums.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
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
  const int64_t H = x.size(-1), count = x.numel() / H;
  for (int64_t row = 0; row < count; ++row)
    rms_norm<T>(x.data_ptr<T>() + row * H, weight.data_ptr<T>(), H, static_cast<float>(eps),
                out.data_ptr<T>() + row * H);
}

struct Shape {
  int64_t heads, kv_heads, intermediate, near;
};

// The rotary turn of each token's query and key heads in the q/k/v product [B, n, heads + 2 kv, D], laid out as the
// attention takes them: queries [B, heads, n, D] (a key/value head's query heads one after another, as
// `grouped_attention` folds them), keys and values [B, kv, n, D].
template <class T>
void heads_of(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& query,
              at::Tensor& keys, at::Tensor& values) {
  const int64_t B = qkv.size(0), n = qkv.size(1), width = qkv.size(2), D = qkv.size(3);
  const int64_t heads = query.size(1), kv = keys.size(1);
  const T* qp = qkv.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t) {
      const T* token = qp + (b * n + t) * width * D;
      const T* c = cos.data_ptr<T>() + (b * n + t) * D;
      const T* s = sin.data_ptr<T>() + (b * n + t) * D;
      for (int64_t head = 0; head < heads; ++head)
        turn<T>(token + head * D, c, s, D, query.data_ptr<T>() + ((b * heads + head) * n + t) * D);
      for (int64_t head = 0; head < kv; ++head) {
        turn<T>(token + (heads + head) * D, c, s, D, keys.data_ptr<T>() + ((b * kv + head) * n + t) * D);
        std::copy_n(token + (heads + kv + head) * D, D, values.data_ptr<T>() + ((b * kv + head) * n + t) * D);
      }
    }
}

// One decoder layer over the residual stream x [B, n, H], in place; h [B, n, H] a norm's output.
template <class T>
void layer(at::Tensor& x, at::Tensor& h, int64_t index, at::IntArrayRef products, at::TensorList norms,
           at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin, int64_t room, int64_t length,
           const c10::optional<at::Tensor>& mask, double scale, const Shape& s) {
  using hf_eagle31_rows::product;
  const int64_t B = x.size(0), n = x.size(1), H = x.size(2), D = cos.size(-1);
  norm_rows<T>(x, norms[2 * index], eps[2 * index], h);
  const at::Tensor qkv = product(h, products[4 * index], (s.heads + 2 * s.kv_heads) * D, s.near)
                             .view({B, n, s.heads + 2 * s.kv_heads, D});
  at::Tensor query = at::empty({B, s.heads, n, D}, x.options());
  at::Tensor keys = at::empty({B, s.kv_heads, n, D}, x.options()), values = at::empty_like(keys);
  heads_of<T>(qkv, cos, sin, query, keys, values);
  const at::Tensor attended = hf_eagle31_rows::attention_in_room(
      query.view({B, s.kv_heads, s.heads / s.kv_heads * n, D}), keys, values, room, index, length, mask, scale);
  const at::Tensor heads_out = n == 1 ? attended.view({B, 1, s.heads * D})
                                      : attended.view({B, s.heads, n, D}).transpose(1, 2).reshape({B, n, s.heads * D});
  const at::Tensor o = product(heads_out, products[4 * index + 1], H, s.near);
  add_into<T>(x.data_ptr<T>(), o.data_ptr<T>(), x.numel());
  norm_rows<T>(x, norms[2 * index + 1], eps[2 * index + 1], h);
  const at::Tensor gate_up = product(h, products[4 * index + 2], 2 * s.intermediate, s.near);
  at::Tensor gated = at::empty({B, n, s.intermediate}, x.options());
  for (int64_t row = 0; row < B * n; ++row)
    gate<T>(gate_up.data_ptr<T>() + row * 2 * s.intermediate, s.intermediate,
            gated.data_ptr<T>() + row * s.intermediate);
  const at::Tensor down = product(gated, products[4 * index + 3], H, s.near);
  add_into<T>(x.data_ptr<T>(), down.data_ptr<T>(), x.numel());
}

// The decoder layers and final norm over a block of n tokens a row: x [B, n, H] (the embedding's), `products` four
// keys a layer (q/k/v, o, gate/up, down: lean.py's `product_keys`), `norms` and `eps` two a layer and the final
// norm's, cos and sin [B, n, (1,) D], the cache in `room` (`hold_room`) with `length` entries cached, the additive
// `mask` [B, 1, G n, length + n] (folded as `grouped_attention` folds it; or none); the last hidden states
// [B, n, H] and the states before each layer of `capture` (the final norm's output for the layer count) side by
// side [B, n, len(capture) H].
std::tuple<at::Tensor, at::Tensor> step(const at::Tensor& x, at::IntArrayRef products, at::TensorList norms,
                                        at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                                        int64_t room, int64_t length, const c10::optional<at::Tensor>& mask,
                                        double scale, int64_t heads, int64_t kv_heads, int64_t intermediate,
                                        at::IntArrayRef capture, int64_t near) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "hf_eagle31_rows::step: fp32 or bf16 expected, got ",
              dtype);
  TORCH_CHECK(x.dim() == 3, "hf_eagle31_rows::step: a block [B, n, H] expected");
  const int64_t layers = static_cast<int64_t>(products.size()) / 4, B = x.size(0), n = x.size(1), H = x.size(2);
  const int64_t D = cos.size(-1);
  TORCH_CHECK(products.size() % 4 == 0 && norms.size() == static_cast<size_t>(2 * layers + 1) &&
                  eps.size() == norms.size(), "hf_eagle31_rows::step: four products and two norms a layer, and a final "
              "norm, expected");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && D % 2 == 0,
              "hf_eagle31_rows::step: query heads a multiple of the key/value heads, and an even head dim, expected");
  for (const auto& norm : norms)
    TORCH_CHECK(norm.scalar_type() == dtype && norm.numel() == H && norm.is_contiguous(),
                "hf_eagle31_rows::step: norm weights of ", H, " ", dtype, " features expected");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.numel() == B * n * D &&
                  sin.numel() == B * n * D,
              "hf_eagle31_rows::step: cos and sin [B, n, D] in the input's dtype expected");
  for (const auto index : capture)
    TORCH_CHECK(index >= 0 && index <= layers, "hf_eagle31_rows::step: no state ", index, " to capture");
  const Shape shape{heads, kv_heads, intermediate, near};
  at::Tensor stream = x.contiguous().clone(), h = at::empty_like(stream);  // the residual stream, a norm's output
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor features = at::empty({B, n, static_cast<int64_t>(capture.size()) * H}, stream.options());
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
