"""Typed Python entry points for the kimi_k3 ops. Each is a thin call into torch.ops.kimi_k3.

These wrappers are the documented API: each first checks that its tensor arguments are tensors, so that a numpy
array or a list gets one line naming the argument (``TypeError: prefix_sum must be a torch.Tensor, got
numpy.ndarray``) instead of the dispatcher's page of overloads; calling ``torch.ops.kimi_k3.*`` directly gives
PyTorch's own error. Every other rule (shapes, dtypes, devices, K, eps, overlaps) is checked by the ops themselves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from . import tp

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["attn_res", "apply_attn_res", "fused_attn_res", "fused_attn_res_", "fused_attn_res_full",
           "FusedAttnResOutputs", "warmup"]


def _not_tensors(optional: tuple[str, ...] = (), **arguments: object) -> TypeError:
    """The TypeError naming the first of ``arguments`` (in order) that is not a tensor (None allowed for the names in
    ``optional``). Built only once a wrapper's own isinstance checks failed: those stay inline, as they are on the
    path of every good call (~60 ns for four, a function call per argument would be ~300 ns)."""
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor) or (value is None and name in optional):
            continue
        kind = type(value)
        where = "" if kind.__module__ == "builtins" else kind.__module__.split(".")[0] + "."
        return TypeError(f"{name} must be a torch.Tensor{' or None' if name in optional else ''}, got "
                         f"{where}{kind.__qualname__}")
    raise AssertionError("_not_tensors: every argument is a tensor")


def attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
             proj_weight: torch.Tensor, num_valid_blocks: int, eps: float) -> torch.Tensor:
    """Kimi K3 Block AttnRes: the softmax mix of the valid block snapshots and the running prefix.

    Per token t, with candidates v_i = block_residual[t, i] for i < K and v_K = prefix_sum[t], in FP32:
    ``s_i = rsqrt(mean(v_i^2) + eps) * sum(v_i * norm_weight * proj_weight)``, ``p = softmax(s)``,
    ``out[t] = sum_i p_i v_i``.

    Args:
        prefix_sum: [T, H], bf16 / fp16 / fp32 / fp64, any strides. The running residual.
        block_residual: [T, C, H], same dtype, any strides: a token-major [T, C, H] buffer or a
            block-major [C, T, H] buffer passed as ``.transpose(0, 1)``; never copied. C is capacity;
            only ``[:, :num_valid_blocks]`` is read.
        norm_weight: [H], any floating dtype. The AttnRes RMSNorm weight (folded into the score).
        proj_weight: [H] or [1, H] (an ``nn.Linear(H, 1)`` weight), any floating dtype.
        num_valid_blocks: K, with 0 <= K <= C.
        eps: RMSNorm epsilon, finite and > 0.

    Returns:
        A new contiguous [T, H] tensor of ``prefix_sum.dtype``; equal to ``prefix_sum`` when K = 0.
    """
    Tensor = torch.Tensor
    if not (isinstance(prefix_sum, Tensor) and isinstance(block_residual, Tensor) and isinstance(norm_weight, Tensor)
            and isinstance(proj_weight, Tensor)):
        raise _not_tensors(prefix_sum=prefix_sum, block_residual=block_residual, norm_weight=norm_weight,
                           proj_weight=proj_weight)
    return torch.ops.kimi_k3.attn_res.default(prefix_sum, block_residual, norm_weight, proj_weight,
                                               num_valid_blocks, eps)


def _require_fused(prefix_sum: object, addend: object, block_residual: object, norm_weight: object,
                   proj_weight: object, out_norm_weight: object, sum_out: object = None) -> None:
    """The serving wrappers' tensor arguments are tensors (addend, out_norm_weight and sum_out may be None)."""
    Tensor = torch.Tensor
    if not (isinstance(prefix_sum, Tensor) and (addend is None or isinstance(addend, Tensor))
            and isinstance(block_residual, Tensor) and isinstance(norm_weight, Tensor)
            and isinstance(proj_weight, Tensor) and (out_norm_weight is None or isinstance(out_norm_weight, Tensor))
            and (sum_out is None or isinstance(sum_out, Tensor))):
        raise _not_tensors(("addend", "out_norm_weight", "sum_out"), prefix_sum=prefix_sum, addend=addend,
                           block_residual=block_residual, norm_weight=norm_weight, proj_weight=proj_weight,
                           out_norm_weight=out_norm_weight, sum_out=sum_out)


def fused_attn_res(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                   norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float, *,
                   block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                   out_norm_eps: float | None = None, round_mix: bool = True, out_dtype: torch.dtype | None = None,
                   tp_group: ProcessGroup | str | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The serving variant of :func:`attn_res`: residual add, block snapshot, mix and the following RMSNorm.

    Computes, with the rounding points of docs/fused_attn_res.md::

        new_prefix = prefix_sum + addend                       # rounded to the I/O dtype (torch's own add)
        if block_write_idx >= 0:
            block_residual[:, block_write_idx] = new_prefix    # IN PLACE: the block snapshot
        mix = attn_res(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
        out = mix if out_norm_weight is None else rms_norm(mix, out_norm_weight, out_norm_eps)
        if out_dtype is not None:
            q, scale = fp8_quant(out, out_dtype)               # per-token dynamic scale

    Args:
        prefix_sum: [T, H], bf16 / fp16 / fp32 / fp64, any strides. The running residual; never written.
        addend: [T, H] like prefix_sum (same dtype and device), any strides, or None (no add; new_prefix is
            then a copy of prefix_sum). The sublayer output to add; never written.
        block_residual: [T, C, H], prefix_sum's dtype, any strides: a token-major [T, C, H] buffer or a
            block-major [C, T, H] buffer passed as ``.transpose(0, 1)``; never copied. Only
            ``[:, :num_valid_blocks]`` is read; only ``[:, block_write_idx]`` is written (mutated in place,
            its version counter is bumped), every other byte is left as it was.
        norm_weight: [H], any floating dtype. The AttnRes RMSNorm weight (folded into the score).
        proj_weight: [H] or [1, H] (an ``nn.Linear(H, 1)`` weight), any floating dtype.
        num_valid_blocks: K, with 0 <= K <= C.
        eps: the AttnRes RMSNorm epsilon, finite and > 0.
        block_write_idx: -1 (no snapshot) or the free slot to snapshot new_prefix into,
            ``num_valid_blocks <= block_write_idx < C``. The snapshot is not one of this call's candidates;
            pass ``num_valid_blocks + 1`` to the next call to include it.
        out_norm_weight: [H], any floating dtype, or None (out is the mix). The weight of the RMSNorm that
            follows the mix (e.g. the next input_layernorm); the norm runs in FP32.
        out_norm_eps: that norm's epsilon, finite and > 0; None means ``eps``. Needs ``out_norm_weight``.
        round_mix: what the output norm sees: True (default) the mix rounded to the I/O dtype, so that
            fused == rms_norm(attn_res(...)) of the unfused ops; False the FP32 mix (vLLM's kernels). No effect
            without ``out_norm_weight``.
        out_dtype: None, or ``torch.float8_e4m3fn`` / ``torch.float8_e4m3fnuz`` for an FP8 output: the (normed)
            output rounded to the I/O dtype, ``scale = max(amax, 1e-10) / fp8_max`` per token (fp8_max 448 for
            e4m3fn, 224 for e4m3fnuz as vLLM uses), ``q = clamp(out / scale, -fp8_max, fp8_max)`` rounded to
            nearest even (``kimi_k3::fused_attn_res.quant``).
        tp_group: None, or a ``torch.distributed`` ProcessGroup (or its group name) over which ``addend`` is this
            rank's partial sum (tensor parallelism): the addend is then ``kimi_k3::tp_all_reduce(addend, group)``, the
            sum over the ranks rounded to the I/O dtype (docs/tp.md), and every rank gets the same outputs. Call it
            on every rank of the group with the same shapes. A group of one rank adds the partial as it is.

    Returns:
        ``(out, new_prefix)``: two new contiguous [T, H] tensors of ``prefix_sum.dtype``. new_prefix is the
        running residual for the next layer (never an alias of prefix_sum). With ``out_dtype``:
        ``(q, new_prefix, scale)``, q [T, H] of out_dtype and scale [T, 1] fp32 (``q.float() * scale`` ~ out).

    Inference only: with grad mode on and any input requiring grad it raises (use :func:`attn_res` for
    training). Bad arguments raise before anything is written.
    """
    _require_fused(prefix_sum, addend, block_residual, norm_weight, proj_weight, out_norm_weight)
    if tp_group is not None:
        addend = tp.reduce_addend(addend, tp_group)
    if out_dtype is not None:
        return torch.ops.kimi_k3.fused_attn_res.quant(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                                       num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                                       out_norm_eps, out_dtype=out_dtype, round_mix=round_mix)
    return torch.ops.kimi_k3.fused_attn_res.default(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                                     num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                                     out_norm_eps, round_mix=round_mix)


def fused_attn_res_(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                    norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float, *,
                    block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                    out_norm_eps: float | None = None, round_mix: bool = True, out_dtype: torch.dtype | None = None,
                    tp_group: ProcessGroup | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-place serving call (``kimi_k3::fused_attn_res_``): :func:`fused_attn_res` with the running residual
    updated IN PLACE, as vLLM's Kimi K3 model keeps it::

        prefix_sum += addend                                   # IN PLACE, rounded to the I/O dtype
        if block_write_idx >= 0:
            block_residual[:, block_write_idx] = prefix_sum    # IN PLACE: the block snapshot
        out = mix / norm / FP8 of the updated prefix_sum, as in fused_attn_res

    Args: as :func:`fused_attn_res`, except
        prefix_sum: [T, H], any strides but no broadcast (stride-0) dimension when an addend is given. Written in
            place with round(prefix_sum + addend) when ``addend`` is given (its version counter is bumped on every
            call), read only otherwise. Must not overlap ``addend`` other than exactly, nor ``block_residual``.

    Returns:
        ``(out, scale)``: out a new contiguous [T, H] of ``prefix_sum.dtype`` (or ``out_dtype``); scale [T, 1]
        fp32 with an FP8 ``out_dtype``, else an empty [0] fp32 tensor. One kernel launch on CUDA and NPU, the
        in-place prefix store included; under torch.compile the mutation is functionalized and reinplaced (no
        copy of prefix_sum or the buffer).

    With ``tp_group`` (tensor parallelism; see :func:`fused_attn_res`) ``addend`` is this rank's partial sum and
    ``prefix_sum += all_reduce(addend)``: two launches on CUDA, the one-shot all-reduce over symmetric memory (or
    NCCL's, by the size rule of k3_ops.tp) and this op; the caller's addend is never written.
    """
    _require_fused(prefix_sum, addend, block_residual, norm_weight, proj_weight, out_norm_weight)
    if tp_group is not None:
        addend = tp.reduce_addend(addend, tp_group)
    return torch.ops.kimi_k3.fused_attn_res_.default(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                                      num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                                      out_norm_eps, out_dtype=out_dtype, round_mix=round_mix)


class FusedAttnResOutputs(NamedTuple):
    """What :func:`fused_attn_res_full` returns; see there for which tensor each one is."""

    out: torch.Tensor
    new_prefix: torch.Tensor
    mix: torch.Tensor


def fused_attn_res_full(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                        norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float, *,
                        block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                        out_norm_eps: float | None = None, round_mix: bool = True, return_mix: bool = False,
                        mix: bool = True, sum_out: torch.Tensor | None = None) -> FusedAttnResOutputs:
    """The serving call with every output switchable (``kimi_k3::fused_attn_res.full``): vLLM-Ascend's fused AttnRes
    call forms (docs/fused_attn_res.md, "Every output")::

        new_prefix = prefix_sum + addend                       # rounded to the I/O dtype; into sum_out if given
        if block_write_idx >= 0:
            block_residual[:, block_write_idx] = new_prefix    # IN PLACE: the block snapshot
        if mix:
            m = attn_res(new_prefix, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
            out = m if out_norm_weight is None else rms_norm(m, out_norm_weight, out_norm_eps)

    Args: as :func:`fused_attn_res` (prefix_sum, addend, block_residual, weights, K, eps, block_write_idx, the output
    norm and ``round_mix``: the norm of the mix rounded to the I/O dtype, or of the FP32 mix), plus
        return_mix: also return the pre-norm mix rounded to prefix_sum's dtype ([T, H], contiguous): with
            ``round_mix`` exactly the tensor the output norm normalises. Needs ``mix``.
        mix: False: only the add and the snapshot (one launch, nothing read from the buffer): a pipeline-parallel
            boundary. Takes no output norm and no ``return_mix``.
        sum_out: [T, H] of prefix_sum's dtype and device, contiguous rows at any token stride, sharing no memory with
            prefix_sum, addend or block_residual: the new prefix is stored here (mutated in place, its version counter
            bumped); without an addend it receives a copy of prefix_sum.

    Returns:
        ``FusedAttnResOutputs(out, new_prefix, mix)``, with the aliases made explicit:

        - ``new_prefix`` IS ``sum_out`` when given, IS ``prefix_sum`` when there is neither an addend nor ``sum_out``
          (nothing is copied), else a new contiguous [T, H] tensor;
        - ``out``: a new contiguous [T, H] tensor; with ``mix=False`` it IS ``new_prefix`` (vLLM-Ascend's op returns
          the unmixed new prefix there as its output, a copy of the same values);
        - ``mix``: a new contiguous [T, H] tensor with ``return_mix`` and an output norm; otherwise it IS ``out``
          (without an output norm the pre-norm mix is ``out`` itself, without ``return_mix`` nothing else is
          returned, as vLLM-Ascend's ``materialized``).

    Inference only (see :func:`fused_attn_res`). Bad arguments raise before anything is written.
    """
    # Without an output norm the mix is out itself: nothing to store twice. With mix=False the op sees return_mix
    # as given, so that it refuses the combination.
    _require_fused(prefix_sum, addend, block_residual, norm_weight, proj_weight, out_norm_weight, sum_out)
    store_mix = return_mix and (out_norm_weight is not None or not mix)
    out, new_prefix, mixed = torch.ops.kimi_k3.fused_attn_res.full(
        prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
        out_norm_weight, out_norm_eps, round_mix=round_mix, return_mix=store_mix, mix=mix, sum_out=sum_out)
    if sum_out is not None:
        new_prefix = sum_out
    elif addend is None:
        new_prefix = prefix_sum
    if not mix:
        out = new_prefix
    return FusedAttnResOutputs(out, new_prefix, mixed if store_mix else out)


def warmup(hidden_size: int, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None, *,
           max_num_valid_blocks: int = 8, max_num_tokens: int = 65536, serving: bool = False,
           weight_dtype: torch.dtype | None = None, full: bool = False) -> int:
    """Compile every kernel variant the launch table can pick for one model, before CUDA/NPU-graph capture.

    Capture must not compile or allocate: call this once per (hidden_size, dtype, device) after loading the
    model and before capturing. It runs each distinct launch configuration (compile key) that token counts
    1..max_num_tokens and K = 1..max_num_valid_blocks can select once on a small zero-filled problem, which
    also caches its launch handle. Token counts and K never enter a compile key, so nothing compiles afterwards
    for any T or K in range (non-unit hidden strides excepted, see docs/kernels.md).

    Args:
        hidden_size: H. dtype: the I/O dtype (bf16 / fp16 / fp32; fp64 and CPU run the reference: no-op).
        device: a CUDA or Ascend NPU (PrivateUse1) device; None means the current CUDA device.
        serving: CUDA: also the in-place serving call vLLM's Kimi K3 model makes (``fused_attn_res_`` with the
            FP32-mix output norm, with and without a delta and the snapshot).
        weight_dtype: the dtype of the norm / projection weights (part of a compile key); None compiles for the
            I/O dtype and fp32. NPU: for the ``full`` forms only (its plain forward compiles for fp32 weights).
        full: also :func:`fused_attn_res_full`'s call forms as vLLM-Ascend's model makes them (its fused op with
            and without an addend, snapshot and the pre-norm mix returned; the new prefix into ``sum_out`` with the
            FP32-mix norm; ``mix=False``), on CUDA and NPU.
    Returns:
        The number of kernel configurations run (0 where nothing needs compiling).
    """
    if device is None:
        if not torch.cuda.is_available():
            return 0
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda":
        from .backends import cuda as backend  # lazy: importing k3_ops never imports triton
    elif device.type == torch._C._get_privateuse1_backend_name():
        from .backends import npu as backend  # lazy: importing k3_ops never imports torch_npu / triton-ascend
    else:
        return 0  # CPU: the reference needs no compilation
    extra = dict(full=full, weight_dtype=weight_dtype)
    if device.type == "cuda":
        extra["serving"] = serving
    return backend.warmup(hidden_size, dtype, device, max_num_valid_blocks=max_num_valid_blocks,
                          max_num_tokens=max_num_tokens, **extra)


class _RMSNormLike(Protocol):
    weight: torch.Tensor


class _LinearLike(Protocol):
    weight: torch.Tensor


def _norm_eps(norm: _RMSNormLike) -> float:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(norm, name, None)
        if eps is not None:
            return float(eps)
    raise TypeError(f"norm must carry its epsilon as .variance_epsilon or .eps, got {type(norm).__name__} "
                    "with neither")


def apply_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj: _LinearLike,
                   norm: _RMSNormLike, num_valid_blocks: int) -> torch.Tensor:
    """Drop-in for the serving engines' ``apply_attn_res(prefix_sum, block_residual, proj, norm, K)`` helper.

    ``norm`` is an RMSNorm-like module (``.weight`` [H] and ``.variance_epsilon`` or ``.eps``); ``proj`` is
    an ``nn.Linear(H, 1)``-like module (``.weight`` [1, H]). Equivalent to
    ``attn_res(prefix_sum, block_residual, norm.weight, proj.weight, num_valid_blocks, eps)``.
    """
    return attn_res(prefix_sum, block_residual, norm.weight, proj.weight, num_valid_blocks, _norm_eps(norm))
