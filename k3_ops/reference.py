"""The one reference implementation of every kimi_k3 op, in plain PyTorch.

These functions are the CPU kernels (registered in ``_registration.py``) *and* the test oracle: the
"plain FP32 PyTorch formula" that the Triton kernels' accuracy contract is measured against. The
``*_truth`` variants run the same math in float64 (no final rounding) and are what errors are measured
from.

Math per token (docs/attn_res.md): candidates v_0..v_{K-1} = block_residual[t, :K], v_K = prefix_sum[t];
w = norm_weight * proj_weight (folded in the compute dtype);
s_i = rsqrt(mean(v_i^2) + eps) * <v_i, w>;  p = softmax(s);  out = sum_i p_i v_i, cast to prefix_sum's dtype.
Only the valid prefix block_residual[:, :K] is ever read: the slice is taken before any arithmetic.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "compute_dtype",
    "attn_res_reference",
    "attn_res_truth",
    "rms_norm_reference",
    "fused_attn_res_reference",
    "attn_res_backward_reference",
    "attn_res_backward_truth",
]


def compute_dtype(io_dtype: torch.dtype) -> torch.dtype:
    """FP32 for bf16/fp16/fp32 I/O; FP64 for fp64 I/O (so that gradcheck is meaningful)."""
    return torch.float64 if io_dtype == torch.float64 else torch.float32


def _candidates(prefix_sum: torch.Tensor, block_residual: torch.Tensor, num_valid_blocks: int,
                dtype: torch.dtype) -> torch.Tensor:
    """[T, K+1, H] stack of the valid blocks and the prefix, in ``dtype``. Never reads slots >= K."""
    valid = block_residual[:, :num_valid_blocks]
    return torch.cat([valid, prefix_sum.unsqueeze(1)], dim=1).to(dtype)


def _mix(v: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The math on an already-stacked [T, K+1, H] candidate tensor, in v's dtype."""
    w = norm_weight.to(v.dtype) * proj_weight.reshape(-1).to(v.dtype)
    r = torch.rsqrt(v.square().mean(dim=-1) + eps)  # [T, K+1]: RMSNorm *without* gamma
    d = (v * w).sum(dim=-1)  # [T, K+1]
    p = torch.softmax(r * d, dim=-1)  # over the K+1 candidates only
    return (p.unsqueeze(-1) * v).sum(dim=1)  # raw values, not normalised ones


def attn_res_reference(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                       proj_weight: torch.Tensor, num_valid_blocks: int, eps: float) -> torch.Tensor:
    """kimi_k3::attn_res in FP32 PyTorch (FP64 for fp64 inputs). Returns a new contiguous [T, H] tensor."""
    if num_valid_blocks == 0:
        # One candidate: p = 1 exactly. Copy instead of computing so that the result is bit-exact even
        # where the score itself would overflow (inf * 0 would poison p with NaN).
        return prefix_sum.clone(memory_format=torch.contiguous_format)
    v = _candidates(prefix_sum, block_residual, num_valid_blocks, compute_dtype(prefix_sum.dtype))
    return _mix(v, norm_weight, proj_weight, eps).to(prefix_sum.dtype)


def attn_res_truth(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                   proj_weight: torch.Tensor, num_valid_blocks: int, eps: float) -> torch.Tensor:
    """The same math in float64 from the (exactly upcast) inputs, unrounded: the accuracy yardstick."""
    if num_valid_blocks == 0:
        return prefix_sum.to(torch.float64)
    v = _candidates(prefix_sum, block_residual, num_valid_blocks, torch.float64)
    return _mix(v, norm_weight.to(torch.float64), proj_weight.to(torch.float64), eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm that follows every mix: ``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in FP32
    (FP64 for fp64 x) from the dtype-rounded ``x``, cast back to ``x.dtype``."""
    xc = x.to(compute_dtype(x.dtype))
    y = xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps) * weight.to(xc.dtype)
    return y.to(x.dtype)


def fused_attn_res_reference(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                             norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                             eps: float, block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                             out_norm_eps: float | None = None, *,
                             attn_res_fn: Callable[..., torch.Tensor] = attn_res_reference,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res as the unfused pipeline, with the rounding points of docs/fused_attn_res.md.

    Writes ``block_residual[:, block_write_idx]`` in place when ``block_write_idx >= 0``; nothing else is
    written. ``attn_res_fn`` computes the mix: this module's formula for the CPU kernel, the device's
    attn_res launcher where a device falls back to this composition (so that ``out`` equals that device's
    ``attn_res(new_prefix, ...)`` bit for bit). Returns ``(out, new_prefix)``, both new contiguous [T, H].
    """
    # The residual add is torch's own elementwise add, rounded to the I/O dtype: exactly what the unfused
    # `prefix + addend` produces. new_prefix is always a fresh tensor, never an alias of prefix_sum.
    new_prefix = torch.empty_like(prefix_sum, memory_format=torch.contiguous_format)
    if addend is None:
        new_prefix.copy_(prefix_sum)
    else:
        torch.add(prefix_sum, addend, out=new_prefix)
    if block_write_idx >= 0:
        # The snapshot lands in free capacity (block_write_idx >= num_valid_blocks), so the mix below never
        # reads it: the order of snapshot and mix does not matter.
        block_residual[:, block_write_idx].copy_(new_prefix)
    mix = attn_res_fn(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
    if out_norm_weight is None:
        return mix, new_prefix
    # mix is already rounded to the I/O dtype (the unfused attn_res output), so the norm sees what the
    # unfused pipeline's RMSNorm sees.
    return rms_norm_reference(mix, out_norm_weight, eps if out_norm_eps is None else out_norm_eps), new_prefix


def attn_res_backward_reference(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                                norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                                eps: float, output_mask: list[bool] | tuple[bool, bool, bool] = (True, True, True),
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::attn_res_backward in FP32 PyTorch (FP64 for fp64 inputs): the CPU kernel and the eager yardstick.

    Recomputes the forward from the inputs, then per token (docs/attn_res.md "Backward"), with gy = grad_out:
    ``g_i = <gy, v_i>``, ``gs_i = p_i (g_i - sum_j p_j g_j)``,
    ``dv_i = p_i gy + gs_i (r_i w - (d_i r_i^3 / H) v_i)``, ``dw = sum_t sum_i gs_i r_i v_i``.

    Returns ``(grad_prefix_sum [T, H] of prefix_sum.dtype, grad_block_residual [T, C, H] of
    block_residual.dtype with zeros at slots >= K, grad_weight [H] in the compute dtype)``, each new and
    contiguous; an output whose ``output_mask`` entry is False is an empty 1-D tensor (no work spent on it).
    ``grad_weight`` is dL/dw for the folded ``w = norm_weight * proj_weight``.
    """
    want_prefix, want_blocks, want_w = (bool(m) for m in output_mask)
    T, C, H = block_residual.shape
    K = num_valid_blocks
    cdt = compute_dtype(prefix_sum.dtype)

    def nothing(dtype: torch.dtype) -> torch.Tensor:
        return prefix_sum.new_empty((0,), dtype=dtype)

    if K == 0 or T == 0:
        # One candidate: p = 1 exactly, so gs = 0 and dv_K = gy. Spelled out (like the forward's copy) so that
        # the gradient is exact even where the score would overflow. (T = 0: everything is empty or zero.)
        grad_prefix = (grad_out.clone(memory_format=torch.contiguous_format) if want_prefix
                       else nothing(prefix_sum.dtype))
        grad_blocks = (block_residual.new_zeros((T, C, H)) if want_blocks else nothing(block_residual.dtype))
        grad_w = prefix_sum.new_zeros((H,), dtype=cdt) if want_w else nothing(cdt)
        return grad_prefix, grad_blocks, grad_w

    v = _candidates(prefix_sum, block_residual, K, cdt)  # [T, K+1, H]; never reads slots >= K
    gy = grad_out.to(cdt).unsqueeze(1)  # [T, 1, H]
    w = norm_weight.to(cdt) * proj_weight.reshape(-1).to(cdt)
    r = torch.rsqrt(v.square().mean(dim=-1) + eps)  # [T, K+1]
    d = (v * w).sum(dim=-1)
    p = torch.softmax(r * d, dim=-1)
    g = (v * gy).sum(dim=-1)
    gs = p * (g - (p * g).sum(dim=-1, keepdim=True))  # softmax backward

    if want_prefix or want_blocks:
        dv = p.unsqueeze(-1) * gy + gs.unsqueeze(-1) * (r.unsqueeze(-1) * w - (d * r.pow(3) / H).unsqueeze(-1) * v)
        # A fresh [T, H] tensor: dv[:, K] is a strided view into dv (and .to is a no-op for fp32).
        grad_prefix = (prefix_sum.new_empty((T, H)).copy_(dv[:, K]) if want_prefix else nothing(prefix_sum.dtype))
        if want_blocks:
            grad_blocks = block_residual.new_zeros((T, C, H))  # slots >= K: exactly zero
            grad_blocks[:, :K] = dv[:, :K]
        else:
            grad_blocks = nothing(block_residual.dtype)
    else:
        grad_prefix, grad_blocks = nothing(prefix_sum.dtype), nothing(block_residual.dtype)
    grad_w = ((gs * r).unsqueeze(-1) * v).sum(dim=(0, 1)) if want_w else nothing(cdt)
    return grad_prefix, grad_blocks, grad_w


def attn_res_backward_truth(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                            norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 truth of attn_res_backward: autograd of ``attn_res_truth`` from the exactly upcast inputs,
    unrounded. Returns ``(grad_prefix_sum [T, H], grad_block_residual [T, C, H] (zeros at slots >= K),
    grad_weight [H])``, all float64 on prefix_sum's device; ``grad_weight`` is dL/dw of the folded weight."""
    f64 = torch.float64
    with torch.enable_grad():
        prefix = prefix_sum.detach().to(f64).requires_grad_(True)
        blocks = block_residual.detach().to(f64).requires_grad_(True)
        # Differentiate with respect to the folded weight itself: pass it as norm_weight with a unit proj.
        w = (norm_weight.detach().to(f64) * proj_weight.detach().reshape(-1).to(f64)).requires_grad_(True)
        out = attn_res_truth(prefix, blocks, w, torch.ones_like(w), num_valid_blocks, eps)
        grads = torch.autograd.grad(out, (prefix, blocks, w), grad_out.detach().to(f64), allow_unused=True)
    return tuple(torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, (prefix, blocks, w)))
