// Vector lanes for paged_attention.cpp: one struct per instruction set, same operations.
//
//   Avx512 (16 lanes), Avx2 (8 lanes, with FMA): intrinsics, built only where the
//   compiler targets them (-march=native on the host that builds the kernel);
//   Lanes<N>: plain arrays, portable C++ (the compiler vectorises them where it can).
//
// exp is Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial),
// within 2 ulp of the true value for x >= -87.33; below that (where exp(x) is subnormal
// or 0, always the case for -inf) it returns 0, an absolute error under 1.2e-38 that a
// softmax, whose largest term is 1, cannot see. NaN stays NaN.
// tests/engine/test_cpu_kernel.py checks both bounds for every width built here.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#define PDSERVE_HAVE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_HAVE_AVX2 1
#endif
#if defined(PDSERVE_HAVE_AVX512) || defined(PDSERVE_HAVE_AVX2)
#include <immintrin.h>
#endif

#include "paged_attention_abi.h"  // bf16_to_f32

namespace pdserve {

namespace expc {
constexpr float lo = -87.33654f, hi = 88.0f, log2e = 1.44269504088896341f;
constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
constexpr float p0 = 1.9875691500e-4f, p1 = 1.3981999507e-3f, p2 = 8.3334519073e-3f;
constexpr float p3 = 4.1665795894e-2f, p4 = 1.6666665459e-1f, p5 = 5.0000001201e-1f;
}  // namespace expc

// Cephes' expf on the vector lanes of S, from S's arithmetic and six ISA pieces: min,
// max, round (to nearest), fnmadd (c - a * b), pow2 (2^n of whole-number lanes) and
// exp_edges (0 where x < lo, x where x is NaN; the result elsewhere).
template <class S>
inline typename S::V exp_lanes(typename S::V x) {
  using namespace expc;
  using V = typename S::V;
  const V c = S::min(S::max(x, S::set1(lo)), S::set1(hi));
  const V n = S::round(S::mul(c, S::set1(log2e)));
  const V r = S::fnmadd(n, S::set1(ln2_lo), S::fnmadd(n, S::set1(ln2_hi), c));
  V y = S::fma(S::set1(p0), r, S::set1(p1));
  y = S::fma(y, r, S::set1(p2));
  y = S::fma(y, r, S::set1(p3));
  y = S::fma(y, r, S::set1(p4));
  y = S::fma(y, r, S::set1(p5));
  y = S::fma(y, S::mul(r, r), S::add(r, S::set1(1.0f)));
  return S::exp_edges(x, S::mul(y, S::pow2(n)));
}

template <int N>
struct Lanes {
  static constexpr int W = N;
  struct V {
    float x[N];
  };
  static float exp_lane(float x) {
    using namespace expc;
    if (x != x) return x;
    if (x < lo) return 0.0f;
    x = x > hi ? hi : x;
    const float n = std::nearbyint(x * log2e);
    const float r = x - n * ln2_hi - n * ln2_lo;
    float y = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5;
    y = y * r * r + r + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
  }
  static V zero() { return set1(0.0f); }
  static V set1(float a) {
    V r;
    for (int i = 0; i < N; ++i) r.x[i] = a;
    return r;
  }
  static V load(const float* p) {
    V r;
    for (int i = 0; i < N; ++i) r.x[i] = p[i];
    return r;
  }
  static V load(const uint16_t* p) {
    V r;
    for (int i = 0; i < N; ++i) r.x[i] = bf16_to_f32(p[i]);
    return r;
  }
  static void store(float* p, V a) {
    for (int i = 0; i < N; ++i) p[i] = a.x[i];
  }
#define PDSERVE_LANEWISE(name, expr)    \
  static V name(V a, V b) {             \
    for (int i = 0; i < N; ++i) a.x[i] = expr; \
    return a;                           \
  }
  PDSERVE_LANEWISE(add, a.x[i] + b.x[i])
  PDSERVE_LANEWISE(sub, a.x[i] - b.x[i])
  PDSERVE_LANEWISE(mul, a.x[i] * b.x[i])
#undef PDSERVE_LANEWISE
  static V fma(V a, V b, V c) {
    for (int i = 0; i < N; ++i) c.x[i] += a.x[i] * b.x[i];
    return c;
  }
  static V exp(V a) {
    for (int i = 0; i < N; ++i) a.x[i] = exp_lane(a.x[i]);
    return a;
  }
  static float hsum(V a) {
    float s = 0.0f;
    for (int i = 0; i < N; ++i) s += a.x[i];
    return s;
  }
  static float hmax(V a) {  // a NaN lane is skipped, like the vector max instructions
    float m = a.x[0];
    for (int i = 1; i < N; ++i) m = a.x[i] > m ? a.x[i] : m;
    return m;
  }
  static V transpose_sum(const V* v) {  // lane j: the sum of v[j]'s lanes
    V r;
    for (int j = 0; j < N; ++j) r.x[j] = hsum(v[j]);
    return r;
  }
  // The grouped form of transpose_sum (see Avx512), for N == 4: one group.
  static int group_pos(int, int m) { return m; }
  static V group4(const V* p) { return transpose_sum(p); }
  static V combine(const V* g) { return g[0]; }
};

// The operations that are one intrinsic, or one expression of them, alike in both x86
// widths but for the width in their names (B: 512 or 256).
#define PDSERVE_X86_LANES(B)                                                               \
  static V zero() { return _mm##B##_setzero_ps(); }                                        \
  static V set1(float a) { return _mm##B##_set1_ps(a); }                                   \
  static V load(const float* p) { return _mm##B##_loadu_ps(p); }                           \
  static void store(float* p, V a) { _mm##B##_storeu_ps(p, a); }                           \
  static V add(V a, V b) { return _mm##B##_add_ps(a, b); }                                 \
  static V sub(V a, V b) { return _mm##B##_sub_ps(a, b); }                                 \
  static V mul(V a, V b) { return _mm##B##_mul_ps(a, b); }                                 \
  static V fma(V a, V b, V c) { return _mm##B##_fmadd_ps(a, b, c); }                       \
  static V min(V a, V b) { return _mm##B##_min_ps(a, b); }                                 \
  static V max(V a, V b) { return _mm##B##_max_ps(a, b); }                                 \
  static V fnmadd(V a, V b, V c) { return _mm##B##_fnmadd_ps(a, b, c); }                   \
  static V pow2(V n) {                                                                     \
    const auto e = _mm##B##_add_epi32(_mm##B##_cvtps_epi32(n), _mm##B##_set1_epi32(127));  \
    return _mm##B##_castsi##B##_ps(_mm##B##_slli_epi32(e, 23));                            \
  }

#ifdef PDSERVE_HAVE_AVX512
struct Avx512 {
  static constexpr int W = 16;
  using V = __m512;
  PDSERVE_X86_LANES(512)
  static V load(const uint16_t* p) {  // bf16 is the top half of a float32
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static float hsum(V a) { return _mm512_reduce_add_ps(a); }
  static float hmax(V a) { return _mm512_reduce_max_ps(a); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V exp_edges(V x, V v) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, set1(expc::lo), _CMP_GE_OQ);  // false for NaN
    return _mm512_mask_mov_ps(_mm512_maskz_mov_ps(keep, v), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
  }
  static V exp(V x) { return exp_lanes<Avx512>(x); }
  // A transpose-add: lane j of the result is the sum of the lanes of vector j of 16,
  // in four rounds that each halve the vectors by adding pairs of shuffled halves
  // (256-bit, 128-bit, then 32-bit lanes twice). The first two rounds run per group of
  // four vectors as soon as they are computed (group i holds positions i, 4+i, 8+i,
  // 12+i: that order makes the result come out in natural order), the last two over
  // the four groups.
  static int group_pos(int i, int m) { return 4 * m + i; }
  static V group4(const V* p) {
    const V a0 = add(_mm512_shuffle_f32x4(p[0], p[1], 0x44), _mm512_shuffle_f32x4(p[0], p[1], 0xEE));
    const V a1 = add(_mm512_shuffle_f32x4(p[2], p[3], 0x44), _mm512_shuffle_f32x4(p[2], p[3], 0xEE));
    return add(_mm512_shuffle_f32x4(a0, a1, 0x88), _mm512_shuffle_f32x4(a0, a1, 0xDD));
  }
  static V combine(const V* g) {
    const V c0 = add(_mm512_unpacklo_ps(g[0], g[1]), _mm512_unpackhi_ps(g[0], g[1]));
    const V c1 = add(_mm512_unpacklo_ps(g[2], g[3]), _mm512_unpackhi_ps(g[2], g[3]));
    return add(_mm512_shuffle_ps(c0, c1, 0x44), _mm512_shuffle_ps(c0, c1, 0xEE));
  }
};
#endif

#ifdef PDSERVE_HAVE_AVX2
struct Avx2 {
  static constexpr int W = 8;
  using V = __m256;
  PDSERVE_X86_LANES(256)
  static V load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static float hsum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(V a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V exp_edges(V x, V v) {
    const V keep = _mm256_cmp_ps(x, set1(expc::lo), _CMP_GE_OQ);  // false for NaN
    return _mm256_blendv_ps(_mm256_and_ps(keep, v), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  static V exp(V x) { return exp_lanes<Avx2>(x); }
  // Transpose-add (lane j: the sum of vector j's lanes) by horizontal adds: positions
  // 4i..4i+3 form group i; the two groups' halves are added at the end.
  static int group_pos(int i, int m) { return 4 * i + m; }
  static V group4(const V* p) {
    return _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
  }
  static V combine(const V* g) {
    return add(_mm256_permute2f128_ps(g[0], g[1], 0x20), _mm256_permute2f128_ps(g[0], g[1], 0x31));
  }
};
#endif

#undef PDSERVE_X86_LANES

}  // namespace pdserve
