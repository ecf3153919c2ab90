"""The launch table as a picture (``python -m k3_ops.bench plan``) and the launch-table cell alternatives
(``python -m k3_ops.bench variants``), on a machine without a GPU: the plans drawn are the launch policy's own, and
the alternatives replace one entry and put it back."""
from __future__ import annotations

import pytest
import torch

from k3_ops.backends import cuda
from k3_ops.bench import cli, plan, variants

NO_KERNELS = plan.DeviceFacts("H100", 132, (9, 0), False)
TOKENS = [1, 8, 16, 64, 128, 512, 1024, 4096, 16384]
BLOCKS = [1, 2, 4, 5, 8, 16]


def test_plan_without_the_native_kernels_is_the_policy_on_this_machine():
    """Without the CUDA C++ kernels the stand-in device must change nothing: the grid is exactly the policy's
    plans for this machine's device (the interpreter's, where the native kernels never run)."""
    grid = plan.table_plans(NO_KERNELS, TOKENS, BLOCKS)
    for (T, K), cell in grid.items():
        assert cell == plan.path_of(cuda.choose_config(T, K, 7168, torch.device("cpu"))), (T, K)
    assert not {p for p, _ in grid.values()} & {"cluster", "stream"}


def test_plan_with_the_native_kernels_takes_each_entry_or_its_fallback():
    grid = plan.table_plans(plan.H100, TOKENS, BLOCKS)
    for (T, K), (path, _) in grid.items():
        with variants.replaced_entry(T, K, None) as own:
            pass
        if own.kernel in ("cluster", "stream"):
            native = 1 <= K <= 8 and K >= own.min_k
            expected = own.kernel if native else plan.path_of(cuda.choose_config(T, K, 7168, torch.device("cpu"),
                                                                                   own.fallback))[0]
            assert path == expected, (T, K)
        else:
            assert path == plan.table_plans(NO_KERNELS, [T], [K])[(T, K)][0], (T, K)  # the facts change nothing
    assert "cluster" in {p for p, _ in grid.values()}  # the table does use it on an H100
    # The stand-in is gone afterwards: this machine's plans are the interpreter's again.
    assert cuda.choose_config(1, 8, 7168, torch.device("cpu")).kernel != "cluster"


def test_plan_writes_markdown_and_png(tmp_path, capsys):
    out = plan.main(["--out", str(tmp_path)])
    md = (tmp_path / "launch_table.md").read_text()
    assert md.count("\n## ") == 2 and "H100, sm_90, 132 SMs, with the CUDA C++ kernels" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2 * len(plan.TOKENS)
    assert all(line.count("|") == len(plan.BLOCKS) + 2 for line in rows)
    if "png" in out["written"]:
        assert (tmp_path / "launch_table.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "no launch_table.png" in capsys.readouterr().out


@pytest.mark.parametrize("text, cells", [("256x4", [(256, 4)]), ("256x4, 512X1,", [(256, 4), (512, 1)])],
                         ids=["one", "two-with-spaces"])
def test_parse_cells(text, cells):
    assert variants.parse_cells(text) == cells


@pytest.mark.parametrize("text, message", [("256", "a cell is TxK"), ("0x4", "T must be >= 1"), (",", "no cell")],
                         ids=["no-k", "zero-t", "empty"])
def test_parse_cells_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        variants.parse_cells(text)


@pytest.mark.parametrize("T, K", [(1, 1), (16, 8), (256, 4), (512, 8), (4096, 2), (16384, 8), (64, 12)],
                         ids=lambda v: str(v))
def test_alternatives_are_valid_plans_other_than_the_entry(T, K):
    with variants.replaced_entry(T, K, None) as own:
        pass
    alts = variants.alternatives(T, K, own)
    assert alts and own not in alts.values()
    for config in alts.values():
        plan_ = cuda.choose_config(T, K, 7168, torch.device("cpu"), config)  # resolves without error
        assert plan_.kernel in ("token", "rows", "split")  # the native ones fall back on this machine
        assert variants.short(config).startswith(f"(kernel={config.kernel!r}")
    assert ("cluster8" in alts) == (K <= 8 and T <= 512)
    assert ("split" in alts) == (T <= 16)


def test_replaced_entry_puts_the_entry_back_and_the_plans_follow():
    T, K = 256, 4
    before = cuda.choose_config(T, K, 7168, torch.device("cpu"))
    alt = variants.alternatives(T, K, None)["rows_w8_c1_s3"]
    with variants.replaced_entry(T, K, alt) as own:
        inside = cuda.choose_config(T, K, 7168, torch.device("cpu"))
        assert (inside.kernel, inside.num_warps, inside.ctas_per_sm) == ("rows", 8, 1)
    assert cuda.choose_config(T, K, 7168, torch.device("cpu")) == before
    with pytest.raises(RuntimeError, match="boom"), variants.replaced_entry(T, K, alt):
        raise RuntimeError("boom")
    with variants.replaced_entry(T, K, None) as again:
        assert again == own


def test_variants_dry_run_lists_each_cell_and_refuses_to_time_without_a_gpu(capsys):
    cli.main(["variants", "--cells", "256x4,16x8", "--dry-run", "--configs",
              '{"mine": {"kernel": "token", "rows_per_tile": 2, "num_warps": 4}}'])
    out = capsys.readouterr().out.splitlines()
    cells = [line for line in out if line.startswith("cell ")]
    assert [c.split(" (entry")[0] for c in cells] == ["cell T=256 K=4", "cell T=16 K=8"]
    assert any(line.startswith("  mine: (kernel='token', num_warps=4, rows_per_tile=2)") for line in out)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            cli.main(["variants", "--cells", "256x4"])
        assert "it needs a CUDA device" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_variants_time_a_cell_warm_and_cold_beside_its_entry(tmp_path):
    before = cuda.choose_config(64, 4, 1024, torch.device("cuda"))
    result = cli.main(["variants", "--cells", "64x4", "--calls", "plain,inplace", "--l2", "both", "--only",
                       "tiles4_w8,cluster8", "--floors", "--hidden", "1024", "--rep", "1", "--quick", "--out",
                       str(tmp_path)])["variants"]
    names = [r["variant"] for r in result["rows"] if r["call"] == "plain" and r["l2"] == "cold"]
    assert names[:4] == ["table", "tiles4_w8", "cluster8", "table_again"]
    assert any(n.startswith("floor_row_w8") for n in names)
    for r in result["rows"]:
        assert r["us"] > 0 and r["vs_table"] > 0
    assert (tmp_path / "variants.json").exists()
    assert cuda.choose_config(64, 4, 1024, torch.device("cuda")) == before  # the entry is back
