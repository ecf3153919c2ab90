"""Forward kernels of kimi_k3::attn_res (@triton.jit code only; launch policies live in k3_ops/backends/).

Per token, in FP32: v_i = block_residual[t, i] (i < K), v_K = prefix_sum[t], w = norm_weight * proj_weight,
s_i = rsqrt(mean(v_i^2) + eps) * <v_i, w>, p = softmax(s), out[t] = sum_i p_i v_i (docs/kernels.md).

Three kernels share the helpers below:

- ``attn_res_rows_kernel`` (CUDA, large T): a persistent grid; each program streams the (token, candidate)
  rows of its tokens as one sequence through a [BLOCK_H] hidden tile with an online softmax (a RUN-time loop,
  any K); each candidate row is read exactly once, software-pipelined by hand (rows i + 1 .. i + PREFETCH are
  in flight while row i is reduced), across token boundaries.
- ``attn_res_split_kernel`` (CUDA, opt-in): H split across P = cdiv(H, CHUNK) programs per token, each
  holding a [K_PAD, CHUNK] tile of all candidates; partial (ss, d) go through a per-call FP64 buffer between
  two launches (PHASE 1 then PHASE 2).
- ``attn_res_token_kernel`` (CUDA, decode sizes) lives in attn_res_decode.py and shares these helpers.
- ``attn_res_npu_kernel`` (Ascend, triton-ascend): one program per vector core walking a contiguous token
  range; [K_PAD, BLOCK_H] tiles; two passes over H per token (statistics, then output).

Recompile safety: token counts, K and every stride are runtime arguments listed in ``do_not_specialize``
(Triton would otherwise specialise ints equal to 1 or divisible by 16, i.e. recompile per token count).
Token/block strides arrive divided by the constexpr ``VEC`` and are multiplied back here, so the compiler
still knows every row starts on a VEC-element (16-byte) boundary and emits vector loads. Row offsets are
formed in int64 (T * token stride exceeds 2^31 at prefill sizes).

Hidden stride: ``H_STRIDED=False`` (unit stride, the fast path) or ``True`` (strides ``stride_ph`` /
``stride_bh`` multiply the column index; correct at any stride, no vector loads).

Fused serving variant (kimi_k3::fused_attn_res, docs/fused_attn_res.md): the SAME kernels take four constexpr
flags, all False by default, so the plain forward compiles exactly as before (the extra pointer arguments
default to None, which Triton specialises away):

- ``HAS_ADDEND``: the prefix candidate is round_to_dtype(prefix + addend), added in FP32 and rounded once to
  the I/O dtype (bit-identical to torch's own add), then used as the candidate.
- ``FUSED``: write that prefix candidate (``new_prefix``, a new contiguous [T, H]) once per token.
- ``SNAPSHOT``: also write it into ``blocks[t, write_idx]`` (runtime index, a slot >= K: never read here).
- ``OUT_NORM``: the output is rms_norm(round_to_dtype(mix)) in FP32 with ``onw_ptr`` and ``out_eps``.

The serving calls' further flags (INPLACE_PREFIX, NORM_FP32_MIX, FP8_OUT, MIX_OUT) are described with their helpers
below. ``attn_res_add_snapshot_kernel`` (end of this module) is fused_attn_res.full's ``mix=False`` call: the add and
the snapshot alone, on CUDA and Ascend alike.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_RUNTIME_INTS = ["T", "K", "stride_pt", "stride_ph", "stride_bt", "stride_bc", "stride_bh", "stride_ot"]
# The fused variant's runtime ints (token counts and strides again: never specialised).
_FUSED_INTS = ["stride_at", "stride_ah", "stride_nt", "write_idx"]


# --------------------------------------------------------------------------------------------------------------
# Shared helpers: candidate addressing, the score, the output store.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _col_offsets(cols, stride_h, H_STRIDED: tl.constexpr):
    # Unit hidden stride: plain column indices, so the compiler sees contiguous, vectorisable addresses.
    if H_STRIDED:
        return tl.cast(cols, tl.int64) * stride_h
    else:
        return cols


@triton.jit
def _prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC: tl.constexpr, H_STRIDED: tl.constexpr):
    return prefix_ptr + tl.cast(t, tl.int64) * (stride_pt * VEC) + _col_offsets(cols, stride_ph, H_STRIDED)


@triton.jit
def _block_row_ptrs(blocks_ptr, t, i, cols, stride_bt, stride_bc, stride_bh, VEC: tl.constexpr,
                    H_STRIDED: tl.constexpr):
    return (blocks_ptr + tl.cast(t, tl.int64) * (stride_bt * VEC) + tl.cast(i, tl.int64) * (stride_bc * VEC)
            + _col_offsets(cols, stride_bh, H_STRIDED))


@triton.jit
def _load_folded_weight(nw_ptr, pw_ptr, cols, mask):
    # w = norm_weight * proj_weight folded in FP32 (the canonical scoring: RMSNorm without gamma, then <., w>).
    nw = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pw = tl.load(pw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return nw * pw


@triton.jit
def _sum_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


# Whether this module's kernels run in the Triton interpreter (TRITON_INTERPRET is read when they are decorated).
# The interpreter runs a reduction with any combine function but its own sum one element at a time in Python
# (about 400 s for one T = 7, H = 7168 one-tile case on a CI core), so there the statistics are two plain sums.
# A constexpr global: the compiler resolves the branch before code generation (docs/kernels.md, "Interpreter
# speed").
_INTERPRETED = tl.constexpr(isinstance(_sum_pair, InterpretedFunction))


@triton.jit
def _stats(x, w, AXIS: tl.constexpr, ACC64: tl.constexpr, PAIR: tl.constexpr = False):
    # (sum v^2, <v, w>) along AXIS. bf16/fp16 I/O: FP32 is ample (the output rounding dominates by far).
    # fp32 I/O: the score's summation error would dominate the output error (p = softmax(s) amplifies an
    # absolute score error into a relative weight error), so products and sums run in FP64 (exact products).
    # PAIR: both FP32 sums in one two-operand reduction, one cross-warp round (shared memory, barrier) for the
    # two; the per-token kernel's choice (docs/benchmarks.md, "The statistics in one reduction"). The rows
    # kernel keeps two sums: its fused variants were slower with one.
    if ACC64:
        xd = x.to(tl.float64)
        return tl.sum(xd * xd, axis=AXIS), tl.sum(xd * w.to(tl.float64), axis=AXIS)
    elif PAIR and not _INTERPRETED:
        return tl.reduce((x * x, x * w), AXIS, _sum_pair)
    else:
        return tl.sum(x * x, axis=AXIS), tl.sum(x * w, axis=AXIS)


@triton.jit
def _acc_full(shape, value, ACC64: tl.constexpr):
    if ACC64:
        return tl.full(shape, value, tl.float64)
    else:
        return tl.full(shape, value, tl.float32)


@triton.jit
def _rsqrt(x):
    # 1 / sqrt(x) in FP32 within 1 ulp: the hardware's approximate rsqrt (relative error up to 2^-22.9, about 2.6
    # ulp) and one Newton step, r + r (1 - x r^2) / 2 with the residual in one FMA. A branch-free handful of
    # instructions where the correctly rounded sqrt and division, 1 / sqrt_rn(x) (up to 1.5 ulp: two roundings),
    # each take a subroutine with a slow path. Two edges: the approximate rsqrt flushes subnormal x to zero, so
    # such x are scaled by 2^64 first (the result by 2^32 after, both exact); x = inf gives r = 0 and a NaN
    # residual, which keeps r (1 / sqrt(inf) = 0), as NaN x keeps NaN.
    tiny = x < 1.1754943508222875e-38
    xs = tl.where(tiny, x * 18446744073709551616.0, x)
    r = tl.rsqrt(xs)
    e = tl.fma(-(xs * r), r, 1.0)
    r = tl.where(e == e, tl.fma(0.5 * r, e, r), r)
    return tl.where(tiny, r * 4294967296.0, r)


@triton.jit
def _score(ss, d, H, eps, ACC64: tl.constexpr, REFINED: tl.constexpr = False):
    # The score's 1 / sqrt within 1 ulp: it feeds exp(), so the approximate rsqrt's error alone would show in the
    # weights; a few ops per candidate row, nothing per element. REFINED (the per-token kernel): _rsqrt; otherwise
    # correctly rounded sqrt and division (the rows and split kernels: there _rsqrt made the plain rows kernel
    # 1-1.5 % slower at T = 4096, K = 1..2, docs/benchmarks.md, "The op's steps on a one-tile floor"). (FP64 sqrt
    # and division are IEEE-rounded already.)
    if ACC64:
        return d / tl.sqrt(ss / H + eps)
    elif REFINED:
        return _rsqrt(ss / H + eps) * d
    else:
        return tl.div_rn(1.0, tl.sqrt_rn(ss / H + eps)) * d


@triton.jit
def _store_out(out_ptr, t, cols, mask, value, stride_ot, VEC: tl.constexpr):
    # The one place output is written: a contiguous [T, H] row of the output dtype.
    ptrs = out_ptr + tl.cast(t, tl.int64) * (stride_ot * VEC) + cols
    tl.store(ptrs, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gdc_wait_if(USE_PDL: tl.constexpr):
    # Programmatic dependent launch (sm_90+): block until the preceding kernel in the stream has completed and its
    # writes are visible. A PDL kernel reads no input before this point. Not emitted without PDL (the
    # interpreter cannot run inline PTX).
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch_dependents_if(USE_PDL: tl.constexpr):
    # Let the next PDL launch's programs be scheduled now: they wait in their own gdc_wait_if, so this only hides
    # their launch latency behind this kernel's work.
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


# --------------------------------------------------------------------------------------------------------------
# Fused serving variant helpers (only reached with a fused flag set).
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _add_addend(v, addend_ptr, t, cols, mask, stride_at, stride_ah, VEC: tl.constexpr, H_STRIDED: tl.constexpr):
    # round_to_dtype(prefix + addend): one FP32 add, one rounding to the I/O dtype -- what torch's own add of
    # two bf16/fp16/fp32 tensors computes, so new_prefix matches the unfused pipeline bit for bit.
    a = tl.load(_prefix_row_ptrs(addend_ptr, t, cols, stride_at, stride_ah, VEC, H_STRIDED), mask=mask, other=0.0)
    return (v.to(tl.float32) + a.to(tl.float32)).to(v.dtype)


@triton.jit
def _store_snapshot(blocks_ptr, t, cols, mask, value, stride_bt, stride_bc, stride_bh, write_idx, VEC: tl.constexpr,
                    H_STRIDED: tl.constexpr):
    # The snapshot row blocks[t, write_idx] (a slot >= K, never read by the mix).
    ptrs = _block_row_ptrs(blocks_ptr, t, write_idx, cols, stride_bt, stride_bc, stride_bh, VEC, H_STRIDED)
    tl.store(ptrs, value.to(blocks_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_new_prefix(newp_ptr, blocks_ptr, t, cols, mask, value, stride_nt, stride_bt, stride_bc, stride_bh,
                      write_idx, VEC: tl.constexpr, H_STRIDED: tl.constexpr, SNAPSHOT: tl.constexpr):
    # new_prefix row (contiguous [T, H]) and, at a block boundary, the snapshot row blocks[t, write_idx]: the
    # same I/O-dtype values, so the two are equal bit for bit.
    _store_out(newp_ptr, t, cols, mask, value, stride_nt, VEC)
    if SNAPSHOT:
        _store_snapshot(blocks_ptr, t, cols, mask, value, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED)


@triton.jit
def _round_mix(mix, io_ptr):
    # The mix as the unfused pipeline's RMSNorm sees it: rounded to the I/O dtype (io_ptr's element type) first.
    return mix.to(io_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _norm_scale(ss, H, out_eps, REFINED: tl.constexpr = False):
    # rsqrt(mean(x^2) + eps) within 1 ulp, in _score's form (REFINED: _rsqrt; otherwise correctly rounded).
    if REFINED:
        return _rsqrt(ss / H + out_eps)
    else:
        return tl.div_rn(1.0, tl.sqrt_rn(ss / H + out_eps))


@triton.jit
def _norm_scale_npu(ss, H, out_eps):
    # _norm_scale for triton-ascend: its --triton-to-linalg pass cannot lower a scalar tl.div_rn (tt.precise_divf
    # on a 0-d f32 trips an assertion), while a plain division and tl.sqrt_rn lower. The same quotient wherever
    # FP32 division is correctly rounded: the interpreter, and on Ascend what the NPU kernels' plain-division
    # scores already assume (unverified on hardware). On CUDA `/` is approximate, so its kernels keep _norm_scale.
    return 1.0 / tl.sqrt_rn(ss / H + out_eps)


@triton.jit
def _norm_sum_sq(x, gram_ss, gram_ok, NORM_GRAM: tl.constexpr):
    # The output norm's sum of squares of its input row x: reduced over x, or with NORM_GRAM the one the kernel
    # formed from its candidates' pairwise products (attn_res_decode.py, "Gram"), where ``gram_ok`` says it is
    # accurate, which is uniform over the program (a runtime branch: the reduction runs only where it is not).
    if NORM_GRAM:
        if gram_ok:
            ss = gram_ss.to(tl.float32)
        else:
            ss = tl.sum(x * x, axis=0)
    else:
        ss = tl.sum(x * x, axis=0)
    return ss


@triton.jit
def _apply_out_norm(x, scale, onw_ptr, cols, mask):
    # torch's rms_norm order: (x * rsqrt(...)) * weight, in FP32.
    g = tl.load(onw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x * scale * g


# --------------------------------------------------------------------------------------------------------------
# Serving-call helpers: kimi_k3::fused_attn_res_ (prefix updated in place) and fused_attn_res.quant (FP8 output),
# both also selecting the output norm's rounding point. Reached only with their constexpr flags set
# (INPLACE_PREFIX, NORM_FP32_MIX, FP8_OUT), all False by default, so every other variant compiles as before.
#
# Contract, for any kernel that computes a token's FP32 mix (the rows kernel, the NPU kernel, a per-token decode
# kernel); none reads or writes anything but the rows named, all flags are constexprs:
#   _store_updated_prefix(...)  stores a token's prefix candidate ``value`` (round(prefix + addend), I/O dtype) as
#       the new prefix: into new_prefix (newp_ptr, contiguous) or, with INPLACE_PREFIX, back into prefix_ptr at
#       prefix_sum's own strides (only with HAS_ADDEND: otherwise nothing changed), plus the snapshot row with
#       SNAPSHOT. Each lane writes exactly the elements it loaded, so a program that has read (all of) the row it
#       still needs may overwrite it; no other program reads that token's prefix.
#   _norm_input(mix, mask, io_ptr, NORM_FP32_MIX)  what the output norm sees: the mix rounded to the I/O dtype
#       (default: fused == rms_norm(attn_res(...))) or the FP32 mix itself (NORM_FP32_MIX: vLLM's kernels); 0 in
#       masked lanes, so sums over the row are exact.
#   _fp8_scale_part(y, mask, FP8_MAX)  the FP8 dequantisation scale of (a chunk of) a row ``y`` already rounded
#       to the model dtype: max over lanes of div_rn(max(|y|, 1e-10), FP8_MAX). x -> div_rn(x, FP8_MAX) is
#       monotone, so the max over a row's chunks is exactly div_rn(max(amax, 1e-10), FP8_MAX), with no scalar
#       division (which triton-ascend's adapter cannot lower).
#   _fp8_bits(y, scale, FP8_MAX, FNUZ)  q = clamp(div_rn(y, scale), -FP8_MAX, FP8_MAX) as e4m3 bit patterns
#       (int32 in [0, 255]; see _e4m3_bits), to be stored through a uint8 view of the FP8 output.
#   _serving_row_out(...)  all of the output side for a complete row held in registers: norm, rounding, FP8
#       scale and bits, the store of out (and of scale_ptr[t]); with MIX_OUT (fused_attn_res.full's return_mix)
#       first the mix rounded to the I/O dtype into mix_ptr (_store_mix), the norm's input bit for bit.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, mask, value, stride_nt, stride_pt, stride_ph,
                          stride_bt, stride_bc, stride_bh, write_idx, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                          HAS_ADDEND: tl.constexpr, SNAPSHOT: tl.constexpr, INPLACE_PREFIX: tl.constexpr):
    if INPLACE_PREFIX:
        if HAS_ADDEND:
            tl.store(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED),
                     value.to(prefix_ptr.dtype.element_ty), mask=mask)
        if SNAPSHOT:
            _store_snapshot(blocks_ptr, t, cols, mask, value, stride_bt, stride_bc, stride_bh, write_idx, VEC,
                            H_STRIDED)
    else:
        _store_new_prefix(newp_ptr, blocks_ptr, t, cols, mask, value, stride_nt, stride_bt, stride_bc, stride_bh,
                          write_idx, VEC, H_STRIDED, SNAPSHOT)


@triton.jit
def _norm_input(mix, mask, io_ptr, NORM_FP32_MIX: tl.constexpr):
    if NORM_FP32_MIX:
        return tl.where(mask, mix, 0.0)
    else:
        return tl.where(mask, _round_mix(mix, io_ptr), 0.0)


@triton.jit
def _fp8_scale_part(y, mask, FP8_MAX: tl.constexpr):
    a = tl.maximum(tl.where(mask, tl.abs(y), 0.0), 1e-10)
    return tl.max(tl.div_rn(a, tl.full(a.shape, FP8_MAX, tl.float32)), axis=0)


@triton.jit
def _e4m3_bits(x, FNUZ: tl.constexpr):
    # fp32 -> e4m3 bit pattern, round to nearest even, for |x| <= the format's max (callers clamp), by integer
    # arithmetic: identical to torch's conversion and independent of the backend's FP8 support.
    # float8_e4m3fn: exponent bias 7, has -0.0, NaN 0x7F | sign. float8_e4m3fnuz: bias 8, no -0.0, NaN 0x80.
    BIAS: tl.constexpr = 8 if FNUZ else 7
    MIN_NORMAL: tl.constexpr = 2.0 ** (1 - BIAS)
    SUB_SCALE: tl.constexpr = 2.0 ** (2 + BIAS)  # 1 / the subnormal step 2^(1 - BIAS - 3)
    is_nan = x != x
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    # NaN lanes take the magnitude of 0 (their pattern is chosen below), so no lane's integer sum overflows.
    mag = tl.where(is_nan, 0.0, x).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    ax = mag.to(tl.float32, bitcast=True)
    # Normal range: round the 23-bit mantissa to 3 bits, ties to even (a carry correctly bumps the exponent), then
    # rebias the exponent from 127 to BIAS.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - BIAS) << 3)
    # Subnormal range: multiples of 2^(1 - BIAS - 3); adding and removing 2^23 rounds to the nearest even integer
    # (exact here: the scaled value is below 8 and the scaling is a power of two).
    sub = ((ax * SUB_SCALE + 8388608.0) - 8388608.0).to(tl.int32)
    enc = tl.where(ax < MIN_NORMAL, sub, normal)
    if FNUZ:
        return tl.where(is_nan, 0x80, tl.where(enc == 0, 0, enc | (sign << 7)))
    else:
        # The tensor on the left of `|`: triton-ascend's frontend (Triton 3.2) cannot take an int there.
        return tl.where(is_nan, (sign << 7) | 0x7F, enc | (sign << 7))


@triton.jit
def _fp8_bits(y, scale, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr):
    q = tl.div_rn(y, scale + tl.zeros(y.shape, tl.float32))
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
    return _e4m3_bits(q, FNUZ)


@triton.jit
def _store_mix(mix_ptr, t, cols, mask, mix, stride_ot, VEC: tl.constexpr, MIX_OUT: tl.constexpr):
    # fused_attn_res.full's return_mix: the FP32 mix rounded to the I/O dtype (mix_ptr's, a new contiguous [T, H] at
    # out's token stride) by the same conversion _round_mix applies, so it is the output norm's input bit for bit.
    if MIX_OUT:
        _store_out(mix_ptr, t, cols, mask, mix, stride_ot, VEC)


@triton.jit
def _serving_row_out(out_ptr, io_ptr, scale_ptr, onw_ptr, t, cols, hmask, mix, H, out_eps, stride_ot,
                     VEC: tl.constexpr, OUT_NORM: tl.constexpr, NORM_FP32_MIX: tl.constexpr, FP8_OUT: tl.constexpr,
                     FP8_FNUZ: tl.constexpr, FP8_MAX: tl.constexpr, NPU_NORM_SCALE: tl.constexpr = False,
                     gram_ss=0.0, gram_ok=False, NORM_GRAM: tl.constexpr = False, REFINED: tl.constexpr = False,
                     mix_ptr=None, MIX_OUT: tl.constexpr = False):
    # NPU_NORM_SCALE: the norm's scale in the form triton-ascend lowers (_norm_scale_npu: no scalar div_rn).
    # NORM_GRAM: the norm's sum of squares given (gram_ss where gram_ok; see _norm_sum_sq). REFINED: _norm_scale's.
    # MIX_OUT: the mix rounded to the I/O dtype into mix_ptr (_store_mix).
    _store_mix(mix_ptr, t, cols, hmask, mix, stride_ot, VEC, MIX_OUT)
    y = mix
    if OUT_NORM:
        x = _norm_input(mix, hmask, io_ptr, NORM_FP32_MIX)
        ss = _norm_sum_sq(x, gram_ss, gram_ok, NORM_GRAM)
        if NPU_NORM_SCALE:
            scale = _norm_scale_npu(ss, H, out_eps)
        else:
            scale = _norm_scale(ss, H, out_eps, REFINED)
        y = _apply_out_norm(x, scale, onw_ptr, cols, hmask)
    if FP8_OUT:
        # The output as the model dtype holds it, then its per-token scale and FP8 bits.
        yr = tl.where(hmask, _round_mix(y, io_ptr), 0.0)
        scale = _fp8_scale_part(yr, hmask, FP8_MAX)
        _store_out(out_ptr, t, cols, hmask, _fp8_bits(yr, scale, FP8_MAX, FP8_FNUZ), stride_ot, VEC)
        tl.store(scale_ptr + t, scale)
    else:
        _store_out(out_ptr, t, cols, hmask, y, stride_ot, VEC)


@triton.jit
def _serving_epilogue(out_ptr, newp_ptr, prefix_ptr, blocks_ptr, onw_ptr, scale_ptr, t, cols, hmask, mix, v, K, H,
                      out_eps, stride_ot, stride_nt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, write_idx,
                      VEC: tl.constexpr, H_STRIDED: tl.constexpr, HAS_ADDEND: tl.constexpr, SNAPSHOT: tl.constexpr,
                      OUT_NORM: tl.constexpr, INPLACE_PREFIX: tl.constexpr, NORM_FP32_MIX: tl.constexpr,
                      FP8_OUT: tl.constexpr, FP8_FNUZ: tl.constexpr, FP8_MAX: tl.constexpr, gram_ss=0.0,
                      gram_ok=False, NORM_GRAM: tl.constexpr = False, REFINED: tl.constexpr = False, mix_ptr=None,
                      MIX_OUT: tl.constexpr = False):
    # A complete token row (rows kernel, per-token kernel): v is its prefix candidate (the new prefix), mix its
    # FP32 mix; NORM_GRAM: the norm's sum of squares given (_norm_sum_sq); REFINED: _norm_scale's; MIX_OUT: the
    # rounded mix stored too (_store_mix).
    _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, v, stride_nt, stride_pt, stride_ph,
                          stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED, HAS_ADDEND, SNAPSHOT,
                          INPLACE_PREFIX)
    # K = 0: the mix IS the new prefix (attn_res's exact copy); 0 * acc + 1 * v would turn -0.0 into +0.0.
    mix = tl.where(K == 0, v.to(tl.float32), mix)
    _serving_row_out(out_ptr, prefix_ptr, scale_ptr, onw_ptr, t, cols, hmask, mix, H, out_eps, stride_ot, VEC,
                     OUT_NORM, NORM_FP32_MIX, FP8_OUT, FP8_FNUZ, FP8_MAX, False, gram_ss, gram_ok, NORM_GRAM, REFINED,
                     mix_ptr, MIX_OUT)


# --------------------------------------------------------------------------------------------------------------
# CUDA, large T: rows kernel with a run-time candidate loop and an online softmax.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _load_candidate_row(prefix_ptr, blocks_ptr, t, i, K, cols, hmask, stride_pt, stride_ph, stride_bt, stride_bc,
                        stride_bh, VEC: tl.constexpr, H_STRIDED: tl.constexpr):
    # Candidate i of token t: block i for i < K, the prefix for i == K, nothing (zeros) past K. Slots >= K of
    # the buffer are never addressed by an unmasked lane. The row is chosen by a *scalar* select of its base
    # pointer (and hidden stride), not an element-wise select of two pointer tensors: 64-bit pointer tensors
    # cost two registers per element, and register pressure is what limits this kernel's occupancy.
    # Streaming data: evict first, keep L2 for the weights.
    t64 = tl.cast(t, tl.int64)
    blk = blocks_ptr + t64 * (stride_bt * VEC) + tl.cast(tl.minimum(i, K - 1), tl.int64) * (stride_bc * VEC)
    pre = prefix_ptr + t64 * (stride_pt * VEC)
    base = tl.where(i < K, blk, pre)
    if H_STRIDED:
        offs = tl.cast(cols, tl.int64) * tl.where(i < K, stride_bh, stride_ph)
    else:
        offs = cols
    # Masks are built with tl.where, a bool tensor on every Triton version: `hmask & (i <= K)` (a bool tensor and
    # a scalar comparison) reaches triton 3.9's interpreter as int32, which it rejects as a mask.
    return tl.load(base + offs, mask=tl.where(hmask, i <= K, False), other=0.0, eviction_policy="evict_first")


@triton.jit
def _online_update(x, w, m, l_sum, acc, H, eps, ACC64: tl.constexpr):
    # One candidate row into the online softmax: rescale the running sum when the running max grows.
    ss, d = _stats(x, w, 0, ACC64)
    s = _score(ss, d, H, eps, ACC64)
    m_new = tl.maximum(m, s)
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    acc = acc * alpha.to(tl.float32) + p.to(tl.float32) * x
    l_sum = l_sum * alpha + p
    return m_new, l_sum, acc


@triton.jit
def _load_step(prefix_ptr, blocks_ptr, pid, nprog, j, steps, K, cols, hmask, stride_pt, stride_ph, stride_bt,
               stride_bc, stride_bh, VEC: tl.constexpr, H_STRIDED: tl.constexpr):
    # Step j of this program's stream of (token, candidate) rows: token pid + (j // (K + 1)) * nprog,
    # candidate j % (K + 1). Steps past the end load nothing.
    t = pid + (j // (K + 1)) * nprog
    i = j % (K + 1)
    row = _load_candidate_row(prefix_ptr, blocks_ptr, t, i, K, cols, tl.where(hmask, j < steps, False), stride_pt,
                              stride_ph, stride_bt, stride_bc, stride_bh, VEC, H_STRIDED)
    return row


@triton.jit
def _load_step_fused(prefix_ptr, blocks_ptr, addend_ptr, pid, nprog, j, steps, K, cols, hmask, stride_pt, stride_ph,
                     stride_bt, stride_bc, stride_bh, stride_at, stride_ah, VEC: tl.constexpr,
                     H_STRIDED: tl.constexpr, HAS_ADDEND: tl.constexpr):
    # _load_step, and with HAS_ADDEND the prefix candidate replaced by round(prefix + addend); the addend row
    # is loaded with the step (so it is prefetched with it), by lanes of the prefix step only.
    row = _load_step(prefix_ptr, blocks_ptr, pid, nprog, j, steps, K, cols, hmask, stride_pt, stride_ph, stride_bt,
                     stride_bc, stride_bh, VEC, H_STRIDED)
    if HAS_ADDEND:
        i = j % (K + 1)
        t = pid + (j // (K + 1)) * nprog
        row = tl.where(i == K, _add_addend(row, addend_ptr, t, cols, tl.where(hmask, (j < steps) & (i == K), False),
                                           stride_at, stride_ah, VEC, H_STRIDED), row)
    return row


@triton.jit(do_not_specialize=_RUNTIME_INTS + _FUSED_INTS)
def attn_res_rows_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, T, K, H, eps,
                         stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_ot,
                         BLOCK_H: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr, ACC64: tl.constexpr,
                         PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr,
                         addend_ptr=None, newp_ptr=None, onw_ptr=None, stride_at=0, stride_ah=0, stride_nt=0,
                         write_idx=0, out_eps=1.0, HAS_ADDEND: tl.constexpr = False, FUSED: tl.constexpr = False,
                         SNAPSHOT: tl.constexpr = False, OUT_NORM: tl.constexpr = False, scale_ptr=None,
                         INPLACE_PREFIX: tl.constexpr = False, NORM_FP32_MIX: tl.constexpr = False,
                         FP8_OUT: tl.constexpr = False, FP8_FNUZ: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
                         USE_PDL: tl.constexpr = False, mix_ptr=None, MIX_OUT: tl.constexpr = False):
    # Persistent: program pid handles tokens pid, pid + nprog, ... as ONE continuous stream of candidate rows
    # (token-major, K + 1 rows per token), so the prefetch runs across token boundaries and the memory system
    # never waits for a new token to start; the folded weight is loaded once per program, not once per token.
    # PREFETCH (1 or 2): rows held in registers in flight ahead of the one being reduced (0: Triton's pipeliner
    # stages them in shared memory instead, NUM_STAGES deep). The kernel is latency-bound per program (load a row,
    # reduce it, fold it in), so rows in flight per SM set its bandwidth; registers cap programs per SM at two.
    # Fused: the mix row is complete in registers at the token's last candidate, which is the prefix candidate
    # (new_prefix), so new_prefix, the snapshot and the normed output are all written there, in this launch.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    # PDL: any input may come from the preceding kernel, so nothing is read before the wait.
    gdc_wait_if(USE_PDL)
    gdc_launch_dependents_if(USE_PDL)
    w = _load_folded_weight(nw_ptr, pw_ptr, cols, hmask)
    steps = ((T - pid + nprog - 1) // nprog) * (K + 1)
    m = _acc_full([], -float("inf"), ACC64)
    l_sum = _acc_full([], 0.0, ACC64)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if PREFETCH == 0:
        # Let Triton's software pipeliner stage the row loads (cp.async into shared memory, NUM_STAGES deep)
        # instead of holding prefetched rows in registers.
        for j in tl.range(0, steps, num_stages=NUM_STAGES):
            xr = _load_step_fused(prefix_ptr, blocks_ptr, addend_ptr, pid, nprog, j, steps, K, cols, hmask,
                                  stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_at, stride_ah, VEC,
                                  H_STRIDED, HAS_ADDEND)
            x = xr.to(tl.float32)
            m, l_sum, acc = _online_update(x, w, m, l_sum, acc, H, eps, ACC64)
            if j % (K + 1) == K:
                if FUSED:
                    _serving_epilogue(out_ptr, newp_ptr, prefix_ptr, blocks_ptr, onw_ptr, scale_ptr,
                                      pid + (j // (K + 1)) * nprog, cols, hmask, acc / l_sum.to(tl.float32), xr, K, H,
                                      out_eps, stride_ot, stride_nt, stride_pt, stride_ph, stride_bt, stride_bc,
                                      stride_bh, write_idx, VEC, H_STRIDED, HAS_ADDEND, SNAPSHOT, OUT_NORM,
                                      INPLACE_PREFIX, NORM_FP32_MIX, FP8_OUT, FP8_FNUZ, FP8_MAX, mix_ptr=mix_ptr,
                                      MIX_OUT=MIX_OUT)
                else:
                    _store_out(out_ptr, pid + (j // (K + 1)) * nprog, cols, hmask, acc / l_sum.to(tl.float32),
                               stride_ot, VEC)
                m = _acc_full([], -float("inf"), ACC64)
                l_sum = _acc_full([], 0.0, ACC64)
                acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        return
    v = _load_step_fused(prefix_ptr, blocks_ptr, addend_ptr, pid, nprog, 0, steps, K, cols, hmask, stride_pt,
                         stride_ph, stride_bt, stride_bc, stride_bh, stride_at, stride_ah, VEC, H_STRIDED, HAS_ADDEND)
    if PREFETCH == 2:
        v1 = _load_step_fused(prefix_ptr, blocks_ptr, addend_ptr, pid, nprog, 1, steps, K, cols, hmask, stride_pt,
                              stride_ph, stride_bt, stride_bc, stride_bh, stride_at, stride_ah, VEC, H_STRIDED,
                              HAS_ADDEND)
    for j in range(0, steps):
        vn = _load_step_fused(prefix_ptr, blocks_ptr, addend_ptr, pid, nprog, j + PREFETCH, steps, K, cols, hmask,
                              stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_at, stride_ah, VEC,
                              H_STRIDED, HAS_ADDEND)
        m, l_sum, acc = _online_update(v.to(tl.float32), w, m, l_sum, acc, H, eps, ACC64)
        if j % (K + 1) == K:
            # Last candidate of a token: write its row, start the next token's softmax.
            if FUSED:
                _serving_epilogue(out_ptr, newp_ptr, prefix_ptr, blocks_ptr, onw_ptr, scale_ptr,
                                  pid + (j // (K + 1)) * nprog, cols, hmask, acc / l_sum.to(tl.float32), v, K, H,
                                  out_eps, stride_ot, stride_nt, stride_pt, stride_ph, stride_bt, stride_bc, stride_bh,
                                  write_idx, VEC, H_STRIDED, HAS_ADDEND, SNAPSHOT, OUT_NORM, INPLACE_PREFIX,
                                  NORM_FP32_MIX, FP8_OUT, FP8_FNUZ, FP8_MAX, mix_ptr=mix_ptr, MIX_OUT=MIX_OUT)
            else:
                _store_out(out_ptr, pid + (j // (K + 1)) * nprog, cols, hmask, acc / l_sum.to(tl.float32), stride_ot,
                           VEC)
            m = _acc_full([], -float("inf"), ACC64)
            l_sum = _acc_full([], 0.0, ACC64)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        if PREFETCH == 2:
            v = v1
            v1 = vn
        else:
            v = vn


# --------------------------------------------------------------------------------------------------------------
# CUDA, opt-in: split kernel (H split across programs, two launches).
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _load_candidate_tile(prefix_ptr, blocks_ptr, t, K, rows, cols, hmask, stride_pt, stride_ph, stride_bt,
                         stride_bc, stride_bh, VEC: tl.constexpr, H_STRIDED: tl.constexpr):
    # [K_PAD, CHUNK] tile: rows < K are blocks, row K is the prefix, rows > K are masked (never addressed).
    r = rows[:, None]
    blk = _block_row_ptrs(blocks_ptr, t, tl.minimum(r, K - 1), cols[None, :], stride_bt, stride_bc, stride_bh,
                          VEC, H_STRIDED)
    pre = _prefix_row_ptrs(prefix_ptr, t, cols[None, :], stride_pt, stride_ph, VEC, H_STRIDED)
    ptrs = tl.where(r < K, blk, pre)
    return tl.load(ptrs, mask=(r <= K) & hmask[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _split_norm_scale(norm_base, P, H, out_eps, P_PAD: tl.constexpr):
    # Sum of squares of the token's rounded mix from its P chunk partials, in a fixed order (deterministic, and
    # every chunk applies the same scale).
    pc = tl.arange(0, P_PAD)
    ss = tl.sum(tl.load(norm_base + pc, mask=pc < P, other=0.0, cache_modifier=".cg"), axis=0)
    return _norm_scale(ss.to(tl.float32), H, out_eps)


@triton.jit(do_not_specialize=_RUNTIME_INTS + _FUSED_INTS)
def attn_res_split_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, partials_ptr, T, K, H, eps,
                          stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_ot,
                          CHUNK: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, VEC: tl.constexpr,
                          H_STRIDED: tl.constexpr, ACC64: tl.constexpr, PHASE: tl.constexpr,
                          addend_ptr=None, newp_ptr=None, onw_ptr=None, stride_at=0, stride_ah=0, stride_nt=0,
                          write_idx=0, out_eps=1.0, HAS_ADDEND: tl.constexpr = False, FUSED: tl.constexpr = False,
                          SNAPSHOT: tl.constexpr = False, OUT_NORM: tl.constexpr = False):
    # Grid (P, T): program (c, t) owns hidden chunk c of token t. Launched twice (PHASE 1: partials, PHASE 2:
    # combine + output), the partials in a buffer of the call's own:
    #   partials[t, c, 0, :K_PAD] = partial sum(v^2), partials[t, c, 1, :K_PAD] = partial <v, w>   (FP64)
    #   with OUT_NORM also partials[t, P_PAD * 2 * K_PAD + c] = partial sum(round(mix)^2) of chunk c
    # Fused: each program adds/writes only its own chunk of new_prefix (and of the snapshot). OUT_NORM needs the
    # whole row's sum of squares: PHASE 2 writes the rounded mix and a third launch (PHASE 3) normalises it in
    # place.
    c = tl.program_id(0)
    t = tl.program_id(1)
    P = tl.num_programs(0)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    hmask = cols < H
    rows = tl.arange(0, K_PAD)
    kp = tl.arange(0, K_PAD)
    if OUT_NORM:
        part_base = partials_ptr + tl.cast(t, tl.int64) * (P_PAD * (2 * K_PAD + 1))
    else:
        part_base = partials_ptr + tl.cast(t, tl.int64) * (P_PAD * 2 * K_PAD)
    if PHASE == 3:
        # Fused OUT_NORM, two-launch mode: out holds the rounded mix; scale it in place.
        x = tl.load(out_ptr + tl.cast(t, tl.int64) * (stride_ot * VEC) + cols, mask=hmask, other=0.0).to(tl.float32)
        scale = _split_norm_scale(part_base + P_PAD * 2 * K_PAD, P, H, out_eps, P_PAD)
        _store_out(out_ptr, t, cols, hmask, _apply_out_norm(x, scale, onw_ptr, cols, hmask), stride_ot, VEC)
        return
    x = _load_candidate_tile(prefix_ptr, blocks_ptr, t, K, rows, cols, hmask, stride_pt, stride_ph, stride_bt,
                             stride_bc, stride_bh, VEC, H_STRIDED).to(tl.float32)
    if FUSED:
        # This chunk of the prefix candidate (an L1/L2 hit: the tile just read it), plus the addend, rounded.
        newp = tl.load(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED), mask=hmask,
                       other=0.0)
        if HAS_ADDEND:
            newp = _add_addend(newp, addend_ptr, t, cols, hmask, stride_at, stride_ah, VEC, H_STRIDED)
            x = tl.where(rows[:, None] == K, newp[None, :].to(tl.float32), x)
        if PHASE != 2:
            _store_new_prefix(newp_ptr, blocks_ptr, t, cols, hmask, newp, stride_nt, stride_bt, stride_bc,
                              stride_bh, write_idx, VEC, H_STRIDED, SNAPSHOT)
    if PHASE != 2:
        w = _load_folded_weight(nw_ptr, pw_ptr, cols, hmask)
        ss_part, d_part = _stats(x, w[None, :], 1, ACC64)
        # The workspace is FP64 whatever the I/O dtype (a few hundred bytes): no rounding between chunks.
        tl.store(part_base + c * (2 * K_PAD) + kp, ss_part.to(tl.float64))
        tl.store(part_base + c * (2 * K_PAD) + K_PAD + kp, d_part.to(tl.float64))
    if PHASE != 1:
        # Every program sums the P partials of its token in the same fixed order, so all chunks see identical
        # statistics (deterministic). ".cg" reads bypass L1: the data was written by other SMs just now.
        pc = tl.arange(0, P_PAD)
        pmask = (pc < P)[:, None]
        poffs = pc[:, None] * (2 * K_PAD) + kp[None, :]
        ss = tl.sum(tl.load(part_base + poffs, mask=pmask, other=0.0, cache_modifier=".cg"), axis=0)
        d = tl.sum(tl.load(part_base + K_PAD + poffs, mask=pmask, other=0.0, cache_modifier=".cg"), axis=0)
        if not ACC64:
            ss = ss.to(tl.float32)
            d = d.to(tl.float32)
        s = tl.where(kp <= K, _score(ss, d, H, eps, ACC64), -float("inf"))
        p = tl.exp(s - tl.max(s, axis=0))
        p = (p / tl.sum(p, axis=0)).to(tl.float32)
        if FUSED:
            # K = 0: the mix IS new_prefix (attn_res's exact copy, -0.0 included).
            mix = tl.where(K == 0, newp.to(tl.float32), tl.sum(p[:, None] * x, axis=0))
            if OUT_NORM:
                xm = tl.where(hmask, _round_mix(mix, out_ptr), 0.0)
                tl.store(part_base + P_PAD * 2 * K_PAD + c, tl.sum(xm * xm, axis=0).to(tl.float64))
                mix = xm  # PHASE 3 scales it
            _store_out(out_ptr, t, cols, hmask, mix, stride_ot, VEC)
        else:
            _store_out(out_ptr, t, cols, hmask, tl.sum(p[:, None] * x, axis=0), stride_ot, VEC)


# --------------------------------------------------------------------------------------------------------------
# Ascend NPU (triton-ascend): one program per vector core, contiguous token range, two passes over H.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _load_npu_tile(prefix_ptr, blocks_ptr, t, K, rows, cols, hmask, stride_pt, stride_ph, stride_bt, stride_bc,
                   stride_bh, VEC: tl.constexpr, H_STRIDED: tl.constexpr):
    # [K_PAD, BLOCK_H] tile built from two plain masked loads (blocks, prefix) and a value select: no pointer
    # select, which the Ascend compiler handles less well than the vector select.
    r = rows[:, None]
    blk = tl.load(_block_row_ptrs(blocks_ptr, t, r, cols[None, :], stride_bt, stride_bc, stride_bh, VEC, H_STRIDED),
                  mask=(r < K) & hmask[None, :], other=0.0)
    pre = tl.load(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED), mask=hmask,
                  other=0.0)
    return tl.where(r == K, pre[None, :].to(tl.float32), blk.to(tl.float32))


@triton.jit
def _load_npu_tile_fused(prefix_ptr, blocks_ptr, addend_ptr, t, K, rows, cols, hmask, stride_pt, stride_ph, stride_bt,
                         stride_bc, stride_bh, stride_at, stride_ah, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                         HAS_ADDEND: tl.constexpr):
    # _load_npu_tile with the prefix row replaced by new_prefix = round(prefix + addend) (or the prefix itself);
    # returns the FP32 tile and the new_prefix row in the I/O dtype.
    r = rows[:, None]
    blk = tl.load(_block_row_ptrs(blocks_ptr, t, r, cols[None, :], stride_bt, stride_bc, stride_bh, VEC, H_STRIDED),
                  mask=(r < K) & hmask[None, :], other=0.0)
    newp = tl.load(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED), mask=hmask,
                   other=0.0)
    if HAS_ADDEND:
        newp = _add_addend(newp, addend_ptr, t, cols, hmask, stride_at, stride_ah, VEC, H_STRIDED)
    return tl.where(r == K, newp[None, :].to(tl.float32), blk.to(tl.float32)), newp


@triton.jit
def _two_sum_combine(a_hi, a_lo, b_hi, b_lo):
    # Knuth's TwoSum: hi + lo represents a + b exactly (a "double-float" sum in FP32 arithmetic).
    hi = a_hi + b_hi
    bb = hi - a_hi
    err = (a_hi - (hi - bb)) + (b_hi - bb)
    return hi, a_lo + b_lo + err


@triton.jit
def _fast_two_sum(a, b):
    # |a| >= |b|: hi + lo == a + b exactly.
    hi = a + b
    return hi, b - (hi - a)


@triton.jit
def _two_prod(a, b):
    # Dekker's TwoProduct without FMA: hi + lo == a * b exactly. The split keeps 12 significant bits in the high
    # part (mask off the low 12 mantissa bits), so every partial product below is exact in FP32; an FMA the
    # compiler might contract into is exact on these operands too.
    p = a * b
    a_hi = (a.to(tl.int32, bitcast=True) & -4096).to(tl.float32, bitcast=True)
    b_hi = (b.to(tl.int32, bitcast=True) & -4096).to(tl.float32, bitcast=True)
    a_lo = a - a_hi
    b_lo = b - b_hi
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


@triton.jit
def _df_mul(a_hi, a_lo, b_hi, b_lo):
    p, e = _two_prod(a_hi, b_hi)
    return _fast_two_sum(p, e + (a_hi * b_lo + a_lo * b_hi))


@triton.jit
def _df_div_int(hi, lo, n):
    # (hi + lo) / n in double-float for a positive integer n (exact in FP32): quotient, then the exact remainder.
    nf = n.to(tl.float32)
    q = hi / nf
    p, e = _two_prod(q, nf)
    return _fast_two_sum(q, (((hi - p) - e) + lo) / nf)


@triton.jit
def _df_score(ss_hi, ss_lo, d_hi, d_lo, H, eps):
    """r = rsqrt(ss / H + eps) and s = r * d in double-float FP32 arithmetic (forward and backward share it, so
    both see the same scores): m = ss / H + eps, then an FP32 estimate of 1 / sqrt(m) refined by one Newton
    step on the double-float residual m * r0^2 - 1."""
    m_hi, m_lo = _df_div_int(ss_hi, ss_lo, H)
    m_hi, m_lo = _two_sum_combine(m_hi, m_lo, eps, 0.0)
    m_hi, m_lo = _fast_two_sum(m_hi, m_lo)
    r0 = 1.0 / tl.sqrt(m_hi)
    sq_hi, sq_lo = _two_prod(r0, r0)
    t_hi, t_lo = _df_mul(m_hi, m_lo, sq_hi, sq_lo)
    r_hi, r_lo = _fast_two_sum(r0, -0.5 * r0 * ((t_hi - 1.0) + t_lo))
    s_hi, s_lo = _df_mul(d_hi, d_lo, r_hi, r_lo)
    return r_hi, r_lo, s_hi, s_lo


@triton.jit
def _df_softmax_weights(ss_hi, ss_lo, d_hi, d_lo, valid, H, eps):
    """softmax(rsqrt(ss / H + eps) * d) over [K_PAD] candidates from double-float (hi, lo) statistics, with the
    score carried in double-float arithmetic (FP32 only, for Ascend): an FP32 score's absolute rounding error
    (~1e-7 x |s|) becomes the weights' relative error, which dominates fp32 outputs."""
    r_hi, r_lo, s_hi, s_lo = _df_score(ss_hi, ss_lo, d_hi, d_lo, H, eps)
    mx = tl.max(tl.where(valid, s_hi, -float("inf")), axis=0)
    # exp(s - mx) with the low part applied to first order (|s_lo| ~ 1e-7 |s|). Padding rows get weight 0 (and
    # stay finite on the way: no inf - inf).
    dl_hi, dl_lo = _two_sum_combine(tl.where(valid, s_hi, mx), tl.where(valid, s_lo, 0.0), -mx, 0.0)
    w = tl.where(valid, tl.exp(dl_hi) * (1.0 + dl_lo), 0.0)
    return w / tl.sum(w, axis=0)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["tokens_per_prog"] + _FUSED_INTS)
def attn_res_npu_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, T, K, H, eps, tokens_per_prog,
                        stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_ot,
                        BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr, H_STRIDED: tl.constexpr,
                        COMPENSATED: tl.constexpr,
                        addend_ptr=None, newp_ptr=None, onw_ptr=None, stride_at=0, stride_ah=0, stride_nt=0,
                        write_idx=0, out_eps=1.0, HAS_ADDEND: tl.constexpr = False, FUSED: tl.constexpr = False,
                        SNAPSHOT: tl.constexpr = False, OUT_NORM: tl.constexpr = False, scale_ptr=None,
                        scratch_ptr=None, INPLACE_PREFIX: tl.constexpr = False, NORM_FP32_MIX: tl.constexpr = False,
                        FP8_OUT: tl.constexpr = False, FP8_FNUZ: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
                        NPU_NORM_SCALE: tl.constexpr = False, mix_ptr=None, MIX_OUT: tl.constexpr = False):
    # NPU_NORM_SCALE: the output norm's scale in the form triton-ascend lowers (_norm_scale_npu); the NPU policy
    # sets it, the CUDA "tiles" plan keeps the default (_norm_scale's div_rn, bits unchanged).
    # COMPENSATED (fp32 I/O): Ascend vector cores have no FP64, so where the CUDA kernels score in FP64 this one
    # keeps "double-float" (hi, lo) sums instead: per tile element across chunks with TwoSum (elementwise, so
    # cheap), then one TwoSum tree reduction per token. Plain FP32 sums would make the score's rounding the
    # dominant output error for fp32 I/O (see _stats). bf16/fp16 I/O: plain FP32 sums of each chunk.
    # Fused: both passes build the prefix row as new_prefix (the addend row is re-read in pass 2 rather than
    # kept: H elements do not fit the Unified Buffer next to the tile); pass 2 writes new_prefix / the snapshot
    # chunk by chunk. OUT_NORM: pass 2 writes the rounded mix and sums its squares, pass 3 re-reads this
    # program's own output row and scales it in place (extra UB: see backends/npu_plan.py, npu_block_h).
    # Serving flags (the helpers' contract above): INPLACE_PREFIX stores the new prefix back into prefix_ptr in
    # pass 2. NORM_FP32_MIX (with OUT_NORM) and FP8_OUT need a row the output cannot hold (the FP32 mix; the
    # rounded, normed row before quantisation), so pass 2 writes it to this program's FP32 row of scratch_ptr
    # ([programs, H]) instead of the output; pass 3 normalises it (OUT_NORM), and with FP8_OUT the scale needs the
    # whole final row, so a last pass quantises from scratch (pass 3 writes the normed row back there first).
    pid = tl.program_id(0)
    t_begin = pid * tokens_per_prog
    t_end = tl.minimum(t_begin + tokens_per_prog, T)
    rows = tl.arange(0, K_PAD)
    for t in range(t_begin, t_end):
        # Pass 1: per-candidate sum(v^2) and <v, w>, chunk by chunk.
        if COMPENSATED:
            ss_hi = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            ss_lo = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            d_hi = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
            d_lo = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
        else:
            ss_acc = tl.zeros([K_PAD], dtype=tl.float32)
            d_acc = tl.zeros([K_PAD], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            hmask = cols < H
            if FUSED:
                x, newp = _load_npu_tile_fused(prefix_ptr, blocks_ptr, addend_ptr, t, K, rows, cols, hmask, stride_pt,
                                               stride_ph, stride_bt, stride_bc, stride_bh, stride_at, stride_ah, VEC,
                                               H_STRIDED, HAS_ADDEND)
            else:
                x = _load_npu_tile(prefix_ptr, blocks_ptr, t, K, rows, cols, hmask, stride_pt, stride_ph, stride_bt,
                                   stride_bc, stride_bh, VEC, H_STRIDED)
            w = _load_folded_weight(nw_ptr, pw_ptr, cols, hmask)
            if COMPENSATED:
                ss_hi, ss_lo = _two_sum_combine(ss_hi, ss_lo, x * x, 0.0)
                d_hi, d_lo = _two_sum_combine(d_hi, d_lo, x * w[None, :], 0.0)
            else:
                ss_acc += tl.sum(x * x, axis=1)
                d_acc += tl.sum(x * w[None, :], axis=1)
        if COMPENSATED:
            ss_hi, ss_lo = tl.reduce((ss_hi, ss_lo), 1, _two_sum_combine)
            d_hi, d_lo = tl.reduce((d_hi, d_lo), 1, _two_sum_combine)
            ss_hi, ss_lo = _fast_two_sum(ss_hi, ss_lo)
            d_hi, d_lo = _fast_two_sum(d_hi, d_lo)
            p = _df_softmax_weights(ss_hi, ss_lo, d_hi, d_lo, rows <= K, H, eps)
        else:
            # Plain sqrt / division: the Ascend vector unit's are IEEE-accurate in FP32 (no approximate rsqrt).
            s = tl.where(rows <= K, d_acc / tl.sqrt(ss_acc / H + eps), -float("inf"))
            p = tl.exp(s - tl.max(s, axis=0))
            p = p / tl.sum(p, axis=0)
        # Pass 2: re-read each chunk and write the mix.
        if FUSED:
            ss_mix = 0.0
            fp8_scale = tl.full([], 0.0, tl.float32)
            if (OUT_NORM and NORM_FP32_MIX) or FP8_OUT:
                scratch_row = scratch_ptr + tl.cast(pid, tl.int64) * H
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                hmask = cols < H
                x, newp = _load_npu_tile_fused(prefix_ptr, blocks_ptr, addend_ptr, t, K, rows, cols, hmask,
                                               stride_pt, stride_ph, stride_bt, stride_bc, stride_bh, stride_at,
                                               stride_ah, VEC, H_STRIDED, HAS_ADDEND)
                _store_updated_prefix(newp_ptr, prefix_ptr, blocks_ptr, t, cols, hmask, newp, stride_nt, stride_pt,
                                      stride_ph, stride_bt, stride_bc, stride_bh, write_idx, VEC, H_STRIDED,
                                      HAS_ADDEND, SNAPSHOT, INPLACE_PREFIX)
                # K = 0: the mix IS new_prefix (attn_res's exact copy, -0.0 included).
                mix = tl.where(K == 0, newp.to(tl.float32), tl.sum(p[:, None] * x, axis=0))
                # MIX_OUT: this chunk of the rounded mix, complete here (the norm's scale needs the whole row).
                _store_mix(mix_ptr, t, cols, hmask, mix, stride_ot, VEC, MIX_OUT)
                if OUT_NORM:
                    mix = _norm_input(mix, hmask, prefix_ptr, NORM_FP32_MIX)
                    ss_mix += tl.sum(mix * mix, axis=0)
                elif FP8_OUT:
                    mix = tl.where(hmask, _round_mix(mix, prefix_ptr), 0.0)
                    fp8_scale = tl.maximum(fp8_scale, _fp8_scale_part(mix, hmask, FP8_MAX))
                if (OUT_NORM and NORM_FP32_MIX) or FP8_OUT:
                    tl.store(scratch_row + cols, mix, mask=hmask)
                else:
                    _store_out(out_ptr, t, cols, hmask, mix, stride_ot, VEC)
            if OUT_NORM:
                # Pass 3: this program's own row, written just above, normalised.
                tl.debug_barrier()
                if NPU_NORM_SCALE:
                    scale = _norm_scale_npu(ss_mix, H, out_eps)
                else:
                    scale = _norm_scale(ss_mix, H, out_eps)
                for h0 in range(0, H, BLOCK_H):
                    cols = h0 + tl.arange(0, BLOCK_H)
                    hmask = cols < H
                    if (OUT_NORM and NORM_FP32_MIX) or FP8_OUT:
                        y = tl.load(scratch_row + cols, mask=hmask, other=0.0)
                    else:
                        y = tl.load(out_ptr + tl.cast(t, tl.int64) * (stride_ot * VEC) + cols, mask=hmask,
                                    other=0.0).to(tl.float32)
                    y = _apply_out_norm(y, scale, onw_ptr, cols, hmask)
                    if FP8_OUT:
                        y = tl.where(hmask, _round_mix(y, prefix_ptr), 0.0)
                        fp8_scale = tl.maximum(fp8_scale, _fp8_scale_part(y, hmask, FP8_MAX))
                        tl.store(scratch_row + cols, y, mask=hmask)
                    else:
                        _store_out(out_ptr, t, cols, hmask, y, stride_ot, VEC)
            if FP8_OUT:
                # Last pass: the row (rounded to the model dtype) quantised with the whole row's scale.
                tl.debug_barrier()
                for h0 in range(0, H, BLOCK_H):
                    cols = h0 + tl.arange(0, BLOCK_H)
                    hmask = cols < H
                    y = tl.load(scratch_row + cols, mask=hmask, other=0.0)
                    _store_out(out_ptr, t, cols, hmask, _fp8_bits(y, fp8_scale, FP8_MAX, FP8_FNUZ), stride_ot, VEC)
                tl.store(scale_ptr + t, fp8_scale)
        else:
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                hmask = cols < H
                x = _load_npu_tile(prefix_ptr, blocks_ptr, t, K, rows, cols, hmask, stride_pt, stride_ph, stride_bt,
                                   stride_bc, stride_bh, VEC, H_STRIDED)
                _store_out(out_ptr, t, cols, hmask, tl.sum(p[:, None] * x, axis=0), stride_ot, VEC)


# --------------------------------------------------------------------------------------------------------------
# fused_attn_res.full with mix=False: the add and the snapshot only (a pipeline-parallel boundary), CUDA and Ascend.
# --------------------------------------------------------------------------------------------------------------
_ADD_SNAPSHOT_INTS = ["T", "H", "tokens_per_prog", "stride_pt", "stride_ph", "stride_bt", "stride_bc", "stride_bh",
                      "stride_at", "stride_ah", "stride_nt", "write_idx"]


@triton.jit(do_not_specialize=_ADD_SNAPSHOT_INTS)
def attn_res_add_snapshot_kernel(prefix_ptr, blocks_ptr, T, H, tokens_per_prog, stride_pt, stride_ph, stride_bt,
                                 stride_bc, stride_bh, BLOCK: tl.constexpr, VEC: tl.constexpr,
                                 H_STRIDED: tl.constexpr, addend_ptr=None, newp_ptr=None, stride_at=0, stride_ah=0,
                                 stride_nt=0, write_idx=0, HAS_ADDEND: tl.constexpr = False,
                                 STORE_PREFIX: tl.constexpr = False, SNAPSHOT: tl.constexpr = False):
    # Program pid owns tokens [pid * tokens_per_prog, (pid + 1) * tokens_per_prog) (CUDA: one token each; Ascend: a
    # vector core's contiguous range) and walks each row in BLOCK-wide pieces: the new prefix round(prefix + addend)
    # (_add_addend: the fused kernels' add, bit for bit), or the prefix itself, into newp_ptr (contiguous rows at
    # stride_nt) with STORE_PREFIX and into blocks[t, write_idx] with SNAPSHOT. Nothing else is read or written.
    pid = tl.program_id(0)
    t_begin = pid * tokens_per_prog
    t_end = tl.minimum(t_begin + tokens_per_prog, T)
    for t in range(t_begin, t_end):
        for h0 in range(0, H, BLOCK):
            cols = h0 + tl.arange(0, BLOCK)
            mask = cols < H
            v = tl.load(_prefix_row_ptrs(prefix_ptr, t, cols, stride_pt, stride_ph, VEC, H_STRIDED), mask=mask,
                        other=0.0)
            if HAS_ADDEND:
                v = _add_addend(v, addend_ptr, t, cols, mask, stride_at, stride_ah, VEC, H_STRIDED)
            if STORE_PREFIX:
                _store_out(newp_ptr, t, cols, mask, v, stride_nt, VEC)
            if SNAPSHOT:
                _store_snapshot(blocks_ptr, t, cols, mask, v, stride_bt, stride_bc, stride_bh, write_idx, VEC,
                                H_STRIDED)
