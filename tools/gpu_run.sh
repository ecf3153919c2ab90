#!/usr/bin/env bash
# Build k3_ops in place on a GPU machine and run the named stages in one call: the device machines have no network
# and keep nothing between leases, so the build and everything that needs it go in one command.
#
#   tools/gpu_run.sh [-n|--dry-run] [-h|--help] [STAGE ...]        (no stage: build tests)
#
# Stages, run in the order given (every stage after build needs its environment: name build first):
#   build    pip install -e . against the machine's torch (no build isolation, no dependencies); prints the device,
#            torch, triton, and whether the CUDA C++ kernels were built
#   tests    the whole suite in one pytest; prints its summary line and the failed tests' names (from pytest -v's
#            stream, so a run its timeout kills still names them)
#   ptests   each of TEST_FILES twice at once, PDL on and off (K3_OPS_PDL=1 / 0; one GPU, so correctness only, never
#            timings); one pytest per file and setting, one line each and the failed tests' names
#   job      the README's main job (python -m k3_ops), its files under $OUT/job, its log in $OUT/job.txt
#   bench    python -m k3_ops.bench $BENCH_ARGS (section names and options), its files under $OUT/bench
#   pack     everything under $OUT into $OUT/gpu_out.tgz (name it last: the device returns only a few files)
# A table of the stages' times and results closes the output; each stage's full log stays under $OUT.
#
# Environment: OUT (default gpu_out), PY (python3), TEST_FILES (tests/test_*.py), PYTEST_ARGS (word-split, added to
# every pytest), TEST_TIMEOUT (seconds per pytest, 600), JOB_TIMEOUT (540), BENCH_ARGS, K3_OPS_COMMIT (the commit
# the benchmark JSON records: pass `git rev-parse --short HEAD` from the checkout, since a copied tree may carry
# another checkout's git metadata). --dry-run prints each stage's commands and runs none (no GPU needed).
# Exit status: 0 when every stage passed.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

DRY=0
stages=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    -n|--dry-run) DRY=1 ;;
    -*) echo "gpu_run.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) stages+=("$arg") ;;
  esac
done
[ ${#stages[@]} -eq 0 ] && stages=(build tests)
for stage in "${stages[@]}"; do
  case "$stage" in
    build|tests|ptests|job|bench|pack) ;;
    *) echo "gpu_run.sh: unknown stage $stage (stages: build tests ptests job bench pack)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-gpu_out}
PY=${PY:-python3}
TEST_FILES=${TEST_FILES:-tests/test_*.py}
TEST_TIMEOUT=${TEST_TIMEOUT:-600}
JOB_TIMEOUT=${JOB_TIMEOUT:-540}
export PYTHONUNBUFFERED=1

sh_run() {  # sh_run CMD: run the command line CMD in this shell, or print it under --dry-run
  if [ $DRY = 1 ]; then printf '  + %s\n' "$1"; return 0; fi
  eval "$1"
}

pytest_line() {  # pytest_line LOG: pytest's closing summary line of LOG (or its last line)
  grep -aE "(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s" "$1" | tail -1 | tr -d '=' \
    | sed 's/^ *//;s/ *$//' || tail -1 "$1"
}

failed_names() {  # failed_names LOG: the tests LOG reports failed, one per line, from the lines pytest -v streams
  # (so a run that its timeout kills before the closing summary still names them), at most 20
  grep -aE "(FAILED|ERROR)" "$1" | grep -aoE "[^ ]+\.py::[^ ]+" | sort -u | head -20 | sed 's/^/  failed: /'
}

stage_build() {
  # Test-only wheels the GPU image lacks (expecttest, which opcheck needs), carried in .whl/ (git-ignored: make it
  # with `pip download --no-deps -d .whl expecttest`), installed beside the tree since there is no network.
  sh_run 'if ls .whl/*.whl >/dev/null 2>&1; then $PY -m pip install -q --no-index --no-deps --target /tmp/k3_site .whl/*.whl && export PYTHONPATH=/tmp/k3_site${PYTHONPATH:+:$PYTHONPATH}; fi'
  sh_run 'nvidia-smi --query-gpu=name,driver_version --format=csv,noheader'
  sh_run '$PY -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, torch.version.cuda and \"CUDA \" + torch.version.cuda)"'
  # No network on the device machine: build against its torch, without build isolation or dependencies. setup.py
  # passes -Xptxas -v, so build.log also holds the CUDA C++ kernels' registers and spills.
  sh_run '$PY -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }'
  sh_run '$PY -c "import k3_ops, k3_ops._C as c; print(\"k3_ops\", k3_ops.__version__, \"built; CUDA C++ kernels:\", c.has_cuda_kernels)"'
}

stage_tests() {
  sh_run 'timeout "$TEST_TIMEOUT" $PY -m pytest -v -ra -p no:cacheprovider ${PYTEST_ARGS:-} >"$OUT/tests.log" 2>&1; rc=$?; echo "tests rc=$rc: $(pytest_line "$OUT/tests.log")"; failed_names "$OUT/tests.log"; return $rc'
}

stage_ptests() {
  # One background chain per setting; each file's pytest writes its own log and one summary line.
  sh_run 'pids=(); for pdl in 1 0; do ( for f in $TEST_FILES; do log="$OUT/ptests/pdl$pdl.$(basename "$f" .py).log"; K3_OPS_PDL=$pdl timeout "$TEST_TIMEOUT" $PY -m pytest -v -ra -p no:cacheprovider ${PYTEST_ARGS:-} "$f" >"$log" 2>&1; echo "PDL=$pdl $f rc=$?: $(pytest_line "$log")"; failed_names "$log"; done >"$OUT/ptests/summary$pdl.txt" ) & pids+=($!); done; wait "${pids[@]}"'
  sh_run 'cat "$OUT"/ptests/summary*.txt; ! grep -q "rc=[1-9]" "$OUT"/ptests/summary*.txt'
}

stage_job() {
  sh_run 'timeout "$JOB_TIMEOUT" $PY -m k3_ops -- --out "$OUT/job" >"$OUT/job.txt" 2>&1; rc=$?; tail -3 "$OUT/job.txt" | cut -c1-200; return $rc'
}

stage_bench() {
  sh_run '$PY -m k3_ops.bench --out "$OUT/bench" ${BENCH_ARGS:-} >"$OUT/bench.txt" 2>&1; rc=$?; grep -aE "^#|warning|Error" "$OUT/bench.txt" | head -20 | cut -c1-200; return $rc'
}

stage_pack() {
  sh_run 'tar czf /tmp/gpu_out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_out.tgz "$OUT/gpu_out.tgz" && echo "packed: $OUT/gpu_out.tgz"'
}

[ $DRY = 1 ] || mkdir -p "$OUT/ptests"
results=()
status=0
for stage in "${stages[@]}"; do
  echo "=== $stage"
  start=$SECONDS
  "stage_$stage"
  rc=$?
  [ $rc -eq 0 ] || status=1
  results+=("$(printf '%-8s %5d s  %s' "$stage" $((SECONDS - start)) "$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")")")
  # A failed build leaves nothing for the other stages to run against.
  if [ "$stage" = build ] && [ $rc -ne 0 ]; then break; fi
done
echo "=== stages"
printf '%s\n' "${results[@]}"
exit $status
