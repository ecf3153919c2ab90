"""Where the fused call's time over the plain op goes: the serving call with one part left out at a time, in one run
(H200 data in docs/benchmarks.md, "Where the remaining gap goes").

Every row is the bench's fused section (graph replay, bf16, H = 7168, capacity 9, NaN in unused slots) on the
launch table's plans, the call varied, not the kernel: ``full`` (addend, snapshot into slot K when K < capacity,
output norm: the bench's call), ``no_norm`` (no output norm), ``no_snapshot`` (block_write_idx -1), ``no_addend``
(no add: new_prefix is a copy of prefix_sum), ``bare`` (none of the three: the fused kernel's mix and its
new_prefix store) and ``plain`` (``attn_res``: the plain instantiation, no new_prefix). The difference of two
rows is what that part costs where the others stay; the kernel (the cluster kernel, the one-tile plan, the rows
kernel) is the table's at each shape, the same in every row of it.

Usage, on the GPU machine:
  python tools/fused_parts.py [--out DIR] [--weight-dtype fp32] [--tokens 1,8,...] [--blocks 1,2,...]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from plan_variants import options, save  # noqa: E402  (tools/, this script's directory)

import k3_ops  # noqa: E402,F401  (registers the ops)
from k3_ops.bench import fused  # noqa: E402
from k3_ops.bench.common import Ops  # noqa: E402

_FUSED = torch.ops.kimi_k3.fused_attn_res.default
_PLAIN = torch.ops.kimi_k3.attn_res.default


def part(addend: bool = True, snapshot: bool = True, norm: bool = True) -> Ops:
    """The bench's fused call with the parts named False left out."""

    def call(prefix, add, blocks, nw, pw, K, eps, write=-1, onw=None, oeps=None):
        return _FUSED(prefix, add if addend else None, blocks, nw, pw, K, eps, write if snapshot else -1,
                      onw if norm else None, oeps if norm else None)

    return Ops(fused=call)


def plain() -> Ops:
    def call(prefix, add, blocks, nw, pw, K, eps, write=-1, onw=None, oeps=None):
        return _PLAIN(prefix, blocks, nw, pw, K, eps), prefix

    return Ops(fused=call)


PARTS = {"full": part(), "no_norm": part(norm=False), "no_snapshot": part(snapshot=False),
         "no_addend": part(addend=False), "bare": part(False, False, False), "plain": plain()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".", help="directory for fused_parts[_<weight dtype>].json")
    p.add_argument("--weight-dtype", default=None, help="the weights' dtype (default: the I/O dtype, bf16)")
    p.add_argument("--tokens", default="1,8,64,256", help="comma-separated T")
    p.add_argument("--blocks", default="1,2,4,8", help="comma-separated K")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    grid = dict(tokens=[int(t) for t in args.tokens.split(",")], blocks=[int(k) for k in args.blocks.split(",")])
    if args.weight_dtype:
        grid["weight_dtype"] = args.weight_dtype
    result = fused.run(options(**grid), ops=PARTS)
    suffix = f"_{args.weight_dtype}" if args.weight_dtype else ""
    save(result, os.path.join(args.out, f"fused_parts{suffix}.json"), "fused_parts")


if __name__ == "__main__":
    main()
