"""Persistent thread-block clusters with a shared-memory ring: does the cluster kernel's design hold from 64 tokens
up, once its clusters stream tokens instead of taking one each?

The table's cluster kernel (csrc_cuda/attn_res_cluster_kernel.h) gives each token a cluster of CTAs that hold their
columns of every candidate row in registers and exchange per-candidate partial statistics (sum v^2, <v, w>)
through distributed shared memory. At T <= 64 it is the table's fastest plain op; from 128 tokens on it loses to
one program per token (the notes on the launch table's cluster entries in k3_ops/backends/cuda.py: T = 128, K = 8,
9.09 against 7.30 us), while the floor kernel that reads the same bytes (k3_ops/bench/floor.py) stays below both.
One token per cluster pays the whole chain (loads, statistics, exchange, mix, store) once per wave of clusters, at
the low occupancy of about 120 registers per thread. This probe builds (torch.utils.cpp_extension.load_inline,
sm_90) the same statistics, exchange and mix in a form that keeps the memory busy across tokens, and times it beside
the table, ``floor`` and ``floor_stream`` in one run of the mix section (graph replay, NaN in unused slots):

- ``ring_cs<CS>_s<S>``: as many clusters of CS CTAs as can be resident (``cudaOccupancyMaxActiveClusters``; the
  ``_x2`` form launches twice as many), at most one per token; cluster c mixes tokens c, c + clusters, ... in order.
  Each thread owns one 16-byte vector of every candidate row of its CTA's columns and copies the rows of its
  cluster's next tokens into a ring of S token slots in shared memory (cp.async, one commit group per token, the
  pattern of csrc_cuda/attn_res_stream.cu: each thread reads back only what it copied, so the ring needs no
  barrier), S tokens in flight while it waits and S - 1 while it mixes. Per token: the push exchange of the cluster
  kernel, one split cluster barrier, the inbox double-buffered by token parity.
- ``regs_cs<CS>``: the same clusters without the ring: each thread loads its vectors of the next token into
  registers before the exchange of the current one (one token ahead).
- ``mbar_ring_cs<CS>_s2``, ``mbar_regs_cs<CS>``: those forms with the exchange through transaction barriers: each
  partial a remote ``st.async`` that completes its bytes on the receiving CTA's mbarrier (one per inbox buffer,
  expecting CS x 2 (MB + 1) x 4 bytes a phase), the receiver waiting on its own barrier. The split cluster barrier
  they replace is a release: a fence over every earlier load and store of the thread (on sm_90 a ``MEMBAR`` at GPU
  scope, docs/benchmarks.md, "Where the fused call's time over the plain op goes"), so each token's exchange also
  waits for the previous token's output stores and, in the register form, for the next token's prefetch. The run of
  7df92d4 (docs/data/cluster_ring_probe_*_7df92d4.*) predates these forms.

Every form sums what the cluster kernel sums, in its order (the transposing warp sum of csrc_cuda/warp_reduce.h,
the warps in warp order, the ranks in rank order), and scores and mixes as it does; the accuracy rows record whether
an output equals the table's bits (the table runs other kernels at these shapes, so they need not).
Before timing, each form's output at every shape is checked against the float64 formula (k3_ops.reference): its
max-abs error must be at most 1.25 times the FP32 eager formula's; a form that fails is reported and not timed.
The JSON holds the timings, the error ratios and each kernel's registers, shared memory and resident clusters.

Usage, on the GPU machine: python tools/cluster_ring_probe.py [--out DIR]; RING_VARIANTS=a,b,... times only the
named forms (every form is built either way).
"""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

#: name: (CTAs per cluster, ring slots, variant (0 ring, 1 registers), clusters per resident cluster, exchange (0
#: one split cluster barrier per token, 1 transaction barriers: the ``mbar_`` forms))
VARIANTS = {"ring_cs8_s2": (8, 2, 0, 1, 0), "ring_cs8_s3": (8, 3, 0, 1, 0), "ring_cs8_s4": (8, 4, 0, 1, 0),
            "ring_cs4_s2": (4, 2, 0, 1, 0), "ring_cs4_s3": (4, 3, 0, 1, 0), "ring_cs8_s3_x2": (8, 3, 0, 2, 0),
            "regs_cs8": (8, 2, 1, 1, 0), "regs_cs4": (4, 2, 1, 1, 0),
            "mbar_ring_cs8_s2": (8, 2, 0, 1, 1), "mbar_ring_cs4_s2": (4, 2, 0, 1, 1),
            "mbar_regs_cs8": (8, 2, 1, 1, 1), "mbar_regs_cs4": (4, 2, 1, 1, 1)}
if os.environ.get("RING_VARIANTS"):
    _named = os.environ["RING_VARIANTS"].split(",")
    _unknown = [n for n in _named if n not in VARIANTS]
    if _unknown:
        raise SystemExit(f"RING_VARIANTS must name forms of {', '.join(VARIANTS)}, got {', '.join(_unknown)}")
    VARIANTS = {n: VARIANTS[n] for n in _named}
TOKENS = [64, 128, 256, 512, 1024, 4096]
BLOCKS = [4, 8]
H, CAPACITY, EPS = 7168, 9, 1e-6
#: The accuracy rule: max-abs error against the float64 formula at most FACTOR x the FP32 eager formula's
#: (SLACK where the eager error is exactly 0).
FACTOR, SLACK = 1.25, 1e-6

# The kernels and their launch, plain CUDA runtime (no torch headers): _BINDING turns tensors into these arguments.
_KERNELS = r"""
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attn_res_vec.h"
#include "kernel_launch.h"
#include "warp_reduce.h"

namespace ring_probe {

namespace cg = cooperative_groups;
using namespace k3_ops::cuda::device;

struct Args {
  const __nv_bfloat16* prefix;  // [T, H], unit hidden stride
  const __nv_bfloat16* blocks;  // [T, C, H] view, unit hidden stride; only slots < K are read
  const __nv_bfloat16* nw;      // [H]
  const __nv_bfloat16* pw;      // [H]
  __nv_bfloat16* out;           // [T, H] contiguous
  int64_t T, stride_pt, stride_bt, stride_bc;
  int K, H;
  float eps;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // .cg: cached in L2 only; each row is read once.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The transaction-barrier exchange (XCH 1) through attn_res_vec.h's helpers (smem_u32, map_rank, mbar_*,
// st_async_f32): each value is a remote st.async that completes bytes on the receiving CTA's mbarrier, so the
// receiver waits on its own barrier for exactly the bytes it expects, and no fence orders the sender's other memory
// operations (a barrier.cluster.arrive.release does: it is a MEMBAR over every earlier load and store, the previous
// token's output stores and the next token's prefetch included).

constexpr int threads_for(int CS) { return CS == 8 ? 128 : 256; }

// CS CTAs per cluster, S token slots in the ring (VAR 0) or registers one token ahead (VAR 1), MB block rows held
// (the prefix is candidate K, kept in slot MB); XCH 0: the exchange through one split cluster barrier per token,
// XCH 1: through transaction barriers (st.async into the inbox, the receiver's mbarrier counting the bytes).
template <int CS, int S, int MB, int VAR, int XCH>
__global__ void __launch_bounds__(threads_for(CS)) ring_kernel(Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  constexpr int kCand = MB + 1;
  constexpr int kParts = 2 * kCand;
  extern __shared__ uint4 ring[];  // [S][kCand][blockDim.x] 16-byte vectors (VAR 0)
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t c = blockIdx.x / CS, clusters = gridDim.x / CS;  // clusters <= T: every cluster has a token
  const int64_t count = (a.T - c + clusters - 1) / clusters;     // tokens c, c + clusters, ...: the same per rank
  const int vecs = a.H / 8 / CS;
  const int v = threadIdx.x;
  const bool active = v < vecs;
  const int64_t col = (static_cast<int64_t>(rank) * vecs + v) * 8;
  const int K = a.K;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float warp_part[32][kParts];
  // Rank r's (ss_i, d_i) of a token in inbox[token parity][r], stored by rank r. One cluster barrier per token
  // suffices with two buffers: rank r writes inbox[p] for token n + 2 only after its wait of token n + 1 returned,
  // which needs this CTA's arrive of token n + 1, issued (arrive.release: after its earlier reads too) once this
  // CTA has read inbox[p] for token n. Token n + 1's partials go to the other buffer, read by nobody for token n.
  __shared__ float inbox[2][CS][kParts];
  // One buffer each for warp_part and shared_score: a CTA barrier separates every write from the reads of the
  // token before (warp_part: the score barrier of token n; shared_score: the warp_part barrier of token n + 1).
  __shared__ float shared_score[kCand];
  // XCH 1: the barrier of inbox[p], one local arrival (with the expected bytes) per phase. Token n uses barrier
  // n & 1 in its phase n >> 1; the same double-buffering argument as the inbox's keeps a token's bytes out of the
  // other token's phase (rank r sends token n + 2 only after its wait for token n + 1, which needs this CTA's
  // token n + 1 bytes, sent after this CTA's wait for token n returned).
  __shared__ __align__(8) uint64_t xbar[2];
  auto cell = [&](int slot, int i) -> uint4& { return ring[(slot * kCand + i) * blockDim.x + v]; };
  auto token = [&](int64_t n) { return c + n * clusters; };
  auto valid = [&](int i) { return i < K || i == MB; };

  if constexpr (XCH == 1) {
    if (threadIdx.x == 0) {
      mbar_init(&xbar[0], 1);
      mbar_init(&xbar[1], 1);
      mbar_init_fence();  // the inits visible to the cluster before the arrive below
    }
    __syncthreads();
  }
  cluster_arrive_relaxed();  // "this CTA runs" (XCH 1: and its barriers are initialised): waited for before the
                             // first remote store
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();

  // The ring: token n's rows in slot n % S, one commit group per token (empty past the last token, so that every
  // thread's group count stays one per token). Slots >= K are never addressed.
  auto issue = [&](int64_t n) {
    if (active && n < count) {
      const int64_t t = token(n);
      const int slot = static_cast<int>(n % S);
#pragma unroll
      for (int i = 0; i < MB; ++i) {
        if (i < K) cp_async16(&cell(slot, i), a.blocks + t * a.stride_bt + i * a.stride_bc + col);
      }
      cp_async16(&cell(slot, MB), a.prefix + t * a.stride_pt + col);
    }
    cp_async_commit();
  };
  // Registers: token n's raw vectors.
  auto fetch = [&](int64_t n, Raw8<__nv_bfloat16> (&raw)[kCand]) {
    if (active) {
      const int64_t t = token(n);
#pragma unroll
      for (int i = 0; i < MB; ++i) {
        if (i < K) raw[i] = fetch8(a.blocks + t * a.stride_bt + i * a.stride_bc + col);
      }
      raw[MB] = fetch8(a.prefix + t * a.stride_pt + col);
    }
  };
  Raw8<__nv_bfloat16> cur[kCand], next[kCand];
  if constexpr (VAR == 0) {
#pragma unroll
    for (int n = 0; n < S - 1; ++n) issue(n);
  } else {
    fetch(0, cur);
  }
  float w[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (active) {
    float nw[8], pw[8];
    load8(a.nw + col, nw);
    load8(a.pw + col, pw);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = nw[j] * pw[j];
  }
  const float inv_h = 1.0f / static_cast<float>(a.H);

  int slot = 0;
  for (int64_t n = 0; n < count; ++n) {
    const int p = static_cast<int>(n & 1);
    if constexpr (VAR == 0) {
      // Slot (n + S - 1) % S held token n - 1, which this thread has mixed: refill it before waiting for token n,
      // so S tokens are in flight during the wait; then token n's group (the oldest of S) is complete.
      issue(n + S - 1);
      cp_async_wait<S - 1>();
    } else {
      if (n + 1 < count) fetch(n + 1, next);  // in flight across this token's exchange (the barriers' asm orders it)
    }
    auto row = [&](int i, float (&x)[8]) {
      if constexpr (VAR == 0) {
        load8(reinterpret_cast<const __nv_bfloat16*>(&cell(slot, i)), x);
      } else {
        unpack8(cur[i], x);
      }
    };
    float part[kParts];
#pragma unroll
    for (int i = 0; i < kCand; ++i) {
      float s = 0.f, d = 0.f;
      if (active && valid(i)) {
        float x[8];
        row(i, x);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          s = fmaf(x[j], x[j], s);
          d = fmaf(x[j], w[j], d);
        }
      }
      part[2 * i] = s;
      part[2 * i + 1] = d;
    }
    const float warp_total = warp_sum_transposed<kParts>(part, lane);
    const int part_index = butterfly_index<kParts>(lane);
    if (part_index < kParts) warp_part[warp][part_index] = warp_total;
    __syncthreads();
    float mine = 0.f;
    if (threadIdx.x < kParts) {
      for (int q = 0; q < warps; ++q) mine += warp_part[q][threadIdx.x];
    }
    if (n == 0) cluster_wait_acquire();  // every CTA of the cluster runs: its shared memory may be written
    if constexpr (XCH == 0) {
      if (threadIdx.x < kParts) {
#pragma unroll
        for (int r = 0; r < CS; ++r) cluster.map_shared_rank(&inbox[p][rank][0], r)[threadIdx.x] = mine;
      }
      cluster_arrive_release();
      cluster_wait_acquire();  // every rank's partials of token n are in inbox[p]
    } else {
      if (threadIdx.x == 0) mbar_expect_tx(&xbar[p], CS * kParts * 4);
      if (threadIdx.x < kParts) {
        const uint32_t mine_addr = smem_u32(&inbox[p][rank][threadIdx.x]), bar = smem_u32(&xbar[p]);
#pragma unroll
        for (int r = 0; r < CS; ++r) st_async_f32(map_rank(mine_addr, r), mine, map_rank(bar, r));
      }
      // Only the threads that read the inbox wait; the CTA barrier after the scores holds the others.
      if (threadIdx.x < kCand) mbar_wait(&xbar[p], static_cast<uint32_t>((n >> 1) & 1));
    }
    if (threadIdx.x < kCand) {
      const int i = static_cast<int>(threadIdx.x);
      float s = 0.f, d = 0.f;
#pragma unroll
      for (int r = 0; r < CS; ++r) {
        s += inbox[p][r][2 * i];
        d += inbox[p][r][2 * i + 1];
      }
      shared_score[i] = valid(i) ? __fdiv_rn(1.0f, __fsqrt_rn(s * inv_h + a.eps)) * d : -INFINITY;
    }
    __syncthreads();
    float score[kCand];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kCand; ++i) {
      score[i] = shared_score[i];
      m = fmaxf(m, score[i]);
    }
    float l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kCand; ++i) {
      if (valid(i)) {
        const float e = __expf(score[i] - m);
        l += e;
        if (active) {
          float x[8];
          row(i, x);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] = fmaf(e, x[j], acc[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = acc[j] / l;
    if (active) store8(a.out + token(n) * a.H + col, acc);
    if constexpr (VAR == 0) {
      slot = slot + 1 == S ? 0 : slot + 1;
    } else {
#pragma unroll
      for (int i = 0; i < kCand; ++i) cur[i] = next[i];
    }
  }
  if constexpr (VAR == 0) cp_async_wait<0>();  // the empty tail groups: nothing in flight at exit
  // No cluster barrier at exit: every remote store into this CTA's inbox was released before an arrive it waited for
  // (XCH 1: was counted by a barrier phase it waited for).
#endif
}

struct Plan {
  int threads = 0, smem = 0, max_clusters = 0;
  cudaError_t err = cudaSuccess;
};

// Threads, dynamic shared memory and resident clusters of one instantiation, resolved once (first call, before any
// graph capture) and cached.
template <int CS, int S, int MB, int VAR, int XCH>
const Plan& plan(int H) {
  static Plan cached;
  static int cached_h = 0;
  if (cached_h == H) return cached;
  Plan p;
  auto kernel = ring_kernel<CS, S, MB, VAR, XCH>;
  p.threads = (H / 8 / CS + 31) / 32 * 32;
  p.smem = VAR == 0 ? S * (MB + 1) * p.threads * 16 : 0;
  if (p.threads > threads_for(CS)) {
    p.err = cudaErrorInvalidValue;
  } else {
    p.err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem);
  }
  if (p.err == cudaSuccess) {
    k3_ops::cuda::KernelLaunch config(dim3(CS), dim3(p.threads), p.smem, nullptr);
    config.cluster(CS);
    p.err = cudaOccupancyMaxActiveClusters(&p.max_clusters, kernel, config.get());
    if (p.err == cudaSuccess && p.max_clusters < 1) p.err = cudaErrorInvalidConfiguration;
  }
  cached = p;
  cached_h = H;
  return cached;
}

template <int CS, int S, int MB, int VAR, int XCH>
cudaError_t launch(const Args& a, int factor, cudaStream_t stream) {
  const Plan& p = plan<CS, S, MB, VAR, XCH>(a.H);
  if (p.err != cudaSuccess) return p.err;
  if (a.T == 0) return cudaSuccess;
  const int64_t resident = static_cast<int64_t>(p.max_clusters) * factor;
  const int64_t clusters = a.T < resident ? a.T : resident;
  return k3_ops::cuda::KernelLaunch(dim3(static_cast<unsigned>(clusters * CS)), dim3(p.threads), p.smem, stream)
      .cluster(CS)
      .pdl(true)
      .launch(ring_kernel<CS, S, MB, VAR, XCH>, a);
}

// Registers, local memory (spills), static and dynamic shared memory, resident clusters.
template <int CS, int S, int MB, int VAR, int XCH>
cudaError_t describe(int H, int64_t (&info)[5]) {
  const Plan& p = plan<CS, S, MB, VAR, XCH>(H);
  if (p.err != cudaSuccess) return p.err;
  cudaFuncAttributes attr;
  const cudaError_t err = cudaFuncGetAttributes(&attr, ring_kernel<CS, S, MB, VAR, XCH>);
  if (err != cudaSuccess) return err;
  info[0] = attr.numRegs;
  info[1] = static_cast<int64_t>(attr.localSizeBytes);
  info[2] = static_cast<int64_t>(attr.sharedSizeBytes);
  info[3] = p.smem;
  info[4] = p.max_clusters;
  return cudaSuccess;
}

// The instantiations: (CS, S) of the ring forms, CS of the register form, each with 4 and 8 block rows, with the
// cluster-barrier exchange (XCH 0) and, for the 2-slot ring and the register form, the transaction-barrier one.
template <int MB>
cudaError_t run(const Args& a, int cs, int slots, int var, int xch, int factor, cudaStream_t stream,
                bool info_only, int64_t (&info)[5]) {
#define RING_CASE(CS_, S_, VAR_, XCH_)                                                                \
  if (cs == CS_ && (VAR_ == 1 || slots == S_) && var == VAR_ && xch == XCH_) {                        \
    return info_only ? describe<CS_, S_, MB, VAR_, XCH_>(a.H, info)                                   \
                     : launch<CS_, S_, MB, VAR_, XCH_>(a, factor, stream);                            \
  }
  RING_CASE(8, 2, 0, 0)
  RING_CASE(8, 3, 0, 0)
  RING_CASE(8, 4, 0, 0)
  RING_CASE(4, 2, 0, 0)
  RING_CASE(4, 3, 0, 0)
  RING_CASE(8, 2, 1, 0)
  RING_CASE(4, 2, 1, 0)
  RING_CASE(8, 2, 0, 1)
  RING_CASE(4, 2, 0, 1)
  RING_CASE(8, 2, 1, 1)
  RING_CASE(4, 2, 1, 1)
#undef RING_CASE
  return cudaErrorInvalidValue;
}

cudaError_t dispatch(const Args& a, int cs, int slots, int var, int xch, int factor, cudaStream_t stream,
                     bool info_only, int64_t (&info)[5]) {
  if (a.K < 1 || a.K > 8 || a.H % (8 * cs) != 0) return cudaErrorInvalidValue;
  if (a.K <= 4) return run<4>(a, cs, slots, var, xch, factor, stream, info_only, info);
  return run<8>(a, cs, slots, var, xch, factor, stream, info_only, info);
}

}  // namespace ring_probe
"""

_BINDING = r"""
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

namespace {
ring_probe::Args args_of(const torch::Tensor& prefix, const torch::Tensor& blocks, const torch::Tensor& nw,
                         const torch::Tensor& pw, torch::Tensor& out, int64_t K, double eps) {
  auto bf = [](const torch::Tensor& x) { return reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()); };
  return ring_probe::Args{bf(prefix), bf(blocks), bf(nw), bf(pw), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
                          prefix.size(0), prefix.stride(0), blocks.stride(0), blocks.stride(1), static_cast<int>(K),
                          static_cast<int>(prefix.size(1)), static_cast<float>(eps)};
}
}  // namespace

void ring_mix(torch::Tensor prefix, torch::Tensor blocks, torch::Tensor nw, torch::Tensor pw, torch::Tensor out,
              int64_t K, double eps, int64_t cs, int64_t slots, int64_t variant, int64_t exchange, int64_t factor) {
  int64_t info[5];
  const cudaError_t err = ring_probe::dispatch(args_of(prefix, blocks, nw, pw, out, K, eps), static_cast<int>(cs),
                                               static_cast<int>(slots), static_cast<int>(variant),
                                               static_cast<int>(exchange), static_cast<int>(factor),
                                               at::cuda::getCurrentCUDAStream(), false, info);
  TORCH_CHECK(err == cudaSuccess, "cluster ring probe launch (cs=", cs, ", slots=", slots, ", variant=", variant,
              ", K=", K, "): ", cudaGetErrorString(err));
}

std::vector<int64_t> ring_info(int64_t K, int64_t H, int64_t cs, int64_t slots, int64_t variant, int64_t exchange) {
  ring_probe::Args a = {};
  a.K = static_cast<int>(K);
  a.H = static_cast<int>(H);
  int64_t info[5] = {0, 0, 0, 0, 0};
  const cudaError_t err = ring_probe::dispatch(a, static_cast<int>(cs), static_cast<int>(slots),
                                               static_cast<int>(variant), static_cast<int>(exchange), 1, nullptr,
                                               true, info);
  TORCH_CHECK(err == cudaSuccess, "cluster ring probe info: ", cudaGetErrorString(err));
  return std::vector<int64_t>(info, info + 5);
}
"""

_CPP = ("void ring_mix(torch::Tensor prefix, torch::Tensor blocks, torch::Tensor nw, torch::Tensor pw, "
        "torch::Tensor out, int64_t K, double eps, int64_t cs, int64_t slots, int64_t variant, int64_t exchange, "
        "int64_t factor);\n"
        "std::vector<int64_t> ring_info(int64_t K, int64_t H, int64_t cs, int64_t slots, int64_t variant, "
        "int64_t exchange);")


def build():
    """The extension (cached by torch under its extensions directory: a second call with the same sources loads it)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline("k3_cluster_ring_probe", cpp_sources=_CPP, cuda_sources=_KERNELS + _BINDING,
                       functions=["ring_mix", "ring_info"], extra_include_paths=[os.path.join(ROOT, "csrc_cuda")],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "-std=c++17"], verbose=False)


def ring_op(ext, cs: int, slots: int, variant: int, factor: int, exchange: int):
    def attn_res(prefix, blocks, nw, pw, K, eps):
        # bf16 rows and weights, unit hidden stride, 16-byte aligned rows, H a multiple of 8 x cs (the bench's).
        out = torch.empty(prefix.shape, dtype=prefix.dtype, device=prefix.device)
        ext.ring_mix(prefix, blocks, nw.to(prefix.dtype), pw.reshape(-1).to(prefix.dtype), out, int(K), float(eps),
                     cs, slots, variant, exchange, factor)
        return out
    return attn_res


def kernel_info(ext) -> tuple[dict, list[str]]:
    """Per variant and block-row count (4: K <= 4, 8: K = 5..8): registers, spills, shared memory, clusters; and the
    variants that cannot launch (no resident cluster, a rejected attribute)."""
    info, broken = {}, []
    for name, (cs, slots, variant, factor, exchange) in VARIANTS.items():
        for K in (4, 8):
            try:
                regs, local, static_smem, dyn_smem, clusters = ext.ring_info(K, H, cs, slots, variant, exchange)
            except RuntimeError as e:
                print(f"{name} MB={K}: {e}", flush=True)
                info[f"{name}_mb{K}"] = {"error": str(e)}
                broken.append(name)
                continue
            info[f"{name}_mb{K}"] = {"registers": regs, "local_bytes": local, "static_smem": static_smem,
                                     "dynamic_smem": dyn_smem, "max_active_clusters": clusters,
                                     "clusters_launched": clusters * factor}
            print(f"{name} MB={K}: {regs} registers, {local} B local, {static_smem} B static + {dyn_smem} B dynamic "
                  f"shared memory per CTA, {clusters} clusters resident, {clusters * factor} launched (at most T)",
                  flush=True)
    return info, sorted(set(broken))


def max_abs_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    """Max |out - truth| in float64 on the device; NaN where out has a NaN (fails every comparison)."""
    diff = (out.to(torch.float64) - truth).abs()
    return float("nan") if bool(diff.isnan().any()) else float(diff.max())


def check(calls: dict) -> tuple[list[dict], list[str]]:
    """Each call's output at every (T, K) of the grid against the float64 formula, beside the FP32 eager formula's
    (both from k3_ops.reference), on token-major buffers of capacity 9 with NaN in slots >= K. Returns the rows and
    the names that fail anywhere. The table's ratio is recorded too (not a gate)."""
    from k3_ops import reference

    rows, failed = [], set()
    for K in BLOCKS:
        for T in TOKENS:
            g = torch.Generator(device="cuda").manual_seed(T + 7 * K)
            blocks = torch.randn(T, CAPACITY, H, generator=g, device="cuda").bfloat16()
            blocks[:, K:] = float("nan")
            prefix = (torch.randn(T, H, generator=g, device="cuda") * 1.5).bfloat16()
            nw = (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).bfloat16()
            pw = (torch.randn(1, H, generator=g, device="cuda") * 2 / H**0.5).bfloat16()
            args = (prefix, blocks, nw, pw, K, EPS)
            truth = reference.attn_res_truth(*args)
            eager = max_abs_error(reference.attn_res_reference(*args), truth)
            table = calls["table"](*args)
            row = {"T": T, "K": K, "eager_max_abs": eager}
            for name, fn in calls.items():
                try:
                    out = fn(*args)
                except RuntimeError as e:  # a launch the runtime rejects (not a fault: that would end the process)
                    row[name] = {"error": str(e), "ok": False, "ratio": float("nan")}
                    if name != "table":
                        failed.add(name)
                    continue
                err = max_abs_error(out, truth)
                ok = err <= FACTOR * eager + (SLACK if eager == 0 else 0.0)
                ratio = err / eager if eager > 0 else (0.0 if err == 0 else float("inf"))
                row[name] = {"max_abs": err, "ratio": ratio, "ok": bool(ok),
                             "equal_to_table": bool(torch.equal(out, table))}
                if not ok and name != "table":
                    failed.add(name)
            del truth, blocks
            torch.cuda.synchronize()
            rows.append(row)
            print(f"accuracy T={T} K={K} eager max_abs={eager:.3e} ratio (max-abs / eager's): "
                  + " ".join(f"{n}={row[n]['ratio']:.3f}{'' if row[n]['ok'] else ' FAIL'}" for n in calls),
                  flush=True)
    return rows, sorted(failed)


def print_table(result: dict) -> None:
    names = [c[0][3:] for c in result["columns"] if c[0].startswith("us:")]
    width = max(8, *(len(n) + 1 for n in names))
    print("us per call (CUDA-graph replay), token-major, bf16, H = 7168")
    print(f"{'T':>5} {'K':>2}" + "".join(f"{n:>{width}}" for n in names))
    for row in result["rows"]:
        print(f"{row['T']:>5} {row['K']:>2}" + "".join(f"{row.get('us:' + n, float('nan')):>{width}.2f}"
                                                         for n in names))


def main() -> None:
    from plan_variants import options, output_dir, save  # tools/, this script's directory

    from k3_ops.backends import cuda
    from k3_ops.bench import floor, mix
    from k3_ops.bench.common import Ops, k3_ops_ops

    out = output_dir(__doc__)
    ext = build()
    info, broken = kernel_info(ext)
    table = k3_ops_ops().attn_res
    rings = {name: ring_op(ext, *spec) for name, spec in VARIANTS.items() if name not in broken}
    with torch.no_grad():
        accuracy, failed = check({"table": table, **rings})
    failed = sorted(set(failed) | set(broken))
    for name in failed:
        print(f"{name} fails the accuracy rule or cannot launch: not timed", flush=True)
    ops = {"table": Ops(attn_res=table), "floor": Ops(attn_res=floor.mix_floor),
           "floor_stream": Ops(attn_res=floor.mix_floor_stream),
           **{n: Ops(attn_res=fn) for n, fn in rings.items() if n not in failed}}
    result = mix.run(options(tokens=TOKENS, blocks=BLOCKS), ops=ops)
    device = torch.device("cuda")
    result["table_plans"] = {f"T{T}-K{K}": repr(cuda.choose_config(T, K, H, device)) for T in TOKENS for K in BLOCKS}
    result["variants"] = {n: dict(zip(("cluster_size", "slots", "variant", "cluster_factor", "exchange"), s))
                          for n, s in VARIANTS.items()}
    result["kernels"] = info
    result["accuracy"] = {"rule": f"max_abs <= {FACTOR} x eager's (+{SLACK} where eager's is 0)", "rows": accuracy,
                          "failed": failed}
    save(result, os.path.join(out, "cluster_ring_probe_mix.json"), "ring")
    print_table(result)


if __name__ == "__main__":
    main()
