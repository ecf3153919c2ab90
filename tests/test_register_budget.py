"""The register budget of the default CUDA launch plans, checked without a GPU.

The large-T kernels are latency-bound: their speed depends on how many rows are in flight per SM, which the
register file caps (docs/kernels.md, docs/benchmarks.md). A change that makes the default plans spill to local
memory can cost 3x (the fused kernel did, at ~1 KB per thread) and no CPU test would notice. So: compile the
default plans (read from the live launch table and backward config) for sm_90 with the ptxas Triton itself
picks for sm_90, as tools/ptxas_info.py does, and check registers and spills. It runs in a subprocess because
the pytest process runs Triton in interpreter mode. Skips where this triton has no CUDA ptxas. The figures move
with the Triton release (its code generation and its ptxas): the comments below give what each one measured.
The CUDA C++ backward (csrc_cuda/) is compiled the same way with nvcc where a CUDA toolkit is installed (its
tests skip elsewhere).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
TOOL = Path(__file__).resolve().parent.parent / "tools" / "ptxas_info.py"


@pytest.fixture(scope="module")
def budget() -> dict:
    """{plan name: ptxas -v resources}; skips where Triton has no ptxas for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(TOOL), "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    if report["ptxas"] is None:
        pytest.skip(f"triton {report['triton']} has no CUDA ptxas for sm_90")
    return report["cases"]


def test_default_rows_plan_has_no_spills(budget):
    # Two 4-warp programs per SM (ctas_per_sm = 2) need <= 255 registers per thread, and no local memory.
    # Measured: 246 registers, no spills, with triton 3.8 and with triton 3.9.
    r = budget["forward-default"]
    assert 0 < r["regs"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r


def test_default_fused_rows_plan_spills_little(budget):
    # The fused serving variant shares the plan (bit-exact mix); with every flag on it may spill a little in
    # its once-per-token epilogue: 80 bytes of spill stores and loads with triton 3.8, 112 with triton 3.9 (the
    # two CI stacks); 132 with the H200's triton 3.6, where its benchmarks ran (measured before the kernels'
    # masks became tl.where selects, which took 3.8 from 92 to 80 and 3.9 from 120 to 112). The bound is there
    # to catch ~1 KB, which (rows held in registers) made it 3x slower.
    r = budget["forward-default-fused"]
    assert 0 <= r["spill_stores"] <= 256 and 0 <= r["spill_loads"] <= 256, r


@pytest.mark.parametrize("name", [f"forward-one-tile-k{K}{f}" for K in (1, 2, 4) for f in ("", "-fused")])
def test_one_tile_token_plan_has_no_spills(budget, name):
    # The one-tile decode plan (the table's entry for K <= 4 up to 256 tokens; rows_per_tile 0, 8 warps): all of a
    # token's rows and the prefix row held in registers at once, which is its point; a spill would put them in
    # local memory. Measured, no spills: triton 3.8 102 / 125 / 209 registers plain at K = 1 / 2 / 4 and 165 / 222
    # / 255 fused since 1f87869 (the tile's loads first, the plain op's row mask an &), triton 3.9 102 / 128 / 211
    # and 166 / 212 / 255. (The device's triton 3.6 spills 4 bytes per thread in the plain K = 2 plan
    # since 1f87869, which its timings include: docs/benchmarks.md, "The op's steps on a one-tile floor".)
    r = budget[name]
    assert 0 < r["regs"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r


@pytest.mark.parametrize("name", [f"forward-loop-{k}{f}" for k in ("k4", "k8", "k16", "k16-s3")
                                  for f in ("", "-fused", "-serving")])
def test_loop_token_plan_has_no_spills(budget, name):
    # The table's one-row loop plans at K = 5..8 and 9..16 above 128 tokens and K = 3..4 above 512 (4 warps, 3
    # stages; 4 at K = 9..16 up to 512 tokens, 3 above: "-s3"), which fold
    # the prefix candidate first so that its row is dead in the loop. Folded last, the 3-stage plan's fused call at
    # 255 registers spilled 128 bytes of stores and 120 of loads with every flag, 104 / 100 as vLLM's in-place call
    # (triton 3.8; triton 3.9 144 / 140 and 96 / 96); first, none (triton 3.8 255 registers; triton 3.9 232 plain,
    # 233 / 230 fused; at 4 stages 232 / 235 / 226). A spill here would undo the gains in
    # docs/data/prefix_first_h200_149d12a.txt, docs/data/loop_plans_*_h200_16132f0.json and
    # docs/data/loop_large_*_h200_f779dc5.json and docs/data/loop_large_small_k_*_h200_bf31833.json.
    r = budget[name]
    assert 0 < r["regs"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r


@pytest.mark.parametrize("name", ["backward-split-kpad2", "backward-split-kpad16", "backward-split-apply-kpad2",
                                  "backward-split-apply-kpad16", "backward-rows-kpad2", "backward-rows-kpad16",
                                  "backward-tiles-kpad2", "backward-tiles-kpad16"])
def test_default_backward_plan_has_no_spills(budget, name):
    # 255 registers is the hardware's per-thread limit: past it ptxas spills. Measured (registers, no spills):
    # statistics kernel of the split 241 with triton 3.8, 254 with triton 3.9 (the closest to the limit); its
    # apply kernel 221 on both; rows kernel 252 / 240; tiles kernel 175 / 173 at K_PAD 16, 114 at K_PAD 2.
    r = budget[name]
    assert 0 < r["regs"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r


# --------------------------------------------------------------------------------------------------------------
# The CUDA C++ backward (csrc_cuda/attn_res_bwd.cu), compiled here with nvcc for sm_90 where a toolkit exists.
# --------------------------------------------------------------------------------------------------------------
def _nvcc() -> str | None:
    # A CPU build of torch leaves cpp_extension.CUDA_HOME unset; the toolkit may still be there.
    import shutil

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    return found if Path(found).exists() else None


NVCC_FLAGS = ("-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v")


def _ptxas_report(nvcc: str, source: Path, tmp_path_factory) -> str:
    """nvcc's stderr (ptxas -v) for ``source``, kept on disk under a key of everything the compile depends on (the
    nvcc release, the flags, every file of csrc_cuda/): the full compile of the cluster kernel's variants takes
    minutes, and CI runs this file once per software stack against the same sources and nvcc. A lock per key
    makes a second process wait for the first's report instead of compiling it again."""
    import fcntl
    import hashlib

    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join((version, *NVCC_FLAGS, source.name)).encode())
    for path in sorted(source.parent.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    cache = Path(os.environ.get("K3_OPS_NVCC_CACHE", Path.home() / ".cache" / "k3_ops" / "nvcc"))
    cache.mkdir(parents=True, exist_ok=True)
    report = cache / f"{source.stem}-{digest.hexdigest()[:24]}.txt"
    with open(cache / (report.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if report.exists():
            return report.read_text()
        obj = tmp_path_factory.mktemp("nvcc") / (source.stem + ".o")
        r = subprocess.run([nvcc, *NVCC_FLAGS, "-c", str(source), "-o", str(obj)], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        # Written whole, then renamed: a reader never sees a partial report.
        tmp = report.with_suffix(".part")
        tmp.write_text(r.stderr)
        tmp.replace(report)
        return r.stderr


def _nvcc_resources(source_name: str, tmp_path_factory, entry: str, key) -> dict:
    """ptxas -v of every kernel in csrc_cuda/<source_name> compiled for sm_90: {key(match): resources} for each
    entry function matching the regex ``entry`` (registers, stack frame, spill stores and loads)."""
    import re

    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc) here: the C++ kernel's register budget is checked where one is")
    source = Path(__file__).resolve().parent.parent / "csrc_cuda" / source_name
    report = _ptxas_report(nvcc, source, tmp_path_factory)
    assert "warning" not in report.lower(), report[-3000:]
    out, name = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '" + entry, line)
        if m:
            name = key(m)
            out[name] = {}
            continue
        if name is None:
            continue
        for field, pattern in (("stack", r"(\d+) bytes stack frame"), ("spill_stores", r"(\d+) bytes spill stores"),
                               ("spill_loads", r"(\d+) bytes spill loads"), ("regs", r"Used (\d+) registers")):
            m = re.search(pattern, line)
            if m:
                out[name][field] = int(m.group(1))
    return out


def _dtype(mangled: str) -> str:
    return "bf16" if mangled == "bfloat16" else "fp16"


@pytest.fixture(scope="module")
def cpp_budget(tmp_path_factory) -> dict[tuple[str, int, int], dict[str, int]]:
    """ptxas -v of every compiled variant, keyed (dtype, vectors per thread, rows); vectors per thread 0 is the
    shared-memory-resident kernel (one vector per thread), 3 the ring kernel."""
    import re

    def key(m):
        # ..._single_read_kernelI13__nv_bfloat16Li2ELi10EE... (dtype, VPT, MAXR); ..._smem_kernelI6__halfLi10EE...;
        # ..._ring_kernelI6__halfLi10EE...
        ints = [int(i) for i in re.findall(r"Li(\d+)E", m.group(4))]
        layout = 0 if m.group(1) else 3 if m.group(2) else None
        return (_dtype(m.group(3)), *((layout, ints[0]) if layout is not None else (ints[0], ints[1])))

    return _nvcc_resources("attn_res_bwd.cu", tmp_path_factory,
                           r"\w*(?:single_read_(smem)_|single_read_|bwd_(ring)_)kernelI\w*?(bfloat16|half)((?:Li\d+E)+)",
                           key)


def test_cuda_cpp_backward_variants_compile_within_budget(cpp_budget):
    # Every variant: 2 dtypes x {shared-memory layout, 1, 2 vectors per thread, ring} x {3, 6, 10} rows, at most
    # 65536 / (1024 / max(VPT, 1)) registers (the launch bound), so that one program of up to 1024 / max(VPT, 1)
    # threads fits an SM; the ring's bound is 896 threads (72 registers).
    assert len(cpp_budget) == 24, sorted(cpp_budget)
    for (dtype, vpt, rows), r in cpp_budget.items():
        assert 0 < r["regs"] <= (72 if vpt == 3 else 64 * max(vpt, 1)), ((dtype, vpt, rows), r)


@pytest.mark.parametrize("vpt, rows", [(2, 3), (2, 6), (0, 3), (0, 6), (3, 3), (3, 6)],
                         ids=["reg-rows3", "reg-rows6", "smem-rows3", "smem-rows6", "ring-rows3", "ring-rows6"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_cpp_backward_default_variants_have_no_local_memory(cpp_budget, dtype, vpt, rows):
    # The register layout for K <= 4 (two vectors per thread), the shared-memory layouts at the same row counts
    # (the ring's too, at 72 registers): no spills and no stack frame. A stack frame without spills is a register
    # array indexed at run time (an unrolled-too-late loop, a select of two array elements), which puts the whole
    # array in local memory: it happened twice while this kernel was written.
    r = cpp_budget[(dtype, vpt, rows)]
    assert r.get("stack", 0) == 0 and r.get("spill_stores", 0) == 0 and r.get("spill_loads", 0) == 0, r


@pytest.mark.parametrize("vpt", [0, 3], ids=["smem", "ring"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_cpp_backward_k8_smem_variants_spill_almost_nothing(cpp_budget, dtype, vpt):
    # The shared-memory layouts at 10 rows: at 64 registers the plain one spills nothing with nvcc 13.0 (4 bytes
    # before the softmax step became one helper shared by both layouts); the ring at 72 (its FP64 dw registers and
    # cursors) at most one 8-byte value kept across the token loop: with nvcc 13.0 the bf16 variant stores it once
    # before the loop and loads it three times after it (8 bytes of stores, 24 of loads; cuobjdump -sass). A
    # register array of rows or partials pushed to local memory would be tens to hundreds of bytes.
    r = cpp_budget[(dtype, vpt, 10)]
    assert r.get("stack", 0) <= 16 and r.get("spill_stores", 0) <= 16 and r.get("spill_loads", 0) <= 32, r


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_cpp_backward_k8_variant_spills_little(cpp_budget, dtype):
    # The register layout (forced, or where the shared-memory one does not fit) at K <= 8 holds 9 rows x 2 vectors
    # plus grad_out and w at the 128-register budget: a few of w's registers live in L1-resident local memory
    # (nvcc 13.0: 116-156 bytes of spill stores, 208-324 of loads over the versions in docs/history.md, "Backward").
    # The bound catches a regression to the ~1 KB that hurts.
    r = cpp_budget[(dtype, 2, 10)]
    assert r.get("spill_stores", 0) <= 256 and r.get("spill_loads", 0) <= 512, r


# --------------------------------------------------------------------------------------------------------------
# The CUDA C++ streaming forward (csrc_cuda/attn_res_stream.cu), compiled the same way.
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stream_budget(tmp_path_factory) -> dict[tuple[str, int, bool], dict[str, int]]:
    """ptxas -v of every streaming variant, keyed (dtype, vectors per thread, fused)."""
    # ..._stream_kernelI13__nv_bfloat16Li7ELb1EE... (dtype, V, fused)
    return _nvcc_resources("attn_res_stream.cu", tmp_path_factory,
                           r"\w*stream_kernelI\w*?(bfloat16|half)Li(\d+)ELb([01])E",
                           lambda m: (_dtype(m.group(1)), int(m.group(2)), m.group(3) == "1"))


def test_cuda_cpp_stream_variants_fit_two_ctas_per_sm_without_local_memory(stream_budget):
    # 2 dtypes x vectors per thread {1, 2, 4, 7, 8} x {plain, fused}. Two 128-thread CTAs per SM allow 255
    # registers per thread (the launch bound); the accumulator, the folded weight and the current row of a thread
    # are V x 8 values each (V = 7 at H = 7168: 213 registers plain, 235 fused with nvcc 13.0) and must stay in
    # registers: no spills, no stack frame (a run-time-indexed register array would put it in local memory).
    assert len(stream_budget) == 20, sorted(stream_budget)
    for key, r in stream_budget.items():
        assert 0 < r["regs"] <= 255, (key, r)
        assert r.get("stack", 0) == 0 and r.get("spill_stores", 0) == 0 and r.get("spill_loads", 0) == 0, (key, r)


# --------------------------------------------------------------------------------------------------------------
# The CUDA C++ cluster forward (csrc_cuda/attn_res_cluster_kernel.h, one translation unit per cluster size:
# attn_res_cluster_cs{2,4,8}.cu), compiled the same way.
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_budget(tmp_path_factory) -> dict[tuple[str, int, int, bool, bool], dict[str, int]]:
    """ptxas -v of every cluster variant, keyed (template arguments, cluster size, most block rows, fused, Gram
    norm)."""
    # ..._cluster_kernelI13__nv_bfloat16S3_S3_Li8ELi4ELb1ELb0EE... (io, nw, pw dtypes, CS, MB, fused, kGram)
    budget = {}
    for cs in (2, 4, 8):
        budget.update(_nvcc_resources(f"attn_res_cluster_cs{cs}.cu", tmp_path_factory,
                                      r"\w*cluster_kernelI(\w+?)Li(\d+)ELi(\d+)ELb([01])ELb([01])E",
                                      lambda m: (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) == "1",
                                                 m.group(5) == "1")))
    return budget


def test_cuda_cpp_cluster_variants_keep_their_rows_in_registers(cluster_budget):
    # 2 io dtypes x 3 x 3 weight dtypes x cluster sizes {2, 4, 8} x most block rows {2, 4, 6, 8} x {plain, fused,
    # fused with the Gram norm}.
    # The launch bound (512 threads) allows 128 registers per thread; a thread holds MB + 1 candidates x 8 columns
    # in FP32 across the exchange, and all of its loads are in flight at once (fetch8), so a spill or a stack frame
    # would put rows in local memory. nvcc 13.0: 111-126 registers at MB = 8, 90-110 at MB = 6, 71-94 at MB = 4,
    # 54-72 at MB = 2, no spills. The fused 2-block variants with an FP32 weight take a minimum of one CTA per SM in
    # their launch bound (kMinCtasPerSm): without it ptxas stopped them at 64 registers and those with 8 CTAs
    # spilled 8-16 bytes.
    assert len(cluster_budget) == 648, sorted(cluster_budget)
    for key, r in cluster_budget.items():
        assert 0 < r["regs"] <= 128, (key, r)
        assert r.get("stack", 0) == 0 and r.get("spill_stores", 0) == 0 and r.get("spill_loads", 0) == 0, (key, r)


def test_cuda_cpp_cluster_few_block_variants_hold_fewer_registers(cluster_budget):
    # A variant with fewer block rows exists to drop the absent candidates' values and statistics: it must hold
    # fewer registers than the next larger variant of the same arguments, or it buys nothing.
    larger = {2: 4, 4: 6, 6: 8}
    for (args, cs, mb, fused, gram), r in cluster_budget.items():
        if mb in larger:
            bigger = cluster_budget[(args, cs, larger[mb], fused, gram)]
            assert r["regs"] < bigger["regs"], (args, cs, mb, fused, gram, r)


def test_schedule_cases_compile_to_16_byte_loads():
    # tools/ptxas_info.py --schedule shows where the one-tile plan places its global loads; that means something
    # only if they load 16 bytes per instruction as the JIT compiles them: at K = 4, 16 tile loads, 4 of the prefix
    # and the weights' per thread, 24-48 in all, where 2-byte loads would be about 8x as many.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import ptxas_info as p; f = p.find_ptxas(); "
            "print(json.dumps(None if f is None else {n: p.load_schedule(c) for n, c in p.schedule_cases()}))")
    r = subprocess.run([sys.executable, "-c", code, str(TOOL.parent)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads(r.stdout.strip().splitlines()[-1])
    if cases is None:
        pytest.skip(f"triton {triton.__version__} has no CUDA ptxas for sm_90")
    assert {n.split("-k4")[0] for n in cases} == {"op-one-tile"} and len(cases) == 3, sorted(cases)
    for name, sched in cases.items():
        assert 24 <= len(sched["ldg"]) <= 48, (name, sched)
        assert sched["ldg"] == sorted(sched["ldg"]) and min(sched["ldg"]) < sched["first_shuffle"], (name, sched)
