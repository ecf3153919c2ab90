"""The README's main job runs on a machine without a GPU: real checks, then the benchmark, and it says where the
benchmark's files are."""
from __future__ import annotations

import json

import pytest

from k3_ops import __main__ as main_job


def test_main_job_on_cpu_checks_pass_and_reports_its_files(tmp_path, capsys):
    assert main_job.main(["--device", "cpu", "--", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ALL CHECKS PASSED" in out and "graph breaks: 0" in out
    assert out.count(" ok") >= 4  # one line per numerics case
    tail = out.rstrip().splitlines()[-3:]
    assert tail[0].startswith("benchmark results (JSON): ")
    for section in ("mix", "fused", "layer", "host", "train"):
        path = tmp_path / f"{section}.json"
        assert str(path) in tail[0]
        assert json.loads(path.read_text())["section"] == section
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib (the bench extra) is not installed: no plots to check")
    assert tail[1] == f"benchmark plots (PNG): {tmp_path / 'mix.png'}, {tmp_path / 'fused.png'}"
    assert (tmp_path / "mix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

