"""The measured floors under a serving call: the ``floor``, ``floor_stream`` and ``floor_row`` rows of the mix, fused
and layer sections (CUDA only; a cell's floor is the fastest of them).

A Triton kernel that does only what no design of the op can skip, in the op's dependency order and with its PDL
launch: read every row the call reads (the prefix, the addend, the K candidate rows), store what the call stores
(the new prefix, the snapshot, one output row), and between the loads and the output store make one FP32
reduction over each row (the scores need a full-row sum before any output element exists) and, with the output
norm, one more over the mixed row. It has no weights, no scores, no softmax and no exchange between the programs
of one token: where it splits a token over several programs, each reduces only its own columns. So it is a lower
bound for the kernels the launch table chooses from (one program per token, tiles of rows, the cluster and
streaming kernels), timed with the same method in the same run; its output is not the op's.

Two geometries of the same kernel, each a floor in its own column. ``tile`` (the column ``floor``): all of a
token's rows in one [rows, columns] tile per program (every load in flight at once); 8 programs per token up to
16 tokens (the cluster kernel's split, where a token's rows through one SM are the bound), else as few as keep the
tile within 64 FP32 values per thread at 16 warps. Its padded 16-row tile at K = 8 makes it slower than the op
from 32 tokens on, where it bounds nothing. ``stream`` (the column ``floor_stream``): each token's columns over
many small 4-warp programs (at most 32 FP32 values per thread; 28 programs per token at K = 8, H = 7168), so
many tiles are in flight on every SM and the bytes, not a program's chain, set the time: the floor under the
bandwidth-bound shapes, where graph replay may still serve rows from L2 faster than the copy bandwidth.

A third geometry, ``row`` (the column ``floor_row``): one program per token walking its rows one at a time, the
prefix first, through a software-pipelined loop (``ROW_WARPS`` warps, ``ROW_STAGES`` stages by default; ``warps`` and
``stages`` pick another form, ``ROW_FORMS`` are the ones ``python -m k3_ops.bench variants --floors`` times), each
row's reduction before its contribution to the output: the floor under the launch table's one-row plans (one
program per token, one row at a time), which neither of the others bounds at K = 8 from 64 tokens (the tile floor's
padded tile is slower than the op there, and the stream floor splits a token without its exchange).

The backward's floor (``backward_floor``, the train section's ``bwd floor``): the stream geometry over what every
backward must move, per token the K + 2 rows it reads (grad_out, the prefix, the K valid blocks) and the C + 1 rows
it writes (grad_prefix_sum and grad_block_residual at full capacity, zeros past K), with one FP32 reduction over each
row read before any row is written (the softmax backward needs every row's full-row sums first). No weights, no
exchange between the programs of one token, no weight gradient: a lower bound for the backward kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.attn_res_fwd import gdc_launch_dependents_if, gdc_wait_if

__all__ = ["backward_floor", "mix_floor", "fused_floor", "mix_floor_stream", "fused_floor_stream", "mix_floor_row",
           "fused_floor_row", "prefix_candidate", "GEOMETRIES", "ROW_FORMS", "row_form"]

GEOMETRIES = ("tile", "stream", "row")
#: Tokens up to which the tile geometry splits a token over SPLIT programs.
SPLIT_MAX_T = 16
SPLIT = 8
_MAX_TILE = 16 * 32 * 64  # 16 warps x 64 values
#: Columns and warps per program of the stream geometry (8 values of each of up to 8 block rows per thread).
STREAM_BLOCK, STREAM_WARPS = 1024, 4
#: Warps per program and pipeline stages of the row geometry (the table's one-row plan: 4 warps, 3 stages).
ROW_WARPS, ROW_STAGES = 4, 3
#: The row geometry's forms worth timing beside the default: (warps, stages).
ROW_FORMS = tuple((warps, stages) for warps in (4, 8) for stages in (1, 2, 3))


@triton.jit
def prefix_candidate(prefix_ptr, addend_ptr, blocks_ptr, new_prefix_ptr, t, cols, mask, stride_pt, stride_at,
                     stride_bt, stride_bc, H, write_idx, HAS_ADDEND: tl.constexpr):
    # The prefix candidate as the call has it, in FP32, and the call's stores of it: with an addend the new prefix
    # (one FP32 add rounded to the I/O dtype, as torch's add) into new_prefix and, where write_idx >= 0, the
    # snapshot slot. Every geometry's.
    v = tl.load(prefix_ptr + t * stride_pt + cols, mask=mask, other=0.0)
    if HAS_ADDEND:
        a = tl.load(addend_ptr + t * stride_at + cols, mask=mask, other=0.0)
        v = (v.to(tl.float32) + a.to(tl.float32)).to(new_prefix_ptr.dtype.element_ty)
        tl.store(new_prefix_ptr + t * H + cols, v, mask=mask)
        if write_idx >= 0:
            tl.store(blocks_ptr + t * stride_bt + write_idx * stride_bc + cols, v, mask=mask)
    return v.to(tl.float32)


@triton.jit
def _floor_kernel(prefix_ptr, addend_ptr, blocks_ptr, out_ptr, new_prefix_ptr, stride_pt, stride_at, stride_bt,
                  stride_bc, H, write_idx, eps, K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                  HAS_ADDEND: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr, PROGRAMS: tl.constexpr):
    # One grid axis, a token's programs adjacent (the CTAs in flight together read neighbouring columns).
    pid = tl.program_id(0)
    t = (pid // PROGRAMS).to(tl.int64)
    cols = (pid % PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    rows = tl.arange(0, ROWS)
    gdc_wait_if(USE_PDL)
    gdc_launch_dependents_if(USE_PDL)
    # Candidate rows 0..K-1 and the prefix in row K of one tile, loaded at once.
    tile_mask = (rows[:, None] < K) & mask[None, :]
    x = tl.load(blocks_ptr + t * stride_bt + rows[:, None] * stride_bc + cols[None, :], mask=tile_mask, other=0.0)
    x = x.to(tl.float32)
    v = prefix_candidate(prefix_ptr, addend_ptr, blocks_ptr, new_prefix_ptr, t, cols, mask, stride_pt, stride_at,
                         stride_bt, stride_bc, H, write_idx, HAS_ADDEND)
    x = tl.where(rows[:, None] == K, v[None, :], x)
    scale = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)  # one reduction per row
    y = tl.sum(x * scale[:, None], axis=0)
    if NORM:
        y = y * tl.rsqrt(tl.sum(y * y, axis=0) / H + eps)  # the output norm's reduction, after the mix
    tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _floor_stream_kernel(prefix_ptr, addend_ptr, blocks_ptr, out_ptr, new_prefix_ptr, stride_pt, stride_at, stride_bt,
                         stride_bc, H, write_idx, eps, K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_ADDEND: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr,
                         PROGRAMS: tl.constexpr):
    # The same work as _floor_kernel in another form: the K block rows in a [ROWS, BLOCK] tile (ROWS =
    # next_pow2(K), not next_pow2(K + 1): 8 rows at K = 8, not 16) and the prefix (and addend) apart as [1, BLOCK]
    # tiles, whose columns are laid out as the block tile's; every warp spans whole row pieces (BLOCK >= 256 x
    # warps). Tiles padded to 16 rows, or narrower than the warps, move far fewer bytes per second at large T, so
    # they would be no floor under the bandwidth-bound shapes.
    pid = tl.program_id(0)
    t = (pid // PROGRAMS).to(tl.int64)
    cols = ((pid % PROGRAMS) * BLOCK + tl.arange(0, BLOCK))[None, :]
    rows = tl.arange(0, ROWS)[:, None]
    inside = cols < H
    gdc_wait_if(USE_PDL)
    gdc_launch_dependents_if(USE_PDL)
    x = tl.load(blocks_ptr + t * stride_bt + rows * stride_bc + cols, mask=(rows < K) & inside, other=0.0)
    v = prefix_candidate(prefix_ptr, addend_ptr, blocks_ptr, new_prefix_ptr, t, cols, inside, stride_pt, stride_at,
                         stride_bt, stride_bc, H, write_idx, HAS_ADDEND)
    x = x.to(tl.float32)
    # one reduction per row
    y = tl.sum(x * tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)[:, None], axis=0)[None, :]
    y += v * tl.rsqrt(tl.sum(v * v, axis=1) / H + eps)[:, None]
    if NORM:
        y = y * tl.rsqrt(tl.sum(y * y, axis=1) / H + eps)[:, None]  # the output norm's reduction, after the mix
    tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _floor_row_kernel(prefix_ptr, addend_ptr, blocks_ptr, out_ptr, new_prefix_ptr, stride_pt, stride_at, stride_bt,
                      stride_bc, H, write_idx, eps, K, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_ADDEND: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr, PROGRAMS: tl.constexpr,
                      STAGES: tl.constexpr):
    # The same work as _floor_kernel, one program per token and one row at a time: the prefix (and addend) first,
    # then the K block rows through a loop whose loads the compiler pipelines STAGES deep. Each row is reduced
    # before it is added to the output, as a one-pass kernel must (its weight needs the whole row's sum). K is a
    # runtime argument, as the op's: one compiled kernel per form serves every site of a layer step.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    gdc_wait_if(USE_PDL)
    gdc_launch_dependents_if(USE_PDL)
    v = prefix_candidate(prefix_ptr, addend_ptr, blocks_ptr, new_prefix_ptr, t, cols, mask, stride_pt, stride_at,
                         stride_bt, stride_bc, H, write_idx, HAS_ADDEND)
    y = v * tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    for i in tl.range(0, K, num_stages=STAGES):
        x = tl.load(blocks_ptr + t * stride_bt + i * stride_bc + cols, mask=mask, other=0.0).to(tl.float32)
        y += x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    if NORM:
        y = y * tl.rsqrt(tl.sum(y * y, axis=0) / H + eps)  # the output norm's reduction, after the mix
    tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_floor_kernel(gy_ptr, prefix_ptr, blocks_ptr, gp_ptr, gb_ptr, stride_gt, stride_pt, stride_bt, stride_bc,
                           H, C, K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    # A [ROWS, BLOCK] tile of the K block rows, the prefix and grad_out apart; each row's sum of squares over the
    # tile, then every gradient row of the token's columns: K + 1 rows that depend on those sums, C - K zero rows.
    pid = tl.program_id(0)
    t = (pid // PROGRAMS).to(tl.int64)
    cols = ((pid % PROGRAMS) * BLOCK + tl.arange(0, BLOCK))[None, :]
    rows = tl.arange(0, ROWS)[:, None]
    inside = cols < H
    x = tl.load(blocks_ptr + t * stride_bt + rows * stride_bc + cols, mask=(rows < K) & inside, other=0.0)
    x = x.to(tl.float32)
    v = tl.load(prefix_ptr + t * stride_pt + cols, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(gy_ptr + t * stride_gt + cols, mask=inside, other=0.0).to(tl.float32)
    dx = g + x * tl.sum(x * x, axis=1)[:, None]
    dv = g + v * tl.sum(v * v, axis=1)[:, None]
    tl.store(gp_ptr + t * H + cols, dv.to(gp_ptr.dtype.element_ty), mask=inside)
    tl.store(gb_ptr + (t * C + rows) * H + cols, dx.to(gb_ptr.dtype.element_ty), mask=(rows < K) & inside)
    for c in range(K, C):
        tl.store(gb_ptr + (t * C + c) * H + cols, tl.zeros_like(g).to(gb_ptr.dtype.element_ty), mask=inside)


def backward_floor(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                   output_mask=(True, True, True, True)):
    """The floor under ``attn_res_backward`` at this call's shape (same arguments; the outputs are not the op's)."""
    T, C, H = block_residual.shape
    K = int(num_valid_blocks)
    rows, programs, block, warps = _geometry(T, K, H, "stream")
    grad_prefix = torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
    grad_blocks = torch.empty((T, C, H), dtype=block_residual.dtype, device=prefix_sum.device)
    _backward_floor_kernel[(T * programs,)](
        grad_out, prefix_sum, block_residual, grad_prefix, grad_blocks, grad_out.stride(0), prefix_sum.stride(0),
        block_residual.stride(0), block_residual.stride(1), H, C, K=K, ROWS=rows, BLOCK=block, PROGRAMS=programs,
        num_warps=warps, num_stages=1)
    return grad_prefix, grad_blocks


def _geometry(T: int, K: int, H: int, geometry: str = "tile",
              row_warps: int | None = None) -> tuple[int, int, int, int]:
    """(rows per tile, programs per token, columns per program, warps)."""
    rows = triton.next_power_of_2(K + 1)
    if geometry == "stream":  # the prefix apart: next_pow2(K) block rows; 1024 columns, 4 warps
        block = min(STREAM_BLOCK, triton.next_power_of_2(H))
        return triton.next_power_of_2(max(K, 1)), triton.cdiv(H, block), block, STREAM_WARPS
    if geometry == "row":  # one program per token, one row of next_pow2(H) columns at a time
        return 1, 1, triton.next_power_of_2(H), row_warps or ROW_WARPS
    if geometry != "tile":
        raise ValueError(f"geometry must be one of {GEOMETRIES}, got {geometry!r}")
    programs = SPLIT if T <= SPLIT_MAX_T else 1
    while rows * triton.next_power_of_2(triton.cdiv(H, programs)) > _MAX_TILE:
        programs *= 2
    block = triton.next_power_of_2(triton.cdiv(H, programs))
    warps = min(16, max(4, rows * block // (32 * 64)))
    return rows, programs, block, warps


def _launch(prefix: torch.Tensor, addend: torch.Tensor | None, blocks: torch.Tensor, K: int, eps: float,
            write_idx: int, norm: bool, geometry: str, warps: int | None = None,
            stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    from ..backends.cuda import pdl_enabled

    T, H = prefix.shape
    rows, programs, block, warps = _geometry(T, K, H, geometry, warps)
    out = torch.empty((T, H), dtype=prefix.dtype, device=prefix.device)
    new_prefix = torch.empty_like(out) if addend is not None else None
    pdl = pdl_enabled(prefix.device)
    extra = {"launch_pdl": True} if pdl else {}
    kernel = {"stream": _floor_stream_kernel, "row": _floor_row_kernel}.get(geometry, _floor_kernel)
    if geometry == "row":
        extra["STAGES"] = stages or ROW_STAGES
    kernel[(T * programs,)](
        prefix, addend if addend is not None else prefix, blocks, out, new_prefix if new_prefix is not None else out,
        prefix.stride(0), (addend if addend is not None else prefix).stride(0), blocks.stride(0), blocks.stride(1),
        H, write_idx, eps, K=K, ROWS=rows, BLOCK=block, HAS_ADDEND=addend is not None, NORM=norm,
        USE_PDL=pdl, PROGRAMS=programs, num_warps=warps, num_stages=1, **extra)
    return out, new_prefix


def mix_floor(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, *, geometry="tile",
              warps=None, stages=None):
    """The floor under ``attn_res`` at this call's shape (same arguments; the output is not the op's); ``warps``
    and ``stages``: the row geometry's form (default ``ROW_WARPS``, ``ROW_STAGES``)."""
    return _launch(prefix_sum, None, block_residual, int(num_valid_blocks), float(eps), -1, False, geometry, warps,
                   stages)[0]


def fused_floor(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                block_write_idx=-1, out_norm_weight=None, out_norm_eps=None, *, geometry="tile", warps=None,
                stages=None):
    """The floor under ``fused_attn_res`` at this call's shape (same arguments; the outputs are not the op's)."""
    return _launch(prefix_sum, addend, block_residual, int(num_valid_blocks), float(eps), int(block_write_idx),
                   out_norm_weight is not None, geometry, warps, stages)


def mix_floor_stream(*args):
    """``mix_floor`` with the stream geometry."""
    return mix_floor(*args, geometry="stream")


def fused_floor_stream(*args):
    """``fused_floor`` with the stream geometry."""
    return fused_floor(*args, geometry="stream")


def mix_floor_row(*args):
    """``mix_floor`` with the row geometry."""
    return mix_floor(*args, geometry="row")


def fused_floor_row(*args):
    """``fused_floor`` with the row geometry."""
    return fused_floor(*args, geometry="row")


def row_form(fn, warps: int, stages: int):
    """``mix_floor`` or ``fused_floor`` in the row geometry's form (``warps``, ``stages``): a callable with the op's
    arguments."""
    def call(*args):
        return fn(*args, geometry="row", warps=warps, stages=stages)
    return call
