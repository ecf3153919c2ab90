"""Backward kernels of kimi_k3::attn_res (@triton.jit code only; launch policies live in k3_ops/backends/).

With gy = dL/d out, per token in FP32 (docs/attn_res_backward.md, "Math"), recomputed from the inputs:

    r_i = rsqrt(mean(v_i^2) + eps),  d_i = <v_i, w>,  p = softmax(r * d),  g_i = <gy, v_i>
    gs_i = p_i (g_i - sum_j p_j g_j)
    dv_i = p_i gy + gs_i (r_i w - (d_i r_i^3 / H) v_i)         -> grad_block_residual[t, i] (i < K), grad_prefix (i = K)
    dw   = sum_t sum_i gs_i r_i v_i      (folded w = norm_weight * proj_weight) -> grad_norm_weight = dw * proj_weight,
                                                                                grad_proj_weight = dw * norm_weight

The kernels:

- ``attn_res_bwd_kernel`` (every device: Ascend, and CUDA for H > 8192 or ``BackwardConfig(kernel="tiles")``):
  a bounded grid of programs (a few per SM on CUDA, one per vector core on Ascend), program p walking the
  contiguous token range [p * tokens_per_prog, (p + 1) * tokens_per_prog). Per token, two passes over H in
  [K_PAD, BLOCK_H] tiles (rows < K: blocks, row K: the prefix, rows > K masked and never addressed): pass 1
  reduces sum(v^2), <v, w> and <v, gy> per candidate; then the softmax and its backward on K_PAD scalars; pass 2
  re-reads the same tiles (just read, so mostly from L2: the pass-1 loads are ``evict_last``) and writes dv for
  every candidate; zeros for slots K..C-1 of grad_block_residual follow in a loop of their own. One candidate
  tile per hidden chunk, so any K works (K_PAD = next_power_of_2(K + 1) is the compile-time tile height; K itself
  is a runtime argument).
- ``attn_res_bwd_rows_kernel`` (CUDA, H <= 8192; the default below 8192 token-candidate rows): the same
  gradients with the forward rows kernel's layout: one [BLOCK_H = next_power_of_2(H)] row at a time over all
  warps, a program's tokens as one software-pipelined stream of 2 K + 3 row loads each, dw accumulated in
  registers. It lifts the tiles kernel's L1/shared-memory bound (docs/history.md,
  "Backward (`attn_res_backward`)").
- ``attn_res_bwd_stats_kernel``, ``attn_res_bwd_scalars_kernel``, ``attn_res_bwd_apply_kernel`` (CUDA, H <= 8192;
  the default from 8192 token-candidate rows; ``BackwardConfig(kernel="stats_apply")``): the same gradients
  split in two streams on (token range, column chunk) grids: chunk partials of the statistics, then per-token
  scalars (fixed-order chunk sum + softmax backward), then the element-wise dv / dw pass. Reads the inputs
  twice, but no step waits on the cross-warp reduction chain of a single program per SM
  (docs/attn_res_backward.md, "Kernels"; docs/history.md, "Backward (`attn_res_backward`)").
- ``attn_res_bwd_dw_reduce_kernel``: the weights' gradients. Each program of the first kernel accumulates its
  tokens' contributions into its own row of a workspace [num_programs, H] (FP64; FP32 without ACC64) with no
  atomics (a row has one writer), and this kernel sums the rows in a fixed order (fixed-shape tile sums, then
  chunks in sequence; an FP32 workspace row by row in double-float) and writes dw times the other weight into
  each weight's gradient, rounded once to the weight's dtype.
  Identical inputs on the same device and grid give identical bits; the workspace is O(programs x H).

Recompile safety and addressing are the forward's (``attn_res_fwd``): T, K, C, the token range and every
stride are in ``do_not_specialize``; token/block strides arrive divided by the constexpr VEC; row offsets are
int64; ``H_STRIDED`` selects the strided-hidden variant for prefix_sum / block_residual (grad_out and the
outputs always have unit hidden stride: the launch policy guarantees it).
"""
from __future__ import annotations

import triton
import triton.language as tl

# Double-float ("FP32 pair") primitives shared with the forward's Ascend kernel (exact TwoSum / TwoProduct).
from .attn_res_fwd import _df_div_int, _df_mul, _df_score, _two_prod, _two_sum_combine

_BWD_RUNTIME_INTS = ["T", "K", "C", "tokens_per_prog", "stride_gyt", "stride_pt", "stride_ph", "stride_bt",
                     "stride_bc", "stride_bh", "stride_gpt", "stride_gbt", "stride_gbc"]


@triton.jit
def _df_row_sums3(a_hi, a_lo, b_hi, b_lo, c_hi, c_lo, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row sums of three double-float [K_PAD, BLOCK_H] tiles: a pairwise tree of TwoSums, one vectorised level at a
    time (adjacent columns paired through reshape + split), then normalised. Returns six [K_PAD] vectors.
    (tl.reduce with a TwoSum combine is the same sum, but the Triton interpreter runs a custom combine one
    element at a time; this form is also fixed-order by construction.)"""
    for i in tl.static_range(16):
        if (BLOCK_H >> i) > 1:
            x_hi, y_hi = tl.split(tl.reshape(a_hi, [K_PAD, BLOCK_H >> (i + 1), 2]))
            x_lo, y_lo = tl.split(tl.reshape(a_lo, [K_PAD, BLOCK_H >> (i + 1), 2]))
            a_hi = x_hi + y_hi
            t_ = a_hi - x_hi
            a_lo = x_lo + y_lo + ((x_hi - (a_hi - t_)) + (y_hi - t_))
            x_hi, y_hi = tl.split(tl.reshape(b_hi, [K_PAD, BLOCK_H >> (i + 1), 2]))
            x_lo, y_lo = tl.split(tl.reshape(b_lo, [K_PAD, BLOCK_H >> (i + 1), 2]))
            b_hi = x_hi + y_hi
            t_ = b_hi - x_hi
            b_lo = x_lo + y_lo + ((x_hi - (b_hi - t_)) + (y_hi - t_))
            x_hi, y_hi = tl.split(tl.reshape(c_hi, [K_PAD, BLOCK_H >> (i + 1), 2]))
            x_lo, y_lo = tl.split(tl.reshape(c_lo, [K_PAD, BLOCK_H >> (i + 1), 2]))
            c_hi = x_hi + y_hi
            t_ = c_hi - x_hi
            c_lo = x_lo + y_lo + ((x_hi - (c_hi - t_)) + (y_hi - t_))
    a_hi = tl.reshape(a_hi, [K_PAD])
    a_lo = tl.reshape(a_lo, [K_PAD])
    b_hi = tl.reshape(b_hi, [K_PAD])
    b_lo = tl.reshape(b_lo, [K_PAD])
    c_hi = tl.reshape(c_hi, [K_PAD])
    c_lo = tl.reshape(c_lo, [K_PAD])
    # Normalise: hi = round(hi + lo), lo = the rest (|hi| >= |lo| holds after the tree).
    t_ = a_hi + a_lo
    a_lo = a_lo - (t_ - a_hi)
    a_hi = t_
    t_ = b_hi + b_lo
    b_lo = b_lo - (t_ - b_hi)
    b_hi = t_
    t_ = c_hi + c_lo
    c_lo = c_lo - (t_ - c_hi)
    c_hi = t_
    return a_hi, a_lo, b_hi, b_lo, c_hi, c_lo


@triton.jit
def _split12(a):
    # a = hi + lo with hi keeping 12 significant bits: products of two such halves are exact in FP32.
    hi = (a.to(tl.int32, bitcast=True) & -4096).to(tl.float32, bitcast=True)
    return hi, a - hi


@triton.jit
def _df_exp(z_hi, z_lo):
    """exp(z_hi + z_lo) for z <= 0 as a double-float, in FP32 arithmetic only (no FP64 on the device): z = k ln2 + r
    with |r| <= ln2 / 2; exp(r) = 1 + r (1 + r/2 (1 + r/3 (...))) from the inside out, the outer four levels in
    double-float, the inner ones in FP32 (their share is below r^4 / 24 < 7e-4, so FP32 is ample); then the
    exact power of two 2^k from the exponent bits. Relative error ~1e-12 where plain FP32 exp gives ~1e-7.
    Written without nested helper calls (the Triton interpreter pays milliseconds per call)."""
    k = tl.maximum(tl.floor(z_hi * 1.4426950408889634 + 0.5), -126.0)  # below 2^-126 the weight is 0 anyway
    r_hi = z_hi - k * 0.693145751953125  # ln2 high part: 16 significant bits, so k * it is exact (|k| <= 126)
    r_lo = z_lo - k * 1.4286068202862268e-06  # ln2 - 0.693145751953125
    t = r_hi + r_lo
    r_lo = r_lo - (t - r_hi)
    r_hi = t
    q = 1.0 + r_hi / 12.0
    for i in tl.static_range(7):
        q = 1.0 + r_hi * q / (11 - i)  # n = 11 .. 5
    p_hi = q
    p_lo = tl.zeros_like(q)
    rh_h, rh_l = _split12(r_hi)
    for i in tl.static_range(4):
        # (p_hi, p_lo) = 1 + r * (p_hi, p_lo) / n for n = 4, 3, 2, 1, in double-float.
        m = r_hi * p_hi
        ph_h, ph_l = _split12(p_hi)
        m_lo = (((rh_h * ph_h - m) + rh_h * ph_l + rh_l * ph_h) + rh_l * ph_l) + r_hi * p_lo + r_lo * p_hi
        dq = m / (4 - i)
        dq_h, dq_l = _split12(dq)
        pn = dq * (4 - i)
        pn_err = dq_h * (4 - i) - pn + dq_l * (4 - i)  # n has 3 bits: both partial products are exact
        dq_lo = ((m - pn) - pn_err + m_lo) / (4 - i)
        p_hi = 1.0 + dq
        p_lo = (dq - (p_hi - 1.0)) + dq_lo
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return p_hi * scale, p_lo * scale


@triton.jit
def _df_softmax_backward(ss_hi, ss_lo, d_hi, d_lo, g_hi, g_lo, valid, H, eps):
    """The per-token scalar chain from double-float (hi, lo) statistics, carried in double-float FP32 arithmetic
    (for devices without FP64): r = rsqrt(ss / H + eps), s = r d, p = softmax(s), gs = p (g - sum p g),
    c = d r^3 / H, a = gs r. Returns p, gs, r, c, a rounded to FP32 (zero on padding rows)."""
    r_hi, r_lo, s_hi, s_lo = _df_score(ss_hi, ss_lo, d_hi, d_lo, H, eps)
    mx = tl.max(tl.where(valid, s_hi, -float("inf")), axis=0)
    z_hi, z_lo = _two_sum_combine(tl.where(valid, s_hi, mx), tl.where(valid, s_lo, 0.0), -mx, 0.0)
    e_hi, e_lo = _df_exp(z_hi, z_lo)
    e_hi = tl.where(valid, e_hi, 0.0)
    e_lo = tl.where(valid, e_lo, 0.0)
    # p = e / sum(e): double-float sum, then the quotient with its exact remainder, rounded to FP32.
    es_hi, es_lo = tl.reduce((e_hi, e_lo), 0, _two_sum_combine)
    q = e_hi / es_hi
    qp, qe = _two_prod(q, es_hi)
    p = q + (((e_hi - qp) - qe) + e_lo - q * es_lo) / es_hi
    zero = tl.zeros_like(p)
    # g_i - sum_j p_j g_j: the cancellation happens in double-float, so its FP32 result is correctly rounded.
    pg_hi, pg_lo = _df_mul(p, zero, g_hi, g_lo)
    gbar_hi, gbar_lo = tl.reduce((pg_hi, pg_lo), 0, _two_sum_combine)
    dg_hi, dg_lo = _two_sum_combine(g_hi, g_lo, -gbar_hi, -gbar_lo)
    gs_hi, gs_lo = _df_mul(p, zero, dg_hi, dg_lo)
    a_hi, a_lo = _df_mul(gs_hi, gs_lo, r_hi, r_lo)
    r2_hi, r2_lo = _df_mul(r_hi, r_lo, r_hi, r_lo)
    r3_hi, r3_lo = _df_mul(r2_hi, r2_lo, r_hi, r_lo)
    c_hi, c_lo = _df_mul(d_hi, d_lo, r3_hi, r3_lo)
    c_hi, c_lo = _df_div_int(c_hi, c_lo, H)
    return (p, tl.where(valid, gs_hi + gs_lo, 0.0), tl.where(valid, r_hi + r_lo, 0.0),
            tl.where(valid, c_hi + c_lo, 0.0), tl.where(valid, a_hi + a_lo, 0.0))


@triton.jit
def _softmax_backward(ss, d, g, valid, H, eps, ACC64: tl.constexpr):
    """The per-token scalar chain on [K_PAD] statistics (FP64 under ACC64: IEEE sqrt and division; FP32: correctly
    rounded sqrt / division): r = rsqrt(ss / H + eps), p = softmax(r d),
    gs = p (g - sum p g), c = d r^3 / H (coefficient of v_i in d s_i / d v_i), a = gs r (coefficient of v_i in
    dw). Returns p, gs, r, c, a in FP32, zero on padding rows."""
    if ACC64:
        r = 1.0 / tl.sqrt(ss / H + eps)
    else:
        r = tl.div_rn(1.0, tl.sqrt_rn(ss / H + eps))
    s = tl.where(valid, r * d, -float("inf"))
    p = tl.exp(s - tl.max(s, axis=0))
    p = p / tl.sum(p, axis=0)
    gs = tl.where(valid, p * (g - tl.sum(p * g, axis=0)), 0.0)
    c = tl.where(valid, d * (r * r * r) / H, 0.0).to(tl.float32)
    a = (gs * r).to(tl.float32)
    return p.to(tl.float32), gs.to(tl.float32), r.to(tl.float32), c, a


@triton.jit
def _load_candidates(blk_tile, pre_row, cols, hmask, is_blk, is_prefix, stride_ph, stride_bh,
                     H_STRIDED: tl.constexpr, EVICTION: tl.constexpr):
    """One [K_PAD, BLOCK_H] FP32 chunk of token t's candidates (rows < K from the buffer, row K the prefix, rows
    past K zero and never addressed): two plain masked loads and a value select, not a pointer select, which
    the Ascend compiler handles better."""
    if H_STRIDED:
        pcols = cols.to(tl.int64) * stride_ph
        bcols = cols.to(tl.int64) * stride_bh
    else:
        pcols = cols
        bcols = cols
    blk = tl.load(blk_tile + bcols[None, :], mask=is_blk & hmask[None, :], other=0.0, eviction_policy=EVICTION)
    pre = tl.load(pre_row + pcols, mask=hmask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    return tl.where(is_prefix, pre[None, :], blk.to(tl.float32))


@triton.jit(do_not_specialize=_BWD_RUNTIME_INTS)
def attn_res_bwd_kernel(gy_ptr, prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, gp_ptr, gb_ptr, ws_ptr,
                        T, K, C, H, eps, tokens_per_prog,
                        stride_gyt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                        stride_gpt, stride_gbt, stride_gbc,
                        BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                        WRITE_PREFIX: tl.constexpr, WRITE_BLOCKS: tl.constexpr, COMPUTE_DW: tl.constexpr,
                        ACC64: tl.constexpr, DF: tl.constexpr, NUM_STAGES: tl.constexpr = 1,
                        PREFIX_ROW_SUM: tl.constexpr = False):
    # Requires K >= 1 (K = 0 is an exact copy handled by the launch policy without a launch).
    # Outputs are contiguous: grad_prefix [T, H] (stride_gpt), grad_blocks [T, C, H] (stride_gbt, stride_gbc),
    # workspace [num_programs, H] (fp64 if ACC64 else fp32; row pid belongs to this program alone).
    #
    # Precision (ACC64, the GPU default): the per-token statistics (products and sums), the softmax and its
    # backward run in FP64 and the weight gradient accumulates over tokens in FP64; the [K_PAD, BLOCK_H]
    # element-wise math (dv, the dw products) stays FP32. Every output element then carries only its own FP32
    # rounding, while the FP32 eager formula also carries the rounding of every scalar it was built from; with
    # FP32 scalars the two errors are the same size and the 1.25x contract would hold only by luck. Costs one
    # FP32 -> FP64 conversion and three FP64 FMAs per candidate element, in pass 1 only.
    # DF (devices without FP64, e.g. Ascend vector cores): the same in double-float FP32 arithmetic: statistics
    # accumulated per tile element with TwoSum across chunks, one TwoSum tree per token, then
    # _df_softmax_backward. Neither flag: plain FP32 (the eager formula's error size).
    # Addressing and the chunk loops' arithmetic are written out inline (nested @triton.jit helpers run at most
    # once per token): the Triton interpreter pays milliseconds per nested call, which would dominate CI time.
    #
    # Speed: both chunk loops are latency-bound unless loads run ahead of the math, so (1) pass 1 accumulates
    # its statistics element-wise in [K_PAD, BLOCK_H] tiles and reduces across threads once per token, not once
    # per chunk, and (2) both loops are software-pipelined (NUM_STAGES > 1: Triton stages the next chunks' loads
    # through shared memory while this chunk is reduced; 1 = no pipelining, e.g. under triton-ascend).
    #
    # PREFIX_ROW_SUM (the NPU policy): grad_prefix's row is taken out of the dv tile by a masked sum over the
    # tile's rows and stored through a plain row pointer. Without it the row is stored through a [K_PAD, 1]
    # pointer tile whose row stride is zero (every row points at grad_prefix row t, only row K unmasked), which
    # triton-ascend's --triton-to-linalg rejects ("strides must not be zero"). The sum runs on the FP32 bit
    # patterns as int32 (row K's word plus zeros), so it is exact for every value, signed zeros and NaN
    # included; a float sum with -0.0 elsewhere is not, because both the interpreter and the adapter's
    # linalg.reduce start the reduction from +0.0 (which turns a -0.0 into +0.0).
    pid = tl.program_id(0)
    t_begin = pid * tokens_per_prog
    t_end = tl.minimum(t_begin + tokens_per_prog, T)
    rows = tl.arange(0, K_PAD)
    r2 = rows[:, None]
    blk_rows = r2.to(tl.int64) * stride_bc * VEC  # [K_PAD, 1] offsets of candidate rows within a token
    gb_rows = r2.to(tl.int64) * stride_gbc * VEC
    is_blk = r2 < K  # rows read from block_residual; row K is the prefix; rows > K are never addressed
    valid = rows <= K
    ws_row = ws_ptr + pid.to(tl.int64) * H
    if COMPUTE_DW:
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            tl.store(ws_row + cols, tl.zeros([BLOCK_H], dtype=ws_ptr.dtype.element_ty), mask=cols < H)
        tl.debug_barrier()  # the zeros are visible to every thread before the first token reads them back
    for t in range(t_begin, t_end):
        t64 = tl.cast(t, tl.int64)  # tl.cast, not .to: the interpreter's loop variable is a Python int
        gy_row = gy_ptr + t64 * stride_gyt * VEC
        pre_row = prefix_ptr + t64 * stride_pt * VEC
        blk_tile = blocks_ptr + t64 * stride_bt * VEC + blk_rows
        # Pass 1: per-candidate sum(v^2), <v, w> and <v, gy>, chunk by chunk. evict_last: pass 2 re-reads these.
        if ACC64:
            ss = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float64)
            d = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float64)
            g = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float64)
        elif DF:
            ss_hi = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            ss_lo = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            d_hi = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            d_lo = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            g_hi = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            g_lo = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
        else:
            ss = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            d = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            g = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
        for h0 in tl.range(0, H, BLOCK_H, num_stages=NUM_STAGES):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < H
            # Pass 1 keeps the chunk in L2 (evict_last): pass 2 reads it again.
            x = _load_candidates(blk_tile, pre_row, cols, hmask, is_blk, r2 == K, stride_ph, stride_bh, H_STRIDED,
                                 "evict_last")
            gy = tl.load(gy_row + cols, mask=hmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            w = (tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
                 * tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32))  # folded in FP32, as the forward
            if ACC64:
                # Exact FP64 products (of bf16/fp16/fp32 values), FP64 sums: the statistics carry no FP32 error.
                xd = x.to(tl.float64)
                ss += xd * xd
                d += xd * w.to(tl.float64)[None, :]
                g += xd * gy.to(tl.float64)[None, :]
            elif DF:
                # Element-wise TwoSum into (hi, lo) accumulators, written out (no helper call per chunk).
                v = x * x
                t_ = ss_hi + v
                b_ = t_ - ss_hi
                ss_lo += (ss_hi - (t_ - b_)) + (v - b_)
                ss_hi = t_
                v = x * w[None, :]
                t_ = d_hi + v
                b_ = t_ - d_hi
                d_lo += (d_hi - (t_ - b_)) + (v - b_)
                d_hi = t_
                v = x * gy[None, :]
                t_ = g_hi + v
                b_ = t_ - g_hi
                g_lo += (g_hi - (t_ - b_)) + (v - b_)
                g_hi = t_
            else:
                ss += x * x
                d += x * w[None, :]
                g += x * gy[None, :]
        if not DF:
            # One cross-thread reduction per token (the DF path does its own fixed-order TwoSum tree below).
            ss = tl.sum(ss, axis=1)
            d = tl.sum(d, axis=1)
            g = tl.sum(g, axis=1)
        # Softmax and its backward on K_PAD scalars (FP64 under ACC64: IEEE sqrt and division; FP32: correctly
        # rounded sqrt / division, as in the forward's score).
        if DF:
            ss_hi, ss_lo, d_hi, d_lo, g_hi, g_lo = _df_row_sums3(ss_hi, ss_lo, d_hi, d_lo, g_hi, g_lo, K_PAD, BLOCK_H)
            p, gs, r, c, a = _df_softmax_backward(ss_hi, ss_lo, d_hi, d_lo, g_hi, g_lo, valid, H, eps)
        else:
            p, gs, r, c, a = _softmax_backward(ss, d, g, valid, H, eps, ACC64)
        # The element-wise math below is FP32 in the eager formula's order: dv_i = p_i gy + gs_i (r_i w - c_i v_i).
        gb_tile = gb_ptr + t64 * stride_gbt * VEC + gb_rows
        gp_row = gp_ptr + t64 * stride_gpt * VEC
        # Every row of this [K_PAD, 1] pointer tile is grad_prefix's row t; only row K's lanes are unmasked.
        gp_tile = gp_row + r2 * 0
        # Pass 2: re-read each chunk; write dv (and zeros past K) and fold this token into the dw row.
        for h0 in tl.range(0, H, BLOCK_H, num_stages=NUM_STAGES):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < H
            if COMPUTE_DW:
                # Issued first: this row chunk was last written by the previous token (a barrier ago).
                acc = tl.load(ws_row + cols, mask=hmask, other=0.0)
            x = _load_candidates(blk_tile, pre_row, cols, hmask, is_blk, r2 == K, stride_ph, stride_bh, H_STRIDED,
                                 "evict_first")
            if WRITE_PREFIX or WRITE_BLOCKS:
                gy = tl.load(gy_row + cols, mask=hmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                w = (tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
                     * tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32))
                dv = p[:, None] * gy[None, :] + gs[:, None] * (r[:, None] * w[None, :] - c[:, None] * x)
                if WRITE_PREFIX:
                    if PREFIX_ROW_SUM:
                        word = tl.sum(tl.where(r2 == K, dv.to(tl.int32, bitcast=True), 0), axis=0)
                        tl.store(gp_row + cols, word.to(tl.float32, bitcast=True).to(gp_ptr.dtype.element_ty),
                                 mask=hmask)
                    else:
                        tl.store(gp_tile + cols[None, :], dv.to(gp_ptr.dtype.element_ty),
                                 mask=(r2 == K) & hmask[None, :])
                if WRITE_BLOCKS:
                    tl.store(gb_tile + cols[None, :], dv.to(gb_ptr.dtype.element_ty), mask=is_blk & hmask[None, :])
            if COMPUTE_DW:
                tl.store(ws_row + cols, acc + tl.sum(a[:, None] * x, axis=0).to(ws_ptr.dtype.element_ty), mask=hmask)
        if WRITE_BLOCKS:
            # Slots K..C-1 get exact zeros (they were never read). A loop of its own: a loop nested in the chunk
            # loop above would keep Triton from software-pipelining that loop (only innermost loops are).
            zeros = tl.zeros([K_PAD, BLOCK_H], dtype=gb_ptr.dtype.element_ty)
            for z0 in range(K, C, K_PAD):
                zr = z0 + r2
                for h0 in range(0, H, BLOCK_H):
                    cols = h0 + tl.arange(0, BLOCK_H)
                    tl.store(gb_tile + tl.cast(z0, tl.int64) * stride_gbc * VEC + cols[None, :], zeros,
                             mask=(zr < C) & (cols < H)[None, :])
        if COMPUTE_DW:
            # The dw row is read back by the next token: make this token's stores visible to every thread of
            # the program whatever layouts the compiler picked for the load and the store (one barrier per token;
            # a CTA barrier on GPUs, a pipeline barrier under triton-ascend, a no-op in the interpreter).
            tl.debug_barrier()


@triton.jit
def _step_row_ptrs(t64, st, i, K, gy_ptr, prefix_ptr, blocks_ptr, cols, stride_gyt, stride_pt, stride_ph, stride_bt,
                   stride_bc, stride_bh, VEC: tl.constexpr, H_STRIDED: tl.constexpr):
    """Pointers to the columns ``cols`` of one streamed row of token t: grad_out[t] at step st == 0, else
    candidate i (v_i = block_residual[t, i] for i < K, prefix_sum[t] for i == K). The row's base pointer is a
    scalar select (as the forward's rows kernel), not a per-element one."""
    blk = blocks_ptr + t64 * (stride_bt * VEC) + tl.cast(tl.minimum(tl.maximum(i, 0), K - 1), tl.int64) * (
        stride_bc * VEC)
    cand = tl.where(i < K, blk, prefix_ptr + t64 * (stride_pt * VEC))
    base = tl.where(st == 0, gy_ptr + t64 * (stride_gyt * VEC), cand)
    if H_STRIDED:
        return base + tl.cast(cols, tl.int64) * tl.where(st == 0, 1, tl.where(i < K, stride_bh, stride_ph))
    return base + cols


@triton.jit
def _store_dv(dv, t64, i, K, cols, hmask, gp_ptr, gb_ptr, stride_gpt, stride_gbt, stride_gbc, VEC: tl.constexpr,
              WRITE_PREFIX: tl.constexpr, WRITE_BLOCKS: tl.constexpr):
    """Candidate i's gradient row of token t: grad_prefix_sum[t] for i == K, grad_block_residual[t, i] for i < K
    (both outputs contiguous); an output not asked for is not written."""
    # Masks as tl.where (a bool tensor on every Triton version; `hmask & (i == K)` reaches triton 3.9's interpreter
    # as int32, which it rejects as a mask).
    if WRITE_PREFIX:
        tl.store(gp_ptr + t64 * (stride_gpt * VEC) + cols, dv.to(gp_ptr.dtype.element_ty),
                 mask=tl.where(hmask, i == K, False))
    if WRITE_BLOCKS:
        tl.store(gb_ptr + t64 * (stride_gbt * VEC) + tl.cast(tl.minimum(i, K - 1), tl.int64) * (stride_gbc * VEC)
                 + cols, dv.to(gb_ptr.dtype.element_ty), mask=tl.where(hmask, i < K, False))


@triton.jit
def _store_zero_slots(gb_ptr, t_begin, n_tok, K, C, cols, hmask, stride_gbt, stride_gbc, VEC: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Exact zeros into grad_block_residual slots K..C-1 of tokens t_begin .. t_begin + n_tok - 1, columns
    ``cols`` (those slots were never read). A loop of its own, after the streaming loop: a loop nested in that
    one would keep Triton from software-pipelining it (only innermost loops are)."""
    zeros = tl.zeros([BLOCK], dtype=gb_ptr.dtype.element_ty)
    for tt in range(0, n_tok):
        t64 = tl.cast(t_begin + tt, tl.int64)
        for z in range(K, C):
            tl.store(gb_ptr + t64 * (stride_gbt * VEC) + tl.cast(z, tl.int64) * (stride_gbc * VEC) + cols, zeros,
                     mask=hmask)


@triton.jit(do_not_specialize=_BWD_RUNTIME_INTS)
def attn_res_bwd_rows_kernel(gy_ptr, prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, gp_ptr, gb_ptr, ws_ptr,
                             T, K, C, H, eps, tokens_per_prog,
                             stride_gyt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                             stride_gpt, stride_gbt, stride_gbc,
                             BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                             WRITE_PREFIX: tl.constexpr, WRITE_BLOCKS: tl.constexpr, COMPUTE_DW: tl.constexpr,
                             ACC64: tl.constexpr, NUM_STAGES: tl.constexpr):
    # The streaming variant (CUDA, H <= BLOCK_H, the launch policy's ``kernel="rows"``): the forward rows kernel's
    # layout for the backward. Each row is one [BLOCK_H] tile spread over all warps (no warp holds a row that
    # another warp needs, so nothing is replicated and no reduction crosses candidate rows), and a program walks
    # its tokens as ONE pipelined sequence of row loads, 2 K + 3 per token:
    #     grad_out[t]  |  v_0 .. v_K (statistics)  |  v_0 .. v_K again (dv and dw; L2 hits: just read)
    # The statistics of a row are reduced as soon as it arrives and parked in [K_PAD] vectors; after v_K the
    # softmax backward runs on them (_softmax_backward, as in attn_res_bwd_kernel). dw accumulates in registers
    # across all of the program's tokens (FP64 under ACC64) and is stored once, into the program's workspace row.
    # Same outputs, same workspace contract and the same dw reduction as attn_res_bwd_kernel.
    pid = tl.program_id(0)
    t_begin = pid * tokens_per_prog
    n_tok = tl.maximum(tl.minimum(t_begin + tokens_per_prog, T) - t_begin, 0)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    rows = tl.arange(0, K_PAD)
    valid = rows <= K
    w = (tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
         * tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32))  # folded in FP32, as the forward
    per_tok = 2 * K + 3
    gy = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ACC64:
        dw = tl.zeros([BLOCK_H], dtype=tl.float64)
        ss = tl.zeros([K_PAD], dtype=tl.float64)
        d = tl.zeros([K_PAD], dtype=tl.float64)
        g = tl.zeros([K_PAD], dtype=tl.float64)
    else:
        dw = tl.zeros([BLOCK_H], dtype=tl.float32)
        ss = tl.zeros([K_PAD], dtype=tl.float32)
        d = tl.zeros([K_PAD], dtype=tl.float32)
        g = tl.zeros([K_PAD], dtype=tl.float32)
    p = tl.zeros([K_PAD], dtype=tl.float32)
    gs = tl.zeros([K_PAD], dtype=tl.float32)
    r = tl.zeros([K_PAD], dtype=tl.float32)
    c = tl.zeros([K_PAD], dtype=tl.float32)
    a = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.range(0, n_tok * per_tok, num_stages=NUM_STAGES):
        t64 = tl.cast(t_begin + j // per_tok, tl.int64)
        st = j % per_tok
        i = tl.where(st <= K + 1, st - 1, st - K - 2)  # candidate of this step (-1: the grad_out step)
        x = tl.load(_step_row_ptrs(t64, st, i, K, gy_ptr, prefix_ptr, blocks_ptr, cols, stride_gyt, stride_pt,
                                   stride_ph, stride_bt, stride_bc, stride_bh, VEC, H_STRIDED),
                    mask=hmask, other=0.0).to(tl.float32)
        if st == 0:
            gy = x
        elif st <= K + 1:
            # Pass 1: this candidate's statistics, reduced now, parked at position i.
            if ACC64:
                xd = x.to(tl.float64)
                ss_i = tl.sum(xd * xd, axis=0)
                d_i = tl.sum(xd * w.to(tl.float64), axis=0)
                g_i = tl.sum(xd * gy.to(tl.float64), axis=0)
            else:
                ss_i = tl.sum(x * x, axis=0)
                d_i = tl.sum(x * w, axis=0)
                g_i = tl.sum(x * gy, axis=0)
            ss = tl.where(rows == i, ss_i, ss)
            d = tl.where(rows == i, d_i, d)
            g = tl.where(rows == i, g_i, g)
            if st == K + 1:
                p, gs, r, c, a = _softmax_backward(ss, d, g, valid, H, eps, ACC64)
        else:
            # Pass 2: dv_i = p_i gy + gs_i (r_i w - c_i v_i), in the eager formula's FP32 order; dw += a_i v_i.
            sel = rows == i
            p_i = tl.sum(tl.where(sel, p, 0.0), axis=0)
            gs_i = tl.sum(tl.where(sel, gs, 0.0), axis=0)
            r_i = tl.sum(tl.where(sel, r, 0.0), axis=0)
            c_i = tl.sum(tl.where(sel, c, 0.0), axis=0)
            a_i = tl.sum(tl.where(sel, a, 0.0), axis=0)
            dv = p_i * gy + gs_i * (r_i * w - c_i * x)
            _store_dv(dv, t64, i, K, cols, hmask, gp_ptr, gb_ptr, stride_gpt, stride_gbt, stride_gbc, VEC,
                      WRITE_PREFIX, WRITE_BLOCKS)
            if COMPUTE_DW:
                dw += (a_i * x).to(dw.dtype)
    if WRITE_BLOCKS:
        _store_zero_slots(gb_ptr, t_begin, n_tok, K, C, cols, hmask, stride_gbt, stride_gbc, VEC, BLOCK_H)
    if COMPUTE_DW:
        tl.store(ws_ptr + tl.cast(pid, tl.int64) * H + cols, dw.to(ws_ptr.dtype.element_ty), mask=hmask)


@triton.jit(do_not_specialize=["P"])
def attn_res_bwd_dw_reduce_kernel(ws_ptr, nw_ptr, pw_ptr, gnorm_ptr, gproj_ptr, P, H, WRITE_NORM: tl.constexpr,
                                  WRITE_PROJ: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    # dw[h] = sum over workspace rows 0..P-1, always in the same order, with no atomics: identical bits from run to
    # run. Then the chain rule through w = norm_weight * proj_weight, rounded once to each weight's dtype:
    # grad_norm_weight = dw * proj_weight, grad_proj_weight = dw * norm_weight.
    # FP64 workspace (the GPU): fixed-shape [BLOCK_P, BLOCK_H] tile sums added in sequence, the products in FP64.
    # FP32 workspace (no FP64: the NPU): the rows one by one into a double-float (TwoSum) sum, and each product of
    # that pair formed with an FMA, so that neither the sum over programs nor the FP32 rounding of dw adds to the
    # error of the per-program partials (the eager formula rounds both).
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    nw = tl.load(nw_ptr + cols, mask=hmask, other=0.0)
    pw = tl.load(pw_ptr + cols, mask=hmask, other=0.0)
    if ws_ptr.dtype.element_ty == tl.float64:
        acc = tl.zeros([BLOCK_H], dtype=tl.float64)
        for p0 in range(0, P, BLOCK_P):
            prow = p0 + tl.arange(0, BLOCK_P)
            tile = tl.load(ws_ptr + prow[:, None].to(tl.int64) * H + cols[None, :],
                           mask=(prow < P)[:, None] & hmask[None, :], other=0.0)
            acc += tl.sum(tile, axis=0)
        g_norm = (acc * pw.to(tl.float64)).to(tl.float32)
        g_proj = (acc * nw.to(tl.float64)).to(tl.float32)
    else:
        hi = tl.zeros([BLOCK_H], dtype=tl.float32)
        lo = tl.zeros([BLOCK_H], dtype=tl.float32)
        for p in range(0, P):
            x = tl.load(ws_ptr + tl.cast(p, tl.int64) * H + cols, mask=hmask, other=0.0)
            hi, lo = _two_sum_combine(hi, lo, x, 0.0)
        pw32, nw32 = pw.to(tl.float32), nw.to(tl.float32)
        g_norm = tl.fma(hi, pw32, lo * pw32)
        g_proj = tl.fma(hi, nw32, lo * nw32)
    if WRITE_NORM:
        tl.store(gnorm_ptr + cols, g_norm.to(gnorm_ptr.dtype.element_ty), mask=hmask)
    if WRITE_PROJ:
        tl.store(gproj_ptr + cols, g_proj.to(gproj_ptr.dtype.element_ty), mask=hmask)


# Per-token scalars handed from the statistics kernel to the apply kernel: [T, N_SCALARS, K_PAD] FP32, in this
# order (zero on padding rows): p, gs, r, c, a (see _softmax_backward). A constexpr global: jitted code may read it.
N_SCALARS = tl.constexpr(5)
_STATS_RUNTIME_INTS = ["T", "K", "tokens_per_prog", "stride_gyt", "stride_pt", "stride_ph", "stride_bt", "stride_bc",
                       "stride_bh"]  # (n_chunks is tl.num_programs(1))
_APPLY_RUNTIME_INTS = _BWD_RUNTIME_INTS


@triton.jit(do_not_specialize=_STATS_RUNTIME_INTS)
def attn_res_bwd_stats_kernel(gy_ptr, prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, part_ptr,
                              T, K, H, tokens_per_prog,
                              stride_gyt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                              BLOCK_C: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                              ACC64: tl.constexpr, NUM_STAGES: tl.constexpr):
    # First kernel of the "stats_apply" backward: the per-token reductions, split over column chunks. Grid (token
    # ranges, column chunks of BLOCK_C), like the apply kernel: many small programs per SM hide each other's
    # memory and reduction latency, which the rows kernel's single 8-warp program per SM cannot hide
    # (docs/history.md, "Backward (`attn_res_backward`)"). Per token, K + 2 row-chunk loads (grad_out,
    # v_0 .. v_K); for each candidate the chunk's partial sum(v^2), <v, w>, <v, gy> go to
    # part[t, chunk, 0..2, i] (FP64 under ACC64), summed over chunks in a fixed order by
    # attn_res_bwd_scalars_kernel.
    # FP64 statistics cost one FP32 -> FP64 conversion per element and row: w and grad_out are converted once
    # (per program / per token) and kept in FP64 registers, since conversions run at a quarter of the FP64 FMA
    # rate on sm_90 and converting all three operands per row would cost more than the products.
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    hmask = cols < H
    t_begin = pid * tokens_per_prog
    n_tok = tl.maximum(tl.minimum(t_begin + tokens_per_prog, T) - t_begin, 0)
    w = (tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
         * tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32))  # folded in FP32, as the forward
    acc_t = tl.float64 if ACC64 else tl.float32
    wd = w.to(acc_t)
    gyd = tl.zeros([BLOCK_C], dtype=acc_t)
    per_tok = K + 2
    for j in tl.range(0, n_tok * per_tok, num_stages=NUM_STAGES):
        t64 = tl.cast(t_begin + j // per_tok, tl.int64)
        st = j % per_tok
        i = st - 1  # candidate of this step (-1: the grad_out step)
        x = tl.load(_step_row_ptrs(t64, st, i, K, gy_ptr, prefix_ptr, blocks_ptr, cols, stride_gyt, stride_pt,
                                   stride_ph, stride_bt, stride_bc, stride_bh, VEC, H_STRIDED),
                    mask=hmask, other=0.0).to(tl.float32)
        if st == 0:
            gyd = x.to(acc_t)
        else:
            xd = x.to(acc_t)
            out = part_ptr + ((t64 * n_chunks + chunk) * 3) * K_PAD + i
            tl.store(out, tl.sum(xd * xd, axis=0))
            tl.store(out + K_PAD, tl.sum(xd * wd, axis=0))
            tl.store(out + 2 * K_PAD, tl.sum(xd * gyd, axis=0))


@triton.jit(do_not_specialize=["T", "K", "n_chunks", "tokens_per_prog"])
def attn_res_bwd_scalars_kernel(part_ptr, sc_ptr, T, K, H, eps, n_chunks, tokens_per_prog,
                                K_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr, ACC64: tl.constexpr):
    # Between the two "stats_apply" kernels: per token, the chunk partials summed in a fixed order (one
    # fixed-shape tile sum: identical bits run to run), then the softmax backward (_softmax_backward, as every
    # backward kernel) into sc[t] = (p, gs, r, c, a) [N_SCALARS, K_PAD] FP32. O(T x K) work and bytes.
    pid = tl.program_id(0)
    t_begin = pid * tokens_per_prog
    t_end = tl.minimum(t_begin + tokens_per_prog, T)
    rows = tl.arange(0, K_PAD)
    ch = tl.arange(0, CHUNKS_PAD)
    valid = rows <= K
    tile = ch[:, None] * (3 * K_PAD) + rows[None, :]
    tmask = (ch < n_chunks)[:, None] & valid[None, :]
    for t in range(t_begin, t_end):
        base = part_ptr + tl.cast(t, tl.int64) * n_chunks * (3 * K_PAD)
        ss = tl.sum(tl.load(base + tile, mask=tmask, other=0.0), axis=0)
        d = tl.sum(tl.load(base + K_PAD + tile, mask=tmask, other=0.0), axis=0)
        g = tl.sum(tl.load(base + 2 * K_PAD + tile, mask=tmask, other=0.0), axis=0)
        p, gs, r, c, a = _softmax_backward(ss, d, g, valid, H, eps, ACC64)
        out = sc_ptr + tl.cast(t, tl.int64) * (N_SCALARS * K_PAD) + rows
        tl.store(out, p)
        tl.store(out + K_PAD, gs)
        tl.store(out + 2 * K_PAD, r)
        tl.store(out + 3 * K_PAD, c)
        tl.store(out + 4 * K_PAD, a)


@triton.jit(do_not_specialize=_APPLY_RUNTIME_INTS)
def attn_res_bwd_apply_kernel(gy_ptr, prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, sc_ptr, gp_ptr, gb_ptr, ws_ptr,
                              T, K, C, H, tokens_per_prog,
                              stride_gyt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                              stride_gpt, stride_gbt, stride_gbc,
                              BLOCK_C: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                              WRITE_PREFIX: tl.constexpr, WRITE_BLOCKS: tl.constexpr, COMPUTE_DW: tl.constexpr,
                              ACC64: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Second kernel of the "stats_apply" backward: everything element-wise, with the per-token scalars from
    # attn_res_bwd_stats_kernel. Grid (token ranges, column chunks of BLOCK_C): no value crosses a thread, so
    # many small programs share an SM and hide memory latency with each other instead of through one long chain
    # of reductions. Per token, K + 2 row-chunk loads (grad_out, v_0 .. v_K) as one pipelined stream:
    #     dv_i = p_i gy + gs_i (r_i w - c_i v_i)     (FP32, the eager formula's order) -> grad rows
    #     dw  += a_i v_i                              (FP64 under ACC64, as the rows kernel; per column chunk)
    # then zeros for slots K..C-1, and the program's dw chunk into its workspace row (reduced in a fixed order by
    # attn_res_bwd_dw_reduce_kernel, like the other backward kernels).
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    hmask = cols < H
    t_begin = pid * tokens_per_prog
    n_tok = tl.maximum(tl.minimum(t_begin + tokens_per_prog, T) - t_begin, 0)
    w = (tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
         * tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32))
    gy = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw = tl.zeros([BLOCK_C], dtype=tl.float64 if ACC64 else tl.float32)
    per_tok = K + 2
    for j in tl.range(0, n_tok * per_tok, num_stages=NUM_STAGES):
        t64 = tl.cast(t_begin + j // per_tok, tl.int64)
        st = j % per_tok
        i = st - 1
        ic = tl.maximum(i, 0)
        # Last use of every input row: evict_first.
        x = tl.load(_step_row_ptrs(t64, st, i, K, gy_ptr, prefix_ptr, blocks_ptr, cols, stride_gyt, stride_pt,
                                   stride_ph, stride_bt, stride_bc, stride_bh, VEC, H_STRIDED),
                    mask=hmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # The step's scalars, loaded unconditionally (the grad_out step reads candidate 0's) so that the loop's
        # every load is outside the branches and the software pipeliner can issue them ahead.
        sc = sc_ptr + t64 * (N_SCALARS * K_PAD) + ic
        p_i = tl.load(sc)
        gs_i = tl.load(sc + K_PAD)
        r_i = tl.load(sc + 2 * K_PAD)
        c_i = tl.load(sc + 3 * K_PAD)
        a_i = tl.load(sc + 4 * K_PAD)
        if st == 0:
            gy = x
        else:
            dv = p_i * gy + gs_i * (r_i * w - c_i * x)
            _store_dv(dv, t64, i, K, cols, hmask, gp_ptr, gb_ptr, stride_gpt, stride_gbt, stride_gbc, VEC,
                      WRITE_PREFIX, WRITE_BLOCKS)
            if COMPUTE_DW:
                dw += (a_i * x).to(dw.dtype)
    if WRITE_BLOCKS:
        _store_zero_slots(gb_ptr, t_begin, n_tok, K, C, cols, hmask, stride_gbt, stride_gbc, VEC, BLOCK_C)
    if COMPUTE_DW:
        tl.store(ws_ptr + tl.cast(pid, tl.int64) * H + cols, dw.to(ws_ptr.dtype.element_ty), mask=hmask)
