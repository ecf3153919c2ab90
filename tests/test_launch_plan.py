"""The plan step (backends/cuda_table.py, cuda_plan.py, npu_plan.py) without a GPU or triton, and the launches of
both launch policies, against tests/data/launch_plans.json.

The JSON holds what the policies chose and launched at 341d364, before the plan step was split from the launch step
(tests/launch_records.py made it; ``python tests/launch_records.py --write`` rewrites it after an intended change of
the table or of the launches, and its diff shows which cells changed):

- every plan of a grid of T x K x H on described devices (the interpreter, GPUs given by SM count, compute
  capability, PDL, shared-memory opt-in and build), of explicit configs, of the serving calls, of the backward, of
  ``warmup`` and of the NPU: compared cell by cell with the pure plan step;
- a digest of everything each of about 3,200 calls hands to Triton and to the CUDA C++ kernels (kernel, grid,
  arguments, compile-time constants, native launches, scratch buffers, unrecordable work), with the kernels
  intercepted: the same kernels, constants and grids, call for call.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import launch_records as records

RECORDED = json.loads(records.DATA.read_text())
PLAN_SECTIONS = [name for name in RECORDED["plans"] if name != "plans"]


def _cells(name: str, section: dict, plans: list) -> dict:
    # Each cell's plan; a warmup row lists (plan, example (T, K)) pairs.
    if name == "warmup":
        return {key: [(plans[i], tuple(tk)) for i, tk in row] for key, row in section.items()}
    return {key: [plans[i] for i in row] for key, row in section.items()}


@pytest.fixture(scope="module")
def current_plans() -> dict:
    return records.plan_records(records.current_api())


@pytest.mark.parametrize("section", PLAN_SECTIONS)
def test_plans_are_the_recorded_plans(current_plans, section):
    want = _cells(section, RECORDED["plans"][section], RECORDED["plans"]["plans"])
    got = _cells(section, current_plans[section], current_plans["plans"])
    assert got.keys() == want.keys(), "the grid changed: rewrite the record (python tests/launch_records.py --write)"
    diffs = [(key, i, w, g) for key in want for i, (w, g) in enumerate(zip(want[key], got[key])) if w != g]
    assert not diffs, "\n".join(f"{key} [{i}]:\n  recorded {w}\n  now      {g}" for key, i, w, g in diffs[:5]) + (
        f"\n... {len(diffs)} cells differ" if len(diffs) > 5 else "")


def test_launches_are_the_recorded_launches():
    pytest.importorskip("triton")
    ids = records.launch_ids()
    want = RECORDED["launches"]["launches"]
    assert len(ids) == len(want), "the calls changed: rewrite the record (python tests/launch_records.py --write)"
    got = records.launch_records(records.current_api())
    diffs = [name for name, w, g in zip(ids, want, got) if w != g]
    assert not diffs, f"{len(diffs)} of {len(ids)} calls launch otherwise than recorded, e.g.\n" + "\n".join(diffs[:10])


@pytest.mark.parametrize("op, config, kernels", [
    ("fused_attn_res", dict(kernel="rows"), ["attn_res_rows_kernel"]),
    ("fused_attn_res", dict(kernel="split"), ["attn_res_split_kernel"] * 3),
    # The serving calls run a split config's serving plan: the 4-row token kernel.
    ("fused_attn_res_", dict(kernel="split"), ["attn_res_token_kernel"]),
    ("fused_attn_res_quant", dict(kernel="tiles"), ["attn_res_token_kernel"]),
    ("fused_attn_res_quant", dict(kernel="token", rows_per_tile=1), ["attn_res_token_kernel"]),
], ids=["fused-rows", "fused-split", "inplace-split", "quant-tiles", "quant-token"])
def test_fused_calls_take_an_explicit_config(op, config, kernels):
    """``config=`` on the CUDA fused entry points replaces the table's entry, as on ``attn_res_forward``."""
    pytest.importorskip("triton")
    call = records.Call("cuda", "interpreter", op, 3, 4, H=64, addend=True, write=True, norm=True,
                        round_mix=op == "fused_attn_res", out_dtype="float8_e4m3fn" if "quant" in op else None)
    inputs = records.call_inputs(call)
    events: list = []
    api = records.current_api()
    with api.cuda(records.FACTS["interpreter"]) as cuda, records.intercepted(events):
        args = (inputs["prefix_sum"], inputs["addend"], inputs["block_residual"], inputs["norm_weight"],
                inputs["proj_weight"], 4, 1e-6, 4, inputs["out_norm_weight"], 1e-5)
        kw = dict(out_dtype=torch.float8_e4m3fn) if "quant" in op else {}
        getattr(cuda, op)(*args, **kw, config=cuda.LaunchConfig(**config))
    assert [e[1] for e in events if e[0] == "launch"] == kernels
    if config.get("rows_per_tile") == 1:
        assert [e[4]["ROWS"] for e in events if e[0] == "launch"] == [1]


PLAN_MODULES = ("cuda_table", "cuda_plan", "npu_plan", "_fused", "_forward")


def test_plan_modules_need_neither_triton_nor_kernels():
    # In a fresh interpreter where importing triton fails: the plan modules import, and resolve a plan, and import no
    # kernel module. A build with the CUDA C++ kernels imports backends._launch (torch only) with k3_ops itself, to
    # bind the kernels' Python path (_registration._bind_cuda); elsewhere it must not be imported at all.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import k3_ops\n"
        "bound = 'k3_ops.backends._launch' in sys.modules\n"
        f"from k3_ops.backends import {', '.join(PLAN_MODULES)}\n"
        "import torch\n"
        "facts = cuda_plan.DeviceFacts(interpreted=False, num_sms=132, capability=(9, 0), pdl=True)\n"
        "assert cuda_plan.table_plan(64, 4, 7168, facts).kernel == 'token'\n"
        "assert npu_plan.forward_plan(7168, 8, torch.bfloat16).kernel == 'single_read'\n"
        "assert not [m for m in sys.modules if m.startswith('k3_ops.kernels.')], 'a kernel module was imported'\n"
        "assert bound == (getattr(k3_ops._C, 'set_cuda_kernels', None) is not None), bound\n"
        "assert bound or 'k3_ops.backends._launch' not in sys.modules, 'a plan module imported the launch step'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module", PLAN_MODULES)
def test_plan_module_imports_no_launch_code(module):
    # The same rule read from the source, so that it holds in a CUDA build too, where k3_ops binds the launch step.
    import ast
    from pathlib import Path

    import k3_ops.backends as backends

    tree = ast.parse((Path(backends.__file__).parent / f"{module}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            imported |= {base} | {f"{base}.{a.name}" if node.module else base + a.name for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    launch = {".cuda", ".npu", "._launch", "..kernels", "triton"}
    assert not {m for m in imported if m in launch or m.startswith(("..kernels.", "triton."))}, imported


def test_launch_table_is_its_rules():
    from k3_ops.backends import cuda_table as table

    assert set(table.LAUNCH_TABLE) == {(t, k) for t in table.T_BUCKETS for k in table.K_BUCKETS}
    for (t, k), config in table.LAUNCH_TABLE.items():
        assert config == table.table_entry(t, k), (t, k)
    for T, K, cell in ((1, 0, (1, 1)), (3, 5, (4, 6)), (129, 7, (256, 8)), (5000, 64, (1 << 62, 64)),
                       (1 << 40, 100, (1 << 62, 1 << 62))):
        assert table.table_config(T, K) is table.LAUNCH_TABLE[cell], (T, K)


def _facts(**kw):
    from k3_ops.backends import cuda_plan

    native = kw.pop("native", False)
    kw.setdefault("interpreted", False)
    kw.setdefault("num_sms", 132)
    return cuda_plan.DeviceFacts(cluster_threads=records.fake_cluster_threads if native else None,
                                 single_read_smem=records.fake_single_read_smem if native else None, **kw)


def test_device_facts_decide_what_the_table_entry_runs():
    """The cluster entry at T <= 4, K = 5..8 runs the cluster kernel only on an sm_90+ device with the CUDA build,
    else its split fallback; PDL follows the device's default; the rows grid follows its SM count."""
    from k3_ops.backends import cuda_plan

    hopper = _facts(capability=(9, 0), pdl=True, native=True)
    plan = cuda_plan.table_plan(4, 8, 7168, hopper)
    assert (plan.kernel, plan.cluster_size, plan.pdl, plan.fallback.kernel) == ("cluster", 8, True, "split")
    for other in (_facts(capability=(9, 0), pdl=True), _facts(capability=(8, 0), native=True),
                  _facts(interpreted=True, native=True)):
        assert cuda_plan.table_plan(4, 8, 7168, other) == plan.fallback, other
    rows = cuda_plan.table_plan(70000, 20, 7168, hopper)
    assert (rows.kernel, rows.ctas_per_sm, rows.pdl) == ("rows", 2, True)
    assert cuda_plan.forward_grid(rows, 70000, 114) == (228,) and cuda_plan.forward_grid(rows, 100, 132) == (100,)
    assert not cuda_plan.table_plan(70000, 20, 7168, _facts(capability=(9, 0), pdl=False)).pdl


def test_forward_constexprs_follow_the_plan_and_the_call():
    from k3_ops.backends import cuda_plan
    from k3_ops.backends.cuda_table import LaunchConfig

    facts = _facts(capability=(9, 0), pdl=True)
    plan = cuda_plan.resolve(2, 7168, facts, LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8, maxnreg=128))
    fused = dict(HAS_ADDEND=True, FUSED=True, SNAPSHOT=False, OUT_NORM=True)
    c = cuda_plan.forward_constexprs(plan, 7168, 8, False, fused, False, interpreted=False)
    assert (c["BLOCK_H"], c["ROWS"], c["H_EXACT"], c["VEC"], c["num_warps"], c["maxnreg"]) == (8192, 2, 7168, 8, 8, 128)
    assert c["ONE_TILE"] and c["ONW_AHEAD"] and c["USE_PDL"] and c["launch_pdl"] and c["enable_fp_fusion"]
    plain = cuda_plan.forward_constexprs(plan, 7168, 1, True, {}, True, interpreted=True)
    assert "ONW_AHEAD" not in plain and "maxnreg" not in plain, "no output norm; no register cap in the interpreter"
    assert plain["ACC64"] and plain["H_STRIDED"] and plain["VEC"] == 1
    split = cuda_plan.resolve(8, 7168, facts, LaunchConfig(kernel="split", chunk=512))
    assert (split.p, split.p_pad, split.k_pad) == (14, 16, 16)
    assert cuda_plan.forward_grid(split, 3, 132) == (14, 3)
