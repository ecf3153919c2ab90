"""Ascend NPU launch policy (PrivateUse1, ``torch_npu`` + triton-ascend): the kimi_k3 ops on NPU tensors.

Every call goes one way: the cases that launch no kernel (fp64, T = 0, K = 0) -> the outputs (``FusedArgs``) -> the
plan (npu_plan.py, on this device's vector-core count and launch options) -> the launch (``launch_forward``,
``launch_add_snapshot`` for fused_attn_res.full with mix=False, or ``_backward.run_attn_res_backward``). The plans,
the tiles' Unified Buffer budgets and the cost model are in npu_plan.py.

Importing this module imports triton (triton-ascend on an Ascend host) but never torch_npu: the device properties are
read through triton-ascend's driver first, torch_npu second, both lazily. With torch_npu installed but no Ascend
runtime, even ``import torch`` fails unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. ``multibuffer=True`` (double-buffered
loads) is passed under triton-ascend only: plain Triton rejects unknown launch options. The shared
``TRITON_COMPILE_OPTIONS`` are passed everywhere but under triton-ascend (``compile_options``).

Test seam (docs/kernels.md): ``SEAM.raw_tensor`` maps a PrivateUse1 tensor to the tensor handed to Triton (identity
on real hardware; the simulated NPU of tests/test_npu_simulated.py returns the CPU tensor backing its wrapper),
``SEAM.num_vector_cores`` overrides the vector-core query and ``SEAM.forward_kernel`` forces the forward plan's
kernel. Use ``substitute(...)`` to set them for a block of code.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton

from ..kernels import attn_res_fwd as _fwd
from ..kernels import attn_res_npu as _npu_kernels
from . import TRITON_COMPILE_OPTIONS, BackwardPlan, _backward, npu_plan, prepare_weights, trivial_attn_res
from ._forward import kernel_arguments
from ._fused import (
    ADD_SNAPSHOT_FORMS,
    FULL_FORMS,
    FusedArgs,
    add_snapshot_args,
    add_snapshot_outputs,
    full_outputs,
    kernel_output,
    trivial_full_call,
    trivial_fused_attn_res,
    trivial_serving_call,
)
from .npu_plan import (
    FALLBACK_NUM_VECTOR_CORES,
    SINGLE_READ_CHUNK,
    UB_BUDGET_BYTES,
    ForwardPlan,
    npu_block_h,
    npu_bwd_block_h,
    npu_single_read_bytes,
)

__all__ = [
    # The ops' entry points (k3_ops._registration).
    "attn_res_forward",
    "fused_attn_res",
    "fused_attn_res_quant",
    "fused_attn_res_",
    "fused_attn_res_full",
    "attn_res_backward",
    "warmup",
    # The device and its plans.
    "Seam",
    "SEAM",
    "substitute",
    "raw",
    "num_vector_cores",
    "is_triton_ascend",
    "launch_options",
    "compile_options",
    "forward_plan",
    "backward_plan",
    # The launch step.
    "launch_forward",
    "launch_add_snapshot",
    # From npu_plan.py.
    "FALLBACK_NUM_VECTOR_CORES",
    "UB_BUDGET_BYTES",
    "SINGLE_READ_CHUNK",
    "ForwardPlan",
    "npu_block_h",
    "npu_single_read_bytes",
    "npu_bwd_block_h",
]


# --------------------------------------------------------------------------------------------------------------
# The test seam and the device.
# --------------------------------------------------------------------------------------------------------------
def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Seam:
    """What tests may substitute. raw_tensor: PrivateUse1 tensor -> tensor handed to Triton (its data_ptr and
    strides are used). num_vector_cores: device -> vector-core count, or None to query the device.
    forward_kernel: "single_read" or "two_pass" forces ``forward_plan``'s kernel (None: the budget decides)."""

    raw_tensor: Callable[[torch.Tensor], torch.Tensor] = _identity
    num_vector_cores: Callable[[torch.device], int] | None = None
    forward_kernel: str | None = None


SEAM = Seam()


@contextlib.contextmanager
def substitute(raw_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None,
               num_vector_cores: Callable[[torch.device], int] | None = None,
               forward_kernel: str | None = None) -> Iterator[Seam]:
    """Temporarily replace parts of ``SEAM`` (tests); restores the previous seam on exit."""
    if forward_kernel not in (None, "single_read", "two_pass"):
        raise ValueError(f"forward_kernel must be None, 'single_read' or 'two_pass', got {forward_kernel!r}")
    saved = (SEAM.raw_tensor, SEAM.num_vector_cores, SEAM.forward_kernel)
    if raw_tensor is not None:
        SEAM.raw_tensor = raw_tensor
    if num_vector_cores is not None:
        SEAM.num_vector_cores = num_vector_cores
    if forward_kernel is not None:
        SEAM.forward_kernel = forward_kernel
    try:
        yield SEAM
    finally:
        SEAM.raw_tensor, SEAM.num_vector_cores, SEAM.forward_kernel = saved


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor handed to Triton for ``t`` (through the seam)."""
    return SEAM.raw_tensor(t)


def use_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def is_triton_ascend() -> bool:
    """True when the installed triton is triton-ascend (its Ascend backend is present and active)."""
    from importlib.util import find_spec

    for name in ("triton.backends.ascend", "triton.backends.cann"):
        try:
            if find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            pass
    try:
        return triton.runtime.driver.active.get_current_target().backend in ("npu", "ascend", "cann")
    except Exception:  # no active driver (CPU-only host, interpreter): not triton-ascend
        return False


def launch_options() -> dict:
    """Extra launch keyword arguments: ``multibuffer=True`` under triton-ascend only (never in the interpreter,
    which, like plain Triton, rejects unknown options)."""
    return {"multibuffer": True} if is_triton_ascend() and not use_interpreter() else {}


def compile_options() -> dict:
    """The shared ``TRITON_COMPILE_OPTIONS``, except under triton-ascend: its Ascend backend takes
    ``enable_fp_fusion`` but never reads it (its BiSheng compiler decides contraction) and warns about it at every
    compile. Plain Triton (the interpreter, the simulated NPU) gets them."""
    return {} if is_triton_ascend() and not use_interpreter() else dict(TRITON_COMPILE_OPTIONS)


_vector_core_cache: dict[int, int] = {}


def num_vector_cores(device: torch.device) -> int:
    """Vector-core count of ``device``: the seam, else triton-ascend's driver, else torch_npu's device
    properties, else FALLBACK_NUM_VECTOR_CORES. Cached per device index."""
    if SEAM.num_vector_cores is not None:
        return int(SEAM.num_vector_cores(device))
    index = device.index if device.index is not None else 0
    n = _vector_core_cache.get(index)
    if n is not None:
        return n
    n = 0
    try:
        n = int(triton.runtime.driver.active.utils.get_device_properties(index).get("num_vectorcore", 0))
    except Exception:
        n = 0
    if n <= 0:
        try:
            import torch_npu  # noqa: F401  (lazy: only on an Ascend host)

            n = int(getattr(torch.npu.get_device_properties(index), "vector_core_num", 0) or 0)
        except Exception:
            n = 0
    if n <= 0:
        n = FALLBACK_NUM_VECTOR_CORES
    _vector_core_cache[index] = n
    return n


def forward_plan(H: int, K: int, dtype: torch.dtype, fused: bool = False) -> ForwardPlan:
    """``npu_plan.forward_plan`` with the seam's forced kernel, if any."""
    return npu_plan.forward_plan(H, K, dtype, fused, SEAM.forward_kernel)


def backward_plan(prefix_sum: torch.Tensor, num_valid_blocks: int) -> BackwardPlan:
    """``npu_plan.backward_plan`` for prefix_sum's shape, dtype and device and K."""
    return npu_plan.backward_plan(prefix_sum.size(1), int(num_valid_blocks), prefix_sum.element_size(),
                                  num_vector_cores(prefix_sum.device), launch_options(), compile_options())


# --------------------------------------------------------------------------------------------------------------
# The ops.
# --------------------------------------------------------------------------------------------------------------
def attn_res_forward(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, num_valid_blocks: int, eps: float) -> torch.Tensor:
    """kimi_k3::attn_res on Ascend NPU (PrivateUse1) tensors.

    Args (already checked by ``k3_ops._C.check_attn_res``):
        prefix_sum: [T, H] bf16/fp16/fp32 (fp64 goes to the reference), any strides.
        block_residual: [T, C, H] same dtype, any strides (token-major or block-major view); only slots < K read.
        norm_weight: [H]; proj_weight: [H] or [1, H]; any floating dtype (non bf16/fp16/fp32 cast to fp32).
        num_valid_blocks: K in [0, C]. eps: > 0.
    Returns: a new contiguous [T, H] tensor of prefix_sum.dtype on prefix_sum's device.
    """
    out = trivial_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
    if out is not None:
        return out
    T, H = prefix_sum.shape
    K = int(num_valid_blocks)
    nw, pw = prepare_weights(norm_weight, proj_weight)
    out = torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
    plan = forward_plan(H, K, prefix_sum.dtype)
    launch_forward(plan, raw(prefix_sum), raw(block_residual), raw(nw), raw(pw), raw(out), K, float(eps),
                   num_vector_cores(prefix_sum.device))
    return out


def fused_attn_res(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                   norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                   block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                   out_norm_eps: float | None = None, *, round_mix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res on Ascend NPU (PrivateUse1) tensors (arguments already checked by
    ``k3_ops._C.check_fused_attn_res``). Returns ``(out, new_prefix)``, new contiguous [T, H]; writes
    ``block_residual[:, block_write_idx]`` when ``block_write_idx >= 0``, nothing else.

    One launch of the ``forward_plan`` kernel with its fused flags (same grid and arithmetic as
    ``attn_res_forward``). Single-read: new_prefix (and the snapshot) written before or as the prefix candidate is
    read, the output norm applied to the mix row in place. Two-pass (tile width budgeted for the addend row by
    ``npu_block_h``): the add and the new_prefix / snapshot stores in pass 2, the output norm as a pass 3 over the
    program's own output row. fp64 and T = 0 run the reference composition (no kernel).
    """
    trivial = trivial_fused_attn_res(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                     eps, block_write_idx, out_norm_weight, out_norm_eps, attn_res_forward, round_mix)
    if trivial is not None:
        return trivial
    # round_mix matters only with an output norm; without one the launch is exactly the rounded-mix call's.
    serving = not round_mix and out_norm_weight is not None
    fused, out = FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                    eps if out_norm_eps is None else out_norm_eps, round_mix=not serving)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
    return out, fused.new_prefix


def fused_attn_res_quant(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                         norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                         block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                         out_norm_eps: float | None = None, *, out_dtype: torch.dtype,
                         round_mix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.quant on Ascend NPU (PrivateUse1) tensors (arguments already checked by
    ``k3_ops._C.check_fused_attn_res_quant``). Returns ``(q, new_prefix, scale)``. One launch of the
    ``forward_plan`` kernel with its serving flags: single-read, the FP8 output is quantised from the row in the
    tile; two-pass, in a last pass over the program's scratch row, once the row's scale is known. fp64 and T = 0
    run the reference composition.
    """
    trivial = trivial_serving_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                   eps, block_write_idx, out_norm_weight, out_norm_eps, inplace=False,
                                   out_dtype=out_dtype, round_mix=round_mix, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    fused, out = FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                    eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                    out_dtype=out_dtype)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
    return out, fused.new_prefix, fused.scale


def fused_attn_res_(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                    norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                    block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                    out_norm_eps: float | None = None, *, out_dtype: torch.dtype | None = None,
                    round_mix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res_ on Ascend NPU (PrivateUse1) tensors (arguments already checked by
    ``k3_ops._C.check_fused_attn_res_inplace``): the new prefix is stored back into prefix_sum in the same launch
    (single-read: before the candidate loop reads it; two-pass: in pass 2). Returns ``(out, scale)`` (scale empty
    without an FP8 out_dtype). fp64 and T = 0 run the reference composition.
    """
    trivial = trivial_serving_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                   eps, block_write_idx, out_norm_weight, out_norm_eps, inplace=True,
                                   out_dtype=out_dtype, round_mix=round_mix, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    fused, out = FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                    eps if out_norm_eps is None else out_norm_eps, inplace=True,
                                    round_mix=round_mix, out_dtype=out_dtype)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
    return out, fused.scale if fused.scale is not None else out.new_empty((0,), dtype=torch.float32)


def fused_attn_res_full(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                        norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                        block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                        out_norm_eps: float | None = None, *, round_mix: bool = True, return_mix: bool = False,
                        mix: bool = True, sum_out: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.full on Ascend NPU (PrivateUse1) tensors (arguments already checked by
    ``k3_ops._C.check_fused_attn_res_full``). Returns ``(out, new_prefix, mix)``, each output not produced an empty
    [0] tensor. Every form is one launch: the ``forward_plan`` kernel with its fused and serving flags (the new
    prefix into ``sum_out`` or, without an addend, nowhere; the rounded mix stored beside the output with
    ``return_mix``: single-read from the row in the tile, two-pass chunk by chunk in pass 2), or with ``mix=False``
    ``attn_res_add_snapshot_kernel`` over the same grid (no launch without an addend, ``sum_out`` or snapshot).
    fp64 and T = 0 run the reference composition.
    """
    trivial = trivial_full_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                block_write_idx, out_norm_weight, out_norm_eps, round_mix=round_mix,
                                return_mix=return_mix, mix=mix, sum_out=sum_out, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    if not mix:
        target, new_prefix = add_snapshot_outputs(prefix_sum, addend, sum_out)
        if target is not None or block_write_idx >= 0:
            launch_add_snapshot(raw(prefix_sum), None if addend is None else raw(addend),
                                None if target is None else raw(target), raw(block_residual), block_write_idx,
                                num_vector_cores(prefix_sum.device))
        return full_outputs(None, prefix_sum, None, new_prefix)
    fused, out = FusedArgs.allocate_full(prefix_sum, addend, block_write_idx, out_norm_weight,
                                         eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                         return_mix=return_mix, sum_out=sum_out)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
    return full_outputs(fused, prefix_sum, out, None if sum_out is not None else fused.new_prefix)


def _launch_fused(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                  proj_weight: torch.Tensor, K: int, eps: float, fused: FusedArgs, out: torch.Tensor) -> None:
    # The plan and the launch of a fused call. The two-pass kernel keeps the FP32-mix norm's and the FP8 output's
    # row between passes in an FP32 scratch row per program; the grid is at most one program per vector core, so
    # [cores, H] is enough for any T. The single-read kernel holds that row in its tile and needs none.
    cores = num_vector_cores(prefix_sum.device)
    plan = forward_plan(prefix_sum.size(1), K, prefix_sum.dtype, True)
    if fused.needs_scratch and plan.kernel == "two_pass":
        fused = fused.with_scratch(torch.empty((cores, prefix_sum.size(1)), dtype=torch.float32,
                                               device=prefix_sum.device))
    nw, pw = prepare_weights(norm_weight, proj_weight)
    launch_forward(plan, raw(prefix_sum), raw(block_residual), raw(nw), raw(pw), kernel_output(raw(out)), K,
                   float(eps), cores, fused.map(raw))


def attn_res_backward(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                      norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                      output_mask):
    """kimi_k3::attn_res_backward on Ascend NPU (PrivateUse1) tensors.

    Grid = the vector-core count (``num_vector_cores``, through the seam), program p walking a contiguous token
    range; per token two passes over H in [K_PAD, npu_bwd_block_h] tiles; the per-token statistics and softmax
    backward in double-float FP32 arithmetic (no FP64 on the vector cores); the weight gradient goes through an
    fp32 workspace [cores, H] and a fixed-order reduction (no atomics: identical bits from run to run).

    Args (already checked by ``k3_ops._C.check_attn_res_backward``):
        grad_out: [T, H] of prefix_sum.dtype, any strides (a non-unit hidden stride is copied to contiguous).
        prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps: as for ``attn_res_forward``.
        output_mask: [want grad_prefix_sum, want grad_block_residual, want grad_norm_weight,
            want grad_proj_weight].
    Returns:
        (grad_prefix_sum [T, H] of prefix_sum.dtype, grad_block_residual [T, C, H] of block_residual.dtype with
        exact zeros at slots >= K, grad_norm_weight and grad_proj_weight of each weight's shape and dtype), new
        and contiguous on prefix_sum's device; an output not asked for by output_mask is an empty 1-D tensor.
    """
    trivial = _backward.trivial_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                  num_valid_blocks, eps, output_mask)
    if trivial is not None:
        return trivial
    return _backward.run_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                           num_valid_blocks, eps, output_mask,
                                           backward_plan(prefix_sum, int(num_valid_blocks)), raw=raw)


# --------------------------------------------------------------------------------------------------------------
# The launch step.
# --------------------------------------------------------------------------------------------------------------
def launch_forward(plan: ForwardPlan, prefix_sum, block_residual, nw, pw, out, K: int, eps: float, cores: int,
                   fused: FusedArgs | None = None) -> None:
    """Launch ``plan`` 's forward on the tensors handed to Triton (``raw`` ones): the plain op, or with ``fused``
    (raw tensors too) a fused call, whose flags switch the kernel's fused variant on."""
    T = prefix_sum.size(0)
    args, runtime, flags, vec, h_strided = kernel_arguments(prefix_sum, block_residual, nw, pw, out, K, eps, fused)
    programs, tokens_per_prog = npu_plan.forward_grid(T, cores)
    args = (*args[:9], tokens_per_prog, *args[9:])
    kernel = (_npu_kernels.attn_res_npu_single_read_kernel if plan.kernel == "single_read"
              else _fwd.attn_res_npu_kernel)
    kernel[(programs,)](*args, **runtime, **npu_plan.forward_constexprs(plan, vec, h_strided,
                                                                      prefix_sum.dtype == torch.float32),
                        **flags, **launch_options(), **compile_options())


def launch_add_snapshot(prefix_sum, addend, new_prefix, block_residual, block_write_idx: int, cores: int) -> None:
    """fused_attn_res.full with mix=False on the tensors handed to Triton: ``attn_res_add_snapshot_kernel`` over the
    forward's grid (one program per vector core, each a contiguous token range), storing the new prefix into
    ``new_prefix`` (None: nowhere) and ``block_residual[:, block_write_idx]`` (>= 0)."""
    programs, tokens_per_prog = npu_plan.forward_grid(prefix_sum.size(0), cores)
    args, runtime, flags = add_snapshot_args(prefix_sum, addend, new_prefix, block_residual, block_write_idx,
                                             tokens_per_prog)
    _fwd.attn_res_add_snapshot_kernel[(programs,)](*args, **runtime, **flags, **launch_options(), **compile_options())


# --------------------------------------------------------------------------------------------------------------
# Warm-up.
# --------------------------------------------------------------------------------------------------------------
def warmup(hidden_size: int, dtype: torch.dtype, device: torch.device | str | None = None,
           max_num_valid_blocks: int = 8, max_num_tokens: int = 65536, full: bool = False,
           weight_dtype: torch.dtype | None = None) -> int:
    """Compile every NPU forward compile key for one model (one per distinct ``forward_plan`` for K in
    1..max_num_valid_blocks: one single-read kernel, or one two-pass kernel per K_PAD) before graph capture;
    returns the number of launches. ``max_num_tokens`` is accepted for symmetry with the CUDA backend: the token
    count never enters a compile key here. ``full=True`` also compiles fused_attn_res.full's call forms
    (vLLM-Ascend's: ``FULL_FORMS`` and ``ADD_SNAPSHOT_FORMS`` of backends/_fused.py) with weights of
    ``weight_dtype`` (None: the I/O dtype and fp32; the plain forward keeps its fp32 weights)."""
    del max_num_tokens
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return 0
    device = torch.device(device if device is not None else "npu")
    H = int(hidden_size)
    plans: dict[ForwardPlan, int] = {}
    for K in range(1, max_num_valid_blocks + 1):
        plans.setdefault(forward_plan(H, K, dtype), K)
    with torch.no_grad():
        w = torch.ones(H, dtype=torch.float32, device=device)
        for K in plans.values():
            prefix = torch.zeros((1, H), dtype=dtype, device=device)
            blocks = torch.zeros((1, K, H), dtype=dtype, device=device)
            attn_res_forward(prefix, blocks, w, w, K, 1e-6)
        if full:
            _warmup_full(plans, H, dtype, device, weight_dtype)
    return len(plans)


def _warmup_full(plans: dict[ForwardPlan, int], H: int, dtype: torch.dtype, device: torch.device,
                 weight_dtype: torch.dtype | None) -> None:
    for wdtype in [weight_dtype] if weight_dtype is not None else list(dict.fromkeys([dtype, torch.float32])):
        w = torch.ones(H, dtype=wdtype, device=device)
        for K in plans.values():
            prefix = torch.zeros((1, H), dtype=dtype, device=device)
            spare = torch.zeros((1, K + 1, H), dtype=dtype, device=device)
            for addend, write, norm, round_mix, ret, into in FULL_FORMS:
                fused_attn_res_full(prefix, prefix if addend else None, spare, w, w, K, 1e-6, K if write else -1,
                                    w if norm else None, None, round_mix=round_mix, return_mix=ret,
                                    sum_out=torch.empty_like(prefix) if into else None)
            for addend, write in ADD_SNAPSHOT_FORMS:
                fused_attn_res_full(prefix, prefix if addend else None, spare, w, w, K, 1e-6, K if write else -1,
                                    mix=False)
