"""Ascend NPU launch policy (PrivateUse1, ``torch_npu`` + triton-ascend) for the kimi_k3 Triton kernels.

Importing this module imports triton (triton-ascend on an Ascend host) but never torch_npu: the device
properties are read through triton-ascend's driver first, torch_npu second, both lazily. With torch_npu
installed but no Ascend runtime, even ``import torch`` fails unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.

Configuration (forward, ``attn_res_forward`` and ``fused_attn_res``), chosen by ``forward_plan``:

- grid = the device's vector-core count (``num_vectorcore`` from
  ``triton.runtime.driver.active.utils.get_device_properties``, else torch_npu's device properties, else
  ``FALLBACK_NUM_VECTOR_CORES`` = 48, an Atlas A2 / 910B's 24 AI cores x 2 vector cores; a wrong guess only
  costs an extra wave or idle cores, never correctness); program p walks the contiguous token range
  [p * ceil(T / cores), (p + 1) * ceil(T / cores)).
- "single_read" (``kernels.attn_res_npu.attn_res_npu_single_read_kernel``) wherever its working set fits the
  Unified Buffer budget (``npu_single_read_bytes`` <= ``UB_BUDGET_BYTES``: bf16 / fp16 up to H = 8192, the Kimi
  K3 hidden size 7168 included; fp32 up to H = 4096): per token the K + 1 candidate rows stream through one
  [next_power_of_2(H)] row tile into an online softmax, each read once. K is a runtime argument and not part of
  the compile key.
- "two_pass" (``kernels.attn_res_fwd.attn_res_npu_kernel``) where a row does not fit: per token, two passes over
  H in [K_PAD, BLOCK_H] tiles (K_PAD = next_power_of_2(K + 1), a compile-time constant): pass 1 accumulates
  sum(v^2) and <v, w> per candidate, then the softmax; pass 2 re-reads the tiles and writes the output chunk.
- The fused op takes the same plan as the plain op of its shape (the choice does not depend on the fused flags),
  so its mix equals ``attn_res(new_prefix, ...)`` bit for bit.
- ``multibuffer=True`` (double-buffered loads) only under triton-ascend: plain Triton rejects unknown launch
  options. The shared ``TRITON_COMPILE_OPTIONS`` everywhere but under triton-ascend (``compile_options``).

Cost model (bytes moved per token; no throughput figure is claimed without hardware), s = itemsize:

- single_read: (K + 2) H s (every candidate row read once, the output written once), the folded weight row
  once per program (not per token). Fused: + H s for the addend, + H s for new_prefix, + H s for the snapshot;
  with an addend new_prefix is also read back once (the program's own row, just written, so likely from L2), and
  the output norm reads its weight row per token.
- two_pass: (2 (K + 1) + 1) H s (every candidate row read twice), the weights once per hidden chunk per token
  (L2). It is kept for rows that do not fit: a [K + 1, H] working set (H = 7168: 16 x 7168 x 4 B = 458 KB in
  FP32) can never stay in the UB, and the single-read row tile needs the whole row (a row's softmax weight is
  known only after the whole row is reduced), e.g. 32 B per column for fp32, 256 KB at H = 7168.
- Parallelism: one program per vector core (48 on an Atlas A2), each streaming its own tokens; at T < cores
  only T cores work (decode at T = 1 uses one vector core).
- UB budget: ``UB_BUDGET_BYTES`` = 160 KB of the vector core's 192 KB Unified Buffer for one program's tiles,
  the rest left to the compiler; per-tile estimates in ``npu_single_read_bytes`` and ``npu_block_h``. They are
  estimates: only CANN's bishengir-compile decides the real allocation (docs/kernels.md, "Compile check").

Test seam (explicit, documented in docs/kernels.md): ``SEAM.raw_tensor`` maps a PrivateUse1 tensor to the
tensor handed to Triton (identity on real hardware; the simulated NPU of tests/test_npu_simulated.py returns
the CPU tensor backing its wrapper), ``SEAM.num_vector_cores`` overrides the vector-core query and
``SEAM.forward_kernel`` forces the forward plan's kernel. Use ``substitute(...)`` to set them for a block of code.
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
from . import (
    TRITON_COMPILE_OPTIONS,
    _backward,
    hidden_strided,
    next_power_of_2,
    prepare_weights,
    stride_vec,
    trivial_attn_res,
)
from ._fused import FusedArgs as _FusedArgs
from ._fused import (
    add_snapshot_args,
    add_snapshot_outputs,
    full_outputs,
    fused_hidden_dims,
    fused_kernel_args,
    fused_token_strides,
    kernel_output,
    trivial_full_call,
    trivial_fused_attn_res,
    trivial_serving_call,
)

__all__ = [
    "FALLBACK_NUM_VECTOR_CORES",
    "UB_BUDGET_BYTES",
    "Seam",
    "SEAM",
    "substitute",
    "raw",
    "num_vector_cores",
    "is_triton_ascend",
    "launch_options",
    "compile_options",
    "npu_block_h",
    "npu_single_read_bytes",
    "ForwardPlan",
    "forward_plan",
    "attn_res_forward",
    "fused_attn_res",
    "fused_attn_res_quant",
    "fused_attn_res_",
    "fused_attn_res_full",
    "warmup",
    "npu_bwd_block_h",
    "attn_res_backward",
    "backward_plan",
]

# --------------------------------------------------------------------------------------------------------------
# Common helpers (shared with the backward / fused launch functions added to this module).
# --------------------------------------------------------------------------------------------------------------
FALLBACK_NUM_VECTOR_CORES = 48

#: Bytes of the vector core's ~192 KB Unified Buffer that one program's tiles may use; the rest is left to the
#: compiler (scalars, masks, index vectors, reduction scratch).
UB_BUDGET_BYTES = 160 * 1024


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
    """The shared ``TRITON_COMPILE_OPTIONS``, except under triton-ascend: its Ascend backend (3.2) takes
    ``enable_fp_fusion`` but never reads it (its BiSheng compiler decides contraction) and prints a "DO NOT tune
    args" warning for it at every compile. Plain Triton (the interpreter, the simulated NPU) gets them."""
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


def npu_block_h(H: int, k_pad: int, itemsize: int, compensated: bool = False, fused: bool = False) -> int:
    """Largest power-of-two hidden tile (<= next_pow2(H), >= 16) whose working set fits UB_BUDGET_BYTES.

    Bytes per tile column: the [K_PAD] candidate values loaded in the I/O dtype, double-buffered by
    multibuffer (2 * itemsize), converted to FP32 (4) and one FP32 product temporary (x * x, x * w or p * x: 4),
    so K_PAD * (2 * itemsize + 8); for the compensated sums of fp32 I/O add K_PAD * 28 (four FP32 (hi, lo)
    accumulator tiles that live across the chunk loop, 16, and three TwoSum temporaries, 12); plus the prefix
    row (2 * itemsize + 4), the two weight rows and the folded w (3 * 4) and the output row (4 + itemsize).
    bf16, K_PAD = 16 (K <= 15): 218 B per column -> BLOCK_H = 512 (109 KB); K_PAD = 8: 122 B -> 1024
    (122 KB); fp32 (compensated), K_PAD = 16: 736 B -> 128 (92 KB).
    Fused (fused_attn_res): the addend row, double-buffered and in FP32 (2 * itemsize + 4), and the rounded
    new_prefix row stored to new_prefix / the snapshot (itemsize): 3 * itemsize + 4 more per column (bf16, K_PAD
    = 16: 228 B -> still 512). The output norm's pass 3 holds only an output row and the norm weight, less
    than pass 2.
    """
    per_col = k_pad * (2 * itemsize + 8 + (28 if compensated else 0)) + (2 * itemsize + 4) + 12 + (4 + itemsize)
    if fused:
        per_col += 3 * itemsize + 4
    limit = next_power_of_2(H)
    block = 16
    while block * 2 <= limit and block * 2 * per_col <= UB_BUDGET_BYTES:
        block *= 2
    return block


#: Hidden elements per piece of the single-read kernel's new_prefix pre-pass (fused with an addend): small tiles,
#: so the pre-pass adds nothing to the row-wide working set.
SINGLE_READ_CHUNK = 1024


def npu_single_read_bytes(H: int, itemsize: int, compensated: bool = False) -> int:
    """Estimated Unified Buffer bytes of one ``attn_res_npu_single_read_kernel`` program, at its row tile
    BLOCK_H = next_power_of_2(H) (the masked tail is allocated too).

    Bytes per tile column: the row in flight in the I/O dtype, double-buffered by multibuffer (2 * itemsize), its
    FP32 copy (4; none for fp32, whose load is FP32 already), one FP32 product row (x * x, x * w or p * x: 4),
    the FP32 accumulator row (4) and the folded FP32 weight row (4), which stays for all of the program's
    tokens; fp32 I/O (compensated) adds the second product row and the first level of the double-float tree
    (hi and lo of two half-width sums): 4 + 8. bf16 / fp16: 20 B per column, so H <= 8192 fits 160 KB (H = 7168
    pads to 8192: 160 KB); fp32: 32 B, so H <= 4096 (128 KB), H = 7168 does not (256 KB).
    The fused variants add no row-wide tile: the new_prefix pre-pass works in SINGLE_READ_CHUNK pieces before
    the candidate loop, and the output norm's weight row (itemsize + 4) is live only after the loop, in place of
    the row-in-flight buffers.
    """
    per_col = 2 * itemsize + (4 if itemsize < 4 else 0) + 4 + 4 + 4 + (12 if compensated else 0)
    return max(16, next_power_of_2(H)) * per_col


@dataclass(frozen=True)
class ForwardPlan:
    """One forward launch: kernel "single_read" (block_h = the padded row) or "two_pass" ([k_pad, block_h] tiles)."""

    kernel: str
    block_h: int
    k_pad: int = 0


def forward_plan(H: int, K: int, dtype: torch.dtype, fused: bool = False) -> ForwardPlan:
    """The single-read plan where a row fits the UB budget, else the two-pass plan (``fused`` widens only the
    two-pass tile budget; the kernel choice is the same for the plain and the fused op of a shape).
    ``SEAM.forward_kernel`` forces one of the two (tests)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    compensated = dtype == torch.float32
    fits = npu_single_read_bytes(H, itemsize, compensated) <= UB_BUDGET_BYTES
    if SEAM.forward_kernel == "single_read" or (SEAM.forward_kernel is None and fits):
        return ForwardPlan("single_read", max(16, next_power_of_2(H)))
    k_pad = next_power_of_2(K + 1)
    return ForwardPlan("two_pass", npu_block_h(H, k_pad, itemsize, compensated, fused), k_pad)


# --------------------------------------------------------------------------------------------------------------
# Forward.
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
    nw, pw = prepare_weights(norm_weight, proj_weight)
    out = torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
    _launch_forward(raw(prefix_sum), raw(block_residual), raw(nw), raw(pw), raw(out), int(num_valid_blocks),
                    float(eps), num_vector_cores(prefix_sum.device))
    return out


def _launch_forward(prefix_sum, block_residual, nw, pw, out, K: int, eps: float, cores: int,
                    fused: _FusedArgs | None = None) -> None:
    # fused: the fused_attn_res arguments (raw tensors), which switch the kernel's fused flags on.
    T, H = prefix_sum.shape
    plan = forward_plan(H, K, prefix_sum.dtype, fused is not None)
    h_strided = hidden_strided((prefix_sum, 1), (block_residual, 2), *fused_hidden_dims(fused))
    vec = stride_vec(prefix_sum.dtype, (prefix_sum.stride(0), block_residual.stride(0), block_residual.stride(1),
                                        out.stride(0), *fused_token_strides(fused)))
    grid_size = max(1, min(cores, T))
    tokens_per_prog = triton.cdiv(T, grid_size)
    args = (prefix_sum, block_residual, nw, pw, out, T, K, H, eps, tokens_per_prog,
            prefix_sum.stride(0) // vec, prefix_sum.stride(1), block_residual.stride(0) // vec,
            block_residual.stride(1) // vec, block_residual.stride(2), out.stride(0) // vec)
    flags = dict(BLOCK_H=plan.block_h, VEC=vec, H_STRIDED=h_strided, COMPENSATED=prefix_sum.dtype == torch.float32,
                 **fused_kernel_args(fused, vec), **launch_options(), **compile_options())
    if plan.kernel == "single_read":
        _npu_kernels.attn_res_npu_single_read_kernel[(grid_size,)](
            *args, CHUNK=min(plan.block_h, SINGLE_READ_CHUNK), **flags)
    else:
        _fwd.attn_res_npu_kernel[(grid_size,)](*args, K_PAD=plan.k_pad, NPU_NORM_SCALE=True, **flags)


def warmup(hidden_size: int, dtype: torch.dtype, device: torch.device | str | None = None,
           max_num_valid_blocks: int = 8, max_num_tokens: int = 65536, full: bool = False,
           weight_dtype: torch.dtype | None = None) -> int:
    """Compile every NPU forward compile key for one model (one per distinct ``forward_plan`` for K in
    1..max_num_valid_blocks: one single-read kernel, or one two-pass kernel per K_PAD) before graph capture;
    returns the number of launches. ``max_num_tokens`` is accepted for symmetry with the CUDA backend: the token
    count never enters a compile key here. ``full=True`` also compiles fused_attn_res.full's call forms
    (vLLM-Ascend's: ``cuda.FULL_FORMS`` and ``cuda.ADD_SNAPSHOT_FORMS``) with weights of ``weight_dtype`` (None: the
    I/O dtype and fp32; the plain forward keeps its fp32 weights)."""
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
    # The forms as the CUDA policy lists them (one list, no triton import there beyond what this module has).
    from .cuda import ADD_SNAPSHOT_FORMS, FULL_FORMS

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


# --------------------------------------------------------------------------------------------------------------
# Fused serving variant.
# --------------------------------------------------------------------------------------------------------------
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
    if not round_mix and out_norm_weight is not None:
        # The FP32-mix norm: the serving flags' launch (fused_attn_res_quant's, without the FP8 output).
        fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                         eps if out_norm_eps is None else out_norm_eps, round_mix=False)
        _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
        return out, fused.new_prefix
    fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                     eps if out_norm_eps is None else out_norm_eps)
    nw, pw = prepare_weights(norm_weight, proj_weight)
    _launch_forward(raw(prefix_sum), raw(block_residual), raw(nw), raw(pw), raw(out), int(num_valid_blocks),
                    float(eps), num_vector_cores(prefix_sum.device), fused.map(raw))
    return out, fused.new_prefix


def _launch_serving(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                    proj_weight: torch.Tensor, K: int, eps: float, fused: _FusedArgs, out: torch.Tensor) -> None:
    # The two-pass kernel keeps the FP32-mix norm's and the FP8 output's row between passes in an FP32 scratch row
    # per program; the grid is at most one program per vector core (_launch_forward), so [cores, H] is enough for
    # any T. The single-read kernel holds that row in its tile and needs none.
    cores = num_vector_cores(prefix_sum.device)
    two_pass = forward_plan(prefix_sum.size(1), K, prefix_sum.dtype, True).kernel == "two_pass"
    if fused.needs_scratch and two_pass:
        fused = fused.with_scratch(torch.empty((cores, prefix_sum.size(1)), dtype=torch.float32,
                                               device=prefix_sum.device))
    nw, pw = prepare_weights(norm_weight, proj_weight)
    _launch_forward(raw(prefix_sum), raw(block_residual), raw(nw), raw(pw), kernel_output(raw(out)), K, float(eps),
                    cores, fused.map(raw))


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
    fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                     eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                     out_dtype=out_dtype)
    _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
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
    fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                     eps if out_norm_eps is None else out_norm_eps, inplace=True,
                                     round_mix=round_mix, out_dtype=out_dtype)
    _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
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
            T = prefix_sum.size(0)
            grid = max(1, min(num_vector_cores(prefix_sum.device), T))
            args, runtime, flags = add_snapshot_args(raw(prefix_sum), None if addend is None else raw(addend),
                                                     None if target is None else raw(target), raw(block_residual),
                                                     block_write_idx, triton.cdiv(T, grid))
            _fwd.attn_res_add_snapshot_kernel[(grid,)](*args, **runtime, **flags, **launch_options(),
                                                       **compile_options())
        return full_outputs(None, prefix_sum, None, new_prefix)
    fused, out = _FusedArgs.allocate_full(prefix_sum, addend, block_write_idx, out_norm_weight,
                                          eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                          return_mix=return_mix, sum_out=sum_out)
    _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
    return full_outputs(fused, prefix_sum, out, None if sum_out is not None else fused.new_prefix)


# --------------------------------------------------------------------------------------------------------------
# Backward: kimi_k3::attn_res_backward. Kernels in k3_ops.kernels.attn_res_bwd; the device-independent
# part of the launch (trivial cases, allocation, strides) lives in backends/_backward.py, shared with cuda.py.
# --------------------------------------------------------------------------------------------------------------
def npu_bwd_block_h(H: int, k_pad: int, itemsize: int) -> int:
    """Largest power-of-two hidden tile (<= next_pow2(H), >= 16) whose backward working set fits UB_BUDGET_BYTES.

    Bytes per tile column, pass 2 (the larger pass): the [K_PAD] candidate values loaded in the I/O dtype and
    double-buffered by multibuffer (2 * itemsize), their FP32 copy (4), one FP32 product temporary (4), the
    FP32 dv (4) and dv cast to the I/O dtype for the stores (itemsize), and the six FP32 double-float statistic
    accumulators of pass 1 (hi and lo of sum(v^2), <v, w>, <v, gy>: 24) that live across the chunk loop:
    K_PAD * (3 * itemsize + 36); plus the prefix and grad_out rows (each double-buffered and in FP32:
    2 * (2 * itemsize + 4)), the two weight rows and the folded w (3 * 4) and the dw workspace row with this
    token's contribution (2 * 4). bf16, K_PAD = 16 (K <= 15): 708 B per column -> BLOCK_H = 128 (89 KB);
    K_PAD = 8: 372 B -> 256 (93 KB).
    """
    per_col = k_pad * (3 * itemsize + 36) + 2 * (2 * itemsize + 4) + 12 + 8
    limit = next_power_of_2(H)
    block = 16
    while block * 2 <= limit and block * 2 * per_col <= UB_BUDGET_BYTES:
        block *= 2
    return min(block, max(16, limit))


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
        output_mask: [want grad_prefix_sum, want grad_block_residual, want grad_weight].
    Returns:
        (grad_prefix_sum [T, H] of prefix_sum.dtype, grad_block_residual [T, C, H] of block_residual.dtype with
        exact zeros at slots >= K, grad_weight [H] fp32 (fp64 for fp64 inputs)), new and contiguous on
        prefix_sum's device; an output not asked for by output_mask is an empty 1-D tensor.
    """
    trivial = _backward.trivial_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                  num_valid_blocks, eps, output_mask)
    if trivial is not None:
        return trivial
    return _backward.run_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                           num_valid_blocks, eps, output_mask,
                                           backward_plan(prefix_sum, int(num_valid_blocks)), raw=raw)


def backward_plan(prefix_sum: torch.Tensor, num_valid_blocks: int) -> _backward.BackwardPlan:
    """The NPU backward launch for prefix_sum's shape, dtype and device and K: the tiles kernel, one program per
    vector core, double-float statistics (Ascend vector cores have no FP64), grad_prefix's row taken out of the dv
    tile by an exact masked sum (the form triton-ascend lowers: ``attn_res_bwd_kernel``'s PREFIX_ROW_SUM)."""
    H = prefix_sum.size(1)
    k_pad = next_power_of_2(int(num_valid_blocks) + 1)
    return _backward.BackwardPlan(num_programs=num_vector_cores(prefix_sum.device),
                                  block_h=npu_bwd_block_h(H, k_pad, prefix_sum.element_size()), k_pad=k_pad,
                                  acc64=False, df=True, launch_options=tuple(launch_options().items()),
                                  compile_options=tuple(compile_options().items()), prefix_row_sum=True)
