// The attention of a few query rows over a cache of keys (fp32 or bf16, computed in fp32 on rows.h's vectors): a
// decoding step's, where each query head is one row, and a verify block's computed whole (rows_step.cpp), where each
// query head of each token is one (there, for EAGLE's blocks of 5 on an AMD EPYC, SDPA took an EAGLE step 0.95-1.04x
// as long: medians of 3 runs of interleaved rounds).
//
// Why: torch's SDPA on a CPU (its flash kernel) blocks queries by 32 and keys by 512, so a step's few rows over a
// few hundred keys take it several times their arithmetic (docs/benchmarks.md: a fifth of a compiled SmolLM2 step's
// time between the products went to it). Each row here is one task: its scores against every key of its head (kept
// in a buffer) and their softmax, then the values weighted by them, in one pass for a few rows of a head (`weigh`);
// keys and values are read from the cache as they lie (strided views of its buffers). An additive mask is added to
// the scores before the softmax, as SDPA adds it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "rows.h"

#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using namespace hf_eagle31_rows;  // the vectors (rows.h)

constexpr int MAX_DIM = 256;  // head dims up to this, in steps of 16 (a vector)

bool attends(int64_t head_dim) { return head_dim % 16 == 0 && head_dim <= MAX_DIM; }

// Each key's score s[j] = qv . k[j] (the query already scaled; `mask` [L] added, if any) for keys [L, D] (rows `ks`
// apart); returns the highest.
template <class T>
float score(const Vec* qv, int64_t vectors, const T* k, int64_t ks, const T* mask, int64_t L, float* s) {
  Vec tops = set16(-INFINITY);
  int64_t j = 0;
  if (vectors <= 8) {  // 16 keys at a time, summed together (`sums16`); 16 sums and the query in registers
    for (; j + 16 <= L; j += 16) {
      Vec acc[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) acc[c] = zero16();
      for (int64_t d = 0; d < vectors; ++d)
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) acc[c] = fmadd(qv[d], load16(k + (j + c) * ks + 16 * d), acc[c]);
      Vec sixteen = sums16(acc);
      if (mask) sixteen = add(sixteen, load16(mask + j));
      store16(s + j, sixteen);
      tops = max16(sixteen, tops);  // a NaN score is passed over, as std::max(top, s) below passes it
    }
  }
  const int64_t summed = j;
  for (; j + 4 <= L; j += 4) {  // four keys at a time: four independent sums in flight
    Vec acc[4] = {zero16(), zero16(), zero16(), zero16()};
    for (int64_t d = 0; d < vectors; ++d)
      for (int c = 0; c < 4; ++c) acc[c] = fmadd(qv[d], load16(k + (j + c) * ks + 16 * d), acc[c]);
    for (int c = 0; c < 4; ++c) s[j + c] = sum16(acc[c]);
  }
  for (; j < L; ++j) {
    Vec acc = zero16();
    for (int64_t d = 0; d < vectors; ++d) acc = fmadd(qv[d], load16(k + j * ks + 16 * d), acc);
    s[j] = sum16(acc);
  }
  float top = max_of(tops);
  for (j = summed; j < L; ++j) {
    if (mask) s[j] += static_cast<float>(mask[j]);
    top = std::max(top, s[j]);
  }
  return top;
}

// One query row `q` [D]'s softmax weights over keys [L, D] (rows `ks` apart), `mask` [L] (or none): s[j] the
// exponential of key j's score less the highest, s[L] a zero (an odd count's last pair in `weigh`); returns their sum.
template <class T>
float softmax_weights(const T* q, const T* k, int64_t ks, const T* mask, int64_t L, int64_t D, float scale, float* s) {
  const int64_t vectors = D / 16;
  Vec qv[MAX_DIM / 16];
  for (int64_t d = 0; d < vectors; ++d) qv[d] = mul(load16(q + 16 * d), set16(scale));
  const float top = score(qv, vectors, k, ks, mask, L, s);
  Vec total = zero16();
  for (int64_t j = 0; j < L; j += 16) {
    const Vec e = keep(lanes(L - j), exp16(sub(load16(s + j), set16(top))));
    store16(s + j, e);
    total = add(total, e);
  }
  s[L] = 0.f;
  return sum16(total);
}

// A row's weighted values, its even and odd keys' sums [D / 16 vectors], over its weights' `sum`, into `out` [D].
template <class T>
void store_row(const Vec* even, const Vec* odd, int64_t vectors, float sum, T* out) {
  alignas(64) float row[MAX_DIM];
  const Vec total = set16(sum);
  for (int64_t d = 0; d < vectors; ++d) store16(row + 16 * d, div(add(even[d], odd[d]), total));
  for (int64_t d = 0; d < 16 * vectors; ++d) out[d] = static_cast<T>(row[d]);
}

// ROWS rows' weights s[r] (over their `sums`) times the values [L, D = 16 VEC] (rows `vs` apart), into out[r]: each
// value vector loaded once for all the rows, their sums in registers, even and odd keys in two chains a row.
// Why: a key/value head's rows (its query heads, and a block's tokens) weigh the same values, which a row at a time
// loaded and converted once a row: SmolLM2's step at 1,545 cached tokens 1.03x as fast in bf16, at 245 1.00x; fp32
// attention alone 1.05-1.08x over cached keys (AMD EPYC).
template <class T, int VEC, int ROWS>
void weigh(const float* const* s, const float* sums, const T* v, int64_t vs, int64_t L, T* const* out) {
  Vec even[ROWS][VEC], odd[ROWS][VEC];
  for (int r = 0; r < ROWS; ++r)
    for (int d = 0; d < VEC; ++d) even[r][d] = odd[r][d] = zero16();
  for (int64_t j = 0; j < L; j += 2) {
    const T* next = v + std::min(j + 1, L - 1) * vs;  // an odd count's last pair weighs a zero: its last row again
#pragma GCC unroll 8
    for (int d = 0; d < VEC; ++d) {
      const Vec ve = load16(v + j * vs + 16 * d), vo = load16(next + 16 * d);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        even[r][d] = fmadd(set16(s[r][j]), ve, even[r][d]);
        odd[r][d] = fmadd(set16(s[r][j + 1]), vo, odd[r][d]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) store_row(even[r], odd[r], VEC, sums[r], out[r]);
}

// `weigh` of one row for any head size up to MAX_DIM: its sums in memory.
template <class T>
void weigh_any(const float* s, float sum, const T* v, int64_t vs, int64_t L, int64_t D, T* out) {
  const int64_t vectors = D / 16;
  Vec even[MAX_DIM / 16], odd[MAX_DIM / 16];
  for (int64_t d = 0; d < vectors; ++d) even[d] = odd[d] = zero16();
  for (int64_t j = 0; j < L; j += 2) {
    const Vec e = set16(s[j]), o = set16(s[j + 1]);
    const T* next = v + std::min(j + 1, L - 1) * vs;
    for (int64_t d = 0; d < vectors; ++d) {
      even[d] = fmadd(e, load16(v + j * vs + 16 * d), even[d]);
      odd[d] = fmadd(o, load16(next + 16 * d), odd[d]);
    }
  }
  store_row(even, odd, vectors, sum, out);
}

// How many of a key/value head's rows one pass over its values serves: three of head size 64 (the size measured),
// their sums in registers; one of any other.
constexpr int64_t MOST_AT_ONCE = 3;
int64_t rows_at_once(int64_t D) { return D == 64 ? MOST_AT_ONCE : 1; }

// `count` rows (at most `rows_at_once`) of one key/value head: weights s[r] over sums[r] times its values, into out[r].
template <class T>
void weigh_rows(const float* const* s, const float* sums, int64_t count, const T* v, int64_t vs, int64_t L, int64_t D,
                T* const* out) {
  if (D == 64 && count == 3) return weigh<T, 4, 3>(s, sums, v, vs, L, out);
  if (D == 64 && count == 2) return weigh<T, 4, 2>(s, sums, v, vs, L, out);
  for (int64_t r = 0; r < count; ++r) weigh_any(s[r], sums[r], v, vs, L, D, out[r]);
}

// Rows [begin, end) of `q` [B, G, R, D] (row b G R + g R + r) over their groups' keys, into `out` (contiguous): each
// row's own softmax weights, then a group's rows `rows_at_once` at a time through one pass over its values.
template <class T>
void attend_range(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& m, float scale,
                  at::Tensor& out, int64_t begin, int64_t end) {
  const int64_t G = q.size(1), R = q.size(2), D = q.size(3), L = k.size(2), most = rows_at_once(D);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const T* mp = m.defined() ? m.data_ptr<T>() : nullptr;
  std::vector<float> scores(most * (L + 16));
  float* s[MOST_AT_ONCE];
  float sums[MOST_AT_ONCE];
  T* outs[MOST_AT_ONCE];
  for (int64_t i = begin; i < end;) {
    const int64_t b = i / (G * R), g = i / R % G, first = i % R;
    const int64_t count = std::min({most, end - i, R - first});  // this group's next rows
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row = first + r;
      s[r] = scores.data() + r * (L + 16);
      outs[r] = out.data_ptr<T>() + (i + r) * D;
      sums[r] = softmax_weights(qp + b * q.stride(0) + g * q.stride(1) + row * q.stride(2),
                                kp + b * k.stride(0) + g * k.stride(1), k.stride(2),
                                mp ? mp + b * m.stride(0) + g * m.stride(1) + row * m.stride(2) : nullptr, L, D, scale,
                                s[r]);
    }
    weigh_rows(s, sums, count, vp + b * v.stride(0) + g * v.stride(1), v.stride(2), L, D, outs);
    i += count;
  }
}

// Every row of `q` [B, G, R, D] over its group's keys, one task per row, into `out` (contiguous).
template <class T>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& m, float scale,
                at::Tensor& out) {
  at::parallel_for(0, q.size(0) * q.size(1) * q.size(2), 1, [&](int64_t begin, int64_t end) {
    attend_range<T>(q, k, v, m, scale, out, begin, end);
  });
}

// query [B, G, R, D], key and value [B, G, L, D] (the last dimension contiguous), mask [B, 1 or G, R, L] additive
// (or none): [B, G, R, D], each of the R rows of a group over that group's keys.
at::Tensor rows_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const c10::optional<at::Tensor>& mask, double scale) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rows attention: fp32 or bf16 expected, got ", dtype);
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "rows attention: 4-d inputs expected");
  const int64_t B = query.size(0), G = query.size(1), R = query.size(2), D = query.size(3), L = key.size(2);
  TORCH_CHECK(attends(D) && key.size(3) == D && value.size(3) == D, "rows attention: head dims of a multiple of 16 ",
              "up to ", MAX_DIM, " expected, got ", D);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == B && key.size(1) == G, "rows attention: key and value ",
              "[B, G, L, D] expected");
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype, "rows attention: one dtype expected");
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  at::Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == dtype && mask->dim() == 4, "rows attention: a 4-d additive mask expected");
    m = mask->expand({B, G, R, L});
    if (m.stride(3) != 1) m = m.contiguous();
  }
  at::Tensor out = at::empty({B, G, R, D}, q.options());
  if (dtype == at::kFloat) attend_all<float>(q, k, v, m, static_cast<float>(scale), out);
  else attend_all<at::BFloat16>(q, k, v, m, static_cast<float>(scale), out);
  return out;
}

// Each layer's key and value buffers of a call's cache room (lean.py's `CacheRoom`), held under the room's key, so
// that a compiled one-token step writes and attends there instead of taking 60 cache views as inputs, each with a
// length of its own for inductor's entry to check and convert. Held weakly: the room owns them.
using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
std::mutex rooms_lock;
std::unordered_map<int64_t, std::vector<std::pair<Weak, Weak>>> rooms;

// Hold the room's layers' buffers, keys[i] and values[i] for layer i; rooms whose buffers were freed are dropped.
void hold_room(int64_t room, at::TensorList keys, at::TensorList values) {
  TORCH_CHECK(keys.size() == values.size(), "hold_room: a values buffer for each keys buffer");
  std::lock_guard<std::mutex> lock(rooms_lock);
  for (auto entry = rooms.begin(); entry != rooms.end();)
    entry = entry->second.empty() || entry->second[0].first.expired() ? rooms.erase(entry) : ++entry;
  std::vector<std::pair<Weak, Weak>> layers;
  for (size_t i = 0; i < keys.size(); ++i) layers.emplace_back(keys[i].getIntrusivePtr(), values[i].getIntrusivePtr());
  rooms[room] = std::move(layers);
}

// Each buffer's first `length` entries [B, H, length, D]: the cache views a room hands its layers at every forward
// (lean.py's `CacheRoom.reserve`), made in one call where 60 `narrow`s from Python cost ~0.1 ms of a SmolLM2 step.
std::vector<at::Tensor> fronts(at::TensorList buffers, int64_t length) {
  std::vector<at::Tensor> views;
  views.reserve(buffers.size());
  for (const auto& buffer : buffers) views.push_back(buffer.narrow(2, 0, length));
  return views;
}

// Each view [B, H, L, D] of a room's buffer set in place to its first `length` entries: what `CacheRoom.commit`
// makes each layer's cache once a forward wrote its block behind it, and `CacheRoom.truncate` once the walk rejected
// part of it, the layers keeping their tensors instead of taking 60 new views a SmolLM2 step (each a Python object
// made, and one freed).
void set_length(at::TensorList views, int64_t length) {
  for (const auto& view : views) {
    TORCH_CHECK(view.dim() == 4 && length >= 0, "hf_eagle31_rows::set_length: views [B, H, L, D] and a length of at "
                "least 0 expected");
    int64_t last = view.storage_offset() + (length - 1) * view.stride(2);  // the last element it will reach
    for (const int64_t dim : {0, 1, 3}) last += (view.size(dim) - 1) * view.stride(dim);
    const bool none = length == 0 || view.size(0) == 0 || view.size(1) == 0 || view.size(3) == 0;  // no element
    const int64_t bytes = (last + 1) * static_cast<int64_t>(view.itemsize());
    TORCH_CHECK(none || bytes <= static_cast<int64_t>(view.storage().nbytes()),
                "hf_eagle31_rows::set_length: no room for ", length, " entries in a view's buffer");
  }
  for (const auto& view : views) {
    std::vector<int64_t> sizes = view.sizes().vec();
    sizes[2] = length;
    view.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, view.strides());
  }
}

}  // namespace

namespace hf_eagle31_rows {

std::pair<at::Tensor, at::Tensor> room_layer(int64_t room, int64_t layer) {
  std::pair<at::Tensor, at::Tensor> buffers;
  {
    std::lock_guard<std::mutex> lock(rooms_lock);
    const auto entry = rooms.find(room);
    TORCH_CHECK(entry != rooms.end() && layer < static_cast<int64_t>(entry->second.size()),
                "hf_eagle31_rows: no buffers held for layer ", layer, " of room ", room);
    buffers = {at::Tensor(entry->second[layer].first.lock()), at::Tensor(entry->second[layer].second.lock())};
  }
  TORCH_CHECK(buffers.first.defined() && buffers.second.defined(), "hf_eagle31_rows: the buffers of room ",
              room, " were freed");
  return buffers;
}

void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& m, double scale,
                 at::Tensor& out, int64_t begin, int64_t end) {
  if (q.scalar_type() == at::kFloat) attend_range<float>(q, k, v, m, static_cast<float>(scale), out, begin, end);
  else attend_range<at::BFloat16>(q, k, v, m, static_cast<float>(scale), out, begin, end);
}

}  // namespace hf_eagle31_rows

namespace {

// The new keys and values [B, G, n, D] written into the room's buffers of `layer` behind its `length` cached
// entries, then `query`'s rows attending over all length + n (`rows_attention`).
at::Tensor attention_in_room(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                             c10::SymInt room_key, int64_t layer, c10::SymInt cached,
                             const c10::optional<at::Tensor>& mask, double scale) {
  const int64_t room = room_key.expect_int(), length = cached.expect_int();
  auto [kb, vb] = hf_eagle31_rows::room_layer(room, layer);
  const int64_t n = keys.size(2);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.dim() == 4 && kb.dim() == 4 && length + n <= kb.size(2),
              "hf_eagle31_rows::attention_in_room: no room for ", n, " more keys after ", length, " in a buffer of ",
              kb.dim() == 4 ? kb.size(2) : 0);
  kb.narrow(2, length, n).copy_(keys);
  vb.narrow(2, length, n).copy_(values);
  return rows_attention(query, kb.narrow(2, 0, length + n), vb.narrow(2, 0, length + n), mask, scale);
}

at::Tensor attention_in_room_shape(const at::Tensor& query, const at::Tensor&, const at::Tensor&, c10::SymInt,
                                   int64_t, c10::SymInt, const c10::optional<at::Tensor>&, double) {
  return at::empty_symint(query.sym_sizes(), query.options());
}

// The output's shape and type, not its values: what torch.compile traces a graph with (sizes may be symbolic).
at::Tensor rows_attention_shape(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const c10::optional<at::Tensor>& mask, double scale) {
  return at::empty_symint(query.sym_sizes(), query.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_eagle31_rows, m) {
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.impl("attention", c10::DispatchKey::CPU, TORCH_FN(rows_attention));
  m.impl("attention", c10::DispatchKey::Meta, TORCH_FN(rows_attention_shape));
  m.def("attends(int head_dim) -> bool", [](int64_t head_dim) { return attends(head_dim); });
  m.def("hold_room(int room, Tensor[] keys, Tensor[] values) -> ()", hold_room);
  m.def("fronts(Tensor(a)[] buffers, int length) -> Tensor(a)[]", fronts);
  m.def("set_length(Tensor(a!)[] views, int length) -> ()", set_length);
  m.def("attention_in_room(Tensor query, Tensor keys, Tensor values, SymInt room, int layer, SymInt length, "
        "Tensor? mask, float scale) -> Tensor");
  m.impl("attention_in_room", c10::DispatchKey::CPU, TORCH_FN(attention_in_room));
  m.impl("attention_in_room", c10::DispatchKey::Meta, TORCH_FN(attention_in_room_shape));
}
