// A Llama-family target's forward over a few tokens a row (a decoding step's one, a verify block's), whole: every
// decoder layer's norms, rotary turn, residual adds and gated activation computed here, between its products on the
// weights the library holds (rows_linear.cpp) and its attention in the cache room the library holds
// (rows_attention.cpp); and an EAGLE drafter's forward of one layer the same way (`draft_step`, draft.py).
//
// Why: between a forward's 120 products, the lean forward (lean.py) runs about 30 small torch operations a layer, a
// few microseconds of Python and dispatch each for a few hundred numbers, while the memory waits; compiled,
// inductor's entry and its calls between kernels still left a millisecond or two of a SmolLM2 step idle
// (docs/benchmarks.md). Here they are loops over a token's few hundred numbers. Each rounds where torch's operation
// would (a bf16 result after every operation), so a forward is the lean forward's but for the order of a few sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "rows.h"

namespace {

using namespace hf_eagle31_rows;  // the vectors (rows.h)

// f(j, lanes) over 0..n in vectors of 16, the last one masked to what is left.
template <class F>
inline void by16(int64_t n, F f) {
  for (int64_t j = 0; j < n; j += 16) f(j, lanes(n - j));
}

// transformers' Llama RMSNorm of one row: x over its root mean square in fp32, rounded to T, times the weight.
template <class T>
void rms_norm(const T* x, const T* weight, int64_t H, float eps, T* out) {
  Vec squares = zero16();
  by16(H, [&](int64_t j, Mask m) {
    const Vec v = load16(x + j, m);
    squares = fmadd(v, v, squares);
  });
  const Vec inverse = set16(1.0f / std::sqrt(sum16(squares) / static_cast<float>(H) + eps));
  by16(H, [&](int64_t j, Mask m) {
    const Vec normed = round16<T>(mul(load16(x + j, m), inverse));
    store16(out + j, mul(load16(weight + j, m), normed), m);
  });
}

// transformers' rotary turn of one head: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
template <class T>
void turn(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  const int64_t half = D / 2;
  by16(half, [&](int64_t j, Mask m) {
    const Vec x1 = load16(x + j, m), x2 = load16(x + half + j, m);
    const Vec first = sub(round16<T>(mul(x1, load16(cos + j, m))), round16<T>(mul(x2, load16(sin + j, m))));
    const Vec second = add(round16<T>(mul(x2, load16(cos + half + j, m))),
                           round16<T>(mul(x1, load16(sin + half + j, m))));
    store16(out + j, first, m);
    store16(out + half + j, second, m);
  });
}

// The MLP's silu(gate) * up over `count` columns of one row of the gate/up product [gate (I), up (I)] (gate_up and
// out at the first of them), silu(g) = g / (1 + e^-g).
template <class T>
void gate(const T* gate_up, int64_t I, int64_t count, T* out) {
  const Vec one = set16(1.0f);
  by16(count, [&](int64_t j, Mask m) {
    const Vec g = load16(gate_up + j, m);
    const Vec silu = round16<T>(div(g, add(one, exp16(sub(zero16(), g)))));
    store16(out + j, mul(silu, load16(gate_up + I + j, m)), m);
  });
}

template <class T>
void add_into(T* x, const T* y, int64_t n) {
  by16(n, [&](int64_t j, Mask m) { store16(x + j, add(load16(x + j, m), load16(y + j, m)), m); });
}

// Each row of x [rows, F] normed in equal parts, one norm a part (`norms`, `eps`), into out.
template <class T>
void norm_parts(const at::Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::Tensor& out) {
  const int64_t F = x.size(1), width = F / static_cast<int64_t>(norms.size());
  for (int64_t row = 0; row < x.size(0); ++row)
    for (size_t part = 0; part < norms.size(); ++part)
      rms_norm<T>(x.data_ptr<T>() + row * F + part * width, norms[part].data_ptr<T>(), width,
                  static_cast<float>(eps[part]), out.data_ptr<T>() + row * F + part * width);
}

// Each row of x [rows, H] normed whole, into out.
template <class T>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  norm_parts<T>(x, weight, eps, out);
}

// One forward's sizes and buffers (B n rows of tokens), allocated once a forward: those its threads share, and
// each thread's own residual stream and norm output (`xs`, `hs`; the same numbers in every thread's).
struct Forward {
  int64_t B, n, H, D, heads, kv, intermediate, length, ways;  // ways: how products read (rows_linear.cpp)
  double scale;
  int64_t attended;          // the cache entries each query attends over: length + n, or a drafter's slots
  const int64_t* columns;    // where each token's key and value are written (a drafter's); null: behind `length`
  std::vector<at::Tensor> xs, hs;  // each thread's residual stream and norm output [B n, H]
  at::Tensor qkv;            // [B n, (heads + 2 kv) D]
  at::Tensor query, attended_heads;  // [B, kv, G n, D]: a key/value head's G query heads' rows one after another,
                                     // as `grouped_attention` folds them
  at::Tensor merged;         // the attended heads side by side [B n, heads D] (a view of them for one token)
  at::Tensor out;            // the o and down products [B n, H]
  at::Tensor gate_up, gated;  // [B n, 2 I], [B n, I]
  at::Tensor mask;           // the additive mask [B, kv, G n, attended], or undefined
};

// A layer's key and value buffers [B, kv, capacity, D], and the entries its queries attend over.
struct LayerCache {
  at::Tensor keys, values, attended_keys, attended_values;
};

// Every thread of the team waits for the others here (an OpenMP barrier of the enclosing parallel region).
inline void all_here() {
#pragma omp barrier
}

// `body(team)` on each thread of one parallel region of torch's thread count (`Team`; one thread inside another
// region). Why one region a forward: a region per product and per attention started and joined the threads 150
// times a SmolLM2 step while the one thread that went on computed the few hundred numbers between them; here each
// thread computes those itself (`Forward::xs`, the same numbers in each) and the products, the new keys, the
// attention and the gate are split among them, a barrier after each. Measured on a 2-core AMD EPYC, SmolLM2's
// one-token step alone, in one process against the region-per-product forward: bf16 1.07-1.09x as fast (median of
// 39-150 rounds in each of five runs) where the host read 45-70 GB/s, 1.01x at 33-36; fp32 1.05x and 1.00x; the
// same outputs, bit for bit.
template <class F>
void in_team(int64_t threads, F body) {
#pragma omp parallel num_threads(static_cast<int>(threads))
  body(hf_eagle31_rows::Team{omp_get_thread_num(), omp_get_num_threads()});
}

// The rotary turn of each token's query and key heads in the q/k/v product for (row, key/value head) pairs
// [first, last) (pair b kv + g: head g and its G query heads): queries into `f.query`, keys and values written into
// the layer's cache buffers behind the `f.length` cached (or at `f.columns`).
template <class T>
void heads_of(Forward& f, const at::Tensor& cos, const at::Tensor& sin, LayerCache& cache, int64_t first,
              int64_t last) {
  const int64_t D = f.D, G = f.heads / f.kv, width = (f.heads + 2 * f.kv) * D;
  const at::Tensor &kb = cache.keys, &vb = cache.values;
  for (int64_t pair = first; pair < last; ++pair) {
    const int64_t b = pair / f.kv, g = pair % f.kv;
    for (int64_t t = 0; t < f.n; ++t) {
      const T* token = f.qkv.data_ptr<T>() + (b * f.n + t) * width;
      const T* c = cos.data_ptr<T>() + (b * f.n + t) * D;
      const T* s = sin.data_ptr<T>() + (b * f.n + t) * D;
      for (int64_t head = g * G; head < (g + 1) * G; ++head)
        turn<T>(token + head * D, c, s, D, f.query.data_ptr<T>() + ((b * f.heads + head) * f.n + t) * D);
      const int64_t column = f.columns ? f.columns[t] : f.length + t;
      turn<T>(token + (f.heads + g) * D, c, s, D,
              kb.data_ptr<T>() + b * kb.stride(0) + g * kb.stride(1) + column * kb.stride(2));
      std::copy_n(token + (f.heads + f.kv + g) * D, D,
                  vb.data_ptr<T>() + b * vb.stride(0) + g * vb.stride(1) + column * vb.stride(2));
    }
  }
}

// Rows [begin, end) of the attended heads [B, kv, G n, D] (row (b kv + g) G n + h n + t: token t of query head
// g G + h) side by side for each token: [B n, heads D].
template <class T>
void merge_rows(const Forward& f, int64_t begin, int64_t end) {
  const int64_t G = f.heads / f.kv, rows = G * f.n;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t pair = i / rows, b = pair / f.kv, head = pair % f.kv * G + i % rows / f.n, t = i % f.n;
    std::copy_n(f.attended_heads.data_ptr<T>() + i * f.D, f.D,
                f.merged.data_ptr<T>() + ((b * f.n + t) * f.heads + head) * f.D);
  }
}

// A layer's attention added to this thread's residual stream: `input` (its norm's output) through `products`
// q/k/v and o; the new keys and values turned by (row, key/value head) pairs, the query rows attended, split among
// the team.
template <class T>
void attention(Forward& f, const hf_eagle31_rows::Team& team, const at::Tensor& input,
               const hf_eagle31_rows::Weights* products, LayerCache& cache, const at::Tensor& cos,
               const at::Tensor& sin) {
  hf_eagle31_rows::product_share(input, products[0], f.qkv, f.ways, team);
  all_here();
  const auto [first, last] = team.share(f.B * f.kv, 1);
  heads_of<T>(f, cos, sin, cache, first, last);
  all_here();  // every new key and value written, every query turned: a thread's rows may be of another's heads
  // the query rows split evenly, not the pairs: SmolLM2's 3 key/value heads on 2 threads kept one thread waiting for
  // the other's second head (1.3-1.8 ms of a bf16 step at 1,545 cached tokens)
  const auto [begin, end] = team.share(f.query.size(0) * f.query.size(1) * f.query.size(2), 1);
  hf_eagle31_rows::attend_rows(f.query, cache.attended_keys, cache.attended_values, f.mask, f.scale,
                               f.attended_heads, begin, end);
  if (f.n > 1) merge_rows<T>(f, begin, end);
  all_here();
  hf_eagle31_rows::product_share(f.merged, products[1], f.out, f.ways, team);
  all_here();
  at::Tensor& x = f.xs[team.thread];
  add_into<T>(x.data_ptr<T>(), f.out.data_ptr<T>(), x.numel());
}

// A layer's gated MLP added to this thread's residual stream: its norm (`norm`, `eps`), `products` gate/up and
// down, the gate's columns split among the team.
template <class T>
void mlp(Forward& f, const hf_eagle31_rows::Team& team, const hf_eagle31_rows::Weights* products,
         const at::Tensor& norm, double eps) {
  at::Tensor &x = f.xs[team.thread], &h = f.hs[team.thread];
  norm_rows<T>(x, norm, eps, h);
  hf_eagle31_rows::product_share(h, products[0], f.gate_up, f.ways, team);
  all_here();
  const auto [from, to] = team.share(f.intermediate, 16);
  for (int64_t row = 0; row < f.B * f.n; ++row)
    gate<T>(f.gate_up.data_ptr<T>() + row * 2 * f.intermediate + from, f.intermediate, to - from,
            f.gated.data_ptr<T>() + row * f.intermediate + from);
  all_here();
  hf_eagle31_rows::product_share(f.gated, products[1], f.out, f.ways, team);
  all_here();
  add_into<T>(x.data_ptr<T>(), f.out.data_ptr<T>(), x.numel());
}

// One decoder layer over this thread's residual stream, in place: `products` its four (q/k/v, o, gate/up, down),
// `norms` and `eps` its two, `cache` its key and value buffers.
template <class T>
void layer(Forward& f, const hf_eagle31_rows::Team& team, const hf_eagle31_rows::Weights* products,
           const at::Tensor* norms, const double* eps, LayerCache& cache, const at::Tensor& cos,
           const at::Tensor& sin) {
  norm_rows<T>(f.xs[team.thread], norms[0], eps[0], f.hs[team.thread]);
  attention<T>(f, team, f.hs[team.thread], products, cache, cos, sin);
  mlp<T>(f, team, products + 2, norms[1], eps[1]);
}

// A product's weights (held under `key`), checked once a forward against what the layer multiplies them by.
void check_weights(const hf_eagle31_rows::Weights& found, int64_t key, int64_t in_features, int64_t out_features,
                   at::ScalarType dtype, const char* who) {
  const int64_t features = hf_eagle31_rows::features_of(found.weights, in_features, dtype, who, key);
  TORCH_CHECK(features == out_features, who, ": the weights under key ", key, " give ", features, " features, not ",
              out_features);
}

// A layer's four products (q/k/v, o, gate/up, down, held under `keys`), checked once a forward: q/k/v multiplies
// `input` features (the hidden size H; a drafter's norms of its embedding and its stream side by side, 2 H).
void check_layer(const hf_eagle31_rows::Weights* weights, const int64_t* keys, int64_t input, int64_t H, int64_t D,
                 int64_t heads, int64_t kv, int64_t intermediate, at::ScalarType dtype, const char* who) {
  const int64_t inputs[4] = {input, heads * D, H, intermediate};
  const int64_t outputs[4] = {(heads + 2 * kv) * D, H, 2 * intermediate, H};
  for (int i = 0; i < 4; ++i) check_weights(weights[i], keys[i], inputs[i], outputs[i], dtype, who);
}

// A layer's cache buffers in the room, checked once a forward: room for the block behind the cache.
LayerCache cache_for(int64_t room, int64_t index, const Forward& f, at::ScalarType dtype) {
  auto [keys, values] = hf_eagle31_rows::room_layer(room, index);
  for (const auto& buffer : {keys, values})
    TORCH_CHECK(buffer.dim() == 4 && buffer.scalar_type() == dtype && buffer.size(0) == f.B &&
                    buffer.size(1) == f.kv && buffer.size(3) == f.D && buffer.stride(3) == 1 &&
                    f.length + f.n <= buffer.size(2),
                "hf_eagle31_rows::step: the cache buffers of layer ", index, " hold no room for ", f.n,
                " more entries after ", f.length);
  return {keys, values, keys.narrow(2, 0, f.attended), values.narrow(2, 0, f.attended)};
}

// The forward's buffers, its queries attending over `attended` cache entries; the mask `mask` [B, 1, G n, attended]
// expanded over the key/value heads; `threads` residual streams starting at x.
Forward forward_for(const at::Tensor& x, int64_t D, int64_t heads, int64_t kv, int64_t intermediate, int64_t length,
                    int64_t attended, const c10::optional<at::Tensor>& mask, double scale, int64_t ways,
                    int64_t threads) {
  const int64_t B = x.size(0), n = x.size(1), H = x.size(2), rows = B * n, G = heads / kv;
  Forward f{B, n, H, D, heads, kv, intermediate, length, ways, scale, attended, nullptr};
  const auto options = x.options();
  for (int64_t thread = 0; thread < threads; ++thread) {
    f.xs.push_back(x.reshape({rows, H}).clone(at::MemoryFormat::Contiguous));
    f.hs.push_back(at::empty({rows, H}, options));
  }
  f.qkv = at::empty({rows, (heads + 2 * kv) * D}, options);
  f.query = at::empty({B, kv, G * n, D}, options);
  f.attended_heads = at::empty_like(f.query);
  f.merged = n == 1 ? f.attended_heads.view({rows, heads * D}) : at::empty({rows, heads * D}, options);
  f.out = at::empty({rows, H}, options);
  f.gate_up = at::empty({rows, 2 * intermediate}, options);
  f.gated = at::empty({rows, intermediate}, options);
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == x.scalar_type() && mask->dim() == 4 && mask->size(2) == G * n &&
                    mask->size(3) == attended,
                "hf_eagle31_rows::step: an additive mask [B, 1, G n, ", attended, "] in the input's dtype expected");
    f.mask = mask->expand({B, kv, G * n, attended});
    if (f.mask.stride(3) != 1) f.mask = f.mask.contiguous();
  }
  return f;
}

// Each row of `state` [rows, H] into columns [part H, (part + 1) H) of `features` [rows, F].
template <class T>
void keep_state(const at::Tensor& state, int64_t part, at::Tensor& features) {
  const int64_t H = state.size(1), F = features.size(1);
  for (int64_t row = 0; row < state.size(0); ++row)
    std::copy_n(state.data_ptr<T>() + row * H, H, features.data_ptr<T>() + row * F + part * H);
}

// The decoder layers and the final norm on every thread of a team, the states of `capture` kept by the first; with
// a `head`, its product of the normed states into `logits`, split among the threads (each normed its own stream,
// the same numbers: no barrier before it).
template <class T>
void layers_in_team(Forward& f, const std::vector<hf_eagle31_rows::Weights>& weights, at::TensorList norms,
                    at::ArrayRef<double> eps, std::vector<LayerCache>& caches, const at::Tensor& cos,
                    const at::Tensor& sin, at::IntArrayRef capture, at::Tensor& features,
                    const hf_eagle31_rows::Weights* head, at::Tensor& logits) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  in_team(static_cast<int64_t>(f.xs.size()), [&](const hf_eagle31_rows::Team& team) {
    auto keep = [&](int64_t index, const at::Tensor& state) {
      for (size_t i = 0; i < capture.size(); ++i)
        if (team.thread == 0 && capture[i] == index) keep_state<T>(state, static_cast<int64_t>(i), features);
    };
    for (int64_t index = 0; index < layers; ++index) {
      keep(index, f.xs[team.thread]);
      layer<T>(f, team, &weights[4 * index], &norms[2 * index], &eps[2 * index], caches[index], cos, sin);
    }
    norm_rows<T>(f.xs[team.thread], norms[2 * layers], eps[2 * layers], f.hs[team.thread]);
    keep(layers, f.hs[team.thread]);
    if (head != nullptr) hf_eagle31_rows::product_share(f.hs[team.thread], *head, logits, f.ways, team);
  });
}

// What a room's forwards multiply by: each product's keys (four a layer, then the head's or -1) and the sizes its
// weights were checked against.
struct Shape {
  std::vector<int64_t> keys;
  int64_t head;
  at::ScalarType dtype;
  int64_t H, D, heads, kv, intermediate;
  bool operator==(const Shape& other) const {
    return keys == other.keys && head == other.head && dtype == other.dtype && H == other.H && D == other.D &&
           heads == other.heads && kv == other.kv && intermediate == other.intermediate;
  }
};

// A room's weights, looked up and checked at its first forward and held (strongly) until the room is released.
// Why: looked up at every forward (under a lock, a weak reference locked for each of SmolLM2's 211 weights) and
// checked, they cost ~0.1 ms a step, most of it cache misses in the tensors the step before streamed past.
struct Prepared {
  Shape shape;
  std::vector<hf_eagle31_rows::Weights> layers;  // four a layer
  hf_eagle31_rows::Weights head;
  int64_t vocabulary = 0;
};
std::mutex prepared_lock;
std::unordered_map<int64_t, std::shared_ptr<const Prepared>> prepared;

// The weights of `room`'s forwards of `shape`: those held for it, or looked up and checked now (and held).
std::shared_ptr<const Prepared> prepared_for(int64_t room, Shape shape) {
  {
    std::lock_guard<std::mutex> lock(prepared_lock);
    const auto entry = prepared.find(room);
    if (entry != prepared.end() && entry->second->shape == shape) return entry->second;
  }
  auto made = std::make_shared<Prepared>();
  made->layers = hf_eagle31_rows::held_weights(shape.keys);
  for (size_t index = 0; 4 * index < shape.keys.size(); ++index)
    check_layer(&made->layers[4 * index], shape.keys.data() + 4 * index, shape.H, shape.H, shape.D, shape.heads,
                shape.kv, shape.intermediate, shape.dtype, "hf_eagle31_rows::step");
  if (shape.head != -1) {
    made->head = std::move(hf_eagle31_rows::held_weights({shape.head})[0]);
    made->vocabulary = hf_eagle31_rows::features_of(made->head.weights, shape.H, shape.dtype, "hf_eagle31_rows::step",
                                                    shape.head);
  }
  made->shape = std::move(shape);
  std::lock_guard<std::mutex> lock(prepared_lock);
  return prepared[room] = std::move(made);
}

// The room is done (lean.py's `CacheRoom`, at its end): its weights are no longer held for it.
void release(int64_t room) {
  std::lock_guard<std::mutex> lock(prepared_lock);
  prepared.erase(room);
}

// The decoder layers and final norm over a block of n tokens a row: x [B, n, H] (the embedding's), `products` four
// keys a layer (q/k/v, o, gate/up, down: lean.py's `product_keys`), `norms` and `eps` two a layer and the final
// norm's, cos and sin [B, n, (1,) D], the cache in `room` (`hold_room`) with `length` entries cached, the additive
// `mask` [B, 1, G n, length + n] (folded as `grouped_attention` folds it; or none); the last hidden states
// [B, n, H] and the states before each layer of `capture` (the final norm's output for the layer count) side by
// side [B, n, len(capture) H]; with a `head` key (not -1), the logits of the product held under it, in fp32
// [B, n, V] (the head's output rounded to the input's dtype, then widened: `lm_head(x).float()`), else none [0].
std::tuple<at::Tensor, at::Tensor, at::Tensor> step(
    const at::Tensor& x, at::IntArrayRef products, at::TensorList norms, at::ArrayRef<double> eps,
    const at::Tensor& cos, const at::Tensor& sin, int64_t room, int64_t length, const c10::optional<at::Tensor>& mask,
    double scale, int64_t heads, int64_t kv_heads, int64_t intermediate, at::IntArrayRef capture, int64_t ways,
    int64_t head) {
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
  // below autograd's view and in-place tracking: nothing here is differentiated, and tracking each of a forward's
  // small views and copies was a noticeable share of its time between the products
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  Forward f = forward_for(x, D, heads, kv_heads, intermediate, length, length + n, mask, scale, ways,
                          at::get_num_threads());
  const std::shared_ptr<const Prepared> weights =
      prepared_for(room, {products.vec(), head, dtype, H, D, heads, kv_heads, intermediate});
  std::vector<LayerCache> caches;
  for (int64_t index = 0; index < layers; ++index) caches.push_back(cache_for(room, index, f, dtype));
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor features = at::empty({B * n, static_cast<int64_t>(capture.size()) * H}, x.options());
  at::Tensor logits = at::empty({B * n, weights->vocabulary}, x.options());
  const hf_eagle31_rows::Weights* held = head != -1 ? &weights->head : nullptr;
  if (dtype == at::kFloat)
    layers_in_team<float>(f, weights->layers, norms, eps, caches, c, s, capture, features, held, logits);
  else layers_in_team<at::BFloat16>(f, weights->layers, norms, eps, caches, c, s, capture, features, held, logits);
  return {f.hs[0].view({B, n, H}), features.view({B, n, static_cast<int64_t>(capture.size()) * H}),
          logits.to(at::kFloat).view({B, n, weights->vocabulary})};
}

// The drafter's one layer and final norm over this thread's residual stream, its input (`input` [B n, 2 H], this
// thread's) being the embedding's norm and the stream's side by side; `norms` and `eps`: hidden_norm,
// input_layernorm, post_attention_layernorm, norm.
template <class T>
void draft_layer(Forward& f, const hf_eagle31_rows::Team& team, const at::Tensor& embeds,
                 const hf_eagle31_rows::Weights* products, const at::Tensor* norms, const double* eps,
                 bool norm_before_residual, LayerCache& cache, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor& input) {
  const int64_t H = f.H;
  T* x = f.xs[team.thread].data_ptr<T>();
  for (int64_t row = 0; row < f.B * f.n; ++row) {
    T* both = input.data_ptr<T>() + row * 2 * H;
    rms_norm<T>(embeds.data_ptr<T>() + row * H, norms[1].data_ptr<T>(), H, static_cast<float>(eps[1]), both);
    rms_norm<T>(x + row * H, norms[0].data_ptr<T>(), H, static_cast<float>(eps[0]), both + H);
    if (norm_before_residual) std::copy_n(both + H, H, x + row * H);
  }
  attention<T>(f, team, input, products, cache, cos, sin);
  mlp<T>(f, team, products + 2, norms[2], eps[2]);
  norm_rows<T>(f.xs[team.thread], norms[3], eps[3], f.hs[team.thread]);
}

// The drafter's residual stream [B n, H]: the target features' norms (`fc_norms`) and fc where `project`, else the
// fed-back states as they are.
at::Tensor draft_stream(const at::Tensor& hidden, bool project, const hf_eagle31_rows::Weights& fc,
                        at::TensorList fc_norms, at::ArrayRef<double> eps, int64_t H, int64_t ways) {
  const at::Tensor states = hidden.reshape({-1, hidden.size(2)}).contiguous();
  if (!project) return states;
  at::Tensor normed = states;
  if (!fc_norms.empty()) {
    normed = at::empty_like(states);
    if (states.scalar_type() == at::kFloat) norm_parts<float>(states, fc_norms, eps, normed);
    else norm_parts<at::BFloat16>(states, fc_norms, eps, normed);
  }
  at::Tensor x = at::empty({states.size(0), H}, states.options());
  hf_eagle31_rows::product_into(normed, fc, x, ways);
  return x;
}

// An EAGLE drafter's forward with one decoder layer (modeling.py's `Eagle3DraftModel.forward`) over n positions a
// row, whole, for the same reason as `step`: about 60 small operations a forward between its six products.
// embeds [B, n, H] the tokens' embedding; hidden [B, n, F] the target's features (`project`: normed by the first
// norms, `fc_norms` of them over equal parts of F, then fc) or fed-back states [B, n, H]; `products` six keys (fc,
// q/k/v, o, gate/up, down, lm_head); `norms` and `eps` the fc norms, hidden_norm, input_layernorm,
// post_attention_layernorm, norm; cos and sin [B, n, D]; keys and values [B, kv, capacity, D] the cache's buffers,
// the n new entries written at `columns` [n], each query attending over the first `slots` entries where `mask`
// [B, n, slots] (bool) is true; returns the head's logits at `logit_rows` (indices into the [B n] positions) and the
// states to feed back [B, n, H] (the final norm's where `norm_output`).
std::tuple<at::Tensor, at::Tensor> draft_step(const at::Tensor& embeds, const at::Tensor& hidden, bool project,
                                              at::IntArrayRef products, at::TensorList norms, at::ArrayRef<double> eps,
                                              bool norm_before_residual, bool norm_output, const at::Tensor& cos,
                                              const at::Tensor& sin, const at::Tensor& keys, const at::Tensor& values,
                                              const at::Tensor& columns, const at::Tensor& mask,
                                              const at::Tensor& logit_rows, double scale, int64_t heads,
                                              int64_t kv_heads, int64_t intermediate, int64_t ways) {
  const auto dtype = embeds.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && embeds.dim() == 3 && embeds.is_contiguous() &&
                  hidden.scalar_type() == dtype && hidden.dim() == 3,
              "hf_eagle31_rows::draft_step: embeddings [B, n, H] and states [B, n, F], fp32 or bf16, expected");
  const int64_t B = embeds.size(0), n = embeds.size(1), H = embeds.size(2), D = cos.size(-1);
  const int64_t slots = mask.size(-1), fc_count = static_cast<int64_t>(norms.size()) - 4;
  TORCH_CHECK(products.size() == 6 && fc_count >= 0 && eps.size() == norms.size() && heads % kv_heads == 0 &&
                  D % 2 == 0, "hf_eagle31_rows::draft_step: six products, the norms and their eps expected");
  for (int64_t i = 0; i < static_cast<int64_t>(norms.size()); ++i)  // the fc norms' parts of the features projected
    TORCH_CHECK(norms[i].scalar_type() == dtype && norms[i].is_contiguous() &&
                    (i < fc_count ? !project || norms[i].numel() * fc_count == hidden.size(2) : norms[i].numel() == H),
                "hf_eagle31_rows::draft_step: norm ", i, " has the wrong size or dtype");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.numel() == B * n * D &&
                  sin.numel() == B * n * D, "hf_eagle31_rows::draft_step: cos and sin [B, n, D] expected");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3 && mask.size(0) == B && mask.size(1) == n &&
                  columns.scalar_type() == at::kLong && columns.numel() == n && logit_rows.scalar_type() == at::kLong,
              "hf_eagle31_rows::draft_step: a bool mask [B, n, slots], n long columns and long logit rows expected");
  const at::Tensor where = columns.contiguous();
  for (const auto& buffer : {keys, values})
    TORCH_CHECK(buffer.dim() == 4 && buffer.scalar_type() == dtype && buffer.size(0) == B &&
                    buffer.size(1) == kv_heads && buffer.size(2) == keys.size(2) && buffer.size(3) == D &&
                    buffer.stride(3) == 1 && slots <= buffer.size(2),
                "hf_eagle31_rows::draft_step: cache buffers [B, kv, capacity, D] holding every slot expected");
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(where.data_ptr<int64_t>()[t] >= 0 && where.data_ptr<int64_t>()[t] < keys.size(2),
                "hf_eagle31_rows::draft_step: column ", where.data_ptr<int64_t>()[t], " outside the cache");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const char* who = "hf_eagle31_rows::draft_step";
  std::vector<hf_eagle31_rows::Weights> weights = hf_eagle31_rows::held_weights(products.slice(project ? 0 : 1));
  if (project) check_weights(weights[0], products[0], hidden.size(2), H, dtype, who);
  else weights.emplace(weights.begin());  // no fc: the states fed back are the stream
  check_layer(&weights[1], products.data() + 1, 2 * H, H, D, heads, kv_heads, intermediate, dtype, who);
  const int64_t vocabulary = hf_eagle31_rows::features_of(weights[5].weights, H, dtype, who, products[5]);
  TORCH_CHECK(project || hidden.size(2) == H, "hf_eagle31_rows::draft_step: fed-back states of ", H, " features");
  const at::Tensor x = draft_stream(hidden, project, weights[0], norms.slice(0, fc_count), eps.slice(0, fc_count), H,
                                    ways);
  // each query head of a group sees what its position sees (`grouped_attention`'s fold)
  const int64_t G = heads / kv_heads;
  const at::Tensor additive = at::zeros({B, 1, 1, n, slots}, embeds.options())
                                  .masked_fill_(mask.logical_not().view({B, 1, 1, n, slots}), -INFINITY)
                                  .expand({B, 1, G, n, slots}).reshape({B, 1, G * n, slots});
  const int64_t threads = at::get_num_threads();
  Forward f = forward_for(x.view({B, n, H}), D, heads, kv_heads, intermediate, 0, slots, additive, scale, ways,
                          threads);
  f.columns = where.data_ptr<int64_t>();
  LayerCache cache{keys, values, keys.narrow(2, 0, slots), values.narrow(2, 0, slots)};
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  std::vector<at::Tensor> inputs;
  for (int64_t thread = 0; thread < threads; ++thread) inputs.push_back(at::empty({B * n, 2 * H}, embeds.options()));
  in_team(threads, [&](const hf_eagle31_rows::Team& team) {
    if (dtype == at::kFloat)
      draft_layer<float>(f, team, embeds, &weights[1], &norms[fc_count], &eps[fc_count], norm_before_residual, cache,
                         c, s, inputs[team.thread]);
    else
      draft_layer<at::BFloat16>(f, team, embeds, &weights[1], &norms[fc_count], &eps[fc_count], norm_before_residual,
                                cache, c, s, inputs[team.thread]);
  });
  const at::Tensor chosen = f.hs[0].index_select(0, logit_rows);
  at::Tensor logits = at::empty({chosen.size(0), vocabulary}, chosen.options());
  hf_eagle31_rows::product_into(chosen, weights[5], logits, ways);
  return {logits, (norm_output ? f.hs[0] : f.xs[0]).view({B, n, H})};
}

// The index of the largest of V fp32 scores as torch's argmax finds it: the first of equal largest ones (-0 equal to
// 0), the first NaN where there is one.
int64_t argmax_of(const float* x, int64_t V) {
  const Vec none = set16(-INFINITY);
  Vec largest = none;
  Mask nan = 0;
  for (int64_t j = 0; j < V && !nan; j += 16) {
    const Mask m = lanes(V - j);
    const Vec v = select(m, load16(x + j, m), none);
    nan = nans(v);
    largest = max16(largest, v);
  }
  if (nan) return std::find_if(x, x + V, [](float v) { return std::isnan(v); }) - x;
  const Vec top = set16(max_of(largest));
  for (int64_t j = 0;; j += 16) {
    const Mask m = lanes(V - j);
    const Mask equal = equals(load16(x + j, m), top) & m;
    if (equal) return j + __builtin_ctz(equal);
  }
}

// `scores.argmax(-1, keepdim=True)` [..., 1] of scores [..., V], in vectors for contiguous fp32 scores (a decoding
// step's processed logits, `acceptance.pick_token`): torch's CPU argmax compares one score at a time, ~45 us over a
// 49,152-token vocabulary, more with the caches cold after a step streamed the weights.
at::Tensor argmax(const at::Tensor& scores) {
  if (scores.scalar_type() != at::kFloat || !scores.is_contiguous() || scores.dim() == 0 || scores.size(-1) == 0)
    return scores.argmax(-1, true);
  const int64_t V = scores.size(-1), rows = scores.numel() / V;
  std::vector<int64_t> shape = scores.sizes().vec();
  shape.back() = 1;
  at::Tensor out = at::empty(shape, scores.options().dtype(at::kLong));
  for (int64_t row = 0; row < rows; ++row)
    out.data_ptr<int64_t>()[row] = argmax_of(scores.data_ptr<float>() + row * V, V);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_eagle31_rows, m) {
  m.def("step(Tensor x, int[] products, Tensor[] norms, float[] eps, Tensor cos, Tensor sin, int room, int length, "
        "Tensor? mask, float scale, int heads, int kv_heads, int intermediate, int[] capture, int ways, int head) -> "
        "(Tensor, Tensor, Tensor)");
  m.impl("step", c10::DispatchKey::CPU, TORCH_FN(step));
  m.def("release(int room) -> ()", release);
  m.def("draft_step(Tensor embeds, Tensor hidden, bool project, int[] products, Tensor[] norms, float[] eps, "
        "bool norm_before_residual, bool norm_output, Tensor cos, Tensor sin, Tensor keys, Tensor values, "
        "Tensor columns, Tensor mask, Tensor logit_rows, float scale, int heads, int kv_heads, int intermediate, "
        "int ways) -> (Tensor, Tensor)");
  m.impl("draft_step", c10::DispatchKey::CPU, TORCH_FN(draft_step));
  m.def("argmax(Tensor scores) -> Tensor");
  m.impl("argmax", c10::DispatchKey::CPU, TORCH_FN(argmax));
}
