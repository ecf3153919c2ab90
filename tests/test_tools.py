"""The maintainer tools in tools/ (README.md, "Tools"), exercised without a GPU or a vLLM install.

Each tool answers ``--help``; the shell tools parse (``bash -n``) and have a dry run that prints what they would run;
``tools/gpu_run.sh``'s test stages run for real on two tiny pytest files of their own, so that its stage loop, its
per-file summary lines and its exit status are checked on CPU. ``tools/ptxas_info.py``'s compile paths are tested by
tests/test_register_budget.py and tests/test_store_order.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
SHELL_TOOLS = ("gpu_run.sh", "check_vllm.sh")
GPU_STAGES = ("build", "tests", "ptests", "job", "bench", "pack")


def tools() -> list[str]:
    """The files in tools/ (bytecode caches and hidden files aside: importing ptxas_info.py leaves a __pycache__)."""
    return sorted(p.name for p in TOOLS.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))


def run(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_tools_folder_holds_only_the_listed_tools():
    # A new tool gets a README line and a test here; a one-off probe does not belong in tools/.
    assert tools() == sorted([*SHELL_TOOLS, "ptxas_info.py"])


def test_readme_lists_every_tool():
    readme = (ROOT / "README.md").read_text()
    for tool in tools():
        assert re.search(rf"\|\s*`tools/{re.escape(tool)}", readme), f"README.md's tools table lacks {tool}"


@pytest.mark.parametrize("tool", SHELL_TOOLS)
def test_shell_tool_parses(tool):
    r = run("bash", "-n", str(TOOLS / tool))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("tool", SHELL_TOOLS)
def test_shell_tool_help(tool):
    r = run("bash", str(TOOLS / tool), "--help")
    assert r.returncode == 0, r.stderr
    assert f"tools/{tool}" in r.stdout and "--dry-run" in r.stdout, r.stdout


def test_gpu_run_help_names_every_stage():
    text = run("bash", str(TOOLS / "gpu_run.sh"), "--help").stdout
    for stage in GPU_STAGES:
        assert re.search(rf"^  {stage} ", text, re.M), (stage, text)


def test_gpu_run_dry_run_prints_each_stage_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    r = run("bash", str(TOOLS / "gpu_run.sh"), "--dry-run", *GPU_STAGES, env={"OUT": str(out)})
    assert r.returncode == 0, r.stdout + r.stderr
    for stage in GPU_STAGES:
        assert f"=== {stage}\n  + " in r.stdout, (stage, r.stdout)
        assert re.search(rf"^{stage} +\d+ s  ok$", r.stdout, re.M), (stage, r.stdout)
    assert "python -m k3_ops" not in r.stdout  # commands go through $PY, printed unexpanded
    assert "$PY -m k3_ops -- --out" in r.stdout and "$PY -m k3_ops.bench --out" in r.stdout
    assert "K3_OPS_PDL=$pdl" in r.stdout and "for pdl in 1 0" in r.stdout
    assert not out.exists()


@pytest.mark.parametrize("args", [["bogus"], ["--bogus"]], ids=["unknown-stage", "unknown-option"])
def test_gpu_run_rejects_unknown_words(args, tmp_path):
    r = run("bash", str(TOOLS / "gpu_run.sh"), *args, env={"OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and "unknown" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


def _tiny_tests(folder: Path, fail: bool, hang: bool = False) -> list[Path]:
    folder.mkdir()
    ok = folder / "test_ok.py"
    ok.write_text("import os\n\n\ndef test_pdl_setting():\n    assert os.environ['K3_OPS_PDL'] in ('0', '1')\n")
    files = [ok]
    if fail:
        bad = folder / "test_bad.py"
        # With hang, a test after the failure outlives the timeout: pytest never prints its closing summary.
        bad.write_text("import time\n\n\ndef test_fails():\n    assert False\n"
                       + ("\n\ndef test_hangs():\n    time.sleep(600)\n" if hang else ""))
        files.append(bad)
    return files


@pytest.mark.parametrize("fail, hang", [(False, False), (True, False), (True, True)],
                         ids=["all-pass", "one-file-fails", "fails-then-times-out"])
def test_gpu_run_ptests_runs_each_file_with_pdl_on_and_off(tmp_path, fail, hang):
    files = _tiny_tests(tmp_path / "t", fail, hang)
    out = tmp_path / "out"
    env = {"OUT": str(out), "PY": sys.executable, "TEST_FILES": " ".join(map(str, files)),
           "TEST_TIMEOUT": "20" if hang else "120"}
    r = run("bash", str(TOOLS / "gpu_run.sh"), "ptests", env=env, timeout=300)
    assert r.returncode == (1 if fail else 0), r.stdout + r.stderr
    for pdl in (0, 1):
        assert re.search(rf"^PDL={pdl} \S+test_ok\.py rc=0: 1 passed in ", r.stdout, re.M), r.stdout
        if fail:
            rc = "124" if hang else r"1: 1 failed in "
            assert re.search(rf"^PDL={pdl} \S+test_bad\.py rc={rc}", r.stdout, re.M), r.stdout
    # The failed test is named under its file's line, twice (PDL on and off), a killed run included; no other is.
    named = re.findall(r"^  failed: (\S+)$", r.stdout, re.M)
    assert len(named) == (2 if fail else 0) and all(n.endswith("/test_bad.py::test_fails") for n in named), r.stdout
    assert re.search(rf"^ptests +\d+ s  {'FAILED' if fail else 'ok'}", r.stdout, re.M), r.stdout
    assert len(list((out / "ptests").glob("pdl*.log"))) == 2 * len(files)


def test_check_vllm_dry_run_names_its_venv_and_tests(tmp_path):
    venv = tmp_path / "vllm-venv"
    r = run("bash", str(TOOLS / "check_vllm.sh"), "--dry-run", "-k", "plugin", env={"K3_OPS_VLLM_VENV": str(venv)})
    assert r.returncode == 0, r.stderr
    assert f"venv: {venv} (to create)" in r.stdout
    assert "vllm==0.33.0" in r.stdout
    assert re.search(r"-m vllm .*tests/test_vllm_real\.py -k plugin$", r.stdout, re.M), r.stdout
    assert (ROOT / "tests" / "test_vllm_real.py").is_file()
    assert not venv.exists()


def test_ptxas_info_help():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(TOOLS / "ptxas_info.py"), "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    for flag in ("--json", "--store-order", "--schedule", "--counts"):
        assert flag in r.stdout, r.stdout
