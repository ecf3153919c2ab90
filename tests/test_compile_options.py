"""Every Triton launch passes the shared compile options (``k3_ops.backends.TRITON_COMPILE_OPTIONS``).

The kernels' accuracy and speed were measured with FP fusion (FMA contraction) on, which is only Triton's default:
triton 3.9 warns that it turns off in 3.10. So each launch names it. Checked under the interpreter (which accepts
and drops these options) by recording the keyword arguments of every launch one call of each launch policy makes.
"""
from __future__ import annotations

import pytest
import torch

from k3_ops.backends import TRITON_COMPILE_OPTIONS

from conftest import Sample, grad_out_for, positional, requires_interpreter

pytestmark = [requires_interpreter, pytest.mark.interpreter]

SAMPLE = Sample(T=6, K=3, cap=5, H=40, dtype=torch.bfloat16)
FULL = [True, True, True, True]


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, dict]]:
    """(kernel name, launch keyword arguments) of every Triton launch made while the test runs."""
    from triton.runtime.interpreter import InterpretedFunction

    seen = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return seen


def _fused_args(args: dict) -> tuple:
    """fused_attn_res's positional arguments with every fused flag on: addend, snapshot into slot K, output norm."""
    g = torch.Generator().manual_seed(2)
    addend = torch.randn(SAMPLE.T, SAMPLE.H, generator=g).to(SAMPLE.dtype)
    out_norm_weight = 1.0 + 0.1 * torch.randn(SAMPLE.H, generator=g)
    return (args["prefix_sum"], addend, args["block_residual"], args["norm_weight"], args["proj_weight"], SAMPLE.K,
            SAMPLE.eps, SAMPLE.K, out_norm_weight, 1e-5)


def _cuda_backward(kernel: str):
    def call(args, gy):
        from k3_ops.backends import cuda

        return cuda.attn_res_backward(gy, *positional(args), FULL, config=cuda.BackwardConfig(kernel=kernel))

    return call


def _npu(fn_name: str, forward_kernel: str | None = None):
    def call(args, gy):
        from k3_ops.backends import npu

        with npu.substitute(num_vector_cores=lambda device: 3, forward_kernel=forward_kernel):
            if fn_name == "attn_res_backward":
                return npu.attn_res_backward(gy, *positional(args), FULL)
            if fn_name == "fused_attn_res":
                return npu.fused_attn_res(*_fused_args(args))
            return npu.attn_res_forward(*positional(args))

    return call


def _cuda_forward(path: str):
    def call(args, gy):
        from k3_ops.backends import cuda
        from k3_ops.backends._fused import FusedArgs

        config = cuda.LaunchConfig(kernel=path)
        cuda.attn_res_forward(*positional(args), config=config)
        plan = cuda.choose_config(SAMPLE.T, SAMPLE.K, SAMPLE.H, args["prefix_sum"].device, config)
        fused = FusedArgs.allocate(args["prefix_sum"], None, SAMPLE.K, None, SAMPLE.eps)[0]
        cuda.launch_forward(plan, args["prefix_sum"], args["block_residual"], args["norm_weight"],
                            args["proj_weight"], torch.empty_like(args["prefix_sum"]), SAMPLE.K, SAMPLE.eps, fused)
        return cuda.fused_attn_res(*_fused_args(args))

    return call


CALLS = {
    "npu-forward": _npu("attn_res_forward"),
    "npu-fused": _npu("fused_attn_res"),
    "npu-forward-two-pass": _npu("attn_res_forward", "two_pass"),
    "npu-fused-two-pass": _npu("fused_attn_res", "two_pass"),
    "npu-backward": _npu("attn_res_backward"),
    "cuda-backward-rows": _cuda_backward("rows"),
    "cuda-backward-stats-apply": _cuda_backward("stats_apply"),
    "cuda-backward-tiles": _cuda_backward("tiles"),
    **{f"cuda-forward-{path}": _cuda_forward(path) for path in ("token", "rows", "split", "tiles")},
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_every_launch_passes_the_shared_compile_options(launches, call):
    args = SAMPLE.make("cpu")
    call(args, grad_out_for(SAMPLE, "cpu"))
    assert launches, "no Triton launch recorded"
    missing = [(name, kw) for name, kw in launches
               if any(kw.get(key, object()) != value for key, value in TRITON_COMPILE_OPTIONS.items())]
    assert not missing, f"launches without {dict(TRITON_COMPILE_OPTIONS)}: {missing}"

