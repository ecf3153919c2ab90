"""Benchmark of kimi_k3::fused_attn_res against the unfused sequence (issue 6, item 7):
``python -m k3_ops.bench_fused [--out file.json]``.

Unfused = what a decoder layer runs without the fused op: torch's ``prefix + addend``, the snapshot copy into
``block_residual[:, idx]``, ``k3_ops.attn_res`` and torch's RMSNorm of its output. Fused = one
``k3_ops.fused_attn_res`` call with the same arguments. Both timed on the current device with CUDA-graph replay
(``triton.testing.do_bench_cudagraph``, as in a captured decode step) and with plain launches
(``triton.testing.do_bench``). Shapes: decode T in (1, 8, 64) and prefill T in (1024, 8192), H = 7168,
capacity 9, K in (1, 8), bf16, every call with addend, snapshot (slot K) and output norm. On a machine
without a GPU a tiny smoke configuration runs on the CPU (wall-clock, reference kernels).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

TOKENS = (1, 8, 64, 1024, 8192)
BLOCKS = (1, 8)
SMOKE = dict(tokens=(1, 3), blocks=(1, 2), hidden=64)


def _inputs(T: int, K: int, H: int, cap: int, dtype: torch.dtype, device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(T * 31 + K)
    buf = torch.full((T, cap, H), float("nan"), dtype=dtype, device=device)
    buf[:, :K] = torch.randn(T, K, H, generator=g).to(device=device, dtype=dtype)
    return dict(prefix_sum=torch.randn(T, H, generator=g).to(device=device, dtype=dtype),
                addend=torch.randn(T, H, generator=g).to(device=device, dtype=dtype), block_residual=buf,
                norm_weight=torch.randn(H, generator=g).to(device=device, dtype=dtype),
                proj_weight=torch.randn(H, generator=g).to(device=device, dtype=dtype),
                out_norm_weight=torch.randn(H, generator=g).to(device=device, dtype=dtype), K=K, eps=1e-6)


def fused_fn(a: dict):
    import k3_ops

    return lambda: k3_ops.fused_attn_res(a["prefix_sum"], a["addend"], a["block_residual"], a["norm_weight"],
                                         a["proj_weight"], a["K"], a["eps"], block_write_idx=a["K"],
                                         out_norm_weight=a["out_norm_weight"], out_norm_eps=a["eps"])


def unfused_fn(a: dict):
    import k3_ops

    H = a["prefix_sum"].size(1)

    def run():
        new_prefix = a["prefix_sum"] + a["addend"]
        a["block_residual"][:, a["K"]].copy_(new_prefix)
        mix = k3_ops.attn_res(new_prefix, a["block_residual"], a["norm_weight"], a["proj_weight"], a["K"], a["eps"])
        return torch.nn.functional.rms_norm(mix, (H,), a["out_norm_weight"], a["eps"]), new_prefix

    return run


def _time(fn, device: torch.device, graph: bool) -> float:
    """Microseconds per call (median)."""
    if device.type == "cuda":
        import triton

        fn()  # compile / allocate workspaces before capture
        torch.cuda.synchronize()
        if graph:
            return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.05 or n < 3:
        fn()
        n += 1
    return 1e6 * (time.perf_counter() - start) / n


def run(tokens, blocks, H: int, cap: int, dtype: torch.dtype, device: torch.device) -> dict:
    rows = []
    modes = ("graph", "launch") if device.type == "cuda" else ("wall",)
    with torch.inference_mode():
        for T in tokens:
            for K in blocks:
                a = _inputs(T, K, H, cap, dtype, device)
                row = dict(T=T, K=K, H=H, us={})
                for mode in modes:
                    for name, make in (("fused", fused_fn), ("unfused", unfused_fn)):
                        row["us"][f"{name}_{mode}"] = _time(make(a), device, mode == "graph")
                rows.append(row)
    return dict(device=str(device), dtype=str(dtype), capacity=cap, torch=torch.__version__, rows=rows)


def print_table(result: dict) -> None:
    keys = list(result["rows"][0]["us"]) if result["rows"] else []
    print(f"{'T':>6} {'K':>3} " + " ".join(f"{k + ' us':>16}" for k in keys) + "   speedup")
    for r in result["rows"]:
        us = r["us"]
        mode = keys[0].split("_", 1)[1] if keys else ""
        speed = us[f"unfused_{mode}"] / us[f"fused_{mode}"]
        print(f"{r['T']:>6} {r['K']:>3} " + " ".join(f"{us[k]:>16.2f}" for k in keys) + f"   {speed:6.2f}x")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        result = run(TOKENS, BLOCKS, 7168, 9, torch.bfloat16, device)
    else:
        result = run(SMOKE["tokens"], SMOKE["blocks"], SMOKE["hidden"], 3, torch.bfloat16, device)
    print_table(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
