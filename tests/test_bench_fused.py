"""The fused benchmark's CPU smoke configuration runs and writes its JSON (timings are not asserted)."""
from __future__ import annotations

import json

from k3_ops import bench_fused


def test_bench_fused_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "fused.json"
    result = bench_fused.main(["--device", "cpu", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"]
    assert [(r["T"], r["K"]) for r in saved["rows"]] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    for r in saved["rows"]:
        assert set(r["us"]) == {"fused_wall", "unfused_wall"} and all(v > 0 for v in r["us"].values())
    assert "speedup" in capsys.readouterr().out
