"""The device-independent part of the fused_attn_res launch (kimi_k3::fused_attn_res), shared by
``cuda.py`` and ``npu.py``: the cases that launch no kernel, the output allocation, and the extra kernel
arguments / stride facts that switch the forward kernels' fused constexpr flags on (kernels/attn_res_fwd.py).
No triton import here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import reference
from . import KERNEL_IO_DTYPES, prepare_weights

__all__ = ["FusedArgs", "trivial_fused_attn_res", "fused_kernel_args", "fused_hidden_dims", "fused_token_strides"]


@dataclass(frozen=True)
class FusedArgs:
    """What a fused call adds to a forward launch.

    addend: [T, H] of the I/O dtype, any strides, or None. new_prefix: new contiguous [T, H] output.
    write_idx: snapshot slot (>= K), or -1. out_norm_weight: [H] contiguous kernel-readable weight, or None.
    out_eps: the output norm's eps (already defaulted to eps).
    """

    addend: torch.Tensor | None
    new_prefix: torch.Tensor
    write_idx: int
    out_norm_weight: torch.Tensor | None
    out_eps: float

    @staticmethod
    def allocate(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_write_idx: int,
                 out_norm_weight: torch.Tensor | None, out_eps: float) -> tuple[FusedArgs, torch.Tensor]:
        """The fused arguments with a fresh new_prefix, and the fresh ``out`` (both [T, H] contiguous)."""
        T, H = prefix_sum.shape
        new_prefix = torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
        out = torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
        onw = None if out_norm_weight is None else prepare_weights(out_norm_weight, out_norm_weight)[0]
        return FusedArgs(addend, new_prefix, int(block_write_idx), onw, float(out_eps)), out

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> FusedArgs:
        """The same arguments with every tensor passed through ``fn`` (the NPU seam's raw tensors)."""
        return replace(self, addend=None if self.addend is None else fn(self.addend),
                       new_prefix=fn(self.new_prefix),
                       out_norm_weight=None if self.out_norm_weight is None else fn(self.out_norm_weight))


def trivial_fused_attn_res(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                           block_write_idx, out_norm_weight, out_norm_eps,
                           attn_res_fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The calls that launch no fused kernel (None otherwise): fp64 (the kernels' I/O dtypes are bf16/fp16/fp32)
    and T = 0 run the reference composition with the device's ``attn_res_fn`` as the mix."""
    if prefix_sum.dtype in KERNEL_IO_DTYPES and prefix_sum.size(0) > 0:
        return None
    return reference.fused_attn_res_reference(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                              num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                              out_norm_eps, attn_res_fn=attn_res_fn)


def fused_hidden_dims(fused: FusedArgs | None) -> tuple[tuple[torch.Tensor, int], ...]:
    """(tensor, hidden dim) pairs the kernels address through H_STRIDED (the addend; new_prefix is contiguous)."""
    return () if fused is None or fused.addend is None else ((fused.addend, 1),)


def fused_token_strides(fused: FusedArgs | None) -> tuple[int, ...]:
    """Token strides the kernels divide by VEC: the addend's and new_prefix's."""
    if fused is None:
        return ()
    return (fused.new_prefix.stride(0),) + (() if fused.addend is None else (fused.addend.stride(0),))


def fused_kernel_args(fused: FusedArgs | None, vec: int) -> dict:
    """Keyword arguments that switch a forward kernel to the fused variant; {} for the plain forward."""
    if fused is None:
        return {}
    a = fused.addend
    return dict(addend_ptr=a, newp_ptr=fused.new_prefix, onw_ptr=fused.out_norm_weight,
                stride_at=0 if a is None else a.stride(0) // vec, stride_ah=0 if a is None else a.stride(1),
                stride_nt=fused.new_prefix.stride(0) // vec, write_idx=max(fused.write_idx, 0),
                out_eps=fused.out_eps, HAS_ADDEND=a is not None, FUSED=True, SNAPSHOT=fused.write_idx >= 0,
                OUT_NORM=fused.out_norm_weight is not None)
