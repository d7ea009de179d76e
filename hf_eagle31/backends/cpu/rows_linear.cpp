// A few rows times a linear layer's own fp32 weights, at the rate the weights stream from memory (AVX-512).
//
// out[m, n] = x[m, :] . w[n, :]: each step loads 16 floats of 1-3 weight rows once and multiplies them into
// up to 16 input rows held in L1, so a weight is read from memory once for up to 16 rows (more re-read a
// block from L1). Rows further on are prefetched into L2 while these compute: the hardware prefetcher alone
// leaves the memory idle during the multiplications (8 rows cost ~1.9 one-row products without, ~1.2 with).
// Into L2, not L1, and 16 rows ahead: prefetched weights then do not evict the input rows from L1 (48 rows
// ahead into L1 cost 2 / 5 / 8 / 16 rows 1.2 / 1.3 / 1.35 / 1.7 one-row products of SmolLM2's weights on a 2-core
// Xeon, 16 ahead into L2 1.0 / 1.05 / 1.2 / 1.6).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int C = 6;         // weight rows a block: 3, 2 or 1 at a time against 8, 12 or 16 input rows (24 accumulators)
constexpr int AHEAD = 16;    // weight rows prefetched (into L2) ahead of those multiplied

template <int R, int W, bool TAIL>
inline void step(const float* x, int64_t K, const float* w, int64_t k, __mmask16 mask, __m512 (&acc)[R][W]) {
  __m512 wv[W];
#pragma GCC unroll 3
  for (int c = 0; c < W; ++c) {
    wv[c] = TAIL ? _mm512_maskz_loadu_ps(mask, w + c * K + k) : _mm512_loadu_ps(w + c * K + k);
    _mm_prefetch(reinterpret_cast<const char*>(w + (c + AHEAD) * K + k), _MM_HINT_T1);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 xv = TAIL ? _mm512_maskz_loadu_ps(mask, x + r * K + k) : _mm512_loadu_ps(x + r * K + k);
#pragma GCC unroll 3
    for (int c = 0; c < W; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
  }
}

template <int R, int W>
inline void block(const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  __m512 acc[R][W];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < W; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) step<R, W, false>(x, K, w, k, 0, acc);
  if (k < K) step<R, W, true>(x, K, w, k, (__mmask16)((1u << (K - k)) - 1), acc);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < W; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int R>
void rows_of(const float* x, int64_t K, const float* w, int64_t n, float* out, int64_t ldo) {
  constexpr int W = R <= 8 ? 3 : R <= 12 ? 2 : 1;
  int64_t row = 0;
  for (; row + W <= n; row += W) block<R, W>(x, K, w + row * K, out + row, ldo);
  for (; row < n; ++row) block<R, 1>(x, K, w + row * K, out + row, ldo);
}

// `n` weight rows against every input row, 16 input rows at a time.
void rows(const float* x, int64_t M, int64_t K, const float* w, int64_t n, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; m += 16) {
    const float* xm = x + m * K;
    float* om = out + m * ldo;
    switch (std::min<int64_t>(16, M - m)) {
      case 1: rows_of<1>(xm, K, w, n, om, ldo); break;
      case 2: rows_of<2>(xm, K, w, n, om, ldo); break;
      case 3: rows_of<3>(xm, K, w, n, om, ldo); break;
      case 4: rows_of<4>(xm, K, w, n, om, ldo); break;
      case 5: rows_of<5>(xm, K, w, n, om, ldo); break;
      case 6: rows_of<6>(xm, K, w, n, om, ldo); break;
      case 7: rows_of<7>(xm, K, w, n, om, ldo); break;
      case 8: rows_of<8>(xm, K, w, n, om, ldo); break;
      case 9: rows_of<9>(xm, K, w, n, om, ldo); break;
      case 10: rows_of<10>(xm, K, w, n, om, ldo); break;
      case 11: rows_of<11>(xm, K, w, n, om, ldo); break;
      case 12: rows_of<12>(xm, K, w, n, om, ldo); break;
      case 13: rows_of<13>(xm, K, w, n, om, ldo); break;
      case 14: rows_of<14>(xm, K, w, n, om, ldo); break;
      case 15: rows_of<15>(xm, K, w, n, om, ldo); break;
      default: rows_of<16>(xm, K, w, n, om, ldo); break;
    }
  }
}

// x [..., K] times each weight [N_i, K], side by side in the output's last dimension, plus bias [sum N_i].
at::Tensor rows_linear(const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rows_linear: fp32 input expected, got ", x.scalar_type());
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1);
  int64_t N = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
                "rows_linear: contiguous fp32 weights of ", K, " input features expected");
    N += w.size(0);
  }
  at::Tensor out = at::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t column = 0;
  for (const auto& w : weights) {
    const float* wp = w.data_ptr<float>();
    const int64_t n = w.size(0), blocks = n / C;
    float* oc = op + column;
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      rows(xp, M, K, wp + begin * C * K, (end - begin) * C, oc + begin * C, N);
    });
    rows(xp, M, K, wp + blocks * C * K, n - blocks * C, oc + blocks * C, N);
    column += n;
  }
  if (bias.has_value()) out.add_(*bias);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(hf_eagle31_rows, m) {
  m.def("linear(Tensor x, Tensor[] weights, Tensor? bias) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(rows_linear));
}
