"""Host time of one forward + backward step of kimi_k3::attn_res (training, plain launches), and where it goes.

The train section's fwd + bwd step (``python -m k3_ops.bench train``) is host-bound at T = 4096
(docs/benchmarks.md, "Where the remaining gap goes"): this prints the step's wall time with the GPU kept busy-free
(synchronised only at the end), its device time, and a cProfile of the host side (top functions by own time), so
a per-call Python cost can be found. Usage (on a GPU):
    python tools/profile_host.py [--tokens 4096] [--blocks 1] [--iters 200] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import k3_ops  # noqa: E402,F401
from k3_ops.bench import train  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    dev, dtype, T, K, H, C = torch.device("cuda"), torch.bfloat16, a.tokens, a.blocks, a.hidden, 8
    g = torch.Generator(device=dev).manual_seed(0)
    call_args = (torch.randn(T, H, device=dev, dtype=dtype, generator=g),
                 torch.randn(T, C, H, device=dev, dtype=dtype, generator=g),
                 1 + 0.1 * torch.randn(H, device=dev, generator=g),
                 torch.randn(1, H, device=dev, generator=g) / H ** 0.5, K, 1e-6)
    gy = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
    step = train.step_fn(torch.ops.kimi_k3.attn_res.default, call_args, gy)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    # Device time of the step's kernels alone: CUDA events around a burst (the GPU queue stays full).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(a.iters):
        step()
    end.record()
    host_us = (time.perf_counter() - t0) / a.iters * 1e6
    torch.cuda.synchronize()
    device_us = start.elapsed_time(end) * 1e3 / a.iters
    print(f"T={T} K={K} H={H}: host {host_us:.1f} us per step (enqueue), device {device_us:.1f} us per step (burst)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.iters):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).sort_stats("tottime")
    stats.print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
