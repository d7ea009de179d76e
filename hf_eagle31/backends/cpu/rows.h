// What one source of the rows library calls in another (rows_step.cpp calls both), and the vectors both
// attention and the whole forward compute on.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace hf_eagle31_rows {

// The first `left` lanes of a vector, all 16 where at least that many are left: a loop's last vector over n values.
inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// The lanes of `m` (all 16 by default) of T at p as fp32; a bf16 is the top half of the fp32 with the same bits.
inline __m512 load16(const float* p, __mmask16 m = 0xFFFF) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Each lane's bf16 bits (in its low half), rounded as torch rounds fp32 to bf16: to nearest, ties to even, a NaN
// to its quiet NaN.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                            16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// fp32 lanes rounded to T, as a torch operation in T stores its result, and back to fp32.
template <class T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

// fp32 lanes stored as T (the lanes of `m`), rounded as torch rounds.
inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// e^x of 16 lanes (relative error ~2e-7): 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor
// series to r^7; exactly 0 below -87.3 (where e^x leaves fp32's normal range), as a masked score's exponent is.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), _mm512_scalef_ps(p, n));
}

// The threads of one parallel region that each run a whole forward (rows_step.cpp), splitting its products and
// attention among them: `thread` of `threads`.
struct Team {
  int64_t thread, threads;

  // This thread's part [begin, end) of `count` items, as `at::parallel_for` (`grain`) would give it: equal
  // contiguous parts of at least `grain` items, all of them to the first thread where there are no more than that.
  std::pair<int64_t, int64_t> share(int64_t count, int64_t grain) const {
    const int64_t parts = count <= grain ? 1 : std::min(threads, (count + grain - 1) / grain);
    const int64_t size = parts > 0 ? (count + parts - 1) / parts : 0;
    const int64_t begin = std::min(count, thread * size);
    return {begin, thread < parts ? std::min(count, begin + size) : begin};
  }
};

// The weights and bias (fp32, or undefined) the library holds under a product's key (rows_linear.cpp's `hold`), held
// strongly while a forward runs: looked up once a forward, not once a product.
struct Weights {
  std::vector<at::Tensor> weights;
  at::Tensor bias;
};
std::vector<Weights> held_weights(at::IntArrayRef keys);  // under one lock: a forward's 120 at once

// The output features of `weights`, each checked to be a contiguous [N_i, K] matrix in `dtype` (`who` and the
// product's `key`, where not -1, name it in the error, composed only on failure).
int64_t features_of(at::TensorList weights, int64_t K, at::ScalarType dtype, const char* who, int64_t key = -1);

// x [M, K] times `weights` into out [M, features] (both contiguous, x in the weights' dtype).
void product_into(const at::Tensor& x, const Weights& weights, at::Tensor& out, int64_t ways);

// `product_into`'s part that is this thread's (`Team::share` of its blocks of weight rows), every thread of the team
// calling it: out is whole once all have (a barrier).
void product_share(const at::Tensor& x, const Weights& weights, at::Tensor& out, int64_t ways, const Team& team);

// Layer `layer`'s key and value buffers [B, G, capacity, D] of the cache room the library holds under `room`
// (rows_attention.cpp's `hold_room`), held strongly while a forward runs.
std::pair<at::Tensor, at::Tensor> room_layer(int64_t room, int64_t layer);

// Rows [begin, end) of q [B, G, R, D] (row b G R + g R + r; the last dimension contiguous) over keys and values
// [B, G, L, D] (the last dimension contiguous), with the additive mask m [B, G, R, L] (its last dimension contiguous;
// or undefined), into out [B, G, R, D] (contiguous), on this thread: `rows_attention`'s sums, checked by its caller.
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& m, double scale,
                 at::Tensor& out, int64_t begin, int64_t end);

}  // namespace hf_eagle31_rows
