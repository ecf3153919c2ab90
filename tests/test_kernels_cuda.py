"""The CUDA Triton kernels on a real GPU: opcheck, the accuracy contract up to T = 16384 on every path,
layouts, NaN-poisoned capacity, CUDA-graph replay, and PDL on == PDL off. Everything here skips with a reason
where there is no NVIDIA GPU.

On the GPU the fp32 -> bf16 store rounds to nearest even, so the contract is checked exactly as stated (no
interpreter allowance).
"""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.optests import opcheck

import k3_ops
from k3_ops import reference
from k3_ops.testing import assert_accuracy_contract

from conftest import Sample, requires_cuda, sample_params

pytestmark = [requires_cuda, pytest.mark.cuda]


def cuda_backend():
    from k3_ops.backends import cuda

    return cuda


def chunked(fn, args: dict, chunk: int = 2048) -> torch.Tensor:
    """A reference function over token chunks (bounds the [T, K+1, H] float64 intermediates)."""
    T = args["prefix_sum"].shape[0]
    parts = []
    for t0 in range(0, T, chunk):
        sl = dict(args, prefix_sum=args["prefix_sum"][t0:t0 + chunk],
                  block_residual=args["block_residual"][t0:t0 + chunk])
        parts.append(fn(**sl))
    return torch.cat(parts)


def check_contract(out: torch.Tensor, args: dict, what: str):
    assert out.is_cuda and out.is_contiguous() and out.dtype == args["prefix_sum"].dtype, what
    assert not out.isnan().any(), f"{what}: NaN in the output (NaN-poisoned capacity leaked?)"
    truth = chunked(reference.attn_res_truth, args)
    eager = chunked(reference.attn_res_reference, args)  # the FP32 eager formula on the GPU, rounded to dtype
    k, e = assert_accuracy_contract(out, eager, truth, what=what)
    print(f"{what}: kernel/eager max-abs {k.max_abs / max(e.max_abs, 1e-30):.3f} "
          f"mean-abs {k.mean_abs / max(e.mean_abs, 1e-30):.3f} ({k})")


@pytest.mark.parametrize("sample", sample_params())
def test_opcheck_cuda(sample):
    opcheck(torch.ops.kimi_k3.attn_res.default, tuple(sample.make(device="cuda").values()))


@pytest.mark.parametrize("sample", sample_params())
def test_dispatch_matches_reference(sample):
    args = sample.make(device="cuda")
    out = torch.ops.kimi_k3.attn_res(**args)
    if sample.dtype == torch.float64 or sample.K == 0:
        assert torch.equal(out, reference.attn_res_reference(**args))
    else:
        check_contract(out, args, f"dispatch:{sample.id}")


CONTRACT = [
    Sample(T=1, K=8, cap=9, H=7168),
    Sample(T=7, K=4, cap=8, H=7168),
    Sample(T=7, K=4, cap=8, H=7168, dtype=torch.float16),
    Sample(T=7, K=4, cap=8, H=7168, dtype=torch.float32),
    Sample(T=64, K=8, cap=9, H=7168),  # the cluster kernel, 2 CTAs per token
    Sample(T=2, K=2, cap=9, H=7168),  # the cluster kernel, 8 CTAs per token, its 2-block variant
    Sample(T=30, K=6, cap=9, H=7168, layout="blockmajor"),  # 4 CTAs per token, block-major rows
    Sample(T=512, K=8, cap=8, H=7168),  # one row, 3 stages, the prefix first
    Sample(T=300, K=12, cap=16, H=7168, layout="blockmajor"),  # one row, 4 stages, the prefix first
    Sample(T=1500, K=6, cap=9, H=7168, layout="blockmajor"),  # one row, 3 stages, the prefix first, above 512
    Sample(T=2500, K=10, cap=12, H=7168),  # the same at K = 9..16
    Sample(T=3000, K=3, cap=9, H=7168, layout="blockmajor"),  # the same at K = 3..4
    Sample(T=800, K=4, cap=5, H=7168, dtype=torch.float16),
    Sample(T=400, K=3, cap=9, H=7168, layout="blockmajor"),  # the one-tile plan at 257-512 tokens
    Sample(T=4096, K=2, cap=9, H=7168, layout="blockmajor"),
    Sample(T=16384, K=8, cap=8, H=7168),  # the streaming kernel
    Sample(T=5000, K=3, cap=4, H=7168, dtype=torch.float16, layout="blockmajor"),  # streaming, block-major
    Sample(T=16384, K=1, cap=9, H=7168, dtype=torch.float16),
    Sample(T=33, K=1, cap=2, H=33, dtype=torch.float16),
    Sample(T=100, K=64, cap=64, H=256, dtype=torch.float32),
]


@pytest.mark.parametrize("sample", sample_params(CONTRACT))
def test_accuracy_contract_default_table(sample):
    args = sample.make(device="cuda")
    check_contract(cuda_backend().attn_res_forward(**args), args, f"table:{sample.id}")


PATHS = {
    "token": dict(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1),  # the decode default, PDL on
    "token-1row-nopdl": dict(kernel="token", rows_per_tile=1, num_stages=1, pdl=False),
    "token-2row": dict(kernel="token", rows_per_tile=2, num_warps=8, num_stages=1),  # 65-128 tokens, K = 5..6
    "token-1row-prefix-first": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=3, prefix_first=True),
    # K = 9..16 at 129-512 tokens.
    "token-1row-s4-prefix-first": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=4, prefix_first=True),
    "token-8row": dict(kernel="token", rows_per_tile=8, num_warps=16, num_stages=1),
    "token-onetile": dict(kernel="token", rows_per_tile=0, num_warps=8),  # every block row in one tile
    "rows": dict(kernel="rows"),  # rows held in registers, one prefetched
    "rows-pipelined": dict(kernel="rows", prefetch=0, num_stages=4),  # cp.async stages in shared memory
    "rows-pipelined-8w": dict(kernel="rows", prefetch=0, num_stages=8, num_warps=8, ctas_per_sm=1),
    "split": dict(kernel="split"),
    # CUDA C++, a token over a thread-block cluster; shapes it cannot run (fp32, K > 8, H % 64) take the token path.
    "cluster8": dict(kernel="cluster", cluster_size=8),
    "cluster4": dict(kernel="cluster", cluster_size=4),
    "cluster2": dict(kernel="cluster", cluster_size=2),
    # CUDA C++, persistent CTAs streaming rows through a shared-memory ring; the same fallback rules.
    "stream": dict(kernel="stream"),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("sample", sample_params([
    Sample(T=1, K=4, cap=8, H=7168),
    Sample(T=9, K=8, cap=9, H=7168),
    Sample(T=16, K=15, cap=16, H=7168, dtype=torch.float32),
    Sample(T=30, K=3, cap=5, H=33, dtype=torch.float16, layout="blockmajor"),
    Sample(T=4096, K=8, cap=8, H=7168),
]))
def test_accuracy_contract_each_path(sample, path):
    cuda = cuda_backend()
    args = sample.make(device="cuda")
    out = cuda.attn_res_forward(**args, config=cuda.LaunchConfig(**PATHS[path]))
    check_contract(out, args, f"{path}:{sample.id}")


@pytest.mark.parametrize("T", [7, 512])
def test_block_major_equals_token_major(T):
    token = Sample(T=T, K=5, cap=8, H=7168).make(device="cuda")
    block = Sample(T=T, K=5, cap=8, H=7168, layout="blockmajor").make(device="cuda")
    assert block["block_residual"].stride(1) == T * 7168  # really block-major
    assert torch.equal(token["block_residual"][:, :5], block["block_residual"][:, :5])  # same values
    assert torch.equal(k3_ops.attn_res(**token), k3_ops.attn_res(**block))


def test_nan_capacity_and_prefix_untouched():
    args = Sample(T=7, K=3, cap=8, H=7168).make(device="cuda")
    before = args["block_residual"].clone(), args["prefix_sum"].clone()
    out = k3_ops.attn_res(**args)
    assert not out.isnan().any()
    assert torch.equal(args["block_residual"].view(torch.int16), before[0].view(torch.int16))
    assert torch.equal(args["prefix_sum"], before[1])


def test_large_offsets_use_64_bit_addressing():
    # T * token stride = 40000 * 9 * 7168 elements > 2^31: row offsets must be formed in int64.
    cuda = cuda_backend()
    s = Sample(T=40000, K=8, cap=9, H=7168)
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = torch.randn(s.T, s.cap, s.H, device="cuda", dtype=torch.bfloat16, generator=g)
    blocks[:, s.K:] = float("nan")
    prefix = torch.randn(s.T, s.H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(s.H, device="cuda", generator=g) * 0.02
    out = cuda.attn_res_forward(prefix, blocks, torch.ones_like(w), w, s.K, 1e-6)
    tail = slice(s.T - 8, s.T)
    expected = reference.attn_res_reference(prefix[tail], blocks[tail], torch.ones_like(w), w, s.K, 1e-6)
    torch.testing.assert_close(out[tail].float(), expected.float(), rtol=2 ** -7, atol=1e-5)
    assert not out.isnan().any()


def test_pdl_off_equals_on():
    # PDL changes when a launch may start, never what it computes: identical bits with it on and off.
    cuda = cuda_backend()
    for sample in (Sample(T=1, K=8, cap=9, H=7168), Sample(T=9, K=4, cap=8, H=7168, dtype=torch.float32),
                   Sample(T=600, K=2, cap=4, H=7168, dtype=torch.float16)):
        args = sample.make(device="cuda")
        for kernel in ("token", "rows", "cluster", "stream"):
            stages = 1 if kernel != "rows" else 3  # a second stage of fp32 [4, 8192] tiles exceeds shared memory
            on = cuda.attn_res_forward(**args, config=cuda.LaunchConfig(kernel=kernel, pdl=True, num_stages=stages))
            off = cuda.attn_res_forward(**args, config=cuda.LaunchConfig(kernel=kernel, pdl=False, num_stages=stages))
            assert torch.equal(on, off), f"{kernel}:{sample.id}"


@pytest.mark.parametrize("T,K", [(1, 8), (7, 4), (8, 1), (512, 8)])
def test_cuda_graph_replay(T, K):
    # Warm up (compiles every plan and caches its launch), capture one call on static buffers, replay it 3 times
    # with fresh inputs: each replay equals the eager call on the same inputs.
    H, cap = 7168, 9
    k3_ops.warmup(H, torch.bfloat16, "cuda", max_num_valid_blocks=8, max_num_tokens=1024)
    static = Sample(T=T, K=K, cap=cap, H=H).make(device="cuda", seed=0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = k3_ops.attn_res(**static)
    for seed in (1, 2, 3):
        fresh = Sample(T=T, K=K, cap=cap, H=H).make(device="cuda", seed=seed)
        for name, value in fresh.items():  # every tensor input, the weights included, into the static buffers
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, k3_ops.attn_res(**fresh)), f"replay with seed {seed} differs from eager"


def test_warmup_compiles_every_plan():
    cuda = cuda_backend()
    n = k3_ops.warmup(7168, torch.bfloat16, "cuda", max_num_valid_blocks=8, max_num_tokens=65536)
    device = torch.device("cuda", torch.cuda.current_device())
    assert n == len(cuda.warmup_plans(device, 7168, 8, 65536)) and n >= 2
    assert k3_ops.warmup(7168, torch.float64, "cuda") == 0
