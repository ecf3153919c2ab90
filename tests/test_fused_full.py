"""kimi_k3::fused_attn_res.full and its wrapper k3_ops.fused_attn_res_full: every output of the serving call
switchable, as vLLM-Ascend's fused AttnRes op offers them (docs/fused_attn_res.md, "Every output").

Contract, checked on every device kernel (CPU here, CUDA on a GPU, the CUDA and NPU launch policies under the
interpreter, the simulated PrivateUse1 device):
- the new prefix is torch's own ``prefix_sum + addend`` bit for bit (under the interpreter bf16 stores truncate:
  either rounding of the exact FP32 sum), stored into the caller's ``sum_out`` (only its rows: the NaN-poisoned gaps
  of its wider storage stay) or a fresh ``new_prefix``, or nowhere without an addend; the snapshot row is it bit for
  bit; every other byte of the buffer (NaN-poisoned capacity) and all storage behind prefix_sum and addend untouched;
- outputs not produced are empty [0] tensors of prefix_sum's dtype; produced ones new contiguous [T, H], aliasing
  nothing;
- ``out`` is fused_attn_res's ``out`` for the same options (bit for bit on the CPU); the returned ``mix`` is within
  the accuracy contract of the float64 truth, and with the rounded-mix norm ``out`` is the norm of exactly that
  tensor (the reference's norm of it, bit for bit on the CPU);
- ``mix=False``: the add and the snapshot only, in one launch (none where there is nothing to write).
Plus opcheck on the same samples, Meta metadata equal to a real run's, every new rule's message in eager, under
FakeTensorMode and under torch.compile (nothing written), the grad refusal, and torch.compile of the call forms.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.optests import opcheck

import k3_ops
from k3_ops import reference
from k3_ops.testing import assert_accuracy_contract, assert_close

from conftest import Sample, requires_cuda, requires_interpreter
from test_fused import NORM_RTOL, FusedCase, _truncate_to_bf16, bits, storage_bytes
from test_npu_simulated import NpuTensor, simulated_npu  # noqa: F401  (the fixture)

OP = torch.ops.kimi_k3.fused_attn_res.full
FUSED = torch.ops.kimi_k3.fused_attn_res.default
POSITIONAL = [a.name for a in OP._schema.arguments if not a.kwarg_only]


@dataclass(frozen=True)
class FullCase:
    """One fused_attn_res.full call: a ``FusedCase`` (tensors, addend, snapshot, output norm, strided views) plus
    the norm's rounding point, the switches and where the new prefix goes. sum_out: "none", "dense" (a [T, H]
    tensor) or "rows" (the first H columns of a NaN-filled [T, 2 H] allocation: token stride 2 H)."""

    fused: FusedCase
    round_mix: bool = True
    return_mix: bool = False
    mix: bool = True
    sum_out: str = "none"

    @property
    def base(self) -> Sample:
        return self.fused.base

    @property
    def id(self) -> str:
        parts = [self.fused.id, "roundmix" if self.round_mix else "fp32mix"]
        parts += ["retmix"] if self.return_mix else []
        parts += [] if self.mix else ["nomix"]
        return "-".join(parts + [f"sumout_{self.sum_out}"])

    def make(self, device) -> dict:
        args = self.fused.make(device)
        T, H, dtype = self.base.T, self.base.H, self.base.dtype
        sum_out = None
        if self.sum_out == "dense":
            sum_out = torch.full((T, H), float("nan"), device=device, dtype=dtype)
        elif self.sum_out == "rows":
            sum_out = torch.full((T, 2 * H), float("nan"), device=device, dtype=dtype)[:, :H]
        return dict(args, sum_out=sum_out)

    def kwargs(self, args: dict) -> dict:
        return dict(round_mix=self.round_mix, return_mix=self.return_mix, mix=self.mix, sum_out=args["sum_out"])


def positional(args: dict) -> tuple:
    return tuple(args[name] for name in POSITIONAL)


def run(case: FullCase, args: dict, fn=None):
    return (fn or OP)(*positional(args), **case.kwargs(args))


def S(T, K, cap, H, dtype=torch.bfloat16, **kw):
    return Sample(T=T, K=K, cap=cap, H=H, dtype=dtype, **kw)


# vLLM-Ascend's call forms (form 3: its fused op, the rounded mix normalised, the pre-norm mix returned for speculative
# decoding, mix=False at a pipeline-parallel boundary; form 4: sum_out and the FP32-mix norm) and every switch on and
# off: addend, snapshot, output norm (own eps / defaulted), strided views, block-major buffer, K = 0, full capacity,
# odd H, one token, fp16 / fp32, fp64 (the reference path) and an empty batch.
CASES = [
    FullCase(FusedCase(S(5, 3, 5, 64), norm="own"), return_mix=True),  # form 3 in a layer: add, snapshot, norm
    FullCase(FusedCase(S(5, 3, 5, 64), addend=False, norm="own"), return_mix=True),  # form 3, no addend
    FullCase(FusedCase(S(4, 2, 4, 33, torch.float16), write="none", norm="own", views=True), sum_out="rows",
             round_mix=False),  # form 4: sum_out, FP32-mix norm, strided prefix / addend
    FullCase(FusedCase(S(4, 2, 4, 33, torch.float16), write="none", norm="none"), sum_out="dense"),  # form 4, no norm
    FullCase(FusedCase(S(6, 3, 5, 96, layout="blockmajor"), norm="eps"), return_mix=True, round_mix=False),
    FullCase(FusedCase(S(3, 0, 2, 32), addend=False, norm="own"), return_mix=True),  # first layer: K = 0
    FullCase(FusedCase(S(3, 2, 3, 48, torch.float32, proj_2d=False), write="last", norm="own"), return_mix=True,
             sum_out="rows"),
    FullCase(FusedCase(S(1, 5, 9, 256), write="none", norm="own"), return_mix=True),  # decode, one token
    FullCase(FusedCase(S(4, 3, 5, 64), norm="none"), return_mix=True),  # no norm: the mix is out
    FullCase(FusedCase(S(4, 8, 8, 64), norm="own")),  # full capacity: no snapshot
    FullCase(FusedCase(S(3, 6, 8, 64), norm="own"), sum_out="rows"),  # CUDA's split path, sum_out at stride 2 H
    FullCase(FusedCase(S(5, 3, 5, 64)), mix=False),  # pipeline-parallel boundary: add and snapshot
    FullCase(FusedCase(S(5, 3, 5, 64), write="none", views=True), mix=False, sum_out="rows"),
    FullCase(FusedCase(S(5, 3, 5, 64), addend=False), mix=False),  # snapshot only
    FullCase(FusedCase(S(5, 3, 5, 64), addend=False, write="none"), mix=False),  # nothing to write
    FullCase(FusedCase(S(5, 3, 5, 64), addend=False, write="none", norm="own"), sum_out="dense"),  # copy to sum_out
    FullCase(FusedCase(S(3, 2, 3, 16, torch.float64), norm="own"), return_mix=True, sum_out="dense"),
    FullCase(FusedCase(S(0, 1, 3, 40), norm="own"), return_mix=True),
]


def case_params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


# --- the contract, shared by every device and policy --------------------------------------------------------
def snapshot_args(args: dict) -> dict:
    """Byte-exact copies to compare against afterwards; prefix_sum, addend and sum_out with their whole storage."""
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    for name in ("prefix_sum", "addend", "sum_out"):
        if args[name] is not None:
            before[name + "_storage"] = storage_bytes(args[name])
    return before


def expected_new_prefix(case: FullCase, before: dict) -> torch.Tensor:
    if case.fused.addend:
        return before["prefix_sum"] + before["addend"]
    return before["prefix_sum"]


def check_full(case: FullCase, before: dict, after: dict, outs, truncating_bf16: bool = False) -> torch.Tensor:
    """``before``: snapshot_args of the call's tensors; ``after``: the call's own tensors; ``outs``: (out, new_prefix,
    mix) as the op returns them. Returns the new prefix as the call stored it (for the output checks)."""
    T, H, dtype = case.base.T, case.base.H, case.base.dtype
    out, new_prefix, mix = outs
    want = expected_new_prefix(case, before)
    # Where the new prefix went: sum_out, a fresh new_prefix (addend, no sum_out), or nowhere (prefix_sum itself).
    if after["sum_out"] is not None:
        stored = after["sum_out"]
    elif case.fused.addend:
        stored = new_prefix
    else:
        stored = after["prefix_sum"]
    fresh = case.fused.addend and after["sum_out"] is None
    assert new_prefix.shape == ((T, H) if fresh else (0,)) and new_prefix.dtype == dtype, (
        f"{case.id}: new_prefix {tuple(new_prefix.shape)}")
    if not torch.equal(bits(stored), bits(want)):
        assert truncating_bf16 and dtype == torch.bfloat16 and case.fused.addend, f"{case.id}: new prefix wrong"
        exact = before["prefix_sum"].float() + before["addend"].float()
        assert torch.equal(bits(stored), bits(_truncate_to_bf16(exact))), f"{case.id}: new prefix wrong"
    if after["sum_out"] is not None and case.sum_out == "rows":
        gaps = storage_bytes(after["sum_out"]).view(dtype).view(T, 2 * H)[:, H:]
        assert torch.equal(bits(gaps), bits(before["sum_out_storage"].view(dtype).view(T, 2 * H)[:, H:])), (
            f"{case.id}: sum_out's storage written outside its rows")
    # Inputs untouched, the buffer outside the snapshot slot untouched, the snapshot slot the new prefix.
    for name in ("prefix_sum", "addend"):
        if after[name] is not None:
            assert torch.equal(storage_bytes(after[name]), before[name + "_storage"]), f"{case.id}: {name} written"
    buf, idx = after["block_residual"], case.fused.write_idx
    others = [i for i in range(case.base.cap) if i != idx]
    assert torch.equal(bits(buf[:, others]), bits(before["block_residual"][:, others])), (
        f"{case.id}: bytes outside the snapshot slot changed")
    if idx >= 0:
        assert torch.equal(bits(buf[:, idx]), bits(stored)), f"{case.id}: snapshot row != the new prefix"
    # Outputs: present only where asked for, new contiguous tensors, aliasing nothing, no NaN (capacity never read).
    produced = [t for t, on in ((out, case.mix), (mix, case.return_mix)) if on]
    for t, on in ((out, case.mix), (mix, case.return_mix)):
        if not on:
            assert t.shape == (0,) and t.dtype == dtype, f"{case.id}: an output not asked for is {tuple(t.shape)}"
    for t in produced + ([new_prefix] if fresh else []):
        assert t.shape == (T, H) and t.dtype == dtype and t.is_contiguous(), f"{case.id}: {tuple(t.shape)}"
        assert not t.isnan().any(), f"{case.id}: NaN in an output (poisoned capacity read?)"
    if T:
        inputs = {after[k].untyped_storage().data_ptr() for k in ("prefix_sum", "block_residual", "sum_out", "addend")
                  if after[k] is not None}
        ptrs = [t.untyped_storage().data_ptr() for t in produced + ([new_prefix] if fresh else [])]
        assert len(set(ptrs)) == len(ptrs) and not set(ptrs) & inputs, f"{case.id}: outputs alias"
    return stored


def reference_outputs(case: FullCase, before: dict):
    """The CPU reference of the same call on copies of the original tensors."""
    args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in before.items()
            if not k.endswith("_storage")}
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return reference.fused_attn_res_full_reference(*positional(args), **case.kwargs(args))


# --- the op on every device (CPU here; CUDA on a GPU) -----------------------------------------------------
@pytest.mark.parametrize("case", case_params(CASES))
def test_full_contract(case: FullCase, device: str):
    args = case.make(device)
    before = snapshot_args(args)
    versions = {k: args[k]._version for k in ("block_residual", "sum_out") if args[k] is not None}
    outs = run(case, args)
    check_full(case, before, args, outs)
    if case.fused.write_idx >= 0:
        assert args["block_residual"]._version > versions["block_residual"], "snapshot: version counter not bumped"
    if args["sum_out"] is not None:
        assert args["sum_out"]._version > versions["sum_out"], "sum_out: version counter not bumped"


@pytest.mark.parametrize("case", case_params([c for c in CASES if c.mix and c.base.T]))
def test_out_is_fused_attn_res_out(case: FullCase, device: str):
    """The same call through fused_attn_res (same options): out bit for bit on the CPU, where both are the
    reference; on a GPU within one output ulp (calls only the serving flags serve run the token or rows kernel,
    where fused_attn_res may take the split or a native path)."""
    args, plain = case.make(device), case.make(device)
    out, new_prefix, _ = run(case, args)
    want, want_prefix = FUSED(*positional(plain), round_mix=case.round_mix)
    stored = args["sum_out"] if args["sum_out"] is not None else (
        new_prefix if case.fused.addend else args["prefix_sum"])
    assert torch.equal(bits(stored), bits(want_prefix))
    if device == "cpu":
        assert torch.equal(bits(out), bits(want)), f"{case.id}: out != fused_attn_res's out"
    else:
        tol = NORM_RTOL[case.base.dtype]
        assert_close(out, want, atol=tol, rtol=tol, what=case.id)


@pytest.mark.parametrize("case", case_params([c for c in CASES if c.return_mix and c.base.T]))
def test_mix_accuracy_and_the_norm_of_it(case: FullCase, device: str):
    """The returned mix: the accuracy contract against the float64 truth of the mix of the new prefix (the eager FP32
    formula rounded to the dtype as the yardstick); with the rounded-mix norm, out is the norm of exactly this
    tensor (the reference's RMSNorm of it: bit for bit on the CPU, within the norm's ulp on a device)."""
    args = case.make(device)
    before = snapshot_args(args)
    out, _, mix = run(case, args)
    new_prefix = expected_new_prefix(case, before).cpu()
    blocks, nw, pw = (before[k].cpu() for k in ("block_residual", "norm_weight", "proj_weight"))
    K, eps = case.base.K, case.base.eps
    truth = reference.attn_res_truth(new_prefix, blocks, nw, pw, K, eps)
    eager = reference.attn_res_reference(new_prefix, blocks, nw, pw, K, eps)
    assert_accuracy_contract(mix.cpu(), eager, truth, what=case.id)
    if case.fused.norm == "none":
        return
    norm_eps = case.base.eps if args["out_norm_eps"] is None else args["out_norm_eps"]
    onw = args["out_norm_weight"].cpu()
    if case.round_mix:
        normed = reference.rms_norm_reference(mix.cpu(), onw, norm_eps)
        if device == "cpu":
            assert torch.equal(bits(out), bits(normed)), f"{case.id}: out != rms_norm(mix)"
        tol = NORM_RTOL[case.base.dtype]
        assert_close(out.cpu(), normed, atol=tol, rtol=tol, what=f"{case.id}: out vs rms_norm(mix)")
    else:
        # The FP32-mix norm: out is the norm of the unrounded mix, not of the returned (rounded) one.
        want = reference.fused_attn_res_full_reference(new_prefix, None, blocks.clone(), nw, pw, K, eps, -1, onw,
                                                       args["out_norm_eps"], round_mix=False)[0]
        truth_out = truth * torch.rsqrt(truth.square().mean(-1, keepdim=True) + norm_eps) * onw.double()
        assert_accuracy_contract(out.cpu(), want, truth_out, what=f"{case.id}: FP32-mix norm")


@pytest.mark.parametrize("case", case_params([c for c in CASES if c.base.T and c.base.dtype != torch.float64]))
def test_device_outputs_are_the_reference(case: FullCase, device: str):
    """Every output against the CPU reference of the same call: bit for bit on the CPU; on a GPU the new prefix and
    the snapshot bit for bit (checked by the contract) and out / mix within one output ulp."""
    args = case.make(device)
    before = snapshot_args(args)
    outs = run(case, args)
    for name, got, want in zip(("out", "new_prefix", "mix"), outs, reference_outputs(case, before)):
        assert got.shape == want.shape, f"{case.id}: {name} {tuple(got.shape)} != {tuple(want.shape)}"
        if device == "cpu" or name == "new_prefix":
            assert torch.equal(bits(got.cpu()), bits(want)), f"{case.id}: {name} != reference"
        else:
            tol = NORM_RTOL[case.base.dtype]
            assert_close(got.cpu(), want, atol=tol, rtol=tol, what=f"{case.id}: {name}")


def test_wrapper_makes_the_aliases_explicit(device: str):
    """k3_ops.fused_attn_res_full's NamedTuple: new_prefix IS sum_out (given) or prefix_sum (no addend); out IS
    new_prefix with mix=False (vLLM-Ascend's op returns the unmixed new prefix as its output); mix IS out without
    return_mix or without an output norm, else a tensor of its own; all other outputs are new tensors."""
    case = FullCase(FusedCase(S(4, 2, 4, 32), norm="own"))
    a = case.make(device)
    pos = positional(a)[:7]
    kw = dict(block_write_idx=a["block_write_idx"], out_norm_weight=a["out_norm_weight"],
              out_norm_eps=a["out_norm_eps"])
    r = k3_ops.fused_attn_res_full(*pos, **kw)
    assert isinstance(r, k3_ops.FusedAttnResOutputs) and r.mix is r.out and r.new_prefix.shape == (4, 32)
    r = k3_ops.fused_attn_res_full(*pos, **kw, return_mix=True)
    assert r.mix is not r.out and r.mix.shape == (4, 32)
    normed = reference.rms_norm_reference(r.mix.cpu(), a["out_norm_weight"].cpu(), a["out_norm_eps"])
    assert_close(r.out.cpu(), normed, atol=2 ** -7, rtol=2 ** -7, what="out vs rms_norm(mix)")
    sum_out = torch.empty_like(a["prefix_sum"])
    r = k3_ops.fused_attn_res_full(*pos, **kw, sum_out=sum_out)
    assert r.new_prefix is sum_out
    assert torch.equal(bits(sum_out), bits(a["prefix_sum"] + a["addend"]))
    no_addend = (pos[0], None, *pos[2:])
    r = k3_ops.fused_attn_res_full(*no_addend, **kw)
    assert r.new_prefix is a["prefix_sum"]
    r = k3_ops.fused_attn_res_full(*pos, block_write_idx=a["block_write_idx"], mix=False)
    assert r.out is r.new_prefix and r.mix is r.out
    assert torch.equal(bits(r.out), bits(a["prefix_sum"] + a["addend"]))
    r = k3_ops.fused_attn_res_full(*no_addend, mix=False)
    assert r.out is a["prefix_sum"] and r.new_prefix is a["prefix_sum"] and r.mix is a["prefix_sum"]
    # Without an output norm the pre-norm mix is out itself: returned as out, not stored twice.
    r = k3_ops.fused_attn_res_full(*pos, return_mix=True)
    assert r.mix is r.out
    with pytest.raises(ValueError, match=r"^return_mix=True needs mix=True"):
        k3_ops.fused_attn_res_full(*pos, return_mix=True, mix=False)


# --- metadata, opcheck ------------------------------------------------------------------------------------
META_CASES = [c for c in CASES if c.base.T and c.base.dtype != torch.float64]


@pytest.mark.parametrize("case", case_params(META_CASES))
def test_fake_outputs_match_real_run(case: FullCase, device: str):
    args = case.make(device)
    with FakeTensorMode() as mode:
        fake_args = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        fake = run(case, fake_args)
    real = run(case, args)
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.stride(), f.device) == (r.shape, r.dtype, r.stride(), r.device)


OPCHECK_CASES = [CASES[i] for i in (0, 1, 2, 3, 5, 7, 8, 10, 11, 12, 13, 15, 16)]


@pytest.mark.parametrize("case", case_params(OPCHECK_CASES))
def test_opcheck_full(case: FullCase, device: str):
    # schema (the declared mutations of block_residual and sum_out only, no output aliasing), autograd registration,
    # fake tensor, aot_dispatch static and dynamic (functionalization of both writes).
    args = case.make(device)
    opcheck(OP, positional(args), case.kwargs(args))


# --- inference only, bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["prefix_sum", "addend", "block_residual", "out_norm_weight", "sum_out"])
def test_requires_grad_is_refused_before_writing(name: str, device: str):
    case = replace(CASES[2], fused=replace(CASES[2].fused, write="next"))
    args = case.make(device)
    args[name] = args[name].detach().clone().requires_grad_(True)
    before = {k: args[k].detach().clone() for k in ("block_residual", "sum_out")}
    with pytest.raises(RuntimeError, match=rf"kimi_k3::fused_attn_res.full is an inference op .*{name} requires grad"):
        run(case, args)
    for k, v in before.items():
        assert torch.equal(bits(args[k].detach()), bits(v)), f"{k} written before the refusal"
    with torch.no_grad():
        run(case, args)


def _overlapping(a: dict, name: str) -> None:
    # sum_out in another argument's memory: rows 3..7 of a 10-row allocation whose rows 0..4 are prefix_sum; the
    # addend itself; a free slot of the buffer.
    if name == "prefix_sum":
        wide = torch.cat([a["prefix_sum"], a["prefix_sum"]])
        a["prefix_sum"], a["sum_out"] = wide[:5], wide[3:8]
    elif name == "addend":
        a["sum_out"] = a["addend"]
    elif name == "prefix_half":
        # Rows at one token stride whose columns meet: half of each sum_out row over a prefix_sum row.
        wide = torch.cat([a["prefix_sum"], a["prefix_sum"]], dim=1)
        a["prefix_sum"], a["sum_out"] = wide[:, :64], wide[:, 32:96]
    else:
        a["sum_out"] = a["block_residual"][:, 4]


BAD = {
    # id: (how to break the arguments, exception type, message pattern). Base: CASES[0] (T = 5, K = 3, cap 5, H = 64,
    # bf16, snapshot into slot 3, output norm) with a [5, 64] sum_out.
    "return_mix_without_mix": (lambda a, kw: kw.update(mix=False, return_mix=True) or a.update(out_norm_weight=None,
                                                                                            out_norm_eps=None),
                               ValueError, r"^return_mix=True needs mix=True \(with mix=False nothing is mixed\), got "
                                           r"return_mix=True and mix=False$"),
    "out_norm_without_mix": (lambda a, kw: kw.update(mix=False, return_mix=False), ValueError,
                             r"^out_norm_weight needs mix=True \(with mix=False there is no output to normalise\), "
                             r"got mix=False and out_norm_weight of shape \[64\]$"),
    "sum_out_dtype": (lambda a, kw: a.update(sum_out=a["sum_out"].float()), TypeError,
                      r"^sum_out.dtype must equal prefix_sum.dtype=torch.bfloat16, got torch.float32$"),
    "sum_out_tokens": (lambda a, kw: a.update(sum_out=a["sum_out"][:4]), ValueError,
                       r"^sum_out.size\(0\) must equal prefix_sum.size\(0\)=5 \(token count\), got 4$"),
    "sum_out_rank": (lambda a, kw: a.update(sum_out=a["sum_out"].reshape(-1)), ValueError,
                     r"^sum_out must be 2-D \[T, H\] like prefix_sum, got a 1-D tensor of shape \[320\]$"),
    "sum_out_hidden_strided": (lambda a, kw: a.update(sum_out=torch.empty(5, 128, dtype=torch.bfloat16,
                                                                          device=a["prefix_sum"].device)[:, ::2]),
                               ValueError, r"^sum_out must have contiguous rows \(sum_out.stride\(1\) == 1\), got "
                                           r"sum_out.stride\(1\)=2$"),
    "sum_out_broadcast": (lambda a, kw: a.update(sum_out=a["sum_out"][:1].expand(5, 64)), ValueError,
                          r"^sum_out's rows must not overlap \(sum_out.stride\(0\) >= sum_out.size\(1\)=64\), got "
                          r"sum_out.stride\(0\)=0$"),
    "sum_out_rows_overlap": (lambda a, kw: a.update(sum_out=torch.empty(400, dtype=torch.bfloat16,
                                                                        device=a["prefix_sum"].device)
                                                    .as_strided((5, 64), (32, 1))), ValueError,
                             r"sum_out.stride\(0\)=32$"),
    "sum_out_is_prefix_sum": (lambda a, kw: _overlapping(a, "prefix_sum"), ValueError,
                              r"^sum_out must not share memory with prefix_sum \(the new prefix is stored into sum_out "
                              r"while the inputs are read\), got sum_out at bytes \[384, 1024\) and prefix_sum at "
                              r"bytes \[0, 640\) of one storage$"),
    "sum_out_over_half_a_prefix_row": (lambda a, kw: _overlapping(a, "prefix_half"), ValueError,
                                       r"^sum_out must not share memory with prefix_sum .* got sum_out at bytes "
                                       r"\[64, 1216\) and prefix_sum at bytes \[0, 1152\) of one storage$"),
    "sum_out_is_addend": (lambda a, kw: _overlapping(a, "addend"), ValueError,
                          r"^sum_out must not share memory with addend .* got sum_out at bytes \[0, 640\) and addend "
                          r"at bytes \[0, 640\) of one storage$"),
    "sum_out_in_buffer": (lambda a, kw: _overlapping(a, "block_residual"), ValueError,
                          r"^sum_out must not share memory with block_residual "),
    # fused_attn_res's rules hold here too (one of each kind).
    "write_idx_below_K": (lambda a, kw: a.update(block_write_idx=2), ValueError,
                          r"block_write_idx must be -1 \(no snapshot\) or in \[num_valid_blocks=3, "
                          r"block_residual.size\(1\)=5\), got 2"),
    "addend_dtype": (lambda a, kw: a.update(addend=a["addend"].float()), TypeError,
                     r"addend.dtype must equal prefix_sum.dtype=torch.bfloat16, got torch.float32"),
}


def _bad(device: str, name: str):
    case = replace(CASES[0], sum_out="dense")
    args = case.make(device)
    kw = case.kwargs(args)
    breaker, exc, pattern = BAD[name]
    breaker(args, kw)
    kw["sum_out"] = args["sum_out"]
    return args, kw, exc, pattern


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_eager_writes_nothing(name: str, device: str):
    args, kw, exc, pattern = _bad(device, name)
    watched = {k: args[k] for k in ("prefix_sum", "addend", "block_residual", "sum_out") if args[k] is not None}
    before = {k: storage_bytes(v) for k, v in watched.items()}
    with pytest.raises(exc, match=pattern):
        OP(*positional(args), **kw)
    for k, v in watched.items():
        assert torch.equal(storage_bytes(v), before[k]), f"a rejected call wrote into {k}"


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_under_fake_tensor_mode(name: str, device: str):
    """The Meta kernel runs the same C++ rules: the same message at trace time (the aliasing of a view is kept by
    FakeTensorMode's from_tensor of the base, here by making the views inside the mode)."""
    args, kw, exc, pattern = _bad(device, name)
    with FakeTensorMode() as mode:
        memo = {}

        def fake(v):
            if not isinstance(v, torch.Tensor):
                return v
            if id(v) not in memo:
                memo[id(v)] = mode.from_tensor(v)
            return memo[id(v)]

        fake_args = {k: fake(v) for k, v in args.items()}
        fake_kw = {k: fake(v) for k, v in kw.items()}
        with pytest.raises(exc, match=pattern):
            OP(*positional(fake_args), **fake_kw)


@pytest.mark.parametrize("beside", ["prefix_sum", "addend"])
def test_sum_out_beside_an_input_in_one_allocation(beside: str, device: str):
    """sum_out and prefix_sum (or addend) as the two halves of one [T, 2 H] allocation: rows side by side at one token
    stride share no element, so the call is valid (eagerly and at trace time) and the other half is untouched."""
    case = replace(CASES[0], sum_out="dense")
    args = case.make(device)
    wide = torch.full((5, 128), float("nan"), dtype=torch.bfloat16, device=device)
    wide[:, :64] = args[beside]
    args[beside], args["sum_out"] = wide[:, :64], wide[:, 64:]
    kept = args[beside].clone()
    want = args["prefix_sum"] + args["addend"]
    with FakeTensorMode() as mode:
        fake_wide = mode.from_tensor(wide)
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        fake[beside], fake["sum_out"] = fake_wide[:, :64], fake_wide[:, 64:]
        run(case, fake)
    out, new_prefix, _ = run(case, args)
    assert new_prefix.shape == (0,) and torch.equal(bits(args["sum_out"]), bits(want))
    assert torch.equal(bits(args[beside]), bits(kept)), f"the {beside} half was written"
    assert torch.equal(bits(out), bits(FUSED(*positional(case.make(device)))[0]))


def test_sum_out_in_a_slot_beside_the_bank(device: str):
    """sum_out as the last slot of a [T, C + 1, H] allocation whose first C slots are the buffer: the rows sit in
    different columns of the token stride, so the call is valid (eagerly and at trace time); the buffer changes
    exactly as the same call with a separate sum_out changes it."""
    case = replace(CASES[0], sum_out="dense")
    args, plain = case.make(device), case.make(device)
    bank = torch.full((5, 6, 64), float("nan"), dtype=torch.bfloat16, device=device)
    bank[:, :5] = args["block_residual"]
    args["block_residual"], args["sum_out"] = bank[:, :5], bank[:, 5]
    with FakeTensorMode() as mode:
        fake_bank = mode.from_tensor(bank)
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        fake["block_residual"], fake["sum_out"] = fake_bank[:, :5], fake_bank[:, 5]
        run(case, fake)
    got = run(case, args)
    want = run(case, plain)
    for g, w in zip(got, want):
        assert torch.equal(bits(g), bits(w))
    assert torch.equal(bits(args["block_residual"]), bits(plain["block_residual"]))
    assert torch.equal(bits(args["sum_out"]), bits(plain["sum_out"]))


# --- torch.compile: vLLM-Ascend's call forms inside one graph ---------------------------------------------
COMPILE_H, COMPILE_CAP, COMPILE_K = 64, 5, 2


def _forms(prefix, addend, buf, nw, pw, onw, sum_out):
    # Form 3 with the pre-norm mix returned, then form 4 into sum_out (FP32-mix norm), then a pipeline-parallel
    # boundary (mix=False) adding the second output to the first form's new prefix.
    f3 = k3_ops.fused_attn_res_full(prefix, addend, buf, nw, pw, COMPILE_K, 1e-6, block_write_idx=COMPILE_K,
                                    out_norm_weight=onw, out_norm_eps=1e-5, return_mix=True)
    f4 = k3_ops.fused_attn_res_full(f3.new_prefix, torch.tanh(f3.out), buf, nw, pw, COMPILE_K + 1, 1e-6,
                                    out_norm_weight=onw, out_norm_eps=1e-5, round_mix=False, sum_out=sum_out)
    pp = k3_ops.fused_attn_res_full(f4.new_prefix, f4.out, buf, nw, pw, COMPILE_K + 1, 1e-6, mix=False)
    return f3.out, f3.mix, f4.out, pp.out


def _compile_inputs(T: int, device: str):
    g = torch.Generator().manual_seed(T)
    buf = torch.randn(T, COMPILE_CAP, COMPILE_H, generator=g)
    buf[:, COMPILE_K:] = float("nan")
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (f(T, COMPILE_H).to(device, torch.bfloat16), f(T, COMPILE_H).to(device, torch.bfloat16),
            buf.to(device, torch.bfloat16), (1 + 0.1 * f(COMPILE_H)).to(device), (0.3 * f(1, COMPILE_H)).to(device),
            (1 + 0.1 * f(COMPILE_H)).to(device, torch.bfloat16),
            torch.full((T, COMPILE_H), float("nan")).to(device, torch.bfloat16))


@pytest.fixture
def fresh_compile():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_matches_eager(compiled, T: int, device: str) -> None:
    # Outputs and the two mutated tensors (the buffer's snapshot, sum_out) bit for bit.
    inputs = _compile_inputs(T, device)
    eager_inputs = tuple(t.clone() for t in inputs)
    want = _forms(*eager_inputs)
    got = compiled(*inputs)
    for g, w in zip(got, want):
        assert torch.equal(bits(g), bits(w)), "compiled output != eager"
    for i in (2, 6):
        assert torch.equal(bits(inputs[i]), bits(eager_inputs[i])), "compiled mutation != eager mutation"


def test_compiled_forms_match_eager(fresh_compile, device: str):
    """fullgraph (no graph break) with a dynamic token count: compiled == eager for two token counts through one
    graph (no recompile)."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_forms, fullgraph=True, dynamic=True, backend=counter)
    for T in (6, 3):  # neither equal to the capacity (5): duck sizing would tie the two
        _compiled_matches_eager(compiled, T, device)
    assert counter.frame_count == 1, f"{counter.frame_count} compiled frames: recompiled"


def test_compiled_forms_with_inductor(fresh_compile, device: str):
    """The same graph through Inductor (functionalization of the snapshot and of sum_out, then reinplacing)."""
    _compiled_matches_eager(torch.compile(_forms, fullgraph=True, dynamic=True), 4, device)


@pytest.mark.parametrize("name", ["return_mix_without_mix", "out_norm_without_mix", "sum_out_hidden_strided",
                                  "sum_out_is_addend"])
def test_bad_input_under_torch_compile(fresh_compile, name: str, device: str):
    """Rejected at trace time with the eager message (the Meta kernel's check)."""
    args, kw, exc, pattern = _bad(device, name)

    def f(prefix_sum, addend, block_residual, norm_weight, proj_weight, out_norm_weight, sum_out):
        return OP(prefix_sum, addend, block_residual, norm_weight, proj_weight, args["num_valid_blocks"],
                  args["eps"], args["block_write_idx"], out_norm_weight, args["out_norm_eps"],
                  round_mix=kw["round_mix"], return_mix=kw["return_mix"], mix=kw["mix"], sum_out=sum_out)

    before = storage_bytes(args["block_residual"])
    with pytest.raises(Exception, match=pattern.lstrip("^").rstrip("$")) as info:
        torch.compile(f, fullgraph=True, backend="eager")(args["prefix_sum"], args["addend"], args["block_residual"],
                                                         args["norm_weight"], args["proj_weight"],
                                                         args["out_norm_weight"], args["sum_out"])
    assert isinstance(info.value, exc) or isinstance(info.value.__cause__, exc) or exc.__name__ in str(info.value)
    assert torch.equal(storage_bytes(args["block_residual"]), before)


# --- the launch policies under the interpreter ------------------------------------------------------------
INTERPRETER_CASES = [c for c in CASES if c.base.T and c.base.dtype != torch.float64 and c.base.H <= 96]


def _count_launches(monkeypatch) -> list[str]:
    """Every k3_ops kernel launch from here on, by kernel name (the interpreter runs them through ``run``)."""
    from triton.runtime.interpreter import InterpretedFunction

    from k3_ops.kernels import attn_res_decode, attn_res_fwd, attn_res_npu

    launches = []
    for module in (attn_res_fwd, attn_res_decode, attn_res_npu):
        for obj in list(vars(module).values()):
            if isinstance(obj, InterpretedFunction) and obj.fn.__module__ == module.__name__:
                real = obj.run
                monkeypatch.setattr(obj, "run", lambda *a, _real=real, _name=obj.fn.__name__, **k: (
                    launches.append(_name), _real(*a, **k))[1])
    return launches


@requires_interpreter
@pytest.mark.interpreter
# "cuda": the table's plan (split at T <= 4, K = 5..8 for the calls fused_attn_res makes; the per-token kernel
# otherwise); "cuda-onetile", "cuda-prefix-first", "cuda-rows": the per-token kernel's one-tile and loop epilogues and
# the rows kernel's; "npu": the single-read kernel at these H; "npu-two-pass": the two-pass kernel.
@pytest.mark.parametrize("policy", ["cuda", "cuda-onetile", "cuda-prefix-first", "cuda-rows", "npu", "npu-two-pass"])
@pytest.mark.parametrize("case", case_params(INTERPRETER_CASES))
def test_policies_under_interpreter(case: FullCase, policy: str, monkeypatch):
    """The CUDA and NPU backends' fused_attn_res_full on CPU tensors: the contract, one kernel launch (none with
    mix=False and nothing to write), outputs within the interpreter's bf16 truncation of the reference's."""
    from k3_ops.backends import cuda, cuda_table, npu

    backend = npu if policy.startswith("npu") else cuda
    forced = "two_pass" if policy == "npu-two-pass" else None
    if policy.startswith("cuda-"):
        forced_plan = {"cuda-onetile": cuda.LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8),
                       "cuda-prefix-first": cuda.LaunchConfig(kernel="token", rows_per_tile=2, num_warps=8,
                                                              num_stages=1, prefix_first=True),
                       "cuda-rows": cuda_table.ROWS_CONFIG}[policy]
        real_choose = cuda.choose_config
        monkeypatch.setattr(cuda, "choose_config", lambda T, K, H, device, config=None: real_choose(
            T, K, H, device, forced_plan))
    args = case.make("cpu")
    before = snapshot_args(args)
    launches = _count_launches(monkeypatch)
    with npu.substitute(num_vector_cores=lambda device: 3, forward_kernel=forced):
        outs = backend.fused_attn_res_full(*positional(args), **case.kwargs(args))
    nothing = not case.mix and not case.fused.addend and case.sum_out == "none" and case.fused.write_idx < 0
    if launches and launches[0] == "attn_res_split_kernel":
        # The split path's phases (statistics, mix, and the output norm's scale), the only multi-launch plan.
        assert launches == ["attn_res_split_kernel"] * (3 if case.fused.norm != "none" else 2), launches
    else:
        assert len(launches) == (0 if nothing else 1), f"{case.id}: launches {launches}"
    if not case.mix:
        assert launches in ([], ["attn_res_add_snapshot_kernel"]), launches
    check_full(case, before, args, outs, truncating_bf16=True)
    tol = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9, torch.float32: 1e-5}[case.base.dtype]
    for name, got, want in zip(("out", "new_prefix", "mix"), outs, reference_outputs(case, before)):
        assert got.shape == want.shape, f"{case.id}: {name}"
        # One ulp for the order of the sums, one more for the truncating bf16 store.
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=f"{case.id}: {name}")
    if case.return_mix and case.round_mix and case.fused.norm != "none":
        normed = reference.rms_norm_reference(outs[2], args["out_norm_weight"], args["out_norm_eps"] or case.base.eps)
        torch.testing.assert_close(outs[0].float(), normed.float(), rtol=tol, atol=tol, msg=f"{case.id}: norm(mix)")


@requires_interpreter
@pytest.mark.interpreter
def test_warmup_full_runs_every_form(monkeypatch):
    """warmup(full=True) runs each of vLLM-Ascend's forms per plan (CUDA policy: on each plan and its fallback) and
    the add-and-snapshot kernel's variants; the NPU policy likewise per forward plan and weight dtype."""
    from k3_ops.backends import cuda, npu

    launches = _count_launches(monkeypatch)
    plans = cuda.warmup(64, torch.bfloat16, torch.device("cpu"), max_num_valid_blocks=2, max_num_tokens=8,
                        fused=False, full=True, weight_dtype=torch.bfloat16)
    assert launches.count("attn_res_add_snapshot_kernel") == plans * len(cuda.ADD_SNAPSHOT_FORMS)
    forward = [name for name in launches if name != "attn_res_add_snapshot_kernel"]
    assert len(forward) >= plans * (1 + len(cuda.FULL_FORMS)), forward
    launches.clear()
    with npu.substitute(num_vector_cores=lambda device: 2):
        plans = npu.warmup(64, torch.bfloat16, torch.device("cpu"), max_num_valid_blocks=2, full=True)
    # Weights of the I/O dtype and fp32 (weight_dtype None): every form twice per plan.
    assert launches.count("attn_res_add_snapshot_kernel") == 2 * plans * len(cuda.ADD_SNAPSHOT_FORMS)
    assert len(launches) == plans * (1 + 2 * (len(cuda.FULL_FORMS) + len(cuda.ADD_SNAPSHOT_FORMS))), launches


@requires_interpreter
@pytest.mark.interpreter
def test_cuda_policy_routes_the_extra_outputs(monkeypatch):
    """Where the table picks the split path (T <= 4, K = 5..8) the calls fused_attn_res makes keep it (sum_out
    included: the split kernel stores new prefixes at any token stride), and those only the serving flags serve (the
    rounded mix returned, the new prefix kept in prefix_sum) run the per-token kernel."""
    from k3_ops.backends import cuda

    kernels = []
    real = cuda.launch_forward
    monkeypatch.setattr(cuda, "launch_forward", lambda plan, *a, **k: (kernels.append(plan.kernel),
                                                                        real(plan, *a, **k))[1])
    case = FullCase(FusedCase(S(2, 6, 7, 64), norm="own"))
    assert cuda.choose_config(2, 6, 64, torch.device("cpu")).kernel == "split"
    for c in (case, replace(case, sum_out="rows"), replace(case, return_mix=True),
              replace(case, fused=replace(case.fused, addend=False))):
        args = c.make("cpu")
        cuda.fused_attn_res_full(*positional(args), **c.kwargs(args))
    assert kernels == ["split", "split", "token", "token"]


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("case", case_params([CASES[0], CASES[2], CASES[11], CASES[12]]))
def test_simulated_npu_through_the_dispatcher(simulated_npu, case: FullCase):  # noqa: F811
    """fused_attn_res.full on PrivateUse1 tensors: the registered op reaches the NPU policy, writes the device's own
    buffer and sum_out, and returns device tensors."""
    raw = simulated_npu.raw
    dev = torch.device(simulated_npu.device)

    def on_device(args: dict) -> dict:
        out = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        if case.fused.views:  # keep the strided prefix view: rebuild it on the device with the same layout
            out["prefix_sum"] = args["prefix_sum"].t().contiguous().to(dev).t()
        if case.sum_out == "rows":  # keep sum_out's token stride and the NaN gaps beside its rows
            out["sum_out"] = torch.full((case.base.T, 2 * case.base.H), float("nan"), dtype=case.base.dtype,
                                        device=dev)[:, :case.base.H]
        return out

    dev_args = on_device(case.make("cpu"))
    raw_args = {k: (raw(v) if isinstance(v, torch.Tensor) else v) for k, v in dev_args.items()}
    before = snapshot_args(raw_args)
    outs = run(case, dev_args)
    assert all(isinstance(t, NpuTensor) for t in outs)
    check_full(case, before, raw_args, tuple(raw(t) for t in outs), truncating_bf16=True)


# --- CUDA: model-sized shapes, one kernel launch per call ---------------------------------------------------
CUDA_CASES = [
    # The cluster path's shapes (T <= 64 at K = 5..8, <= 32 at K = 3..4): return_mix and a strided sum_out take its
    # Triton fallback, the rest stay native; the streaming kernel's (K = 5..8 above 2048 tokens); the rows kernel's.
    FullCase(FusedCase(S(1, 4, 9, 7168), norm="own"), return_mix=True),
    FullCase(FusedCase(S(8, 8, 9, 7168), addend=False, norm="own"), return_mix=True),
    FullCase(FusedCase(S(24, 3, 9, 7168), write="none", norm="own"), sum_out="rows", round_mix=False),
    FullCase(FusedCase(S(48, 6, 9, 7168), norm="own"), sum_out="dense"),
    FullCase(FusedCase(S(2, 6, 9, 7168), norm="own"), return_mix=True),
    FullCase(FusedCase(S(300, 8, 9, 7168, layout="blockmajor"), norm="own", views=True), return_mix=True),
    FullCase(FusedCase(S(2100, 6, 9, 7168), norm="own"), return_mix=True),
    FullCase(FusedCase(S(5000, 1, 9, 7168), write="none", norm="own"), sum_out="rows", round_mix=False),
    FullCase(FusedCase(S(33, 2, 5, 4096, torch.float32), norm="own"), return_mix=True),
    FullCase(FusedCase(S(64, 3, 9, 7168)), mix=False),
    FullCase(FusedCase(S(7, 3, 9, 7168, torch.float16), views=True), mix=False, sum_out="rows"),
]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", case_params(CUDA_CASES))
def test_full_contract_cuda_shapes(case: FullCase):
    args = case.make("cuda")
    before = snapshot_args(args)
    outs = run(case, args)
    check_full(case, before, args, outs)
    if case.mix:
        test_out_is_fused_attn_res_out(case, "cuda")
    if case.return_mix:
        test_mix_accuracy_and_the_norm_of_it(case, "cuda")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("form", ["retmix", "sumout_rows", "nomix"])
@pytest.mark.parametrize("T", [1, 8, 64, 4096], ids=lambda t: f"T{t}")
def test_kernel_launches_per_full_call(T: int, form: str):
    """One kernel per call whatever the form: the rounded mix stored beside the output, the new prefix into a
    strided sum_out, the add and the snapshot alone (allocations issue no kernel)."""
    from test_fused_kernels import _kernel_launches

    case = FullCase(FusedCase(S(T, 8, 9, 7168), write="none", norm="own"), return_mix=form == "retmix",
                    sum_out="rows" if form == "sumout_rows" else "none")
    if form == "nomix":
        case = FullCase(FusedCase(S(T, 8, 9, 7168), write="next"), mix=False)
    args = case.make("cuda")
    n = _kernel_launches(lambda: run(case, args))
    assert n == 1, f"{case.id}: {n} kernel launches per fused_attn_res.full call"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.skipif(not getattr(k3_ops._C, "cpp_launch_enabled", False),
                    reason="needs a CUDA build of k3_ops._C with the C++ launch path (K3_OPS_CPP_LAUNCH != 0)")
@pytest.mark.parametrize("form", ["retmix", "sumout_rows", "nomix", "noadd"])
def test_cpp_launch_cache_replays_full_calls(form: str):
    """The C++ CUDA kernel records a fused_attn_res.full call (sum_out, a keyword-only input, named by its schema
    position) and replays it for the next call with the same metadata: the same bits as the op's Python kernel on
    copies of the inputs, outputs, the buffer and sum_out alike."""
    from k3_ops import _registration

    case = {"retmix": FullCase(FusedCase(S(8, 3, 9, 7168), norm="own"), return_mix=True),
            "sumout_rows": FullCase(FusedCase(S(8, 3, 9, 7168), write="none", norm="own"), sum_out="rows",
                                    round_mix=False),
            "nomix": FullCase(FusedCase(S(8, 3, 9, 7168)), mix=False, sum_out="rows"),
            "noadd": FullCase(FusedCase(S(8, 3, 9, 7168), addend=False, norm="own"))}[form]
    k3_ops._C.clear_launch_recipes()
    run(case, case.make("cuda"))  # recorded
    assert k3_ops._C.launch_recipe_count() == 1, "the call was not recorded"
    args = case.make("cuda")
    python = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    if case.sum_out == "rows":
        python["sum_out"] = torch.full((8, 2 * 7168), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :7168]
    got = run(case, args)  # replayed
    want = _registration._CUDA_KERNELS["fused_attn_res.full"](*positional(python), **case.kwargs(python))
    for g, w in zip(got, want):
        assert torch.equal(bits(g), bits(w))
    for name in ("block_residual", "sum_out"):
        if args[name] is not None:
            assert torch.equal(bits(args[name]), bits(python[name])), f"{name} differs after the replay"
    assert k3_ops._C.launch_recipe_count() == 1


@requires_cuda
@pytest.mark.cuda
def test_warmup_full_compiles_the_call_forms():
    """After ``k3_ops.warmup(..., full=True)`` vLLM-Ascend's call forms at any token count compile nothing (the
    launch cache's compiled variants do not grow), as CUDA-graph capture requires."""
    from k3_ops.backends import _launch

    H = 512
    k3_ops.warmup(H, torch.bfloat16, "cuda", max_num_valid_blocks=3, max_num_tokens=300, full=True,
                  weight_dtype=torch.bfloat16)
    before = _launch.cache_size()
    for T in (1, 7, 64, 300):
        for case in (FullCase(FusedCase(S(T, 3, 5, H), norm="own"), return_mix=True),
                     FullCase(FusedCase(S(T, 2, 5, H), addend=False, norm="own"), return_mix=True),
                     FullCase(FusedCase(S(T, 2, 5, H), write="none", norm="own"), sum_out="dense", round_mix=False),
                     FullCase(FusedCase(S(T, 3, 5, H)), mix=False)):
            args = case.make("cuda")
            for k in ("norm_weight", "proj_weight"):
                args[k] = args[k].to(torch.bfloat16)
            run(case, args)
    assert _launch.cache_size() == before, "a fused_attn_res.full form compiled after warmup(full=True)"


# --- the benchmark section (timed on the device by ``python -m k3_ops.bench full``) --------------------------
def test_bench_full_section_times_every_form(device: str):
    """``python -m k3_ops.bench full``: one row per (T, K) with every form timed and finite (no NaN from the
    poisoned capacity), and the two ratios; not part of the main job's default sections."""
    from k3_ops.bench import cli, full
    from k3_ops.bench.common import Options
    from k3_ops.bench.timing import Timer

    assert "full" in cli.SECTIONS and "full" not in cli.DEFAULT_SECTIONS
    opts = Options(device=device, hidden=64, tokens=[1, 4], blocks=[1, 8], rep_ms=0.5, quick=True, progress=False,
                   l2=["warm"])
    res = full.run(opts, Timer(device, rep_ms=0.5, quick=True))
    assert [(r["T"], r["K"], r["l2"]) for r in res["rows"]] == [(1, 1, "warm"), (4, 1, "warm"), (1, 8, "warm"),
                                                                (4, 8, "warm")]
    # A wide spread is noted on a busy CPU; a non-finite output would mean a poisoned slot was read.
    assert not [n for n in res["notes"] if not n.startswith("wide spread")], res["notes"]
    for row in res["rows"]:
        assert all(row[f"us:{n}"] > 0 and row[f"bw:{n}"] > 0 for n in full.BYTES)
        assert row["retmix_vs_fused"] > 0 and row["nomix_vs_add_copy"] > 0


@requires_cuda
@pytest.mark.cuda
def test_bench_full_section_times_warm_and_cold():
    """On a GPU the ``full`` section times every form warm and cold, the cold rows over input sets that together
    exceed 3x the L2 even for the forms that read no block row (the default: cold)."""
    from k3_ops.bench import full
    from k3_ops.bench.common import Options
    from k3_ops.bench.timing import Timer

    # T = 64 at H = 1024: a few hundred cold sets (H = 7168 at T = 1 takes thousands).
    opts = Options(device="cuda", hidden=1024, tokens=[64], blocks=[2], rep_ms=0.5, quick=True, progress=False,
                   l2=["warm", "cold"])
    res = full.run(opts, Timer("cuda", rep_ms=0.5, quick=True))
    rows = {r["l2"]: r for r in res["rows"]}
    assert set(rows) == {"warm", "cold"}
    for row in rows.values():
        assert all(row[f"us:{n}"] > 0 and row[f"bw:{n}"] > 0 for n in full.BYTES)
    assert rows["cold"]["cold_ratio"] > 3 and rows["cold"]["sets"] >= 2
    assert not [n for n in res["notes"] if not n.startswith("wide spread")], res["notes"]
    assert [r["l2"] for r in full.run(replace(opts, l2=None), Timer("cuda", rep_ms=0.5, quick=True))["rows"]] == [
        "cold"]
