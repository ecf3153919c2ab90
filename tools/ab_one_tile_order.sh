#!/usr/bin/env bash
# The one-tile kernel's load order (kernels/attn_res_decode.py: the tile's loads first, then the prefix's and the
# weights') against the order before it (the folded weight, the prefix, then the tile), two builds timed in turn in
# one device call: tools/plan_variants.py one_tile_blocks (the table at T = 1..512, K = 1..4, plain and fused) and
# layer_table (the layer step, T = 1, 8, 64, 512), in the order a b b a.
#   a: this tree;
#   b: this tree with BEFORE (a copy of kernels/attn_res_decode.py as it was) in place of that file.
# Usage, on the GPU machine from the repository root after an in-place build:
#   K3_OPS_COMMIT=<commit> OUT=<dir> BEFORE=<file> tools/ab_one_tile_order.sh
set -u
export PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-ab_out}"); mkdir -p $OUT
A=$(pwd)
B=/tmp/side_b; rm -rf $B && mkdir -p $B
tar cf - --exclude=./build --exclude=./.venv --exclude=./.git . | tar xf - -C $B
cp "$BEFORE" $B/k3_ops/kernels/attn_res_decode.py
echo "b: $(diff $A/k3_ops/kernels/attn_res_decode.py $B/k3_ops/kernels/attn_res_decode.py | grep -c '^[<>]') changed lines"
n=0
for s in ${ORDER:-a b b a}; do
  n=$((n + 1)); D=$A; [ $s = b ] && D=$B
  (cd $D && timeout ${SIDE_TIMEOUT:-200} python3 tools/plan_variants.py one_tile_blocks layer_table --out $OUT/${n}_$s 2>&1 \
    | grep -E "^(one_tile_blocks|layer_table)" | sed "s/^/$s /")
done
