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
tiles, so its latency hides behind theirs; it is scored separately (a [BLOCK_H] row) and its row, in the I/O
dtype, is exactly what the fused call stores as new_prefix and the snapshot: in the epilogue, or with ``ONE_TILE``
(every block row in one tile, no loop) right after the tile's loads are issued (the in-place prefix after the
reductions: see there).

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

Recompile safety: T, K, every stride and write_idx are runtime arguments in ``do_not_specialize``; the compile
key is (dtype, BLOCK_H, ROWS, VEC, H_STRIDED, ACC64, NUM_STAGES, USE_PDL, the fused flags, ONW_AHEAD, ONE_TILE,
PREFIX_FIRST, num_warps).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attn_res_fwd import (
    _FUSED_INTS,
    _RUNTIME_INTS,
    _acc_full,
    _add_addend,
    _block_row_ptrs,
    _load_folded_weight,
    _norm_input,
    _norm_scale,
    _prefix_row_ptrs,
    _score,
    _serving_epilogue,
    _serving_row_out,
    _stats,
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
    s = _score(ss, d, H, eps, ACC64)
    m_new = tl.maximum(m, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m - m_new)
    acc = acc * alpha.to(tl.float32) + p.to(tl.float32) * x
    l_sum = l_sum * alpha + p
    return m_new, l_sum, acc


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
                          ONE_TILE: tl.constexpr = False, PREFIX_FIRST: tl.constexpr = False):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    gdc_wait_if(USE_PDL)
    gdc_launch_dependents_if(USE_PDL)
    w = _load_folded_weight(nw_ptr, pw_ptr, cols, hmask)
    if ONW_AHEAD:
        g = tl.load(onw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    # The prefix candidate first (new_prefix with an addend): its loads overlap the tiles'.
    v = tl.load(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED), mask=hmask, other=0.0)
    if HAS_ADDEND:
        v = _add_addend(v, addend_ptr, t, cols, hmask, stride_at, stride_ah, VEC, H_STRIDED)
    r = tl.arange(0, ROWS)
    if ONE_TILE:
        # Every block row in one tile (the policy makes ROWS >= K) and the prefix row beside it: no loop, no
        # online rescale, both statistics of each in one two-operand reduction (tools/decode_probe.py).
        rmask = tl.where(hmask[None, :], (r < K)[:, None], False)
        x = tl.load(_block_row_ptrs(blocks_ptr, t, r[:, None], cols[None, :], stride_bt, stride_bc, stride_bh, VEC,
                                    H_STRIDED), mask=rmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
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
        ss, d = _stats(x, w[None, :], 1, ACC64, True)
        ss_v, d_v = _stats(vf, w, 0, ACC64, True)
        s = tl.where(r < K, _score(ss, d, H, eps, ACC64), -float("inf"))
        s_v = _score(ss_v, d_v, H, eps, ACC64)
        m = tl.maximum(tl.max(s, axis=0), s_v)
        p = tl.exp(s - m)
        p_v = tl.exp(s_v - m)
        acc = tl.sum(p.to(tl.float32)[:, None] * x, axis=0) + p_v.to(tl.float32) * vf
        mix = acc / (tl.sum(p, axis=0) + p_v).to(tl.float32)
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
            m = _score(ss_v, d_v, H, eps, ACC64)
            l_sum = _acc_full([], 1.0, ACC64)
            acc = vf
            if FUSED:
                _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_pt,
                                      stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED,
                                      HAS_ADDEND, SNAPSHOT, INPLACE_PREFIX)
        else:
            m = _acc_full([], -float("inf"), ACC64)
            l_sum = _acc_full([], 0.0, ACC64)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.range(0, tl.cdiv(K, ROWS), num_stages=NUM_STAGES):
            i = j * ROWS + r
            # Rows >= K are masked lanes: never addressed, so NaN-filled capacity is never read.
            rmask = tl.where(hmask[None, :], (i < K)[:, None], False)
            x = tl.load(_block_row_ptrs(blocks_ptr, t, i[:, None], cols[None, :], stride_bt, stride_bc, stride_bh,
                                        VEC, H_STRIDED), mask=rmask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            # An online softmax over ROWS rows at once: both statistics of the tile in one cross-warp reduction.
            ss, d = _stats(x, w[None, :], 1, ACC64, True)
            s = tl.where(i < K, _score(ss, d, H, eps, ACC64), -float("inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            acc = acc * alpha.to(tl.float32) + tl.sum(p.to(tl.float32)[:, None] * x, axis=0)
            l_sum = l_sum * alpha + tl.sum(p, axis=0)
            m = m_new
        if not PREFIX_FIRST:
            # The prefix candidate, last.
            m, l_sum, acc = _fold_row(v.to(tl.float32), w, m, l_sum, acc, H, eps, ACC64)
        mix = acc / l_sum.to(tl.float32)
    if FUSED and ONW_AHEAD:
        # The epilogue below with the output norm's weight already in registers (no FP8 output here).
        if not ONE_TILE and not PREFIX_FIRST:
            _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_pt,
                                  stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED, HAS_ADDEND,
                                  SNAPSHOT, INPLACE_PREFIX)
        if not PREFIX_FIRST:
            mix = tl.where(K == 0, v.to(tl.float32), mix)
        x = _norm_input(mix, hmask, prefix_ptr, NORM_FP32_MIX)
        _store_out(out_ptr, t, cols, hmask, x * _norm_scale(tl.sum(x * x, axis=0), H, out_eps) * g, stride_ot, VEC)
    elif FUSED and (ONE_TILE or PREFIX_FIRST):
        # The output side only: the new prefix and the snapshot are stored above. K = 0: the mix IS the new prefix
        # (as in _serving_epilogue; with PREFIX_FIRST it already is, bit for bit).
        if ONE_TILE:
            mix = tl.where(K == 0, v.to(tl.float32), mix)
        _serving_row_out(out_ptr, prefix_ptr, scale_ptr, onw_ptr, t, cols, hmask, mix, H, out_eps, stride_ot, VEC,
                         OUT_NORM, NORM_FP32_MIX, FP8_OUT, FP8_FNUZ, FP8_MAX)
    elif FUSED:
        # The rows kernel's epilogue: new_prefix (or, INPLACE_PREFIX, prefix itself: this program read its row
        # above and no other program touches it), the snapshot, the output norm and the FP8 output.
        _serving_epilogue(out_ptr, newp_ptr, prefix_ptr, blocks_ptr, onw_ptr, scale_ptr, t, cols, hmask, mix, v, K,
                          H, out_eps, stride_ot, stride_nt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                          write_idx, VEC, H_STRIDED, HAS_ADDEND, SNAPSHOT, OUT_NORM, INPLACE_PREFIX, NORM_FP32_MIX,
                          FP8_OUT, FP8_FNUZ, FP8_MAX)
    else:
        _store_out(out_ptr, t, cols, hmask, mix, stride_ot, VEC)
