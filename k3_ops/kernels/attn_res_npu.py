"""Forward kernels that only the Ascend NPU policy launches (@triton.jit code only; k3_ops/backends/npu.py).

``attn_res_npu_single_read_kernel``: one program per vector core walking a contiguous token range; per token the
K + 1 candidate rows are streamed through one [BLOCK_H = next_power_of_2(H)] row tile and folded into an online
softmax (running max, running sum, an FP32 accumulator row), so every valid candidate row is read exactly once:
(K + 2) H itemsize bytes per token against the two-pass kernel's (2 (K + 1) + 1) H itemsize. The folded weight
row is loaded once per program. The policy launches it where its working set fits the vector core's Unified
Buffer (``npu.npu_single_read_bytes``; a whole row must be resident because a row's score, and with it its
softmax weight, is known only after the whole row was reduced); elsewhere the two-pass
``attn_res_fwd.attn_res_npu_kernel`` runs, which also serves the CUDA "tiles" plan and therefore lives with
the shared kernels.

Arithmetic: FP32 throughout; fp32 I/O (``COMPENSATED``) keeps the statistics and the score in double-float
FP32 pairs as the two-pass kernel does (no FP64 on the vector cores), and applies the low part of each score and
of each rescaling exponent to first order. Fused and serving flags as in attn_res_fwd (HAS_ADDEND, FUSED,
SNAPSHOT, OUT_NORM; INPLACE_PREFIX, NORM_FP32_MIX, FP8_OUT, MIX_OUT through its serving helpers); the mix is computed by
the same code with or without them, so a fused op's mix equals the plain op's of its new prefix bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attn_res_fwd import (
    _FUSED_INTS,
    _RUNTIME_INTS,
    _add_addend,
    _block_row_ptrs,
    _df_score,
    _load_folded_weight,
    _prefix_row_ptrs,
    _serving_row_out,
    _store_updated_prefix,
    _two_sum_combine,
)


@triton.jit
def _df_sums(a, b, BLOCK: tl.constexpr):
    """Sums of two [BLOCK] FP32 vectors as double-float (hi, lo) scalars: a pairwise tree of TwoSums, one vectorised
    level at a time (adjacent elements paired through reshape + split), so the order is fixed by construction and
    the interpreter runs vector ops, not a per-element combine."""
    a_lo = tl.zeros_like(a)
    b_lo = tl.zeros_like(b)
    for i in tl.static_range(16):
        if (BLOCK >> i) > 1:
            x_hi, y_hi = tl.split(tl.reshape(a, [BLOCK >> (i + 1), 2]))
            x_lo, y_lo = tl.split(tl.reshape(a_lo, [BLOCK >> (i + 1), 2]))
            a = x_hi + y_hi
            t_ = a - x_hi
            a_lo = x_lo + y_lo + ((x_hi - (a - t_)) + (y_hi - t_))
            x_hi, y_hi = tl.split(tl.reshape(b, [BLOCK >> (i + 1), 2]))
            x_lo, y_lo = tl.split(tl.reshape(b_lo, [BLOCK >> (i + 1), 2]))
            b = x_hi + y_hi
            t_ = b - x_hi
            b_lo = x_lo + y_lo + ((x_hi - (b - t_)) + (y_hi - t_))
    # One element left: its scalar (a one-element sum; the pairs are normalised by _df_score's first steps).
    return tl.sum(a, axis=0), tl.sum(a_lo, axis=0), tl.sum(b, axis=0), tl.sum(b_lo, axis=0)


@triton.jit
def _exp_df(hi, lo):
    # exp(hi + lo) for |lo| << |hi|, the low part to first order.
    return tl.exp(hi) * (1.0 + lo)


@triton.jit
def _online_update(x, w, m, l_sum, acc, H, eps, COMPENSATED: tl.constexpr, BLOCK_H: tl.constexpr):
    """One candidate row x (FP32, masked lanes zero) into the running (max m, sum l_sum, accumulator acc)."""
    if COMPENSATED:
        ss_hi, ss_lo, d_hi, d_lo = _df_sums(x * x, x * w, BLOCK_H)
        _, _, s_hi, s_lo = _df_score(ss_hi, ss_lo, d_hi, d_lo, H, eps)
        m_new = tl.maximum(m, s_hi)
        # s - m_new and m - m_new exactly (TwoSum), so the only rounding left is exp's own; the first candidate
        # (m = -inf) gets alpha = 0 without forming inf - inf.
        z_hi, z_lo = _two_sum_combine(s_hi, s_lo, -m_new, 0.0)
        p = _exp_df(z_hi, z_lo)
        first = m == -float("inf")
        y_hi, y_lo = _two_sum_combine(tl.where(first, m_new, m), 0.0, -m_new, 0.0)
        alpha = tl.where(first, 0.0, _exp_df(y_hi, y_lo))
    else:
        # Plain FP32 sqrt and division, as the two-pass kernel's bf16/fp16 score.
        s = tl.sum(x * w, axis=0) / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        m_new = tl.maximum(m, s)
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
    return m_new, l_sum * alpha + p, acc * alpha + p * x


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["tokens_per_prog"] + _FUSED_INTS)
def attn_res_npu_single_read_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, T, K, H, eps, tokens_per_prog,
                                    stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_ot,
                                    BLOCK_H: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                                    COMPENSATED: tl.constexpr, CHUNK: tl.constexpr,
                                    addend_ptr=None, newp_ptr=None, onw_ptr=None, stride_at=0, stride_ah=0,
                                    stride_nt=0, write_idx=0, out_eps=1.0, HAS_ADDEND: tl.constexpr = False,
                                    FUSED: tl.constexpr = False, SNAPSHOT: tl.constexpr = False,
                                    OUT_NORM: tl.constexpr = False, scale_ptr=None,
                                    INPLACE_PREFIX: tl.constexpr = False, NORM_FP32_MIX: tl.constexpr = False,
                                    FP8_OUT: tl.constexpr = False, FP8_FNUZ: tl.constexpr = False,
                                    FP8_MAX: tl.constexpr = 448.0, mix_ptr=None, MIX_OUT: tl.constexpr = False):
    # Program pid owns tokens [pid * tokens_per_prog, (pid + 1) * tokens_per_prog); per token the candidates
    # v_0 .. v_{K-1} (block rows, never a slot >= K) and then v_K (the prefix, or the new prefix) are loaded once
    # each, as plain masked row loads (no pointer select). Working set per program (Unified Buffer): the folded
    # weight row and the accumulator row (FP32), the row in flight (double-buffered under multibuffer) and its
    # FP32 copy, one FP32 product row; fp32 I/O adds the double-float tree's pairs (npu.npu_single_read_bytes).
    # Fused: with an addend, the new prefix round(prefix + addend) is formed first in CHUNK-wide pieces (small
    # tiles, so the row-wide working set stays the plain kernel's) and stored with its snapshot, into new_prefix
    # or, with INPLACE_PREFIX, back into prefix_sum (attn_res_fwd's serving-helper contract); the candidate loop
    # then reads it back as v_K (the program's own row, just written: a barrier orders the two). Without an addend
    # v_K is the prefix row, stored as new_prefix (and the snapshot) when it is loaded. The output side (norm of
    # the rounded or, NORM_FP32_MIX, the FP32 mix; FP8 output with its per-token scale) works on the mix row
    # still in the accumulator, so it needs no further pass over memory and no scratch row.
    pid = tl.program_id(0)
    t_begin = pid * tokens_per_prog
    t_end = tl.minimum(t_begin + tokens_per_prog, T)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    w = _load_folded_weight(nw_ptr, pw_ptr, cols, hmask)
    for t in range(t_begin, t_end):
        if HAS_ADDEND:
            for h0 in range(0, H, CHUNK):
                ccols = h0 + tl.arange(0, CHUNK)
                cmask = ccols < H
                newp = tl.load(_prefix_row_ptrs(prefix_ptr, t, ccols, stride_pt, stride_ph, VEC, H_STRIDED),
                               mask=cmask, other=0.0)
                newp = _add_addend(newp, addend_ptr, t, ccols, cmask, stride_at, stride_ah, VEC, H_STRIDED)
                _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, ccols, cmask, newp, stride_nt, stride_pt,
                                      stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED,
                                      HAS_ADDEND, SNAPSHOT, INPLACE_PREFIX)
            tl.debug_barrier()
        m = tl.full([], -float("inf"), tl.float32)
        l_sum = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i in range(0, K):
            x = tl.load(_block_row_ptrs(blocks_ptr, t, i, cols, stride_bt, stride_bc, stride_bh, VEC, H_STRIDED),
                        mask=hmask, other=0.0).to(tl.float32)
            m, l_sum, acc = _online_update(x, w, m, l_sum, acc, H, eps, COMPENSATED, BLOCK_H)
        if HAS_ADDEND and not INPLACE_PREFIX:
            v = tl.load(newp_ptr + tl.cast(t, tl.int64) * (stride_nt * VEC) + cols, mask=hmask, other=0.0)
        else:
            # The prefix row (with INPLACE_PREFIX and an addend: the new prefix stored there above).
            v = tl.load(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED), mask=hmask,
                        other=0.0)
            if FUSED and not HAS_ADDEND:
                _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_pt,
                                      stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED,
                                      HAS_ADDEND, SNAPSHOT, INPLACE_PREFIX)
        x = v.to(tl.float32)
        m, l_sum, acc = _online_update(x, w, m, l_sum, acc, H, eps, COMPENSATED, BLOCK_H)
        mix = acc / l_sum
        if FUSED:
            # K = 0: the mix IS the new prefix (attn_res's exact copy, -0.0 included); p * x / p need not be x.
            mix = tl.where(K == 0, x, mix)
        _serving_row_out(out_ptr, prefix_ptr, scale_ptr, onw_ptr, t, cols, hmask, mix, H, out_eps, stride_ot, VEC,
                         OUT_NORM, NORM_FP32_MIX, FP8_OUT, FP8_FNUZ, FP8_MAX, NPU_NORM_SCALE=True, mix_ptr=mix_ptr,
                         MIX_OUT=MIX_OUT)
