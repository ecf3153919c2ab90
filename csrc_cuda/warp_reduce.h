// The transposing warp sum shared by the CUDA C++ kernels (attn_res_bwd.cu's pass 1, attn_res_cluster_kernel.h's
// statistics): N per-lane values summed over the warp in about N shuffles instead of 5 N. Included by .cu files
// only (device code).
//
// At each level (lane offsets 16, 8, 4, 2, 1) a lane keeps half of the values it still holds (rounded up; an odd
// count is padded with a zero) and receives its partner's copies of them; once one value is left, plain butterfly
// levels finish. Every total equals the plain butterfly's (`s += shfl_xor(s, o)` for o = 16 .. 1) bit for bit: the
// same pairs of lanes are added at each level, and a + b == b + a.
#pragma once

namespace k3_ops::cuda::device {

// A register select the compiler cannot turn into a select of addresses: `c ? v[i] : v[j]` on a local array
// becomes a load from a run-time index, which puts the whole array in local memory.
__device__ __forceinline__ float select(bool c, float a, float b) {
  float r;
  asm("{\n .reg .pred p;\n setp.ne.s32 p, %3, 0;\n selp.f32 %0, %1, %2, p;\n}"
      : "=f"(r)
      : "f"(a), "f"(b), "r"(static_cast<int>(c)));
  return r;
}

// One level: the first n of v's values held, (n + 1) / 2 kept (in place, in v's first slots), exchanged with
// lane ^ OFFSET. A template per level, so that every loop has a compile-time trip count (a loop ptxas cannot fully
// unroll would index v at run time and put it in local memory). In place, not in a fresh array per level: for the
// backward's power-of-two counts the code is the one it was tuned with (an array per level cost it a spill).
template <int N, int n, int OFFSET>
__device__ __forceinline__ float butterfly_level(float (&v)[N], int lane) {
  if constexpr (n == 1) {
    float total = v[0];
#pragma unroll
    for (int offset = OFFSET; offset >= 1; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
    return total;
  } else {
    static_assert(OFFSET >= 1, "more than 32 values");
    constexpr int m = (n + 1) / 2;
    const bool upper = lane & OFFSET;
#pragma unroll
    for (int j = 0; j < m; ++j) {
      const float hi = j + m < n ? v[j + m] : 0.f;  // slots m .. n - 1 are read here only, never written
      const float send = select(upper, v[j], hi);
      const float keep = select(upper, hi, v[j]);
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, OFFSET);
    }
    return butterfly_level<N, m, OFFSET / 2>(v, lane);
  }
}

// This lane's total, of value index butterfly_index<N>(lane); v is overwritten.
template <int N>
__device__ __forceinline__ float warp_sum_transposed(float (&v)[N], int lane) {
  static_assert(N >= 1 && N <= 32, "N must be in [1, 32]");
  return butterfly_level<N, N, 16>(v, lane);
}

// The value index whose total warp_sum_transposed<N> leaves in this lane, or N where the lane holds only padding.
// Every index below N is held by 32 / N lanes when N is a power of two, by at least one lane otherwise. Two forms of
// one mapping: for a power of two no lane holds padding, and the plain bit sum keeps fewer registers live (the
// general form, which tracks how many of a lane's slots are real, cost the backward's 6-row variant a spill).
template <int N>
__device__ __forceinline__ int butterfly_index(int lane) {
  if constexpr ((N & (N - 1)) == 0) {
    int index = 0;  // the lane's bits at offsets 16 .. 32 / N, from the top
#pragma unroll
    for (int half = N / 2; half >= 1; half /= 2) {
      if (lane & (32 * half / N)) index += half;
    }
    return index;
  } else {
    int base = 0, count = N, n = N;  // the lane holds n slots, values base .. base + count - 1 in the first ones
#pragma unroll
    for (int offset = 16; n > 1; offset /= 2) {
      const int m = (n + 1) / 2;
      if (lane & offset) {
        base += m;
        count = count > m ? count - m : 0;
      } else {
        count = count < m ? count : m;
      }
      n = m;
    }
    return count >= 1 ? base : N;
  }
}

}  // namespace k3_ops::cuda::device
