"""The vLLM general plugin, loaded the way vLLM loads it: through
``importlib.metadata.entry_points(group="vllm.general_plugins")`` (vLLM itself pins another torch and is not
installed here). register() must be idempotent, thread-safe and log once per process, in every process; the
``_apply_attn_res`` drop-in must equal the op with the module weights.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

import k3_ops
from k3_ops import vllm_plugin

from conftest import Sample

GROUP = "vllm.general_plugins"
LOG_MARK = "registered kimi_k3::attn_res"


def plugin_entry_point() -> importlib.metadata.EntryPoint:
    eps = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == "k3_ops"]
    assert len(eps) == 1, f"expected one k3_ops entry point in {GROUP}, got {eps}"
    return eps[0]


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin as a new process sees it: not registered yet."""
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    monkeypatch.delenv(vllm_plugin.PATCH_ENV, raising=False)
    return vllm_plugin


def test_entry_point_resolves_to_register():
    ep = plugin_entry_point()
    assert ep.value == "k3_ops.vllm_plugin:register"
    assert ep.load() is vllm_plugin.register


def test_register_twice_logs_once(fresh_plugin, caplog):
    caplog.set_level(logging.INFO, logger="k3_ops.vllm_plugin")
    plugin_entry_point().load()()
    plugin_entry_point().load()()
    records = [r for r in caplog.records if LOG_MARK in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert "kimi_k3::fused_attn_res" in records[0].getMessage()


def test_register_from_many_threads_logs_once(fresh_plugin, caplog):
    caplog.set_level(logging.INFO, logger="k3_ops.vllm_plugin")
    start = threading.Barrier(8)

    def call():
        start.wait()
        fresh_plugin.register()

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(LOG_MARK in r.getMessage() for r in caplog.records) == 1


# What vLLM's plugin loader does in each process: every plugin of the group, loaded and called; twice here.
_CHILD = textwrap.dedent(f"""
    import importlib.metadata, json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    for _ in range(2):
        for ep in importlib.metadata.entry_points(group={GROUP!r}):
            if ep.name == "k3_ops":
                ep.load()()
    import torch
    x = torch.randn(3, 16)
    blocks = torch.randn(3, 2, 16)
    out = torch.ops.kimi_k3.attn_res(x, blocks, torch.ones(16), torch.zeros(1, 16), 2, 1e-6)
    print(json.dumps({{"ok": bool(torch.allclose(out, (blocks.sum(1) + x) / 3, atol=1e-6))}}))
""")


def test_plugin_loads_in_fresh_processes():
    """Two processes at once, each loading the plugin twice: each logs once and can run the op."""
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"ok": True}
        assert err.count(LOG_MARK) == 1, err


class _VllmRMSNorm(torch.nn.Module):
    """Shaped like vLLM's RMSNorm: .weight [H] and .variance_epsilon."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.variance_epsilon = eps


class _ReplicatedLinear(torch.nn.Module):
    """Shaped like vLLM's ReplicatedLinear(H, 1, bias=False): .weight [1, H]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


@pytest.mark.parametrize("sample", [Sample(T=5, K=3, cap=4, H=64, dtype=torch.bfloat16),
                                    Sample(T=4, K=2, cap=3, H=32, dtype=torch.float32, layout="blockmajor")],
                         ids=lambda s: s.id)
@torch.no_grad()
def test_drop_in_equals_the_op_with_module_weights(sample: Sample):
    args = sample.make("cpu")
    norm = _VllmRMSNorm(args["norm_weight"], 1e-5)
    proj = _ReplicatedLinear(args["proj_weight"].reshape(1, sample.H))
    got = vllm_plugin.apply_attn_res(args["prefix_sum"], args["block_residual"], proj, norm, sample.K)
    want = k3_ops.attn_res(args["prefix_sum"], args["block_residual"], norm.weight, proj.weight, sample.K, 1e-5)
    assert torch.equal(got, want)


def test_env_patch_replaces_the_model_helper(fresh_plugin, monkeypatch):
    def original(prefix_sum, block_residual, proj, norm, num_valid_blocks):
        raise AssertionError("the model's own helper must have been replaced")

    model_module = types.ModuleType("fake_vllm_kimi_k3")
    model_module._apply_attn_res = original
    monkeypatch.setitem(sys.modules, model_module.__name__, model_module)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, f" {model_module.__name__} ,")
    fresh_plugin.register()
    assert model_module._apply_attn_res is fresh_plugin.apply_attn_res
    fresh_plugin.patch_apply_attn_res(model_module)  # again: still the drop-in
    assert model_module._apply_attn_res is fresh_plugin.apply_attn_res


def test_env_patch_of_a_module_without_the_helper_fails_loudly(fresh_plugin, monkeypatch):
    monkeypatch.setitem(sys.modules, "fake_model_without_helper", types.ModuleType("fake_model_without_helper"))
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "fake_model_without_helper")
    with pytest.raises(AttributeError, match=r"module fake_model_without_helper must define _apply_attn_res"):
        fresh_plugin.register()
    assert fresh_plugin._registered is False, "a failed registration must be retried by the next call"
