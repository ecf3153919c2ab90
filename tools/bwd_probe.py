"""Backward launch configurations timed side by side, with each kernel's share of the time (H200 tuning aid).

For each shape (T, K) and each ``BackwardConfig`` (JSON ``{"name": {knobs}}`` or ``@file``, as ``python -m
k3_ops.bench train --bwd-configs``; "default" is always included): the whole backward op timed like that section
(plain launches, L2 flushed between calls, median), its fraction of copy bandwidth (the backward's own bytes, see
``k3_ops.bench.train.backward_bytes``), and the device time per kernel from ``torch.profiler`` (so the two kernels of
"stats_apply" show their shares). A config may also set "REDUCE_BLOCK_P" / "REDUCE_BLOCK_H" (the weight-gradient
reduction's tile, module constants of k3_ops.backends._backward, set for that config's timings only). Usage (on a GPU):
    python tools/bwd_probe.py '{"split": {"kernel": "stats_apply"}}' [--tokens 4096,16384] [--blocks 1,8] \
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops.backends import _backward, cuda  # noqa: E402
from k3_ops.bench import Timer, train  # noqa: E402

REDUCE_KNOBS = ("REDUCE_BLOCK_P", "REDUCE_BLOCK_H")


def kernel_times(fn, iters: int = 10) -> dict[str, float]:
    """Mean device microseconds per call of each kernel launched by fn (torch.profiler, after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time / iters
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="?", default="{}")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--blocks", default="1,8")
    ap.add_argument("--capacity", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rep", type=float, default=20.0, help="milliseconds per measurement")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mask", default="111", help="output_mask as three digits (e.g. 001: weight gradient only, "
                    "no dv stores: how much of the time the stores take)")
    a = ap.parse_args(argv)
    text = Path(a.configs[1:]).read_text() if a.configs.startswith("@") else a.configs
    configs, reduce_tiles = {"default": None}, {}
    for n, kw in json.loads(text).items():
        reduce_tiles[n] = {k: kw.pop(k) for k in REDUCE_KNOBS if k in kw}
        configs[n] = cuda.BackwardConfig(**kw)
    defaults = {k: getattr(_backward, k) for k in REDUCE_KNOBS}
    mask = [c == "1" for c in a.mask]
    dev = torch.device("cuda")
    timer = Timer(dev, rep_ms=a.rep)
    bw = timer.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s  {torch.cuda.get_device_name()}  torch {torch.__version__}")
    H, C, dtype = a.hidden, a.capacity, torch.bfloat16
    results = []
    for T in (int(t) for t in a.tokens.split(",")):
        for K in (int(k) for k in a.blocks.split(",")):
            g = torch.Generator(device=dev).manual_seed(0)
            blocks = torch.randn(T, C, H, device=dev, dtype=dtype, generator=g)
            prefix = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
            gy = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
            nw = 1 + 0.1 * torch.randn(H, device=dev, generator=g)
            pw = torch.randn(1, H, device=dev, generator=g) / H ** 0.5
            nbytes = train.backward_bytes(T, K, C, H, 2)
            ref_out = None
            for name, cfg in configs.items():
                for k, v in {**defaults, **reduce_tiles.get(name, {})}.items():
                    setattr(_backward, k, v)

                def fn(cfg=cfg, args=(gy, prefix, blocks, nw, pw, K)):
                    return cuda.attn_res_backward(*args, 1e-6, mask, config=cfg)
                # Same gradients as the default config (to within its rounding): a wrong variant is not timed.
                out = fn()
                if ref_out is None:
                    ref_out = out
                dev_max = max((float((o.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30))
                               for o, r in zip(out, ref_out) if o.numel()), default=0.0)
                del out
                us = timer.launch(fn)
                kt = kernel_times(fn)
                frac = nbytes / (us * 1e-6) / bw
                gpu_us = sum(kt.values())  # device time of the kernels alone (no host launch gaps)
                parts = "  ".join(f"{k.split('_kernel')[0].replace('attn_res_bwd_', '')}={v:.0f}"
                                  for k, v in kt.items())
                print(f"T={T:6d} K={K} H={H} {name:14s} {us:7.1f} us of BW {frac:.3f} | kernels {gpu_us:7.1f} us of BW "
                      f"{nbytes / (gpu_us * 1e-6) / bw:.3f} [{parts}] dev {dev_max:.1e}", flush=True)
                results.append(dict(T=T, K=K, H=H, config=name, us=us, of_bw=frac, kernels_us=kt, kernels_sum_us=gpu_us,
                                    kernels_of_bw=nbytes / (gpu_us * 1e-6) / bw, max_rel_dev_vs_default=dev_max))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_bw=bw, device=torch.cuda.get_device_name(),
                                                torch=torch.__version__, commit=os.environ.get("K3_OPS_COMMIT"),
                                                results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
