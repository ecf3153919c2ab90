// Device helpers of the CUDA C++ forward kernels (attn_res_cluster_kernel.h, attn_res_stream.cu): 16-byte vector loads
// (split into fetch and unpack) and stores of 8 elements converted to / from FP32, CTA-wide reductions, the e4m3
// encoding and the split cluster barrier. Included by .cu files only (device code).
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

// 8 elements as loaded, not yet converted: fetch8 issues the load and nothing else, unpack8 converts. A kernel can
// so put a load in flight long before the value is needed: the cluster kernel fetches the output norm's weight with
// its inputs and converts it after the mix (the block rows need no such split: the compiler already overlaps their
// loads).
template <typename T>
struct Raw8 {
  uint4 u;  // 8 16-bit elements
};
template <>
struct Raw8<float> {
  float4 a, b;
};

template <typename T>
__device__ __forceinline__ Raw8<T> fetch8(const T* p) {
  return Raw8<T>{*reinterpret_cast<const uint4*>(p)};
}
template <>
__device__ __forceinline__ Raw8<float> fetch8<float>(const float* p) {
  return Raw8<float>{reinterpret_cast<const float4*>(p)[0], reinterpret_cast<const float4*>(p)[1]};
}

template <typename T>
__device__ __forceinline__ void unpack8(const Raw8<T>& r, float (&x)[8]) {
  const T* v = reinterpret_cast<const T*>(&r.u);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = to_float(v[j]);
}
template <>
__device__ __forceinline__ void unpack8<float>(const Raw8<float>& r, float (&x)[8]) {
  x[0] = r.a.x; x[1] = r.a.y; x[2] = r.a.z; x[3] = r.a.w; x[4] = r.b.x; x[5] = r.b.y; x[6] = r.b.z; x[7] = r.b.w;
}

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
  unpack8(fetch8(p), x);
}

// A weight of any of the three dtypes, chosen at run time (a uniform branch): the output norm's, whose dtype would
// otherwise multiply the instantiations by three. fetch8_any / unpack8_any split it as fetch8 / unpack8 do.
struct Raw8Any {
  uint4 lo, hi;  // 16-bit dtypes: lo only
};

__device__ __forceinline__ Raw8Any fetch8_any(const void* p, IoDtype dtype, int64_t col) {
  if (dtype == IoDtype::kFloat32) {
    const uint4* q = reinterpret_cast<const uint4*>(static_cast<const float*>(p) + col);
    return Raw8Any{q[0], q[1]};
  }
  return Raw8Any{*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + col), make_uint4(0u, 0u, 0u, 0u)};
}

__device__ __forceinline__ void unpack8_any(const Raw8Any& r, IoDtype dtype, float (&x)[8]) {
  switch (dtype) {
    case IoDtype::kFloat32: {
      const float* f = reinterpret_cast<const float*>(&r);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = f[j];
      break;
    }
    case IoDtype::kBFloat16: unpack8(Raw8<__nv_bfloat16>{r.lo}, x); break;
    default: unpack8(Raw8<__half>{r.lo}, x); break;
  }
}

__device__ __forceinline__ void load8_any(const void* p, IoDtype dtype, int64_t col, float (&x)[8]) {
  unpack8_any(fetch8_any(p, dtype, col), dtype, x);
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

// The cluster barrier split into its two halves (sm_90 PTX barrier.cluster), so that a CTA signals "my stores are
// done" (arrive) and waits for the others (wait) as two steps, with its own work between them. Every thread of
// every CTA of the cluster runs the same sequence of arrives and waits (.aligned: never in a divergent branch).
// arrive_relaxed orders nothing (the "every CTA has started" phase, before any distributed-shared-memory access);
// arrive_release orders this thread's earlier stores, local and remote, before the arrive; wait_acquire makes every
// store released by the phase's arrives visible to this thread. Below sm_90 they compile to nothing: the kernels
// that call them trap there (attn_res_cluster_kernel.h).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

}  // namespace k3_ops::cuda::device
