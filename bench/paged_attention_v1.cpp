// The first paged-attention kernel (main before the rewrite), kept as the baseline that
// bench/attention_kernel.py times the current pdserve/engine/paged_attention.cpp against.
// Paged attention on CPU that reads the KV pool in place (no gather copy).
//
// One call per layer covers every query token of the step that attends to context
// in the pool: decodes and continuing prefill chunks alike. Token i attends causally
// to the first ctx[i] positions of its request, whose blocks are table row
// tok_table[i] (W entries). Work items are (token, KV head) pairs; the G query heads
// sharing a KV head are done together, so each K/V row is loaded once for all G.
// Compiled at run time by pdserve/engine/cpu_kernel.py (g++ -O3 -march=native).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../engine/paged_attention_abi.h"  // Args, the bf16 conversions

namespace {

using pdserve::Args;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return pdserve::bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = pdserve::f32_to_bf16(x); }

template <typename T>
void one_item(const Args& a, int64_t item, std::vector<float>& scores, std::vector<float>& acc) {
  const int i = static_cast<int>(item / a.hkv), h = static_cast<int>(item % a.hkv);
  const int g_count = a.hq / a.hkv, d = a.head_dim, bs = a.block_size;
  const int ctx = a.tok_ctx[i], row = a.tok_row[i];
  const int32_t* table = a.tables + static_cast<int64_t>(a.tok_table[i]) * a.table_width;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  scores.resize(static_cast<size_t>(g_count) * ctx);
  acc.assign(static_cast<size_t>(g_count) * d, 0.0f);
  float qf[8][256];  // G <= 8, D <= 256: checked by the caller
  for (int g = 0; g < g_count; ++g)
    for (int e = 0; e < d; ++e)
      qf[g][e] = load(q, row * a.q_stride_t + (h * g_count + g) * a.q_stride_h + e) * a.scale;
  for (int j = 0; j < ctx; ++j) {
    const int64_t slot = static_cast<int64_t>(table[j / bs]) * bs + j % bs;
    const int64_t base = (slot * a.hkv + h) * d;
    for (int g = 0; g < g_count; ++g) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int e = 0; e < d; ++e) s += qf[g][e] * load(k, base + e);
      scores[static_cast<size_t>(g) * ctx + j] = s;
    }
  }
  for (int g = 0; g < g_count; ++g) {
    float* sg = scores.data() + static_cast<size_t>(g) * ctx;
    const float m = *std::max_element(sg, sg + ctx);
    float sum = 0.0f;
    for (int j = 0; j < ctx; ++j) sum += (sg[j] = std::exp(sg[j] - m));
    const float inv = 1.0f / sum;
    for (int j = 0; j < ctx; ++j) sg[j] *= inv;
  }
  for (int j = 0; j < ctx; ++j) {
    const int64_t slot = static_cast<int64_t>(table[j / bs]) * bs + j % bs;
    const int64_t base = (slot * a.hkv + h) * d;
    for (int g = 0; g < g_count; ++g) {
      const float p = scores[static_cast<size_t>(g) * ctx + j];
      float* o = acc.data() + static_cast<size_t>(g) * d;
#pragma omp simd
      for (int e = 0; e < d; ++e) o[e] += p * load(v, base + e);
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int g = 0; g < g_count; ++g)
    for (int e = 0; e < d; ++e)
      store(out, (static_cast<int64_t>(row) * a.hq + h * g_count + g) * d + e,
            acc[static_cast<size_t>(g) * d + e]);
}

template <typename T>
void run(const Args& a, int num_threads) {
  const int64_t items = static_cast<int64_t>(a.num_tokens) * a.hkv;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc;
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < items; ++item) one_item<T>(a, item, scores, acc);
  }
}

}  // namespace

extern "C" int pdserve_paged_attention(
    int dtype,  // 0: float32, 1: bfloat16
    const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k, const void* v,
    void* out, const int32_t* tables, int32_t table_width, const int32_t* tok_row,
    const int32_t* tok_table, const int32_t* tok_ctx, int32_t num_tokens, int32_t hq,
    int32_t hkv, int32_t head_dim, int32_t block_size, float scale, int32_t num_threads) {
  if (hq % hkv != 0 || hq / hkv > 8 || head_dim > 256) return 1;
  Args a{q,      q_stride_t, q_stride_h, k,         v,          out,        tables,
         table_width, tok_row, tok_table, tok_ctx, num_tokens, hq, hkv, head_dim,
         block_size, scale};
  return pdserve::by_dtype(dtype, [&](auto zero) { run<decltype(zero)>(a, num_threads); });
}
