#!/usr/bin/env bash
# The cluster kernel's exchanges through transaction barriers, timed against the kernel as committed: three builds
# side by side in one device call (timed on the H200 at e69d6f0: both slower, docs/benchmarks.md, "Where the fused
# call's time over the plain op goes"; the patches apply to the commit that added them and fail loudly on a tree
# they no longer fit).
#   a: this tree, built in place;
#   b: + norm_tx.patch: the output norm's exchange as one sum per warp, each a remote st.async counted by the
#      receiver's mbarrier: no CTA barrier before it, no release fence in it (docs/benchmarks.md, "Where the fused
#      call's time over the plain op goes": the norm is about 1 us of the fused call on the cluster kernel, the CTA
#      barrier and the fence part of it);
#   c: + stats_norm_tx.patch: the statistics' exchange the same way too (the kGram variants keep theirs), so that in
#      the fused call no fence waits for the new prefix's and the snapshot's stores.
# Both sum in the committed kernel's order, so every output must equal a's bits (bits.py: 260 outputs). Then each
# build is timed in turn (ORDER, default a b c c b a): tools/fused_parts.py (TOK x BLK, the table's plans) and the
# layer step (tools/plan_variants.py layer_decode); EXTRA names more plan_variants sections for a and c; TESTS=1
# (default) runs the cluster cases of tests/test_fused_kernels.py on b and c.
# Usage, on the GPU machine from the repository root: K3_OPS_COMMIT=<commit> OUT=<dir> tools/ab_cluster_exchange/run.sh
# (.whl/ carried as for tools/gpu_run.sh).
set -u
export PYTHONUNBUFFERED=1 K3_OPS_COMMIT=${K3_OPS_COMMIT:-unknown}
OUT=$(realpath -m "${OUT:-ab_out}"); R=$OUT/r; mkdir -p $R
t0=$SECONDS
A=$(pwd)
# Each stage leaves its results packed, so a call cut off at its time limit still brings back what had run.
snap() { tar czf $OUT/r.tgz -C $OUT r; }
python3 -m pip install -q --no-index --no-deps --target /tmp/k3_site .whl/*.whl >/dev/null 2>&1
side() { case $1 in a) echo $A ;; b) echo /tmp/side_b ;; c) echo /tmp/side_c ;; esac; }
for s in b c; do
  D=$(side $s); P=$([ $s = b ] && echo norm_tx || echo stats_norm_tx)
  rm -rf $D && mkdir -p $D && tar cf - --exclude=./build --exclude='*.so' --exclude=./.venv --exclude=./.git --exclude=./ab_out . | tar xf - -C $D
  (cd $D && patch -p1 -s < $A/tools/ab_cluster_exchange/$P.patch) || { echo "patch $P failed"; exit 1; }
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for s in a b c; do
  (cd $(side $s) && MAX_JOBS=6 python3 setup.py build_ext --inplace > $R/build_$s.log 2>&1; echo "build $s rc=$? at $((SECONDS - t0)) s") &
done
wait
for s in a b c; do echo "$s: $(grep -c 'Compiling entry' $R/build_$s.log) entries, $(grep -cE '[1-9][0-9]* bytes spill stores' $R/build_$s.log) with spills"; done
for s in a b c; do (cd $R && PYTHONPATH=$(side $s):/tmp/k3_site timeout 200 python3 $A/tools/ab_cluster_exchange/bits.py save $R/bits_$s.pt 2>&1 | tail -2); done
for s in b c; do echo -n "$s against a: "; python3 $A/tools/ab_cluster_exchange/bits.py compare $R/bits_a.pt $R/bits_$s.pt; done
rm -f $R/bits_*.pt
echo "--- timing at $((SECONDS - t0)) s"
n=0
for s in ${ORDER:-a b c c b a}; do
  n=$((n + 1)); D=$(side $s)
  PYTHONPATH=/tmp/k3_site timeout ${PT:-120} python3 $D/tools/fused_parts.py --tokens ${TOK:-1,64} --blocks ${BLK:-2,4,8} --out $R/parts_${n}_$s 2>&1 | grep "^fused_parts" | sed "s/^/$s /"
  PYTHONPATH=/tmp/k3_site timeout ${PT:-120} python3 $D/tools/plan_variants.py layer_decode --out $R/layer_${n}_$s 2>&1 | grep "^layer_decode" | sed "s/^/$s /"
  echo "--- $n $s done at $((SECONDS - t0)) s"; snap
done
# EXTRA: plan_variants sections timed on a and c after the rest (e.g. cluster_k12: the cluster kernel at K = 1..2,
# where the table runs the one-tile plan at K = 1: does the cheaper exchange bring it under the fused T = 1, K = 1
# target of 2.8 us?).
for sec in ${EXTRA:-}; do
  for s in a c; do
    D=$(side $s)
    PYTHONPATH=/tmp/k3_site timeout ${PT:-120} python3 $D/tools/plan_variants.py $sec --out $R/extra_$s 2>&1 | grep "^$sec" | sed "s/^/$s /"
  done
done
if [ "${TESTS:-1}" = 1 ]; then
  for s in b c; do
    D=$(side $s)
    (cd $D && PYTHONPATH=$D:/tmp/k3_site timeout ${TT:-100} python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py -k "cuda_paths and cluster" > $R/t_$s.log 2>&1; echo "$s cluster paths rc=$?: $(tail -1 $R/t_$s.log)") &
  done
  wait
fi
rm -f $R/build_*.log
snap
