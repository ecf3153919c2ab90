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
    "attn_res_mix_reference",
    "rms_norm_reference",
    "FP8_MAX",
    "FP8_SCALE_FLOOR",
    "fp8_quant_reference",
    "fused_attn_res_reference",
    "fused_attn_res_quant_reference",
    "fused_attn_res_inplace_reference",
    "fused_attn_res_full_reference",
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


def attn_res_mix_reference(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                           proj_weight: torch.Tensor, num_valid_blocks: int, eps: float) -> torch.Tensor:
    """The mix of :func:`attn_res_reference` before its final rounding: [T, H] in the compute dtype (FP32, FP64
    for fp64 inputs). K = 0 gives prefix_sum exactly (upcast)."""
    cdt = compute_dtype(prefix_sum.dtype)
    if num_valid_blocks == 0:
        return prefix_sum.to(cdt)
    return _mix(_candidates(prefix_sum, block_residual, num_valid_blocks, cdt), norm_weight, proj_weight, eps)


def _rms_norm(xc: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's rms_norm order, (x * rsqrt(mean(x^2) + eps)) * weight, in xc's dtype; unrounded.
    return xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps) * weight.to(xc.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm that follows every mix: ``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in FP32
    (FP64 for fp64 x) from the dtype-rounded ``x``, cast back to ``x.dtype``."""
    return _rms_norm(x.to(compute_dtype(x.dtype)), weight, eps).to(x.dtype)


#: The magnitude each FP8 output format's rows are scaled to. float8_e4m3fn: its largest finite value. float8_e4m3fnuz:
#: 224, not torch.finfo's 240: the bound vLLM's dynamic FP8 quantisation uses for fnuz (``get_fp8_min_max``; it
#: found 240 costs accuracy on ROCm), so a k3_ops scale is what the consuming FP8 GEMM expects.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}

#: Smallest amax a scale is computed from: an all-zero row gets a tiny positive scale (and zeros), never 0 / 0.
FP8_SCALE_FLOOR = 1e-10


def fp8_quant_reference(y: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 quantisation of a [T, H] output already rounded to the model dtype, in FP32:
    ``scale = max(amax, FP8_SCALE_FLOOR) / fp8_max`` per row, ``q = clamp(y / scale, -fp8_max, fp8_max)``
    converted with round-to-nearest-even. Returns ``(q [T, H] of out_dtype, scale [T, 1] fp32)``, so that
    ``q.float() * scale`` approximates ``y``."""
    fp8_max = FP8_MAX[out_dtype]
    yf = y.to(torch.float32)
    amax = torch.clamp_min(yf.abs().amax(dim=-1, keepdim=True), FP8_SCALE_FLOOR)
    # Divided by a tensor, not a Python scalar: on CUDA torch turns division by a scalar into a multiplication by
    # its reciprocal, which rounds differently from the correctly rounded division the CPU (and the kernels) do.
    scale = amax / torch.full_like(amax, fp8_max)
    q = torch.clamp(yf / scale, -fp8_max, fp8_max).to(out_dtype)
    return q.contiguous(), scale.contiguous()


def _serving_output(new_prefix: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                    proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                    out_norm_weight: torch.Tensor | None, out_norm_eps: float | None, round_mix: bool,
                    out_dtype: torch.dtype | None, attn_res_fn: Callable[..., torch.Tensor],
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the serving ops output after the add and the snapshot (docs/fused_attn_res.md, "Rounding points"):
    the mix, the optional output RMSNorm (of the dtype-rounded mix when ``round_mix``, else of the FP32 mix) and
    the optional FP8 quantisation. Returns ``(out, scale or None)``."""
    norm_eps = eps if out_norm_eps is None else out_norm_eps
    if out_norm_weight is not None and not round_mix:
        mix = attn_res_mix_reference(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
        out = _rms_norm(mix, out_norm_weight, norm_eps).to(new_prefix.dtype)
    else:
        out = attn_res_fn(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
        if out_norm_weight is not None:
            # out is already rounded to the I/O dtype (the unfused attn_res output), so the norm sees what the
            # unfused pipeline's RMSNorm sees.
            out = rms_norm_reference(out, out_norm_weight, norm_eps)
    if out_dtype is None:
        return out, None
    return fp8_quant_reference(out, out_dtype)


def _new_prefix(prefix_sum: torch.Tensor, addend: torch.Tensor | None) -> torch.Tensor:
    # The residual add is torch's own elementwise add, rounded to the I/O dtype: exactly what the unfused
    # `prefix + addend` produces. A fresh tensor, never an alias of prefix_sum.
    new_prefix = torch.empty_like(prefix_sum, memory_format=torch.contiguous_format)
    if addend is None:
        new_prefix.copy_(prefix_sum)
    else:
        torch.add(prefix_sum, addend, out=new_prefix)
    return new_prefix


def _snapshot(block_residual: torch.Tensor, block_write_idx: int, new_prefix: torch.Tensor) -> None:
    if block_write_idx >= 0:
        # The snapshot lands in free capacity (block_write_idx >= num_valid_blocks), so the mix never reads it:
        # the order of snapshot and mix does not matter.
        block_residual[:, block_write_idx].copy_(new_prefix)


def fused_attn_res_reference(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                             norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                             eps: float, block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                             out_norm_eps: float | None = None, *, round_mix: bool = True,
                             attn_res_fn: Callable[..., torch.Tensor] = attn_res_reference,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res as the unfused pipeline, with the rounding points of docs/fused_attn_res.md
    (``round_mix=False``: the output norm runs on the FP32 mix instead of the dtype-rounded one).

    Writes ``block_residual[:, block_write_idx]`` in place when ``block_write_idx >= 0``; nothing else is
    written. ``attn_res_fn`` computes the mix: this module's formula for the CPU kernel, the device's
    attn_res launcher where a device falls back to this composition (so that ``out`` equals that device's
    ``attn_res(new_prefix, ...)`` bit for bit). Returns ``(out, new_prefix)``, both new contiguous [T, H].
    """
    new_prefix = _new_prefix(prefix_sum, addend)
    _snapshot(block_residual, block_write_idx, new_prefix)
    out, _ = _serving_output(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                             out_norm_weight, out_norm_eps, round_mix, None, attn_res_fn)
    return out, new_prefix


def fused_attn_res_quant_reference(prefix_sum: torch.Tensor, addend: torch.Tensor | None,
                                   block_residual: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                                   num_valid_blocks: int, eps: float, block_write_idx: int = -1,
                                   out_norm_weight: torch.Tensor | None = None, out_norm_eps: float | None = None, *,
                                   out_dtype: torch.dtype, round_mix: bool = True,
                                   attn_res_fn: Callable[..., torch.Tensor] = attn_res_reference,
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.quant: :func:`fused_attn_res_reference` with the output norm's rounding point
    chosen by ``round_mix`` and the output quantised to ``out_dtype`` (:func:`fp8_quant_reference`).
    Returns ``(q [T, H] of out_dtype, new_prefix [T, H], scale [T, 1] fp32)``."""
    new_prefix = _new_prefix(prefix_sum, addend)
    _snapshot(block_residual, block_write_idx, new_prefix)
    q, scale = _serving_output(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                               out_norm_weight, out_norm_eps, round_mix, out_dtype, attn_res_fn)
    return q, new_prefix, scale


def fused_attn_res_inplace_reference(prefix_sum: torch.Tensor, addend: torch.Tensor | None,
                                     block_residual: torch.Tensor, norm_weight: torch.Tensor,
                                     proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                                     block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                                     out_norm_eps: float | None = None, *, out_dtype: torch.dtype | None = None,
                                     round_mix: bool = True,
                                     attn_res_fn: Callable[..., torch.Tensor] = attn_res_reference,
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res_, the in-place serving call: ``prefix_sum += addend`` (torch's own in-place add,
    rounded to the I/O dtype), then the snapshot ``block_residual[:, block_write_idx] = prefix_sum``, then the
    output of the updated prefix_sum as in :func:`fused_attn_res_quant_reference`. Returns ``(out, scale)``:
    out [T, H] of prefix_sum.dtype (or out_dtype), scale [T, 1] fp32 with an FP8 out_dtype, else empty [0]."""
    if addend is not None:
        prefix_sum.add_(addend)
    _snapshot(block_residual, block_write_idx, prefix_sum)
    out, scale = _serving_output(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                 out_norm_weight, out_norm_eps, round_mix, out_dtype, attn_res_fn)
    return out, (prefix_sum.new_empty((0,), dtype=torch.float32) if scale is None else scale)


def fused_attn_res_full_reference(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                                  norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                                  eps: float, block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                                  out_norm_eps: float | None = None, *, round_mix: bool = True,
                                  return_mix: bool = False, mix: bool = True, sum_out: torch.Tensor | None = None,
                                  attn_res_fn: Callable[..., torch.Tensor] = attn_res_reference,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.full: :func:`fused_attn_res_reference` with every output switchable.

    The new prefix is ``prefix_sum + addend`` (torch's own add, rounded to the I/O dtype), stored into ``sum_out``
    when given (without an addend: a copy of prefix_sum), else into a fresh tensor with an addend, else it is
    prefix_sum itself (nothing written); then the snapshot; then, with ``mix``, the output as in
    :func:`fused_attn_res_reference` and with ``return_mix`` the mix rounded to the I/O dtype (the tensor a rounded-mix
    output norm normalises). Returns ``(out, new_prefix, mix)``, where an output not produced is an empty [0] tensor
    of prefix_sum's dtype: out with ``mix=False``, new_prefix without an addend or with ``sum_out``, mix without
    ``return_mix``. Produced outputs are new contiguous [T, H] tensors that alias nothing.
    """
    def nothing() -> torch.Tensor:
        return prefix_sum.new_empty((0,))

    if sum_out is not None:
        if addend is None:
            sum_out.copy_(prefix_sum)
        else:
            torch.add(prefix_sum, addend, out=sum_out)
        new_prefix, returned_prefix = sum_out, nothing()
    elif addend is not None:
        new_prefix = returned_prefix = _new_prefix(prefix_sum, addend)
    else:
        new_prefix, returned_prefix = prefix_sum, nothing()
    _snapshot(block_residual, block_write_idx, new_prefix)
    if not mix:
        return nothing(), returned_prefix, nothing()
    norm_eps = eps if out_norm_eps is None else out_norm_eps
    if out_norm_weight is not None and not round_mix:
        mix_fp = attn_res_mix_reference(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
        out = _rms_norm(mix_fp, out_norm_weight, norm_eps).to(new_prefix.dtype)
        rounded = mix_fp.to(new_prefix.dtype) if return_mix else None
    else:
        rounded = attn_res_fn(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
        if out_norm_weight is None:
            # out is the rounded mix itself; a requested mix is its own tensor (outputs never alias each other).
            out = rounded
            rounded = rounded.clone() if return_mix else None
        else:
            out = rms_norm_reference(rounded, out_norm_weight, norm_eps)
    return out, returned_prefix, (rounded.contiguous() if return_mix else nothing())


def attn_res_backward_reference(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                                norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                                eps: float,
                                output_mask: list[bool] | tuple[bool, bool, bool, bool] = (True, True, True, True),
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::attn_res_backward in FP32 PyTorch (FP64 for fp64 inputs): the CPU kernel and the eager yardstick.

    Recomputes the forward from the inputs, then per token (docs/attn_res.md "Backward"), with gy = grad_out:
    ``g_i = <gy, v_i>``, ``gs_i = p_i (g_i - sum_j p_j g_j)``,
    ``dv_i = p_i gy + gs_i (r_i w - (d_i r_i^3 / H) v_i)``, ``dw = sum_t sum_i gs_i r_i v_i`` (the folded weight
    ``w = norm_weight * proj_weight``), and by the chain rule ``grad_norm_weight = dw * proj_weight``,
    ``grad_proj_weight = dw * norm_weight``: each product in the compute dtype, rounded once to the weight's dtype.

    Returns ``(grad_prefix_sum [T, H] of prefix_sum.dtype, grad_block_residual [T, C, H] of
    block_residual.dtype with zeros at slots >= K, grad_norm_weight, grad_proj_weight)`` (each weight's gradient
    in its shape and dtype), each new and contiguous; an output whose ``output_mask`` entry is False is an empty
    1-D tensor (no work spent on it).
    """
    want_prefix, want_blocks, want_norm, want_proj = (bool(m) for m in output_mask)
    T, C, H = block_residual.shape
    K = num_valid_blocks
    cdt = compute_dtype(prefix_sum.dtype)

    def nothing(like: torch.Tensor) -> torch.Tensor:
        return like.new_empty((0,))

    def weight_grads(dw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        def one(wanted: bool, weight: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            if not wanted:
                return nothing(weight)
            grad = dw * other.reshape(-1).to(cdt) if dw is not None else weight.new_zeros((H,), dtype=cdt)
            return grad.reshape(weight.shape).to(weight.dtype).contiguous()

        return one(want_norm, norm_weight, proj_weight), one(want_proj, proj_weight, norm_weight)

    if K == 0 or T == 0:
        # One candidate: p = 1 exactly, so gs = 0 and dv_K = gy. Spelled out (like the forward's copy) so that
        # the gradient is exact even where the score would overflow. (T = 0: everything is empty or zero.)
        grad_prefix = (grad_out.clone(memory_format=torch.contiguous_format) if want_prefix
                       else nothing(prefix_sum))
        grad_blocks = (block_residual.new_zeros((T, C, H)) if want_blocks else nothing(block_residual))
        return (grad_prefix, grad_blocks, *weight_grads(None))

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
        grad_prefix = (prefix_sum.new_empty((T, H)).copy_(dv[:, K]) if want_prefix else nothing(prefix_sum))
        if want_blocks:
            grad_blocks = block_residual.new_zeros((T, C, H))  # slots >= K: exactly zero
            grad_blocks[:, :K] = dv[:, :K]
        else:
            grad_blocks = nothing(block_residual)
    else:
        grad_prefix, grad_blocks = nothing(prefix_sum), nothing(block_residual)
    dw = ((gs * r).unsqueeze(-1) * v).sum(dim=(0, 1)) if (want_norm or want_proj) else None
    return (grad_prefix, grad_blocks, *weight_grads(dw))


def attn_res_backward_truth(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                            norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 truth of attn_res_backward: autograd of ``attn_res_truth`` from the exactly upcast inputs,
    unrounded. Returns ``(grad_prefix_sum [T, H], grad_block_residual [T, C, H] (zeros at slots >= K),
    grad_norm_weight, grad_proj_weight)`` (each weight's gradient in its shape), all float64 on prefix_sum's
    device."""
    f64 = torch.float64
    with torch.enable_grad():
        leaves = tuple(t.detach().to(f64).requires_grad_(True)
                       for t in (prefix_sum, block_residual, norm_weight, proj_weight))
        out = attn_res_truth(*leaves, num_valid_blocks, eps)
        grads = torch.autograd.grad(out, leaves, grad_out.detach().to(f64), allow_unused=True)
    return tuple(torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, leaves))

