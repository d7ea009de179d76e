// A few rows times a linear layer's own weights (fp32, or bf16 on a CPU with AVX512-BF16), at the rate the
// weights stream from memory: the rows library's kernel on a CPU with AVX-512 (`product_into`, rows.h).
//
// out[m, n] = x[m, :] . w[n, :]: each step loads one vector of W weight rows once and multiplies it into a group of
// input rows held in registers' reach, so a weight is read from memory once for every row. More rows than a group
// holds are two or three groups over the same W weight rows, the later ones reading them again from L1: one group of
// 16 rows against one weight row loaded 17 vectors for 16 multiply-adds, and its input rows (16 x K floats) did not
// fit L1, so it ran far below the memory's rate. Rows further on are prefetched into L2 while these compute: the
// hardware prefetcher alone leaves the memory idle during the multiplications. Into L2, not L1, and 16 rows
// ahead: prefetched weights then do not evict the input rows from L1.
//
// `ways` says, per row count, how a group of that many rows reads (measured on the machine: routes.py), four bits for
// r rows: bit r - 1 (`near`) also prefetches the weights a few lines ahead into L1, so that loads wait less (on an AMD
// EPYC 8-16 rows 5-20% faster, 2-6 rows within a few percent either way, one row slower); bit 16 + r - 1 (`single`)
// reads one weight row at a time (W = 1), a single stream, reloading the input rows from L1 for every weight vector (on
// an AMD EPYC 2-8 bf16 rows 1.2-1.3x faster; 2-3 fp32 rows of 576 features 0.7-0.85x as fast, 4 rows 1.15x). One input
// row (a decoding step) read that way reads the weight rows one after another (`stream_rows`), a stream the hardware
// prefetcher follows, with a light prefetch further ahead: on an AMD EPYC 4-12% faster than W rows side by side, W
// short streams it barely catches; on an Intel Xeon (Sapphire Rapids) slower, where each output's sum, one chain of
// multiply-adds, waits on the last (vdpbf16ps: 8 cycles there, twice an fp32 multiply-add) and W rows are W chains side
// by side: a weight streamed 1.15x faster side by side in fp32 and 1.35x in bf16, and SmolLM2's decoding step ran 1.07x
// and 1.12x faster. Bit 32 + r - 1 (`narrow`) multiplies 7-16 rows in groups of up to 6 against W = 4 weight rows, not
// of up to 8 against W = 3 (on an AMD EPYC 8-16 fp32 rows 1.2-1.3x faster where the weights come from the cache, bf16
// rows up to 10% slower). Bit 48 + r - 2 multiplies 2-16 bf16 rows on AMX's tiles (`amx_rows`).
// Every way but AMX's sums each output in the same order, so all give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "rows.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <type_traits>
#include <vector>

namespace {

constexpr int C = 12;      // weight rows a parallel block: a multiple of every W below
constexpr int64_t GRAIN = 2;  // blocks a thread takes at least
constexpr int AHEAD = 16;  // weight rows prefetched (into L2) ahead of those multiplied
constexpr int STREAM_AHEAD = 16384;  // bytes one input row's stream prefetches ahead (8-32 KB measured alike)
constexpr int NEAR = 64;   // elements of a weight row prefetched into L1 ahead of those multiplied, with `near`
constexpr int STREAM_NEAR = 1024;  // bytes one input row's stream prefetches into L1 ahead, with `near`

// One element type's vectors: how many elements a 512-bit load holds, and the multiply-add into 16 fp32 sums.
struct F32 {
  using T = float;
  using V = __m512;
  static constexpr int LANES = 16;
  static V load(const T* p) { return _mm512_loadu_ps(p); }
  static V load_tail(const T* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
  static __m512 fma(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

#ifdef __AVX512BF16__
struct BF16 {  // pairs of bf16 products summed into each fp32 lane (vdpbf16ps)
  using T = at::BFloat16;
  using V = __m512i;
  static constexpr int LANES = 32;
  static V load(const T* p) { return _mm512_loadu_si512(p); }
  static V load_tail(const T* p, int64_t n) { return _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p); }
  static __m512 fma(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
};
#endif

template <class E, int R, int W, bool TAIL, bool PREFETCH, bool L1>
inline void step(const typename E::T* x, int64_t K, const typename E::T* w, int64_t k, int64_t tail,
                 __m512 (&acc)[R][W]) {
  typename E::V wv[W];
#pragma GCC unroll 4
  for (int c = 0; c < W; ++c) {
    wv[c] = TAIL ? E::load_tail(w + c * K + k, tail) : E::load(w + c * K + k);
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + (c + AHEAD) * K + k), _MM_HINT_T1);
    if (PREFETCH && L1) _mm_prefetch(reinterpret_cast<const char*>(w + c * K + k + NEAR), _MM_HINT_T0);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const typename E::V xv = TAIL ? E::load_tail(x + r * K + k, tail) : E::load(x + r * K + k);
#pragma GCC unroll 4
    for (int c = 0; c < W; ++c) acc[r][c] = E::fma(acc[r][c], xv, wv[c]);
  }
}

// R input rows against W weight rows over all K: out[r, c] = sum + bias[c], rounded once to the output's type.
template <class E, int R, int W, bool PREFETCH, bool L1, class O>
inline void block(const typename E::T* x, int64_t K, const typename E::T* w, const float* bias, O* out,
                  int64_t ldo) {
  __m512 acc[R][W];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < W; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + E::LANES <= K; k += E::LANES) step<E, R, W, false, PREFETCH, L1>(x, K, w, k, 0, acc);
  if (k < K) step<E, R, W, true, PREFETCH, L1>(x, K, w, k, K - k, acc);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < W; ++c)
      out[r * ldo + c] = static_cast<O>(_mm512_reduce_add_ps(acc[r][c]) + (bias ? bias[c] : 0.f));
}

// One input row against `n` weight rows read one after another; each output summed in the order `block` sums it,
// so both give the same bits. One weight line in four prefetched into L2: the hardware prefetcher fetches the rest;
// with `near` (L1) every line also into L1, a little ahead.
template <class E, bool L1, class O>
void stream_rows(const typename E::T* x, int64_t K, const typename E::T* w, const float* bias, int64_t n, O* out) {
  constexpr int L = E::LANES;
  for (int64_t row = 0; row < n; ++row, w += K) {
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 4 * L <= K; k += 4 * L) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + STREAM_AHEAD, _MM_HINT_T1);
      if (L1) {
        const char* next = reinterpret_cast<const char*>(w + k + 4 * L) + STREAM_NEAR;
#pragma GCC unroll 4
        for (int j = 0; j < 4 * L * int(sizeof(typename E::T)); j += 64) _mm_prefetch(next + j, _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc = E::fma(acc, E::load(x + k + j * L), E::load(w + k + j * L));
    }
    for (; k + L <= K; k += L) acc = E::fma(acc, E::load(x + k), E::load(w + k));
    if (k < K) acc = E::fma(acc, E::load_tail(x + k, K - k), E::load_tail(w + k, K - k));
    out[row] = static_cast<O>(_mm512_reduce_add_ps(acc) + (bias ? bias[row] : 0.f));
  }
}

// W weight rows against the input rows in groups of First, Rest... rows: the first group reads the weights from
// memory (with the prefetches), the others read the same weight rows again from L1.
template <class E, bool L1, int W, class O, int First, int... Rest>
inline void blocks(const typename E::T* x, int64_t K, const typename E::T* w, const float* bias, O* out,
                   int64_t ldo) {
  block<E, First, W, true, L1>(x, K, w, bias, out, ldo);
  int64_t r = First;
  ((block<E, Rest, W, false, false>(x + r * K, K, w, bias, out + r * ldo, ldo), r += Rest), ...);
}

// `n` weight rows against input rows in groups of G... rows, W weight rows at a time.
template <class E, bool L1, int W, class O, int... G>
void rows_of(const typename E::T* x, int64_t K, const typename E::T* w, const float* bias, int64_t n, O* out,
             int64_t ldo) {
  int64_t row = 0;
  for (; row + W <= n; row += W) blocks<E, L1, W, O, G...>(x, K, w + row * K, bias ? bias + row : nullptr, out + row,
                                                            ldo);
  for (; row < n; ++row) blocks<E, L1, 1, O, G...>(x, K, w + row * K, bias ? bias + row : nullptr, out + row, ldo);
}

// `n` weight rows against a group of 1-16 input rows, with or without the prefetch into L1, a weight row at a time
// or W side by side, 7-16 rows in groups of up to 6 (NARROW, W = 4) or of up to 8 (W = 3).
template <class E, bool L1, bool SINGLE, bool NARROW, class O>
void group(const typename E::T* x, int64_t M, int64_t K, const typename E::T* w, const float* bias, int64_t n, O* out,
           int64_t ldo) {
  constexpr int W = SINGLE ? 1 : 4, LONG = SINGLE ? 1 : NARROW ? 4 : 3;  // LONG: W for 7 rows or more
  switch (M) {
    case 1:
      if constexpr (SINGLE) stream_rows<E, L1>(x, K, w, bias, n, out);
      else rows_of<E, L1, W, O, 1>(x, K, w, bias, n, out, ldo);
      break;
    case 2: rows_of<E, L1, W, O, 2>(x, K, w, bias, n, out, ldo); break;
    case 3: rows_of<E, L1, W, O, 3>(x, K, w, bias, n, out, ldo); break;
    case 4: rows_of<E, L1, W, O, 4>(x, K, w, bias, n, out, ldo); break;
    case 5: rows_of<E, L1, W, O, 5>(x, K, w, bias, n, out, ldo); break;
    case 6: rows_of<E, L1, W, O, 6>(x, K, w, bias, n, out, ldo); break;
    case 7:
      if constexpr (NARROW) rows_of<E, L1, LONG, O, 4, 3>(x, K, w, bias, n, out, ldo);
      else rows_of<E, L1, LONG, O, 7>(x, K, w, bias, n, out, ldo);
      break;
    case 8:
      if constexpr (NARROW) rows_of<E, L1, LONG, O, 4, 4>(x, K, w, bias, n, out, ldo);
      else rows_of<E, L1, LONG, O, 8>(x, K, w, bias, n, out, ldo);
      break;
    case 9: rows_of<E, L1, LONG, O, 5, 4>(x, K, w, bias, n, out, ldo); break;
    case 10: rows_of<E, L1, LONG, O, 5, 5>(x, K, w, bias, n, out, ldo); break;
    case 11: rows_of<E, L1, LONG, O, 6, 5>(x, K, w, bias, n, out, ldo); break;
    case 12: rows_of<E, L1, LONG, O, 6, 6>(x, K, w, bias, n, out, ldo); break;
    case 13:
      if constexpr (NARROW) rows_of<E, L1, LONG, O, 5, 4, 4>(x, K, w, bias, n, out, ldo);
      else rows_of<E, L1, LONG, O, 7, 6>(x, K, w, bias, n, out, ldo);
      break;
    case 14:
      if constexpr (NARROW) rows_of<E, L1, LONG, O, 5, 5, 4>(x, K, w, bias, n, out, ldo);
      else rows_of<E, L1, LONG, O, 7, 7>(x, K, w, bias, n, out, ldo);
      break;
    case 15:
      if constexpr (NARROW) rows_of<E, L1, LONG, O, 5, 5, 5>(x, K, w, bias, n, out, ldo);
      else rows_of<E, L1, LONG, O, 8, 7>(x, K, w, bias, n, out, ldo);
      break;
    default:
      if constexpr (NARROW) rows_of<E, L1, LONG, O, 6, 5, 5>(x, K, w, bias, n, out, ldo);
      else rows_of<E, L1, LONG, O, 8, 8>(x, K, w, bias, n, out, ldo);
      break;
  }
}

constexpr int SINGLE_BITS = 16;  // bit SINGLE_BITS + r - 1 of `ways`: r rows read one weight row at a time
constexpr int NARROW_BITS = 32;  // bit NARROW_BITS + r - 1: r rows in groups of up to 6
constexpr int AMX_BITS = 48;     // bit AMX_BITS + r - 2: 2-16 bf16 rows on AMX's tiles (`amx_rows`)

#ifdef __AMX_BF16__
// AMX's tile configuration (palette 1): tile 0 the sums [rows x M] fp32, tile 1 the weights [rows x 32] bf16, tile 2
// the input rows [16 pairs x M] of bf16 pairs.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int64_t rows, int64_t M) {
  TileConfig config;
  config.rows[0] = rows, config.colsb[0] = M * 4;
  config.rows[1] = rows, config.colsb[1] = 64;
  config.rows[2] = 16, config.colsb[2] = M * 4;
  _tile_loadconfig(&config);
}

// M bf16 input rows against `n` weight rows on AMX, 16 weight rows a tile: the sums of each output in AMX's order
// (32 products a step, in pairs), not the vector kernel's, so its bits differ from the other ways'. Why: on an Intel
// Xeon a verify block of 6-16 bf16 rows is several times the multiply-adds the vector units do at the memory's rate,
// and the tiles do them at it. K a multiple of 32 (`rows` sends other weights to the vector kernel).
template <class O>
void amx_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, const float* bias, int64_t n,
              O* out, int64_t ldo) {
  thread_local std::vector<uint32_t> packed;  // [K / 32][16][M] pairs: tile 2's rows for each 32 elements of K
  packed.resize(K / 2 * M);
  const auto* pairs = reinterpret_cast<const uint32_t*>(x);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t pair = 0; pair < K / 2; ++pair) packed[pair * M + m] = pairs[m * (K / 2) + pair];
  alignas(64) float sums[16 * 16];
  int64_t configured = -1;
  for (int64_t row = 0; row < n; row += 16) {
    const int64_t rows = std::min<int64_t>(16, n - row);
    if (rows != configured) configure(rows, M), configured = rows;
    const at::BFloat16* block = w + row * K;
    _tile_zero(0);
    for (int64_t k = 0; k < K; k += 32) {
      // the next block's lines (16 weight rows, contiguous), spread over this block's steps
      const char* next = reinterpret_cast<const char*>(block + 16 * K) + k * 32;
#pragma GCC unroll 16
      for (int line = 0; line < 16; ++line) _mm_prefetch(next + line * 64, _MM_HINT_T1);
      _tile_loadd(1, block + k, K * 2);
      _tile_loadd(2, packed.data() + k / 2 * M, M * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sums, M * 4);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t m = 0; m < M; ++m)
        out[m * ldo + row + r] = static_cast<O>(sums[r * M + m] + (bias ? bias[row + r] : 0.f));
  }
  _tile_release();
}
#endif

// Whether AMX multiplies here: built for it, and Linux lets this process use its tiles (asked once).
bool amx_kernel() {
#ifdef __AMX_BF16__
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ready;
#else
  return false;
#endif
}

// `group` in groups of up to 6 rows where `narrow`, else of up to 8.
template <class E, bool L1, bool SINGLE, class O>
void narrow_or_wide(bool narrow, const typename E::T* x, int64_t M, int64_t K, const typename E::T* w,
                    const float* bias, int64_t n, O* out, int64_t ldo) {
  if (narrow) group<E, L1, SINGLE, true>(x, M, K, w, bias, n, out, ldo);
  else group<E, L1, SINGLE, false>(x, M, K, w, bias, n, out, ldo);
}

// `n` weight rows against every input row, 16 input rows at a time (more rows read the weights again); a group of
// r rows reads as bits r - 1, SINGLE_BITS + r - 1 and NARROW_BITS + r - 1 of `ways` say.
template <class E, class O>
void rows(const typename E::T* x, int64_t M, int64_t K, const typename E::T* w, const float* bias, int64_t n, O* out,
          int64_t ldo, int64_t ways) {
  for (int64_t m = 0; m < M; m += 16) {
    const int64_t count = std::min<int64_t>(16, M - m);
    const bool near = (ways >> (count - 1)) & 1, single = (ways >> (SINGLE_BITS + count - 1)) & 1;
    const bool narrow = (ways >> (NARROW_BITS + count - 1)) & 1;
    const auto* xm = x + m * K;
    auto* om = out + m * ldo;
#ifdef __AMX_BF16__
    if constexpr (std::is_same_v<E, BF16>)
      if (count > 1 && ((ways >> (AMX_BITS + count - 2)) & 1) && K % 32 == 0 && amx_kernel()) {
        amx_rows(xm, count, K, w, bias, n, om, ldo);
        continue;
      }
#endif
    if (near && single) narrow_or_wide<E, true, true>(narrow, xm, count, K, w, bias, n, om, ldo);
    else if (near) narrow_or_wide<E, true, false>(narrow, xm, count, K, w, bias, n, om, ldo);
    else if (single) narrow_or_wide<E, false, true>(narrow, xm, count, K, w, bias, n, om, ldo);
    else narrow_or_wide<E, false, false>(narrow, xm, count, K, w, bias, n, om, ldo);
  }
}

// The weights' rows, one after another, as one range of blocks of C rows (a weight's last block may be shorter):
// how many, and blocks [begin, end) of it multiplied (a thread's share).
int64_t blocks_of(at::TensorList weights) {
  int64_t blocks = 0;
  for (const auto& w : weights) blocks += (w.size(0) + C - 1) / C;
  return blocks;
}

template <class E>
void blocks_into(const at::Tensor& x2, at::TensorList weights, const float* bias, at::Tensor& out, int64_t ways,
                 int64_t begin, int64_t end) {
  using T = typename E::T;  // the output in the input's type too, as torch's product gives it
  const int64_t M = x2.size(0), K = x2.size(1), N = out.size(1);
  int64_t first = 0, column = 0;  // each weight's first block and first output
  for (const auto& w : weights) {
    const int64_t blocks = (w.size(0) + C - 1) / C;
    const int64_t from = std::max(begin, first) - first, to = std::min(end, first + blocks) - first;
    if (from < to) {
      const int64_t row = from * C, rows_here = std::min(w.size(0), to * C) - row;
      rows<E>(x2.data_ptr<T>(), M, K, w.data_ptr<T>() + row * K, bias ? bias + column + row : nullptr, rows_here,
              out.data_ptr<T>() + column + row, N, ways);
    }
    first += blocks;
    column += w.size(0);
  }
}

// x2 [M, K] (contiguous) times the weights into out [M, sum N_i] (contiguous), in x2's dtype: blocks [begin, end).
void multiply_blocks(const at::Tensor& x2, at::TensorList weights, const float* bias, at::Tensor& out,
                     int64_t ways, int64_t begin, int64_t end) {
  if (x2.scalar_type() == at::kFloat) blocks_into<F32>(x2, weights, bias, out, ways, begin, end);
#ifdef __AVX512BF16__
  else blocks_into<BF16>(x2, weights, bias, out, ways, begin, end);
#endif
}

// Every block, split among the threads in one parallel region: a product of several weights (q/k/v, gate/up)
// starts and joins the threads once, not once a weight.
void multiply(const at::Tensor& x2, at::TensorList weights, const float* bias, at::Tensor& out, int64_t ways) {
  at::parallel_for(0, blocks_of(weights), GRAIN, [&](int64_t begin, int64_t end) {
    multiply_blocks(x2, weights, bias, out, ways, begin, end);
  });
}

}  // namespace

namespace hf_eagle31_rows {

bool multiplies_bf16() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

void product_into(const at::Tensor& x, const Weights& weights, at::Tensor& out, int64_t ways) {
  multiply(x, weights.weights, weights.bias.defined() ? weights.bias.data_ptr<float>() : nullptr, out, ways);
}

void product_share(const at::Tensor& x, const Weights& weights, at::Tensor& out, int64_t ways, const Team& team) {
  const auto [begin, end] = team.share(blocks_of(weights.weights), GRAIN);
  if (begin < end)
    multiply_blocks(x, weights.weights, weights.bias.defined() ? weights.bias.data_ptr<float>() : nullptr, out, ways,
                    begin, end);
}

}  // namespace hf_eagle31_rows

TORCH_LIBRARY_FRAGMENT(hf_eagle31_rows, m) { m.def("amx() -> bool", [] { return amx_kernel(); }); }
