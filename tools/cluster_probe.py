"""Where the cluster kernel's time goes at decode sizes: its loads and its exchange, timed apart (H200 data in
docs/benchmarks.md, "Where the remaining gap goes").

The table's plain op at T <= 16, K = 5..8 is csrc_cuda/attn_res_cluster_kernel.h: a token over a cluster of 8 CTAs,
each holding 1/8 of the columns of every candidate row, exchanging per-candidate partial statistics through
distributed shared memory. This probe builds (torch.utils.cpp_extension.load_inline, sm_90) the same loads,
statistics and mix in forms that differ only in the exchange and in the order of the loads, and times them beside
the table and the floor kernel (k3_ops/bench/floor.py) in one run of the mix section (graph replay, NaN in unused
slots). Its statistics are the kernel's as they were before 1c4f5dc (plain warp butterflies, every thread
computing all scores): what it isolates is the exchange and the load order, not today's instruction count.
1c4f5dc kept the bits, so the exchanging forms still equal the table's output. Exchanges:

- ``pull``: the library's before the push exchange: each CTA writes its partials to its own shared memory,
  ``cluster.sync()``, every CTA reads all ranks' partials (DSMEM loads), and a second ``cluster.sync()`` before
  exit so that no CTA frees shared memory another still reads.
- ``push``: the library's now (attn_res_cluster_kernel.h, with its barrier helpers from attn_res_vec.h): each CTA stores
  its partials into every rank's inbox (DSMEM stores), then one split cluster barrier (arrive.release /
  wait.acquire) and only local reads after it, so no barrier at exit; the "every CTA has started" rule for DSMEM
  is a relaxed arrive at entry, waited for just before the remote stores (by then long satisfied). Same sums in
  the same order as ``pull``.
- ``none_cluster``: no exchange at all (each CTA's softmax over its own partials: wrong output, timing only), still
  launched as clusters of 8; ``none_grid``: the same without the cluster attribute (8 independent CTAs per token).

Loads: plain names convert each row right after its load, each in its own ``i < K`` branch (the library's kernel
before ``fetch8``); ``_batched`` issues every load (weights, rows, prefix) before converting any, as the library
does now. ``pull``, ``pull_batched`` and ``push_batched`` must equal the table's output bit for bit (checked).

Usage, on the GPU machine: python tools/cluster_probe.py [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from plan_variants import options, output_dir, save  # noqa: E402  (tools/, this script's directory)

from k3_ops.backends import cuda  # noqa: E402
from k3_ops.bench import floor, mix  # noqa: E402
from k3_ops.bench.common import Ops  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
#: name: (exchange mode, every load issued before any conversion)
MODES = {"pull": (0, False), "pull_batched": (0, True), "push_batched": (1, True), "none_cluster": (2, False),
         "none_grid": (3, False), "none_grid_batched": (3, True)}
CS = 8

_CUDA = r"""
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "attn_res_vec.h"
#include "kernel_launch.h"

namespace cg = cooperative_groups;
using namespace k3_ops::cuda::device;

constexpr int kMaxCand = 9;
constexpr int kCS = 8;

// MODE 0 pull, 1 push, 2 and 3 no exchange (3 is launched without clusters); kBatched: every load before any use.
template <int MODE, bool kBatched>
__global__ void __launch_bounds__(512) probe_kernel(const __nv_bfloat16* prefix, const __nv_bfloat16* blocks,
                                                    const __nv_bfloat16* nw, const __nv_bfloat16* pw,
                                                    __nv_bfloat16* out, int K, int H, int64_t stride_pt,
                                                    int64_t stride_bt, int64_t stride_bc, float eps) {
  const int rank = blockIdx.x % kCS;  // == cluster.block_rank() for clusters of kCS along x
  const int64_t t = blockIdx.x / kCS;
  const int vecs = H / 8 / kCS;
  const bool active = static_cast<int>(threadIdx.x) < vecs;
  const int64_t col = (static_cast<int64_t>(rank) * vecs + threadIdx.x) * 8;
  const int warps = (blockDim.x + 31) / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float warp_part[32][2 * kMaxCand];
  __shared__ float part[2 * kMaxCand];
  __shared__ float inbox[kCS][2 * kMaxCand];
  __shared__ float total[2 * kMaxCand];
  if constexpr (MODE == 1) cluster_arrive_relaxed();  // "this CTA runs": waited for before the first remote store
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  float x[kMaxCand][8];
  float w[8];
  if (active && kBatched) {
    // Every load issued before any conversion (attn_res_vec.h, fetch8).
    const Raw8<__nv_bfloat16> raw_nw = fetch8(nw + col), raw_pw = fetch8(pw + col);
    Raw8<__nv_bfloat16> raw[kMaxCand];
#pragma unroll
    for (int i = 0; i < kMaxCand - 1; ++i) {
      if (i < K) raw[i] = fetch8(blocks + t * stride_bt + i * stride_bc + col);
    }
    raw[kMaxCand - 1] = fetch8(prefix + t * stride_pt + col);
    float a[8], b[8];
    unpack8(raw_nw, a);
    unpack8(raw_pw, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = a[j] * b[j];
#pragma unroll
    for (int i = 0; i < kMaxCand; ++i) {
      if (i < K || i == kMaxCand - 1) unpack8(raw[i], x[i]);
    }
  } else if (active) {
    // Each row converted right after its load, in its own branch (the library's kernel before fetch8).
    float a[8], b[8];
    load8(nw + col, a);
    load8(pw + col, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = a[j] * b[j];
#pragma unroll
    for (int i = 0; i < kMaxCand - 1; ++i) {
      if (i < K) load8(blocks + t * stride_bt + i * stride_bc + col, x[i]);
    }
    load8(prefix + t * stride_pt + col, x[kMaxCand - 1]);
  }
  float ss[kMaxCand], d[kMaxCand];
#pragma unroll
  for (int i = 0; i < kMaxCand; ++i) {
    float s = 0.f, dd = 0.f;
    if (active && (i < K || i == kMaxCand - 1)) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s = fmaf(x[i][j], x[i][j], s);
        dd = fmaf(x[i][j], w[j], dd);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      s += __shfl_xor_sync(0xffffffffu, s, off);
      dd += __shfl_xor_sync(0xffffffffu, dd, off);
    }
    ss[i] = s;
    d[i] = dd;
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kMaxCand; ++i) {
      warp_part[warp][2 * i] = ss[i];
      warp_part[warp][2 * i + 1] = d[i];
    }
  }
  __syncthreads();
  float mine = 0.f;
  if (threadIdx.x < 2 * kMaxCand) {
    for (int q = 0; q < warps; ++q) mine += warp_part[q][threadIdx.x];
  }
  if constexpr (MODE == 0) {
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x < 2 * kMaxCand) part[threadIdx.x] = mine;
    cluster.sync();
    if (threadIdx.x < 2 * kMaxCand) {
      float s = 0.f;
#pragma unroll
      for (int r = 0; r < kCS; ++r) s += cluster.map_shared_rank(part, r)[threadIdx.x];
      total[threadIdx.x] = s;
    }
  } else if constexpr (MODE == 1) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster_wait_acquire();  // every CTA of the cluster has started: its shared memory may be written
    if (threadIdx.x < 2 * kMaxCand) {
#pragma unroll
      for (int r = 0; r < kCS; ++r) cluster.map_shared_rank(&inbox[rank][0], r)[threadIdx.x] = mine;
    }
    cluster_arrive_release();
    cluster_wait_acquire();  // every rank's partials are in this CTA's inbox; nobody touches it again
    if (threadIdx.x < 2 * kMaxCand) {
      float s = 0.f;
#pragma unroll
      for (int r = 0; r < kCS; ++r) s += inbox[r][threadIdx.x];
      total[threadIdx.x] = s;
    }
  } else {
    if (threadIdx.x < 2 * kMaxCand) total[threadIdx.x] = mine;
  }
  __syncthreads();
  const float inv_h = 1.0f / static_cast<float>(H);
  float score[kMaxCand];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxCand; ++i) {
    const bool valid = i < K || i == kMaxCand - 1;
    score[i] = valid ? __fdiv_rn(1.0f, __fsqrt_rn(total[2 * i] * inv_h + eps)) * total[2 * i + 1] : -INFINITY;
    m = fmaxf(m, score[i]);
  }
  float l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kMaxCand; ++i) {
    if (i < K || i == kMaxCand - 1) {
      const float p = __expf(score[i] - m);
      l += p;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = fmaf(p, x[i][j], acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = acc[j] / l;
  if (active) store8(out + t * H + col, acc);
  if constexpr (MODE == 0) cg::this_cluster().sync();
}

template <int MODE, bool kBatched>
void launch(const torch::Tensor& prefix, const torch::Tensor& blocks, const torch::Tensor& nw, const torch::Tensor& pw,
            torch::Tensor& out, int K, double eps) {
  const int T = static_cast<int>(prefix.size(0)), H = static_cast<int>(prefix.size(1));
  // MODE 3 runs the same kernel without clusters (its rank and token still read from blockIdx.x).
  k3_ops::cuda::KernelLaunch config(dim3(static_cast<unsigned>(T * kCS)),
                                    dim3(static_cast<unsigned>((H / 8 / kCS + 31) / 32 * 32)), 0,
                                    at::cuda::getCurrentCUDAStream());
  config.pdl(true);
  if (MODE != 3) config.cluster(kCS);
  auto bf = [](const torch::Tensor& x) { return reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()); };
  cudaError_t err = config.launch(probe_kernel<MODE, kBatched>, bf(prefix), bf(blocks), bf(nw), bf(pw),
                                  reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), K, H, prefix.stride(0),
                                  blocks.stride(0), blocks.stride(1), static_cast<float>(eps));
  TORCH_CHECK(err == cudaSuccess, "cluster probe launch: ", cudaGetErrorString(err));
}

void probe(torch::Tensor prefix, torch::Tensor blocks, torch::Tensor nw, torch::Tensor pw, torch::Tensor out,
           int64_t K, double eps, int64_t mode, bool batched) {
  const int k = static_cast<int>(K);
  if (batched) {
    switch (mode) {
      case 0: return launch<0, true>(prefix, blocks, nw, pw, out, k, eps);
      case 1: return launch<1, true>(prefix, blocks, nw, pw, out, k, eps);
      case 2: return launch<2, true>(prefix, blocks, nw, pw, out, k, eps);
      default: return launch<3, true>(prefix, blocks, nw, pw, out, k, eps);
    }
  }
  switch (mode) {
    case 0: return launch<0, false>(prefix, blocks, nw, pw, out, k, eps);
    case 1: return launch<1, false>(prefix, blocks, nw, pw, out, k, eps);
    case 2: return launch<2, false>(prefix, blocks, nw, pw, out, k, eps);
    default: return launch<3, false>(prefix, blocks, nw, pw, out, k, eps);
  }
}
"""

_CPP = ("void probe(torch::Tensor prefix, torch::Tensor blocks, torch::Tensor nw, torch::Tensor pw, "
        "torch::Tensor out, int64_t K, double eps, int64_t mode, bool batched);")


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("k3_cluster_probe", cpp_sources=_CPP, cuda_sources=_CUDA, functions=["probe"],
                       extra_include_paths=[os.path.join(ROOT, "csrc_cuda")],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "-std=c++17"], verbose=False)


def variants(ext) -> dict[str, Ops]:
    def op(mode: int, batched: bool):
        def attn_res(prefix, blocks, nw, pw, K, eps):
            # bf16 rows and weights, unit hidden stride, 16-byte aligned rows, H a multiple of 64 (the bench's).
            out = torch.empty(prefix.shape, dtype=prefix.dtype, device=prefix.device)
            ext.probe(prefix, blocks, nw.to(prefix.dtype), pw.reshape(-1).to(prefix.dtype), out, int(K), float(eps),
                      mode, batched)
            return out
        return attn_res

    probes = {n: Ops(attn_res=op(*m)) for n, m in MODES.items()}
    return {"table": Ops(attn_res=cuda.attn_res_forward), "floor": Ops(attn_res=floor.mix_floor), **probes}


def check(ops: dict[str, Ops]) -> list[dict]:
    """pull and push against the table (the library's cluster kernel at these shapes): equal bits."""
    rows = []
    for T, K in ((1, 8), (16, 5)):
        g = torch.Generator().manual_seed(T + 7 * K)
        blocks = torch.randn(T, 9, 7168, generator=g)
        blocks[:, K:] = float("nan")
        args = ((torch.randn(T, 7168, generator=g) * 1.5).cuda().bfloat16(), blocks.cuda().bfloat16(),
                (1 + 0.1 * torch.randn(7168, generator=g)).cuda().bfloat16(),
                (torch.randn(1, 7168, generator=g) * 2 / 7168**0.5).cuda().bfloat16(), K, 1e-6)
        assert cuda.choose_config(T, K, 7168, args[0].device).kernel == "cluster", (T, K)
        want = ops["table"].attn_res(*args)
        row = {"T": T, "K": K, **{n: bool(torch.equal(ops[n].attn_res(*args), want))
                                       for n in ("pull", "pull_batched", "push_batched")}}
        rows.append(row)
        print("equal bits to the table", row, flush=True)
    return rows


def main() -> None:
    out = output_dir(__doc__)
    ops = variants(build())
    checked = check(ops)
    result = mix.run(options(tokens=[1, 4, 16], blocks=[1, 4, 8]), ops=ops)
    result["equal_bits"] = checked
    save(result, os.path.join(out, "cluster_probe_mix.json"), "mix")


if __name__ == "__main__":
    main()
