// The streaming forward of kimi_k3::attn_res for many tokens (sm_80+): persistent CTAs, two per SM, each streaming
// the candidate rows of its tokens through a ring of shared-memory row slots, one row at a time.
//
// Why: a fused call's epilogue (the output RMSNorm) needs the whole mixed row before it can scale any of it, so a
// Triton program holding a [next_pow2(H)] FP32 row per tile is register-bound: the rows kernel spills at 4 warps and
// loses bandwidth at 8 or 16 (docs/kernels.md, "Rows kernel (large T)" and "Streaming kernel (CUDA C++)"). Here each
// thread owns H / threads columns (V 16-byte vectors: 128 threads x 7 vectors at H = 7168), holds their folded
// weight and accumulator in registers and nothing else across rows; the output norm's weight waits in shared memory
// for the epilogue.
//
// Rows: the rows of the CTA's tokens (tokens b, b + grid, ...; per token the K block rows, the prefix row, the
// addend row) form one sequence; slot n % R takes row n. Each thread copies its own columns into the ring
// (cp.async) and reads back only those, so the ring needs no barrier, only each thread's cp.async.wait_group; a
// slot is refilled with the row R ahead as soon as its row is in registers, so R - 1 rows are always in flight.
//
// Per candidate (blocks 0..K-1, then the prefix): its partial statistics (sum v^2, <v, w>) over the warp, one CTA
// barrier, every thread sums the warps' partials in warp order (so every thread holds the same score), and an
// online softmax folds the row into the accumulator (rescaled only when the running max grows). Numerics: FP32;
// the score with correctly rounded sqrt and reciprocal. The plain op and the fused calls run the same arithmetic
// (kFused only compiles the fused code out), so a fused call's mix is the plain op's bit for bit.
//
// Nothing outlives a launch (no workspace): concurrent calls on any streams are independent. PDL: nothing is read
// before griddepcontrol.wait; dependents are released right after it.
#include <cuda_runtime.h>

#include <algorithm>

#include "attn_res_cluster.h"
#include "attn_res_vec.h"
#include "cp_async.h"
#include "kernel_launch.h"

namespace k3_ops::cuda {
namespace {

using namespace device;  // NOLINT: the shared vector helpers

// Threads per CTA at most, and CTAs per SM: 4 warps each, two CTAs per SM (255 registers per thread at most).
constexpr int kStreamThreads = 128;
constexpr int kStreamCtasPerSm = 2;
constexpr int kStreamWarps = kStreamThreads / 32;
// cp.async.wait_group takes an immediate: ring sizes up to this many slots.
constexpr int kStreamMaxSlots = 16;

// The row sequence of one CTA: row j of its it-th token (t = blockIdx.x + it * gridDim.x) is block j (j < K), the
// prefix (j = K) or the addend (j = K + 1).
template <typename IO>
struct RowStream {
  const IO* prefix;
  const IO* blocks;
  const IO* addend;
  int64_t stride_pt, stride_bt, stride_bc, stride_at;
  int K;

  __device__ __forceinline__ const IO* row(int64_t t, int j) const {
    if (j < K) return blocks + t * stride_bt + j * stride_bc;
    if (j == K) return prefix + t * stride_pt;
    return addend + t * stride_at;
  }
};

template <typename IO, int V, bool kFused>
__global__ void __launch_bounds__(kStreamThreads, kStreamCtasPerSm) attn_res_stream_kernel(ClusterFwdArgs a,
                                                                                          int slots) {
  // Dynamic shared memory: the ring, [slots][V][kStreamThreads] 16-byte vectors, then (output norm only) the
  // norm's weight as FP32, [V][kStreamThreads][8].
  extern __shared__ uint4 ring[];
  float* onw_smem = reinterpret_cast<float*>(ring + static_cast<size_t>(slots) * V * kStreamThreads);
  const int vecs = static_cast<int>(a.H / 8 / V);  // 8-element vectors per row and vector index q
  const int v = threadIdx.x;
  const bool active = v < vecs;
  const int K = static_cast<int>(a.K);
  const bool has_addend = kFused && a.addend != nullptr;
  const bool out_norm = kFused && a.out_norm_weight != nullptr;
  const int rows_per_token = K + 1 + (has_addend ? 1 : 0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t tokens = a.T > blockIdx.x ? (a.T - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  __shared__ float2 warp_part[2][kStreamWarps];  // by row parity: one barrier per row
  __shared__ float warp_norm[kStreamWarps];
  __shared__ float warp_amax[kStreamWarps];
  const RowStream<IO> rs{static_cast<const IO*>(a.prefix), static_cast<const IO*>(a.blocks),
                         static_cast<const IO*>(a.addend), a.stride_pt, a.stride_bt, a.stride_bc, a.stride_at, K};
  auto column = [&](int q) { return (static_cast<int64_t>(q) * vecs + v) * 8; };
  auto cell = [&](int slot, int q) -> uint4& { return ring[(slot * V + q) * kStreamThreads + v]; };

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
#endif

  // The next row to issue: token index, row index, slot.
  int64_t issue_it = 0;
  int issue_j = 0, issue_slot = 0;
  auto issue = [&]() {
    if (active && issue_it < tokens) {
      const IO* src = rs.row(blockIdx.x + issue_it * gridDim.x, issue_j);
#pragma unroll
      for (int q = 0; q < V; ++q) cp_async16(&cell(issue_slot, q), src + column(q));
    }
    cp_async_commit();  // empty groups past the last token keep one group per row
    if (++issue_j == rows_per_token) {
      issue_j = 0;
      ++issue_it;
    }
    if (++issue_slot == slots) issue_slot = 0;
  };
  for (int n = 0; n < slots; ++n) issue();

  // This thread's folded weight (nw * pw) in registers, its output-norm weight in shared memory: read once.
  float w[V][8];
#pragma unroll
  for (int q = 0; q < V; ++q) {
    float nw[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, pw[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (active) {
      load8_any(a.norm_weight, a.nw_dtype, column(q), nw);
      load8_any(a.proj_weight, a.pw_dtype, column(q), pw);
      if (out_norm) {
        float g[8];
        load8_any(a.out_norm_weight, a.onw_dtype, column(q), g);
        float4* dst = reinterpret_cast<float4*>(onw_smem + (q * kStreamThreads + v) * 8);
        dst[0] = make_float4(g[0], g[1], g[2], g[3]);
        dst[1] = make_float4(g[4], g[5], g[6], g[7]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) w[q][j] = nw[j] * pw[j];
  }
  const float inv_h = 1.0f / static_cast<float>(a.H);
  const float eps = static_cast<float>(a.eps);

  int slot = 0;  // the slot of the next row to consume
  int parity = 0;
  for (int64_t it = 0; it < tokens; ++it) {
    const int64_t t = blockIdx.x + it * gridDim.x;
    float acc[V][8];
    float m = 0.f, l = 0.f;
    for (int i = 0; i <= K; ++i) {
      const bool is_prefix = i == K;
      const bool two = is_prefix && has_addend;  // the prefix candidate takes the prefix and the addend rows
      cp_async_wait_dyn(two ? slots - 2 : slots - 1);
      const int next = slot + 1 == slots ? 0 : slot + 1;
      float x[V][8];
#pragma unroll
      for (int q = 0; q < V; ++q) {
        load8(reinterpret_cast<const IO*>(&cell(slot, q)), x[q]);
        if (two) {
          // round(prefix + addend): one FP32 add, one rounding to the io dtype, as torch's add.
          float add[8];
          load8(reinterpret_cast<const IO*>(&cell(next, q)), add);
#pragma unroll
          for (int j = 0; j < 8; ++j) x[q][j] = to_float(from_float<IO>(x[q][j] + add[j]));
        }
      }
      // The rows are in registers: their slots take the rows `slots` ahead.
      issue();
      if (two) issue();
      slot = two ? (next + 1 == slots ? 0 : next + 1) : next;
      if constexpr (kFused) {
        if (is_prefix && active) {
          // Each thread stores exactly the columns it has read: the in-place store races no read.
#pragma unroll
          for (int q = 0; q < V; ++q) {
            if (a.new_prefix != nullptr) store8(static_cast<IO*>(a.new_prefix) + t * a.H + column(q), x[q]);
            if (a.inplace_prefix && has_addend) {
              store8(const_cast<IO*>(rs.prefix) + t * a.stride_pt + column(q), x[q]);
            }
            if (a.write_idx >= 0) {
              store8(const_cast<IO*>(rs.blocks) + t * a.stride_bt + a.write_idx * a.stride_bc + column(q), x[q]);
            }
          }
        }
      }
      // Statistics: two chains each (even and odd vectors) for instruction-level parallelism.
      float s0 = 0.f, s1 = 0.f, d0 = 0.f, d1 = 0.f;
      if (active) {
#pragma unroll
        for (int q = 0; q < V; ++q) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (q % 2 == 0) {
              s0 = fmaf(x[q][j], x[q][j], s0);
              d0 = fmaf(x[q][j], w[q][j], d0);
            } else {
              s1 = fmaf(x[q][j], x[q][j], s1);
              d1 = fmaf(x[q][j], w[q][j], d1);
            }
          }
        }
      }
      float s = s0 + s1, d = d0 + d1;
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        s += __shfl_xor_sync(0xffffffffu, s, off);
        d += __shfl_xor_sync(0xffffffffu, d, off);
      }
      if (lane == 0) warp_part[parity][warp] = make_float2(s, d);
      __syncthreads();
      float ss = 0.f, dd = 0.f;
#pragma unroll
      for (int q = 0; q < kStreamWarps; ++q) {
        const float2 part = warp_part[parity][q];
        ss += part.x;
        dd += part.y;
      }
      parity ^= 1;
      const float score = __fdiv_rn(1.0f, __fsqrt_rn(ss * inv_h + eps)) * dd;
      // Online softmax (the branch is uniform: every thread holds the same score).
      if (i == 0) {
        m = score;
        l = 1.f;
#pragma unroll
        for (int q = 0; q < V; ++q) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[q][j] = x[q][j];
        }
      } else if (score > m) {
        const float alpha = __expf(m - score);
        m = score;
        l = fmaf(l, alpha, 1.f);
#pragma unroll
        for (int q = 0; q < V; ++q) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[q][j] = fmaf(acc[q][j], alpha, x[q][j]);
        }
      } else {
        const float p = __expf(score - m);
        l += p;
#pragma unroll
        for (int q = 0; q < V; ++q) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[q][j] = fmaf(p, x[q][j], acc[q][j]);
        }
      }
    }
    const float inv_l = __frcp_rn(l);
#pragma unroll
    for (int q = 0; q < V; ++q) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[q][j] *= inv_l;
    }

    if (out_norm) {
      float sq = 0.f;
      if (active) {
#pragma unroll
        for (int q = 0; q < V; ++q) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (a.norm_rounded_mix) acc[q][j] = to_float(from_float<IO>(acc[q][j]));
            sq = fmaf(acc[q][j], acc[q][j], sq);
          }
        }
      }
      sq = cta_sum(sq, warp_norm, kStreamWarps, lane, warp);
      // torch's rms_norm order, (y * rsqrt(mean(y^2) + eps)) * weight; the rsqrt correctly rounded.
      const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fdiv_rn(sq, static_cast<float>(a.H)) +
                                                     static_cast<float>(a.out_eps)));
      if (active) {
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const float4* src = reinterpret_cast<const float4*>(onw_smem + (q * kStreamThreads + v) * 8);
          const float4 g0 = src[0], g1 = src[1];
          const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[q][j] = acc[q][j] * scale * g[j];
        }
      }
    }
    if (kFused && a.fp8 != Fp8Kind::kNone) {
      float amax = 0.f;
#pragma unroll
      for (int q = 0; q < V; ++q) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[q][j] = to_float(from_float<IO>(acc[q][j]));
          amax = fmaxf(amax, fabsf(acc[q][j]));
        }
      }
      amax = cta_max(active ? amax : 0.f, warp_amax, kStreamWarps, lane, warp);
      const float fp8_max = static_cast<float>(a.fp8_max);
      const float scale = __fdiv_rn(fmaxf(amax, 1e-10f), fp8_max);
      if (active) {
#pragma unroll
        for (int q = 0; q < V; ++q) {
          uint32_t word[2] = {0u, 0u};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float y = __fdiv_rn(acc[q][j], scale);
            if (y == y) y = fminf(fmaxf(y, -fp8_max), fp8_max);
            word[j / 4] |= e4m3_bits(y, a.fp8 == Fp8Kind::kE4M3Fnuz) << (8 * (j % 4));
          }
          *reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.out) + t * a.H + column(q)) =
              make_uint2(word[0], word[1]);
        }
      }
      if (threadIdx.x == 0) a.scale[t] = scale;
    } else if (active) {
#pragma unroll
      for (int q = 0; q < V; ++q) store8(static_cast<IO*>(a.out) + t * a.H + column(q), acc[q]);
    }
  }
  cp_async_wait<0>();  // the empty tail groups: nothing in flight when the CTA's shared memory is released
}

// Vectors per thread and row: the fewest (of the compiled widths) that cover H with at most kStreamThreads
// threads; 0 when none does.
constexpr int kWidths[] = {1, 2, 4, 7, 8};

int vectors_per_thread(int64_t H) {
  for (int V : kWidths) {
    if (H % (8 * V) == 0 && H / 8 / V <= kStreamThreads) return V;
  }
  return 0;
}

int device_attribute(cudaDeviceAttr attr) {
  // Per device, read once (the launch path is host-time sensitive).
  constexpr int kMaxDevices = 64;
  static int cache[2][kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMaxDevices) return 0;
  const int which = attr == cudaDevAttrMultiProcessorCount ? 0 : 1;
  int& slot = cache[which][dev];
  if (slot == 0 && cudaDeviceGetAttribute(&slot, attr, dev) != cudaSuccess) slot = 0;
  return slot;
}

// Dynamic shared memory per CTA: kStreamCtasPerSm CTAs share an SM's (its per-block opt-in, less 1 KB each for
// the runtime and the static scratch).
int64_t smem_per_cta() {
  const int64_t per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  const int64_t per_block = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  return std::min(per_block, per_sm / kStreamCtasPerSm - 1024) - 1024;
}

// Ring slots: what is left of smem_per_cta beside the output norm's FP32 weight, at most kStreamMaxSlots; 0 when
// fewer than 3 (the prefix and addend rows together, and one in flight) fit.
int ring_slots(int64_t H, bool out_norm) {
  const int V = vectors_per_thread(H);
  if (V == 0) return 0;
  const int64_t slot_bytes = static_cast<int64_t>(V) * kStreamThreads * 16;
  const int64_t weight_bytes = out_norm ? static_cast<int64_t>(V) * kStreamThreads * 8 * 4 : 0;
  const int64_t slots = std::min<int64_t>(kStreamMaxSlots, (smem_per_cta() - weight_bytes) / slot_bytes);
  return slots >= 3 ? static_cast<int>(slots) : 0;
}

template <typename IO, int V, bool kFused>
cudaError_t launch(const ClusterFwdArgs& args, int slots, bool pdl, cudaStream_t stream) {
  auto kernel = attn_res_stream_kernel<IO, V, kFused>;
  const bool out_norm = kFused && args.out_norm_weight != nullptr;
  const size_t smem = static_cast<size_t>(slots) * V * kStreamThreads * 16 +
                      (out_norm ? static_cast<size_t>(V) * kStreamThreads * 8 * 4 : 0);
  // The dynamic shared memory limit, raised once per instantiation and device to the most any call needs.
  constexpr int kMaxDevices = 64;
  static size_t raised[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= kMaxDevices || raised[dev] < smem) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    if (dev < kMaxDevices) raised[dev] = smem;
  }
  const int64_t grid = std::min<int64_t>(args.T, kStreamCtasPerSm * device_attribute(cudaDevAttrMultiProcessorCount));
  return KernelLaunch(dim3(static_cast<unsigned>(grid)), dim3(kStreamThreads), smem, stream)
      .pdl(pdl)
      .launch(kernel, args, slots);
}

template <typename IO, bool kFused>
cudaError_t by_width(const ClusterFwdArgs& args, int slots, bool pdl, cudaStream_t stream) {
  switch (vectors_per_thread(args.H)) {
    case 1: return launch<IO, 1, kFused>(args, slots, pdl, stream);
    case 2: return launch<IO, 2, kFused>(args, slots, pdl, stream);
    case 4: return launch<IO, 4, kFused>(args, slots, pdl, stream);
    case 7: return launch<IO, 7, kFused>(args, slots, pdl, stream);
    default: return launch<IO, 8, kFused>(args, slots, pdl, stream);
  }
}

template <typename IO>
cudaError_t by_fused(const ClusterFwdArgs& args, int slots, bool pdl, cudaStream_t stream) {
  // As the cluster kernel: the plain op's calls take the instantiation without the fused code. The weights'
  // dtypes are read at run time (once per CTA).
  const bool fused = args.addend != nullptr || args.new_prefix != nullptr || args.inplace_prefix ||
                     args.write_idx >= 0 || args.out_norm_weight != nullptr || args.fp8 != Fp8Kind::kNone;
  return fused ? by_width<IO, true>(args, slots, pdl, stream) : by_width<IO, false>(args, slots, pdl, stream);
}

}  // namespace

int stream_fwd_threads(int64_t K, int64_t H, IoDtype io_dtype) {
  if (io_dtype == IoDtype::kFloat32 || K < 1 || K > kClusterMaxBlocks) return 0;
  if (vectors_per_thread(H) == 0 || ring_slots(H, true) == 0) return 0;
  return kStreamThreads;
}

cudaError_t launch_stream_fwd(const ClusterFwdArgs& args, bool pdl, cudaStream_t stream) {
  if (stream_fwd_threads(args.K, args.H, args.io_dtype) == 0) return cudaErrorInvalidValue;
  if (args.T == 0) return cudaSuccess;
  const int slots = ring_slots(args.H, args.out_norm_weight != nullptr);
  if (args.io_dtype == IoDtype::kBFloat16) return by_fused<__nv_bfloat16>(args, slots, pdl, stream);
  return by_fused<__half>(args, slots, pdl, stream);
}

}  // namespace k3_ops::cuda
