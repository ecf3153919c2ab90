"""Hardware counters of one backward launch per BackwardConfig, one summary line per kernel (on a GPU with ncu).

Runs ``ncu`` on tools/profile_bwd.py (T = K3_BWD_T, K = K3_BWD_K; default 4096, 8; bf16, H = 7168) once per
config given as JSON (``'{}'`` is the default config) and prints the chosen metrics per kernel:
    memory: time, DRAM bytes read / written, L2 and L1 hit rates, registers, grid (is the kernel single-read?)
    stalls: time, issue-slot use, warp instructions, warps per scheduler, and the stall reasons costing more than
            0.3 cycles per issued instruction (is it issue- or latency-bound, and on what?)
The raw CSV of every run is appended to $OUT/ncu_<mode>.csv. Usage:
    python tools/ncu_bwd.py memory '{}' '{"kernel": "rows"}'
"""
from __future__ import annotations

import csv
import io
import os
import subprocess
import sys

MODES = {
    "memory": ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
               "lts__t_sector_hit_rate.pct", "l1tex__t_sector_hit_rate.pct", "launch__registers_per_thread",
               "launch__grid_size", "launch__block_size"],
    "stalls": ["gpu__time_duration.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
               "sm__inst_executed.sum", "smsp__warps_active.avg.per_cycle_active",
               r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"],
}


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(raw_csv: str, mode: str) -> list[str]:
    rows = list(csv.reader(io.StringIO(raw_csv)))
    header = next(r for r in rows if r and r[0] == "ID")
    lines = []
    for r in rows:
        if len(r) != len(header) or not r[0].isdigit():
            continue  # the units row and ncu's own messages
        d = dict(zip(header, r))
        name = d["Kernel Name"].split("(")[0].replace("attn_res_bwd_", "")
        fields = [f"us={number(d['gpu__time_duration.sum']) / 1e3:.1f}"]
        if mode == "memory":
            fields += [f"dram_read_MB={number(d['dram__bytes_read.sum']) / 1e6:.1f}",
                       f"dram_write_MB={number(d['dram__bytes_write.sum']) / 1e6:.1f}",
                       f"L2_hit%={number(d['lts__t_sector_hit_rate.pct']):.1f}",
                       f"L1_hit%={number(d['l1tex__t_sector_hit_rate.pct']):.1f}",
                       f"regs={d['launch__registers_per_thread']}",
                       f"grid={d['launch__grid_size']}x{d['launch__block_size']}"]
        else:
            stalls = sorted(((number(d[k]), k.split("stalled_")[1].split("_per_issue")[0])
                             for k in header if "issue_stalled_" in k), reverse=True)
            fields += [f"issue%={number(d['smsp__issue_active.avg.pct_of_peak_sustained_active']):.1f}",
                       f"inst_M={number(d['sm__inst_executed.sum']) / 1e6:.0f}",
                       f"warps/scheduler={number(d['smsp__warps_active.avg.per_cycle_active']):.2f}",
                       "stalls/issue: " + " ".join(f"{n}={v:.2f}" for v, n in stalls if v > 0.3)]
        lines.append(f"  {name:14s} " + " ".join(fields))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in MODES:
        print(__doc__)
        return 2
    mode, configs = argv[0], argv[1:]
    out = os.environ.get("OUT", "gpu_out")
    os.makedirs(out, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    for cfg in configs:
        print(f"== {cfg}", flush=True)
        cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "-k", "regex:attn_res_bwd",
               "--metrics", ",".join(MODES[mode]), "--csv", "--page", "raw",
               sys.executable, os.path.join(here, "profile_bwd.py")]
        run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, K3_BWD_CONFIG=cfg))
        if run.returncode != 0:
            print("\n".join((run.stdout + run.stderr).splitlines()[-5:]))
            continue
        with open(os.path.join(out, f"ncu_{mode}.csv"), "a") as f:
            f.write(run.stdout)
        print("\n".join(summarize(run.stdout, mode)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
