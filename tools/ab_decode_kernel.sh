#!/usr/bin/env bash
# Builds of the per-token kernel (k3_ops/kernels/attn_res_decode.py) timed in turn in one device call: this tree
# ("a") and one copy of it per SIDES entry "name:file", with that file in place of attn_res_decode.py, or, for a
# file ending in .patch, that patch applied to the copy (`patch -p1`: changes beyond that file, e.g.
# tools/ab_score/); "name:f1+f2" applies both in turn. Each pass runs tools/plan_variants.py on SECTIONS (default
# one_tile_blocks layer_table: the table at T = 1..512, K = 1..4, plain and fused, and the layer step at T = 1, 8,
# 64, 512), in ORDER (default: a, the sides, the sides again reversed, a). Only the Python kernels differ between
# the builds; the C++ extension built here is shared.
# Usage, on the GPU machine from the repository root after an in-place build:
#   K3_OPS_COMMIT=<commit> OUT=<dir> SIDES="b:old.py c:new.py" tools/ab_decode_kernel.sh
set -u
export PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-ab_out}"); mkdir -p $OUT
A=$(pwd)
names=""
for entry in ${SIDES:?name:file pairs}; do
  s=${entry%%:*}; f=${entry#*:}; D=/tmp/side_$s; rm -rf $D && mkdir -p $D
  tar cf - --exclude=./build --exclude=./.venv --exclude=./.git . | tar xf - -C $D
  for g in ${f//+/ }; do
    case $g in
      *.patch) patch -s -p1 --no-backup-if-mismatch -d $D < "$g" || { echo "$s: $g does not apply"; exit 1; } ;;
      *) cp "$g" $D/k3_ops/kernels/attn_res_decode.py ;;
    esac
  done
  echo "$s: $(diff -r $A/k3_ops $D/k3_ops | grep -c '^[<>]') changed lines"
  names="$names $s"
done
default_order="a$names $(echo $names | tr ' ' '\n' | tac | tr '\n' ' ') a"
n=0
for s in ${ORDER:-$default_order}; do
  n=$((n + 1)); D=$A; [ $s != a ] && D=/tmp/side_$s
  (cd $D && timeout ${SIDE_TIMEOUT:-200} python3 tools/plan_variants.py ${SECTIONS:-one_tile_blocks layer_table} \
    --out $OUT/${n}_$s 2>&1 | grep -E "^[a-z_]+ (mix|fused|layer) T=" | sed "s/^/$s /")
done
