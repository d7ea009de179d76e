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

// 16 fp32 lanes, what attention and the whole forward compute on: one AVX-512 vector, or on a CPU with AVX2 but not
// AVX-512 two AVX2 vectors (lanes 0-7, 8-15), the same sources built for either (rows.py). A `Mask` names lanes by
// its bits.
#ifdef __AVX512F__
using Vec = __m512;
using Mask = __mmask16;

inline Vec zero16() { return _mm512_setzero_ps(); }
inline Vec set16(float a) { return _mm512_set1_ps(a); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c
inline Vec max16(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // b where either is a NaN
inline Vec keep(Mask m, Vec a) { return _mm512_maskz_mov_ps(m, a); }  // the lanes of m, zero elsewhere
inline Vec select(Mask m, Vec a, Vec b) { return _mm512_mask_mov_ps(b, m, a); }  // a in the lanes of m, else b
inline Mask nans(Vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline Mask equals(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline float max_of(Vec a) { return _mm512_reduce_max_ps(a); }

// The sum of a vector's 16 lanes: lane i plus lane i + 8, those pairs' i plus i + 4, then i + 2, then i + 1 (the
// order of GCC's _mm512_reduce_add_ps, spelled out so that `sums16` and every compiler sum alike).
inline float sum16(Vec a) {
  const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

// `sum16` of each of a[0..15], lane j the sum of a[j]: the same pairs added in the same order, but a pair of each
// of several vectors in one instruction (46 instructions for 16 sums, against about 9 a sum one at a time).
inline Vec sums16(const Vec (&a)[16]) {
  __m512 c[8], e[4], f[2];
  for (int p = 0; p < 8; ++p)  // lanes 0-7: a[2p]'s i + i + 8; lanes 8-15: a[2p + 1]'s
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)  // block b: a[4q + b]'s four pairs of those
    e[q] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * q], c[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * q], c[2 * q + 1], 0xDD));
  for (int r = 0; r < 2; ++r) {  // block b: a[8r + b]'s two pairs, then a[8r + 4 + b]'s
    const __m512d x = _mm512_castps_pd(e[2 * r]), y = _mm512_castps_pd(e[2 * r + 1]);
    f[r] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 g = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4b + c: a[4c + b]
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), g);
}

// The lanes of `m` (all 16 by default) of T at p as fp32; a bf16 is the top half of the fp32 with the same bits.
inline Vec load16(const float* p, Mask m = 0xFFFF) { return _mm512_maskz_loadu_ps(m, p); }
inline Vec load16(const at::BFloat16* p, Mask m = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Each lane's bf16 bits (in its low half), rounded as torch rounds fp32 to bf16: to nearest, ties to even, a NaN
// to its quiet NaN.
inline __m512i bf16_bits(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                            16);
  return _mm512_mask_mov_epi32(rounded, nans(v), _mm512_set1_epi32(0x7FC0));
}

// fp32 lanes rounded to bf16 and back to fp32.
inline Vec bf16_round(Vec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }

// fp32 lanes stored as T (the lanes of `m`), rounded as torch rounds.
inline void store16(float* p, Vec v, Mask m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, Vec v, Mask m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// The lanes' 2^n (n whole, from -127 on; infinite past 2^127) times p.
inline Vec times_power_of_two(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }
inline Vec nearest_whole(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Mask at_least(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
#else
struct Vec {
  __m256 lo, hi;
};
using Mask = uint16_t;

// f of each half (of each vector's).
template <class F>
inline Vec halves(F f, Vec a) { return {f(a.lo), f(a.hi)}; }
template <class F>
inline Vec halves(F f, Vec a, Vec b) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }

inline Vec zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set16(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec max16(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }

// The lanes of 8 bits of a mask as a vector's lanes of all ones, the others zero; the other way, a comparison's.
inline __m256 lanes_of(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), bit), bit));
}
inline Mask mask_of(__m256 lo, __m256 hi) { return _mm256_movemask_ps(lo) | _mm256_movemask_ps(hi) << 8; }

inline Vec keep(Mask m, Vec a) {
  return {_mm256_and_ps(lanes_of(m & 0xFF), a.lo), _mm256_and_ps(lanes_of(m >> 8), a.hi)};
}
inline Vec select(Mask m, Vec a, Vec b) {
  return {_mm256_blendv_ps(b.lo, a.lo, lanes_of(m & 0xFF)), _mm256_blendv_ps(b.hi, a.hi, lanes_of(m >> 8))};
}
inline Mask nans(Vec a) {
  return mask_of(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q));
}
inline Mask equals(Vec a, Vec b) {
  return mask_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ));
}
inline Mask at_least(Vec a, Vec b) {
  return mask_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ));
}

// The sum of 8 lanes: lane i plus i + 4, then i + 2, then i + 1 (the last steps of `sum16`; the AVX2 kernel's sums).
inline float sum8(__m256 t3) {
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}
inline float sum16(Vec a) { return sum8(_mm256_add_ps(a.lo, a.hi)); }
inline float max_of(Vec a) {
  const __m256 t3 = _mm256_max_ps(a.lo, a.hi);
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  t = _mm_max_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// `sum16` of each of a[0..15], lane j the sum of a[j], the same pairs added in the same order.
inline Vec sums16(const Vec (&a)[16]) {
  __m256 c[16], e[8], f[4], g[2];
  for (int p = 0; p < 16; ++p) c[p] = _mm256_add_ps(a[p].lo, a[p].hi);  // i + i + 8
  for (int q = 0; q < 8; ++q)  // lanes 0-3: c[2q]'s i + i + 4; lanes 4-7: c[2q + 1]'s
    e[q] = _mm256_add_ps(_mm256_permute2f128_ps(c[2 * q], c[2 * q + 1], 0x20),
                         _mm256_permute2f128_ps(c[2 * q], c[2 * q + 1], 0x31));
  for (int r = 0; r < 4; ++r) {  // lanes 0-1: a[4r]'s i + i + 2, 2-3: a[4r + 2]'s, 4-5: a[4r + 1]'s, 6-7: a[4r + 3]'s
    const __m256d x = _mm256_castps_pd(e[2 * r]), y = _mm256_castps_pd(e[2 * r + 1]);
    f[r] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  for (int s = 0; s < 2; ++s)  // lanes a[8s], a[8s + 2], a[8s + 4], a[8s + 6], a[8s + 1], ..., a[8s + 7]
    g[s] = _mm256_add_ps(_mm256_shuffle_ps(f[2 * s], f[2 * s + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(f[2 * s], f[2 * s + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return {_mm256_permutevar8x32_ps(g[0], order), _mm256_permutevar8x32_ps(g[1], order)};
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The lanes of `m` of T at p as fp32, the others zero (a partial vector through a copy: AVX2 masks no bf16 loads).
template <class T>
inline Vec load16(const T* p, Mask m = 0xFFFF) {
  if (m == 0xFFFF) return {load8(p), load8(p + 8)};
  T part[16] = {};
  for (int i = 0; i < 16; ++i)
    if ((m >> i) & 1) part[i] = p[i];
  return {load8(part), load8(part + 8)};
}

// `bf16_bits` of 8 lanes.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))),
                                            16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// fp32 lanes rounded to bf16 and back to fp32.
inline Vec bf16_round(Vec v) {
  return halves([](__m256 h) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(h), 16)); }, v);
}

// fp32 lanes stored as T (the lanes of `m`), rounded as torch rounds.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = bf16_bits8(v);  // below 2^16: packed without saturating, the lanes kept in order
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
template <class T>
inline void store16(T* p, Vec v, Mask m = 0xFFFF) {
  T* to = p;
  T part[16];
  if (m != 0xFFFF) to = part;
  store8(to, v.lo);
  store8(to + 8, v.hi);
  if (m != 0xFFFF)
    for (int i = 0; i < 16; ++i)
      if ((m >> i) & 1) p[i] = part[i];
}

// The lanes' 2^n (n whole, from -127 on; infinite past 2^127) times p, in two exact steps 2^(n / 2) and the rest, as
// AVX-512's scalef: one power of two would leave the exponent's range past 2^127.
inline Vec times_power_of_two(Vec p, Vec n) {
  return halves([](__m256 p, __m256 n) {
    const __m256i whole = _mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(256.f)));
    const __m256i first = _mm256_srai_epi32(whole, 1), second = _mm256_sub_epi32(whole, first);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
  }, p, n);
}
inline Vec nearest_whole(Vec a) {
  return halves([](__m256 h) { return _mm256_round_ps(h, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }, a);
}
#endif

// The first `left` lanes of a vector, all 16 where at least that many are left: a loop's last vector over n values.
inline Mask lanes(int64_t left) { return left >= 16 ? (Mask)0xFFFF : (Mask)((1u << left) - 1); }

// fp32 lanes rounded to T, as a torch operation in T stores its result, and back to fp32.
template <class T>
inline Vec round16(Vec v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return bf16_round(v);
}

// e^x of 16 lanes (relative error ~2e-7): 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor
// series to r^7; exactly 0 below -87.3 (where e^x leaves fp32's normal range), as a masked score's exponent is.
inline Vec exp16(Vec x) {
  const Vec n = nearest_whole(mul(x, set16(1.44269504088896341f)));
  Vec r = fmadd(n, set16(-0.693145751953125f), x);
  r = fmadd(n, set16(-1.428606765330187e-06f), r);
  Vec p = set16(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fmadd(p, r, set16(c));
  return keep(at_least(x, set16(-87.3f)), times_power_of_two(p, n));
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

// x [..., K] times each of `weights` [N_i, K] (contiguous, in x's dtype), side by side in the output's last
// dimension, plus bias [sum N_i]: the library's `linear` (rows_held.cpp), checked. `ways`: how the AVX-512 kernel
// reads the weights at each row count (rows_linear.cpp; the same sums every way).
at::Tensor linear(const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>& bias, int64_t ways);

// What the kernel this library is built with (rows_linear.cpp or rows_avx2.cpp) computes: whether it multiplies bf16
// too; x [M, K] times `weights` into out [M, features] (both contiguous, x in the weights' dtype).
bool multiplies_bf16();
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
