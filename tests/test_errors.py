"""Every argument rule of kimi_k3::attn_res, eagerly and at trace time (FakeTensorMode -> the C++ Meta
kernel). Both paths run the same C++ checks, so they must raise the same exception with the same message,
which names the argument, the rule and the actual value."""
from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import k3_ops  # noqa: F401

from conftest import Sample

OP = torch.ops.kimi_k3.attn_res.default
BASE = Sample(T=4, K=3, cap=8, H=16, dtype=torch.bfloat16)


def _set(name: str, value) -> Callable[[dict], dict]:
    return lambda a: {**a, name: value(a) if callable(value) else value}


# (id, how to break the arguments, exception type, exact-substring message)
BAD_INPUTS = [
    ("K-above-capacity", _set("num_valid_blocks", 9), ValueError,
     "num_valid_blocks must be in [0, block_residual.size(1)=8], got 9"),
    ("K-negative", _set("num_valid_blocks", -1), ValueError,
     "num_valid_blocks must be in [0, block_residual.size(1)=8], got -1"),
    ("eps-zero", _set("eps", 0.0), ValueError, "eps must be finite and > 0, got 0"),
    ("eps-negative", _set("eps", -1e-6), ValueError, "eps must be finite and > 0, got -1e-06"),
    ("eps-nan", _set("eps", float("nan")), ValueError, "eps must be finite and > 0, got nan"),
    ("eps-inf", _set("eps", float("inf")), ValueError, "eps must be finite and > 0, got inf"),
    ("prefix-3d", _set("prefix_sum", lambda a: a["prefix_sum"].unsqueeze(0)), ValueError,
     "prefix_sum must be 2-D [T, H], got a 3-D tensor of shape [1, 4, 16]"),
    ("blocks-2d", _set("block_residual", lambda a: a["block_residual"][:, 0]), ValueError,
     "block_residual must be 3-D [T, C, H]"),
    ("norm-2d", _set("norm_weight", lambda a: a["norm_weight"].unsqueeze(0)), ValueError,
     "norm_weight must be 1-D [H], got a 2-D tensor of shape [1, 16]"),
    ("proj-2-rows", _set("proj_weight", lambda a: a["proj_weight"].expand(2, 16)), ValueError,
     "proj_weight must be [H] or [1, H] (an nn.Linear(H, 1) weight), got shape [2, 16]"),
    ("proj-3d", _set("proj_weight", lambda a: a["proj_weight"].view(1, 1, 16)), ValueError,
     "proj_weight must be [H] or [1, H] (an nn.Linear(H, 1) weight), got a 3-D tensor"),
    ("prefix-int", _set("prefix_sum", lambda a: a["prefix_sum"].to(torch.int64)), TypeError,
     "prefix_sum.dtype must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64, got torch.int64"),
    ("blocks-other-dtype", _set("block_residual", lambda a: a["block_residual"].float()), TypeError,
     "block_residual.dtype must equal prefix_sum.dtype=torch.bfloat16, got torch.float32"),
    ("norm-int", _set("norm_weight", lambda a: a["norm_weight"].to(torch.int32)), TypeError,
     "norm_weight.dtype must be a floating dtype, got torch.int32"),
    ("proj-complex", _set("proj_weight", lambda a: a["proj_weight"].to(torch.complex64)), TypeError,
     "proj_weight.dtype must be a floating dtype, got torch.complex64"),
    ("blocks-other-H", _set("block_residual", lambda a: a["block_residual"][..., :15]), ValueError,
     "block_residual.size(2) must equal prefix_sum.size(1)=16 (hidden size), got 15"),
    ("norm-other-H", _set("norm_weight", lambda a: a["norm_weight"][:12]), ValueError,
     "norm_weight.size(0) must equal prefix_sum.size(1)=16 (hidden size), got 12"),
    ("proj-other-H", _set("proj_weight", lambda a: a["proj_weight"][:, :17 - 2]), ValueError,
     "proj_weight.size(-1) must equal prefix_sum.size(1)=16 (hidden size), got 15"),
    ("blocks-other-T", _set("block_residual", lambda a: a["block_residual"][:3]), ValueError,
     "block_residual.size(0) must equal prefix_sum.size(0)=4 (token count), got 3"),
    ("H-zero", lambda a: {**a, "prefix_sum": a["prefix_sum"][:, :0], "block_residual": a["block_residual"][..., :0],
                          "norm_weight": a["norm_weight"][:0], "proj_weight": a["proj_weight"][:, :0]}, ValueError,
     "prefix_sum.size(1) (hidden size H) must be >= 1, got 0"),
]


def _call(a: dict):
    return OP(a["prefix_sum"], a["block_residual"], a["norm_weight"], a["proj_weight"], a["num_valid_blocks"],
              a["eps"])


@pytest.mark.parametrize("breaker, exc, message", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input_eager(breaker, exc, message, device: str):
    args = breaker(BASE.make(device))
    with pytest.raises(exc, match=re.escape(message)):
        _call(args)


@pytest.mark.parametrize("breaker, exc, message", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input_at_trace_time(breaker, exc, message):
    args = breaker(BASE.make("cpu"))
    with FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        with pytest.raises(exc, match=re.escape(message)):
            _call(fake)


def test_bad_input_under_torch_compile():
    """The trace-time check also fires inside a compiled graph, with the eager message."""
    args = BASE.make("cpu")

    def f(prefix_sum, block_residual, norm_weight, proj_weight):
        return torch.ops.kimi_k3.attn_res(prefix_sum, block_residual, norm_weight, proj_weight, 9, 1e-6)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=re.escape("num_valid_blocks must be in [0, block_residual.size(1)=8], got 9")):
        compiled(args["prefix_sum"], args["block_residual"], args["norm_weight"], args["proj_weight"])


def test_device_mismatch():
    args = BASE.make("cpu")
    args["block_residual"] = args["block_residual"].to("meta")
    with pytest.raises(ValueError, match=re.escape("block_residual must be on prefix_sum's device (cpu), got meta")):
        _call(args)


def test_eager_checks_return_the_violation_instead_of_throwing():
    """The eager checks hand the first broken rule back to Python (no C++ exception crosses the extension
    boundary; see csrc_meta/checks.h): None for valid arguments, (is_type_error, message) otherwise."""
    from k3_ops import _C

    args = BASE.make("cpu")
    assert _C.check_attn_res(**{k: args[k] for k in ("prefix_sum", "block_residual", "norm_weight", "proj_weight",
                                                     "num_valid_blocks", "eps")}) is None
    bad = dict(args, num_valid_blocks=9)
    assert _C.check_attn_res(bad["prefix_sum"], bad["block_residual"], bad["norm_weight"], bad["proj_weight"], 9,
                             bad["eps"]) == (False, "num_valid_blocks must be in [0, block_residual.size(1)=8], got 9")
    as_int = args["prefix_sum"].to(torch.int64)
    verdict = _C.check_attn_res(as_int, args["block_residual"], args["norm_weight"], args["proj_weight"], 3, 1e-6)
    assert verdict is not None and verdict[0] is True and "got torch.int64" in verdict[1]
