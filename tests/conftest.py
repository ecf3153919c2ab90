"""Shared samples and device fixtures for every test module.

One ``Sample`` describes one call of kimi_k3::attn_res (and friends); the same samples feed the numerics
tests and ``torch.library.opcheck`` so the two can never drift apart. Unused buffer capacity
(slots >= num_valid_blocks) is always poisoned with NaN: a kernel that reads it fails loudly.

Devices are queried only inside fixtures and skip marks, never at import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

import k3_ops  # noqa: F401  (loads the kimi_k3 library)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True)
class Sample:
    """One attn_res call. ``layout`` is "tokenmajor" ([T, C, H] buffer) or "blockmajor" ([C, T, H] buffer
    passed as .transpose(0, 1))."""

    T: int
    K: int
    cap: int
    H: int
    dtype: torch.dtype = torch.bfloat16
    layout: str = "tokenmajor"
    proj_2d: bool = True  # proj_weight as an nn.Linear(H, 1) weight [1, H], else [H]
    eps: float = 1e-6

    @property
    def id(self) -> str:
        return f"T{self.T}-K{self.K}-cap{self.cap}-H{self.H}-{DTYPE_NAMES[self.dtype]}-{self.layout}"

    def with_(self, **kw) -> Sample:
        return replace(self, **kw)

    def make(self, device: str | torch.device = "cpu", seed: int = 0, requires_grad: bool = False) -> dict:
        """Tensors for this sample (keyword arguments of attn_res). Values are drawn on the CPU so that every
        device sees identical inputs; each block gets its own scale so the softmax is far from uniform."""
        g = torch.Generator().manual_seed(seed)
        T, K, C, H = self.T, self.K, self.cap, self.H
        scales = torch.tensor([0.5 + 0.25 * i for i in range(C)]).view(1, C, 1)
        blocks = torch.randn(T, C, H, generator=g) * scales
        prefix = torch.randn(T, H, generator=g) * 1.5
        norm_weight = 1.0 + 0.1 * torch.randn(H, generator=g)
        # Score spread ~ N(0, 2^2): s_i = <v_i / rms(v_i), w> with w ~ 2 / sqrt(H) per element.
        proj_weight = torch.randn(1, H, generator=g) * (2.0 / math.sqrt(H))
        if not self.proj_2d:
            proj_weight = proj_weight.reshape(H)
        blocks[:, K:] = float("nan")  # poison: slots >= K must never be read
        if self.layout == "blockmajor":
            # A real [C, T, H] allocation (.contiguous() would keep the strides of a T = 1 view as they are).
            storage = torch.empty((C, T, H), device=device, dtype=self.dtype)
            storage.copy_(blocks.transpose(0, 1))
            block_residual = storage.transpose(0, 1)
        elif self.layout == "tokenmajor":
            block_residual = blocks.to(device=device, dtype=self.dtype)
        else:
            raise ValueError(f"layout must be 'tokenmajor' or 'blockmajor', got {self.layout!r}")
        args = dict(
            prefix_sum=prefix.to(device=device, dtype=self.dtype),
            block_residual=block_residual,
            norm_weight=norm_weight.to(device=device, dtype=torch.float32),
            proj_weight=proj_weight.to(device=device, dtype=torch.float32),
            num_valid_blocks=K,
            eps=self.eps,
        )
        if requires_grad:
            for name in ("prefix_sum", "norm_weight", "proj_weight"):
                args[name].requires_grad_(True)
            args["block_residual"] = args["block_residual"].detach().requires_grad_(True)
        return args


def positional(args: dict) -> tuple:
    """attn_res's positional arguments from a ``Sample.make`` dict (opcheck takes positional args)."""
    return (args["prefix_sum"], args["block_residual"], args["norm_weight"], args["proj_weight"],
            args["num_valid_blocks"], args["eps"])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN), independent of dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def grad_out_for(sample: Sample, device, seed: int = 1) -> torch.Tensor:
    """An upstream gradient [T, H] for ``sample``, drawn on the CPU so every device sees the same values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sample.T, sample.H, generator=g).to(device=device, dtype=sample.dtype)


# The opcheck / numerics samples: numerics and opcheck tests share these inputs, and most test modules reuse them.
SAMPLES = [
    Sample(T=3, K=4, cap=8, H=7168, dtype=torch.bfloat16),  # the Kimi K3 hidden size
    Sample(T=5, K=2, cap=4, H=33, dtype=torch.float16),  # odd H, partial capacity
    Sample(T=7, K=3, cap=8, H=64, dtype=torch.float32, proj_2d=False),  # partial capacity, proj [H]
    Sample(T=4, K=8, cap=8, H=128, dtype=torch.bfloat16),  # full capacity
    Sample(T=3, K=0, cap=2, H=48, dtype=torch.float32),  # K = 0: out == prefix_sum
    Sample(T=6, K=3, cap=5, H=96, dtype=torch.bfloat16, layout="blockmajor"),  # block-major view
    Sample(T=1, K=5, cap=9, H=256, dtype=torch.float16),  # decode: one token
    Sample(T=3, K=2, cap=3, H=16, dtype=torch.float64),  # fp64 computes in fp64
]


def sample_params(samples=SAMPLES):
    return [pytest.param(s, id=s.id) for s in samples]


# torch.cuda.is_available() asks NVML / the driver only; it does not create a CUDA context.
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def device(request) -> str:
    """Every device kernel the machine has: CPU always, CUDA where a GPU is present."""
    return request.param


# --- Triton interpreter -----------------------------------------------------------------------------------
# TRITON_INTERPRET is read when @triton.jit decorates a kernel, i.e. when a kernel module is first imported;
# k3_ops never imports one at package import, so setting it here (before any test runs) is early enough.
# Only where there is no GPU: on a GPU machine the same suite must run the real compiled CUDA kernels.
def pytest_configure(config):
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_interpreted() -> bool:
    """True when Triton kernels in this process run under the interpreter (CPU tensors)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Interpreter-only tests (CPU tensors through Triton) skip on GPU machines, where the kernels are compiled for
# the GPU instead and the CUDA tests check the same launch policies on the real device.
requires_interpreter = pytest.mark.skipif(
    "os.environ.get('TRITON_INTERPRET', '0') != '1'",
    reason="Triton interpreter tests run only where TRITON_INTERPRET=1 (set by conftest when there is no GPU); "
           "on a GPU machine the CUDA tests cover these launch policies on the device")


# --- multi-process tests ----------------------------------------------------------------------------------------
def spawn_bounded(fn, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` spawned processes (torch.multiprocessing) and wait at most ``timeout_s``:
    past it every rank still alive is killed and the test fails naming ``what``, so a hung collective never hangs
    the suite. A rank that raises fails the test with its traceback (torch.multiprocessing's ProcessRaisedException)."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not finish in {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)  # reaped here, not left a zombie for the rest of the suite
