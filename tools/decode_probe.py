"""Where the decode-size plain mix loses its time: the launch table's kernel beside a one-tile kernel and the
bench's floor kernel, in one run (H200 data in docs/benchmarks.md, "Where the remaining gap goes").

The one-tile kernel (here only, not a library path): one program per token holding all K + 1 candidates in one
[ROWS, BLOCK_H] tile (the prefix in row K), the folded weight loaded with them, both statistics of every row in
ONE two-operand reduction, the softmax over the tile's rows in registers and the mix summed over them: one
cross-warp reduction round per call, where the table's per-token kernel runs its tile loop and then the prefix
candidate's own statistics. Variants: 8 or 16 warps, and the folded weight loaded before ``gdc_wait`` (what a
kernel may do only where no kernel just before it writes the weights: serving, not a training step). The floor
kernel (``k3_ops.bench.floor``) is timed with its own geometry and with one program per token at every T.
Each variant's error against the float64 truth is printed beside the eager FP32 formula's (the 1.25x contract).

Usage, on the GPU machine: python tools/decode_probe.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops import reference  # noqa: E402
from k3_ops.backends.cuda import pdl_enabled  # noqa: E402
from k3_ops.bench import floor, mix  # noqa: E402
from k3_ops.bench.common import Ops, Options, k3_ops_ops  # noqa: E402
from k3_ops.kernels.attn_res_fwd import gdc_launch_dependents_if, gdc_wait_if  # noqa: E402
from k3_ops.testing import error_stats  # noqa: E402


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _one_tile_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, K, H, eps, stride_pt, stride_bt, stride_bc,
                     ROWS: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr, EARLY_W: tl.constexpr):
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
    x = tl.where(r[:, None] == K, v[None, :], x).to(tl.float32)
    ss, d = tl.reduce((x * x, x * w[None, :]), 1, _add2)
    s = tl.where(r <= K, tl.div_rn(1.0, tl.sqrt_rn(ss / H + eps)) * d, -float("inf"))
    p = tl.exp(s - tl.max(s, axis=0))
    y = tl.sum(p[:, None] * x, axis=0) / tl.sum(p, axis=0)
    tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=hmask)


def one_tile(warps: int, early_w: bool = False):
    def call(prefix, blocks, nw, pw, K, eps):
        T, H = prefix.shape
        out = torch.empty_like(prefix)
        extra = {"launch_pdl": True} if pdl_enabled(prefix.device) else {}
        _one_tile_kernel[(T,)](prefix, blocks, nw, pw, out, K, H, eps, prefix.stride(0), blocks.stride(0),
                               blocks.stride(1), ROWS=triton.next_power_of_2(K + 1),
                               BLOCK_H=triton.next_power_of_2(H), USE_PDL=bool(extra), EARLY_W=early_w,
                               num_warps=warps, num_stages=1, **extra)
        return out
    return call


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
    "tile_w8": Ops(attn_res=one_tile(8)),
    "tile_w16": Ops(attn_res=one_tile(16)),
    "tile_w8_early_w": Ops(attn_res=one_tile(8, early_w=True)),
    "floor": Ops(attn_res=floor.mix_floor),
    "floor_1prog": Ops(attn_res=floor_one_program),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
BLOCKS = [1, 2, 3, 4]


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
        rows.append(row)
        print("accuracy", row, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    acc = accuracy(device)
    result = mix.run(Options(refs=False, rep_ms=10, layouts=["token"], tokens=TOKENS, blocks=BLOCKS), ops=VARIANTS)
    result["accuracy"] = acc
    with open(os.path.join(args.out, "decode_probe_mix.json"), "w") as f:
        json.dump(result, f, default=str)
    for row in result["rows"]:
        print(f"T={row['T']} K={row['K']} " + " ".join(f"{k[3:]}={v:.2f}" for k, v in row.items()
                                                         if k.startswith("us:")), flush=True)


if __name__ == "__main__":
    main()
