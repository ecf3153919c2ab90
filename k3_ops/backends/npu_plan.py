"""The Ascend NPU plan step: shapes and device facts (vector cores, launch options) in, a frozen plan out. Pure: no
launch, no triton, no device.

Forward (``attn_res`` and every fused call), ``forward_plan``:

- "single_read" (``kernels.attn_res_npu.attn_res_npu_single_read_kernel``) wherever its working set fits the Unified
  Buffer budget (``npu_single_read_bytes`` <= ``UB_BUDGET_BYTES``: bf16 / fp16 up to H = 8192, the Kimi K3 hidden
  size 7168 included; fp32 up to H = 4096): per token the K + 1 candidate rows stream through one
  [next_power_of_2(H)] row tile into an online softmax, each read once. K is a runtime argument, not a compile key.
- "two_pass" (``kernels.attn_res_fwd.attn_res_npu_kernel``) where a row does not fit: per token, two passes over H
  in [K_PAD, BLOCK_H] tiles (K_PAD = next_power_of_2(K + 1), a compile-time constant): pass 1 accumulates sum(v^2)
  and <v, w> per candidate, then the softmax; pass 2 re-reads the tiles and writes the output chunk.
- The fused calls take the plan of the plain op of their shape (the choice does not depend on the fused flags), so
  their mix equals ``attn_res(new_prefix, ...)`` bit for bit; ``fused`` only widens the two-pass tile budget.
- The grid is one program per vector core (``forward_grid``), program p walking the contiguous token range
  [p * ceil(T / cores), (p + 1) * ceil(T / cores)); at T < cores only T cores work.

Cost model (bytes moved per token; no throughput figure is claimed without hardware), s = itemsize:

- single_read: (K + 2) H s (every candidate row read once, the output written once), the folded weight row once per
  program. Fused: + H s for the addend, + H s for new_prefix, + H s for the snapshot; with an addend new_prefix is
  also read back once (the program's own row, just written), and the output norm reads its weight row per token.
- two_pass: (2 (K + 1) + 1) H s (every candidate row read twice), the weights once per hidden chunk per token. It is
  kept for rows that do not fit: a [K + 1, H] working set can never stay in the UB, and the single-read row tile
  needs the whole row (a row's softmax weight is known only after the whole row is reduced).
- UB budget: ``UB_BUDGET_BYTES`` = 160 KB of the vector core's 192 KB Unified Buffer for one program's tiles, the rest
  left to the compiler; per-tile estimates in ``npu_single_read_bytes`` and ``npu_block_h``. Only CANN's
  bishengir-compile decides the real allocation (docs/kernels.md, "Ascend NPU (PrivateUse1, triton-ascend)": the
  UB budget and the compile check).

Backward (``backward_plan``): the tiles kernel, one program per vector core, double-float statistics (the vector
cores have no FP64), [K_PAD, ``npu_bwd_block_h``] tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import BackwardPlan, cdiv, next_power_of_2

__all__ = [
    "FALLBACK_NUM_VECTOR_CORES",
    "UB_BUDGET_BYTES",
    "SINGLE_READ_CHUNK",
    "npu_block_h",
    "npu_single_read_bytes",
    "npu_bwd_block_h",
    "ForwardPlan",
    "forward_plan",
    "forward_grid",
    "forward_constexprs",
    "backward_plan",
]

#: Vector cores assumed where the device does not say: an Atlas A2 / 910B's 24 AI cores x 2 vector cores (a wrong
#: guess only costs an extra wave or idle cores, never correctness).
FALLBACK_NUM_VECTOR_CORES = 48

#: Bytes of the vector core's ~192 KB Unified Buffer that one program's tiles may use; the rest is left to the
#: compiler (scalars, masks, index vectors, reduction scratch).
UB_BUDGET_BYTES = 160 * 1024

#: Hidden elements per piece of the single-read kernel's new_prefix pre-pass (fused with an addend): small tiles,
#: so the pre-pass adds nothing to the row-wide working set.
SINGLE_READ_CHUNK = 1024


def npu_block_h(H: int, k_pad: int, itemsize: int, compensated: bool = False, fused: bool = False) -> int:
    """Largest power-of-two hidden tile (<= next_pow2(H), >= 16) whose two-pass working set fits UB_BUDGET_BYTES.

    Bytes per tile column: the [K_PAD] candidate values loaded in the I/O dtype, double-buffered by multibuffer
    (2 * itemsize), converted to FP32 (4) and one FP32 product temporary (x * x, x * w or p * x: 4), so
    K_PAD * (2 * itemsize + 8); for the compensated sums of fp32 I/O add K_PAD * 28 (four FP32 (hi, lo) accumulator
    tiles that live across the chunk loop, 16, and three TwoSum temporaries, 12); plus the prefix row
    (2 * itemsize + 4), the two weight rows and the folded w (3 * 4) and the output row (4 + itemsize). bf16,
    K_PAD = 16 (K <= 15): 218 B per column -> BLOCK_H = 512; K_PAD = 8: 122 B -> 1024; fp32 (compensated), K_PAD =
    16: 736 B -> 128. Fused: the addend row, double-buffered and in FP32 (2 * itemsize + 4), and the rounded
    new_prefix row stored to new_prefix / the snapshot (itemsize): 3 * itemsize + 4 more per column. The output
    norm's pass 3 holds only an output row and the norm weight, less than pass 2.
    """
    per_col = k_pad * (2 * itemsize + 8 + (28 if compensated else 0)) + (2 * itemsize + 4) + 12 + (4 + itemsize)
    if fused:
        per_col += 3 * itemsize + 4
    limit = next_power_of_2(H)
    block = 16
    while block * 2 <= limit and block * 2 * per_col <= UB_BUDGET_BYTES:
        block *= 2
    return block


def npu_single_read_bytes(H: int, itemsize: int, compensated: bool = False) -> int:
    """Estimated Unified Buffer bytes of one ``attn_res_npu_single_read_kernel`` program, at its row tile
    BLOCK_H = next_power_of_2(H) (the masked tail is allocated too).

    Bytes per tile column: the row in flight in the I/O dtype, double-buffered by multibuffer (2 * itemsize), its
    FP32 copy (4; none for fp32, whose load is FP32 already), one FP32 product row (x * x, x * w or p * x: 4), the
    FP32 accumulator row (4) and the folded FP32 weight row (4), which stays for all of the program's tokens; fp32
    I/O (compensated) adds the second product row and the first level of the double-float tree (hi and lo of two
    half-width sums): 4 + 8. bf16 / fp16: 20 B per column, so H <= 8192 fits 160 KB; fp32: 32 B, so H <= 4096. The
    fused variants add no row-wide tile: the new_prefix pre-pass works in SINGLE_READ_CHUNK pieces before the
    candidate loop, and the output norm's weight row (itemsize + 4) is live only after the loop, in place of the
    row-in-flight buffers.
    """
    per_col = 2 * itemsize + (4 if itemsize < 4 else 0) + 4 + 4 + 4 + (12 if compensated else 0)
    return max(16, next_power_of_2(H)) * per_col


def npu_bwd_block_h(H: int, k_pad: int, itemsize: int) -> int:
    """Largest power-of-two hidden tile (<= next_pow2(H), >= 16) whose backward working set fits UB_BUDGET_BYTES.

    Bytes per tile column, pass 2 (the larger pass): the [K_PAD] candidate values loaded in the I/O dtype and
    double-buffered by multibuffer (2 * itemsize), their FP32 copy (4), one FP32 product temporary (4), the FP32 dv
    (4) and dv cast to the I/O dtype for the stores (itemsize), and the six FP32 double-float statistic accumulators
    of pass 1 (hi and lo of sum(v^2), <v, w>, <v, gy>: 24) that live across the chunk loop: K_PAD * (3 * itemsize +
    36); plus the prefix and grad_out rows (each double-buffered and in FP32: 2 * (2 * itemsize + 4)), the two weight
    rows and the folded w (3 * 4) and the dw workspace row with this token's contribution (2 * 4). bf16, K_PAD = 16
    (K <= 15): 708 B per column -> BLOCK_H = 128; K_PAD = 8: 372 B -> 256.
    """
    per_col = k_pad * (3 * itemsize + 36) + 2 * (2 * itemsize + 4) + 12 + 8
    limit = next_power_of_2(H)
    block = 16
    while block * 2 <= limit and block * 2 * per_col <= UB_BUDGET_BYTES:
        block *= 2
    return min(block, max(16, limit))


@dataclass(frozen=True)
class ForwardPlan:
    """One forward launch: kernel "single_read" (block_h = the padded row) or "two_pass" ([k_pad, block_h] tiles)."""

    kernel: str
    block_h: int
    k_pad: int = 0


def forward_plan(H: int, K: int, dtype: torch.dtype, fused: bool = False, forced: str | None = None) -> ForwardPlan:
    """The single-read plan where a row fits the UB budget, else the two-pass plan (``fused`` widens only the
    two-pass tile budget; the kernel choice is the same for the plain and the fused op of a shape). ``forced``:
    "single_read" or "two_pass" regardless of the budget (the NPU policy's test seam)."""
    itemsize = dtype.itemsize
    compensated = dtype == torch.float32
    fits = npu_single_read_bytes(H, itemsize, compensated) <= UB_BUDGET_BYTES
    if forced == "single_read" or (forced is None and fits):
        return ForwardPlan("single_read", max(16, next_power_of_2(H)))
    k_pad = next_power_of_2(K + 1)
    return ForwardPlan("two_pass", npu_block_h(H, k_pad, itemsize, compensated, fused), k_pad)


def forward_grid(T: int, cores: int) -> tuple[int, int]:
    """(programs, tokens per program) of a forward launch: one program per vector core, at most one per token."""
    programs = max(1, min(cores, T))
    return programs, cdiv(T, programs)


def forward_constexprs(plan: ForwardPlan, vec: int, h_strided: bool, fp32_io: bool) -> dict:
    """The plan's compile-time arguments (the fused flags, launch and compile options come on top)."""
    flags = dict(BLOCK_H=plan.block_h, VEC=vec, H_STRIDED=h_strided, COMPENSATED=fp32_io)
    if plan.kernel == "single_read":
        flags["CHUNK"] = min(plan.block_h, SINGLE_READ_CHUNK)
    else:
        flags.update(K_PAD=plan.k_pad, NPU_NORM_SCALE=True)
    return flags


def backward_plan(H: int, K: int, element_size: int, cores: int, launch_options: dict,
                  compile_options: dict) -> BackwardPlan:
    """The backward launch: the tiles kernel, one program per vector core, double-float statistics (Ascend vector
    cores have no FP64), grad_prefix's row taken out of the dv tile by an exact masked sum (the form triton-ascend
    lowers: ``attn_res_bwd_kernel`` 's PREFIX_ROW_SUM)."""
    k_pad = next_power_of_2(int(K) + 1)
    return BackwardPlan(num_programs=cores, block_h=npu_bwd_block_h(H, k_pad, element_size), k_pad=k_pad,
                        acc64=False, df=True, launch_options=tuple(launch_options.items()),
                        compile_options=tuple(compile_options.items()), prefix_row_sum=True)
