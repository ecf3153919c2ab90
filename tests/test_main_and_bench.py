"""The README's main job and the benchmark run on a machine without a GPU and report real checks."""
from __future__ import annotations

import json

import torch

from k3_ops import __main__ as main_job
from k3_ops import bench


def test_main_job_checks_pass_on_cpu(capsys):
    assert main_job.main(["--device", "cpu", "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "ALL CHECKS PASSED" in out and "graph breaks: 0" in out
    assert out.count(" ok") >= 4  # one line per numerics case


def test_bench_cpu_writes_results(tmp_path, capsys):
    result = bench.main(["--device", "cpu", "--tokens", "1,3", "--blocks", "0,2", "--hidden", "64",
                         "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["torch"] == torch.__version__
    assert [(r["T"], r["K"]) for r in saved["rows"]] == [(1, 0), (3, 0), (1, 2), (3, 2)]
    for r in saved["rows"]:
        assert set(r["us"]) == {"k3_ops", "eager"} and all(v > 0 for v in r["us"].values())
        assert r["bytes_moved"] == (r["K"] + 2) * r["T"] * 64 * 2
    assert result["rows"] == saved["rows"]
    assert "k3_ops us" in capsys.readouterr().out
