"""docs/benchmarks.md is what ``python -m k3_ops.bench report`` makes from the committed results in docs/data/ (no
figure edited by hand), within its length limit; the report puts each cell beside its floor, marks wide spreads,
and sets today's cells beside the public figures only where today's device is of the same type."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3_ops.bench import report

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
PUBLIC = DATA / "public_h100_2026-12-06.json"


def test_benchmarks_md_is_what_report_makes_from_docs_data():
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert committed == report.render_doc(DATA), (
        "docs/benchmarks.md differs from 'python -m k3_ops.bench report' of docs/data: regenerate it, never edit it")
    assert committed.count("\n") <= report.MAX_LINES


def test_report_check_mode(tmp_path, capsys):
    out = tmp_path / "benchmarks.md"
    report.main(["--data", str(DATA), "--out", str(out)])
    report.main(["--data", str(DATA), "--out", str(out), "--check"])
    assert "is up to date" in capsys.readouterr().out
    out.write_text(out.read_text().replace("|", "!", 1))
    with pytest.raises(SystemExit, match="differs from what 'python -m k3_ops.bench report' makes"):
        report.main(["--data", str(DATA), "--out", str(out), "--check"])


def test_public_figures_name_their_source_and_date():
    public = json.loads(PUBLIC.read_text())
    assert public["date"] == "2026-12-06" and "measured side by side" in public["source"]
    assert public["device_match"] == "H100"
    for key in ("mix_warm", "mix_cold", "fused_inplace_warm", "layer_inplace_warm", "host", "train"):
        assert public[key]["rows"], key
    for row in public["mix_warm"]["rows"] + public["mix_cold"]["rows"]:
        assert row["which"] in public["kernels"]
        assert row["speedup"] == pytest.approx(row["best"] / row["k3_ops"], abs=0.011)  # as published, rounded


@pytest.mark.parametrize("us, floor, wide, text", [
    (8.236, 7.1, False, "8.24 / 7.10 (0.86)"),
    (1234.5, None, True, "1234.5†"),
    (65432.0, 50000.0, False, "65,432 / 50,000 (0.76)"),
    (None, 3.0, False, "-"),
], ids=["floor", "wide-no-floor", "large", "missing"])
def test_cell_puts_the_time_beside_its_floor(us, floor, wide, text):
    assert report.cell(us, floor, wide) == text


def _gpu_results(device: str) -> dict:
    env = {"device": device, "sms": 132, "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
           "commit": "abc1234", "device_type": "cuda"}
    limits = {"copy_bandwidth_Bps": 3.0e12, "graph_node_us": 1.3, "l2_bytes": 50 * 2**20}
    params = {"dtype": "bf16", "hidden": 7168, "capacity": 9, "timing": "CUDA-graph replay", "l2": ["warm", "cold"]}

    def result(section, rows):
        return {"section": section, "title": section, "environment": env, "limits": limits, "params": params,
                "columns": [], "rows": rows, "notes": []}

    mix_rows = [{"layout": "token", "l2": l2, "T": T, "K": K, "us:k3_ops": us, "floor_us": 0.8 * us,
                 "spread:k3_ops": 0.3 if (T, K, l2) == (1, 1, "cold") else 0.01, "limit_frac": 0.9, "vs_compile": 3.0}
                for l2, scale in (("warm", 1.0), ("cold", 1.25)) for T in (1, 256) for K in (1, 4)
                for us in [scale * (2 + T * K / 64)]]
    fused_rows = [{"layout": "token", "l2": "warm", "T": T, "K": K, "us:k3_ops": 3.0 * T, "us:k3_ops_inplace": 2.5 * T,
                   "floor_us": 2.0 * T, "vs_unfused": 1.5} for T in (1, 8192) for K in (1,)]
    layer_rows = [{"layout": "token", "l2": l2, "T": T, "calls": 49, "us:k3_ops_inplace": 200.0 + T,
                   "us:k3_ops": 210.0 + T, "us:unfused": 400.0, "floor_us": 150.0, "limit_us": 120.0}
                  for l2 in ("warm", "cold") for T in (1, 512)]
    host_rows = [{"impl": "k3_ops", "call": c, "T": 1, "K": 8, "wall_us": w, "graph_us": 2.0, "ratio": w / 2,
                  "spread": 0.01} for c, w in (("torch.add", 6.0), ("attn_res", 9.5))]
    train_rows = [{"layout": "token", "T": 1024, "K": 8, "us:k3_ops": 200.0, "fwd_us:k3_ops": 60.0,
                   "bwd_us:k3_ops": 140.0, "bwd_bw:k3_ops": 0.8, "us:compile": 800.0}]
    return {"mix": result("mix", mix_rows), "fused": result("fused", fused_rows), "layer": result("layer", layer_rows),
            "host": result("host", host_rows), "train": result("train", train_rows)}


def _write(tmp_path: Path, results: dict) -> Path:
    for name, result in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    shutil.copy(PUBLIC, tmp_path / PUBLIC.name)
    return tmp_path


def test_report_of_a_gpu_run_on_the_same_device_type_sets_todays_cells_beside_the_public_ones(tmp_path):
    text = report.render_doc(_write(tmp_path, _gpu_results("NVIDIA H100 80GB HBM3")))
    lines = text.splitlines()
    assert lines[2] == ("_NVIDIA H100 80GB HBM3 (132 SMs) · torch 2.11.0+cu130 · triton 3.6.0 · CUDA 13.0 · "
                        "commit `abc1234`_")
    assert "Warm L2, token-major, us: k3_ops / floor (floor ÷ k3_ops):" in lines
    assert "Cold L2, token-major, us: k3_ops / floor (floor ÷ k3_ops):" in lines
    assert "| 256 | 6.00 / 4.80 (0.80) | 18.00 / 14.40 (0.80) |" in lines  # warm T = 256, K = 1 and 4
    assert "| 1 | 2.52† / 2.02 (0.80) | 2.58 / 2.06 (0.80) |" in lines  # cold, the wide spread marked
    intro = next(line for line in lines if line.startswith("Today's k3_ops cells"))
    assert intro.startswith("Today's k3_ops cells (NVIDIA H100 80GB HBM3, commit `abc1234`) beside them, from this "
                            "project's own harness")
    assert "not a same-run ratio" in intro
    # Public T = 256, K = 4 warm (8.24 then, 7.43 the best public) beside today's 18.00: 7.43 / 18.00 today.
    assert "| 1 | 1 | 2.02 | 2.67 (ATOM) | 1.32 | 2.02 | 1.32 |" in lines
    assert "| 256 | 4 | 8.24 | 7.43 (vLLM-AMD) | 0.90 | 18.00 | 0.41 |" in lines
    assert "| 256 | 4 | 11.15 | 11.66 (vLLM-NV) | 1.05 | 0.76 | 22.50 | 0.52 |" in lines  # cold, with the limit
    assert "| 1024 | 2 | 23.01 | 22.22 (vLLM-NV) | 0.97 | - | - |" in lines  # no such cell today
    assert "| 8192 | 1 | 210.8 | 212 | 1.01 | 20,480 |" in lines  # the in-place call today
    assert "| 512 | 1100 | 1074 | 0.98 | 712.0 |" in lines  # the in-place layer step today
    assert len(lines) <= report.MAX_LINES


def test_report_of_another_device_type_keeps_todays_cells_away_from_the_public_ones(tmp_path):
    text = report.render_doc(_write(tmp_path, _gpu_results("NVIDIA H200")))
    assert "Today's device (NVIDIA H200) is not an H100: no cell of today's run is set beside these." in text
    assert "k3_ops today" not in text
    assert "| 1 | 1 | 2.02 | 2.67 (ATOM) | 1.32 |" in text.splitlines()


def test_report_names_sections_from_another_run(tmp_path):
    results = _gpu_results("NVIDIA H100 80GB HBM3")
    results["train"]["environment"] = {**results["train"]["environment"], "commit": "fff0000"}
    text = report.render_doc(_write(tmp_path, results))
    assert "_(from another run: train; see each file's environment)_" in text


def test_report_refuses_a_page_over_its_limit_and_an_empty_directory(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no section results"):
        report.render_doc(tmp_path)
    monkeypatch.setattr(report, "MAX_LINES", 20)
    with pytest.raises(ValueError, match="more than 20: trim the grids"):
        report.render_doc(_write(tmp_path, _gpu_results("NVIDIA H100 80GB HBM3")))


def test_training_table_says_which_reference_failed_where():
    # A reference that raised in some cells (torch 2.11's Inductor on the formula at K = 2 and 4) leaves "-" there:
    # the page names the reference, its cells and the error, one line per (reference, error); other notes stay out.
    notes = ["MiB: peak memory of one forward + backward step",
             "compile failed at token-major T=1024 K=2: InductorError: AssertionError: ",
             "compile failed at token-major T=4096 K=4: InductorError: AssertionError: ",
             "eager failed at token-major T=16384 K=8: OutOfMemoryError: CUDA out of memory"]
    lines = report._failed_references(notes)
    assert lines == ["-: the compile reference failed to run at T/K = 1024/2, 4096/4 (InductorError: AssertionError:).",
                     "-: the eager reference failed to run at T/K = 16384/8 (OutOfMemoryError: CUDA out of memory).",
                     ""]
    assert report._failed_references(notes[:1]) == []
