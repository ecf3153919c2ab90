"""The kimi_k3 ops under DTensor (k3_ops/_sharding.py): every rule against the single-process op, on gloo groups
of 2 and 4 CPU processes, and docs/distributed.md's table against the rule data.

Each multi-process test spawns one group that runs a list of check groups (tests/distributed_checks.py) and writes
one report per rank; the test fails naming every failing check of every rank.
"""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

import k3_ops  # noqa: F401

from conftest import spawn_bounded

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: A group that has not finished by then is killed and its test fails (a hung collective never hangs the suite).
SPAWN_TIMEOUT_S = 300


def _distributed_ok() -> tuple[bool, str]:
    import torch.distributed as dist

    if not dist.is_available():
        return False, "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return False, "torch.distributed has no gloo backend in this torch build"
    try:
        from torch.distributed.tensor.experimental import register_sharding  # noqa: F401
    except ImportError:
        return False, "this torch has no torch.distributed.tensor.experimental.register_sharding"
    return True, ""


requires_gloo = pytest.mark.skipif("not __import__('test_distributed')._distributed_ok()[0]",
                                   reason="needs torch.distributed with gloo and DTensor's register_sharding")


def _spawn(world_size: int, groups: list[str], tmp_path) -> dict[int, dict[str, str]]:
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import distributed_checks

    out = tmp_path / "reports"
    out.mkdir()
    spawn_bounded(distributed_checks.worker, (world_size, str(tmp_path / "store"), str(out), groups), world_size,
                  SPAWN_TIMEOUT_S, f"{groups} on {world_size} processes")
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)}


def _assert_all_passed(reports: dict[int, dict[str, str]], expect: tuple[str, ...]) -> None:
    names = set(reports[0])
    for prefix in expect:
        assert any(n.startswith(prefix) for n in names), f"no check named {prefix}* ran: {sorted(names)}"
    failed = {f"rank {r}: {name}": why for r, rep in reports.items() for name, why in rep.items() if why}
    assert not failed, "\n".join(f"{k}\n    {v}" for k, v in failed.items())


@requires_gloo
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"world{n}")
def test_ops_under_dtensor(world_size, tmp_path):
    """attn_res forward and backward (autograd and the op itself), the serving overloads and the in-place op,
    replicated and token-sharded (token- and block-major banks, uneven splits, a rank without tokens), the placements
    served by redistributing and the ones rejected."""
    groups = ["forward_backward", "backward_op", "redistributed", "serving"]
    reports = _spawn(world_size, groups, tmp_path)
    _assert_all_passed(reports, ("attn_res-token", "attn_res-replicate", "attn_res_backward-token", "error-",
                                 "fused_attn_res-", "fused_attn_res.quant", "fused_attn_res.full", "fused_attn_res_-",
                                 "tp_all_reduce-"))


@requires_gloo
def test_compile_over_dtensor(tmp_path):
    """torch.compile(fullgraph=True) of a DTensor program calling the op (2 processes)."""
    _assert_all_passed(_spawn(2, ["compiled"], tmp_path), ("compile-",))


@requires_gloo
def test_every_overload_has_a_rule():
    from k3_ops import _sharding

    overloads = {s.name.removeprefix("kimi_k3::") + (f".{s.overload_name}" if s.overload_name else "")
                 for s in torch._C._jit_get_all_schemas() if s.name.startswith("kimi_k3::")}
    assert {r.op for r in _sharding.RULES} | set(_sharding.COLLECTIVES) == overloads
    assert set(_sharding.REGISTERED) == overloads


def test_docs_table_is_the_rule_data():
    from k3_ops import _sharding

    text = (ROOT / "docs" / "distributed.md").read_text()
    begin, end = "<!-- placements table: generated from k3_ops._sharding.RULES -->", "<!-- end of table -->"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0].strip() + "\n"
    assert table == _sharding.placements_table(), (
        "docs/distributed.md's table differs from the rules; regenerate it with "
        "python -c 'from k3_ops import _sharding; print(_sharding.placements_table())'")


@requires_gloo
def test_training_example_matches_one_process(tmp_path):
    """examples/train_dtensor.py on 4 processes (FSDP2 over dp=2, sequence / tensor parallel over tp=2, gloo): its
    loss curve equals the one-process model's within the example's stated tolerance, and the loss falls."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_dtensor

    out = tmp_path / "result.json"
    spawn_bounded(train_dtensor.worker, (4, str(tmp_path / "store"), str(out)), 4, SPAWN_TIMEOUT_S,
                  "the training example on 4 processes")
    result = json.loads(out.read_text())
    assert len(result["parallel"]) == len(result["single"]) == train_dtensor.STEPS
    assert result["worst_rel_diff"] <= train_dtensor.LOSS_RTOL, result
    assert result["parallel"][-1] < result["parallel"][0], result
