"""The vLLM general plugin, loaded the way vLLM loads it: through
``importlib.metadata.entry_points(group="vllm.general_plugins")`` (vLLM itself pins another torch and is not
installed here: tests/test_vllm_real.py runs against it, through tools/check_vllm.sh). register() must be
idempotent, thread-safe, log once per process through a ``vllm.``-prefixed logger, and never raise for a bad module
name; the drop-ins must have vLLM 0.33's contract (in-place prefix, snapshot, FP32-mix norm, FP8 pair).
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
from k3_ops import reference, vllm_plugin

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
    monkeypatch.delenv(vllm_plugin.LEGACY_PATCH_ENV, raising=False)
    return vllm_plugin


def test_entry_point_resolves_to_register():
    ep = plugin_entry_point()
    assert ep.value == "k3_ops.vllm_plugin:register"
    assert ep.load() is vllm_plugin.register


def test_register_twice_logs_once(fresh_plugin, caplog):
    caplog.set_level(logging.INFO, logger=vllm_plugin.LOGGER_NAME)
    assert vllm_plugin.LOGGER_NAME.startswith("vllm."), "vLLM shows only its own logger's children"
    plugin_entry_point().load()()
    plugin_entry_point().load()()
    records = [r for r in caplog.records if LOG_MARK in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert "kimi_k3::fused_attn_res" in records[0].getMessage()
    assert "kimi_k3::fused_attn_res_" in records[0].getMessage()
    assert records[0].name == "vllm.k3_ops"


def test_register_from_many_threads_logs_once(fresh_plugin, caplog):
    caplog.set_level(logging.INFO, logger=vllm_plugin.LOGGER_NAME)
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
def test_drop_in_without_keywords_is_the_op(sample: Sample):
    args = sample.make("cpu")
    norm = _VllmRMSNorm(args["norm_weight"], 1e-5)
    proj = _ReplicatedLinear(args["proj_weight"].reshape(1, sample.H))
    got = vllm_plugin.apply_attn_res(args["prefix_sum"], args["block_residual"], proj, norm, sample.K)
    want = k3_ops.attn_res(args["prefix_sum"], args["block_residual"], norm.weight, proj.weight, sample.K, 1e-5)
    assert torch.equal(got, want)


# --- vLLM 0.33's contract (the real kernels are compared in tests/test_vllm_real.py) -----------------------
def _vllm_call(T=5, K=3, C=5, H=64, dtype=torch.bfloat16, seed=0):
    args = Sample(T=T, K=K, cap=C, H=H, dtype=dtype).make("cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    delta = torch.randn(T, H, generator=g).to(dtype)
    onw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return args, delta, onw


@pytest.mark.parametrize("quant_dtype", [None, torch.float8_e4m3fn, torch.float8_e4m3fnuz],
                         ids=["noquant", "e4m3fn", "e4m3fnuz"])
@torch.no_grad()
def test_attn_res_has_vllms_contract(quant_dtype):
    """attn_res(prefix, delta, blocks, ...): prefix updated in place with torch's own add, the snapshot row equal
    to it, out the FP32-mix norm (the reference's round_mix=False), and the (q, scale) pair with quant_dtype."""
    args, delta, onw = _vllm_call()
    prefix, blocks = args["prefix_sum"], args["block_residual"]
    expected_prefix = prefix + delta
    ref_blocks = blocks.clone()
    want = reference.fused_attn_res_inplace_reference(prefix.clone(), delta, ref_blocks, args["norm_weight"],
                                                      args["proj_weight"].reshape(-1), 3, 1e-6, 3, onw, 1e-5,
                                                      round_mix=False, out_dtype=quant_dtype)
    got = vllm_plugin.attn_res(prefix, delta, blocks, args["norm_weight"], args["proj_weight"].reshape(-1), onw,
                               num_blocks=3, block_write_idx=3, eps=1e-6, output_norm_eps=1e-5,
                               quant_dtype=quant_dtype)
    assert torch.equal(prefix, expected_prefix), "prefix must hold round(prefix + delta) afterwards"
    assert torch.equal(blocks[:, 3], expected_prefix) and torch.equal(blocks.nan_to_num(9), ref_blocks.nan_to_num(9))
    if quant_dtype is None:
        assert isinstance(got, torch.Tensor) and torch.equal(got, want[0])
    else:
        q, scale = got
        assert q.dtype == quant_dtype and scale.shape == (5, 1) and scale.dtype == torch.float32
        assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1])


@torch.no_grad()
def test_attn_res_forms_the_model_uses():
    """The call forms of nvidia/model.py: the first layer (no delta, K = 0, snapshot, norm), the aux-stream and
    final mixes (no norm, output_norm_eps=0.0 with no weight), and the mix alone, which is the plain op."""
    args, delta, onw = _vllm_call(K=0)
    prefix, blocks = args["prefix_sum"], args["block_residual"]
    before = prefix.clone()
    out = vllm_plugin.attn_res(prefix, None, blocks, args["norm_weight"], args["proj_weight"].reshape(-1), onw,
                               num_blocks=0, block_write_idx=0, eps=1e-6, output_norm_eps=1e-5)
    assert torch.equal(prefix, before) and torch.equal(blocks[:, 0], before)
    assert torch.equal(out, reference.rms_norm_reference(before, onw, 1e-5))  # K = 0: the norm of the prefix
    args, delta, onw = _vllm_call(K=4, C=4)
    prefix, blocks = args["prefix_sum"], args["block_residual"]
    final = vllm_plugin.attn_res(prefix, delta, blocks, args["norm_weight"], args["proj_weight"].reshape(-1), None,
                                 num_blocks=4, block_write_idx=-1, eps=1e-6, output_norm_eps=0.0)
    assert torch.equal(final, k3_ops.attn_res(prefix, blocks, args["norm_weight"], args["proj_weight"], 4, 1e-6))
    mix_only = vllm_plugin.attn_res(prefix, None, blocks, args["norm_weight"], args["proj_weight"].reshape(-1), None,
                                    4, -1, 1e-6, 0.0)
    assert torch.equal(mix_only, final)


class _ScaleDesc:
    def __init__(self, dtype, static, group_shape):
        self.dtype, self.static, self.group_shape = dtype, static, group_shape


class _QuantKey:
    """Shaped like vLLM's QuantKey (dtype, scale, scale2, symmetric)."""

    def __init__(self, dtype=torch.float8_e4m3fn, static=False, group_shape=(1, -1), symmetric=True, scale2=None):
        self.dtype, self.scale, self.scale2, self.symmetric = dtype, _ScaleDesc(torch.float32, static,
                                                                                 group_shape), scale2, symmetric


@pytest.mark.parametrize("key, fused", [
    (None, None),
    (_QuantKey(), torch.float8_e4m3fn),  # kFp8DynamicTokenSym
    (_QuantKey(torch.float8_e4m3fnuz), torch.float8_e4m3fnuz),  # the same on an fnuz platform
    (_QuantKey(static=True, group_shape=(-1, -1)), None),  # kFp8StaticTensorSym
    (_QuantKey(group_shape=(-1, -1)), None),  # kFp8DynamicTensorSym
    (_QuantKey(group_shape=(1, 128)), None),  # per-group
    (_QuantKey(symmetric=False), None),
    (_QuantKey(torch.int8), None),
], ids=["none", "fp8-dynamic-token", "fnuz-dynamic-token", "static-tensor", "dynamic-tensor", "group", "asym",
        "int8"])
def test_quant_keys(key, fused):
    assert vllm_plugin.fp8_dtype_of(key) == fused


@torch.no_grad()
def test_apply_attn_res_with_vllms_keywords():
    """_apply_attn_res's keyword-only arguments, as the K3 layer passes them: delta, output_norm, block_write_idx and
    quant_key; the same as attn_res with the modules' weights and epsilons, the FP8 pair for the FP8 key."""
    args, delta, onw = _vllm_call()
    norm, out_norm = _VllmRMSNorm(args["norm_weight"], 1e-6), _VllmRMSNorm(onw, 1e-5)
    proj = _ReplicatedLinear(args["proj_weight"].reshape(1, 64))
    for key in (None, _QuantKey()):
        p1, b1 = args["prefix_sum"].clone(), args["block_residual"].clone()
        p2, b2 = args["prefix_sum"].clone(), args["block_residual"].clone()
        got = vllm_plugin.apply_attn_res(p1, b1, proj, norm, 3, delta=delta, output_norm=out_norm, block_write_idx=3,
                                         quant_key=key)
        want = vllm_plugin.attn_res(p2, delta, b2, norm.weight, proj.weight.squeeze(0), out_norm.weight, 3, 3, 1e-6,
                                    1e-5, quant_dtype=vllm_plugin.fp8_dtype_of(key))
        assert torch.equal(p1, p2) and torch.equal(b1.nan_to_num(9), b2.nan_to_num(9))
        if key is None:
            assert torch.equal(got, want)
        else:
            assert isinstance(got, tuple) and all(torch.equal(g.view(torch.uint8), w.view(torch.uint8))
                                                  for g, w in zip(got, want))


# --- patching model modules --------------------------------------------------------------------------------
def _fake_module(name: str, monkeypatch, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _original(*args, **kwargs):
    raise AssertionError("the model's own function must have been replaced")


def test_env_patch_replaces_attn_res_of_the_nvidia_model_layout(fresh_plugin, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module = _fake_module("fake_kimi_k3_nvidia_model", monkeypatch, attn_res=_original)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, f" {module.__name__} ,")
    fresh_plugin.register()
    assert module.attn_res is fresh_plugin.attn_res
    assert "patched fake_kimi_k3_nvidia_model.attn_res" in caplog.text
    assert fresh_plugin.patch_attn_res(module) == "attn_res" and module.attn_res is fresh_plugin.attn_res


def test_env_patch_prefers_apply_attn_res(fresh_plugin, monkeypatch):
    # The AMD layout defines both (it imports its ops module's attn_res): the module-taking helper is replaced.
    module = _fake_module("fake_kimi_k3_amd_linear", monkeypatch, attn_res=_original, _apply_attn_res=_original)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, module.__name__)
    fresh_plugin.register()
    assert module._apply_attn_res is fresh_plugin.apply_attn_res_vllm and module.attn_res is _original


def test_legacy_variable_still_patches(fresh_plugin, monkeypatch, caplog):
    module = _fake_module("fake_old_style_model", monkeypatch, _apply_attn_res=_original)
    monkeypatch.setenv(fresh_plugin.LEGACY_PATCH_ENV, module.__name__)
    fresh_plugin.register()
    assert module._apply_attn_res is fresh_plugin.apply_attn_res_vllm
    assert "K3_OPS_PATCH_APPLY_ATTN_RES is the old name of K3_OPS_PATCH_ATTN_RES" in caplog.text


@pytest.mark.parametrize("name, message", [
    ("fake_model_without_either", r"K3_OPS_PATCH_ATTN_RES names module 'fake_model_without_either', which defines "
                                  r"neither _apply_attn_res nor attn_res .*set K3_OPS_PATCH_ATTN_RES to the module"),
    ("no_such_module_k3", r"K3_OPS_PATCH_ATTN_RES names module 'no_such_module_k3', which cannot be imported .*"
                          r"vllm.models.kimi_k3.nvidia.model"),
], ids=["no-attribute", "no-module"])
def test_bad_patch_target_is_logged_not_raised(fresh_plugin, monkeypatch, caplog, name, message):
    """vLLM's loader does not catch plugin errors: a bad module name must not kill the engine. register() logs an
    error naming the module, the attributes and the variable, registers the ops, and patches the other modules."""
    import re

    if name == "fake_model_without_either":
        _fake_module(name, monkeypatch)
    good = _fake_module("fake_good_model", monkeypatch, attn_res=_original)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, f"{name},fake_good_model")
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    fresh_plugin.register()  # no exception
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and re.search(message, errors[0].getMessage()), [r.getMessage() for r in caplog.records]
    assert good.attn_res is fresh_plugin.attn_res and fresh_plugin._registered
    with pytest.raises(AttributeError if name.startswith("fake") else ImportError, match=message):
        fresh_plugin.patch_attn_res(name)
