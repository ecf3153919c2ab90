"""The stream floor's forms at the fused call's bandwidth-bound shapes, beside the op and the tile floor, one run.

``k3_ops.bench.floor``'s stream geometry with 512, 1024 or 2048 columns per program and 2, 4 or 8 warps (where
every warp spans whole row pieces: columns >= 256 x warps), T = 64..16384, K = 1, 2, 4, 8, graph replay, bf16,
H = 7168, NaN in unused slots. Usage, on the GPU machine: python tools/floor_forms.py [--out DIR]; prints one line
per shape (us, and of copy bandwidth in brackets) and writes floor_forms.json.
"""
from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops.bench import common, floor  # noqa: E402
from k3_ops.bench.timing import Timer  # noqa: E402

FORMS = [(block, warps) for block in (512, 1024, 2048) for warps in (2, 4, 8) if block >= 256 * warps]


def main() -> None:
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    os.makedirs(out_dir, exist_ok=True)
    timer = Timer("cuda", rep_ms=10.0)
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    ops = common.k3_ops_ops()
    H, cap = 7168, 9
    rows = []
    problem = common.Problem(16384, cap, H, torch.bfloat16, torch.device("cuda"), "token")
    default = (floor.STREAM_BLOCK, floor.STREAM_WARPS)
    with torch.inference_mode():
        for K in (1, 2, 4, 8):
            problem.poison(K)
            write = K if K < cap else -1
            for T in (64, 256, 512, 1024, 16384):
                args = problem.fused_args(T, K, write)
                nbytes = common.bytes_moved(T, H, 2, K + 2, 2 + (write >= 0))
                row = {"T": T, "K": K, "bytes": nbytes, "us:k3_ops": timer.primary(partial(ops.fused, *args)),
                       "us:tile": timer.primary(partial(floor.fused_floor, *args))}
                for block, warps in FORMS:
                    floor.STREAM_BLOCK, floor.STREAM_WARPS = block, warps
                    row[f"us:stream_c{block}_w{warps}"] = timer.primary(
                        partial(floor.fused_floor, *args, geometry="stream"))
                floor.STREAM_BLOCK, floor.STREAM_WARPS = default
                rows.append(row)
                print(f"T={T} K={K} " + " ".join(f"{k[3:]}={v:.2f}({nbytes / (v * 1e-6) / bw:.2f})"
                                                  for k, v in row.items() if k.startswith("us:")), flush=True)
            problem.restore(K)
    result = {"environment": common.environment(torch.device("cuda")), "limits": limits,
              "default": {"block": default[0], "warps": default[1]}, "rows": rows}
    with open(os.path.join(out_dir, "floor_forms.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
