"""The README's main job runs on a machine without a GPU: real checks, then the benchmark, and it ends with the files
it wrote and its verdict, with the bench extra (matplotlib: plots) and without it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import k3_ops
from k3_ops import __main__ as main_job
from k3_ops import devices, reference
from k3_ops.bench import cli as bench_cli

ROOT = Path(__file__).resolve().parent.parent

SECTIONS = ("mix", "fused", "layer", "host", "train", "model")


@pytest.mark.parametrize("extra", ["with-bench-extra", "without-bench-extra"])
def test_main_job_on_cpu_checks_pass_and_reports_its_files(tmp_path, capsys, monkeypatch, extra):
    if extra == "with-bench-extra":
        pytest.importorskip("matplotlib", reason="the bench extra is not installed: the other case runs the job")
    else:
        # As on a machine without the bench extra (matplotlib, tqdm): importing them fails.
        for package in ("matplotlib", "tqdm"):
            for name in [m for m in sys.modules if m.startswith(package + ".")] + [package]:
                monkeypatch.setitem(sys.modules, name, None)
    assert main_job.main(["--device", "cpu", "--", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "graph breaks: 0" in out
    assert out.count(" ok") >= 5  # one line per numerics case, one for the training check
    assert "check: training a Kimi-K3-shaped stack" in out
    assert "not a kernel benchmark" in out and "CPU thread" in out  # CPU rows say what they are
    tail = out.rstrip().splitlines()[-4:]
    assert tail[-1] == "ALL CHECKS PASSED"
    assert tail[0] == "benchmark results (JSON): " + ", ".join(str(tmp_path / f"{s}.json") for s in SECTIONS)
    assert tail[1] == "benchmark tables (Markdown): " + ", ".join(str(tmp_path / f"{s}.md") for s in SECTIONS)
    for section in SECTIONS:
        assert json.loads((tmp_path / f"{section}.json").read_text())["section"] == section
    if extra == "with-bench-extra":
        assert tail[2] == f"benchmark plots (PNG): {tmp_path / 'mix.png'}, {tmp_path / 'fused.png'}"
        assert (tmp_path / "mix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert tail[2].startswith("benchmark plots (PNG): none (matplotlib is not installed")
        assert not list(tmp_path.glob("*.png"))


def test_main_job_summary_without_the_benchmark_is_the_verdict():
    assert main_job.summary(True, {}, ran_bench=False) == ["ALL CHECKS PASSED"]
    assert main_job.summary(False, {}, ran_bench=False) == ["SOME CHECKS FAILED"]


def test_main_job_help_says_what_it_runs_writes_takes_and_what_success_is(capsys):
    with pytest.raises(SystemExit) as exit_:
        main_job.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for words in ("torch.compile", "float64 truth", "python -m k3_ops.bench", "what it writes:", "<section>.json",
                  "how long:", "s on a 2-core x86-64 CPU", "minutes on one H100", "success:", "ALL CHECKS PASSED",
                  "exit status 1", "exit status 2", "benchmark options:"):
        assert words in text, words


def _cpu_time(text: str) -> str:
    found = re.search(r"about (\d+ s) on a 2-core x86-64 CPU \((\d+ s) measured", " ".join(text.split()))
    assert found, "no measured 2-core CPU time"
    return found.group(1) + " / " + found.group(2)


def test_help_and_readme_state_the_same_measured_times(capsys):
    """The README and --help give the same figures for the main job: the CPU time and the H100 time at its
    commit; the two commands' --device help is one text."""
    with pytest.raises(SystemExit):
        main_job.main(["--help"])
    text = capsys.readouterr().out
    readme = (ROOT / "README.md").read_text()
    assert _cpu_time(text) == _cpu_time(readme)
    h100 = re.search(r"\d+ s at `?([0-9a-f]{7})", " ".join(text.split()))
    assert h100 and h100.group(0).replace("`", "") in readme.replace("`", "")
    assert devices.DEVICE_HELP in " ".join(text.split())
    bench_help = bench_cli.parser().format_help()
    assert devices.DEVICE_HELP in " ".join(bench_help.split())


#: A small accuracy case, so that the failing checks below run in well under a second.
SMALL = {"cases": ((4, 2, 3, "token"), (3, 1, 3, "block")), "hidden": 256}


def _off_by_one_percent(*args):
    return k3_ops.attn_res(*args) * 1.01


def _reads_the_nan_capacity(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
    return reference.attn_res_reference(prefix_sum, block_residual, norm_weight, proj_weight,
                                        block_residual.size(1), eps)


@pytest.mark.parametrize("own_kernels", [False, True], ids=["cpu-rule-bound", "device-rule-vs-formula"])
def test_accuracy_check_passes_the_op_and_says_its_rule(capsys, own_kernels):
    assert main_job.check_numerics(torch.device("cpu"), own_kernels=own_kernels, **SMALL)
    out = capsys.readouterr().out
    assert "rule:" in out or "its own error:" in out
    assert ("1.25 x those of the plain FP32 formula" in out) == own_kernels
    assert ("half a bf16 ulp" in out) != own_kernels
    assert out.count("-> ok") == len(SMALL["cases"]) and "FAIL" not in out


@pytest.mark.parametrize("op", [_off_by_one_percent, _reads_the_nan_capacity], ids=["off-by-1pct", "reads-nan"])
@pytest.mark.parametrize("own_kernels", [False, True], ids=["cpu-rule-bound", "device-rule-vs-formula"])
def test_accuracy_check_fails_a_wrong_op(capsys, op, own_kernels):
    """On the CPU the op is the formula, so the check bounds its error by itself; a wrong op fails either rule."""
    assert not main_job.check_numerics(torch.device("cpu"), op, own_kernels=own_kernels, **SMALL)
    out = capsys.readouterr().out
    assert out.count("-> FAIL") == len(SMALL["cases"])


def test_main_job_says_some_checks_failed_and_exits_1(capsys, monkeypatch):
    check = main_job.check_numerics
    monkeypatch.setattr(main_job, "check_numerics", lambda device: check(device, _off_by_one_percent, **SMALL))
    monkeypatch.setattr(main_job, "check_compile", lambda device: True)
    assert main_job.main(["--device", "cpu", "--no-bench"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "SOME CHECKS FAILED" and any(line.endswith("-> FAIL") for line in out)


def _missing(device: str) -> bool:
    return devices.unavailable(device) is not None


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    pytest.param("npu", marks=pytest.mark.skipif(not _missing("npu"), reason="this machine has an NPU")),
])
@pytest.mark.parametrize("module", ["k3_ops", "k3_ops.bench"])
def test_a_device_this_machine_lacks_is_one_line_and_exit_status_2(module, device):
    run = subprocess.run([sys.executable, "-m", module, "--device", device], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m {module}: --device {device} needs "), lines


def test_a_torch_npu_that_fails_to_import_is_named(monkeypatch, tmp_path):
    """torch_npu installed without the Ascend runtime fails at import: said in the one line, not raised."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        'raise OSError("libascendcl.so: cannot open shared object file: No such file or directory")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    problem = devices.unavailable("npu")
    assert problem.startswith("--device npu needs torch_npu and an Ascend NPU (pip install torch_npu")
    assert problem.endswith("; torch_npu does not import (OSError: libascendcl.so: cannot open shared object file: "
                            "No such file or directory)")
    assert "\n" not in problem


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "argument --device: must be one of cpu, cuda, npu with an optional index"),
    (["--out", "x"], "unrecognized arguments: --out x: benchmark options go after '--' (python -m k3_ops -- --out x)"),
    (["--no-bench", "--", "--quick"], "the options after '--' (--quick) are the benchmark's, which --no-bench skips"),
    (["--device", "cpu", "--", "--hidden", "0"], "argument --hidden: must be an integer >= 1, got '0'"),
], ids=["device", "bench-option-before-dashes", "no-bench-with-options", "bad-bench-option"])
def test_main_job_rejects_bad_options_before_running(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(main_job, "check_numerics", lambda device: pytest.fail("ran before its options were checked"))
    with pytest.raises(SystemExit) as exit_:
        main_job.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
