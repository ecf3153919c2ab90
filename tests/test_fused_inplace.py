"""The serving calls vLLM's Kimi K3 model makes: kimi_k3::fused_attn_res_ (the running residual updated in place),
fused_attn_res.quant (FP8 output) and the output norm's two rounding points (``round_mix``).

Contract (docs/fused_attn_res.md, "The in-place serving call", "FP8 output"), checked on every device kernel:
- prefix_sum afterwards is torch's own ``prefix_sum + addend`` bit for bit (under the interpreter bf16 stores
  truncate: either rounding of the exact FP32 sum), and is not written without an addend; the snapshot row is it
  bit for bit; every other byte of the buffer (NaN-poisoned capacity) and the addend's storage are untouched;
- round_mix=True: out is the out-of-place fused_attn_res's out; round_mix=False: out is the RMSNorm of the FP32
  mix, held to the accuracy contract against a float64 truth;
- FP8: (q, scale) are the per-token quantisation of the same call's unquantised out, bit for bit (the kernels
  convert to e4m3 themselves: tested against torch's conversion on every class of value).
Plus opcheck, FakeTensor metadata, bad input (eager and FakeTensor, nothing written), the grad refusal, the version
counters, and torch.compile (fullgraph, no buffer or prefix copy in Inductor's code).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.optests import opcheck

import k3_ops
from k3_ops import reference
from k3_ops.testing import assert_accuracy_contract

from conftest import DTYPE_NAMES, Sample, requires_cuda, requires_interpreter
from test_fused import FusedCase, _truncate_to_bf16, bits, storage_bytes
from test_npu_simulated import NpuTensor, simulated_npu  # noqa: F401  (the fixture)

OP = torch.ops.kimi_k3.fused_attn_res_.default
QUANT = torch.ops.kimi_k3.fused_attn_res.quant
FUSED = torch.ops.kimi_k3.fused_attn_res.default
POSITIONAL = [a.name for a in OP._schema.arguments if not a.kwarg_only]
FP8_NAMES = {None: "bf", torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}


@dataclass(frozen=True)
class ServingCase:
    """One serving call: a ``FusedCase`` (tensors, addend, snapshot slot, output norm, strided views) plus the
    output norm's rounding point and the FP8 output dtype."""

    fused: FusedCase
    round_mix: bool = False  # vLLM's rounding point; True is fused_attn_res's
    out_dtype: torch.dtype | None = None

    @property
    def base(self) -> Sample:
        return self.fused.base

    @property
    def id(self) -> str:
        out = "out_" + (FP8_NAMES[self.out_dtype] if self.out_dtype else DTYPE_NAMES[self.base.dtype])
        return f"{self.fused.id}-{'roundmix' if self.round_mix else 'fp32mix'}-{out}"

    def make(self, device) -> dict:
        return self.fused.make(device)

    def kwargs(self) -> dict:
        return dict(out_dtype=self.out_dtype, round_mix=self.round_mix)


def positional(args: dict) -> tuple:
    return tuple(args[name] for name in POSITIONAL)


def run_inplace(case: ServingCase, args: dict, fn=None):
    return (fn or OP)(*positional(args), **case.kwargs())


def S(T, K, cap, H, dtype=torch.bfloat16, **kw):
    return Sample(T=T, K=K, cap=cap, H=H, dtype=dtype, **kw)


# Every flag on and off across the cases: addend, snapshot, output norm (own eps / defaulted), rounding point, FP8
# format, strided views, block-major buffer, K = 0, full capacity, odd H, one token, fp64 (the reference path) and
# an empty batch.
CASES = [
    ServingCase(FusedCase(S(5, 3, 5, 64), norm="own")),  # vLLM's pre-attention call: add, snapshot, FP32-mix norm
    ServingCase(FusedCase(S(5, 3, 5, 64), norm="own"), round_mix=True),
    ServingCase(FusedCase(S(4, 2, 4, 33, torch.float16), write="none", norm="eps", views=True),
                out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(3, 2, 3, 48, torch.float32, proj_2d=False), write="last", norm="own"),
                out_dtype=torch.float8_e4m3fnuz),
    ServingCase(FusedCase(S(6, 3, 5, 96, layout="blockmajor"), norm="own"), out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(3, 0, 2, 32), addend=False, norm="own")),  # first layer: K = 0, snapshot, no add
    ServingCase(FusedCase(S(3, 4, 4, 40, torch.float16), write="none", norm="none"), out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(1, 5, 9, 256), addend=False, write="none", norm="own"), round_mix=True,
                out_dtype=torch.float8_e4m3fnuz),
    ServingCase(FusedCase(S(4, 3, 5, 64), write="none", norm="none")),  # the final mix: add only
    ServingCase(FusedCase(S(3, 2, 3, 16, torch.float64), norm="own"), out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(0, 1, 3, 40), norm="own"), out_dtype=torch.float8_e4m3fn),
]


def case_params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


# --- the contract, shared by every device and policy --------------------------------------------------------
def check_serving(case: ServingCase, before: dict, after: dict, out: torch.Tensor, scale: torch.Tensor,
                  unquantised=None, truncating_bf16: bool = False) -> None:
    """``before``: clones of the call's tensors; ``after``: the call's own tensors. ``unquantised``: a function
    that runs the same call (fresh tensors) without the FP8 output, for the FP8 bit-exactness check."""
    T, H, dtype = case.base.T, case.base.H, case.base.dtype
    prefix, buf = after["prefix_sum"], after["block_residual"]
    # prefix_sum: torch's own add (the interpreter's truncating bf16 store: its truncation), never written
    # without an addend.
    if case.fused.addend:
        expected = before["prefix_sum"] + before["addend"]
        if not torch.equal(bits(prefix), bits(expected)):
            assert truncating_bf16 and dtype == torch.bfloat16, f"{case.id}: prefix_sum != prefix_sum + addend"
            exact = before["prefix_sum"].float() + before["addend"].float()
            assert torch.equal(bits(prefix), bits(_truncate_to_bf16(exact))), f"{case.id}: prefix_sum wrong"
        assert torch.equal(storage_bytes(after["addend"]), storage_bytes(before["addend"])), "addend was written"
    else:
        assert torch.equal(storage_bytes(prefix), storage_bytes(before["prefix_sum"])), "prefix_sum was written"
    idx = case.fused.write_idx
    others = [i for i in range(case.base.cap) if i != idx]
    assert torch.equal(bits(buf[:, others]), bits(before["block_residual"][:, others])), (
        f"{case.id}: bytes outside the snapshot slot changed")
    if idx >= 0:
        assert torch.equal(bits(buf[:, idx]), bits(prefix)), f"{case.id}: snapshot row != the updated prefix_sum"
    # Outputs: shapes, dtypes, layouts, no aliasing.
    assert out.shape == (T, H) and out.dtype == (case.out_dtype or dtype) and out.is_contiguous()
    if case.out_dtype is None:
        assert scale.shape == (0,) and scale.dtype == torch.float32
    else:
        assert scale.shape == (T, 1) and scale.dtype == torch.float32 and scale.is_contiguous()
    if T:
        ptrs = {t.untyped_storage().data_ptr() for t in (prefix, buf)}
        assert out.untyped_storage().data_ptr() not in ptrs
    if case.out_dtype is not None and unquantised is not None:
        y = unquantised()
        q_ref, scale_ref = reference.fp8_quant_reference(y.cpu(), case.out_dtype)
        assert torch.equal(scale.cpu(), scale_ref), f"{case.id}: scale != max(amax, 1e-10) / fp8_max of the output"
        assert torch.equal(out.cpu().view(torch.uint8), q_ref.view(torch.uint8)), (
            f"{case.id}: FP8 bits != torch's conversion of clamp(out / scale)")
    elif case.out_dtype is None:
        assert not out.isnan().any(), f"{case.id}: NaN in out (poisoned capacity read?)"


def snapshot_args(args: dict) -> dict:
    """Byte-exact copies to compare against afterwards (the addend with its whole storage)."""
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    if args["addend"] is not None:
        storage = storage_bytes(args["addend"])
        before["addend"] = torch.empty(0, dtype=args["addend"].dtype, device=args["addend"].device).set_(
            storage.untyped_storage(), args["addend"].storage_offset(), args["addend"].size(), args["addend"].stride())
    return before


# --- the op on every device (CPU here; CUDA on a GPU) -----------------------------------------------------
@pytest.mark.parametrize("case", case_params(CASES))
def test_inplace_contract(case: ServingCase, device: str):
    args = case.make(device)
    before = snapshot_args(args)
    versions = (args["prefix_sum"]._version, args["block_residual"]._version)
    out, scale = run_inplace(case, args)

    def unquantised():
        again = case.make(device)
        return run_inplace(replace(case, out_dtype=None), again)[0]

    check_serving(case, before, args, out, scale, unquantised)
    assert args["prefix_sum"]._version > versions[0] and args["block_residual"]._version > versions[1], (
        "the in-place op must bump the version counters of prefix_sum and block_residual")


@pytest.mark.parametrize("case", case_params([c for c in CASES if c.base.T and c.base.dtype != torch.float64]))
def test_round_mix_true_is_fused_attn_res(case: ServingCase, device: str):
    """round_mix=True: the in-place call's outputs are the out-of-place fused_attn_res's: bit for bit on the CPU;
    on a GPU within one output ulp (the serving calls run the token or rows kernel, fused_attn_res may take the split
    path, whose sums run in another order)."""
    case = replace(case, round_mix=True, out_dtype=None)
    args = case.make(device)
    oop_args = case.make(device)
    out, _ = run_inplace(case, args)
    want, new_prefix = FUSED(*positional(oop_args))
    assert torch.equal(bits(args["prefix_sum"]), bits(new_prefix))
    if device == "cpu":
        assert torch.equal(bits(out), bits(want)), f"{case.id}: in-place out != fused_attn_res out"
    else:
        tol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[case.base.dtype]
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol, msg=case.id)


@pytest.mark.parametrize("case", case_params([c for c in CASES if c.fused.norm != "none" and c.base.T]))
def test_fp32_mix_norm_accuracy(case: ServingCase, device: str):
    """round_mix=False: the RMSNorm of the FP32 mix, held to the accuracy contract against the float64 truth
    (the norm of the unrounded float64 mix), with the FP32 PyTorch formula as the yardstick."""
    case = replace(case, round_mix=False, out_dtype=None)
    args = case.make(device)
    before = snapshot_args(args)
    out, _ = run_inplace(case, args)
    new_prefix = args["prefix_sum"].cpu()
    blocks, nw, pw = (before[k].cpu() for k in ("block_residual", "norm_weight", "proj_weight"))
    onw = before["out_norm_weight"].cpu()
    eps, K = case.base.eps, case.base.K
    norm_eps = eps if args["out_norm_eps"] is None else args["out_norm_eps"]
    truth_mix = reference.attn_res_truth(new_prefix, blocks, nw, pw, K, eps)
    truth = truth_mix * torch.rsqrt(truth_mix.square().mean(-1, keepdim=True) + norm_eps) * onw.double()
    eager = reference.fused_attn_res_inplace_reference(new_prefix.clone(), None, blocks.clone(), nw, pw, K, eps, -1,
                                                       onw, args["out_norm_eps"], round_mix=False)[0]
    assert_accuracy_contract(out.cpu(), eager, truth, what=case.id)
    # And it differs from the rounded-mix norm where the rounding matters (bf16 / fp16 mixes).
    if case.base.dtype in (torch.bfloat16, torch.float16) and K > 0:
        rounded = reference.fused_attn_res_inplace_reference(new_prefix.clone(), None, blocks.clone(), nw, pw, K,
                                                             eps, -1, onw, args["out_norm_eps"], round_mix=True)[0]
        assert not torch.equal(bits(eager), bits(rounded)), "the two rounding points should differ on this sample"


@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=lambda d: FP8_NAMES[d])
def test_quant_overload_matches_inplace(out_dtype, device: str):
    """fused_attn_res.quant: the same outputs as the in-place op, with new_prefix returned instead of stored, and
    the caller's prefix_sum untouched; the wrapper dispatches to it when out_dtype is given."""
    case = ServingCase(FusedCase(S(5, 3, 5, 64), norm="own"), out_dtype=out_dtype)
    args, ip_args = case.make(device), case.make(device)
    prefix_bytes = storage_bytes(args["prefix_sum"])
    q, new_prefix, scale = QUANT(*positional(args), **case.kwargs())
    q2, scale2 = run_inplace(case, ip_args)
    assert torch.equal(storage_bytes(args["prefix_sum"]), prefix_bytes), "fused_attn_res.quant wrote prefix_sum"
    assert torch.equal(bits(new_prefix), bits(ip_args["prefix_sum"]))
    assert torch.equal(bits(args["block_residual"]), bits(ip_args["block_residual"]))
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)
    kw = {k: v for k, v in case.make(device).items()}
    via = k3_ops.fused_attn_res(*[kw.pop(n) for n in POSITIONAL[:7]], **kw, out_dtype=out_dtype, round_mix=False)
    assert len(via) == 3 and torch.equal(via[0].view(torch.uint8), q.view(torch.uint8))


def test_fp8_rows_reach_fp8_max_and_dequantise(device: str):
    """Properties of the FP8 contract: each row's largest |q| is fp8_max (the amax maps onto it), q * scale is
    within half an e4m3 step of the unquantised output, and an all-zero row gives zeros and the floor's scale."""
    case = ServingCase(FusedCase(S(6, 2, 3, 128), write="none", norm="own"), out_dtype=torch.float8_e4m3fn)
    args = case.make(device)
    args["prefix_sum"][2].zero_()
    args["addend"][2].zero_()
    args["block_residual"][2, :2].zero_()
    y = run_inplace(replace(case, out_dtype=None), case.make(device) | {
        k: args[k].clone() for k in ("prefix_sum", "addend", "block_residual")})[0].float().cpu()
    q, scale = run_inplace(case, args)
    q, scale = q.float().cpu(), scale.cpu()
    fp8_max = reference.FP8_MAX[torch.float8_e4m3fn]
    assert torch.equal(q[2], torch.zeros(128)) and scale[2, 0].item() == pytest.approx(1e-10 / fp8_max, rel=1e-6)
    live = [r for r in range(6) if r != 2]
    assert torch.equal(q[live].abs().amax(-1), torch.full((5,), fp8_max))
    # e4m3 keeps 3 mantissa bits: relative rounding <= 2^-4 of the value (normal range), plus subnormal steps.
    err = (q * scale - y).abs()
    assert bool((err <= y.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-30).all()), err.max()


# --- the kernels' e4m3 conversion --------------------------------------------------------------------------
def _e4m3_kernel():
    """A one-line kernel around the kernels' own e4m3 conversion (built on first use: Triton resolves the helper
    through this module's globals)."""
    global triton, tl, attn_res_fwd
    import triton
    import triton.language as tl

    from k3_ops.kernels import attn_res_fwd

    @triton.jit
    def convert(x_ptr, y_ptr, n, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, attn_res_fwd._e4m3_bits(x, FNUZ).to(tl.uint8), mask=offs < n)

    @triton.jit
    def quantise(y_ptr, s_ptr, q_ptr, n, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + offs, mask=offs < n)
        scale = tl.load(s_ptr + offs, mask=offs < n, other=1.0)
        tl.store(q_ptr + offs, attn_res_fwd._fp8_bits(y, scale, FP8_MAX, FNUZ).to(tl.uint8), mask=offs < n)

    convert.quantise = quantise
    return convert


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=lambda d: FP8_NAMES[d])
def test_fp8_bits_divide_by_the_scale(out_dtype):
    """q = clamp(y / scale) with y / scale correctly rounded, as the contract says, not y * (1 / scale): on values
    built to sit next to an e4m3 rounding boundary (midpoints between neighbouring codes, times a scale, nudged by
    a few float32 ulps), where the two roundings give different codes."""
    fnuz = out_dtype == torch.float8_e4m3fnuz
    fp8_max = reference.FP8_MAX[out_dtype]
    codes = torch.arange(0, 128, dtype=torch.uint8).view(out_dtype).float()
    values = codes[codes.isfinite() & (codes <= fp8_max)].unique()
    midpoints = (values[1:] + values[:-1]) / 2  # exact in float32
    scales = torch.exp2(torch.rand(64, generator=torch.Generator().manual_seed(1)) * 12 - 8)
    y = (midpoints[:, None] * scales[None, :]).flatten()
    scale = scales.repeat(len(midpoints))
    for _ in range(3):  # a few float32 ulps either side of midpoint * scale
        y = torch.cat([y, torch.nextafter(y, torch.full_like(y, math.inf)), torch.nextafter(y, torch.zeros_like(y))])
        scale = scale.repeat(3)
    y, scale = torch.cat([y, -y]), torch.cat([scale, scale])
    by_division = torch.clamp(y / scale, -fp8_max, fp8_max).to(out_dtype).view(torch.uint8)
    by_reciprocal = torch.clamp(y * (1.0 / scale), -fp8_max, fp8_max).to(out_dtype).view(torch.uint8)
    assert (by_division != by_reciprocal).sum() >= 10, "the sample should contain values the two roundings split"
    got = torch.empty(y.shape, dtype=torch.uint8)
    _e4m3_kernel().quantise[((y.numel() + 1023) // 1024,)](y, scale, got, y.numel(), FP8_MAX=fp8_max, FNUZ=fnuz,
                                                            BLOCK=1024)
    bad = (got != by_division).nonzero().flatten()[:5].tolist()
    assert not bad, [(y[i].item(), scale[i].item(), int(got[i]), int(by_division[i])) for i in bad]


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=lambda d: FP8_NAMES[d])
def test_e4m3_bits_equal_torch_conversion(out_dtype):
    """_e4m3_bits on every class of value: both zeros, subnormals and their ties, the normal/subnormal boundary,
    ties to even in the normal range, the largest values, NaN; plus random values over the whole range."""
    convert = _e4m3_kernel()
    fnuz = out_dtype == torch.float8_e4m3fnuz
    fp8_max = reference.FP8_MAX[out_dtype]
    step = 2.0 ** (-10 if fnuz else -9)  # the subnormal step
    special = [0.0, -0.0, step, step / 2, 3 * step / 2, 5 * step / 2, step / 4, 7 * step, 7.5 * step, 8 * step,
               2.0 ** (-7 if fnuz else -6), 1.0, 1.0625, 1.1875, 1.125 + 2 ** -20, 1.0625 - 2 ** -20, 3.0,
               fp8_max, fp8_max - 1, 100.5, 1e-30, float("nan")]
    g = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(4000, generator=g) * (math.log2(fp8_max) + 12) - 12)
    x = torch.tensor(special + [-v for v in special]).float()
    x = torch.cat([x, rand, -rand, (rand * 16).round() / 16]).clamp(-fp8_max, fp8_max)
    y = torch.empty(x.shape, dtype=torch.uint8)
    convert[((x.numel() + 1023) // 1024,)](x, y, x.numel(), FNUZ=fnuz, BLOCK=1024)
    want = x.to(out_dtype).view(torch.uint8)
    bad = (y != want).nonzero().flatten()[:5].tolist()
    assert not bad, [(x[i].item(), int(y[i]), int(want[i])) for i in bad]


# --- the launch policies under the interpreter ------------------------------------------------------------
INTERPRETER_CASES = [c for c in CASES if c.base.T and c.base.dtype != torch.float64][:8]


@requires_interpreter
@pytest.mark.interpreter
# "npu": its single-read kernel at these H; "cuda-onetile": the per-token kernel with every block row in one tile,
# which stores the updated prefix and the snapshot at their load rather than in the epilogue; "cuda-2row-w8": its
# loop over 2-row tiles with 8 warps (the table's plan at 65-128 tokens, K = 5..6), which loads the output norm's
# weight with the inputs; "cuda-prefix-first": that loop with the prefix candidate folded first, which stores the
# updated prefix and the snapshot before the loop.
@pytest.mark.parametrize("policy", ["cuda", "cuda-onetile", "cuda-2row-w8", "cuda-prefix-first", "npu", "npu-two-pass"])
@pytest.mark.parametrize("case", case_params(INTERPRETER_CASES))
def test_policies_under_interpreter(case: ServingCase, policy: str, monkeypatch):
    """The CUDA and NPU backends' fused_attn_res_ on CPU tensors (one kernel launch each), against the contract and
    against the reference: out within the interpreter's bf16 truncation of it, FP8 bits equal to the quantisation
    of the policy's own unquantised output."""
    from k3_ops.backends import cuda, npu

    backend = npu if policy.startswith("npu") else cuda
    forced = "two_pass" if policy == "npu-two-pass" else None
    if policy.startswith("cuda-"):
        forced_plan = {"cuda-onetile": cuda.LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8),
                       "cuda-2row-w8": cuda.LaunchConfig(kernel="token", rows_per_tile=2, num_warps=8, num_stages=1),
                       "cuda-prefix-first": cuda.LaunchConfig(kernel="token", rows_per_tile=2, num_warps=8,
                                                              num_stages=1, prefix_first=True)}[policy]
        real_choose = cuda.choose_config

        def choose(T, K, H, device, config=None):
            plan = real_choose(T, K, H, device, forced_plan)
            assert plan.one_tile == (policy == "cuda-onetile"), (T, K, H)
            return plan

        monkeypatch.setattr(cuda, "choose_config", choose)
    launches = []
    real = backend.launch_forward

    def call(args, c=case):
        return backend.fused_attn_res_(*positional(args), **c.kwargs())

    args = case.make("cpu")
    before = snapshot_args(args)
    with npu.substitute(num_vector_cores=lambda device: 3, forward_kernel=forced):
        backend.launch_forward = lambda *a, **k: (launches.append(1), real(*a, **k))[1]
        try:
            out, scale = call(args)
        finally:
            backend.launch_forward = real
        assert len(launches) == 1, f"{case.id}: {len(launches)} kernel launches, expected one"
        check_serving(case, before, args, out, scale,
                      lambda: call(case.make("cpu"), replace(case, out_dtype=None))[0], truncating_bf16=True)
    if case.out_dtype is None:
        want, _ = reference.fused_attn_res_inplace_reference(*positional(case.make("cpu")), **case.kwargs())
        # One ulp for the order of the sums, one more for the truncating bf16 store.
        tol = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9, torch.float32: 1e-5}[case.base.dtype]
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol, msg=case.id)


def test_serving_flag_values_tell_every_variant_apart():
    """The CUDA launch cache keys a compiled variant on the fused flags' values (not their names): every
    combination of the serving options must give its own tuple of values, and fused_attn_res's own launches no
    serving argument at all."""
    from itertools import product

    from k3_ops.backends._fused import FusedArgs, fused_kernel_args

    prefix = torch.zeros(2, 16, dtype=torch.bfloat16)
    seen = {}
    for addend, write, norm, inplace, round_mix, out_dtype in product(
            (None, prefix), (-1, 1), (None, torch.ones(16)), (False, True), (True, False),
            (None, torch.float8_e4m3fn, torch.float8_e4m3fnuz)):
        fused, _ = FusedArgs.allocate(prefix, addend, write, norm, 1e-6, inplace=inplace, round_mix=round_mix,
                                      out_dtype=out_dtype)
        kw = fused_kernel_args(fused, 8)
        values = tuple(v for k, v in kw.items() if k.isupper())
        variant = (addend is not None, write >= 0, norm is not None, inplace, fused.norm_fp32_mix, out_dtype)
        assert seen.setdefault(values, variant) == variant, f"{variant} and {seen[values]} share flag values"
        if not fused.serving:
            assert set(kw) == {"addend_ptr", "newp_ptr", "onw_ptr", "stride_at", "stride_ah", "stride_nt",
                               "write_idx", "out_eps", "HAS_ADDEND", "FUSED", "SNAPSHOT", "OUT_NORM"}


def test_serving_plan_of_a_cluster_entry_keeps_a_serving_fallback():
    """A cluster entry serves the serving calls itself (the cluster kernel has every serving option); what it
    leaves to its fallback must be a kernel with the serving flags, so a split fallback becomes the 4-row token
    kernel's plan, and a token fallback stays. The pure plan step: no GPU needed."""
    from k3_ops.backends import cuda_plan
    from k3_ops.backends.cuda_table import SERVING_TOKEN_CONFIG, LaunchConfig

    facts = cuda_plan.DeviceFacts(interpreted=True, num_sms=cuda_plan.INTERPRETER_NUM_SMS)
    split = cuda_plan.resolve(6, 7168, facts, LaunchConfig(kernel="split"))
    token = cuda_plan.resolve(6, 7168, facts, SERVING_TOKEN_CONFIG)
    rows = cuda_plan.resolve(6, 7168, facts, LaunchConfig(kernel="rows"))
    cluster_split = cuda_plan.Plan("cluster", 0, cluster_size=8, fallback=split)
    cluster_token = cuda_plan.Plan("cluster", 0, cluster_size=8, fallback=token)
    served = cuda_plan.serving_plan(cluster_split, 6, 7168, facts)
    assert served.kernel == "cluster" and served.cluster_size == 8 and served.fallback == token
    assert cuda_plan.serving_plan(cluster_split, 6, 7168, facts) is served, "made once per plan"
    assert cuda_plan.serving_plan(cluster_token, 6, 7168, facts) is cluster_token
    assert cuda_plan.serving_plan(split, 6, 7168, facts) == token
    assert cuda_plan.serving_plan(rows, 6, 7168, facts) is rows


@requires_interpreter
@pytest.mark.interpreter
def test_cuda_policy_routes_serving_calls_to_token(monkeypatch):
    """Where the table picks the split path (T <= 4, K = 5..8) the serving calls run on the per-token kernel
    instead (the split kernel has no serving flags), and the plain fused_attn_res still takes the split path."""
    from k3_ops.backends import cuda

    kernels = []
    real = cuda.launch_forward
    monkeypatch.setattr(cuda, "launch_forward", lambda plan, *a, **k: (kernels.append(plan.kernel),
                                                                        real(plan, *a, **k))[1])
    case = ServingCase(FusedCase(S(2, 6, 7, 64), norm="own"))
    assert cuda.choose_config(2, 6, 64, torch.device("cpu")).kernel == "split"
    cuda.fused_attn_res_(*positional(case.make("cpu")), round_mix=False)
    cuda.fused_attn_res_quant(*positional(case.make("cpu")), out_dtype=torch.float8_e4m3fn)
    cuda.fused_attn_res(*positional(case.make("cpu")), round_mix=False)
    cuda.fused_attn_res(*positional(case.make("cpu")))
    assert kernels == ["token", "token", "token", "split"]


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("case", case_params([CASES[0], CASES[2], CASES[4]]))
def test_simulated_npu_through_the_dispatcher(simulated_npu, case: ServingCase):  # noqa: F811
    """fused_attn_res_ on PrivateUse1 tensors: the registered op reaches the NPU policy and updates the device's
    own prefix_sum and buffer in place."""
    raw = simulated_npu.raw

    def on_device(args: dict) -> dict:
        dev = {k: (v.to(simulated_npu.device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        if case.fused.views:  # keep the strided prefix view: rebuild it on the device with the same layout
            dev["prefix_sum"] = args["prefix_sum"].t().contiguous().to(simulated_npu.device).t()
        return dev

    dev_args = on_device(case.make("cpu"))
    raw_args = {k: (raw(v) if isinstance(v, torch.Tensor) else v) for k, v in dev_args.items()}
    before = snapshot_args(raw_args)
    out, scale = run_inplace(case, dev_args)
    assert isinstance(out, NpuTensor) and isinstance(scale, NpuTensor)

    def unquantised():
        return raw(run_inplace(replace(case, out_dtype=None), on_device(case.make("cpu")))[0])

    check_serving(case, before, raw_args, raw(out), raw(scale), unquantised, truncating_bf16=True)


# --- metadata, opcheck ------------------------------------------------------------------------------------
META_CASES = [c for c in CASES if c.base.T][:6]


@pytest.mark.parametrize("case", case_params(META_CASES))
def test_fake_outputs_match_real_run(case: ServingCase, device: str):
    args = case.make(device)
    with FakeTensorMode() as mode:
        fake = run_inplace(case, {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
                                  for k, v in args.items()})
        fake_q = None
        if case.out_dtype is not None:
            fake_q = QUANT(*positional({k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
                                        for k, v in args.items()}), **case.kwargs())
    real = run_inplace(case, args)
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.stride(), f.device) == (r.shape, r.dtype, r.stride(), r.device)
    if fake_q is not None:
        real_q = QUANT(*positional(case.make(device)), **case.kwargs())
        for f, r in zip(fake_q, real_q):
            assert (f.shape, f.dtype, f.stride(), f.device) == (r.shape, r.dtype, r.stride(), r.device)


OPCHECK_CASES = [c for c in CASES if c.base.dtype != torch.float64 or c.out_dtype][:7] + [CASES[9]]


@pytest.mark.parametrize("case", case_params(OPCHECK_CASES))
def test_opcheck_inplace(case: ServingCase, device: str):
    # schema (the two declared mutations only), autograd registration, fake tensor, aot_dispatch static and
    # dynamic (functionalization of both in-place writes).
    opcheck(OP, positional(case.make(device)), case.kwargs())


@pytest.mark.parametrize("case", case_params([c for c in OPCHECK_CASES if c.out_dtype]))
def test_opcheck_quant(case: ServingCase, device: str):
    opcheck(QUANT, positional(case.make(device)), case.kwargs())


def test_opcheck_fused_attn_res_fp32_mix(device: str):
    case = FusedCase(S(4, 2, 4, 33, torch.float16), norm="own")
    opcheck(FUSED, positional(case.make(device)), {"round_mix": False})


# --- inference only, bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["prefix_sum", "addend", "block_residual", "out_norm_weight"])
def test_requires_grad_is_refused_before_writing(name: str, device: str):
    case = CASES[0]
    args = case.make(device)
    args[name] = args[name].detach().clone().requires_grad_(True)
    before = snapshot_args({k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in args.items()})
    with pytest.raises(RuntimeError, match=rf"kimi_k3::fused_attn_res_ is an inference op .*{name} requires grad"):
        run_inplace(case, args)
    for k in ("prefix_sum", "block_residual"):
        assert torch.equal(bits(args[k].detach()), bits(before[k])), f"{k} written before the refusal"
    with torch.no_grad():
        run_inplace(case, args)


BAD = {
    # id: (how to break the arguments, exception type, message pattern)
    "out_dtype_fp16": (lambda a, kw: kw.update(out_dtype=torch.float16), TypeError,
                       r"out_dtype must be None, torch.float8_e4m3fn or torch.float8_e4m3fnuz, got torch.float16"),
    "out_dtype_e5m2": (lambda a, kw: kw.update(out_dtype=torch.float8_e5m2), TypeError,
                       r"out_dtype must be None, .* got torch.float8_e5m2"),
    "out_dtype_e5m2fnuz": (lambda a, kw: kw.update(out_dtype=torch.float8_e5m2fnuz), TypeError,
                           r"got torch.float8_e5m2fnuz$"),
    "prefix_broadcast_tokens": (lambda a, kw: a.update(prefix_sum=a["prefix_sum"][:1].expand(5, 64)), ValueError,
                                r"prefix_sum is written in place \(an addend is given\) and must not be a broadcast "
                                r"view, got prefix_sum.stride\(0\)=0 with prefix_sum.size\(0\)=5"),
    "prefix_broadcast_hidden": (lambda a, kw: a.update(prefix_sum=a["prefix_sum"][:, :1].expand(5, 64)), ValueError,
                                r"prefix_sum.stride\(1\)=0 with prefix_sum.size\(1\)=64"),
    # fused_attn_res's rules hold here too (one of each kind).
    "write_idx_below_K": (lambda a, kw: a.update(block_write_idx=2), ValueError,
                          r"block_write_idx must be -1 \(no snapshot\) or in \[num_valid_blocks=3, "
                          r"block_residual.size\(1\)=5\), got 2"),
    "addend_dtype": (lambda a, kw: a.update(addend=a["addend"].float()), TypeError,
                     r"addend.dtype must equal prefix_sum.dtype=torch.bfloat16, got torch.float32"),
    "out_norm_eps_zero": (lambda a, kw: a.update(out_norm_eps=0.0), ValueError,
                          r"out_norm_eps must be finite and > 0, got 0"),
}


def _bad(device: str, name: str):
    args, kw = CASES[0].make(device), CASES[0].kwargs()
    breaker, exc, pattern = BAD[name]
    breaker(args, kw)
    return args, kw, exc, pattern


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_eager_writes_nothing(name: str, device: str):
    args, kw, exc, pattern = _bad(device, name)
    before = {k: args[k].clone() for k in ("prefix_sum", "block_residual")}
    with pytest.raises(exc, match=pattern):
        OP(*positional(args), **kw)
    for k, v in before.items():
        assert torch.equal(bits(args[k]), bits(v)), f"a rejected call wrote into {k}"


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_under_fake_tensor_mode(name: str, device: str):
    args, kw, exc, pattern = _bad(device, name)
    with FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        with pytest.raises(exc, match=pattern):
            OP(*positional(fake), **kw)


def test_broadcast_prefix_without_addend_is_fine(device: str):
    """Without an addend nothing is written to prefix_sum, so an expanded (read-only) prefix is valid input."""
    case = ServingCase(FusedCase(S(5, 3, 5, 64), addend=False, write="none", norm="own"))
    args = case.make(device)
    args["prefix_sum"] = args["prefix_sum"][:1].expand(5, 64)
    out, _ = run_inplace(case, args)
    want, _ = run_inplace(case, {**args, "prefix_sum": args["prefix_sum"].contiguous()})
    assert torch.equal(bits(out), bits(want))


def test_quant_requires_an_fp8_dtype(device: str):
    args = CASES[0].make(device)
    with pytest.raises(TypeError, match=r"^out_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got "
                                        r"torch.bfloat16$"):
        QUANT(*positional(args), out_dtype=torch.bfloat16)


# --- torch.compile: one graph, both mutations reinplaced (no copy of prefix_sum or the buffer) ---------------
# Method as tests/test_fused_compile.py: Inductor's generated wrapper code (FX-graph caches off) must call the op
# on the caller's own tensors (graph inputs, or the buffer a preceding kernel wrote), with no clone, copy or extra
# allocation; the negative control switches Inductor's reinplace pass off and sees the functionalization copies.
COMPILE_H, COMPILE_CAP, COMPILE_K = 64, 5, 2


def _layer(prefix, mlp_out, buf, nw, pw, onw):
    # vLLM's decoder layer around attention: the pre-attention call adds the previous MLP output into prefix (in
    # place), snapshots it and normalises the FP32 mix; the pre-MLP call adds the "attention output" in place.
    h, _ = OP(prefix, mlp_out, buf, nw, pw, COMPILE_K, 1e-6, COMPILE_K, onw, 1e-5, round_mix=False)
    h2, _ = OP(prefix, torch.tanh(h), buf, nw, pw, COMPILE_K + 1, 1e-6, -1, onw, 1e-5, round_mix=False)
    return h2


def _layer_fp8(prefix, mlp_out, buf, nw, pw, onw):
    q, scale = OP(prefix, mlp_out, buf, nw, pw, COMPILE_K, 1e-6, COMPILE_K, onw, 1e-5,
                  out_dtype=torch.float8_e4m3fn, round_mix=False)
    return q.float() * scale


def _intermediate_prefix(x, mlp_out, buf, nw, pw, onw):
    # The prefix is produced inside the graph (vLLM: the attention output becomes the running residual).
    prefix = x * 2
    h, _ = OP(prefix, mlp_out, buf, nw, pw, COMPILE_K, 1e-6, COMPILE_K, onw, 1e-5, round_mix=False)
    return h, prefix


def _compile_inputs(T: int, device: str, bank: int | None = None):
    g = torch.Generator().manual_seed(T)
    rows = bank or T
    buf = torch.randn(rows, COMPILE_CAP, COMPILE_H, generator=g)
    buf[:, COMPILE_K:] = float("nan")
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (f(T, COMPILE_H).to(device, torch.bfloat16), f(T, COMPILE_H).to(device, torch.bfloat16),
            buf.to(device, torch.bfloat16), (1 + 0.1 * f(COMPILE_H)).to(device), (0.3 * f(1, COMPILE_H)).to(device),
            (1 + 0.1 * f(COMPILE_H)).to(device, torch.bfloat16))


def _copy_findings(code: str, allowed_kernels: int = 0, prefix_made_in_graph: bool = False) -> list[str]:
    from test_fused_compile import _call_body, _top_level_args

    body = _call_body(code)
    findings = []
    kernels = [line.strip() for line in body.splitlines() if re.search(r"\b(?:cpp_fused_\w+|triton_\w+)\(", line)]
    allocs = [line.strip() for line in body.splitlines() if re.search(r"empty_strided\w*\(", line)]
    if len(kernels) > allowed_kernels or len(allocs) > allowed_kernels:
        findings += [f"kernel: {k}" for k in kernels] + [f"allocation: {a}" for a in allocs]
    findings += [f"copy: {line.strip()}" for line in body.splitlines()
                 if re.search(r"\bclone\b|\.copy_\(|aten\.copy|fused_clone|fused_copy", line)]
    calls = [m.end() for m in re.finditer(r"torch\.ops\.kimi_k3\.fused_attn_res_\.default\(", body)]
    if not calls:
        findings.append("no fused_attn_res_ call in the wrapper")
    for start in calls:
        args = _top_level_args(body[start:])
        for i, name in ((0, "prefix_sum"), (2, "block_residual")):
            # The caller's tensor: a graph input (or a view of one); the graph's own prefix where it makes one.
            ok = r"arg\d+_1|reinterpret_tensor\(arg\d+_1\b.*\)"
            if i == 0 and prefix_made_in_graph:
                ok += r"|buf\d+"
            if not re.fullmatch(ok, args[i], re.S):
                findings.append(f"fused_attn_res_ gets {name}={args[i]}, not the caller's tensor")
    return findings


@pytest.fixture
def fresh_compile():
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def _compiled_matches_eager(fn, T: int, device: str, compiled=None, dynamic=True):
    from torch._inductor.utils import run_and_get_code

    inputs = _compile_inputs(T, device)
    eager_inputs = tuple(t.clone() for t in inputs)
    want = fn(*eager_inputs)
    compiled = compiled or torch.compile(fn, fullgraph=True, dynamic=dynamic)
    got, codes = run_and_get_code(compiled, *inputs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(bits(g), bits(w)), "compiled output != eager"
    for i in (0, 2):  # the mutated prefix_sum and buffer, NaN poison included
        assert torch.equal(bits(inputs[i]), bits(eager_inputs[i])), "compiled mutation != eager mutation"
    return compiled, codes


@pytest.mark.parametrize("fn, kernels", [(_layer, 1), (_layer_fp8, 1), (_intermediate_prefix, 1)],
                         ids=["layer", "layer-fp8", "prefix-made-in-graph"])
def test_compiled_inplace_without_copies(fresh_compile, fn, kernels: int, device: str):
    """fullgraph (no graph break), compiled == eager bit for bit (outputs and both mutated tensors), and Inductor
    calls the op on the caller's prefix and buffer: no clone, no copy-back. The one Inductor kernel allowed is the
    graph's own elementwise work (tanh, the dequantising multiply, x * 2), never a copy."""
    compiled, codes = _compiled_matches_eager(fn, 5, device)
    assert len(codes) == 1
    findings = _copy_findings(codes[0], allowed_kernels=kernels, prefix_made_in_graph=fn is _intermediate_prefix)
    assert not findings, "\n".join(findings) + "\n" + codes[0]
    _compiled_matches_eager(fn, 3, device, compiled)  # another token count through the same dynamic graph


def test_detector_sees_the_copies_when_reinplacing_is_off(fresh_compile, monkeypatch):
    post_grad = pytest.importorskip("torch._inductor.fx_passes.post_grad")
    if not hasattr(post_grad, "reinplace_inplaceable_ops"):
        pytest.skip("this torch has no torch._inductor.fx_passes.post_grad.reinplace_inplaceable_ops to switch off")
    from packaging.version import Version

    calls = []
    monkeypatch.setattr(post_grad, "reinplace_inplaceable_ops", lambda *a, **k: calls.append(1))
    _, codes = _compiled_matches_eager(_layer, 5, "cpu")
    if not calls:
        pytest.skip("Inductor did not run post_grad.reinplace_inplaceable_ops here")
    findings = _copy_findings(codes[0], allowed_kernels=1)
    if not findings and Version(torch.__version__.split("+")[0]) < Version("2.13"):
        pytest.skip(f"torch {torch.__version__} reinplaces elsewhere too (see tests/test_fused_compile.py)")
    assert findings, "with reinplacing off the checks should see the functionalization copies:\n" + codes[0]


# --- CUDA: model-sized shapes, and one kernel launch per call ----------------------------------------------
CUDA_CASES = [
    # The cluster path (the table's up to 64 tokens at K = 5..8, 32 at K = 3..4, 16 at K = 2; at K = 5..8 8 CTAs
    # per token up to 8 tokens, 4 up to 32, 2 above): in place, snapshot, FP32-mix norm; no addend, fp16; FP8.
    ServingCase(FusedCase(S(1, 4, 9, 7168), norm="own")),
    ServingCase(FusedCase(S(2, 2, 9, 7168), norm="own")),
    ServingCase(FusedCase(S(24, 3, 9, 7168), write="none", norm="own"), out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(48, 6, 9, 7168), norm="own")),
    ServingCase(FusedCase(S(1, 8, 9, 7168), norm="own")),
    ServingCase(FusedCase(S(16, 5, 9, 7168, torch.float16), addend=False, norm="own")),
    ServingCase(FusedCase(S(8, 8, 9, 7168), write="none", norm="own"), out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(64, 3, 9, 7168, layout="blockmajor"), norm="own", views=True),
                out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(300, 8, 9, 7168), write="none", norm="own"), out_dtype=torch.float8_e4m3fnuz),
    # The streaming kernel (K = 5..8 above 2048 tokens): in place, snapshot, FP8.
    ServingCase(FusedCase(S(2100, 6, 9, 7168), norm="own"), out_dtype=torch.float8_e4m3fn),
    ServingCase(FusedCase(S(33, 2, 5, 4096, torch.float32), norm="own"), round_mix=True),
    ServingCase(FusedCase(S(5, 0, 9, 7168), addend=False, norm="own"), out_dtype=torch.float8_e4m3fn),
]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", case_params(CUDA_CASES))
def test_inplace_contract_cuda_shapes(case: ServingCase):
    args = case.make("cuda")
    before = snapshot_args(args)
    out, scale = run_inplace(case, args)
    check_serving(case, before, args, out, scale,
                  lambda: run_inplace(replace(case, out_dtype=None), case.make("cuda"))[0])
    if case.fused.norm != "none":
        test_fp32_mix_norm_accuracy(case, "cuda")  # the accuracy contract at this shape


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 8, 64, 4096], ids=lambda t: f"T{t}")
def test_kernel_launches_per_inplace_call(T: int, out_dtype):
    """One kernel per call: the in-place add, the snapshot, the mix, the norm and the FP8 epilogue all happen in
    it (allocations issue no kernel)."""
    from test_fused_kernels import _kernel_launches

    case = ServingCase(FusedCase(S(T, 8, 9, 7168), norm="own"), out_dtype=out_dtype)
    case = replace(case, fused=replace(case.fused, write="none"))
    args = case.make("cuda")
    n = _kernel_launches(lambda: run_inplace(case, args))
    assert n == 1, f"{case.id}: {n} kernel launches per fused_attn_res_ call"
