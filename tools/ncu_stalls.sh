#!/usr/bin/env bash
# Issue and stall profile of one backward launch per BackwardConfig given as JSON arguments
# (tools/profile_bwd.py): issue-slot use, instructions, and the stall reasons that cost > 0.3 cycles per issued
# instruction, per kernel. On a GPU.
OUT=${OUT:-gpu_out}
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,gpu__time_duration.sum,smsp__warps_active.avg.per_cycle_active'
for cfg in "$@"; do
  echo "== $cfg"
  K3_BWD_CONFIG="$cfg" ncu --clock-control none --profile-from-start off -k regex:"attn_res_bwd_(rows|apply|stats)" \
    --metrics "$M" --csv --page raw ${PY:-python3} tools/profile_bwd.py >"$OUT/ncu_raw.csv" 2>"$OUT/ncu_err.txt" \
    || { tail -5 "$OUT/ncu_err.txt"; continue; }
  python3 - "$OUT/ncu_raw.csv" <<'PYEOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next(r for r in rows if r and r[0] == "ID")
for r in rows:
    if len(r) != len(hdr) or not r[0].isdigit():
        continue
    d = dict(zip(hdr, r))
    num = lambda k: float(d[k].replace(",", "")) if d.get(k, "").replace(",", "").replace(".", "").isdigit() else 0.0
    stalls = sorted(((num(k), k.split("stalled_")[1].split("_per_issue")[0]) for k in hdr if "issue_stalled_" in k),
                    reverse=True)
    print(f"  {d['Kernel Name'].split('(')[0].replace('attn_res_bwd_', '')[:14]:14s} us={num('gpu__time_duration.sum') / 1e3:.0f} "
          f"issue%={num('smsp__issue_active.avg.pct_of_peak_sustained_active'):.1f} "
          f"inst={num('sm__inst_executed.sum') / 1e6:.0f}M warps/smsp={num('smsp__warps_active.avg.per_cycle_active'):.2f} | "
          + " ".join(f"{n}={v:.2f}" for v, n in stalls if v > 0.3))
PYEOF
  cat "$OUT/ncu_raw.csv" >>"$OUT/ncu_stalls_all.csv"
done
