#!/usr/bin/env bash
# Memory-hierarchy counters (DRAM bytes, L1 / L2 hit rates, occupancy) of one backward launch per BackwardConfig
# given as JSON arguments (tools/profile_bwd.py; T = K3_BWD_T, K = K3_BWD_K, default 4096, 8). One summary line per kernel. On a GPU.
OUT=${OUT:-gpu_out}
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,l1tex__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers
for cfg in "$@"; do
  echo "== $cfg"
  K3_BWD_CONFIG="$cfg" ncu --clock-control none --profile-from-start off -k regex:attn_res_bwd --metrics $M \
    --csv --page raw ${PY:-python3} tools/profile_bwd.py >"$OUT/ncu_raw.csv" 2>"$OUT/ncu_err.txt" || { tail -5 "$OUT/ncu_err.txt"; continue; }
  python3 - "$OUT/ncu_raw.csv" <<'PYEOF'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head, units, data = rows[0], rows[1], rows[2:]
for r in data:
    d = dict(zip(head, r))
    name = d["Kernel Name"].split("(")[0].replace("attn_res_bwd_", "")
    print(f"  {name:14s} " + "  ".join(f"{k.split('__')[1].split('.')[0][:22]}={d[k]}" for k in head if "__" in k))
PYEOF
  cat "$OUT/ncu_raw.csv" >>"$OUT/ncu_all.csv"
done
