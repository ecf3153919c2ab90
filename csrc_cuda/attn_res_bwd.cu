// The single-read CUDA backward of kimi_k3::attn_res. Math: docs/attn_res_backward.md.
//
// Why a CUDA C++ kernel next to the Triton ones: the backward needs every candidate twice per token (statistics,
// then dv), and its bandwidth target needs the second read to come from on-chip memory. The Triton split reads
// the inputs twice from DRAM; the Triton streaming kernel reads once but is issue-bound (docs/history.md,
// "Backward (`attn_res_backward`)"). Here one program per SM walks a contiguous token range, each input row read
// from DRAM once. Three layouts of the token's rows (the launch policy picks, k3_ops/backends/cuda_plan.py
// backward_plan):
//
//   * ring (attn_res_bwd_ring_kernel, the default wherever it runs: H <= 7168): the rows sit in a shared-memory
//     ring of as many row slots as fit, so that the rows of the tokens ahead stay in flight through each token's
//     statistics, softmax and barriers; dw is kept in FP64 registers and, after a grid barrier (a cooperative
//     launch), summed over the programs in the kernel itself;
//   * register-resident (attn_res_bwd_single_read_kernel, 1 or 2 vectors per thread; below
//     SINGLE_READ_SMEM_MIN_K where the ring does not run): one token in registers while the next one streams into
//     shared memory, as described below;
//   * shared-memory-resident (attn_res_bwd_single_read_smem_kernel, from K = 5 where the ring does not run): the
//     rows stay in shared memory and both passes read them from there, so a thread needs 64 registers and an SM
//     runs twice the warps (at K = 8 the register layout fills 128 registers per thread, spills, and its 14 warps
//     at H = 7168 leave it latency-bound: docs/history.md, "Backward (`attn_res_backward`)").
//
// The register-resident kernel:
//
//   * every thread owns the same 16-byte column vectors of every row (vector v = thread + k * threads): it
//     copies them from global to shared memory (cp.async, no registers held while in flight), later loads them
//     into registers, and only it ever touches those shared-memory slots; so as soon as it holds token t in
//     registers it issues the copy of token t + 1 into the same slots, with no barrier, and the DRAM reads of
//     t + 1 overlap all of t's arithmetic;
//   * pass 1 (statistics) runs from registers: per candidate, sum(v^2), <v, w>, <v, gy> in FP32 over the
//     thread's 8 or 16 elements, then FP64 across the warp (shuffles) and across warps (shared memory, a fixed
//     order) -- the accuracy contract's margin, as in the Triton kernels' FP64 statistics;
//   * after the token's one barrier every warp computes the softmax and its backward in FP64 (lane l for
//     candidate l + 1) and keeps three FP32 coefficients per candidate;
//   * pass 2 writes dv from the same registers and adds the token's dw into the program's FP64 shared-memory
//     row, which goes to workspace[program] at the end (summed over programs in a fixed order by the Triton
//     reduction: no atomics, identical bits from run to run).
//
// DRAM traffic is the backward's own bytes: each input row is read once and each output row written once.
#include "attn_res_bwd.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <utility>

#include "cp_async.h"
#include "warp_reduce.h"

namespace k3_ops::cuda {
namespace {

using device::butterfly_index;
using device::cp_async16;
using device::cp_async_commit;
using device::cp_async_wait_all;
using device::cp_async_wait_dyn;
using device::warp_sum_transposed;

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 1024;
constexpr int kElemsPerVector = 8;  // 16 bytes of a 16-bit dtype
constexpr int kRowsPerGroup = 2;  // candidate rows per warp butterfly (6 of its 8 values: 8 partials live)

// Doubles of one statistics buffer ([warps][3 * rows]), rounded up to an even count so that what follows it in shared
// memory (the coefficients' float4s) starts on a 16-byte boundary at any warp count.
__host__ __device__ constexpr int red_doubles(int nwarps, int maxr) { return (nwarps * 3 * maxr + 1) & ~1; }
// The ring kernel's most threads (H <= 7168, Kimi K3's width): with its eight FP64 dw values (16 registers) a thread
// fits the 72 registers that 28 warps leave, without spills; at 32 warps (64 registers) it spills.
constexpr int kRingMaxThreads = 896;

template <typename T>
struct Pack;

template <>
struct Pack<__nv_bfloat16> {
  // Two bf16 in one 32-bit word (element 0 in the low half) <-> two floats.
  __device__ static float2 unpack(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct Pack<__half> {
  __device__ static float2 unpack(uint32_t u) { return __half22float2(*reinterpret_cast<__half2*>(&u)); }
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

__device__ __forceinline__ uint32_t word(const uint4& u, int j) {
  return j == 0 ? u.x : j == 1 ? u.y : j == 2 ? u.z : u.w;
}

__device__ __forceinline__ void set_word(uint4& u, int j, uint32_t v) {
  if (j == 0) u.x = v; else if (j == 1) u.y = v; else if (j == 2) u.z = v; else u.w = v;
}

__device__ __forceinline__ float load_weight(const void* p, IoDtype dtype, int64_t i) {
  switch (dtype) {
    case IoDtype::kFloat32: return static_cast<const float*>(p)[i];
    case IoDtype::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return __half2float(static_cast<const __half*>(p)[i]);
  }
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Pass 1's per-vector step, both layouts: add one 16-byte vector's sum(v^2), <v, w>, <v, gy> (FP32) into the
// row's three partials (part3[0..2]); w8 and gy8 are this vector's 8 weights and grad_out values.
template <typename T>
__device__ __forceinline__ void accumulate_row_stats(float* part3, const uint4& u, const float (&w8)[kElemsPerVector],
                                                     const float (&gy8)[kElemsPerVector]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 x = Pack<T>::unpack(word(u, j));
    part3[0] = fmaf(x.y, x.y, fmaf(x.x, x.x, part3[0]));
    part3[1] = fmaf(x.y, w8[2 * j + 1], fmaf(x.x, w8[2 * j], part3[1]));
    part3[2] = fmaf(x.y, gy8[2 * j + 1], fmaf(x.x, gy8[2 * j], part3[2]));
  }
}

// Pass 1's warp step, both layouts: sum a row group's kN partials over the warp (transposing butterfly,
// warp_reduce.h) and store this warp's totals for rows r0 .. r0 + kRowsPerGroup - 1 into red[warp][3 (r - 1) + q],
// in FP64. FP32 up to here: each total is a 5-level tree over lanes of 8- or 16-element in-thread sums, a shorter
// FP32 chain than the eager formula's (the FP64 sum starts across warps).
template <int kN, int MAXR>
__device__ __forceinline__ void store_group_totals(float (&part)[kN], int lane, int warp, int r0, double* red) {
  const float total = warp_sum_transposed<kN>(part, lane);
  const int index = butterfly_index<kN>(lane);
  const int rows_here = MAXR - r0 < kRowsPerGroup ? MAXR - r0 : kRowsPerGroup;
  if (lane % (kWarpSize / kN) == 0 && index < 3 * rows_here)
    red[warp * 3 * MAXR + 3 * (r0 - 1) + index] = static_cast<double>(total);
}

// The softmax and its backward for one token, in FP64, lane l for candidate row r = l + 1 (both layouts): sum the
// warps' partial statistics (red: [nwarps][3 * MAXR] doubles, row r's sum(v^2), <v, w>, <v, gy> at 3 (r - 1)) in
// a fixed order (identical bits in every warp and run), then r = rsqrt(mean(v^2) + eps), score = r d, p =
// softmax(score), gs = p (<v, gy> - sum p <v, gy>). Returns the lane's FP32 coefficients of dv = x gy + y w - z v,
// dw += y v: (p, gs r, gs d r^3 / H); zeros for lanes past the token's rows. Every lane of the warp must call it.
template <int MAXR>
__device__ __forceinline__ float3 softmax_backward_coefficients(const double* red, int nwarps, int nrows, int lane,
                                                                int64_t H, double eps) {
  const int r = lane + 1;
  const bool valid = r < nrows;
  double ss = 0.0, dd = 0.0, gg = 0.0;
  if (valid) {
    for (int q = 0; q < nwarps; ++q) {
      const double* in = red + q * 3 * MAXR + 3 * (r - 1);
      ss += in[0];
      dd += in[1];
      gg += in[2];
    }
  }
  const double rr = valid ? rsqrt(ss / static_cast<double>(H) + eps) : 0.0;
  const double score = rr * dd;
  const double m = warp_max(valid ? score : -INFINITY);
  const double e = valid ? exp(score - m) : 0.0;
  const double p = e * (1.0 / warp_sum(e));
  const double gs = p * (gg - warp_sum(p * gg));
  return make_float3(static_cast<float>(p), static_cast<float>(gs * rr),
                     static_cast<float>(gs * dd * rr * rr * rr / static_cast<double>(H)));
}

// Row r of a token, as the kernel numbers them: 0 = grad_out, 1 = the prefix (candidate v_K), 2 + i = v_i.
// Fixed register positions for grad_out and the prefix keep every register array index a compile-time constant.
template <typename T>
__device__ __forceinline__ const T* input_row(const SingleReadBwdArgs& a, int64_t t, int r) {
  if (r == 0) return static_cast<const T*>(a.grad_out) + t * a.stride_gyt;
  if (r == 1) return static_cast<const T*>(a.prefix) + t * a.stride_pt;
  return static_cast<const T*>(a.blocks) + t * a.stride_bt + (r - 2) * a.stride_bc;
}

// Copy token t's rows (this thread's vectors only) into shared memory, asynchronously.
template <typename T, int VPT>
__device__ __forceinline__ void prefetch_token(const SingleReadBwdArgs& a, uint4* rows_s, int64_t t, int nrows,
                                               int nvec) {
  for (int r = 0; r < nrows; ++r) {
    const uint4* src = reinterpret_cast<const uint4*>(input_row<T>(a, t, r));
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v < nvec) cp_async16(&rows_s[r * nvec + v], src + v);
    }
  }
  cp_async_commit();
}

// Shared memory: rows [nrows][nvec] uint4 | dw [8][nvec] double | red [2][warps][3 * MAXR] double.
// Registers: 1024 / VPT threads at most, so ptxas budgets 64 (VPT = 1) or 128 (VPT = 2) per thread (a tighter
// thread bound gives no more: 14 warps put 4 on some scheduler, whose quarter of the register file caps them at
// 128). The K = 8 variant keeps a few of w's registers in (L1-resident) local memory.
template <typename T, int VPT, int MAXR>
__global__ void __launch_bounds__(kMaxThreads / VPT, 1) attn_res_bwd_single_read_kernel(SingleReadBwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  using P = Pack<T>;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  const int K = static_cast<int>(a.K);
  const int nrows = K + 2;
  const int64_t H = a.H;
  const int nvec = static_cast<int>(H / kElemsPerVector);
  uint4* rows_s = reinterpret_cast<uint4*>(smem);
  double* dw_s = reinterpret_cast<double*>(rows_s + static_cast<size_t>(nrows) * nvec);
  double* red_s = dw_s + static_cast<size_t>(kElemsPerVector) * nvec;  // two buffers, by token parity

  const int64_t t_begin = static_cast<int64_t>(blockIdx.x) * a.tokens_per_prog;
  const int64_t t_end = t_begin + a.tokens_per_prog < a.T ? t_begin + a.tokens_per_prog : a.T;
  const bool compute_dw = a.workspace != nullptr;
  if (t_begin < t_end) prefetch_token<T, VPT>(a, rows_s, t_begin, nrows, nvec);

  // The folded weight w = norm_weight * proj_weight in FP32 (as the reference folds it), for this thread's columns.
  float w[VPT][kElemsPerVector];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int v = tid + k * blockDim.x;
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) {
      const int64_t h = static_cast<int64_t>(v) * kElemsPerVector + e;
      w[k][e] = v < nvec ? load_weight(a.norm_weight, a.nw_dtype, h) * load_weight(a.proj_weight, a.pw_dtype, h) : 0.f;
      if (compute_dw && v < nvec) dw_s[e * nvec + v] = 0.0;
    }
  }

  for (int64_t t = t_begin; t < t_end; ++t) {
    cp_async_wait_all();  // this thread's own copies of token t have landed (only it reads those slots)
    uint4 x[MAXR][VPT];
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = tid + k * blockDim.x;
        x[r][k] = (r < nrows && v < nvec) ? rows_s[r * nvec + v] : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    // Token t is in registers: the same slots take token t + 1 now, so its DRAM reads overlap all of token t's
    // work. A thread's later write cannot reach its own earlier load of the same address (per-thread coherence;
    // the "memory" clobber keeps the compiler from sinking the loads past the copy).
    if (t + 1 < t_end) prefetch_token<T, VPT>(a, rows_s, t + 1, nrows, nvec);
    double* red = red_s + (t & 1) * nwarps * 3 * MAXR;
    float gy[VPT][kElemsPerVector];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 g = P::unpack(word(x[0][k], j));
        gy[k][2 * j] = g.x;
        gy[k][2 * j + 1] = g.y;
      }
    }

    // Pass 1: per candidate row, three FP32 sums over this thread's elements -- sum(v^2), <v, w>, <v, gy>, value
    // index 3 (r - 1) + q -- then summed over the warp in groups of two rows (6 values, one butterfly).
#pragma unroll
    for (int r0 = 1; r0 < MAXR; r0 += kRowsPerGroup) {
      constexpr int kN = 8;  // values per butterfly, a power of two >= 3 x kRowsPerGroup
      float part[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) part[i] = 0.f;
#pragma unroll
      for (int dr = 0; dr < kRowsPerGroup; ++dr) {
        const int r = r0 + dr;
        if (r < MAXR && 3 * dr + 2 < kN && r < nrows) {  // the first two are compile-time
#pragma unroll
          for (int k = 0; k < VPT; ++k) accumulate_row_stats<T>(&part[3 * dr], x[r][k], w[k], gy[k]);
        }
      }
      store_group_totals<kN, MAXR>(part, lane, warp, r0, red);
    }

    // One barrier per token: every warp then computes the softmax and its backward itself (the same FP64 values
    // in the same order in every warp), lane l for candidate row l + 1, instead of one warp computing them for a
    // second barrier. The partials are double-buffered by token parity: token t + 1 writes the other buffer, and
    // token t + 2 writes this one only after every warp has passed token t + 1's barrier, i.e. finished reading.
    __syncthreads();
    // This lane's candidate: dv = ca gy + cb w - cc v, dw += cb v (every warp computes the same values).
    const float3 coef = softmax_backward_coefficients<MAXR>(red, nwarps, nrows, lane, H, a.eps);
    const float ca_l = coef.x, cb_l = coef.y, cc_l = coef.z;

    // Pass 2: dv_r = p gy + gs r w - (gs d r^3 / H) v, from the same registers; dw_t = sum_r gs r v in FP32.
    // Vector-outer order, so that only one vector's dw partials are live at a time (registers: the K = 8 variant
    // holds 9 rows x 2 vectors plus gy and w, right at the 128-register budget of a 14-warp program).
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = tid + k * blockDim.x;
      float dwt[kElemsPerVector];
#pragma unroll
      for (int e = 0; e < kElemsPerVector; ++e) dwt[e] = 0.f;
#pragma unroll
      for (int r = 1; r < MAXR; ++r) {
        if (r < nrows) {
          const float ca = __shfl_sync(0xffffffffu, ca_l, r - 1), cb = __shfl_sync(0xffffffffu, cb_l, r - 1),
                      cc = __shfl_sync(0xffffffffu, cc_l, r - 1);
          uint4 o;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 vv = P::unpack(word(x[r][k], j));
            const float d0 = fmaf(-cc, vv.x, fmaf(cb, w[k][2 * j], ca * gy[k][2 * j]));
            const float d1 = fmaf(-cc, vv.y, fmaf(cb, w[k][2 * j + 1], ca * gy[k][2 * j + 1]));
            set_word(o, j, P::pack(d0, d1));
            dwt[2 * j] = fmaf(cb, vv.x, dwt[2 * j]);
            dwt[2 * j + 1] = fmaf(cb, vv.y, dwt[2 * j + 1]);
          }
          T* dst = r == 1 ? static_cast<T*>(a.grad_prefix) + t * H
                          : static_cast<T*>(a.grad_blocks) + (t * a.C + (r - 2)) * H;
          if ((r == 1 ? a.grad_prefix : a.grad_blocks) != nullptr && v < nvec) reinterpret_cast<uint4*>(dst)[v] = o;
        }
      }
      if (v < nvec) {
        if (compute_dw) {
#pragma unroll
          for (int e = 0; e < kElemsPerVector; ++e) dw_s[e * nvec + v] += static_cast<double>(dwt[e]);
        }
        if (a.grad_blocks) {  // exact zeros at the slots >= K (never read)
          for (int64_t c = K; c < a.C; ++c)
            reinterpret_cast<uint4*>(static_cast<T*>(a.grad_blocks) + (t * a.C + c) * H)[v] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  }

  if (compute_dw) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = tid + k * blockDim.x;
      if (v < nvec) {
        double* out = a.workspace + static_cast<int64_t>(blockIdx.x) * H + static_cast<int64_t>(v) * kElemsPerVector;
#pragma unroll
        for (int e = 0; e < kElemsPerVector; ++e) out[e] = dw_s[e * nvec + v];
      }
    }
  }
}


// Shared-memory-resident layout (vectors_per_thread = 0): the token's rows stay in shared memory and both passes
// read them from there, one 16-byte vector per thread and row (H / 8 threads: 28 warps at H = 7168, 64 registers, no
// register array of rows), so the SM has twice the warps of the register-resident kernel to hide latency. The
// copy of token t + 1 into a slot is issued as soon as this thread's pass 2 has consumed it (grad_out's slot
// right after it is unpacked into registers), so its DRAM reads overlap pass 2 of token t. Warp 0 computes the
// softmax between two barriers and hands the coefficients over in shared memory (one broadcast load per row);
// the other warps wait there, which 28 warps per SM afford. Statistics, reduction order and FP64 steps are the
// register-resident kernel's, so both layouts give the same gradients to within FP32 rounding order.
// Shared memory: rows [nrows][nvec] uint4 | dw [8][nvec] double | red [warps][3 * MAXR] double | coef [MAXR] float4.
template <typename T, int MAXR>
__global__ void __launch_bounds__(kMaxThreads, 1) attn_res_bwd_single_read_smem_kernel(SingleReadBwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  using P = Pack<T>;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  const int K = static_cast<int>(a.K);
  const int nrows = K + 2;
  const int64_t H = a.H;
  const int nvec = static_cast<int>(H / kElemsPerVector);
  const int v = tid;
  const bool active = v < nvec;
  uint4* rows_s = reinterpret_cast<uint4*>(smem);
  double* dw_s = reinterpret_cast<double*>(rows_s + static_cast<size_t>(nrows) * nvec);
  double* red = dw_s + static_cast<size_t>(kElemsPerVector) * nvec;
  float4* coef_s = reinterpret_cast<float4*>(red + red_doubles(nwarps, MAXR));

  const int64_t t_begin = static_cast<int64_t>(blockIdx.x) * a.tokens_per_prog;
  const int64_t t_end = t_begin + a.tokens_per_prog < a.T ? t_begin + a.tokens_per_prog : a.T;
  const bool compute_dw = a.workspace != nullptr;
  if (t_begin < t_end) prefetch_token<T, 1>(a, rows_s, t_begin, nrows, nvec);

  float w[kElemsPerVector];
#pragma unroll
  for (int e = 0; e < kElemsPerVector; ++e) {
    const int64_t h = static_cast<int64_t>(v) * kElemsPerVector + e;
    w[e] = active ? load_weight(a.norm_weight, a.nw_dtype, h) * load_weight(a.proj_weight, a.pw_dtype, h) : 0.f;
    if (compute_dw && active) dw_s[e * nvec + v] = 0.0;
  }

  for (int64_t t = t_begin; t < t_end; ++t) {
    cp_async_wait_all();  // this thread's own copies of token t have landed (only it reads those slots)
    const bool more = t + 1 < t_end;
    float gy[kElemsPerVector];
    {
      const uint4 u = active ? rows_s[v] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 g = P::unpack(word(u, j));
        gy[2 * j] = g.x;
        gy[2 * j + 1] = g.y;
      }
    }
    if (more && active) cp_async16(&rows_s[v], reinterpret_cast<const uint4*>(input_row<T>(a, t + 1, 0)) + v);

    // Pass 1, as in the register-resident kernel, each row loaded from shared memory when it is needed.
#pragma unroll
    for (int r0 = 1; r0 < MAXR; r0 += kRowsPerGroup) {
      constexpr int kN = 8;
      float part[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) part[i] = 0.f;
#pragma unroll
      for (int dr = 0; dr < kRowsPerGroup; ++dr) {
        const int r = r0 + dr;
        if (r < MAXR && r < nrows) {
          const uint4 u = active ? rows_s[r * nvec + v] : make_uint4(0u, 0u, 0u, 0u);
          accumulate_row_stats<T>(&part[3 * dr], u, w, gy);
        }
      }
      store_group_totals<kN, MAXR>(part, lane, warp, r0, red);
    }
    __syncthreads();
    if (warp == 0) {
      const float3 c = softmax_backward_coefficients<MAXR>(red, nwarps, nrows, lane, H, a.eps);
      if (lane + 1 < nrows) coef_s[lane + 1] = make_float4(c.x, c.y, c.z, 0.f);
    }
    __syncthreads();

    // Pass 2: dv from shared memory; each consumed slot takes token t + 1's row at once.
    float dwt[kElemsPerVector];
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) dwt[e] = 0.f;
#pragma unroll
    for (int r = 1; r < MAXR; ++r) {
      if (r < nrows) {
        const float4 c = coef_s[r];
        if (active) {
          const uint4 u = rows_s[r * nvec + v];
          uint4 o;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 x = P::unpack(word(u, j));
            const float d0 = fmaf(-c.z, x.x, fmaf(c.y, w[2 * j], c.x * gy[2 * j]));
            const float d1 = fmaf(-c.z, x.y, fmaf(c.y, w[2 * j + 1], c.x * gy[2 * j + 1]));
            set_word(o, j, P::pack(d0, d1));
            dwt[2 * j] = fmaf(c.y, x.x, dwt[2 * j]);
            dwt[2 * j + 1] = fmaf(c.y, x.y, dwt[2 * j + 1]);
          }
          void* out = r == 1 ? a.grad_prefix : a.grad_blocks;
          if (out != nullptr) {
            T* dst = r == 1 ? static_cast<T*>(out) + t * H : static_cast<T*>(out) + (t * a.C + (r - 2)) * H;
            reinterpret_cast<uint4*>(dst)[v] = o;
          }
          // o depends on u: the load has completed before the slot is overwritten.
          if (more) cp_async16(&rows_s[r * nvec + v], reinterpret_cast<const uint4*>(input_row<T>(a, t + 1, r)) + v);
        }
      }
    }
    if (more) cp_async_commit();
    if (active) {
      if (compute_dw) {
#pragma unroll
        for (int e = 0; e < kElemsPerVector; ++e) dw_s[e * nvec + v] += static_cast<double>(dwt[e]);
      }
      if (a.grad_blocks) {
        for (int64_t c = K; c < a.C; ++c)
          reinterpret_cast<uint4*>(static_cast<T*>(a.grad_blocks) + (t * a.C + c) * H)[v] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }

  if (compute_dw && active) {
    double* out = a.workspace + static_cast<int64_t>(blockIdx.x) * H + static_cast<int64_t>(v) * kElemsPerVector;
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) out[e] = dw_s[e * nvec + v];
  }
}


__device__ __forceinline__ void store_value(void* p, IoDtype dtype, int64_t i, float x) {
  switch (dtype) {
    case IoDtype::kFloat32: static_cast<float*>(p)[i] = x; break;
    case IoDtype::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
  }
}

// Column h of the weights' gradients from dw[h] (the folded weight's, summed over tokens in FP64): the chain rule
// through w = norm_weight * proj_weight, each product in FP64, then rounded to FP32 and to the weight's dtype (as
// the Triton reduction, attn_res_bwd_dw_reduce_kernel, does with an FP64 workspace).
__device__ __forceinline__ void store_weight_gradients(const SingleReadBwdArgs& a, int64_t h, double total) {
  if (a.grad_norm_weight != nullptr) {
    const double other = load_weight(a.proj_weight, a.pw_dtype, h);
    store_value(a.grad_norm_weight, a.nw_dtype, h, static_cast<float>(total * other));
  }
  if (a.grad_proj_weight != nullptr) {
    const double other = load_weight(a.norm_weight, a.nw_dtype, h);
    store_value(a.grad_proj_weight, a.pw_dtype, h, static_cast<float>(total * other));
  }
}

// The folded weight-gradient reduction (ring layout, a cooperative launch, after the grid barrier): program b sums
// columns [b * per, (b + 1) * per) of the [grid, H] FP64 partials over the grid's rows and writes the two weights'
// gradients of them (store_weight_gradients). Rows are split into `groups` interleaved sets per column (the threads
// a column gets), each summed in four interleaved chains for independent loads, then the sets in order: a fixed
// order for a given grid and H, so the bits repeat run to run. part: groups x columns doubles of shared memory (at
// most blockDim.x).
__device__ __forceinline__ void reduce_weight_gradient(const SingleReadBwdArgs& a, double* part) {
  const int nprog = static_cast<int>(gridDim.x);
  const int64_t per = (a.H + nprog - 1) / nprog;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * per;
  const int ncols = static_cast<int>(c0 < a.H ? (a.H - c0 < per ? a.H - c0 : per) : 0);
  if (ncols == 0) return;
  const int groups = ncols >= static_cast<int>(blockDim.x) ? 1 : static_cast<int>(blockDim.x) / ncols;
  for (int i = threadIdx.x; i < groups * ncols; i += blockDim.x) {
    const int g = i / ncols, col = i % ncols;
    const double* src = a.workspace + c0 + col;
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int p = g;
    for (; p + 3 * groups < nprog; p += 4 * groups) {
      const double x0 = __ldcg(src + static_cast<int64_t>(p) * a.H);
      const double x1 = __ldcg(src + static_cast<int64_t>(p + groups) * a.H);
      const double x2 = __ldcg(src + static_cast<int64_t>(p + 2 * groups) * a.H);
      const double x3 = __ldcg(src + static_cast<int64_t>(p + 3 * groups) * a.H);
      s0 += x0;
      s1 += x1;
      s2 += x2;
      s3 += x3;
    }
    for (; p < nprog; p += groups) s0 += __ldcg(src + static_cast<int64_t>(p) * a.H);
    const double total = (s0 + s1) + (s2 + s3);
    if (groups == 1) {
      store_weight_gradients(a, c0 + col, total);
    } else {
      part[g * ncols + col] = total;
    }
  }
  if (groups == 1) return;
  __syncthreads();
  for (int col = threadIdx.x; col < ncols; col += blockDim.x) {
    double total = 0.0;
    for (int g = 0; g < groups; ++g) total += part[g * ncols + col];
    store_weight_gradients(a, c0 + col, total);
  }
}

// One 16-byte vector of dv_r = p gy + gs r w - (gs d r^3 / H) v (c = (p, gs r, gs d r^3 / H)) from the candidate's
// packed vector u and grad_out's gyp; adds gs r v into dwt when kDw. One expression for every store of a row, so
// that a row stored later (the ring's deferred last token) has the same bits.
template <typename T, bool kDw>
__device__ __forceinline__ uint4 dv_vector(const uint4& u, const uint4& gyp, const float (&w)[kElemsPerVector],
                                           const float4& c, float (&dwt)[kElemsPerVector]) {
  using P = Pack<T>;
  uint4 o;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 x = P::unpack(word(u, j));
    const float2 g = P::unpack(word(gyp, j));
    const float d0 = fmaf(-c.z, x.x, fmaf(c.y, w[2 * j], c.x * g.x));
    const float d1 = fmaf(-c.z, x.y, fmaf(c.y, w[2 * j + 1], c.x * g.y));
    set_word(o, j, P::pack(d0, d1));
    if constexpr (kDw) {
      dwt[2 * j] = fmaf(c.y, x.x, dwt[2 * j]);
      dwt[2 * j + 1] = fmaf(c.y, x.y, dwt[2 * j + 1]);
    }
  }
  return o;
}

// Ring layout (vectors_per_thread = kRingLayout): the shared-memory-resident kernel's arithmetic over a ring of
// R >= K + 2 row slots (as many as the device's shared memory holds, up to kRingMaxRows), so that up to R - (K + 2)
// rows of the tokens ahead stay in flight while a token's statistics, softmax and barriers run. The program's rows
// form one sequence (token-major: grad_out, the prefix, v_0 .. v_{K-1}), row s in slot s mod R. Every thread copies
// and reads only its own 16-byte vector of each slot, one cp.async group per row: when it has consumed row s
// (grad_out once unpacked, a candidate once its dv is computed) it issues row s + R into that slot and commits a
// group (an empty one past the program's last row), so before token t exactly R + t (K + 2) groups are committed
// and "all but the newest R - (K + 2) complete" means token t's rows have landed, with no barrier between threads.
// dw lives in FP64 registers (the shared-memory kernel's FP64 [H] row would take four of the ring's slots).
template <typename T, int MAXR>
__global__ void __launch_bounds__(kRingMaxThreads, 1) attn_res_bwd_ring_kernel(SingleReadBwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  using P = Pack<T>;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  const int K = static_cast<int>(a.K);
  const int nrows = K + 2;
  const int R = a.ring_rows;
  const int64_t H = a.H;
  const int nvec = static_cast<int>(H / kElemsPerVector);
  const int v = tid;
  const bool active = v < nvec;
  uint4* ring = reinterpret_cast<uint4*>(smem);
  double* red = reinterpret_cast<double*>(ring + static_cast<size_t>(R) * nvec);
  float4* coef_s = reinterpret_cast<float4*>(red + red_doubles(nwarps, MAXR));

  const int64_t t_begin = static_cast<int64_t>(blockIdx.x) * a.tokens_per_prog;
  const int64_t t_end = t_begin + a.tokens_per_prog < a.T ? t_begin + a.tokens_per_prog : a.T;
  const bool compute_dw = a.workspace != nullptr;

  // The issue cursor: the next row of the sequence to copy (token, row) and its slot.
  int64_t issue_t = t_begin;
  int issue_r = 0, issue_slot = 0;
  const auto issue_next = [&]() {
    if (issue_t < t_end && active)
      cp_async16(&ring[issue_slot * nvec + v], reinterpret_cast<const uint4*>(input_row<T>(a, issue_t, issue_r)) + v);
    cp_async_commit();
    if (++issue_r == nrows) {
      issue_r = 0;
      ++issue_t;
    }
    if (++issue_slot == R) issue_slot = 0;
  };
  // The first fill takes token 0's rows only, the rest of the ring once they have landed: every program fills at
  // once, so a whole ring's oldest rows would land about when its newest do (token 0 at 15-16 us on an H100 at any
  // T), while K + 2 rows per program land in a few; the ring's rest then streams under token 0's work and stores
  // (docs/kernels.md, "The backward at 1,024-4,096 tokens").
  for (int i = 0; i < nrows; ++i) issue_next();

  float w[kElemsPerVector];
  double dw[kElemsPerVector];
#pragma unroll
  for (int e = 0; e < kElemsPerVector; ++e) {
    const int64_t h = static_cast<int64_t>(v) * kElemsPerVector + e;
    w[e] = active ? load_weight(a.norm_weight, a.nw_dtype, h) * load_weight(a.proj_weight, a.pw_dtype, h) : 0.f;
    dw[e] = 0.0;
  }

  int base = 0;  // slot of token t's grad_out row
  for (int64_t t = t_begin; t < t_end; ++t) {
    const bool defer = t + 1 == t_end;  // the last token's stores come after the loop (after the barrier's arrival)
    if (t == t_begin) {
      cp_async_wait_all();  // token 0's rows (the only ones issued) have landed
      for (int i = nrows; i < R; ++i) issue_next();  // the ring's rest: R groups committed, as below
    } else {
      cp_async_wait_dyn(R - nrows);  // this thread's copies of token t's rows have landed
    }
    const auto slot = [&](int r) { return base + r < R ? base + r : base + r - R; };
    // grad_out stays packed (4 registers, unpacked where used: the 10-row variant spills with 8 floats).
    const uint4 gyp = active ? ring[base * nvec + v] : make_uint4(0u, 0u, 0u, 0u);
    issue_next();  // gy is in registers: its slot takes row s + R

    // Pass 1, as in the other layouts, each row loaded from its slot when it is needed.
#pragma unroll
    for (int r0 = 1; r0 < MAXR; r0 += kRowsPerGroup) {
      constexpr int kN = 8;
      float part[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) part[i] = 0.f;
#pragma unroll
      for (int dr = 0; dr < kRowsPerGroup; ++dr) {
        const int r = r0 + dr;
        if (r < MAXR && r < nrows) {
          const uint4 u = active ? ring[slot(r) * nvec + v] : make_uint4(0u, 0u, 0u, 0u);
          float* part3 = &part[3 * dr];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 x = P::unpack(word(u, j));
            const float2 g = P::unpack(word(gyp, j));
            part3[0] = fmaf(x.y, x.y, fmaf(x.x, x.x, part3[0]));
            part3[1] = fmaf(x.y, w[2 * j + 1], fmaf(x.x, w[2 * j], part3[1]));
            part3[2] = fmaf(x.y, g.y, fmaf(x.x, g.x, part3[2]));
          }
        }
      }
      store_group_totals<kN, MAXR>(part, lane, warp, r0, red);
    }
    __syncthreads();
    if (warp == 0) {
      const float3 c = softmax_backward_coefficients<MAXR>(red, nwarps, nrows, lane, H, a.eps);
      if (lane + 1 < nrows) coef_s[lane + 1] = make_float4(c.x, c.y, c.z, 0.f);
    }
    __syncthreads();

    // Pass 2: dv from the ring; each consumed slot takes its row R ahead at once.
    float dwt[kElemsPerVector];
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) dwt[e] = 0.f;
#pragma unroll
    for (int r = 1; r < MAXR; ++r) {
      if (r < nrows) {
        const float4 c = coef_s[r];
        if (active) {
          const uint4 u = ring[slot(r) * nvec + v];
          const uint4 o = dv_vector<T, true>(u, gyp, w, c, dwt);
          void* out = r == 1 ? a.grad_prefix : a.grad_blocks;
          if (out != nullptr && !defer) {
            T* dst = r == 1 ? static_cast<T*>(out) + t * H : static_cast<T*>(out) + (t * a.C + (r - 2)) * H;
            reinterpret_cast<uint4*>(dst)[v] = o;
          }
        }
        issue_next();  // o depends on u: the slot's load has completed before the copy overwrites it
      }
    }
    if (active) {
#pragma unroll
      for (int e = 0; e < kElemsPerVector; ++e) dw[e] += static_cast<double>(dwt[e]);
      if (a.grad_blocks && !defer) {
        for (int64_t c = K; c < a.C; ++c)
          reinterpret_cast<uint4*>(static_cast<T*>(a.grad_blocks) + (t * a.C + c) * H)[v] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    base = slot(nrows % R);
  }

  if (compute_dw && active) {
    double2* out = reinterpret_cast<double2*>(a.workspace + static_cast<int64_t>(blockIdx.x) * H +
                                              static_cast<int64_t>(v) * kElemsPerVector);
#pragma unroll
    for (int e = 0; e < kElemsPerVector; e += 2) out[e / 2] = make_double2(dw[e], dw[e + 1]);
  }
  // With the weight-gradient reduction in the kernel (a cooperative launch), its grid barrier is split: the
  // arrival's release makes this program's earlier stores visible before any program may pass, so it is issued as
  // soon as the dw partial is written, and the last token's dv and zero rows are stored between the arrival and the
  // wait. Otherwise the program that DRAM served slowest, whose arrival opens the barrier for every program, would
  // first wait for its last token's K + 1 stored rows (and C - K zero rows) to drain (docs/kernels.md, "The backward
  // at 1,024-4,096 tokens"). Without the reduction the stores simply come last.
  const bool folded = compute_dw && (a.grad_norm_weight != nullptr || a.grad_proj_weight != nullptr);
  cooperative_groups::grid_group::arrival_token arrival{};
  if (folded) arrival = cooperative_groups::this_grid().barrier_arrive();
  if (t_begin < t_end && active) {
    // Its coefficients are still in coef_s and its rows in the ring (nothing was issued past the program's last
    // row); dv_vector gives the bits the loop would have stored.
    const int64_t t = t_end - 1;
    const int last_base = (base - nrows % R + R) % R;
    const auto slot = [&](int r) { return last_base + r < R ? last_base + r : last_base + r - R; };
    const uint4 gyp = ring[last_base * nvec + v];
    float unused[kElemsPerVector];
#pragma unroll
    for (int r = 1; r < MAXR; ++r) {
      if (r < nrows) {
        const uint4 o = dv_vector<T, false>(ring[slot(r) * nvec + v], gyp, w, coef_s[r], unused);
        void* out = r == 1 ? a.grad_prefix : a.grad_blocks;
        if (out != nullptr) {
          T* dst = r == 1 ? static_cast<T*>(out) + t * H : static_cast<T*>(out) + (t * a.C + (r - 2)) * H;
          reinterpret_cast<uint4*>(dst)[v] = o;
        }
      }
    }
    if (a.grad_blocks) {
      for (int64_t c = K; c < a.C; ++c)
        reinterpret_cast<uint4*>(static_cast<T*>(a.grad_blocks) + (t * a.C + c) * H)[v] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  if (folded) {
    // Every program's partials are written (the barrier orders them before the reads): each program sums its share
    // of the columns over all programs' rows. The ring's slots are all consumed, so they hold the partials.
    cooperative_groups::this_grid().barrier_wait(std::move(arrival));
    reduce_weight_gradient(a, reinterpret_cast<double*>(smem));
  }
}

int rows_variant(int64_t K) {
  const int64_t nrows = K + 2;
  return nrows <= 3 ? 3 : nrows <= 6 ? 6 : nrows <= kSingleReadMaxRows ? kSingleReadMaxRows : 0;
}

// More than 48 KB of dynamic shared memory needs an opt-in per function and device. Raised only when a launch
// needs more than before on this device, so that warmed-up launches (e.g. under CUDA-graph capture) make no such
// call. One record per kernel function (a template argument of its own). (Concurrent first launches from several
// host threads may both set it: harmless.)
template <auto kernel>
cudaError_t raise_smem_limit(size_t smem) {
  constexpr int kMaxDevices = 64;
  static int opted_in[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices || static_cast<int>(smem) > opted_in[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    if (device < kMaxDevices) opted_in[device] = static_cast<int>(smem);
  }
  return cudaSuccess;
}

// The ring's slot count on the current device: as many rows as its per-block shared-memory opt-in holds beside the
// statistics, at most kRingMaxRows (read once per device).
int ring_rows_on_device(int64_t K, int64_t H) {
  constexpr int kMaxDevices = 64;
  static int optin[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  int limit = device < kMaxDevices ? optin[device] : 0;
  if (limit == 0) {
    if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
    if (device < kMaxDevices) optin[device] = limit;
  }
  return ring_rows_for(K, H, static_cast<size_t>(limit));
}

template <typename T, int VPT, int MAXR>
cudaError_t launch_typed(const SingleReadBwdArgs& a, int grid, cudaStream_t stream) {
  if constexpr (VPT == kRingLayout) {
    SingleReadBwdArgs ring = a;
    ring.ring_rows = ring_rows_on_device(a.K, a.H);
    if (ring.ring_rows < a.K + 2) return cudaErrorInvalidValue;
    const int threads = single_read_threads(a.H, 1);
    const size_t smem = ring_smem_bytes(a.K, a.H, ring.ring_rows);
    constexpr auto kernel = attn_res_bwd_ring_kernel<T, MAXR>;
    cudaError_t err = raise_smem_limit<kernel>(smem);
    if (err != cudaSuccess) return err;
    if (a.grad_norm_weight == nullptr && a.grad_proj_weight == nullptr) {
      kernel<<<grid, threads, smem, stream>>>(ring);
      return cudaGetLastError();
    }
    // The folded reduction's grid barrier needs every program resident at once: a cooperative launch (one program
    // per SM at most, so the grid always fits; the launch fails rather than hangs where it would not).
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute cooperative;
    cooperative.id = cudaLaunchAttributeCooperative;
    cooperative.val.cooperative = 1;
    config.attrs = &cooperative;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, ring);
  } else {
    const int threads = single_read_threads(a.H, VPT);
    const size_t smem = single_read_smem_bytes(a.K, a.H, a.io_dtype, VPT);
    constexpr auto kernel = VPT == 0 ? attn_res_bwd_single_read_smem_kernel<T, MAXR>
                                     : attn_res_bwd_single_read_kernel<T, VPT == 0 ? 1 : VPT, MAXR>;
    cudaError_t err = raise_smem_limit<kernel>(smem);
    if (err != cudaSuccess) return err;
    kernel<<<grid, threads, smem, stream>>>(a);
    return cudaGetLastError();
  }
}

template <typename T, int VPT>
cudaError_t launch_rows(const SingleReadBwdArgs& a, int grid, cudaStream_t stream) {
  switch (rows_variant(a.K)) {
    case 3: return launch_typed<T, VPT, 3>(a, grid, stream);
    case 6: return launch_typed<T, VPT, 6>(a, grid, stream);
    case kSingleReadMaxRows: return launch_typed<T, VPT, kSingleReadMaxRows>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_vpt(const SingleReadBwdArgs& a, int grid, cudaStream_t stream) {
  if (a.vectors_per_thread == 0) return launch_rows<T, 0>(a, grid, stream);
  if (a.vectors_per_thread == kRingLayout) return launch_rows<T, kRingLayout>(a, grid, stream);
  return a.vectors_per_thread == 1 ? launch_rows<T, 1>(a, grid, stream) : launch_rows<T, 2>(a, grid, stream);
}

}  // namespace

int single_read_threads(int64_t H, int vectors_per_thread) {
  if (H <= 0 || H % kElemsPerVector != 0 || vectors_per_thread < 0 || vectors_per_thread > kRingLayout) return 0;
  const bool ring = vectors_per_thread == kRingLayout;
  // The shared-memory-resident layouts: one vector each.
  if (vectors_per_thread == 0 || vectors_per_thread == kRingLayout) vectors_per_thread = 1;
  const int64_t nvec = H / kElemsPerVector;
  const int64_t threads = (nvec + vectors_per_thread - 1) / vectors_per_thread;
  const int64_t rounded = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
  const int64_t most = ring ? kRingMaxThreads : kMaxThreads / vectors_per_thread;
  return rounded <= most ? static_cast<int>(rounded) : 0;
}

size_t ring_smem_bytes(int64_t K, int64_t H, int ring_rows) {
  const int threads = single_read_threads(H, kRingLayout);
  const int maxr = rows_variant(K);
  if (threads == 0 || maxr == 0 || K < 1 || ring_rows < K + 2) return 0;
  const size_t nvec = static_cast<size_t>(H / kElemsPerVector);
  return static_cast<size_t>(ring_rows) * nvec * 16 + red_doubles(threads / kWarpSize, maxr) * sizeof(double) +
         static_cast<size_t>(maxr) * 16;
}

int ring_rows_for(int64_t K, int64_t H, size_t smem_limit) {
  const size_t fixed = ring_smem_bytes(K, H, static_cast<int>(K + 2));
  if (fixed == 0 || fixed > smem_limit) return 0;
  const size_t row = static_cast<size_t>(H / kElemsPerVector) * 16;
  const size_t rows = static_cast<size_t>(K + 2) + (smem_limit - fixed) / row;
  return static_cast<int>(rows < static_cast<size_t>(kRingMaxRows) ? rows : kRingMaxRows);
}

size_t single_read_smem_bytes(int64_t K, int64_t H, IoDtype io_dtype, int vectors_per_thread) {
  if (vectors_per_thread == kRingLayout)  // its least: one slot per row of a token (launches take what fits)
    return io_dtype == IoDtype::kFloat32 ? 0 : ring_smem_bytes(K, H, static_cast<int>(K + 2));
  const int threads = single_read_threads(H, vectors_per_thread);
  const int maxr = rows_variant(K);
  if (threads == 0 || maxr == 0 || K < 1 || io_dtype == IoDtype::kFloat32) return 0;
  const size_t nvec = static_cast<size_t>(H / kElemsPerVector);
  const size_t red = red_doubles(threads / kWarpSize, maxr) * sizeof(double);
  return (static_cast<size_t>(K) + 2) * nvec * 16 + kElemsPerVector * nvec * sizeof(double) +
         (vectors_per_thread == 0 ? red + maxr * 16 : 2 * red);
}

cudaError_t launch_single_read_bwd(const SingleReadBwdArgs& a, int grid, cudaStream_t stream) {
  if ((a.grad_norm_weight != nullptr || a.grad_proj_weight != nullptr) &&
      (a.vectors_per_thread != kRingLayout || a.workspace == nullptr))
    return cudaErrorInvalidValue;
  if (grid <= 0 || single_read_smem_bytes(a.K, a.H, a.io_dtype, a.vectors_per_thread) == 0) return cudaErrorInvalidValue;
  return a.io_dtype == IoDtype::kBFloat16 ? launch_vpt<__nv_bfloat16>(a, grid, stream)
                                          : launch_vpt<__half>(a, grid, stream);
}

}  // namespace k3_ops::cuda
