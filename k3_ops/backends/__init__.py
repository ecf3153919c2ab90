"""Launch policies, one module per device: ``cuda.py`` (NVIDIA GPUs) and ``npu.py`` (Ascend NPUs, PrivateUse1).

A backend module turns checked op arguments into Triton launches: it picks a kernel and its compile-time
configuration, lays out strides and workspaces, and launches ``k3_ops.kernels`` code. Backend modules import
triton (and, for the NPU, torch_npu / triton-ascend) at their own import time, so they are imported only from
inside the registered kernels (``k3_ops._registration``), never when ``k3_ops`` is imported.

This package module holds only torch-level helpers shared by every backend (no triton import here):
the compile options every launch passes, the trivial cases that never launch a kernel, weight preparation,
and the stride arithmetic behind the kernels' compile keys.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from .. import reference

__all__ = [
    "TRITON_COMPILE_OPTIONS",
    "KERNEL_IO_DTYPES",
    "next_power_of_2",
    "trivial_attn_res",
    "prepare_weights",
    "stride_vec",
    "hidden_strided",
]

#: Compile options every Triton launch of the kernels passes as keyword arguments, whatever the installed Triton's
#: defaults. ``enable_fp_fusion``: a * b + c contracted to one FMA (one rounding). The kernels' accuracy and speed
#: were measured with it, and it is only Triton's default so far: 3.9 warns that ``TRITON_DEFAULT_FP_FUSION``
#: turns it off in 3.10, which would silently change both. The interpreter accepts and ignores these options.
#: triton-ascend's launches leave them out (``npu.compile_options``).
TRITON_COMPILE_OPTIONS: Mapping[str, object] = MappingProxyType({"enable_fp_fusion": True})

# Dtypes the Triton kernels read and write natively. fp64 goes to the reference on every device.
KERNEL_IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def trivial_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, num_valid_blocks: int, eps: float) -> torch.Tensor | None:
    """The attn_res cases that never launch a kernel, identical on every device; None when a kernel must run.

    - fp64 inputs: ``reference.attn_res_reference`` (computes in fp64 on the tensors' own device).
    - T = 0: a new empty [0, H] tensor of prefix_sum's dtype.
    - K = 0: ``prefix_sum.clone(memory_format=torch.contiguous_format)``, bit-exact (p = 1 exactly).
    Arguments must already have passed ``k3_ops._C.check_attn_res``.
    """
    if prefix_sum.dtype == torch.float64:
        return reference.attn_res_reference(prefix_sum, block_residual, norm_weight, proj_weight,
                                            num_valid_blocks, eps)
    if prefix_sum.size(0) == 0:
        return torch.empty((0, prefix_sum.size(1)), dtype=prefix_sum.dtype, device=prefix_sum.device)
    if num_valid_blocks == 0:
        return prefix_sum.clone(memory_format=torch.contiguous_format)
    return None


def prepare_weights(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two [H] weight vectors as the kernels load them: contiguous, in a dtype the kernels read.

    ``proj_weight`` [1, H] is read as [H] (a contiguous [1, H] is passed as it is). Weights of dtypes other than
    bf16/fp16/fp32 are cast to fp32 (a tiny [H] op); the kernels fold ``w = norm_weight * proj_weight`` in FP32
    themselves. Both are no-ops
    (no copy, no launch) for the usual contiguous bf16/fp16/fp32 parameters.
    """
    def one(t: torch.Tensor) -> torch.Tensor:
        # The usual case returns the parameter itself (no view, no copy): the kernels read H contiguous values
        # from its data pointer, which is what a contiguous [H] or [1, H] tensor is. Anything else is converted
        # per call, so an in-place update of a parameter is always seen.
        if t.dtype in KERNEL_IO_DTYPES and t.is_contiguous():
            return t
        t = t.reshape(-1)
        if t.dtype not in KERNEL_IO_DTYPES:
            t = t.to(torch.float32)
        return t.contiguous()

    return one(norm_weight), one(proj_weight)


def stride_vec(dtype: torch.dtype, strides: Sequence[int]) -> int:
    """The VEC the kernels multiply their token/block strides back by (see docs/kernels.md, "VEC trick").

    Strides are never compile-time constants (that would recompile per token count), so Triton cannot see
    that a row starts on a 16-byte boundary. Passing ``stride // VEC`` and multiplying by the constexpr VEC in
    the kernel restores that knowledge: 8 elements for 2-byte dtypes and 4 for fp32 (16 bytes) when every
    stride is a multiple of it, otherwise 1 (correct, just narrower loads).
    """
    vec = 16 // dtype.itemsize
    for s in strides:
        if s % vec:
            return 1
    return vec


def hidden_strided(*tensors_and_dims: tuple[torch.Tensor, int]) -> bool:
    """True when some tensor's hidden dimension (given as ``(tensor, dim)``) is not unit-stride.

    A size-1 hidden dimension counts as unit-stride whatever its stride says (it is never stepped).
    The kernels handle non-unit hidden strides correctly through a constexpr flag (a second, slower compiled
    variant, compiled on first use); unit stride is the fast path that ``warmup`` compiles ahead of time.
    """
    return any(t.size(d) > 1 and t.stride(d) != 1 for t, d in tensors_and_dims)
