#!/usr/bin/env bash
# What the one-tile plan does beyond the simplest form of its arithmetic (docs/benchmarks.md, "The row floor": at
# T = 64, K = 4 the op takes 3.55 us, the tile ladder's t2 3.07): two suspects, each removed in a copy of this tree
# and timed beside it in one device call through tools/floor_rows.py --tile-ladder (whose ladder kernels are the
# same code on every side: a drift check), in the order a b c c b a. Ran at ee7b6d8 (on an H100): neither suspect is
# it (docs/benchmarks.md, "The op's steps on a one-tile floor").
#   a: this tree;
#   b: the one-tile tile's loads without the evict_first hint;
#   c: b + the score from an approximate rsqrt instead of the correctly rounded sqrt and division (its bits differ:
#      a timing probe, not a candidate without an accuracy check).
# Usage, on the GPU machine from the repository root after an in-place build: K3_OPS_COMMIT=<commit> OUT=<dir>
# tools/ab_one_tile_chain.sh
set -u
export PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-ab_out}"); mkdir -p $OUT
A=$(pwd)
side() { case $1 in a) echo $A ;; *) echo /tmp/side_$1 ;; esac; }
for s in b c; do
  D=$(side $s); rm -rf $D && mkdir -p $D
  tar cf - --exclude=./build --exclude=./.venv --exclude=./.git . | tar xf - -C $D
  sed -i 's/mask=rmask, other=0.0, eviction_policy="evict_first")/mask=rmask, other=0.0)/' \
    $D/k3_ops/kernels/attn_res_decode.py
  if [ $s = c ]; then
    sed -i 's|return tl.div_rn(1.0, tl.sqrt_rn(ss / H + eps)) \* d|return tl.rsqrt(ss / H + eps) * d|' \
      $D/k3_ops/kernels/attn_res_fwd.py
  fi
  echo "$s: $(diff -r $A/k3_ops $D/k3_ops | grep -c '^[<>]') changed lines"
done
n=0
for s in ${ORDER:-a b c c b a}; do
  n=$((n + 1))
  (cd $(side $s) && timeout 120 python3 tools/floor_rows.py --tile-ladder --out $OUT/${n}_$s 2>&1 | grep "^tile_ladder" | sed "s/^/$s /")
done
