"""Where the decode-size plain mix loses its time: the launch table's kernel beside a one-tile kernel and the
bench's floor kernel, in one run (H200 data in docs/benchmarks.md, "Where the remaining gap goes").

The one-tile kernel (here only, not a library path): one program per token holding all K + 1 candidates in one
[ROWS, BLOCK_H] tile (the prefix in row K; or, "apart", a tile of the K block rows and the prefix row beside it,
two reduction rounds), the folded weight loaded with them, both statistics of every row in
ONE two-operand reduction, the softmax over the tile's rows in registers and the mix summed over them: one
cross-warp reduction round per call, where the table's per-token kernel runs its tile loop and then the prefix
candidate's own statistics. Variants: 8 or 16 warps, and the folded weight loaded before ``gdc_wait`` (what a
kernel may do only where no kernel just before it writes the weights: serving, not a training step). The fused
call (addend, new_prefix, snapshot, the output norm of the rounded mix) is the same kernel with its epilogue. The
floor kernel (``k3_ops.bench.floor``) is timed with its own geometry and, plain, with one program per token at
every T.
Each variant's error against the float64 truth is printed beside the eager FP32 formula's (the 1.25x contract).

Usage, on the GPU machine: python tools/decode_probe.py [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from plan_variants import options, output_dir, save  # noqa: E402  (tools/, this script's directory)

from k3_ops import reference  # noqa: E402
from k3_ops.backends.cuda import pdl_enabled  # noqa: E402
from k3_ops.bench import floor, fused, layer, mix  # noqa: E402
from k3_ops.bench.common import Ops, Options, k3_ops_ops  # noqa: E402
from k3_ops.kernels.attn_res_fwd import gdc_launch_dependents_if, gdc_wait_if  # noqa: E402
from k3_ops.testing import error_stats  # noqa: E402


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _one_tile_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, K, H, eps, stride_pt, stride_bt, stride_bc,
                     addend_ptr, newp_ptr, onw_ptr, write_idx, out_eps,
                     ROWS: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr, EARLY_W: tl.constexpr,
                     FUSED: tl.constexpr, PREFIX_APART: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    hmask = cols < H
    r = tl.arange(0, ROWS)
    if EARLY_W:
        w = tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32) * \
            tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    gdc_wait_if(USE_PDL)
    gdc_launch_dependents_if(USE_PDL)
    if not EARLY_W:
        w = tl.load(nw_ptr + cols, mask=hmask, other=0.0).to(tl.float32) * \
            tl.load(pw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
    x = tl.load(blocks_ptr + t * stride_bt + r[:, None] * stride_bc + cols[None, :],
                mask=(r[:, None] < K) & hmask[None, :], other=0.0)
    v = tl.load(prefix_ptr + t * stride_pt + cols, mask=hmask, other=0.0)
    if FUSED:
        g = tl.load(onw_ptr + cols, mask=hmask, other=0.0).to(tl.float32)
        a = tl.load(addend_ptr + t * H + cols, mask=hmask, other=0.0)
        v = (v.to(tl.float32) + a.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(newp_ptr + t * H + cols, v, mask=hmask)
        if write_idx >= 0:
            tl.store(blocks_ptr + t * stride_bt + write_idx * stride_bc + cols, v, mask=hmask)
    if PREFIX_APART:
        # The K block rows in the tile (ROWS >= K, no padding row for the prefix), the prefix as its own row.
        x = x.to(tl.float32)
        vf = v.to(tl.float32)
        ss, d = tl.reduce((x * x, x * w[None, :]), 1, _add2)
        ssp, dp = tl.reduce((vf * vf, vf * w), 0, _add2)
        s = tl.where(r < K, tl.div_rn(1.0, tl.sqrt_rn(ss / H + eps)) * d, -float("inf"))
        sp = tl.div_rn(1.0, tl.sqrt_rn(ssp / H + eps)) * dp
        m = tl.maximum(tl.max(s, axis=0), sp)
        p = tl.exp(s - m)
        pp = tl.exp(sp - m)
        y = (tl.sum(p[:, None] * x, axis=0) + pp * vf) / (tl.sum(p, axis=0) + pp)
    else:
        x = tl.where(r[:, None] == K, v[None, :], x).to(tl.float32)
        ss, d = tl.reduce((x * x, x * w[None, :]), 1, _add2)
        s = tl.where(r <= K, tl.div_rn(1.0, tl.sqrt_rn(ss / H + eps)) * d, -float("inf"))
        p = tl.exp(s - tl.max(s, axis=0))
        y = tl.sum(p[:, None] * x, axis=0) / tl.sum(p, axis=0)
    if FUSED:
        # The output norm of the dtype-rounded mix (round_mix=True), its rsqrt correctly rounded.
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.div_rn(1.0, tl.sqrt_rn(tl.sum(y * y, axis=0) / H + out_eps)) * g
    tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=hmask)


def _launch_one_tile(warps, early_w, apart, prefix, blocks, nw, pw, K, eps, addend=None, write_idx=-1, onw=None,
                     out_eps=None):
    T, H = prefix.shape
    out = torch.empty_like(prefix)
    fused = addend is not None
    new_prefix = torch.empty_like(prefix) if fused else out
    extra = {"launch_pdl": True} if pdl_enabled(prefix.device) else {}
    rows = triton.next_power_of_2(max(K, 1) if apart else K + 1)
    _one_tile_kernel[(T,)](prefix, blocks, nw, pw, out, K, H, eps, prefix.stride(0), blocks.stride(0),
                           blocks.stride(1), addend if fused else prefix, new_prefix, onw if fused else nw,
                           write_idx, eps if out_eps is None else out_eps, ROWS=rows,
                           BLOCK_H=triton.next_power_of_2(H), USE_PDL=bool(extra), EARLY_W=early_w, FUSED=fused,
                           PREFIX_APART=apart, num_warps=warps, num_stages=1, **extra)
    return (out, new_prefix) if fused else out


def one_tile(warps: int, early_w: bool = False, apart: bool = False) -> Ops:
    """The one-tile kernel's plain and fused calls (the fused call: addend, new_prefix, snapshot, output norm);
    ``apart``: the prefix as its own row beside a tile of the K block rows."""
    def plain(prefix, blocks, nw, pw, K, eps):
        return _launch_one_tile(warps, early_w, apart, prefix, blocks, nw, pw, K, eps)

    def fused(prefix, addend, blocks, nw, pw, K, eps, write_idx=-1, onw=None, out_eps=None):
        return _launch_one_tile(warps, early_w, apart, prefix, blocks, nw, pw, K, eps, addend, write_idx, onw,
                                out_eps)

    return Ops(attn_res=plain, fused=fused)


def floor_one_program(prefix, blocks, nw, pw, K, eps):
    """The floor kernel with one program per token at every T (the bench's splits a token over 8 at T <= 16)."""
    saved = floor.SPLIT_MAX_T
    floor.SPLIT_MAX_T = 0
    try:
        return floor.mix_floor(prefix, blocks, nw, pw, K, eps)
    finally:
        floor.SPLIT_MAX_T = saved


VARIANTS = {
    "table": k3_ops_ops(),
    "tile_w8": one_tile(8),
    "tile_w16": one_tile(16),
    "tile_w8_early_w": one_tile(8, early_w=True),
    "apart_w8": one_tile(8, apart=True),
    "apart_w16": one_tile(16, apart=True),
    "floor": Ops(attn_res=floor.mix_floor, fused=floor.fused_floor),
    "floor_1prog": Ops(attn_res=floor_one_program),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
BLOCKS = [1, 2, 3, 4]


def _layer_variant() -> Ops:
    """The table with the one-tile kernel's fused call where it won in the runs of this probe: K = 0, 1 (16 warps)
    and 3 (8 warps) at T <= 256; the plain final mix stays the table's."""
    table, w16, w8 = VARIANTS["table"], one_tile(16), one_tile(8)

    def fused_call(prefix, addend, blocks, nw, pw, K, *rest):
        T = prefix.shape[0]
        if T <= 256 and K in (0, 1):
            return w16.fused(prefix, addend, blocks, nw, pw, K, *rest)
        if T <= 256 and K == 3:
            return w8.fused(prefix, addend, blocks, nw, pw, K, *rest)
        return table.fused(prefix, addend, blocks, nw, pw, K, *rest)

    return Ops(attn_res=table.attn_res, fused=fused_call)


def accuracy(device: torch.device) -> list[dict]:
    """max / mean |error| against the float64 truth of each kernel variant and of the eager FP32 formula."""
    rows = []
    for T, K in ((1, 1), (16, 3), (77, 4), (256, 2)):
        g = torch.Generator().manual_seed(T * 31 + K)
        blocks = torch.randn(T, 9, 7168, generator=g) * torch.linspace(0.5, 2.0, 9).view(1, 9, 1)
        blocks[:, K:] = float("nan")
        args = ((torch.randn(T, 7168, generator=g) * 1.5).to(device, torch.bfloat16),
                blocks.to(device, torch.bfloat16), (1 + 0.1 * torch.randn(7168, generator=g)).to(device),
                (torch.randn(1, 7168, generator=g) * 2 / 7168**0.5).to(device), K, 1e-6)
        truth = reference.attn_res_truth(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
        row = {"T": T, "K": K}
        for name, fn in (("eager", reference.attn_res_reference), ("table", VARIANTS["table"].attn_res),
                         *((n, VARIANTS[n].attn_res) for n in VARIANTS if n.startswith("tile"))):
            e = error_stats(fn(*args), truth)
            row[name] = [e.max_abs, e.mean_abs]
        # The fused call: new_prefix against torch's add (bits), out against torch's RMSNorm of the table's mix.
        addend = torch.randn(T, 7168, generator=g).to(device, torch.bfloat16)
        onw = (1 + 0.1 * torch.randn(7168, generator=g)).to(device, torch.bfloat16)
        new_prefix = args[0] + addend
        want = torch.nn.functional.rms_norm(VARIANTS["table"].attn_res(new_prefix, *args[1:]).float(), (7168,),
                                            onw.float(), 1e-6).to(torch.bfloat16)
        for n in VARIANTS:
            if n.startswith("tile"):
                blocks_copy = args[1].clone()
                out, newp = VARIANTS[n].fused(args[0], addend, blocks_copy, *args[2:], K, onw, 1e-6)
                row[f"{n}_fused"] = [bool(torch.equal(newp, new_prefix)), bool(torch.equal(blocks_copy[:, K], newp)),
                                     (out.float() - want.float()).abs().max().item()]
        rows.append(row)
        print("accuracy", row, flush=True)
    return rows


def main() -> None:
    out = output_dir(__doc__)
    device = torch.device("cuda")
    acc = accuracy(device)
    result = mix.run(options(tokens=TOKENS, blocks=BLOCKS), ops=VARIANTS)
    result["accuracy"] = acc
    fused_ops = {n: o for n, o in VARIANTS.items() if o.fused is not None}
    fused_result = fused.run(options(tokens=TOKENS, blocks=BLOCKS), ops=fused_ops)
    layer_result = layer.run(Options(refs=False, rep_ms=10), ops={"table": VARIANTS["table"],
                                                                  "tile_k013": _layer_variant()})
    for section, res in (("mix", result), ("fused", fused_result), ("layer", layer_result)):
        save(res, os.path.join(out, f"decode_probe_{section}.json"), section)


if __name__ == "__main__":
    main()
