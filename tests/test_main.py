"""The README's main job runs on a machine without a GPU: real checks, then the benchmark, and it ends with the files
it wrote and its verdict, with the bench extra (matplotlib: plots) and without it."""
from __future__ import annotations

import json
import sys

import pytest

from k3_ops import __main__ as main_job

SECTIONS = ("mix", "fused", "layer", "host", "train")


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
    assert out.count(" ok") >= 4  # one line per numerics case
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
                  "how long:", "minutes on a 2-core CPU", "minutes on one H100", "success:", "ALL CHECKS PASSED",
                  "exit status 1"):
        assert words in text, words
