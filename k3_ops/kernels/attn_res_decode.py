"""Decode-size forward kernel of kimi_k3::attn_res and fused_attn_res (@triton.jit code only).

``attn_res_token_kernel``: one program per token, no workspace and no cross-program communication, so any
number of launches may run at once on any streams (and graphs replayed concurrently) without sharing mutable
state. Per token it streams the K valid block rows as [ROWS, BLOCK_H] tiles (ROWS a power of two, a runtime
loop over cdiv(K, ROWS) tiles, software-pipelined by Triton ``NUM_STAGES`` deep) through an online softmax and
folds in the prefix candidate last; each candidate row is read exactly once, each output row written once.

Why tiles of several rows: a decode token is one program's work, so what bounds it is how many bytes one SM has
in flight. A tile of ROWS rows puts ROWS rows' loads in flight at once and reduces all their statistics in one
cross-warp reduction (one shared-memory round per tile, not one per row).

The prefix candidate (and with HAS_ADDEND its addend) is loaded right after the dependency wait, before the
tiles (with ``ONE_TILE`` right after the tile's loads, which go first), so its latency hides behind theirs; it is
scored separately (a [BLOCK_H] row) and its row, in the I/O dtype, is exactly what the fused call stores as
new_prefix and the snapshot: in the epilogue, or with ``ONE_TILE`` (every block row in one tile, no loop) right
after the tile's loads are issued (the in-place prefix after the reductions: see there).

Programmatic dependent launch (``USE_PDL``, sm_90+): nothing is read before ``gdc_wait``, which returns only
once the preceding kernel in the stream has completed and its writes are visible (the weights too: they are read
from L2 beside the rows, so waiting for them costs no extra round trip). ``gdc_launch_dependents`` right after
the wait lets the next launch's programs be scheduled (they then wait in their own ``gdc_wait``), which hides the
launch latency of a captured chain. With USE_PDL False neither instruction is emitted (the interpreter and
pre-Hopper GPUs).

The output norm's weight (``ONW_AHEAD``, set by the launch policy where the registers allow it: tiles of at most
two rows over 8 warps, no FP8 output) is loaded with the inputs, so that its latency hides behind theirs instead
of adding an L2 round trip after the mix; with larger tiles, or 4 warps, holding it spills.

``PREFIX_FIRST`` (a loop plan's ``LaunchConfig.prefix_first``; the table's one-row plans at K = 5..16): the prefix
candidate folded into the online softmax before the tiles, so that its row is not held through the loop and the
fused call's new_prefix and snapshot stores drain beside the tiles.

``NORM_GRAM`` (``LaunchConfig.norm_gram``; tiles of 1, 2 or 4 rows, with the output norm): the norm's sum of
squares |mix|^2 = sum_ij p_i p_j <v_i, v_j> / l^2 from the candidates' pairwise products, reduced in the same
round as their statistics (``_gram_stats``; a loop carries |acc|^2 through the online softmax, ``_gram_update``),
so no reduction over the mix follows it; where that sum is below ``GRAM_TAU`` (sum_i p_i |v_i|)^2 (candidates that
cancel: its FP32 error would show) the norm reduces over the mix as without it (``_gram_result``, and
``_norm_sum_sq`` in attn_res_fwd.py). docs/kernels.md, "Token path".

Recompile safety: T, K, every stride and write_idx are runtime arguments in ``do_not_specialize``; the compile
key is (dtype, BLOCK_H, ROWS, VEC, H_STRIDED, ACC64, NUM_STAGES, USE_PDL, the fused flags, ONW_AHEAD, ONE_TILE,
PREFIX_FIRST, NORM_GRAM, GRAM_TAU, H_EXACT, num_warps): the hidden size is a compile-time constant (H_EXACT, one
compile per model), the token count never.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attn_res_fwd import (
    _FUSED_INTS,
    _INTERPRETED,
    _RUNTIME_INTS,
    _acc_full,
    _add_addend,
    _block_row_ptrs,
    _load_folded_weight,
    _norm_input,
    _norm_scale,
    _norm_sum_sq,
    _prefix_row_ptrs,
    _score,
    _serving_epilogue,
    _serving_row_out,
    _stats,
    _store_mix,
    _store_new_prefix,
    _store_out,
    _store_snapshot,
    _store_updated_prefix,
    gdc_launch_dependents_if,
    gdc_wait_if,
)


@triton.jit
def _fold_row(x, w, m, l_sum, acc, H, eps, ACC64: tl.constexpr):
    # One candidate row into the online softmax (the prefix, after the tiles): _online_update with both statistics
    # in one reduction and the exps in the order of the tile loop above. Not _online_update itself: its order
    # compiles to other sm_90 code, and this is the code timed against it (docs/benchmarks.md, "The statistics
    # in one reduction").
    ss, d = _stats(x, w, 0, ACC64, True)
    s = _score(ss, d, H, eps, ACC64, REFINED=True)
    m_new = tl.maximum(m, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m - m_new)
    acc = acc * alpha.to(tl.float32) + p.to(tl.float32) * x
    l_sum = l_sum * alpha + p
    return m_new, l_sum, acc


@triton.jit
def _fold_row_gram(x, w, m, l_sum, acc, A, B, H, eps, ACC64: tl.constexpr):
    # _fold_row with |acc|^2 carried (_gram_update for one row): its product with the accumulator in the same
    # reduction as its statistics.
    if ACC64:
        xd = x.to(tl.float64)
        ss, d = tl.sum(xd * xd, axis=0), tl.sum(xd * w.to(tl.float64), axis=0)
        c = tl.sum(xd * acc.to(tl.float64), axis=0)
    elif _INTERPRETED:
        ss, d, c = tl.sum(x * x, axis=0), tl.sum(x * w, axis=0), tl.sum(x * acc, axis=0)
    else:
        ss, d, c = tl.reduce((x * x, x * w, x * acc), 0, _sum3)
    s = _score(ss, d, H, eps, ACC64, REFINED=True)
    m_new = tl.maximum(m, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m - m_new)
    A = A * alpha * alpha + 2.0 * alpha * p * c + p * p * ss
    B = B * alpha + p * tl.sqrt(ss)
    acc = acc * alpha.to(tl.float32) + p.to(tl.float32) * x
    l_sum = l_sum * alpha + p
    return m_new, l_sum, acc, A, B


@triton.jit
def _prefix_row(prefix_ptr, addend_ptr, t, cols, hmask, stride_pt, stride_ph, stride_at, stride_ah,
                VEC: tl.constexpr, H_STRIDED: tl.constexpr, HAS_ADDEND: tl.constexpr):
    # The prefix candidate's row in the I/O dtype: with an addend the new prefix (_add_addend).
    v = tl.load(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED), mask=hmask, other=0.0)
    if HAS_ADDEND:
        v = _add_addend(v, addend_ptr, t, cols, hmask, stride_at, stride_ah, VEC, H_STRIDED)
    return v


@triton.jit
def _sum3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _sum4(a0, b0, c0, e0, a1, b1, c1, e1):
    return a0 + a1, b0 + b1, c0 + c1, e0 + e1


@triton.jit
def _sum5(a0, b0, c0, e0, f0, a1, b1, c1, e1, f1):
    return a0 + a1, b0 + b1, c0 + c1, e0 + e1, f0 + f1


@triton.jit
def _rolled_rows(x, r, s: tl.constexpr, ROWS: tl.constexpr):
    # Row (i + s) mod ROWS of the tile x ([ROWS, BLOCK_H]) in row i. A tile's rows are registers of every thread
    # (its threads and warps lie along H), so these constant-index selects move no data.
    y = tl.zeros_like(x)
    for j in tl.static_range(ROWS):
        row = tl.sum(tl.where(r[:, None] == j, x, 0.0), axis=0)
        y = tl.where(r[:, None] == (j + ROWS - s) % ROWS, row[None, :], y)
    return y


@triton.jit
def _rolled(p, r, s: tl.constexpr, ROWS: tl.constexpr):
    # _rolled_rows for a [ROWS] vector.
    y = tl.zeros_like(p)
    for j in tl.static_range(ROWS):
        y = tl.where(r == (j + ROWS - s) % ROWS, tl.sum(tl.where(r == j, p, 0.0), axis=0), y)
    return y


@triton.jit
def _gram_stats(x, w, u, r, ROWS: tl.constexpr, ACC64: tl.constexpr):
    # Per row i of the tile x ([ROWS, BLOCK_H] FP32; ROWS 1, 2 or 4): sum x_i^2, <x_i, w>, <x_i, u> (u a [BLOCK_H]
    # row: the prefix candidate, or the running accumulator of the loop) and the products with the other rows,
    # g1_i = <x_i, x_(i+1) mod ROWS> (ROWS >= 2) and g2_i = <x_i, x_(i+2) mod 4> (ROWS = 4): with the diagonal,
    # every product of two rows. One multi-operand reduction (one cross-warp round), as _stats's pair; FP64 with
    # ACC64, and plain sums under the interpreter (see _stats).
    if ACC64:
        x = x.to(tl.float64)
        w = w.to(tl.float64)
        u = u.to(tl.float64)
    xu = x * u[None, :]
    g1 = tl.zeros([ROWS], x.dtype)
    g2 = tl.zeros([ROWS], x.dtype)
    if ACC64 or _INTERPRETED:
        ss, d, c = tl.sum(x * x, axis=1), tl.sum(x * w, axis=1), tl.sum(xu, axis=1)
        if ROWS >= 2:
            g1 = tl.sum(x * _rolled_rows(x, r, 1, ROWS), axis=1)
        if ROWS == 4:
            g2 = tl.sum(x * _rolled_rows(x, r, 2, ROWS), axis=1)
    elif ROWS == 1:
        ss, d, c = tl.reduce((x * x, x * w, xu), 1, _sum3)
    elif ROWS == 2:
        ss, d, c, g1 = tl.reduce((x * x, x * w, xu, x * _rolled_rows(x, r, 1, ROWS)), 1, _sum4)
    else:
        ss, d, c, g1, g2 = tl.reduce((x * x, x * w, xu, x * _rolled_rows(x, r, 1, ROWS),
                                      x * _rolled_rows(x, r, 2, ROWS)), 1, _sum5)
    return ss, d, c, g1, g2


@triton.jit
def _gram_quad(p, ss, g1, g2, r, ROWS: tl.constexpr):
    # sum_ij p_i p_j <x_i, x_j> over a tile's rows from _gram_stats: the diagonal, then the ordered pairs i != j,
    # which are the pairs at distance 1 (both orders at ROWS = 2; at ROWS = 4 distance 3 mirrors distance 1) and 2.
    q = tl.sum(p * p * ss, axis=0)
    if ROWS == 2:
        q += tl.sum(p * _rolled(p, r, 1, ROWS) * g1, axis=0)
    if ROWS == 4:
        q += 2.0 * tl.sum(p * _rolled(p, r, 1, ROWS) * g1, axis=0) + tl.sum(p * _rolled(p, r, 2, ROWS) * g2, axis=0)
    return q


@triton.jit
def _gram_update(A, B, alpha, p, ss, c, g1, g2, r, ROWS: tl.constexpr):
    # The online softmax's acc' = alpha acc + sum_i p_i x_i, squared: |acc'|^2 = alpha^2 |acc|^2
    # + 2 alpha sum_i p_i <acc, x_i> + sum_ij p_i p_j <x_i, x_j>; and its bound B' = alpha B + sum_i p_i |x_i|
    # (|acc| <= B: what the guard compares |acc|^2 with).
    A = A * alpha * alpha + 2.0 * alpha * tl.sum(p * c, axis=0) + _gram_quad(p, ss, g1, g2, r, ROWS)
    B = B * alpha + tl.sum(p * tl.sqrt(ss), axis=0)
    return A, B


@triton.jit
def _gram_result(A, B, l_sum, GRAM_TAU: tl.constexpr):
    # The mix's sum of squares A / l^2 and whether it is accurate: each pairwise product carries an FP32 error of
    # a few ulp of |x_i| |x_j|, so A's error is a few ulp of B^2, and A >= GRAM_TAU B^2 bounds its relative error
    # by a few ulp / GRAM_TAU. Below (candidates that cancel), or NaN / inf, the norm reduces over its input.
    return A / (l_sum * l_sum), A >= GRAM_TAU * (B * B)


@triton.jit(do_not_specialize=_RUNTIME_INTS + _FUSED_INTS)
def attn_res_token_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, T, K, H, eps,
                          stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_ot,
                          BLOCK_H: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                          ACC64: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
                          addend_ptr=None, newp_ptr=None, onw_ptr=None, stride_at=0, stride_ah=0, stride_nt=0,
                          write_idx=0, out_eps=1.0, HAS_ADDEND: tl.constexpr = False, FUSED: tl.constexpr = False,
                          SNAPSHOT: tl.constexpr = False, OUT_NORM: tl.constexpr = False, scale_ptr=None,
                          INPLACE_PREFIX: tl.constexpr = False, NORM_FP32_MIX: tl.constexpr = False,
                          FP8_OUT: tl.constexpr = False, FP8_FNUZ: tl.constexpr = False,
                          FP8_MAX: tl.constexpr = 448.0, ONW_AHEAD: tl.constexpr = False,
                          ONE_TILE: tl.constexpr = False, PREFIX_FIRST: tl.constexpr = False,
                          NORM_GRAM: tl.constexpr = False, GRAM_TAU: tl.constexpr = 0.015625,
                          H_EXACT: tl.constexpr = 0, mix_ptr=None, MIX_OUT: tl.constexpr = False):
    if H_EXACT > 0:
        # The hidden size as a compile-time constant (the launch passes it; one compile per model): the column
        # mask is then known per register wherever a whole register's columns lie past H, so their loads, their
        # arithmetic and their stores compile away. With 4 warps (1024 columns per layout repetition) that is
        # the last of BLOCK_H = 8192's eight repetitions at H = 7168, an eighth of the loop's per-column work.
        H = H_EXACT
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    gram_ss, gram_ok = 0.0, False  # NORM_GRAM sets them (the output norm's sum of squares, and its guard)
    hmask = cols < H
    gdc_wait_if(USE_PDL)
    gdc_launch_dependents_if(USE_PDL)
    r = tl.arange(0, ROWS)
    if ONE_TILE:
        # Every block row in one tile (the policy makes ROWS >= K) and the prefix row beside it: no loop, no
        # online rescale, both statistics of each in one two-operand reduction (tools/decode_probe.py).
        # Where the compiled code issues the tile's loads moves its time (docs/benchmarks.md, "The op's steps on a
        # one-tile floor"), and two source choices here were timed for it (one H100 run each, beside the kernel
        # before): the tile's loads first in the source, before the prefix's and the weights' (0.97-1.02x), and
        # the row mask as `&` of the two bool tensors, 0.89-0.97x for the plain op at 64-512 tokens, K = 2..4,
        # where tl.where is 2-5 % faster for the fused call at 128-512 tokens: each keeps its faster form (the
        # same lanes, the same bits).
        if FUSED:
            rmask = tl.where(hmask[None, :], (r < K)[:, None], False)
        else:
            rmask = (r < K)[:, None] & hmask[None, :]
        x = tl.load(_block_row_ptrs(blocks_ptr, t, r[:, None], cols[None, :], stride_bt, stride_bc, stride_bh, VEC,
                                    H_STRIDED), mask=rmask, other=0.0, eviction_policy="evict_first")
        v = _prefix_row(prefix_ptr, addend_ptr, t, cols, hmask, stride_pt, stride_ph, stride_at, stride_ah, VEC,
                        H_STRIDED, HAS_ADDEND)
    w = _load_folded_weight(nw_ptr, pw_ptr, cols, hmask)
    if ONW_AHEAD:
        g = tl.load(onw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    if not ONE_TILE:
        # The prefix candidate before the loop: its loads overlap the tiles'.
        v = _prefix_row(prefix_ptr, addend_ptr, t, cols, hmask, stride_pt, stride_ph, stride_at, stride_ah, VEC,
                        H_STRIDED, HAS_ADDEND)
    if ONE_TILE:
        x = x.to(tl.float32)
        if FUSED:
            # new_prefix and the snapshot as soon as their row is in, while the tile is still loading: the stores
            # drain beside the reduction instead of after it. Safe because nothing in this kernel reads what they
            # write (new_prefix is an output; the snapshot slot is >= K, outside the tile's rows). The in-place
            # prefix is not stored here: a row tensor may be held by several warps at once (a replicated layout,
            # e.g. 128 columns over 256 threads), and a warp that stored it early could overwrite the prefix before
            # another warp has loaded its copy, which would then add the addend twice (seen on the H200 at
            # H = 96). It is stored after the reductions below, which every warp's copy of the row has entered.
            if INPLACE_PREFIX:
                if SNAPSHOT:
                    _store_snapshot(blocks_ptr, t, cols, hmask, v, stride_bt, stride_bc, stride_bh, write_idx, VEC,
                                    H_STRIDED)
            else:
                _store_new_prefix(newp_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_bt, stride_bc,
                                  stride_bh, write_idx, VEC, H_STRIDED, SNAPSHOT)
        vf = v.to(tl.float32)
        if NORM_GRAM:
            ss, d, c, g1, g2 = _gram_stats(x, w[None, :], vf, r, ROWS, ACC64)
        else:
            ss, d = _stats(x, w[None, :], 1, ACC64, True)
        ss_v, d_v = _stats(vf, w, 0, ACC64, True)
        s = tl.where(r < K, _score(ss, d, H, eps, ACC64, REFINED=True), -float("inf"))
        s_v = _score(ss_v, d_v, H, eps, ACC64, REFINED=True)
        m = tl.maximum(tl.max(s, axis=0), s_v)
        p = tl.exp(s - m)
        p_v = tl.exp(s_v - m)
        # The weights normalised before the sum (as the softmax of the eager formula): K + 1 scalar products here
        # instead of a division of every column after it.
        inv_l = 1.0 / (tl.sum(p, axis=0) + p_v)
        mix = tl.sum((p * inv_l).to(tl.float32)[:, None] * x, axis=0) + (p_v * inv_l).to(tl.float32) * vf
        if NORM_GRAM:
            # |mix|^2 from the statistics: the prefix row's own ss_v, its products c with the block rows, and
            # theirs among them (_gram_stats); no reduction over the mix (see _gram_result).
            A = _gram_quad(p, ss, g1, g2, r, ROWS) + 2.0 * p_v * tl.sum(p * c, axis=0) + p_v * p_v * ss_v
            B = tl.sum(p * tl.sqrt(ss), axis=0) + p_v * tl.sqrt(ss_v)
            gram_ss, gram_ok = _gram_result(A, B, tl.sum(p, axis=0) + p_v, GRAM_TAU)
        if FUSED and INPLACE_PREFIX:
            # After the prefix row's reduction (see above): every warp has read the row it overwrites. The
            # snapshot is stored above (SNAPSHOT False here); without an addend nothing is stored.
            _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_pt,
                                  stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED, HAS_ADDEND,
                                  False, INPLACE_PREFIX)
    else:
        if PREFIX_FIRST:
            # The prefix candidate first: its weight is exp(0) = 1, so acc starts as the row itself (K = 0: the mix
            # is the new prefix exactly, -0.0 included), and the row is dead before the tiles (fewer live
            # registers in the loop). The fused call's stores follow its reduction, which every warp's copy of
            # the row has entered (the in-place prefix: see the one-tile branch above).
            vf = v.to(tl.float32)
            ss_v, d_v = _stats(vf, w, 0, ACC64, True)
            m = _score(ss_v, d_v, H, eps, ACC64, REFINED=True)
            l_sum = _acc_full([], 1.0, ACC64)
            acc = vf
            if NORM_GRAM:
                # |acc|^2 and its bound, carried through the loop (_gram_update).
                A = ss_v
                B = tl.sqrt(ss_v)
            if FUSED:
                _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_pt,
                                      stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED,
                                      HAS_ADDEND, SNAPSHOT, INPLACE_PREFIX)
        else:
            m = _acc_full([], -float("inf"), ACC64)
            l_sum = _acc_full([], 0.0, ACC64)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            if NORM_GRAM:
                A = _acc_full([], 0.0, ACC64)
                B = _acc_full([], 0.0, ACC64)
        for j in tl.range(0, tl.cdiv(K, ROWS), num_stages=NUM_STAGES):
            i = j * ROWS + r
            # Rows >= K are masked lanes: never addressed, so NaN-filled capacity is never read.
            rmask = tl.where(hmask[None, :], (i < K)[:, None], False)
            x = tl.load(_block_row_ptrs(blocks_ptr, t, i[:, None], cols[None, :], stride_bt, stride_bc, stride_bh,
                                        VEC, H_STRIDED), mask=rmask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            # An online softmax over ROWS rows at once: both statistics of the tile in one cross-warp reduction
            # (with NORM_GRAM, the products with the accumulator and among the rows in the same one).
            if NORM_GRAM:
                ss, d, c, g1, g2 = _gram_stats(x, w[None, :], acc, r, ROWS, ACC64)
            else:
                ss, d = _stats(x, w[None, :], 1, ACC64, True)
            s = tl.where(i < K, _score(ss, d, H, eps, ACC64, REFINED=True), -float("inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            if NORM_GRAM:
                A, B = _gram_update(A, B, alpha, p, ss, c, g1, g2, r, ROWS)
            acc = acc * alpha.to(tl.float32) + tl.sum(p.to(tl.float32)[:, None] * x, axis=0)
            l_sum = l_sum * alpha + tl.sum(p, axis=0)
            m = m_new
        if not PREFIX_FIRST:
            # The prefix candidate, last.
            if NORM_GRAM:
                m, l_sum, acc, A, B = _fold_row_gram(v.to(tl.float32), w, m, l_sum, acc, A, B, H, eps, ACC64)
            else:
                m, l_sum, acc = _fold_row(v.to(tl.float32), w, m, l_sum, acc, H, eps, ACC64)
        mix = acc / l_sum.to(tl.float32)
        if NORM_GRAM:
            gram_ss, gram_ok = _gram_result(A, B, l_sum, GRAM_TAU)
    if FUSED and ONW_AHEAD:
        # The epilogue below with the output norm's weight already in registers (no FP8 output here).
        if not ONE_TILE and not PREFIX_FIRST:
            _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_pt,
                                  stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED, HAS_ADDEND,
                                  SNAPSHOT, INPLACE_PREFIX)
        if not PREFIX_FIRST:
            mix = tl.where(K == 0, v.to(tl.float32), mix)
        _store_mix(mix_ptr, t, cols, hmask, mix, stride_ot, VEC, MIX_OUT)
        x = _norm_input(mix, hmask, prefix_ptr, NORM_FP32_MIX)
        scale = _norm_scale(_norm_sum_sq(x, gram_ss, gram_ok, NORM_GRAM), H, out_eps, REFINED=True)
        _store_out(out_ptr, t, cols, hmask, x * scale * g, stride_ot, VEC)
    elif FUSED and (ONE_TILE or PREFIX_FIRST):
        # The output side only: the new prefix and the snapshot are stored above. K = 0: the mix IS the new prefix
        # (as in _serving_epilogue; with PREFIX_FIRST it already is, bit for bit).
        if ONE_TILE:
            mix = tl.where(K == 0, v.to(tl.float32), mix)
        _serving_row_out(out_ptr, prefix_ptr, scale_ptr, onw_ptr, t, cols, hmask, mix, H, out_eps, stride_ot, VEC,
                         OUT_NORM, NORM_FP32_MIX, FP8_OUT, FP8_FNUZ, FP8_MAX, False, gram_ss, gram_ok, NORM_GRAM,
                         REFINED=True, mix_ptr=mix_ptr, MIX_OUT=MIX_OUT)
    elif FUSED:
        # The rows kernel's epilogue: new_prefix (or, INPLACE_PREFIX, prefix itself: this program read its row
        # above and no other program touches it), the snapshot, the output norm and the FP8 output.
        _serving_epilogue(out_ptr, newp_ptr, prefix_ptr, blocks_ptr, onw_ptr, scale_ptr, t, cols, hmask, mix, v, K,
                          H, out_eps, stride_ot, stride_nt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                          write_idx, VEC, H_STRIDED, HAS_ADDEND, SNAPSHOT, OUT_NORM, INPLACE_PREFIX, NORM_FP32_MIX,
                          FP8_OUT, FP8_FNUZ, FP8_MAX, gram_ss, gram_ok, NORM_GRAM, REFINED=True, mix_ptr=mix_ptr,
                          MIX_OUT=MIX_OUT)
    else:
        _store_out(out_ptr, t, cols, hmask, mix, stride_ot, VEC)
