"""The order of the CUDA kernels' stores against their reductions (the per-token kernel, the rows kernel), read
from their Triton IR compiled for sm_90 without a GPU (``tools/ptxas_info.py --store-order``).

A program may overwrite memory it reads only after every warp has loaded its copy: a row tensor can be held by
several warps at once (a replicated layout: 128 columns over 256 threads put each element in two), and what
guarantees that each warp has loaded the row is a cross-warp reduction of it, which no warp leaves before all have
entered it. The in-place prefix of ``fused_attn_res_`` is such a store. The one-tile plan once stored it at its
load, and the GPU suite caught the addend added twice, in one run of one test (docs/benchmarks.md, "Where the
remaining gap goes"): a race shows on the device only sometimes and under the interpreter never. Stores into
memory the kernel never reads (new_prefix, the snapshot slot >= K) may come first, and the one-tile plan puts them
there on purpose (they drain while the tile is reduced).

Runs in a subprocess: the pytest process runs Triton in interpreter mode. Skips where this triton has no ptxas
for sm_90 (the compile goes through it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
TOOL = Path(__file__).resolve().parent.parent / "tools" / "ptxas_info.py"


@pytest.fixture(scope="module")
def order() -> dict:
    """{variant: [[kind, IR line, [pointer arguments it derives from]], ...]} in program order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(TOOL), "--store-order"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    if report["ptxas"] is None:
        pytest.skip(f"triton {report['triton']} has no CUDA ptxas for sm_90")
    return report["cases"]


def _stores(events: list, pointer: str) -> list[int]:
    return [line for kind, line, roots in events if kind == "store" and roots == [pointer]]


def _first_reduce(events: list, pointer: str | None = None) -> int:
    return min(line for kind, line, roots in events if kind == "reduce" and (pointer is None or pointer in roots))


@pytest.mark.parametrize("variant", ["one-tile-inplace", "tiles-inplace", "rows-inplace"])
def test_inplace_prefix_is_stored_after_a_reduction_of_the_prefix_row(order, variant):
    events = order[variant]
    stores = _stores(events, "prefix_ptr")
    assert len(stores) == 1, events  # the updated prefix, once
    assert stores[0] > _first_reduce(events, "prefix_ptr"), (
        f"{variant}: the in-place prefix is stored before any warp-wide reduction of the row it overwrites")


def test_one_tile_stores_new_prefix_and_snapshot_before_reducing(order):
    events = order["one-tile-fused"]
    new_prefix, snapshot = _stores(events, "newp_ptr"), _stores(events, "blocks_ptr")
    assert len(new_prefix) == 1 and len(snapshot) == 1, events
    first = _first_reduce(events)
    assert new_prefix[0] < first and snapshot[0] < first, events
    # and in the in-place variant the snapshot stays early too: only the prefix waits for the reductions
    inplace = order["one-tile-inplace"]
    assert _stores(inplace, "blocks_ptr")[0] < _first_reduce(inplace), inplace


def test_every_variant_stores_its_output_last(order):
    # The output row is the end of the chain: a store after it would be a value computed after the output.
    for variant, events in order.items():
        stores = [(line, roots) for kind, line, roots in events if kind == "store"]
        assert stores and stores[-1][1] == ["out_ptr"], (variant, events)
