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
// The next block's rows are prefetched while a block is processed (blocks are scattered,
// and the hardware prefetchers stop at page boundaries). Every item runs the same code
// whatever the thread count, so the output is bitwise independent of it.
// Per-layer options (pdserve_paged_attention_layer): a sliding window starts the walk
// at position ctx - window (whole blocks before it are never read); a soft-cap maps each
// score to cap * tanh(score / cap) before the softmax; sinks (one logit per query head)
// start each head's online softmax at (max = sink, sum = 1), which is the sink's column
// of the softmax with a value of zero. The plain entry point passes none of them.
// Compiled at run time by pdserve/engine/cpu_kernel.py (-O3 -march=native; no
// -ffast-math, no -fassociative-math, see there): AVX-512 and AVX2 paths where the host
// has them, a portable one (Lanes) for everything else; paged_attention_simd.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged_attention_simd.h"

namespace {

using pdserve::Args;
using pdserve::Lanes;
constexpr int kMaxG = 8, kMaxD = 256;  // also checked by the caller (cpu_kernel.supports)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return pdserve::bf16_to_f32(*p); }
inline void store1(float* p, float x) { *p = x; }
inline void store1(uint16_t* p, float x) { *p = pdserve::f32_to_bf16(x); }

template <typename T>
const T* zero_row() {  // stands in for the rows past the context in a partial tile
  alignas(64) static const T zeros[kMaxD] = {};
  return zeros;
}

// One work item: the scaled queries, the online-softmax state and the unnormalised
// output of the G query heads of one (token, KV head), held as vectors of the head dim.
// G and C (vectors per head dim) are compile-time for the common shapes, so that the
// loops unroll and the state stays in registers; 0 means "at run time". O: a soft-cap or
// sinks in use (compiled apart, so the plain case carries none of their code).
template <typename T, class S, int G, int C, bool O>
struct Item {
  using V = typename S::V;
  static constexpr int W = S::W, GM = G ? G : kMaxG, CM = C ? C : kMaxD / W;
  // The value accumulation, row by row, needs G x C accumulators, C values and a weight
  // in registers at once (16 vector registers with AVX2, 32 with AVX-512). Where they do
  // not fit (SmolLM2's G = 3 at a head dim of 64 on AVX2: 33) they spill to the stack, so
  // there it goes one head-dim chunk at a time instead (G accumulators held through the
  // tile; more broadcasts, so the row-major pass stays where it fits: on the tiny preset's
  // G = 2 x 4 chunks chunk-major measured 0.85-1.0x of it, one thread, AVX2).
  // Each accumulator takes the same products in the same order either way: bitwise equal.
  static constexpr bool kRowMajor = G && C && G * C + C + 1 <= (W >= 16 ? 32 : 16);
  int ng, nc;
  float softcap = 0.0f;
  V q[GM][CM], acc[GM][CM], sum[GM];  // sum: lane-wise running sums of the weights
  float max[GM];
  const T* kp[W];  // the tile's rows
  const T* vp[W];

  int heads() const { return G ? G : ng; }
  int chunks() const { return C ? C : nc; }

  // s[g] lane j = q[g] . k[j]: per position a vector of partial products, reduced in
  // groups of four and then for the whole tile (S::group4 / S::combine) by shuffles.
  void scores(int n, V (&s)[GM]) const {
    if constexpr (W % 4 == 0) {
      V grp[GM][W / 4];
      for (int i = 0; i < W / 4; ++i) {
        V part[GM][4];
        for (int m = 0; m < 4; ++m) {
          const T* kr = kp[S::group_pos(i, m)];
          for (int g = 0; g < heads(); ++g) part[g][m] = S::zero();
          for (int c = 0; c < chunks(); ++c) {
            const V kv = S::load(kr + c * W);
            for (int g = 0; g < heads(); ++g) part[g][m] = S::fma(q[g][c], kv, part[g][m]);
          }
        }
        for (int g = 0; g < heads(); ++g) grp[g][i] = S::group4(part[g]);
      }
      for (int g = 0; g < heads(); ++g) s[g] = S::combine(grp[g]);
    } else {
      for (int g = 0; g < heads(); ++g) {
        V part[W];
        for (int j = 0; j < W; ++j) {
          part[j] = S::zero();
          for (int c = 0; c < chunks(); ++c) part[j] = S::fma(q[g][c], S::load(kp[j] + c * W), part[j]);
        }
        s[g] = S::transpose_sum(part);
      }
    }
    if (O && softcap != 0.0f)  // before the padding's -inf below (tanh would make it finite)
      for (int g = 0; g < heads(); ++g) {
        alignas(64) float buf[W];
        S::store(buf, s[g]);
        for (int j = 0; j < W; ++j) buf[j] = softcap * std::tanh(buf[j] / softcap);
        s[g] = S::load(buf);
      }
    if (n < W)
      for (int g = 0; g < heads(); ++g) {
        alignas(64) float buf[W];
        S::store(buf, s[g]);
        std::fill(buf + n, buf + W, kNegInf);
        s[g] = S::load(buf);
      }
  }

  // Folds the tile (n <= W rows; the rest point at zero rows) into the state.
  void fold(int n) {
    V s[GM];
    scores(n, s);
    alignas(64) float p[GM][W];
    for (int g = 0; g < heads(); ++g) {
      const float m = S::hmax(s[g]);
      if (m > max[g]) {  // rescale what came before to the new max
        const V f = S::set1(Lanes<1>::exp_lane(max[g] - m));
        sum[g] = S::mul(sum[g], f);
        for (int c = 0; c < chunks(); ++c) acc[g][c] = S::mul(acc[g][c], f);
        max[g] = m;
      }
      const V e = S::exp(S::sub(s[g], S::set1(max[g])));
      sum[g] = S::add(sum[g], e);
      S::store(p[g], e);
    }
    if constexpr (kRowMajor) {  // every accumulator in a register: one pass over the rows
      for (int j = 0; j < W; ++j) {
        V vv[CM];
        for (int c = 0; c < chunks(); ++c) vv[c] = S::load(vp[j] + c * W);
        for (int g = 0; g < heads(); ++g) {
          const V pg = S::set1(p[g][j]);
          for (int c = 0; c < chunks(); ++c) acc[g][c] = S::fma(pg, vv[c], acc[g][c]);
        }
      }
    } else {  // one chunk of the head dim at a time, its G accumulators in registers
      for (int c = 0; c < chunks(); ++c) {
        V a[GM];
        for (int g = 0; g < heads(); ++g) a[g] = acc[g][c];
        for (int j = 0; j < W; ++j) {
          const V vv = S::load(vp[j] + c * W);
          for (int g = 0; g < heads(); ++g) a[g] = S::fma(S::set1(p[g][j]), vv, a[g]);
        }
        for (int g = 0; g < heads(); ++g) acc[g][c] = a[g];
      }
    }
  }
};

// Blocks are scattered over the pool, and the hardware prefetchers stop at page
// boundaries (a block is about a page): row o of the next block is asked for when row
// o of this one is queued, one block ahead.
template <typename T>
inline void prefetch_row(const T* k, const T* v, int64_t at, int d) {
  constexpr int kLine = 64 / sizeof(T);
  for (int e = 0; e < d; e += kLine) {
    __builtin_prefetch(k + at + e);
    __builtin_prefetch(v + at + e);
  }
}

template <typename T, class S, int G, int C, bool O>
void one_item(const Args& a, int64_t item) {
  using I = Item<T, S, G, C, O>;
  constexpr int W = S::W;
  const int i = static_cast<int>(item / a.hkv), h = static_cast<int>(item % a.hkv);
  const int d = a.head_dim, bs = a.block_size, ctx = a.tok_ctx[i], row = a.tok_row[i];
  const int32_t* table = a.tables + static_cast<int64_t>(a.tok_table[i]) * a.table_width;
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  I it;
  it.ng = a.hq / a.hkv;
  it.nc = d / W;
  it.softcap = a.softcap;
  alignas(64) float buf[kMaxD];
  alignas(64) float first[W] = {1.0f};  // lane 0 set: a sum of exp(sink - sink)
  for (int g = 0; g < it.heads(); ++g) {
    const T* qg = static_cast<const T*>(a.q) + row * a.q_stride_t + (h * it.heads() + g) * a.q_stride_h;
    for (int e = 0; e < d; ++e) buf[e] = load1(qg + e) * a.scale;
    for (int c = 0; c < it.chunks(); ++c) {
      it.q[g][c] = S::load(buf + c * W);
      it.acc[g][c] = S::zero();
    }
    const bool sink = O && a.sinks != nullptr;
    it.max[g] = sink ? a.sinks[h * it.heads() + g] : kNegInf;
    it.sum[g] = sink ? S::load(first) : S::zero();
  }
  const int64_t stride = static_cast<int64_t>(a.hkv) * d;  // between slots, one head
  const int64_t block_stride = bs * stride;
  const int start = a.window > 0 ? std::max(0, ctx - a.window) : 0;
  int n = 0;
  for (int b = start / bs, j = start; j < ctx; ++b) {
    const int64_t base = table[b] * block_stride + h * d;
    const int next_rows = std::min(bs, ctx - (b + 1) * bs);
    const int64_t next = next_rows > 0 ? table[b + 1] * block_stride + h * d : 0;
    for (int o = j - b * bs, end = std::min(bs, ctx - b * bs); o < end; ++o, ++j) {
      if (o < next_rows) prefetch_row(k, v, next + o * stride, d);
      it.kp[n] = k + base + o * stride;
      it.vp[n] = v + base + o * stride;
      if (++n == W) {
        it.fold(W);
        n = 0;
      }
    }
  }
  if (n > 0) {
    for (int j = n; j < W; ++j) it.kp[j] = it.vp[j] = zero_row<T>();
    it.fold(n);
  }
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(row) * a.hq + h * it.heads()) * d;
  for (int g = 0; g < it.heads(); ++g) {
    const auto inv = S::set1(1.0f / S::hsum(it.sum[g]));
    for (int c = 0; c < it.chunks(); ++c) S::store(buf + c * W, S::mul(it.acc[g][c], inv));
    for (int e = 0; e < d; ++e) store1(out + g * d + e, buf[e]);
  }
}

template <typename T, class S, int G, int C>
void run_items(const Args& a, int num_threads) {
  const int64_t items = static_cast<int64_t>(a.num_tokens) * a.hkv;
  if (a.softcap != 0.0f || a.sinks != nullptr) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
    for (int64_t item = 0; item < items; ++item) one_item<T, S, G, C, true>(a, item);
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
  for (int64_t item = 0; item < items; ++item) one_item<T, S, G, C, false>(a, item);
}

template <typename T, class S, int G>
void run_chunks(const Args& a, int num_threads) {
  switch (a.head_dim / S::W) {  // head dims of 2, 4, 8 vectors compiled as such
    case 2: return run_items<T, S, G, 2>(a, num_threads);
    case 4: return run_items<T, S, G, 4>(a, num_threads);
    case 8: return run_items<T, S, G, 8>(a, num_threads);
    default: return run_items<T, S, G, 0>(a, num_threads);
  }
}

template <typename T, class S>
void run_isa(const Args& a, int num_threads) {
  if constexpr (S::W < 8) {  // the portable path: one instance
    run_items<T, S, 0, 0>(a, num_threads);
  } else {
    switch (a.hq / a.hkv) {  // G of 1 to 4 and 8 compiled as such (3: SmolLM2)
      case 1: return run_chunks<T, S, 1>(a, num_threads);
      case 2: return run_chunks<T, S, 2>(a, num_threads);
      case 3: return run_chunks<T, S, 3>(a, num_threads);
      case 4: return run_chunks<T, S, 4>(a, num_threads);
      case 8: return run_chunks<T, S, 8>(a, num_threads);
      default: return run_items<T, S, 0, 0>(a, num_threads);
    }
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

// One layer's attention (dtype 0: float32, 1: bfloat16), with its options: window
// (0: none), softcap (0: none), sinks ([hq] float32 logits, or null).
extern "C" int pdserve_paged_attention_layer(
    int dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
    const void* v, void* out, const int32_t* tables, int32_t table_width,
    const int32_t* tok_row, const int32_t* tok_table, const int32_t* tok_ctx,
    int32_t num_tokens, int32_t hq, int32_t hkv, int32_t head_dim, int32_t block_size,
    float scale, int32_t window, float softcap, const float* sinks, int32_t num_threads) {
  if (hkv <= 0 || hq % hkv != 0 || hq / hkv > kMaxG || head_dim > kMaxD || block_size <= 0 ||
      window < 0)
    return 1;
  Args a{q,      q_stride_t, q_stride_h, k,         v,          out,        tables,
         table_width, tok_row, tok_table, tok_ctx, num_tokens, hq, hkv, head_dim,
         block_size, scale, window, softcap, sinks};
  return pdserve::by_dtype(dtype, [&](auto zero) { run<decltype(zero)>(a, num_threads); });
}

// The plain call: no window, no soft-cap, no sinks.
extern "C" int pdserve_paged_attention(
    int dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
    const void* v, void* out, const int32_t* tables, int32_t table_width,
    const int32_t* tok_row, const int32_t* tok_table, const int32_t* tok_ctx,
    int32_t num_tokens, int32_t hq, int32_t hkv, int32_t head_dim, int32_t block_size,
    float scale, int32_t num_threads) {
  return pdserve_paged_attention_layer(dtype, q, q_stride_t, q_stride_h, k, v, out, tables,
                                       table_width, tok_row, tok_table, tok_ctx, num_tokens,
                                       hq, hkv, head_dim, block_size, scale, 0, 0.0f, nullptr,
                                       num_threads);
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
