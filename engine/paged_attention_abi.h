// What both CPU paged-attention kernels share: the call's arguments as one struct, the
// bfloat16 conversions and the dtype codes. paged_attention.cpp (through paged_attention_simd.h) and the
// frozen first kernel that bench/attention_kernel.py times it against
// (bench/paged_attention_v1.cpp, which reads none of the per-layer options) include it.
#pragma once

#include <cstdint>
#include <cstring>

namespace pdserve {

inline float bf16_to_f32(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float x) {  // round to nearest even; a NaN stays a (quiet) NaN
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
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
  int32_t window = 0;            // 0: no sliding window
  float softcap = 0.0f;          // 0: no soft-capping
  const float* sinks = nullptr;  // [hq] or none
};

// The call's dtype code (0: float32, 1: bfloat16, as uint16_t) to ``run(T{})`` for that
// element type T; returns the call's result: 0, or 2 for an unknown code.
template <class Run>
int by_dtype(int dtype, Run run) {
  if (dtype == 0)
    run(float{});
  else if (dtype == 1)
    run(uint16_t{});
  else
    return 2;
  return 0;
}

}  // namespace pdserve
