"""Drop-ins for vLLM-Ascend's own Kimi K3 model (``vllm_ascend.models.kimi_k3`` and ``kimi_k3_text``): its AttnRes
call forms with their exact semantics, each one ``torch.ops.kimi_k3`` call. See docs/integration.md.

vLLM-Ascend registers its own Kimi K3 classes, so on an NPU vLLM's ``vllm.models.kimi_k3`` kernels are never called;
its model makes these calls instead (all inside ``@support_torch_compile``):

1. ``apply_attn_res(prefix_sum, block_residual, proj, norm)``: the Triton module global, K = ``block_residual.size(1)``
   (the buffer grows by ``torch.cat``), behind ``_apply_attention_residual(prefix_sum, block_residual, projection,
   norm)``, which adds the flash-comm ``torch.ops.vllm.maybe_chunk_residual`` step (:func:`apply_attention_residual`).
2. ``_apply_ascend_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks)``: ``prefix_sum`` itself when
   K <= 0, else the mix of a preallocated buffer's first K slots (:func:`apply_ascend_attn_res`; the Triton global it
   calls takes K as a fifth argument, which :func:`apply_attn_res` accepts too).
3. ``torch.ops._C_ascend.attn_res_fwd(prefix_sum, addend, block_residual, proj_weight, norm_weight, norm_eps,
   num_valid_blocks, output_norm_weight=None, output_norm_eps=1e-5, block_write_idx=-1, return_materialized=False,
   mix=True, optimize_prefill=False) -> (output, raw_prefix, materialized)``: the AscendC op of A3 / A5
   (:func:`attn_res_fwd`; its first, five-argument form is :func:`attn_res_fwd_mix`).
4. ``apply_attn_res(prefix_sum, block_residual, proj, norm, *, addend=None, sum_out=None, out_norm=None)``: the Triton
   global with the residual add and the following RMSNorm fused (:func:`apply_attn_res` with those keywords).

``proj`` / ``projection`` is a ``ReplicatedLinear(H, 1)``-like module (``.weight`` [1, H]); ``norm`` / ``out_norm``
an RMSNorm-like module (``.weight`` [H], ``.variance_epsilon`` or ``.eps``). ``k3_ops.vllm_plugin`` installs these in
place of the model's own functions (``K3_OPS_PATCH_ATTN_RES=auto``).
"""
from __future__ import annotations

from typing import Any

import torch

from k3_ops.ops import _LinearLike, _norm_eps, _not_tensors, _RMSNormLike

__all__ = ["apply_attn_res", "apply_attention_residual", "apply_ascend_attn_res", "attn_res_fwd", "attn_res_fwd_mix"]


def apply_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj: _LinearLike, norm: _RMSNormLike,
                   num_valid_blocks: int | None = None, *, addend: torch.Tensor | None = None,
                   sum_out: torch.Tensor | None = None, out_norm: _RMSNormLike | None = None) -> torch.Tensor:
    """vLLM-Ascend's Triton ``apply_attn_res`` (forms 1, 2 and 4), on k3_ops's kernels.

    Without keywords: the mix of ``block_residual[:, :K]`` and ``prefix_sum`` (``kimi_k3::attn_res``), with
    K = ``num_valid_blocks``, or ``block_residual.size(1)`` when it is None (form 1's growing buffer). With the
    keywords (form 4; one ``kimi_k3::fused_attn_res.full`` call): the mix reads round(prefix_sum + addend) in place of
    prefix_sum, that sum is stored into ``sum_out`` (the caller's [T, H] buffer, e.g. the next layer's running
    residual) when given, and ``out_norm`` (the RMSNorm that follows the mix) normalises the FP32 mix. prefix_sum,
    addend and block_residual are never written. Returns the output only, a new [T, H] tensor of prefix_sum's dtype.

    Shapes: prefix_sum, addend, sum_out [T, H]; block_residual [T, C, H] (any strides); ``proj.weight`` [1, H] or
    [H]; ``norm.weight`` and ``out_norm.weight`` [H].
    """
    Tensor = torch.Tensor
    if not (isinstance(prefix_sum, Tensor) and isinstance(block_residual, Tensor)
            and (addend is None or isinstance(addend, Tensor)) and (sum_out is None or isinstance(sum_out, Tensor))):
        raise _not_tensors(("addend", "sum_out"), prefix_sum=prefix_sum, block_residual=block_residual, addend=addend,
                           sum_out=sum_out)
    K = block_residual.size(1) if num_valid_blocks is None else num_valid_blocks
    eps = _norm_eps(norm)
    if addend is None and sum_out is None and out_norm is None:
        return torch.ops.kimi_k3.attn_res.default(prefix_sum, block_residual, norm.weight, proj.weight, K, eps)
    out, _, _ = torch.ops.kimi_k3.fused_attn_res.full(
        prefix_sum, addend, block_residual, norm.weight, proj.weight, K, eps, -1,
        None if out_norm is None else out_norm.weight, None if out_norm is None else _norm_eps(out_norm),
        round_mix=False, sum_out=sum_out)
    return out


def _flash_comm(prefix_sum: torch.Tensor, mixed: torch.Tensor, extra_ctx: Any) -> torch.Tensor:
    # The model's own step after the mix: with FlashComm on, vLLM-Ascend re-anchors the mix's token dimension to
    # prefix_sum's (TP-local) one through its residual-chunking op, so later layers keep a dynamic token count.
    if extra_ctx is not None and extra_ctx.flash_comm_v1_enabled:
        mixed = torch.ops.vllm.maybe_chunk_residual(prefix_sum, mixed)
    return mixed


def apply_attention_residual(prefix_sum: torch.Tensor, block_residual: torch.Tensor, projection: _LinearLike,
                             norm: _RMSNormLike, *, extra_ctx: Any = None) -> torch.Tensor:
    """The release line's ``_apply_attention_residual`` (form 1 and its wrapper), on k3_ops's kernels.

    The mix of every slot of ``block_residual`` (K = ``block_residual.size(1)``) and ``prefix_sum``, then, when
    ``extra_ctx.flash_comm_v1_enabled`` (``extra_ctx``: vLLM-Ascend's ``_EXTRA_CTX``, read at every call as the model
    reads it), ``torch.ops.vllm.maybe_chunk_residual(prefix_sum, mixed)``. This replaces the model's whole wrapper:
    its Triton global, its AscendC call on A3 / A5 and its eager fallback. Returns a new [T, H] tensor.
    """
    return _flash_comm(prefix_sum, apply_attn_res(prefix_sum, block_residual, projection, norm), extra_ctx)


def apply_ascend_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj: _LinearLike,
                          norm: _RMSNormLike, num_valid_blocks: int, *, extra_ctx: Any = None) -> torch.Tensor:
    """The main line's ``_apply_ascend_attn_res`` (form 2), on k3_ops's kernels.

    ``prefix_sum`` itself (the same tensor, no copy) when ``num_valid_blocks <= 0``; else the mix of
    ``block_residual[:, :num_valid_blocks]`` (a preallocated [T, C, H] buffer; slots >= K are never read) and
    prefix_sum, a new [T, H] tensor, followed by the flash-comm step of :func:`apply_attention_residual` where the
    model's version has one (pass its ``_EXTRA_CTX`` as ``extra_ctx``). The layer snapshots separately
    (``block_residual[:, block_write_idx].copy_(prefix_sum)``).
    """
    if not isinstance(prefix_sum, torch.Tensor):  # returned as it is when K <= 0: never a numpy array
        raise _not_tensors(prefix_sum=prefix_sum)
    if num_valid_blocks <= 0:
        return prefix_sum
    return _flash_comm(prefix_sum, apply_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks),
                       extra_ctx)


def attn_res_fwd(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                 proj_weight: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, num_valid_blocks: int,
                 output_norm_weight: torch.Tensor | None = None, output_norm_eps: float = 1e-5,
                 block_write_idx: int = -1, return_materialized: bool = False, mix: bool = True,
                 optimize_prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM-Ascend's AscendC op ``torch.ops._C_ascend.attn_res_fwd`` (form 3), on one ``kimi_k3::fused_attn_res.full``
    call, with the op's signature, defaults and returns::

        raw_prefix = round(prefix_sum + addend)          # prefix_sum itself without an addend
        if block_write_idx >= 0:
            block_residual[:, block_write_idx] = raw_prefix      # IN PLACE, num_valid_blocks <= block_write_idx < C
        materialized = round(mix of block_residual[:, :num_valid_blocks] and raw_prefix)   # raw_prefix when not mix
        output = rms_norm(materialized, output_norm_weight, output_norm_eps) if output_norm_weight else materialized

    The output norm reads the mix already rounded to the I/O dtype (the AscendC op's rounding point; vLLM's kernels
    and form 4 normalise the FP32 mix instead). Returns ``(output, raw_prefix, materialized)``: ``raw_prefix`` IS
    ``prefix_sum`` without an addend (else a new tensor); ``materialized`` IS ``output`` unless
    ``return_materialized`` (speculative decoding captures the pre-norm mix). ``mix=False`` (a pipeline-parallel
    boundary) skips the mix: output is raw_prefix (normed when a norm weight is given), in a new tensor, as the
    AscendC op's. ``optimize_prefill`` picks the AscendC op's prefill tiling; k3_ops's launch table chooses its own
    plan, so it has no effect here. prefix_sum and addend are never written.

    The AscendC op takes bf16 with contiguous rows; k3_ops takes every dtype and stride its ops take.
    """
    del optimize_prefill  # a tiling hint of the AscendC op (see the docstring)
    Tensor = torch.Tensor
    if not (isinstance(prefix_sum, Tensor) and (addend is None or isinstance(addend, Tensor))
            and isinstance(block_residual, Tensor) and isinstance(proj_weight, Tensor)
            and isinstance(norm_weight, Tensor)
            and (output_norm_weight is None or isinstance(output_norm_weight, Tensor))):
        raise _not_tensors(("addend", "output_norm_weight"), prefix_sum=prefix_sum, addend=addend,
                           block_residual=block_residual, proj_weight=proj_weight, norm_weight=norm_weight,
                           output_norm_weight=output_norm_weight)
    capacity = block_residual.size(1)
    if not mix:
        # Without the mix the call below asks for K = 0 (the mix of the new prefix alone is that prefix exactly);
        # the AscendC op still checks the caller's K and snapshot slot, so they are checked here.
        if not 0 <= num_valid_blocks <= capacity:
            raise ValueError(f"num_valid_blocks must be in [0, block_residual.size(1)={capacity}], "
                             f"got {num_valid_blocks}")
        if 0 <= block_write_idx < num_valid_blocks:
            raise ValueError(f"block_write_idx must be -1 or in [num_valid_blocks={num_valid_blocks}, "
                             f"block_residual.size(1)={capacity}), got {block_write_idx}")
    out, new_prefix, materialized = torch.ops.kimi_k3.fused_attn_res.full(
        prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks if mix else 0, norm_eps,
        block_write_idx, output_norm_weight, None if output_norm_weight is None else output_norm_eps,
        round_mix=True, return_mix=return_materialized)
    raw_prefix = prefix_sum if addend is None else new_prefix
    return out, raw_prefix, (materialized if return_materialized else out)


def attn_res_fwd_mix(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj_weight: torch.Tensor,
                     norm_weight: torch.Tensor, norm_eps: float = 1e-5) -> torch.Tensor:
    """The AscendC op's first form, ``torch.ops._C_ascend.attn_res_fwd(prefix_sum, block_residual, proj_weight,
    norm_weight, norm_eps=1e-5) -> output``: the mix of every slot of ``block_residual`` (the model passes
    ``block_residual[:, :num_valid_blocks]``) and prefix_sum, one ``kimi_k3::attn_res`` call."""
    Tensor = torch.Tensor
    if not (isinstance(prefix_sum, Tensor) and isinstance(block_residual, Tensor) and isinstance(proj_weight, Tensor)
            and isinstance(norm_weight, Tensor)):
        raise _not_tensors(prefix_sum=prefix_sum, block_residual=block_residual, proj_weight=proj_weight,
                           norm_weight=norm_weight)
    return torch.ops.kimi_k3.attn_res.default(prefix_sum, block_residual, norm_weight, proj_weight,
                                              block_residual.size(1), norm_eps)
