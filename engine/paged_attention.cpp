// Paged attention on CPU that reads the KV pool in place (no gather copy).
//
// One call per layer covers every query token of the step that attends to context
// in the pool: decodes and continuing prefill chunks alike. Token i attends causally
// to the first ctx[i] positions of its request, whose blocks are table row
// tok_table[i] (W entries). Work items are (token, KV head) pairs; the G query heads
// sharing a KV head are done together, so each K/V row is loaded once for all G.
//
// Per item, context positions go in tiles of one vector width (16 with AVX-512, 8 with
// AVX2), walking the block table block by block (no division per position):
//   scores: one vector of partial products per (position, head), reduced for the whole
//           tile at once by a transpose-add (not one horizontal sum per score);
//   softmax: online over tiles (running max and sum per head; the accumulator is
//           rescaled only when the max grows), with a vectorised exp;
//   values:  acc[g] += p[g][j] * v[j], the accumulator held in vector registers.
// Every item runs the same code whatever the thread count, so the output is bitwise
// independent of it. Compiled at run time by pdserve/engine/cpu_kernel.py
// (-O3 -march=native, never -ffast-math): the vector paths are chosen at compile time
// by the host's ISA, with a portable scalar path (Lanes) for everything else.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged_attention_simd.h"

namespace {

using pdserve::Lanes;
constexpr int kMaxG = 8, kMaxD = 256;  // also checked by the caller (cpu_kernel.supports)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return pdserve::bf16_to_f32(*p); }
inline void store1(float* p, float x) { *p = x; }
inline void store1(uint16_t* p, float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) {
    *p = 0x7fc0;
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *p = static_cast<uint16_t>(bits >> 16);
}

struct Args {
  const void* q;
  int64_t q_stride_t, q_stride_h;  // in elements; the head dim is contiguous
  const void* k;                   // [num_slots, Hkv, D]
  const void* v;
  void* out;  // [T, Hq, D] contiguous
  const int32_t* tables;
  int32_t table_width;
  const int32_t* tok_row;  // row of each kernel token in q / out
  const int32_t* tok_table;
  const int32_t* tok_ctx;
  int32_t num_tokens, hq, hkv, head_dim, block_size;
  float scale;
};

// One item's state: the scaled queries, the online-softmax running max / sum and the
// unnormalised output, for its G heads.
template <class S, int G>
struct State {
  using V = typename S::V;
  alignas(64) float q[G][kMaxD];
  alignas(64) float acc[G][kMaxD];
  float max[G];
  V sum[G];  // lane-wise running sums, added up once at the end
};

// The tile's scores, s[g] lane j = q[g] . k[j], masked to -inf beyond n.
template <class S, int G, typename T>
void tile_scores(const State<S, G>& st, const T* const* kp, int n, int d,
                 typename S::V (&s)[G]) {
  using V = typename S::V;
  constexpr int W = S::W;
  V part[G][W];
  for (int j = 0; j < W; ++j) {
    for (int g = 0; g < G; ++g) part[g][j] = S::zero();
    if (j >= n) continue;
    for (int c = 0; c < d; c += W) {
      const V kv = S::load(kp[j] + c);
      for (int g = 0; g < G; ++g) part[g][j] = S::fma(S::load(st.q[g] + c), kv, part[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    s[g] = S::transpose_sum(part[g]);
    if (n < W) {
      alignas(64) float buf[W];
      S::store(buf, s[g]);
      std::fill(buf + n, buf + W, kNegInf);
      s[g] = S::load(buf);
    }
  }
}

// Folds a tile of n <= W positions (rows kp / vp) into the item's state.
template <class S, int G, typename T>
void tile(State<S, G>& st, const T* const* kp, const T* const* vp, int n, int d) {
  using V = typename S::V;
  constexpr int W = S::W;
  V s[G];
  tile_scores<S, G, T>(st, kp, n, d, s);
  alignas(64) float p[G][W];
  for (int g = 0; g < G; ++g) {
    const float m = S::hmax(s[g]);
    if (m > st.max[g]) {  // rescale what came before to the new max
      const float f = Lanes<1>::exp_lane(st.max[g] - m);
      st.sum[g] = S::mul(st.sum[g], S::set1(f));
      for (int c = 0; c < d; c += W) S::store(st.acc[g] + c, S::mul(S::load(st.acc[g] + c), S::set1(f)));
      st.max[g] = m;
    }
    const V e = S::exp(S::sub(s[g], S::set1(st.max[g])));
    st.sum[g] = S::add(st.sum[g], e);
    S::store(p[g], e);
  }
  for (int c = 0; c < d; c += W) {
    V o[G];
    for (int g = 0; g < G; ++g) o[g] = S::load(st.acc[g] + c);
    for (int j = 0; j < n; ++j) {
      const V vv = S::load(vp[j] + c);
      for (int g = 0; g < G; ++g) o[g] = S::fma(S::set1(p[g][j]), vv, o[g]);
    }
    for (int g = 0; g < G; ++g) S::store(st.acc[g] + c, o[g]);
  }
}

template <typename T, class S, int G>
void one_item(const Args& a, int64_t item) {
  constexpr int W = S::W;
  const int i = static_cast<int>(item / a.hkv), h = static_cast<int>(item % a.hkv);
  const int d = a.head_dim, bs = a.block_size, ctx = a.tok_ctx[i], row = a.tok_row[i];
  const int32_t* table = a.tables + static_cast<int64_t>(a.tok_table[i]) * a.table_width;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  State<S, G> st;
  for (int g = 0; g < G; ++g) {
    const T* qg = q + row * a.q_stride_t + (h * G + g) * a.q_stride_h;
    for (int e = 0; e < d; ++e) st.q[g][e] = load1(qg + e) * a.scale;
    std::fill(st.acc[g], st.acc[g] + d, 0.0f);
    st.max[g] = kNegInf;
    st.sum[g] = S::zero();
  }
  const int64_t stride = static_cast<int64_t>(a.hkv) * d;  // between slots, one head
  const T* kp[W];
  const T* vp[W];
  int n = 0;
  for (int b = 0, j = 0; j < ctx; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * bs * stride + h * d;
    for (int o = 0, end = std::min(bs, ctx - j); o < end; ++o, ++j) {
      kp[n] = k + base + o * stride;
      vp[n] = v + base + o * stride;
      if (++n == W) {
        tile<S, G, T>(st, kp, vp, n, d);
        n = 0;
      }
    }
  }
  if (n > 0) tile<S, G, T>(st, kp, vp, n, d);
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(row) * a.hq + h * G) * d;
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / S::hsum(st.sum[g]);
    for (int e = 0; e < d; ++e) store1(out + g * d + e, st.acc[g][e] * inv);
  }
}

template <typename T, class S, int G>
void run_items(const Args& a, int num_threads) {
  const int64_t items = static_cast<int64_t>(a.num_tokens) * a.hkv;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
  for (int64_t item = 0; item < items; ++item) one_item<T, S, G>(a, item);
}

template <typename T, class S>
void run_isa(const Args& a, int num_threads) {
  switch (a.hq / a.hkv) {
    case 1: return run_items<T, S, 1>(a, num_threads);
    case 2: return run_items<T, S, 2>(a, num_threads);
    case 3: return run_items<T, S, 3>(a, num_threads);
    case 4: return run_items<T, S, 4>(a, num_threads);
    case 5: return run_items<T, S, 5>(a, num_threads);
    case 6: return run_items<T, S, 6>(a, num_threads);
    case 7: return run_items<T, S, 7>(a, num_threads);
    default: return run_items<T, S, kMaxG>(a, num_threads);
  }
}

// The widest path whose lanes divide the head dim (the tile width is the lane count).
int width_for(int head_dim) {
#ifdef PDSERVE_HAVE_AVX512
  if (head_dim % 16 == 0) return 16;
#endif
#ifdef PDSERVE_HAVE_AVX2
  if (head_dim % 8 == 0) return 8;
#endif
  return head_dim % 4 == 0 ? 4 : 1;
}

template <typename T>
void run(const Args& a, int num_threads) {
  switch (width_for(a.head_dim)) {
#ifdef PDSERVE_HAVE_AVX512
    case 16: return run_isa<T, pdserve::Avx512>(a, num_threads);
#endif
#ifdef PDSERVE_HAVE_AVX2
    case 8: return run_isa<T, pdserve::Avx2>(a, num_threads);
#endif
    case 4: return run_isa<T, Lanes<4>>(a, num_threads);
    default: return run_isa<T, Lanes<1>>(a, num_threads);
  }
}

template <class S>
void exp_array(const float* x, float* y, int64_t n) {
  alignas(64) float buf[S::W];
  for (int64_t i = 0; i < n; i += S::W) {
    const int64_t m = std::min<int64_t>(S::W, n - i);
    std::fill(buf, buf + S::W, 0.0f);
    std::copy(x + i, x + i + m, buf);
    S::store(buf, S::exp(S::load(buf)));
    std::copy(buf, buf + m, y + i);
  }
}

}  // namespace

extern "C" int pdserve_paged_attention(
    int dtype,  // 0: float32, 1: bfloat16
    const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k, const void* v,
    void* out, const int32_t* tables, int32_t table_width, const int32_t* tok_row,
    const int32_t* tok_table, const int32_t* tok_ctx, int32_t num_tokens, int32_t hq,
    int32_t hkv, int32_t head_dim, int32_t block_size, float scale, int32_t num_threads) {
  if (hkv <= 0 || hq % hkv != 0 || hq / hkv > kMaxG || head_dim > kMaxD || block_size <= 0)
    return 1;
  Args a{q,      q_stride_t, q_stride_h, k,         v,          out,        tables,
         table_width, tok_row, tok_table, tok_ctx, num_tokens, hq, hkv, head_dim,
         block_size, scale};
  if (dtype == 0)
    run<float>(a, num_threads);
  else if (dtype == 1)
    run<uint16_t>(a, num_threads);
  else
    return 2;
  return 0;
}

// The lane width (tile size) the kernel uses for this head dim on this build.
extern "C" int pdserve_kernel_width(int32_t head_dim) { return width_for(head_dim); }

// The softmax's exp on `width` lanes (16, 8, 4 or 1), for the accuracy tests;
// returns 1 where that width is not built here.
extern "C" int pdserve_kernel_exp(int32_t width, const float* x, float* y, int64_t n) {
  switch (width) {
#ifdef PDSERVE_HAVE_AVX512
    case 16: exp_array<pdserve::Avx512>(x, y, n); return 0;
#endif
#ifdef PDSERVE_HAVE_AVX2
    case 8: exp_array<pdserve::Avx2>(x, y, n); return 0;
#endif
    case 4: exp_array<Lanes<4>>(x, y, n); return 0;
    case 1: exp_array<Lanes<1>>(x, y, n); return 0;
    default: return 1;
  }
}
