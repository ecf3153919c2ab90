"""Graph-replay timings of one call after different preludes: does a measurement depend on what ran before it?

The main job times each (layout, T, K) cell once; at a few small-T cells its figure has come out up to 1 us over
the same call timed again later in the same process (docs/benchmarks.md, "Plain mix": T = 128, K = 8). This probe
times a few decode-size plain calls five times in a row after each of three preludes: nothing (the previous
measurement), one second with the GPU idle (as when the host builds a shape's buffers or compiles a variant), and
the heaviest call of the grid (T = 16384, K = 8); each with ``Timer.graph`` without and with its settle rule (one
second of idle before a light call that follows a heavy one: ``Timer._settle``). The run of 40d8f8b compared
untimed replays before the timed ones instead (``warm100``), which did not remove the effect. Usage, on the GPU machine:
python tools/timing_probe.py [--out DIR]; prints one line per (method, prelude, shape), writes timing_probe.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops.bench import common  # noqa: E402
from k3_ops.bench.timing import Timer  # noqa: E402

SHAPES = [("token", 1, 1), ("token", 128, 8), ("block", 128, 8), ("token", 128, 5), ("token", 256, 8)]
REPEATS = 5


def sm_clock_reader():
    """A function returning the SM clock in MHz now, through NVML (microseconds, in process: a subprocess would
    itself leave the GPU idle), or None where NVML is absent. Read only: the card's settings are left alone."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:  # noqa: BLE001 - no NVML, no clock column
        return lambda: None


def main() -> None:
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda")
    ops = common.k3_ops_ops()
    H, cap = 7168, 9
    problems = {layout: common.Problem(16384, cap, H, torch.bfloat16, device, layout) for layout in ("token", "block")}
    for p in problems.values():
        p.poison(8)  # slots >= 8 NaN: every shape here reads K <= 8
    heavy = partial(ops.attn_res, *problems["token"].attn_res_args(16384, 8))
    sm_clock_mhz = sm_clock_reader()
    rows = []
    with torch.inference_mode():
        for method, settle_s in (("no_settle", 0.0), ("settle", Timer(device).settle_s)):
            timer = Timer(device, rep_ms=20.0, settle_s=settle_s)
            for prelude in ("none", "idle_1s", "heavy"):
                for layout, T, K in SHAPES:
                    call = partial(ops.attn_res, *problems[layout].attn_res_args(T, K))
                    call()
                    if prelude == "idle_1s":
                        torch.cuda.synchronize()
                        time.sleep(1.0)
                    elif prelude == "heavy":
                        timer.graph(heavy)
                    clock = sm_clock_mhz()
                    times = [timer.graph(call) for _ in range(REPEATS)]
                    row = {"method": method, "settle_s": settle_s, "prelude": prelude, "layout": layout, "T": T,
                           "K": K, "us": times, "sm_clock_before_mhz": clock, "sm_clock_after_mhz": sm_clock_mhz()}
                    rows.append(row)
                    clocks = f"{clock} / {row['sm_clock_after_mhz']}"
                    print(f"{method:9s} {prelude:8s} {layout}-major T={T:4d} K={K}: "
                          + " ".join(f"{t:.2f}" for t in times) + f"  (SM clock before / after: {clocks} MHz)",
                          flush=True)
    env = common.environment(device)
    with open(os.path.join(out_dir, "timing_probe.json"), "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
