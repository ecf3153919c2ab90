"""The FP32 1 / sqrt that the per-token kernel's scores and output norm take (kernels/attn_res_fwd.py, _rsqrt):
within 1 ulp of the true value at every class of input, and exactly the IEEE result at the edges (subnormal,
zero, infinity, NaN).

On a GPU machine the compiled kernel runs, so the bound is the hardware's approximate rsqrt after the Newton step
(its error alone is up to about 2.6 ulp, and 1 / sqrt_rn(x) with its two roundings up to 1.5); under the
interpreter (CPU) the same code runs on NumPy's rsqrt, which checks the edge handling and the step's arithmetic.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from k3_ops.kernels.attn_res_fwd import _rsqrt

from conftest import triton_interpreted

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreted()),
                                reason="needs an NVIDIA GPU or the Triton interpreter (TRITON_INTERPRET=1)")

FLT_MIN = 2.0 ** -126  # the smallest normal FP32 number


@triton.jit
def _rsqrt_probe(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, _rsqrt(tl.load(x_ptr + offs, mask=mask, other=1.0)), mask=mask)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    xd = x.to(device)
    y = torch.empty_like(xd)
    _rsqrt_probe[(triton.cdiv(x.numel(), 1024),)](xd, y, x.numel(), BLOCK=1024)
    return y.cpu()


def ulps(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|y - 1 / sqrt(x)| in units of the FP32 spacing at y (the truth in float64)."""
    truth = x.double().rsqrt()
    spacing = (torch.nextafter(y, torch.tensor(float("inf"))) - y).double()
    return (y.double() - truth).abs() / spacing


def sample_x() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mantissa = 1 + torch.rand(200_000, generator=g, dtype=torch.float64)
    exponent = torch.randint(-126, 127, (200_000,), generator=g).double()
    tiny = torch.randint(1, 2 ** 23, (20_000,), generator=g).double() * 2.0 ** -149  # subnormals
    edges = torch.tensor([FLT_MIN, FLT_MIN * (1 - 2 ** -23), 2.0 ** -149, 1.0, 2.0, 4.0, 1e-6, 1e-5 + 1e-30,
                          torch.finfo(torch.float32).max], dtype=torch.float64)
    return {"normal": (mantissa * 2 ** exponent).float(), "subnormal": tiny.float(), "edges": edges.float()}


@pytest.mark.parametrize("kind", ["normal", "subnormal", "edges"])
def test_rsqrt_within_one_ulp(kind):
    x = sample_x()[kind]
    err = ulps(rsqrt(x), x)
    assert bool((err <= 1.0).all()), f"{kind}: max {err.max().item():.3f} ulp at x = {x[err.argmax()].item()!r}"


def test_rsqrt_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -1.0, -float("inf")])
    y = rsqrt(x)
    assert y[:3].tolist() == [float("inf"), -float("inf"), 0.0], y  # IEEE: 1/sqrt(-0) = -inf
    assert bool(y[3:].isnan().all()), y
