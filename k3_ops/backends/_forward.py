"""A forward launch's kernel arguments, the same for both launch policies (cuda.py, npu.py) and every forward
kernel: the tensors, sizes and strides the kernels take positionally, and a fused call's keywords (_fused.py).

Strides are passed divided by VEC (``stride_vec``: the kernels multiply them back by the constexpr, which tells
Triton that rows start on 16-byte boundaries); a hidden dimension that is not unit-stride sets ``H_STRIDED``. No
triton import here.
"""
from __future__ import annotations

import torch

from . import hidden_strided, stride_vec
from ._fused import FusedArgs, fused_hidden_dims, fused_kernel_args, fused_token_strides

__all__ = ["kernel_arguments"]


def kernel_arguments(prefix_sum: torch.Tensor, block_residual: torch.Tensor, nw: torch.Tensor, pw: torch.Tensor,
                     out: torch.Tensor, K: int, eps: float, fused: FusedArgs | None
                     ) -> tuple[tuple, dict, dict, int, bool]:
    """``(args, runtime, flags, vec, h_strided)`` of a forward launch on these tensors (as handed to Triton).

    args: (prefix, blocks, norm weight, proj weight, out, T, K, H, eps, then the prefix's token and hidden strides,
    the buffer's token, block and hidden strides and the output's token stride); the NPU kernels take their
    tokens_per_prog after eps. runtime: a fused call's tensors and runtime scalars by name; flags: its constexpr
    flags by name (upper case), in ``fused_kernel_args`` ' order. Both empty for the plain op.
    """
    T, H = prefix_sum.shape
    ps_t, ps_h = prefix_sum.stride()
    bs_t, bs_c, bs_h = block_residual.stride()
    os_t = out.stride(0)
    if fused is None:
        h_strided = hidden_strided((prefix_sum, 1), (block_residual, 2))
        vec = stride_vec(prefix_sum.dtype, (ps_t, bs_t, bs_c, os_t))
    else:
        h_strided = hidden_strided((prefix_sum, 1), (block_residual, 2), *fused_hidden_dims(fused))
        vec = stride_vec(prefix_sum.dtype, (ps_t, bs_t, bs_c, os_t, *fused_token_strides(fused)))
    args = (prefix_sum, block_residual, nw, pw, out, T, K, H, eps,
            ps_t // vec, ps_h, bs_t // vec, bs_c // vec, bs_h, os_t // vec)
    runtime, flags = {}, {}
    if fused is not None:
        for name, value in fused_kernel_args(fused, vec).items():
            (flags if name.isupper() else runtime)[name] = value
    return args, runtime, flags, vec, h_strided
