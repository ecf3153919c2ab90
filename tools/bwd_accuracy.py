"""The backward accuracy contract for candidate launch configurations, before one of them becomes the default.

For each ``BackwardConfig`` (JSON ``{"name": {knobs}}`` or ``@file``, as ``python -m k3_ops.bench train
--bwd-configs``) and each shape below, runs the CUDA policy's backward and prints, per output, kernel error /
eager-FP32 error against the float64 truth (max-abs and mean-abs; the contract is <= 1.25 for both,
tests/test_backward_kernels.py). Large T matters here: a program accumulates dw over T / (SMs x programs_per_sm)
tokens, so FP32 accumulation would show its error growth only at serving-size T. Usage (on a GPU):
    python tools/bwd_accuracy.py '{"fp32": {"acc64": false}}' [--json out.json]
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops import reference  # noqa: E402
from k3_ops.backends import cuda  # noqa: E402

# (T, K, capacity, H, dtype): serving-size T at the K3 hidden size, both K extremes, and an fp32 case.
SHAPES = [(16384, 8, 8, 7168, torch.bfloat16), (16384, 1, 8, 7168, torch.bfloat16),
          (4096, 5, 8, 7168, torch.float32), (300, 3, 4, 1000, torch.float16)]
OUTPUTS = ("grad_prefix_sum", "grad_block_residual", "grad_weight")


def error_stats(actual: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """(max-abs, mean-abs) error in float64 on the tensors' device (k3_ops.testing.error_stats works on the CPU,
    far too slow for [16384, 8, 7168])."""
    d = (actual.double() - truth).abs()
    return d.max().item(), d.mean().item()


def inputs(T: int, K: int, C: int, H: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """Random inputs as the tests draw them (NaN past K, per-block scales, score spread ~ N(0, 2^2))."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(T, C, H, generator=g) * torch.tensor([0.5 + 0.25 * i for i in range(C)]).view(1, C, 1)
    blocks[:, K:] = float("nan")
    prefix = torch.randn(T, H, generator=g) * 1.5
    nw = 1.0 + 0.1 * torch.randn(H, generator=g)
    pw = torch.randn(1, H, generator=g) * (2.0 / math.sqrt(H))
    gy = torch.randn(T, H, generator=g)
    return (gy.to(device, dtype), prefix.to(device, dtype), blocks.to(device, dtype), nw.to(device), pw.to(device),
            K, 1e-6)


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "{}"
    text = Path(spec[1:]).read_text() if spec.startswith("@") else spec
    configs = {"default": None, **{n: cuda.BackwardConfig(**kw) for n, kw in json.loads(text).items()}}
    device = torch.device("cuda")
    result, worst = [], {}
    for T, K, C, H, dtype in SHAPES:
        args = inputs(T, K, C, H, dtype, device)
        eager = reference.attn_res_backward_reference(*args, [True, True, True])
        truth = reference.attn_res_backward_truth(*args)
        e_err = [error_stats(e[:, :K] if i == 1 else e, t[:, :K] if i == 1 else t)
                 for i, (e, t) in enumerate(zip(eager, truth))]
        for name, cfg in configs.items():
            outs = cuda.attn_res_backward(*args, [True, True, True], config=cfg)
            row = {"config": name, "T": T, "K": K, "H": H, "dtype": str(dtype).removeprefix("torch.")}
            for i, (o, t, e) in enumerate(zip(outs, truth, e_err)):
                k = error_stats(o[:, :K] if i == 1 else o, t[:, :K] if i == 1 else t)
                ratios = (k[0] / max(e[0], 1e-30), k[1] / max(e[1], 1e-30))
                row[OUTPUTS[i]] = ratios
                worst[name] = max(worst.get(name, 0.0), *ratios)
            result.append(row)
            print(f"{name:24s} T={T:5d} K={K} H={H} {row['dtype']:8s} " + "  ".join(
                f"{o}: {row[o][0]:.3f}/{row[o][1]:.3f}" for o in OUTPUTS), flush=True)
        del eager, truth
        torch.cuda.empty_cache()
    for name, w in worst.items():
        print(f"# {name}: worst kernel/eager error ratio {w:.3f} ({'meets' if w <= 1.25 else 'BREAKS'} the 1.25x "
              "contract)")
    if "--json" in argv:
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(result, indent=1))
    return 0 if all(w <= 1.25 for w in worst.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
