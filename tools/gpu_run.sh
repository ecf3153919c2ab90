#!/usr/bin/env bash
# Build k3_ops in place on a GPU machine and run the named stages (stages after build need the same
# shell, so name them in one call: tools/gpu_run.sh build tests bench); used for the GPU runs (H200, H100) recorded in
# docs/benchmarks.md. Stages: build, errors, ncu, testfiles, ptests, tests, bench, tune, main, job, variants,
# layermix, train, serving, pack (default: build tests bench).
# Results (logs, JSON, PNG) go to $OUT (default ./gpu_out). Extra pytest arguments: PYTEST_ARGS (word-split:
# no spaces inside one argument, so "-k a or b" does not work; name the files in TEST_GROUPS instead). A copy of
# the working tree may carry another commit's git metadata: pass K3_OPS_COMMIT=$(git rev-parse --short HEAD)
# from the checkout so that benchmark JSON records the commit that ran.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build tests bench)
status=0
for stage in "${stages[@]}"; do
  echo "=== $stage ($(date +%T))"
  case "$stage" in
    build)
      # Test-only wheels the GPU image lacks (expecttest), carried in .whl/ since that machine has no network
      # (.whl/ is ignored by git: in a fresh checkout make it with `pip download --no-deps -d .whl expecttest`;
      # without it the test files that import expecttest fail at collection there).
      if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --target /tmp/k3_site .whl/*.whl && export PYTHONPATH=/tmp/k3_site${PYTHONPATH:+:$PYTHONPATH}
      fi
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
      # No network there: build against the machine's torch, without build isolation or dependencies.
      $PY -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
        || { echo "pip -e failed, building in place"; $PY setup.py build_ext --inplace >>"$OUT/build.log" 2>&1; } \
        || { grep -E "error|Error" "$OUT/build.log" | head -30; tail -30 "$OUT/build.log"; exit 1; }
      # ptxas -v of the CUDA C++ kernels (setup.py passes it): registers, spills, shared memory per variant.
      grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | sed -E 's/.*(Compiling entry function|ptxas info *:)//' \
        | paste - - - 2>/dev/null | cut -c1-260 | head -30
      $PY -c "import k3_ops, k3_ops._C as c; print('k3_ops', k3_ops.__version__, 'ok; CUDA C++ kernels:', c.has_cuda_kernels)" || exit 1 ;;
    errors)
      # The bad-input path on this torch build; on a crash, a native backtrace (cuda-gdb runs host code too).
      $PY tools/smoke_errors.py || { echo "smoke_errors failed (rc $?)"; status=1;
        command -v cuda-gdb >/dev/null && cuda-gdb -q -batch -ex run -ex bt --args $PY tools/smoke_errors.py \
          >"$OUT/gdb.txt" 2>&1; grep -E "^#|signal" "$OUT/gdb.txt" | head -16 | cut -c1-300; } ;;
    ncu)
      # Hardware counters of one backward launch of the default kernel (NCU_KERNEL; METHOD.md: leave the clocks alone).
      ncu --clock-control none --profile-from-start off -k regex:${NCU_KERNEL:-attn_res_bwd_stats_kernel} -c 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats --section SchedulerStats $PY tools/profile_bwd.py >"$OUT/ncu.txt" 2>&1 || status=1
      grep -vE "^==PROF==|^ *-+ *$" "$OUT/ncu.txt" | grep -E "Throughput|Duration|Hit|Occupancy|Stall|Warp Cycles|Registers|Shared|Block Limit|Issued|Eligible|Active Warps|L2|DRAM|One or More" | head -60 ;;
    testfiles)
      # One pytest process per file (a crash loses one file, not the suite); one log, one summary line per file.
      # -s keeps the accuracy tests' "kernel/eager" ratio lines (per case), collected into accuracy.txt.
      for f in ${TEST_FILES:-tests/test_*.py}; do
        timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -s -ra -p no:cacheprovider ${PYTEST_ARGS:-} "$f" \
          >>"$OUT/pytest.log" 2>&1
        rc=$?; echo "$f rc=$rc: $(tail -1 "$OUT/pytest.log")"; [ $rc -eq 0 ] || status=1
      done
      grep -a "kernel/eager" "$OUT/pytest.log" >"$OUT/accuracy.txt" || true ;;
    ptests)
      # testfiles, with TEST_GROUPS ("a.py b.py;c.py d.py"): the groups run concurrently (one GPU, many CPU
      # cores: correctness only, never timings), each group's files one pytest process after another.
      # TEST_ENVS ("K3_OPS_PDL=1;K3_OPS_PDL=0"): each group's environment, in the same order (the same file may
      # run in two groups, PDL on and off).
      IFS=';' read -ra groups <<<"${TEST_GROUPS:?}"
      IFS=';' read -ra group_envs <<<"${TEST_ENVS:-}"
      pids=()
      for gi in "${!groups[@]}"; do
        ( for f in ${groups[$gi]}; do
            env ${group_envs[$gi]:-} timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -s -ra -p no:cacheprovider ${PYTEST_ARGS:-} "$f" \
              >"$OUT/pytest_g$gi.$(basename "$f" .py).log" 2>&1
            echo "${group_envs[$gi]:-} $f rc=$?: $(tail -1 "$OUT/pytest_g$gi.$(basename "$f" .py).log")"
          done ) >"$OUT/summary_g$gi.txt" &
        pids+=($!)
      done
      wait "${pids[@]}"
      cat "$OUT"/summary_g*.txt
      grep -q "rc=[1-9]" "$OUT"/summary_g*.txt && status=1
      cat "$OUT"/pytest_g*.log >"$OUT/pytest.log"; rm -f "$OUT"/pytest_g*.log "$OUT"/summary_g*.txt
      grep -a "kernel/eager" "$OUT/pytest.log" >"$OUT/accuracy.txt" || true ;;
    tests)
      timeout ${TEST_TIMEOUT:-1200} $PY -m pytest -q -ra ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | grep -Ev "^(tests/|\.|s)+[ .sxEF]*\[ *[0-9]+%\]$" | tail -60
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench)
      # Every section of the benchmark (BENCH_ARGS: section names and options, e.g. "mix fused --quick"): JSON,
      # Markdown tables and PNG plots under $OUT, the tables on stdout.
      $PY -m k3_ops.bench --out "$OUT" ${BENCH_ARGS:-} 2>"$OUT/bench.err" | tee "$OUT/bench.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || { tail -20 "$OUT/bench.err"; status=1; } ;;
    tune)
      # Forward launch configs side by side (TUNE_ARGS, e.g. --configs @configs.json --tokens 1,8,64).
      $PY -m k3_ops.bench mix --out "$OUT/tune" --no-refs --layouts token ${TUNE_ARGS:-} 2>"$OUT/tune.err" \
        | tee "$OUT/tune.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || { tail -20 "$OUT/tune.err"; status=1; } ;;
    main)
      $PY -m k3_ops --no-bench || status=1 ;;
    job)
      # The README's main job as a user runs it (checks, then every benchmark section), its log beside its files:
      # the run docs/benchmarks.md's tables come from.
      timeout ${JOB_TIMEOUT:-540} $PY -m k3_ops -- --out "$OUT/main" >"$OUT/main_job.txt" 2>"$OUT/main_job.err" \
        || { tail -5 "$OUT/main_job.err"; status=1; }
      grep -E "^# (mix|fused|layer|host|train):|CHECKS" "$OUT/main_job.txt" | cut -c1-120 ;;
    variants)
      # Launch-plan comparisons (PV: tools/plan_variants.py section names, e.g. "onw_after layer_onw_after").
      timeout ${PV_TIMEOUT:-300} $PY tools/plan_variants.py ${PV:?} --out "$OUT/pv" 2>"$OUT/pv.err" | tee "$OUT/pv.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || { tail -5 "$OUT/pv.err"; status=1; } ;;
    layermix)
      # The layer step by site class (LM_ARGS, e.g. "--layer 64,512").
      timeout ${LM_TIMEOUT:-200} $PY tools/floor_rows.py --layer-mix --out "$OUT/lm" ${LM_ARGS:-} | tee "$OUT/lm.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    pack)
      # The device tool returns at most eight files: everything under $OUT moves into one archive (name it last).
      tar czf /tmp/gpu_out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_out.tgz "$OUT/gpu_out.tgz" ;;
    train)
      $PY -m k3_ops.bench train --out "$OUT" ${TRAIN_ARGS:-} || status=1 ;;
    serving)
      $PY -m k3_ops.bench fused layer --out "$OUT" ${SERVING_ARGS:-} || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
