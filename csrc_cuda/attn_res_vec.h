// Device helpers of the CUDA C++ forward kernels (attn_res_cluster.cu, attn_res_stream.cu): 16-byte vector loads
// and stores of 8 elements converted to / from FP32, CTA-wide reductions, the e4m3 encoding. Included by .cu
// files only (device code).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attn_res_bwd.h"  // IoDtype

namespace k3_ops::cuda::device {

// Explicit conversions: torch's build flags turn the implicit bf16 / fp16 ones off.
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = to_float(v[j]);
}

template <>
__device__ __forceinline__ void load8<float>(const float* p, float (&x)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// A weight of any of the three dtypes, chosen at run time (a uniform branch): the output norm's, whose dtype would
// otherwise multiply the instantiations by three.
__device__ __forceinline__ void load8_any(const void* p, IoDtype dtype, int64_t col, float (&x)[8]) {
  switch (dtype) {
    case IoDtype::kFloat32: load8(static_cast<const float*>(p) + col, x); break;
    case IoDtype::kBFloat16: load8(static_cast<const __nv_bfloat16*>(p) + col, x); break;
    default: load8(static_cast<const __half*>(p) + col, x); break;
  }
}

// The sum of `value` over the CTA (warp shuffles, then the warps' partials in warp order), in every thread.
__device__ __forceinline__ float cta_sum(float value, float* warp_scratch, int warps, int lane, int warp) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) value += __shfl_xor_sync(0xffffffffu, value, off);
  if (lane == 0) warp_scratch[warp] = value;
  __syncthreads();
  float s = 0.f;
  for (int q = 0; q < warps; ++q) s += warp_scratch[q];
  return s;
}

// The max of `value` over the CTA, in every thread (as cta_sum).
__device__ __forceinline__ float cta_max(float value, float* warp_scratch, int warps, int lane, int warp) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, off));
  if (lane == 0) warp_scratch[warp] = value;
  __syncthreads();
  float m = 0.f;
  for (int q = 0; q < warps; ++q) m = fmaxf(m, warp_scratch[q]);
  return m;
}

// fp32 -> e4m3 bit pattern, round to nearest even, for |x| <= the format's max (the caller clamps): the integer
// arithmetic of the Triton kernels' _e4m3_bits (kernels/attn_res_fwd.py), identical to torch's conversion, for
// e4m3fn (bias 7, NaN 0x7F | sign) and e4m3fnuz (bias 8, no -0, NaN 0x80), which CUDA's fp8 types do not cover.
__device__ __forceinline__ uint32_t e4m3_bits(float x, bool fnuz) {
  const int bias = fnuz ? 8 : 7;
  const float min_normal = fnuz ? 0.0078125f : 0.015625f;  // 2^(1 - bias)
  const float sub_scale = fnuz ? 1024.f : 512.f;            // 2^(2 + bias), 1 / the subnormal step
  const bool is_nan = x != x;
  const int32_t sign = static_cast<int32_t>(__float_as_uint(x) >> 31);
  const int32_t mag = static_cast<int32_t>(__float_as_uint(is_nan ? 0.f : x) & 0x7FFFFFFFu);
  const float ax = __int_as_float(mag);
  // Normal range: the mantissa rounded to 3 bits, ties to even (a carry bumps the exponent), rebiased.
  const int32_t normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - bias) << 3);
  // Subnormal range: adding and removing 2^23 rounds ax / step to the nearest even integer (exact: < 8).
  const int32_t sub = static_cast<int32_t>(__fsub_rn(__fadd_rn(ax * sub_scale, 8388608.f), 8388608.f));
  const int32_t enc = ax < min_normal ? sub : normal;
  if (fnuz) return is_nan ? 0x80u : (enc == 0 ? 0u : static_cast<uint32_t>(enc | (sign << 7)));
  return static_cast<uint32_t>(is_nan ? ((sign << 7) | 0x7F) : (enc | (sign << 7)));
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&y)[8]) {
  uint4 raw;
  T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = from_float<T>(y[j]);
  *reinterpret_cast<uint4*>(p) = raw;
}

}  // namespace k3_ops::cuda::device
