"""The typed wrappers (k3_ops.ops and k3_ops.vllm_ascend's drop-ins) take tensors: a numpy array or a list in a tensor
argument gets one TypeError line naming that argument, before the dispatcher sees it (which would print its page of
overloads). The op's own rules (shapes, dtypes, K, ...) are tests/test_errors.py's."""
from __future__ import annotations

import re

import pytest
import torch

import k3_ops
from k3_ops import vllm_ascend

pytest.importorskip("numpy", reason="the arrays these tests pass are numpy's (Tensor.numpy)")

T, C, H, K = 2, 3, 8, 1


def _args() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"prefix_sum": torch.randn(T, H, generator=g), "addend": torch.randn(T, H, generator=g),
            "block_residual": torch.randn(T, C, H, generator=g), "norm_weight": torch.ones(H),
            "proj_weight": torch.randn(1, H, generator=g), "out_norm_weight": torch.ones(H),
            "sum_out": torch.empty(T, H)}


def _fused(fn):
    return lambda a: fn(a["prefix_sum"], a["addend"], a["block_residual"], a["norm_weight"], a["proj_weight"], K,
                        1e-6, out_norm_weight=a["out_norm_weight"])


# (id, the call, its tensor arguments, the ones that may be None)
WRAPPERS = [
    ("attn_res", lambda a: k3_ops.attn_res(a["prefix_sum"], a["block_residual"], a["norm_weight"], a["proj_weight"],
                                           K, 1e-6),
     ("prefix_sum", "block_residual", "norm_weight", "proj_weight"), ()),
    ("fused_attn_res", _fused(k3_ops.fused_attn_res),
     ("prefix_sum", "addend", "block_residual", "norm_weight", "proj_weight", "out_norm_weight"),
     ("addend", "out_norm_weight")),
    ("fused_attn_res_", _fused(k3_ops.fused_attn_res_),
     ("prefix_sum", "addend", "block_residual", "norm_weight", "proj_weight", "out_norm_weight"),
     ("addend", "out_norm_weight")),
    ("fused_attn_res_full", lambda a: k3_ops.fused_attn_res_full(
        a["prefix_sum"], a["addend"], a["block_residual"], a["norm_weight"], a["proj_weight"], K, 1e-6,
        out_norm_weight=a["out_norm_weight"], sum_out=a["sum_out"]),
     ("prefix_sum", "addend", "block_residual", "norm_weight", "proj_weight", "out_norm_weight", "sum_out"),
     ("addend", "out_norm_weight", "sum_out")),
    ("vllm_ascend.attn_res_fwd", lambda a: vllm_ascend.attn_res_fwd(
        a["prefix_sum"], a["addend"], a["block_residual"], a["proj_weight"], a["norm_weight"], 1e-6, K,
        output_norm_weight=a["out_norm_weight"]),
     ("prefix_sum", "addend", "block_residual", "proj_weight", "norm_weight", "out_norm_weight"),
     ("addend", "out_norm_weight")),
    ("vllm_ascend.attn_res_fwd_mix", lambda a: vllm_ascend.attn_res_fwd_mix(
        a["prefix_sum"], a["block_residual"], a["proj_weight"], a["norm_weight"]),
     ("prefix_sum", "block_residual", "proj_weight", "norm_weight"), ()),
]
#: vLLM-Ascend's drop-in names its output norm's weight output_norm_weight.
SPELLED = {("vllm_ascend.attn_res_fwd", "out_norm_weight"): "output_norm_weight"}
CASES = [pytest.param(call, name, SPELLED.get((wid, name), name), name in optional, id=f"{wid}-{name}")
         for wid, call, names, optional in WRAPPERS for name in names]


@pytest.mark.parametrize("call, name, shown, optional", CASES)
def test_a_numpy_array_in_a_tensor_argument_is_one_typeerror_naming_it(call, name, shown, optional):
    call(_args())  # the same call with tensors runs
    bad = dict(_args(), **{name: _args()[name].numpy()})
    message = f"{shown} must be a torch.Tensor{' or None' if optional else ''}, got numpy.ndarray"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        call(bad)


def test_a_list_is_named_as_a_list():
    a = _args()
    with pytest.raises(TypeError, match=r"^norm_weight must be a torch\.Tensor, got list$"):
        k3_ops.attn_res(a["prefix_sum"], a["block_residual"], [1.0] * H, a["proj_weight"], K, 1e-6)


def test_the_module_taking_drop_ins_check_their_tensors():
    a = _args()
    norm, proj = torch.nn.RMSNorm(H, eps=1e-6), torch.nn.Linear(H, 1, bias=False)
    with pytest.raises(TypeError, match=r"^block_residual must be a torch\.Tensor, got numpy\.ndarray$"):
        vllm_ascend.apply_attn_res(a["prefix_sum"], a["block_residual"].numpy(), proj, norm, K)
    with pytest.raises(TypeError, match=r"^sum_out must be a torch\.Tensor or None, got numpy\.ndarray$"):
        vllm_ascend.apply_attn_res(a["prefix_sum"], a["block_residual"], proj, norm, K, addend=a["addend"],
                                   sum_out=a["sum_out"].numpy())
    with pytest.raises(TypeError, match=r"^prefix_sum must be a torch\.Tensor, got numpy\.ndarray$"):
        vllm_ascend.apply_ascend_attn_res(a["prefix_sum"].numpy(), a["block_residual"], proj, norm, 0)
    with pytest.raises(TypeError, match=r"^prefix_sum must be a torch\.Tensor, got numpy\.ndarray$"):
        k3_ops.apply_attn_res(a["prefix_sum"].numpy(), a["block_residual"], proj, norm, K)
