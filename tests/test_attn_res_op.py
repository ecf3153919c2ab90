"""The kimi_k3::attn_res contract on CPU (and on CUDA where present): opcheck, Meta metadata, numerics,
layouts, the unused-capacity rule, the Python API, and torch.compile / dynamic-shape behaviour."""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.optests import opcheck

import k3_ops
from k3_ops import reference
from k3_ops.testing import assert_close, error_stats

from conftest import SAMPLES, Sample, bits_equal, positional, sample_params

OP = torch.ops.kimi_k3.attn_res.default


def call(args: dict) -> torch.Tensor:
    return OP(args["prefix_sum"], args["block_residual"], args["norm_weight"], args["proj_weight"],
              args["num_valid_blocks"], args["eps"])


@pytest.mark.parametrize("sample", sample_params())
def test_opcheck(sample: Sample, device: str):
    # Default opcheck utils: schema, autograd registration, fake tensor, aot_dispatch (static and dynamic).
    opcheck(OP, positional(sample.make(device)))


@pytest.mark.parametrize("sample", sample_params())
def test_meta_output_matches_real_run(sample: Sample, device: str):
    args = sample.make(device)
    real = call(args)
    meta_args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    assert meta_args["block_residual"].stride() == args["block_residual"].stride()  # the view survives .to
    meta = call(meta_args)
    assert meta.device.type == "meta"
    assert (meta.shape, meta.dtype, meta.stride()) == (real.shape, real.dtype, real.stride())
    assert real.is_contiguous() and real.shape == (sample.T, sample.H) and real.dtype == sample.dtype


# Per-dtype tolerance against the float64 truth: one rounding of the output (half an ulp, relative) plus
# FP32 accumulation noise, which is far below that for bf16/fp16 and about 1e-6 relative for fp32. Outputs
# near zero come from cancellation between candidates of magnitude up to ~4, so the absolute part of the
# tolerance scales with that magnitude, not with the output.
TRUTH_RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2e-6, torch.float64: 1e-12}


@pytest.mark.parametrize("sample", sample_params())
def test_numerics_against_float64_truth(sample: Sample, device: str):
    args = sample.make(device)
    out = call(args)
    truth = reference.attn_res_truth(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()})
    rtol = TRUTH_RTOL[sample.dtype]
    assert_close(out, truth, atol=4 * rtol, rtol=rtol, what=sample.id)
    assert not out.isnan().any(), "NaN-poisoned capacity leaked into the output"


@pytest.mark.parametrize("sample", sample_params([s for s in SAMPLES if s.K < s.cap]))
def test_unused_capacity_is_never_read(sample: Sample, device: str):
    args = sample.make(device)  # slots >= K hold NaN
    poisoned = call(args)
    storage = args["block_residual"]
    zeroed = storage.clone()
    zeroed[:, sample.K:] = 0.0
    assert bits_equal(call({**args, "block_residual": zeroed}), poisoned)
    # The dtype's largest finite value: read, it would swamp the mix (fp16 cannot hold 1e30, and torch >= 2.15
    # refuses to store an overflowing scalar where 2.13 stored inf).
    huge = storage.clone()
    huge[:, sample.K:] = torch.finfo(storage.dtype).max
    assert bits_equal(call({**args, "block_residual": huge}), poisoned)


@pytest.mark.parametrize("sample", sample_params([s for s in SAMPLES if s.layout == "tokenmajor"]))
def test_block_major_view_equals_token_major(sample: Sample, device: str):
    tok = sample.make(device)
    blk = sample.with_(layout="blockmajor").make(device)
    assert blk["block_residual"].stride(0) <= blk["block_residual"].stride(1)  # really block-major
    assert bits_equal(call(blk), call(tok))


def test_strided_prefix_and_hidden_stride(device: str):
    s = Sample(T=5, K=3, cap=4, H=40, dtype=torch.float32)
    args = s.make(device)
    wide = torch.full((s.T, 2 * s.H), float("nan"), device=device, dtype=s.dtype)
    wide[:, ::2] = args["prefix_sum"]
    strided = wide[:, ::2]  # hidden stride 2
    assert not strided.is_contiguous()
    out = call({**args, "prefix_sum": strided})
    assert out.is_contiguous()
    assert bits_equal(out, call(args))


def test_zero_valid_blocks_returns_a_copy_of_prefix(device: str):
    s = Sample(T=4, K=0, cap=3, H=24, dtype=torch.bfloat16)
    args = s.make(device)
    args["prefix_sum"][0, 0] = 1e38  # a score that would overflow must not matter: the copy is exact
    out = call(args)
    assert bits_equal(out, args["prefix_sum"])
    assert out.data_ptr() != args["prefix_sum"].data_ptr()


def test_zero_tokens(device: str):
    args = Sample(T=0, K=2, cap=4, H=16, dtype=torch.float16).make(device)
    out = call(args)
    assert out.shape == (0, 16) and out.dtype == torch.float16 and out.device.type == torch.device(device).type


def test_weights_in_other_float_dtypes(device: str):
    s = Sample(T=3, K=2, cap=3, H=32, dtype=torch.float32)
    args = s.make(device)
    base = call(args)
    half_w = {**args, "norm_weight": args["norm_weight"].to(torch.bfloat16),
              "proj_weight": args["proj_weight"].to(torch.float16)}
    expect = reference.attn_res_reference(**{**half_w})
    assert_close(call(half_w), expect, atol=1e-6, rtol=1e-5, what="bf16/fp16 weights")
    assert error_stats(call(half_w), base).max_abs < 0.1  # same op, slightly different weights


class _RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, attr: str):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        setattr(self, attr, eps)


@pytest.mark.parametrize("eps_attr", ["variance_epsilon", "eps"])
def test_apply_attn_res_equals_attn_res(eps_attr: str, device: str):
    s = Sample(T=6, K=3, cap=5, H=64, dtype=torch.bfloat16)
    args = s.make(device)
    norm = _RMSNorm(args["norm_weight"], 1e-5, eps_attr)
    proj = torch.nn.Linear(s.H, 1, bias=False, device=device)
    with torch.no_grad():
        proj.weight.copy_(args["proj_weight"])
    with torch.no_grad():
        got = k3_ops.apply_attn_res(args["prefix_sum"], args["block_residual"], proj, norm, s.K)
        want = k3_ops.attn_res(args["prefix_sum"], args["block_residual"], norm.weight, proj.weight, s.K, 1e-5)
    assert bits_equal(got, want)


def test_apply_attn_res_needs_an_epsilon():
    s = Sample(T=2, K=1, cap=2, H=8, dtype=torch.float32)
    args = s.make()
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(args["norm_weight"])
    proj = torch.nn.Linear(s.H, 1, bias=False)
    with pytest.raises(TypeError, match=r"norm must carry its epsilon as \.variance_epsilon or \.eps"):
        k3_ops.apply_attn_res(args["prefix_sum"], args["block_residual"], proj, norm, 1)


# ---------------------------------------------------------------------------------------------- compile


def _mix_fn(prefix_sum, block_residual, norm_weight, proj_weight):
    # A residual add on each side makes the graph more than the bare op: the op must stay one node.
    return k3_ops.attn_res(prefix_sum + 1.0, block_residual, norm_weight, proj_weight, 2, 1e-6) * 2.0


def test_compile_default_backend_no_graph_break_no_recompile():
    explain = torch._dynamo.explain(_mix_fn)(**{k: v for k, v in Sample(T=5, K=2, cap=3, H=32, dtype=torch.float32)
                                                .make().items() if k not in ("num_valid_blocks", "eps")})
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_mix_fn, backend=counter, fullgraph=True, dynamic=True)
    for T in (2, 5, 17, 64):  # T = 1 is excluded: dynamic=True still specialises sizes 0 and 1
        args = Sample(T=T, K=2, cap=3, H=32, dtype=torch.float32).make(seed=T)
        args.pop("num_valid_blocks"), args.pop("eps")
        torch.testing.assert_close(compiled(**args), _mix_fn(**args), rtol=0, atol=0)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} compiles for 4 token counts"
