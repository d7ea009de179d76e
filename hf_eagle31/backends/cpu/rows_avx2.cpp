// A few rows times a linear layer's own weights (fp32 or bf16) on a CPU with AVX2 and FMA but not AVX-512, at the rate
// the weights stream: the rows library's kernel there (rows.py builds it with rows_held.cpp, rows_attention.cpp and
// rows_step.cpp in place of rows_linear.cpp).
//
// out[m, n] = x[m, :] . w[n, :] in blocks of W = 3 weight rows, each read from memory once for every input row: a
// block's vectors multiply up to R = 4 input rows at a time (12 sums and 3 weight vectors of the 16 registers, the
// input vector read by each multiply-add), the later groups of rows reading the block again from L1. More rows are
// split in groups as even as can be (5 rows as 3 and 2, not 4 and 1): a group of one row has three chains of
// multiply-adds, each waiting on the last. The first group prefetches the weight rows 16 ahead into L2, so that the
// memory streams while the block computes: without it 2-8 rows ran 1.2-1.6x slower. Measured on an Intel Xeon with
// AVX-512 masked (2 threads, 1 GiB of weights, ms), against torch's product (MKL limited to AVX2): fp32 1 row 37.8 /
// 40.2, 2 rows 37.2 / 72.3, 4 rows 43.1 / 77.7, 8 rows 56.3 / 96.6, 16 rows 85.0 / 114.6; bf16 1 row 47.5 / 79.3, 4
// rows 69.4 / 182.5, 16 rows 193 / 657. Groups of up to 4 rows against groups of up to 3 (median ratio of 21
// interleaved timings, with the bf16 steps below): fp32 4 and 7-16 rows 1.07-1.11x as fast (5-6 rows are the same
// groups), bf16 4, 7, 8 and 10 rows 1.13-1.21x, 5-6 and 12-16 rows 1.02-1.08x, 1-3 rows 1.00-1.06x. Which serves a
// row count is measured on the machine (routes.py).
//
// A bf16 weight is the top half of the fp32 with the same bits. The kernel reads 16 of a row's elements at once and
// multiplies them as two vectors, the even elements (each 32-bit lane's low half, shifted up) and the odd ones (its
// high half, the low half cleared): one or two integer operations a vector where widening 8 elements took two, which
// a verify block's bf16 products, bound by these operations and the multiply-adds, ran 1.02-1.08x faster for. The
// input rows are converted to fp32 once a product and laid out to match (`as_fp32`), the sums kept in fp32 and the
// output rounded to bf16 once. Every output is summed in the same order whatever the group. The library's `ways`
// name ways of the AVX-512 kernel: here there is one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "rows.h"

#include <vector>

namespace {

using hf_eagle31_rows::sum8;

constexpr int W = 3;           // weight rows a block
constexpr int R = 4;           // input rows a group at most
constexpr int64_t AHEAD = 16;  // weight rows prefetched (into L2) ahead of those multiplied
constexpr int64_t GRAIN = 4;   // blocks a thread takes at least

// Elements of T `block` multiplies a step: one vector of an fp32 weight row, two of a bf16 one (`part`).
template <class T>
constexpr int64_t STEP = 32 / sizeof(T);

// The H-th vector of a weight row's step at p as fp32: fp32 8 elements in a row; bf16 the 8 even elements (H = 0)
// or the 8 odd ones, whose low halves are cleared by a mask, or where a group of 4 rows leaves no register to hold
// the mask (CLEAR_BY_SHIFTS), by two shifts.
template <int H, bool CLEAR_BY_SHIFTS>
inline __m256 part(const float* p) { return _mm256_loadu_ps(p + 8 * H); }
template <int H, bool CLEAR_BY_SHIFTS>
inline __m256 part(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (H == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  if (CLEAR_BY_SHIFTS) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16));
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The H-th vectors of a step at k: Rn rows of x (fp32, in `as_fp32`'s layout) times Wn weight rows, into acc.
template <int H, int Rn, int Wn, bool PREFETCH, class T>
inline void multiply_add(const float* x, const T* w, int64_t K, int64_t k, __m256 (&acc)[Rn][Wn]) {
  constexpr int64_t LINE = 64 / sizeof(T);
  __m256 wv[Wn];
  for (int c = 0; c < Wn; ++c) {
    wv[c] = part<H, (Rn == 4)>(w + c * K + k);
    if (PREFETCH && H == 0 && (k & (LINE - 1)) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(w + (c + AHEAD) * K + k), _MM_HINT_T1);
  }
  for (int r = 0; r < Rn; ++r) {
    const __m256 xv = _mm256_loadu_ps(x + r * K + k + 8 * H);
    for (int c = 0; c < Wn; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
  }
}

// Rows x [Rn, K] (fp32, `as_fp32`) times weight rows w [Wn, K] into out (rows `ldo` apart, in T), plus bias (or
// null); PREFETCH: the weight rows AHEAD on, a cache line at a time.
template <int Rn, int Wn, bool PREFETCH, class T>
void block(const float* x, const T* w, int64_t K, const float* bias, T* out, int64_t ldo) {
  __m256 acc[Rn][Wn];
  for (int r = 0; r < Rn; ++r)
    for (int c = 0; c < Wn; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + STEP<T> <= K; k += STEP<T>) {
    multiply_add<0, Rn, Wn, PREFETCH>(x, w, K, k, acc);
    if constexpr (STEP<T> == 16) multiply_add<1, Rn, Wn, PREFETCH>(x, w, K, k, acc);
  }
  for (int r = 0; r < Rn; ++r)
    for (int c = 0; c < Wn; ++c) {
      float sum = sum8(acc[r][c]);
      for (int64_t j = k; j < K; ++j) sum += x[r * K + j] * static_cast<float>(w[c * K + j]);
      out[r * ldo + c] = static_cast<T>(bias == nullptr ? sum : sum + bias[c]);
    }
}

// A group of `size` rows of x from xm (1 to R) times Wn weight rows.
template <int Wn, bool PREFETCH, class T>
void group(int64_t size, const float* xm, const T* w, int64_t K, const float* bias, T* om, int64_t ldo) {
  if (size == 4) block<4, Wn, PREFETCH>(xm, w, K, bias, om, ldo);
  else if (size == 3) block<3, Wn, PREFETCH>(xm, w, K, bias, om, ldo);
  else if (size == 2) block<2, Wn, PREFETCH>(xm, w, K, bias, om, ldo);
  else block<1, Wn, PREFETCH>(xm, w, K, bias, om, ldo);
}

// All M rows of x [M, K] times Wn weight rows: groups of at most R rows, as even as can be, the first prefetching.
template <int Wn, class T>
void rows_times(const float* x, int64_t M, const T* w, int64_t K, const float* bias, T* out, int64_t ldo) {
  const int64_t groups = (M + R - 1) / R;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t size = M / groups + (g < M % groups ? 1 : 0);
    if (m == 0) group<Wn, true>(size, x, w, K, bias, out, ldo);
    else group<Wn, false>(size, x + m * K, w, K, bias, out + m * ldo, ldo);
    m += size;
  }
}

// The weights' rows, one after another, in blocks of W rows (a weight's last block may be shorter): how many.
int64_t blocks_of(at::TensorList weights) {
  int64_t blocks = 0;
  for (const auto& w : weights) blocks += (w.size(0) + W - 1) / W;
  return blocks;
}

// x's rows as fp32, converted once a product (into this thread's buffer), not at every block of weight rows that
// reads them: bf16 rows laid out as `part` reads the weights, each step of 16 elements its even elements and then its
// odd ones (the elements past the last step in order).
const float* as_fp32(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  thread_local std::vector<float> converted;
  const int64_t M = x.size(0), K = x.size(1), stepped = K / 16 * 16;
  converted.resize(x.numel());
  for (int64_t m = 0; m < M; ++m) {
    const at::BFloat16* row = x.data_ptr<at::BFloat16>() + m * K;
    float* to = converted.data() + m * K;
    for (int64_t k = 0; k < stepped; k += 16)
      for (int j = 0; j < 8; ++j) to[k + j] = row[k + 2 * j], to[k + 8 + j] = row[k + 2 * j + 1];
    for (int64_t k = stepped; k < K; ++k) to[k] = row[k];
  }
  return converted.data();
}

// Blocks [begin, end) of the weights times x [M, K] into their columns of out [M, sum N_i], plus bias (or null).
template <class T>
void blocks_into(const at::Tensor& x, at::TensorList weights, const float* bias, at::Tensor& out, int64_t begin,
                 int64_t end) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const float* xp = as_fp32(x);  // each tensor's data and rows looked up once, not once a block
  T* op = out.data_ptr<T>();
  int64_t first = 0, column = 0;  // each weight's first block and first output
  for (const auto& w : weights) {
    const int64_t n = w.size(0), blocks = (n + W - 1) / W;
    const T* wp = w.data_ptr<T>();
    for (int64_t b = std::max(begin, first); b < std::min(end, first + blocks); ++b) {
      const int64_t row = (b - first) * W, rows = std::min<int64_t>(W, n - row), at = column + row;
      const float* bc = bias == nullptr ? nullptr : bias + at;
      if (rows == 3) rows_times<3>(xp, M, wp + row * K, K, bc, op + at, N);
      else if (rows == 2) rows_times<2>(xp, M, wp + row * K, K, bc, op + at, N);
      else rows_times<1>(xp, M, wp + row * K, K, bc, op + at, N);
    }
    first += blocks;
    column += n;
  }
}

void multiply_blocks(const at::Tensor& x, const hf_eagle31_rows::Weights& weights, at::Tensor& out, int64_t begin,
                     int64_t end) {
  const float* bias = weights.bias.defined() ? weights.bias.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) blocks_into<float>(x, weights.weights, bias, out, begin, end);
  else blocks_into<at::BFloat16>(x, weights.weights, bias, out, begin, end);
}

}  // namespace

namespace hf_eagle31_rows {

bool multiplies_bf16() { return true; }

// Every weight's blocks in one parallel loop, so that each thread streams one stretch of them.
void product_into(const at::Tensor& x, const Weights& weights, at::Tensor& out, int64_t) {
  at::parallel_for(0, blocks_of(weights.weights), GRAIN, [&](int64_t begin, int64_t end) {
    multiply_blocks(x, weights, out, begin, end);
  });
}

void product_share(const at::Tensor& x, const Weights& weights, at::Tensor& out, int64_t, const Team& team) {
  const auto [begin, end] = team.share(blocks_of(weights.weights), GRAIN);
  if (begin < end) multiply_blocks(x, weights, out, begin, end);
}

}  // namespace hf_eagle31_rows
