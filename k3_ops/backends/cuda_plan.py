"""The CUDA plan step: call metadata and device facts in, a frozen plan out. Pure: no launch, no triton, no GPU.

Forward (``attn_res`` and every fused call), in two parts so that the per-call path stays a dictionary lookup:

- ``Plan``: a launch-table entry (cuda_table.py) resolved for K, H and a device (``resolve``, ``table_plan``): the
  kernel, its tiles, warps and stages, PDL, a native entry's fallback. ``serving_plan`` adapts it to the serving
  calls. The CUDA policy caches plans per (T bucket, K, H, device) (backends/cuda.py, ``choose_config``).
- what one call adds: ``forward_grid`` (from T), ``forward_constexprs`` (from the call's VEC, hidden strides and
  fused flags: built once per compile key), and whether the call's layout lets a native entry run
  (``native_layout_ok``).

Backward: ``BackwardConfig`` (the knobs) resolved by ``backward_plan`` into a ``BackwardPlan`` (backends/__init__.py).

A device is described by ``DeviceFacts`` (backends/cuda.py, ``device_facts``, reads them from the GPU); tests and
benchmarks describe devices that are not present the same way.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from . import TRITON_COMPILE_OPTIONS, BackwardPlan, cdiv, next_power_of_2
from .cuda_table import (
    CLUSTER_FALLBACK_CONFIG,
    NATIVE_KERNELS,
    SERVING_TOKEN_CONFIG,
    T_BUCKETS,
    LaunchConfig,
    table_config,
)

__all__ = [
    "DeviceFacts",
    "INTERPRETER_NUM_SMS",
    "Plan",
    "SPLIT_MAX_CANDIDATES",
    "ONE_TILE_MAX_ELEMENTS",
    "cluster_supported",
    "resolve",
    "table_plan",
    "table_plans",
    "serving_plan",
    "forward_grid",
    "forward_constexprs",
    "native_layout_ok",
    "BackwardConfig",
    "BACKWARD_CONFIG",
    "BACKWARD_KERNEL_DEFAULTS",
    "ROWS_BACKWARD_MAX_H",
    "SPLIT_BACKWARD_MIN_ROWS",
    "SCALARS_PROGRAMS_PER_SM",
    "REDUCE_NUM_WARPS",
    "SINGLE_READ_SMEM_MIN_K",
    "RING_LAYOUT",
    "single_read_supported",
    "single_read_layout_ok",
    "backward_plan",
]


# --------------------------------------------------------------------------------------------------------------
# Devices.
# --------------------------------------------------------------------------------------------------------------
#: SM count assumed under the Triton interpreter (CPU tensors): an H200's and an H100 SXM's, so that the interpreter
#: exercises the path choices of the GPUs the benchmarks run on.
INTERPRETER_NUM_SMS = 132


@dataclass(frozen=True)
class DeviceFacts:
    """What the plan step knows of a device.

    interpreted: kernels run under the Triton interpreter (CPU tensors, or TRITON_INTERPRET=1): no native kernels,
        no PDL, no register caps. num_sms: streaming multiprocessors. capability: (major, minor).
    pdl: forward launches use programmatic dependent launch by default (sm_90+, a Triton with ``launch_pdl``,
        ``K3_OPS_PDL`` not "0"). smem_optin: shared memory per block with the opt-in, bytes.
    cluster_threads, single_read_smem: the shape rules of k3_ops._C's CUDA C++ kernels
        (``attn_res_cluster_threads``, ``attn_res_bwd_single_read_smem_bytes``; 0: not supported); None where
        k3_ops._C has no CUDA kernels.
    """

    interpreted: bool
    num_sms: int
    capability: tuple[int, int] = (0, 0)
    pdl: bool = False
    smem_optin: int = 0
    cluster_threads: Callable[[int, int, int, int], int] | None = None
    single_read_smem: Callable[[int, int, int, int], int] | None = None



def cluster_supported(K: int, H: int, facts: DeviceFacts, cluster_size: int, element_size: int = 2) -> bool:
    """Whether the cluster kernel, or with cluster_size 1 the streaming kernel, runs this shape on the device: a CUDA
    build, sm_90+, and the kernel's own shape rule (16-bit rows, K <= 8, H a multiple of 8 x cluster_size). The
    layout (unit hidden strides, 16-byte aligned rows) is the call's: ``native_layout_ok``."""
    if facts.interpreted or facts.cluster_threads is None or K < 1:
        return False
    return facts.capability[0] >= 9 and facts.cluster_threads(K, H, element_size, cluster_size) > 0


# --------------------------------------------------------------------------------------------------------------
# Forward plans.
# --------------------------------------------------------------------------------------------------------------
#: The split path only while K + 1 candidates fit its [K_PAD, chunk] register tile.
SPLIT_MAX_CANDIDATES = 16
#: The largest tile (rows x next_pow2(H)) a one-tile token plan holds; larger ones would only spill.
ONE_TILE_MAX_ELEMENTS = 8 * 8192


@dataclass(frozen=True)
class Plan:
    """A table entry resolved for one shape and device: exactly what is launched (the compile key lives here).
    Hashed once (it is part of every launch's cache key)."""

    kernel: str
    num_warps: int
    block_h: int = 0  # token, rows
    rows_per_tile: int = 0  # token
    one_tile: bool = False  # token: every block row in one tile of rows_per_tile rows
    prefix_first: bool = False  # token with a loop: the prefix candidate folded before the block rows
    norm_gram: bool = False  # token (tiles of at most 4 rows), cluster: the norm's sum of squares from the statistics
    gram_tau: float = 0.0  # with norm_gram: its guard (LaunchConfig.gram_tau)
    onw_ahead: bool = False  # token: a fused call's output norm weight loaded with the inputs (no FP8 output)
    pdl: bool = False  # token, rows, cluster, stream
    tokens_per_prog: int = 1  # tiles
    ctas_per_sm: int = 0  # rows
    chunk: int = 0  # split
    k_pad: int = 0  # split, tiles
    p: int = 0  # split: programs per token
    p_pad: int = 0  # split
    prefetch: int = 1  # rows
    num_stages: int = 1  # token, rows with prefetch 0
    maxnreg: int | None = None
    tile_h: int = 0  # tiles
    cluster_size: int = 0  # cluster (1: stream)
    fallback: Plan | None = None  # cluster, stream: the plan of the calls they do not run

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(tuple(self.__dict__.values())))

    def __hash__(self) -> int:
        return self._hash


def _rows_warps(block_h: int) -> int:
    return min(16, max(4, block_h // 1024))


def _split_warps(k_pad: int, chunk: int) -> int:
    # About 64 fp32 tile values per thread.
    return min(16, max(1, (k_pad * chunk) // (64 * 32)))


def _pdl(config: LaunchConfig, facts: DeviceFacts) -> bool:
    return facts.pdl if config.pdl is None else bool(config.pdl and not facts.interpreted)


def resolve(K: int, H: int, facts: DeviceFacts, config: LaunchConfig) -> Plan:
    """``config`` resolved for K valid blocks of H columns on the device ``facts`` describes."""
    block_h = next_power_of_2(H)
    if config.kernel == "split" and K + 1 > SPLIT_MAX_CANDIDATES:
        # More candidates than the split tile holds: the per-token kernel, which takes any K.
        config = LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1)
    if config.kernel in NATIVE_KERNELS:
        # One native entry: the streaming kernel is its cluster size 1 (csrc_cuda/attn_res_cluster.h).
        cluster_size = config.cluster_size if config.kernel == "cluster" else 1
        fallback = resolve(K, H, facts, config.fallback or CLUSTER_FALLBACK_CONFIG)
        if K < config.min_k or not cluster_supported(K, H, facts, cluster_size):
            return fallback
        gram = config.norm_gram and config.kernel == "cluster"
        return Plan(config.kernel, 0, pdl=_pdl(config, facts), cluster_size=cluster_size, fallback=fallback,
                    norm_gram=gram, gram_tau=config.gram_tau if gram else 0.0)
    if config.kernel == "token":
        pdl = _pdl(config, facts)
        rows, one_tile, stages = config.rows_per_tile, config.rows_per_tile == 0, config.num_stages
        if one_tile:
            rows, stages = next_power_of_2(max(K, 1)), 1
            if rows * block_h > ONE_TILE_MAX_ELEMENTS:
                # A tile that large only spills: 4-row tiles, unpipelined (staged fp32 tiles of 8192 columns would
                # not fit the shared memory).
                rows, one_tile = 4, False
        gram = config.norm_gram and rows <= 4
        warps = config.num_warps or _rows_warps(block_h)
        # The output norm's weight ahead by default where it costs no spill: tiles of at most 2 rows over 8 warps.
        ahead = rows <= 2 and warps >= 8 if config.onw_ahead is None else config.onw_ahead
        return Plan("token", warps, block_h=block_h, rows_per_tile=rows, one_tile=one_tile,
                    prefix_first=config.prefix_first and not one_tile, norm_gram=gram,
                    gram_tau=config.gram_tau if gram else 0.0, onw_ahead=ahead, pdl=pdl, num_stages=stages,
                    maxnreg=config.maxnreg)
    if config.kernel == "split":
        k_pad = next_power_of_2(K + 1)
        chunk = min(config.chunk, block_h)
        p = cdiv(H, chunk)
        return Plan("split", config.num_warps or _split_warps(k_pad, chunk), chunk=chunk, k_pad=k_pad, p=p,
                    p_pad=next_power_of_2(p), maxnreg=config.maxnreg)
    if config.kernel == "tiles":
        k_pad = next_power_of_2(K + 1)
        tile_h = min(config.tile_h, block_h)
        return Plan("tiles", config.num_warps or _split_warps(k_pad, tile_h), k_pad=k_pad, tile_h=tile_h,
                    tokens_per_prog=config.tokens_per_prog, maxnreg=config.maxnreg)
    return Plan("rows", config.num_warps or _rows_warps(block_h), block_h=block_h, pdl=_pdl(config, facts),
                ctas_per_sm=config.ctas_per_sm, prefetch=config.prefetch,
                num_stages=config.num_stages if config.prefetch == 0 else 1, maxnreg=config.maxnreg)


def table_plan(T: int, K: int, H: int, facts: DeviceFacts) -> Plan:
    """The launch table's plan for a call of T tokens, K valid blocks and H columns."""
    return resolve(K, H, facts, table_config(T, K))


def table_plans(H: int, max_num_valid_blocks: int, max_num_tokens: int, facts: DeviceFacts) -> dict[Plan, tuple]:
    """Every distinct plan (compile key) the table picks for T in 1..max_num_tokens and K in 1..max K, each with its
    smallest example (T, K): what ``warmup`` compiles. Plans depend on T only through its bucket."""
    ts = sorted({min(b, max_num_tokens) for b in T_BUCKETS})
    plans: dict[Plan, tuple[int, int]] = {}
    for K in range(1, max_num_valid_blocks + 1):
        for T in ts:
            plans.setdefault(table_plan(T, K, H, facts), (T, K))
    return plans


#: Native plans with a serving-capable fallback, by (table plan, fallback): made once per plan.
_serving_native_plans: dict[tuple, Plan] = {}


def serving_plan(plan: Plan, K: int, H: int, facts: DeviceFacts) -> Plan:
    """The plan of a serving call (fused_attn_res.quant, fused_attn_res_, the FP32-mix norm) where the table's plan
    is ``plan``: the plan itself where its kernel has the serving flags (token, rows, native), a split plan or a
    native plan's split fallback replaced by ``SERVING_TOKEN_CONFIG`` 's."""
    if plan.kernel in ("rows", "token"):
        return plan
    if plan.kernel in NATIVE_KERNELS and plan.fallback.kernel in ("rows", "token"):
        return plan
    token = resolve(K, H, facts, SERVING_TOKEN_CONFIG)
    if plan.kernel not in NATIVE_KERNELS:
        return token
    key = (plan, token)
    found = _serving_native_plans.get(key)
    if found is None:
        found = _serving_native_plans[key] = replace(plan, fallback=token)
    return found


def forward_grid(plan: Plan, T: int, num_sms: int) -> tuple[int, ...]:
    """The grid of a Triton forward launch of ``plan`` for T tokens (num_sms: the rows path's only)."""
    kernel = plan.kernel
    if kernel == "token":
        return (T,)  # one program per token
    if kernel == "rows":
        return (min(T, num_sms * plan.ctas_per_sm),)  # persistent: tokens pid, pid + grid, ...
    if kernel == "tiles":
        return (cdiv(T, plan.tokens_per_prog),)
    return (plan.p, T)  # split: P programs per token


def forward_constexprs(plan: Plan, H: int, vec: int, h_strided: bool, flags: dict, fp32_io: bool,
                       interpreted: bool) -> dict:
    """The compile-time arguments and launch options of a Triton forward launch of ``plan``: the plan's tiles,
    the call's VEC and hidden-stride flag, the fused flags (``_fused.fused_kernel_args``' upper-case keys), the
    shared compile options. The split path's launches add their PHASE."""
    # fp32 I/O scores in FP64 (kernels/attn_res_fwd.py, _stats).
    common = dict(VEC=vec, H_STRIDED=h_strided, ACC64=fp32_io, num_warps=plan.num_warps, **flags,
                  **TRITON_COMPILE_OPTIONS)
    # A register cap and PDL are compile options of the GPU backend only (the interpreter takes neither).
    if plan.maxnreg and not interpreted:
        common["maxnreg"] = plan.maxnreg
    if plan.pdl:
        common["launch_pdl"] = True
    if plan.kernel == "token":
        # The output norm's weight loaded ahead where the plan says so; the FP8 output has only the other epilogue.
        ahead = plan.onw_ahead and flags.get("OUT_NORM", False) and not flags.get("FP8_OUT", False)
        # H as a constexpr (H_EXACT): part of the token kernel's key.
        return dict(BLOCK_H=plan.block_h, ROWS=plan.rows_per_tile, NUM_STAGES=plan.num_stages,
                    USE_PDL=plan.pdl, H_EXACT=H, **common, **({"ONW_AHEAD": True} if ahead else {}),
                    **({"ONE_TILE": True} if plan.one_tile else {}),
                    **({"PREFIX_FIRST": True} if plan.prefix_first else {}),
                    **({"NORM_GRAM": True, "GRAM_TAU": plan.gram_tau}
                       if plan.norm_gram and flags.get("OUT_NORM", False) else {}))
    if plan.kernel == "rows":
        return dict(BLOCK_H=plan.block_h, PREFETCH=plan.prefetch, NUM_STAGES=plan.num_stages,
                    USE_PDL=plan.pdl, **common)
    if plan.kernel == "tiles":
        return dict(BLOCK_H=plan.tile_h, K_PAD=plan.k_pad, COMPENSATED=common.pop("ACC64"), **common)
    return dict(CHUNK=plan.chunk, K_PAD=plan.k_pad, P_PAD=plan.p_pad, **common)


def native_layout_ok(prefix_sum: torch.Tensor, block_residual: torch.Tensor, nw: torch.Tensor, pw: torch.Tensor,
                     out: torch.Tensor, fused) -> bool:
    """Whether a native (cluster, stream) plan runs this call itself: 16-bit rows, an addend of the I/O dtype, and
    16-byte vectors everywhere (unit hidden strides; pointers, token and block strides on 16-byte boundaries), so that
    a fused call's mix is the plain op's and an FP8 output the quantised output of the same call, bit for bit. Not
    fused_attn_res.full's rounded-mix output (``mix_out``) nor a new prefix into rows of another token stride than H
    (its ``sum_out``): the native kernels have neither. Other calls run the plan's fallback."""
    if prefix_sum.element_size() != 2:
        return False
    if fused is not None and (
            (fused.addend is not None and fused.addend.dtype != prefix_sum.dtype) or fused.mix_out is not None
            or (fused.new_prefix is not None and not fused.new_prefix.is_contiguous())):
        return False
    weights = (nw, pw) if fused is None or fused.out_norm_weight is None else (nw, pw, fused.out_norm_weight)
    if any(w.data_ptr() % 16 for w in weights):
        return False
    rows = (prefix_sum, block_residual, out) if fused is None else (
        prefix_sum, block_residual, out, *(t for t in (fused.new_prefix, fused.addend) if t is not None))
    for t in rows:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return False
    return True


# --------------------------------------------------------------------------------------------------------------
# Backward plans.
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackwardConfig:
    """Knobs of the backward launch (``python -m k3_ops.bench train --bwd-configs`` times alternatives).

    kernel: "auto" (default: "single_read" where it runs, else "stats_apply" when T x (K + 1) >=
        SPLIT_BACKWARD_MIN_ROWS, else "rows"), "single_read" (the CUDA C++ kernel of csrc_cuda/attn_res_bwd.cu:
        one program per SM, each token read once from DRAM; needs a build with the CUDA sources, sm_80+, bf16 /
        fp16 candidates, H % 8 == 0, H <= 8192, K <= 8, unit hidden strides and 16-byte aligned rows; elsewhere
        the Triton choice "auto" would make without it), "stats_apply" (the two-stream split:
        ``attn_res_bwd_stats_kernel``, then ``attn_res_bwd_scalars_kernel``, then ``attn_res_bwd_apply_kernel``, on
        (token range, column chunk) grids), "rows" (``attn_res_bwd_rows_kernel``, the single-read streaming kernel:
        one whole row per step over all warps) or "tiles" (``attn_res_bwd_kernel``: [K_PAD, BLOCK_H] candidate tiles
        of ``tile_elems`` elements, two passes per token; the Ascend algorithm). stats_apply and rows need H <=
        ROWS_BACKWARD_MAX_H; wider rows fall back to "tiles".
    programs_per_sm: rows / tiles: programs per SM; grid = min(T, SMs x programs_per_sm), each program walking
        a contiguous token range (a larger grid also means a larger dw workspace, [grid, H] fp64).
    num_warps, num_stages: warps per program and software-pipelining depth (shared-memory stages; 1 = none);
        None takes the resolved kernel's default from ``BACKWARD_KERNEL_DEFAULTS``.
    tile_elems: "tiles" only: K_PAD x BLOCK_H, BLOCK_H = tile_elems // K_PAD (a power of two, at least 16, at
        most next_power_of_2(H)).
    acc64: FP64 per-token statistics / softmax backward / dw accumulation (the accuracy contract's margin; see
        kernels/attn_res_bwd.py). False is plain FP32: cheaper, but its error is the eager formula's size.
    maxnreg: register cap per thread (a CUDA compile option; None: ptxas decides).
    apply_block: "stats_apply" only: columns per program (a power of two) of both of its kernels.
    stats_programs_per_sm: "stats_apply" only: its statistics kernel's grid, about SMs x stats_programs_per_sm
        programs (token ranges x column chunks); num_warps and num_stages describe that kernel.
    apply_warps, apply_stages, apply_programs_per_sm: "stats_apply" only: the same for its apply kernel.
    vectors_per_thread: "single_read" only: how a program holds the token's rows. 0: in shared memory, one 16-byte
        column vector per thread and row (H / 8 threads); 1 or 2: in registers, that many vectors per thread and
        row (H / 8 / vectors_per_thread threads); RING_LAYOUT: in a shared-memory ring of row slots, one vector per
        thread (H <= 7168). None (default): RING_LAYOUT where it runs, else 2 below SINGLE_READ_SMEM_MIN_K and 0 from
        there on, either falling back to the other where its shared memory does not fit the device's opt-in.

    Defaults: the fastest configurations timed (docs/kernels.md, "Backward"; docs/history.md,
    "Backward (`attn_res_backward`)"): the CUDA C++ single-read kernel wherever it runs; for the Triton kernels
    the split with 1-warp programs over 1024-column chunks for both streams (no cross-warp reduction in the
    statistics; 32 elements per thread in the apply pass), 8 programs per SM for each (one wave: 8 such programs
    fit an SM's registers), 3 stages, FP64 statistics and dw accumulation; the rows kernel below
    SPLIT_BACKWARD_MIN_ROWS (one launch instead of four).
    """

    kernel: str = "auto"
    programs_per_sm: int = 1
    num_warps: int | None = None
    num_stages: int | None = None
    tile_elems: int = 2048
    acc64: bool = True
    maxnreg: int | None = None
    apply_block: int = 1024
    apply_warps: int = 1
    apply_stages: int = 3
    apply_programs_per_sm: int = 8
    stats_programs_per_sm: int = 8
    vectors_per_thread: int | None = None

    def __post_init__(self):
        if self.apply_block < 16 or self.apply_block & (self.apply_block - 1):
            raise ValueError(f"BackwardConfig.apply_block must be a power of two >= 16, got {self.apply_block}")
        if self.apply_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"BackwardConfig.apply_warps must be a power of two in [1, 32], got {self.apply_warps}")
        for name in ("apply_stages", "apply_programs_per_sm", "stats_programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"BackwardConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.programs_per_sm < 1:
            raise ValueError(f"BackwardConfig.programs_per_sm must be >= 1, got {self.programs_per_sm}")
        if self.tile_elems < 16 or self.tile_elems & (self.tile_elems - 1):
            raise ValueError(f"BackwardConfig.tile_elems must be a power of two >= 16, got {self.tile_elems}")
        if self.kernel not in ("auto", "single_read", "tiles", "rows", "stats_apply"):
            raise ValueError("BackwardConfig.kernel must be 'auto', 'single_read', 'stats_apply', 'rows' or 'tiles', "
                             f"got {self.kernel!r}")
        if self.vectors_per_thread not in (None, 0, 1, 2, RING_LAYOUT):
            raise ValueError(f"BackwardConfig.vectors_per_thread must be 0, 1, 2, {RING_LAYOUT} or None, got "
                             f"{self.vectors_per_thread}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"BackwardConfig.num_stages must be >= 1 or None, got {self.num_stages}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"BackwardConfig.num_warps must be a power of two in [1, 32] or None, got "
                             f"{self.num_warps}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"BackwardConfig.maxnreg must be in [24, 255] or None, got {self.maxnreg}")


#: The widest row the rows backward holds in registers (larger H uses the tiles kernel; stats_apply shares the
#: bound, its statistics kernel being the newer, less-tested path for wide rows).
ROWS_BACKWARD_MAX_H = 8192

#: Per-kernel (num_warps, num_stages) when the config leaves them None, each kernel's fastest: the statistics kernel
#: of stats_apply on 1 warp, its three sums per row reduced within the warp.
BACKWARD_KERNEL_DEFAULTS = {"rows": (8, 2), "stats_apply": (1, 3), "tiles": (8, 3)}

#: "auto" picks the stats/apply split from this many token-candidate rows, T x (K + 1), on: the smallest shape where
#: it was timed faster than the rows kernel; below it the rows kernel's one launch (the split's four launches cost
#: host time that small shapes do not hide).
SPLIT_BACKWARD_MIN_ROWS = 8192

#: Programs per SM of the split's per-token scalars kernel (1 warp each, a few tokens each): its own grid, so that
#: the apply kernel's smaller one does not thin it out.
SCALARS_PROGRAMS_PER_SM = 16

#: Warps of the weight-gradient reduction, whatever the gradient kernel's: its FP64 tiles want several.
REDUCE_NUM_WARPS = 8

#: "single_read" with vectors_per_thread None where the ring layout does not run (H > 7168): the shared-memory-resident
#: layout (0) from this K on, the register-resident one (2) below it. K + 2 rows of one vector pair each fill 128
#: registers from K = 5 (the 10-row variant spills), where the register-resident program's warps (H / 16 threads)
#: are too few to hide latency.
SINGLE_READ_SMEM_MIN_K = 5

#: "single_read" vectors_per_thread of the ring layout (csrc_cuda/attn_res_bwd.cu, attn_res_bwd_ring_kernel): the
#: shared-memory-resident arithmetic over a ring of as many row slots as fit, so that the rows of the tokens ahead
#: stay in flight through each token's statistics and barriers; H <= 7168. Preferred wherever it runs.
RING_LAYOUT = 3

#: The default backward launch configuration; benchmarks pass ``config=`` to ``attn_res_backward`` instead.
BACKWARD_CONFIG = BackwardConfig()


def single_read_supported(K: int, H: int, facts: DeviceFacts, element_size: int = 2,
                          vectors_per_thread: int = 2) -> bool:
    """Whether the CUDA C++ single-read backward runs this shape on the device in this layout: a k3_ops build with
    the CUDA sources, a GPU (not the interpreter) of compute capability 8.0+ whose per-block shared memory opt-in
    holds one program's (the token's K + 2 rows, plus an FP64 [H] row except in the ring layout), 16-bit
    candidates, K <= 8, H % 8 == 0, H <= 8192 (the ring: H <= 7168). Row layout is the call's:
    ``single_read_layout_ok``."""
    if facts.interpreted or facts.single_read_smem is None or K < 1:
        return False
    smem = facts.single_read_smem(K, H, element_size, vectors_per_thread)
    if smem == 0:
        return False
    return facts.capability >= (8, 0) and smem <= facts.smem_optin


def single_read_layout_ok(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor) -> bool:
    """The single-read kernel copies 16-byte vectors: unit hidden strides (a hidden-strided grad_out is made
    contiguous by the launch) and rows starting on 16-byte boundaries (pointer and token / block strides)."""
    rows = [(prefix_sum, (prefix_sum.stride(0),)),
            (block_residual, (block_residual.stride(0), block_residual.stride(1)))]
    if grad_out.stride(1) == 1:
        rows.append((grad_out, (grad_out.stride(0),)))
    return (prefix_sum.stride(1) == 1 and block_residual.stride(2) == 1
            and all(t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides) for t, strides in rows))


def backward_plan(T: int, K: int, H: int, facts: DeviceFacts, config: BackwardConfig | None = None,
                  element_size: int = 2) -> BackwardPlan:
    """The backward launch for a shape (compile key: kernel, k_pad, block_h, num_warps, num_stages).

    element_size: the candidates' (the single-read CUDA kernel reads 16-bit dtypes only; 0 rules it out)."""
    config = config or BACKWARD_CONFIG
    k_pad = next_power_of_2(K + 1)
    kernel = config.kernel
    if kernel in ("auto", "single_read"):
        # The preferred layout for this K first, then the other one (their shared memory differs by a few
        # hundred bytes, so where one does not fit the other rarely does; the Triton kernels come next).
        preferred = (RING_LAYOUT,) + ((0, 2) if K >= SINGLE_READ_SMEM_MIN_K else (2, 0))
        for vpt in preferred if config.vectors_per_thread is None else (config.vectors_per_thread,):
            if single_read_supported(K, H, facts, element_size, vpt):
                return BackwardPlan(num_programs=min(T, facts.num_sms), block_h=H, k_pad=k_pad, acc64=True,
                                    kernel="single_read", vectors_per_thread=vpt,
                                    reduce_options=(("num_warps", REDUCE_NUM_WARPS),))
    whole_row = next_power_of_2(H) <= ROWS_BACKWARD_MAX_H
    if kernel in ("auto", "single_read"):
        kernel = "stats_apply" if T * (K + 1) >= SPLIT_BACKWARD_MIN_ROWS else "rows"
    kernel = kernel if kernel != "tiles" and whole_row else "tiles"
    block_h = next_power_of_2(H) if kernel != "tiles" else min(next_power_of_2(H), max(16, config.tile_elems // k_pad))
    warps, stages = BACKWARD_KERNEL_DEFAULTS[kernel]
    options = [("num_warps", config.num_warps or warps)]
    if config.maxnreg and not facts.interpreted:
        options.append(("maxnreg", config.maxnreg))  # a GPU compile option; the interpreter takes none
    apply = {}
    programs = min(T, facts.num_sms * config.programs_per_sm)
    if kernel == "stats_apply":
        # Both kernels: a (token ranges, column chunks) grid of about SMs x programs-per-SM programs.
        block = min(config.apply_block, next_power_of_2(H))
        chunks = cdiv(H, block)
        programs = min(T, cdiv(facts.num_sms * config.stats_programs_per_sm, chunks))
        apply = dict(apply_block=block, apply_options=(("num_warps", config.apply_warps),),
                     apply_num_stages=config.apply_stages,
                     apply_programs=min(T, cdiv(facts.num_sms * config.apply_programs_per_sm, chunks)),
                     scalars_programs=min(T, facts.num_sms * SCALARS_PROGRAMS_PER_SM))
    return BackwardPlan(num_programs=programs, block_h=block_h, k_pad=k_pad, acc64=config.acc64,
                        num_stages=config.num_stages or stages, kernel=kernel, launch_options=tuple(options), **apply,
                        reduce_options=(("num_warps", REDUCE_NUM_WARPS),))
