"""Backward kernels of kimi_k3::attn_res (@triton.jit code only; launch policies live in k3_ops/backends/).

With gy = dL/d out, per token in FP32 (docs/attn_res.md "Backward"), recomputed from the inputs:

    r_i = rsqrt(mean(v_i^2) + eps),  d_i = <v_i, w>,  p = softmax(r * d),  g_i = <gy, v_i>
    gs_i = p_i (g_i - sum_j p_j g_j)
    dv_i = p_i gy + gs_i (r_i w - (d_i r_i^3 / H) v_i)         -> grad_block_residual[t, i] (i < K), grad_prefix (i = K)
    dw   = sum_t sum_i gs_i r_i v_i                              -> grad_weight (folded w = norm_weight * proj_weight)

Two kernels:

- ``attn_res_bwd_kernel``: a bounded grid of programs (a few per SM on CUDA, one per vector core on Ascend),
  program p walking the contiguous token range [p * tokens_per_prog, (p + 1) * tokens_per_prog). Per token,
  two passes over H in [K_PAD, BLOCK_H] tiles (rows < K: blocks, row K: the prefix, rows > K masked and never
  addressed): pass 1 reduces sum(v^2), <v, w> and <v, gy> per candidate; then the softmax and its backward
  on K_PAD scalars; pass 2 re-reads the same tiles (just read, so mostly from L2: the pass-1 loads are
  ``evict_last``) and writes dv for every candidate plus zeros for slots K..C-1 of grad_block_residual, all in
  the same pass. One candidate tile per hidden chunk, so any K works (K_PAD = next_power_of_2(K + 1) is the
  compile-time tile height; K itself is a runtime argument).
- ``attn_res_bwd_dw_reduce_kernel``: the weight gradient. Each program of the first kernel accumulates its
  tokens' contributions into its own row of a workspace [num_programs, H] (FP64; FP32 without ACC64) with no
  atomics (a row has one writer), and this kernel sums the rows in a fixed order (fixed-shape tile sums, then
  chunks in sequence).
  Identical inputs on the same device and grid give identical bits; the workspace is O(programs x H).

Recompile safety and addressing are the forward's (``attn_res_fwd``): T, K, C, the token range and every
stride are in ``do_not_specialize``; token/block strides arrive divided by the constexpr VEC; row offsets are
int64; ``H_STRIDED`` selects the strided-hidden variant for prefix_sum / block_residual (grad_out and the
outputs always have unit hidden stride: the launch policy guarantees it).
"""
from __future__ import annotations

import triton
import triton.language as tl

_BWD_RUNTIME_INTS = ["T", "K", "C", "tokens_per_prog", "stride_gyt", "stride_pt", "stride_ph", "stride_bt",
                     "stride_bc", "stride_bh", "stride_gpt", "stride_gbt", "stride_gbc"]


@triton.jit(do_not_specialize=_BWD_RUNTIME_INTS)
def attn_res_bwd_kernel(gy_ptr, prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, gp_ptr, gb_ptr, ws_ptr,
                        T, K, C, H, eps, tokens_per_prog,
                        stride_gyt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                        stride_gpt, stride_gbt, stride_gbc,
                        BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                        WRITE_PREFIX: tl.constexpr, WRITE_BLOCKS: tl.constexpr, COMPUTE_DW: tl.constexpr,
                        ACC64: tl.constexpr):
    # Requires K >= 1 (K = 0 is an exact copy handled by the launch policy without a launch).
    # Outputs are contiguous: grad_prefix [T, H] (stride_gpt), grad_blocks [T, C, H] (stride_gbt, stride_gbc),
    # workspace [num_programs, H] (fp64 if ACC64 else fp32; row pid belongs to this program alone).
    #
    # Precision (ACC64, the GPU default): the per-token statistics (products and sums), the softmax and its
    # backward run in FP64 and the weight gradient accumulates over tokens in FP64; the [K_PAD, BLOCK_H]
    # element-wise math (dv, the dw products) stays FP32. Every output element then carries only its own FP32
    # rounding, while the FP32 eager formula also carries the rounding of every scalar it was built from; with
    # FP32 scalars the two errors are the same size and the 1.25x contract would hold only by luck. Costs one
    # FP32 -> FP64 conversion and three FP64 FMAs per candidate element, in pass 1 only. ACC64 = False is
    # plain FP32 (devices without FP64, e.g. Ascend vector cores).
    # Addressing is written out inline (no nested @triton.jit helpers in the token loop): the Triton
    # interpreter pays milliseconds per nested call, which would dominate the CI run time.
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
    for t in range(t_begin, t_end):
        t64 = tl.cast(t, tl.int64)  # tl.cast, not .to: the interpreter's loop variable is a Python int
        gy_row = gy_ptr + t64 * stride_gyt * VEC
        pre_row = prefix_ptr + t64 * stride_pt * VEC
        blk_tile = blocks_ptr + t64 * stride_bt * VEC + blk_rows
        # Pass 1: per-candidate sum(v^2), <v, w> and <v, gy>, chunk by chunk. evict_last: pass 2 re-reads these.
        if ACC64:
            ss = tl.zeros([K_PAD], dtype=tl.float64)
            d = tl.zeros([K_PAD], dtype=tl.float64)
            g = tl.zeros([K_PAD], dtype=tl.float64)
        else:
            ss = tl.zeros([K_PAD], dtype=tl.float32)
            d = tl.zeros([K_PAD], dtype=tl.float32)
            g = tl.zeros([K_PAD], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < H
            if H_STRIDED:
                pcols = cols.to(tl.int64) * stride_ph
                bcols = cols.to(tl.int64) * stride_bh
            else:
                pcols = cols
                bcols = cols
            # Two plain masked loads and a value select (no pointer select: friendlier to the Ascend compiler).
            blk = tl.load(blk_tile + bcols[None, :], mask=is_blk & hmask[None, :], other=0.0,
                          eviction_policy="evict_last")
            pre = tl.load(pre_row + pcols, mask=hmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            x = tl.where(r2 == K, pre[None, :], blk.to(tl.float32))
            gy = tl.load(gy_row + cols, mask=hmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            w = (tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
                 * tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32))  # folded in FP32, as the forward
            if ACC64:
                xd = x.to(tl.float64)
                ss += tl.sum(xd * xd, axis=1)
                d += tl.sum(xd * w.to(tl.float64)[None, :], axis=1)
                g += tl.sum(xd * gy.to(tl.float64)[None, :], axis=1)
            else:
                ss += tl.sum(x * x, axis=1)
                d += tl.sum(x * w[None, :], axis=1)
                g += tl.sum(x * gy[None, :], axis=1)
        # Softmax and its backward on K_PAD scalars (FP64 under ACC64: IEEE sqrt and division; FP32: correctly
        # rounded sqrt / division, as in the forward's score).
        if ACC64:
            r = 1.0 / tl.sqrt(ss / H + eps)
        else:
            r = tl.div_rn(1.0, tl.sqrt_rn(ss / H + eps))
        s = tl.where(valid, r * d, -float("inf"))
        p = tl.exp(s - tl.max(s, axis=0))
        p = p / tl.sum(p, axis=0)
        gs = tl.where(valid, p * (g - tl.sum(p * g, axis=0)), 0.0)
        # The element-wise math below is FP32 in the eager formula's order: dv_i = p_i gy + gs_i (r_i w - c_i v_i).
        c = (d * (r * r * r) / H).to(tl.float32)  # coefficient of v_i in d s_i / d v_i
        a = (gs * r).to(tl.float32)  # coefficient of v_i in dw
        p = p.to(tl.float32)
        gs = gs.to(tl.float32)
        r = r.to(tl.float32)
        gb_tile = gb_ptr + t64 * stride_gbt * VEC + gb_rows
        # Every row of this [K_PAD, 1] pointer tile is grad_prefix's row t; only row K's lanes are unmasked.
        gp_tile = gp_ptr + t64 * stride_gpt * VEC + r2 * 0
        # Pass 2: re-read each chunk; write dv (and zeros past K) and fold this token into the dw row.
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < H
            if H_STRIDED:
                pcols = cols.to(tl.int64) * stride_ph
                bcols = cols.to(tl.int64) * stride_bh
            else:
                pcols = cols
                bcols = cols
            blk = tl.load(blk_tile + bcols[None, :], mask=is_blk & hmask[None, :], other=0.0,
                          eviction_policy="evict_first")
            pre = tl.load(pre_row + pcols, mask=hmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            x = tl.where(r2 == K, pre[None, :], blk.to(tl.float32))
            if WRITE_PREFIX or WRITE_BLOCKS:
                gy = tl.load(gy_row + cols, mask=hmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                w = (tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
                     * tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32))
                dv = p[:, None] * gy[None, :] + gs[:, None] * (r[:, None] * w[None, :] - c[:, None] * x)
                if WRITE_PREFIX:
                    tl.store(gp_tile + cols[None, :], dv.to(gp_ptr.dtype.element_ty), mask=(r2 == K) & hmask[None, :])
                if WRITE_BLOCKS:
                    tl.store(gb_tile + cols[None, :], dv.to(gb_ptr.dtype.element_ty), mask=is_blk & hmask[None, :])
                    # Slots K..C-1 get exact zeros in the same pass (they were never read).
                    zeros = tl.zeros([K_PAD, BLOCK_H], dtype=gb_ptr.dtype.element_ty)
                    for z0 in range(K, C, K_PAD):
                        zr = z0 + r2
                        tl.store(gb_tile + tl.cast(z0, tl.int64) * stride_gbc * VEC + cols[None, :], zeros,
                                 mask=(zr < C) & hmask[None, :])
            if COMPUTE_DW:
                acc = tl.load(ws_row + cols, mask=hmask, other=0.0)
                tl.store(ws_row + cols, acc + tl.sum(a[:, None] * x, axis=0).to(ws_ptr.dtype.element_ty), mask=hmask)
        if COMPUTE_DW:
            # The dw row is read back by the next token: make this token's stores visible to every thread of
            # the program whatever layouts the compiler picked for the load and the store (one barrier per token;
            # a CTA barrier on GPUs, a pipeline barrier under triton-ascend, a no-op in the interpreter).
            tl.debug_barrier()


@triton.jit(do_not_specialize=["P"])
def attn_res_bwd_dw_reduce_kernel(ws_ptr, out_ptr, P, H, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    # grad_weight[h] = sum over workspace rows 0..P-1, always in the same order: a fixed-shape [BLOCK_P, BLOCK_H]
    # tile sum per chunk of rows, chunks added in sequence. No atomics, so identical bits from run to run.
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=ws_ptr.dtype.element_ty)
    for p0 in range(0, P, BLOCK_P):
        prow = p0 + tl.arange(0, BLOCK_P)
        tile = tl.load(ws_ptr + prow[:, None].to(tl.int64) * H + cols[None, :],
                       mask=(prow < P)[:, None] & hmask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask)
