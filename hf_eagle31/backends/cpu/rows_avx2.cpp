// A few rows times a linear layer's own weights (fp32 or bf16) on a CPU with AVX2 and FMA but not AVX-512, where the
// rows library (rows_linear.cpp and the rest) does not build: the products only, at the rate the weights stream.
//
// out[m, n] = x[m, :] . w[n, :] in blocks of W = 3 weight rows, each read from memory once for every input row: a
// block's vectors multiply R = 3 input rows at a time (9 sums, 3 weight vectors and an input vector: 13 of the 16
// registers), the later groups of rows reading the block again from L1. The first group prefetches the weight rows
// 16 ahead into L2, so that the memory streams while the block computes: without it 2-8 rows ran 1.2-1.6x slower.
// Measured on an Intel Xeon with AVX-512 masked (2 threads, 1 GiB of weights, ms), against torch's product (MKL
// limited to AVX2): fp32 1 row 37.8 / 40.2, 2 rows 37.2 / 72.3, 4 rows 43.1 / 77.7, 8 rows 56.3 / 96.6, 16 rows 85.0 /
// 114.6; bf16 1 row 47.5 / 79.3, 4 rows 69.4 / 182.5, 16 rows 193 / 657. Which serves a row count is measured on the
// machine (routes.py). A bf16 weight is the top half of the fp32 with the same bits: converted as it is loaded, its
// sums in fp32, the output rounded to bf16 once. Every output is summed in the same order whatever the group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <vector>

namespace {

constexpr int W = 3;           // weight rows a block
constexpr int R = 3;           // input rows a group
constexpr int64_t AHEAD = 16;  // weight rows prefetched (into L2) ahead of those multiplied
constexpr int64_t GRAIN = 4;   // blocks a thread takes at least

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline float sum8(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

// Rows x [Rn, K] (fp32) times weight rows w [Wn, K] into out (rows `ldo` apart), plus bias (or null); PREFETCH: the
// weight rows AHEAD on, a cache line at a time.
template <int Rn, int Wn, bool PREFETCH, class T>
void block(const float* x, const T* w, int64_t K, const float* bias, float* out, int64_t ldo) {
  constexpr int64_t LINE = 64 / sizeof(T);
  __m256 acc[Rn][Wn];
  for (int r = 0; r < Rn; ++r)
    for (int c = 0; c < Wn; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[Wn];
    for (int c = 0; c < Wn; ++c) {
      wv[c] = load8(w + c * K + k);
      if (PREFETCH && (k & (LINE - 1)) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + (c + AHEAD) * K + k), _MM_HINT_T1);
    }
    for (int r = 0; r < Rn; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < Wn; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < Rn; ++r)
    for (int c = 0; c < Wn; ++c) {
      float sum = sum8(acc[r][c]);
      for (int64_t j = k; j < K; ++j) sum += x[r * K + j] * static_cast<float>(w[c * K + j]);
      out[r * ldo + c] = bias == nullptr ? sum : sum + bias[c];
    }
}

// The `left` rows of x from xm (R at most) times Wn weight rows.
template <int Wn, bool PREFETCH, class T>
void group(int64_t left, const float* xm, const T* w, int64_t K, const float* bias, float* om, int64_t ldo) {
  if (left >= 3) block<3, Wn, PREFETCH>(xm, w, K, bias, om, ldo);
  else if (left == 2) block<2, Wn, PREFETCH>(xm, w, K, bias, om, ldo);
  else block<1, Wn, PREFETCH>(xm, w, K, bias, om, ldo);
}

// All M rows of x [M, K] times Wn weight rows: groups of R rows, the first prefetching.
template <int Wn, class T>
void rows_times(const float* x, int64_t M, const T* w, int64_t K, const float* bias, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; m += R) {
    if (m == 0) group<Wn, true>(M, x, w, K, bias, out, ldo);
    else group<Wn, false>(M - m, x + m * K, w, K, bias, out + m * ldo, ldo);
  }
}

// x [M, K] times each of `weights` [N_i, K] into out [M, sum N_i] (fp32), plus bias (or null): every weight's blocks
// of W rows in one parallel loop, so that each thread streams one stretch of them.
template <class T>
void multiply(const at::Tensor& x, at::TensorList weights, const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  // each weight's first block and first column, and past the last; its data: read once, not at every block
  std::vector<int64_t> first_block{0}, first_column{0};
  std::vector<const T*> data;
  for (const auto& w : weights) {
    first_block.push_back(first_block.back() + (w.size(0) + W - 1) / W);
    first_column.push_back(first_column.back() + w.size(0));
    data.push_back(w.data_ptr<T>());
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, first_block.back(), GRAIN, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (b >= first_block[i + 1]) ++i;
      const int64_t row = (b - first_block[i]) * W;
      const int64_t rows = std::min<int64_t>(W, first_column[i + 1] - first_column[i] - row);
      const T* w = data[i] + row * K;
      const int64_t column = first_column[i] + row;
      const float* bc = bias == nullptr ? nullptr : bias + column;
      if (rows == 3) rows_times<3>(xp, M, w, K, bc, op + column, N);
      else if (rows == 2) rows_times<2>(xp, M, w, K, bc, op + column, N);
      else rows_times<1>(xp, M, w, K, bc, op + column, N);
    }
  });
}

// x [..., K] times each weight [N_i, K] (contiguous, in x's dtype), side by side in the output's last dimension,
// plus bias [sum N_i].
at::Tensor linear(const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "hf_eagle31_avx2.linear: fp32 or bf16 input expected, "
              "got ", dtype);
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const int64_t K = x2.size(1);
  int64_t N = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
                "hf_eagle31_avx2.linear: contiguous ", dtype, " weights of ", K, " input features expected");
    N += w.size(0);
  }
  at::Tensor b;  // fp32: added before the output's one rounding
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "hf_eagle31_avx2.linear: a bias of ", N, " features expected");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({x2.size(0), N}, x2.options());
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) multiply<float>(x2, weights, bp, out);
  else multiply<at::BFloat16>(x2, weights, bp, out);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return out.to(dtype).view(shape);
}

}  // namespace

TORCH_LIBRARY(hf_eagle31_avx2, m) {
  m.def("linear(Tensor x, Tensor[] weights, Tensor? bias) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
