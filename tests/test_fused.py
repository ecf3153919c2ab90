"""The kimi_k3::fused_attn_res contract on CPU, and on CUDA where present.

Exactness on one device (docs/fused_attn_res.md): new_prefix is torch's own ``prefix_sum + addend`` bit for
bit, the snapshot row is new_prefix bit for bit, without the output norm ``out`` is that device's
``attn_res(new_prefix, ...)`` bit for bit, and with it ``out`` is within one output ulp of torch's RMSNorm of
the dtype-rounded mix. Every other byte of the buffer (NaN-poisoned capacity included) and all of the
storage behind prefix_sum and addend are compared byte for byte before and after the call. Plus opcheck,
Meta metadata, the grad refusal and bad input (eagerly and under FakeTensorMode, nothing written).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.optests import opcheck

import k3_ops
from k3_ops.testing import assert_close

from conftest import SAMPLES, Sample, requires_interpreter

OP = torch.ops.kimi_k3.fused_attn_res.default
ARG_NAMES = [a.name for a in OP._schema.arguments if not a.kwarg_only]  # round_mix is keyword-only


@dataclass(frozen=True)
class FusedCase:
    """One fused_attn_res call built on a shared attn_res ``Sample``.

    write: "none" (block_write_idx = -1), "next" (slot K, what the decoder schedule does) or "last" (slot C-1).
    norm: "none" (no output norm), "eps" (out_norm_eps omitted: defaults to eps) or "own" (its own eps).
    views: prefix_sum as a transposed view and addend as a stride-2 column view of wider storage.
    """

    base: Sample
    addend: bool = True
    write: str = "next"
    norm: str = "none"
    views: bool = False

    @property
    def write_idx(self) -> int:
        idx = {"none": -1, "next": self.base.K, "last": self.base.cap - 1}[self.write]
        return idx if idx >= self.base.K and idx < self.base.cap else -1  # a full buffer takes no snapshot

    @property
    def id(self) -> str:
        return "-".join([self.base.id, "add" if self.addend else "noadd", f"write{self.write_idx}",
                         f"norm_{self.norm}", "views" if self.views else "dense"])

    def make(self, device: str, seed: int = 0) -> dict:
        """Keyword arguments of the op, in schema order. The buffer's snapshot slot is NaN-poisoned like all
        of the unused capacity, so a missing write shows."""
        args = self.base.make(device, seed=seed)
        T, H, dtype = self.base.T, self.base.H, self.base.dtype
        g = torch.Generator().manual_seed(seed + 1)
        prefix = args["prefix_sum"]
        addend = (torch.randn(T, H, generator=g) * 0.7).to(device=device, dtype=dtype) if self.addend else None
        if self.views:
            # Same values, other strides: prefix_sum [T, H] with strides (1, T); addend every other column.
            prefix = prefix.t().contiguous().t()
            if addend is not None:
                wide = torch.full((T, 2 * H), float("nan"), device=device, dtype=dtype)
                wide[:, 1::2] = addend
                addend = wide[:, 1::2]
        out_norm_weight = out_norm_eps = None
        if self.norm != "none":
            out_norm_weight = (1.0 + 0.1 * torch.randn(H, generator=g)).to(device=device, dtype=dtype)
        if self.norm == "own":
            out_norm_eps = 1e-5
        return dict(prefix_sum=prefix, addend=addend, block_residual=args["block_residual"],
                    norm_weight=args["norm_weight"], proj_weight=args["proj_weight"],
                    num_valid_blocks=self.base.K, eps=self.base.eps, block_write_idx=self.write_idx,
                    out_norm_weight=out_norm_weight, out_norm_eps=out_norm_eps)


def positional(args: dict) -> tuple:
    return tuple(args[name] for name in ARG_NAMES)


def call(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return OP(*positional(args))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements reinterpreted as integers of the same width: torch.equal on these compares bytes
    (NaN == NaN, -0.0 != 0.0), whatever the strides."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of the storage behind ``t`` (a view's gaps included)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


CASES = (
    # Every shared sample as a decoder layer uses it: add, snapshot into the next free slot, no norm.
    [FusedCase(s) for s in SAMPLES]
    # ... with strided prefix / addend, the snapshot in the last slot and the following RMSNorm.
    + [FusedCase(s, write="last", norm="own", views=True) for s in SAMPLES]
    + [
        FusedCase(SAMPLES[0], addend=False, write="none", norm="eps"),  # K3 hidden size, no add, no snapshot
        FusedCase(SAMPLES[4], addend=False, norm="eps"),  # K = 0: the first layer's snapshot of the embeddings
        FusedCase(SAMPLES[5], norm="eps", views=True),  # block-major buffer
        FusedCase(SAMPLES[6], write="none", norm="own"),  # decode, one token
        FusedCase(Sample(T=0, K=1, cap=3, H=40, dtype=torch.bfloat16), norm="eps"),  # empty batch
    ]
)


def case_params(cases=CASES):
    return [pytest.param(c, id=c.id) for c in cases]


# --- exactness ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", case_params())
def test_exactness_and_untouched_bytes(case: FusedCase, device: str):
    args = case.make(device)
    buf = args["block_residual"]
    buf_before = buf.clone()  # clone copies bytes: the NaN poison keeps its bits
    prefix_bytes, addend_bytes = storage_bytes(args["prefix_sum"]), (
        storage_bytes(args["addend"]) if args["addend"] is not None else None)
    version = buf._version

    out, new_prefix = call(args)

    # new_prefix: torch's own add in the I/O dtype (or a copy), a new contiguous tensor, never an alias.
    expected_prefix = args["prefix_sum"] + args["addend"] if case.addend else args["prefix_sum"]
    assert torch.equal(bits(new_prefix), bits(expected_prefix)), f"{case.id}: new_prefix != prefix_sum + addend"
    for t in (out, new_prefix):
        assert t.shape == (case.base.T, case.base.H) and t.dtype == case.base.dtype and t.is_contiguous()
    if case.base.T:
        ptrs = {args["prefix_sum"].untyped_storage().data_ptr(), buf.untyped_storage().data_ptr()}
        assert new_prefix.untyped_storage().data_ptr() not in ptrs and out.untyped_storage().data_ptr() not in ptrs
        assert new_prefix.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()

    # The buffer: the snapshot slot holds new_prefix bit for bit; every other byte is as it was.
    idx = case.write_idx
    others = [i for i in range(case.base.cap) if i != idx]
    assert torch.equal(bits(buf[:, others]), bits(buf_before[:, others])), f"{case.id}: bytes outside the slot changed"
    if idx >= 0:
        assert torch.equal(bits(buf[:, idx]), bits(new_prefix)), f"{case.id}: snapshot row != new_prefix"
        assert buf._version > version, "the in-place snapshot must bump block_residual's version counter"

    # The inputs' storage (view gaps included) is untouched.
    assert torch.equal(storage_bytes(args["prefix_sum"]), prefix_bytes), "prefix_sum's storage was written"
    if addend_bytes is not None:
        assert torch.equal(storage_bytes(args["addend"]), addend_bytes), "addend's storage was written"

    # out: the device's own attn_res of new_prefix, bit for bit, or torch's RMSNorm of it within one ulp.
    mix = k3_ops.attn_res(new_prefix, buf, args["norm_weight"], args["proj_weight"], case.base.K, case.base.eps)
    assert not mix.isnan().any(), f"{case.id}: NaN-poisoned capacity leaked into the mix"
    if case.norm == "none":
        assert torch.equal(bits(out), bits(mix)), f"{case.id}: out != attn_res(new_prefix, ...)"
    else:
        norm_eps = case.base.eps if args["out_norm_eps"] is None else args["out_norm_eps"]
        compute = torch.float64 if case.base.dtype == torch.float64 else torch.float32
        expected = torch.nn.functional.rms_norm(mix.to(compute), (case.base.H,), args["out_norm_weight"].to(compute),
                                                norm_eps).to(case.base.dtype)
        rtol = NORM_RTOL[case.base.dtype]
        assert_close(out, expected, atol=rtol, rtol=rtol, what=f"{case.id}: out vs rms_norm(mix)")


# Output norm vs torch's RMSNorm of the same dtype-rounded mix: both compute in FP32 (FP64) and differ only
# in the order of the mean's reduction, which can flip the final rounding by one ulp of the output dtype
# (relative 2^-7 for bf16, 2^-10 for fp16), or a few FP32 ulps for fp32 output.
NORM_RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("case", case_params([c for c in CASES if c.norm != "none"][:3]))
def test_out_norm_matches_unfused_pipeline(case: FusedCase, device: str):
    """out equals the unfused ops applied in turn, where the norm is this library's reference RMSNorm."""
    args = case.make(device)
    out, new_prefix = call(args)
    mix = k3_ops.attn_res(new_prefix, args["block_residual"], args["norm_weight"], args["proj_weight"],
                          case.base.K, case.base.eps)
    norm_eps = case.base.eps if args["out_norm_eps"] is None else args["out_norm_eps"]
    expected = k3_ops.reference.rms_norm_reference(mix, args["out_norm_weight"], norm_eps)
    if device == "cpu":  # the CPU kernel *is* the reference composition
        assert torch.equal(bits(out), bits(expected))
    rtol = NORM_RTOL[case.base.dtype]
    assert_close(out, expected, atol=rtol, rtol=rtol, what=case.id)


@pytest.mark.parametrize("case", case_params([CASES[2], CASES[len(SAMPLES) + 2]]))
def test_wrapper_equals_op(case: FusedCase, device: str):
    args = case.make(device)
    by_op = call({**args, "block_residual": args["block_residual"].clone()})
    kw = dict(args)
    by_wrapper = k3_ops.fused_attn_res(kw.pop("prefix_sum"), kw.pop("addend"), kw.pop("block_residual"),
                                       kw.pop("norm_weight"), kw.pop("proj_weight"), kw.pop("num_valid_blocks"),
                                       kw.pop("eps"), **kw)
    for a, b in zip(by_op, by_wrapper):
        assert torch.equal(bits(a), bits(b))


# --- the Triton launch policies under the interpreter ---------------------------------------------------
INTERPRETER_CASES = [
    FusedCase(SAMPLES[1], write="last", norm="own", views=True),  # fp16, odd H, strided prefix / addend
    FusedCase(SAMPLES[3], norm="eps"),  # bf16, full capacity: no snapshot
    FusedCase(SAMPLES[5], norm="eps"),  # bf16, block-major buffer
    FusedCase(SAMPLES[6], addend=False),  # fp16 decode, one token
]


def _truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32).contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("policy", ["cuda", "npu", "npu-two-pass"])  # "npu": the single-read kernel at these H
@pytest.mark.parametrize("case", case_params(INTERPRETER_CASES))
def test_launch_policy_under_interpreter(case: FusedCase, policy: str):
    """The CUDA and NPU backends' fused_attn_res on CPU tensors (the CPU dispatch key runs the reference, so
    the backend functions are called directly): the same exactness as through the op, measured against the
    same policy's attn_res_forward. The interpreter converts fp32 -> bf16 by truncation where a GPU rounds to
    nearest even (tests/test_kernels_interpreter.py); a Triton add stored as bf16 may therefore equal either
    rounding of the exact FP32 sum, and nothing else."""
    from k3_ops.backends import cuda, npu

    args = case.make("cpu")
    buf = args["block_residual"]
    buf_before = buf.clone()
    if policy.startswith("npu"):
        forced = "two_pass" if policy == "npu-two-pass" else None
        assert forced or npu.forward_plan(case.base.H, case.base.K, case.base.dtype).kernel == "single_read"
        with npu.substitute(num_vector_cores=lambda device: 8, forward_kernel=forced):
            out, new_prefix = npu.fused_attn_res(*positional(args))
            mix = npu.attn_res_forward(new_prefix, buf, args["norm_weight"], args["proj_weight"], case.base.K,
                                       case.base.eps)
    else:
        out, new_prefix = cuda.fused_attn_res(*positional(args))
        mix = cuda.attn_res_forward(new_prefix, buf, args["norm_weight"], args["proj_weight"], case.base.K,
                                    case.base.eps)

    expected_prefix = args["prefix_sum"] + args["addend"] if case.addend else args["prefix_sum"]
    if not torch.equal(bits(new_prefix), bits(expected_prefix)):
        assert case.base.dtype == torch.bfloat16 and case.addend, f"{case.id}: new_prefix != prefix_sum + addend"
        exact_sum = args["prefix_sum"].float() + args["addend"].float()
        assert torch.equal(bits(new_prefix), bits(_truncate_to_bf16(exact_sum))), (
            f"{case.id}: new_prefix is neither rounding of prefix_sum + addend")
    idx = case.write_idx
    others = [i for i in range(case.base.cap) if i != idx]
    assert torch.equal(bits(buf[:, others]), bits(buf_before[:, others])), f"{case.id}: bytes outside the slot changed"
    if idx >= 0:
        assert torch.equal(bits(buf[:, idx]), bits(new_prefix)), f"{case.id}: snapshot row != new_prefix"
    if case.norm == "none":
        assert torch.equal(bits(out), bits(mix)), f"{case.id}: out != {policy} attn_res(new_prefix, ...)"
    else:
        norm_eps = case.base.eps if args["out_norm_eps"] is None else args["out_norm_eps"]
        expected = torch.nn.functional.rms_norm(mix.float(), (case.base.H,), args["out_norm_weight"].float(),
                                                norm_eps).to(case.base.dtype)
        # One ulp for the reduction order, one more for a truncating bf16 store.
        rtol = NORM_RTOL[case.base.dtype] * (2 if case.base.dtype == torch.bfloat16 else 1)
        assert_close(out, expected, atol=rtol, rtol=rtol, what=f"{case.id}: out vs rms_norm(mix)")


# --- metadata and opcheck -------------------------------------------------------------------------------
@pytest.mark.parametrize("case", case_params(CASES[len(SAMPLES):2 * len(SAMPLES)]))
def test_fake_outputs_match_real_run(case: FusedCase, device: str):
    args = case.make(device)
    with FakeTensorMode() as mode:
        fake = call({k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()})
    real = call(args)
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.stride(), f.device) == (r.shape, r.dtype, r.stride(), r.device)


def _trim_defaults(args: dict, keep: set[str]) -> tuple:
    """Positional arguments with the trailing defaults not in ``keep`` left off (so opcheck also sees calls
    that omit block_write_idx / out_norm_weight / out_norm_eps)."""
    values = list(positional(args))
    defaults = {"block_write_idx": -1, "out_norm_weight": None, "out_norm_eps": None}
    while ARG_NAMES[len(values) - 1] in defaults and ARG_NAMES[len(values) - 1] not in keep:
        values.pop()
    return tuple(values)


OPCHECK_CASES = [
    # (case, optional arguments passed explicitly)
    (FusedCase(SAMPLES[1], addend=False, write="none"), set()),  # nothing optional at all
    (FusedCase(SAMPLES[1], write="none"), {"block_write_idx"}),  # addend; block_write_idx=-1 spelled out
    (FusedCase(SAMPLES[2], write="next"), {"block_write_idx"}),  # snapshot, no norm
    (FusedCase(SAMPLES[2], write="last", norm="eps", views=True), {"block_write_idx", "out_norm_weight"}),
    (FusedCase(SAMPLES[5], write="next", norm="own"), {"block_write_idx", "out_norm_weight", "out_norm_eps"}),
    (FusedCase(SAMPLES[6], addend=False, write="none", norm="own"),
     {"block_write_idx", "out_norm_weight", "out_norm_eps"}),
    (FusedCase(SAMPLES[4], norm="eps"), {"block_write_idx", "out_norm_weight"}),  # K = 0
    (FusedCase(SAMPLES[7], norm="own"), {"block_write_idx", "out_norm_weight", "out_norm_eps"}),  # fp64
]


@pytest.mark.parametrize("case,keep", [pytest.param(c, k, id=f"{c.id}-pass_{'+'.join(sorted(k)) or 'none'}")
                                       for c, k in OPCHECK_CASES])
def test_opcheck(case: FusedCase, keep: set, device: str):
    # schema (declared mutation only, no output aliasing), autograd registration, fake tensor, aot_dispatch
    # static and dynamic (functionalization of the in-place snapshot).
    opcheck(OP, _trim_defaults(case.make(device), keep))


# --- inference only ------------------------------------------------------------------------------------
GRAD_INPUTS = ["prefix_sum", "addend", "block_residual", "norm_weight", "proj_weight", "out_norm_weight"]


@pytest.mark.parametrize("name", GRAD_INPUTS)
def test_requires_grad_is_refused_before_writing(name: str, device: str):
    args = FusedCase(SAMPLES[2], norm="eps").make(device)
    args[name] = args[name].detach().clone().requires_grad_(True)
    before = args["block_residual"].detach().clone()
    with pytest.raises(RuntimeError, match=rf"inference op .*{name} requires grad.*k3_ops\.attn_res"):
        call(args)
    assert torch.equal(bits(args["block_residual"].detach()), bits(before)), "buffer written before the refusal"
    # Inference with trainable parameters is fine: no graph is recorded under no_grad / inference_mode.
    with torch.no_grad():
        out, _ = call(args)
    assert not out.requires_grad
    with torch.inference_mode():
        call(args)


# --- bad input ------------------------------------------------------------------------------------------
BAD = {
    # id: (how to break the arguments, exception type, message pattern)
    "write_idx_below_K": (lambda a: a.update(block_write_idx=a["num_valid_blocks"] - 1), ValueError,
                          r"block_write_idx must be -1 \(no snapshot\) or in \[num_valid_blocks=3, "
                          r"block_residual.size\(1\)=8\), got 2"),
    "write_idx_at_capacity": (lambda a: a.update(block_write_idx=8), ValueError,
                              r"block_write_idx must be -1 .* or in \[num_valid_blocks=3, "
                              r"block_residual.size\(1\)=8\), got 8"),
    "write_idx_minus_2": (lambda a: a.update(block_write_idx=-2), ValueError, r"block_write_idx must be -1 .* got -2"),
    "addend_hidden": (lambda a: a.update(addend=a["addend"].new_zeros(7, 65)), ValueError,
                      r"addend.size\(1\) must equal prefix_sum.size\(1\)=64 \(hidden size\), got 65"),
    "addend_tokens": (lambda a: a.update(addend=a["addend"].new_zeros(6, 64)), ValueError,
                      r"addend.size\(0\) must equal prefix_sum.size\(0\)=7 \(token count\), got 6"),
    "addend_rank": (lambda a: a.update(addend=a["addend"].reshape(-1)), ValueError,
                    r"addend must be 2-D \[T, H\] like prefix_sum, got a 1-D tensor"),
    "addend_dtype": (lambda a: a.update(addend=a["addend"].to(torch.bfloat16)), TypeError,
                     r"addend.dtype must equal prefix_sum.dtype=torch.float32, got torch.bfloat16"),
    "out_norm_weight_size": (lambda a: a.update(out_norm_weight=a["out_norm_weight"].new_ones(63)), ValueError,
                             r"out_norm_weight.size\(0\) must equal prefix_sum.size\(1\)=64 \(hidden size\), got 63"),
    "out_norm_weight_rank": (lambda a: a.update(out_norm_weight=a["out_norm_weight"].reshape(1, 64)), ValueError,
                             r"out_norm_weight must be 1-D \[H\], got a 2-D tensor"),
    "eps_zero": (lambda a: a.update(eps=0.0), ValueError, r"^eps must be finite and > 0, got 0"),
    "eps_negative": (lambda a: a.update(eps=-1e-6), ValueError, r"^eps must be finite and > 0, got -1e-06"),
    "eps_nan": (lambda a: a.update(eps=math.nan), ValueError, r"^eps must be finite and > 0, got nan"),
    "out_norm_eps_zero": (lambda a: a.update(out_norm_eps=0.0), ValueError,
                          r"out_norm_eps must be finite and > 0, got 0"),
    "out_norm_eps_inf": (lambda a: a.update(out_norm_eps=math.inf), ValueError,
                         r"out_norm_eps must be finite and > 0, got inf"),
    "out_norm_eps_without_weight": (lambda a: a.update(out_norm_weight=None), ValueError,
                                    r"out_norm_eps needs out_norm_weight .* got out_norm_eps=1e-05"),
}


def _bad_args(device: str, name: str) -> tuple[dict, type, str]:
    # SAMPLES[2]: T=7, K=3, cap=8, H=64, fp32; snapshot into slot 3 and an output norm with its own eps.
    args = FusedCase(SAMPLES[2], norm="own").make(device)
    breaker, exc, pattern = BAD[name]
    breaker(args)
    return args, exc, pattern


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_eager_writes_nothing(name: str, device: str):
    args, exc, pattern = _bad_args(device, name)
    before = args["block_residual"].clone()
    with pytest.raises(exc, match=pattern):
        call(args)
    assert torch.equal(bits(args["block_residual"]), bits(before)), "a rejected call wrote into the buffer"


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_under_fake_tensor_mode(name: str, device: str):
    args, exc, pattern = _bad_args(device, name)
    with FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        with pytest.raises(exc, match=pattern):
            call(fake)

