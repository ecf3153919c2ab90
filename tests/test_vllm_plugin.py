"""The vLLM general plugin, loaded the way vLLM loads it: through
``importlib.metadata.entry_points(group="vllm.general_plugins")`` (vLLM itself pins another torch and is not
installed here: tests/test_vllm_real.py runs against it, through tools/check_vllm.sh). register() must be
idempotent, thread-safe, log once per process through a ``vllm.``-prefixed logger, and never raise for a setting,
however wrong; the drop-ins must have vLLM 0.33's contract (in-place prefix, snapshot, FP32-mix norm, FP8 pair).

The patching runs against module trees written to tmp_path with the real module and attribute names: vLLM-Ascend's
(it cannot be installed here: its build needs CANN) in the shapes of its release line, main line and the
vllm-ascend-kimi-k3 repository (tests/test_vllm_ascend.py cites the sources and commits), and vLLM's where a test
needs vLLM's layout next to it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import logging
import re
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

import k3_ops
from k3_ops import reference, vllm_plugin

from conftest import Sample, requires_cuda, requires_interpreter
from test_npu_simulated import simulated_npu  # noqa: F401  (the fixture)
from test_vllm_ascend import _ReplicatedLinear as _Proj
from test_vllm_ascend import _RMSNorm as _Norm
from test_vllm_ascend import define_chunk_residual_op

GROUP = "vllm.general_plugins"
LOG_MARK = "registered kimi_k3::attn_res"


def plugin_entry_point() -> importlib.metadata.EntryPoint:
    eps = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == "k3_ops"]
    assert len(eps) == 1, f"expected one k3_ops entry point in {GROUP}, got {eps}"
    return eps[0]


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin as a new process sees it: not registered yet, nothing pending; afterwards its import hook, the
    AscendC kernels it replaced and its once-per-process warning are undone."""
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    monkeypatch.setattr(vllm_plugin, "_latency_warned", False)
    monkeypatch.delenv(vllm_plugin.PATCH_ENV, raising=False)
    monkeypatch.delenv(vllm_plugin.LEGACY_PATCH_ENV, raising=False)
    vllm_plugin._ImportHook.forget()
    yield vllm_plugin
    vllm_plugin._ImportHook.forget()
    while vllm_plugin._op_libs:
        vllm_plugin._op_libs.pop()._destroy()


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


# --- patching: modules built in the test process -----------------------------------------------------------
def _fake_module(name: str, monkeypatch, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    monkeypatch.setitem(sys.modules, name, module)
    return module


# The model functions k3_ops replaces, with their real signatures and a body that fails if it ever runs.
def _vllm_attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx,
                   eps, output_norm_eps):
    raise AssertionError("vLLM's own attn_res ran: it must have been replaced")


def _vllm_apply_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks, *, delta=None, output_norm=None,
                         block_write_idx=-1, quant_key=None):
    raise AssertionError("vLLM's own _apply_attn_res ran: it must have been replaced")


def test_env_patch_replaces_attn_res_of_the_nvidia_model_layout(fresh_plugin, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module = _fake_module("fake_kimi_k3_nvidia_model", monkeypatch, attn_res=_vllm_attn_res)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, f" {module.__name__} ,")
    fresh_plugin.register()
    assert module.attn_res is fresh_plugin.attn_res
    assert "patched fake_kimi_k3_nvidia_model.attn_res" in caplog.text
    assert fresh_plugin.patch_attn_res(module) == ["attn_res"] and module.attn_res is fresh_plugin.attn_res


def test_env_patch_prefers_apply_attn_res(fresh_plugin, monkeypatch):
    # The AMD layout defines both (it imports its ops module's attn_res): the module-taking helper is replaced.
    module = _fake_module("fake_kimi_k3_amd_linear", monkeypatch, attn_res=_vllm_attn_res,
                          _apply_attn_res=_vllm_apply_attn_res)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, module.__name__)
    fresh_plugin.register()
    assert module._apply_attn_res is fresh_plugin.apply_attn_res_vllm and module.attn_res is _vllm_attn_res


def test_legacy_variable_still_patches(fresh_plugin, monkeypatch, caplog):
    module = _fake_module("fake_old_style_model", monkeypatch, _apply_attn_res=_vllm_apply_attn_res)
    monkeypatch.setenv(fresh_plugin.LEGACY_PATCH_ENV, module.__name__)
    fresh_plugin.register()
    assert module._apply_attn_res is fresh_plugin.apply_attn_res_vllm
    assert "K3_OPS_PATCH_APPLY_ATTN_RES is the old name of K3_OPS_PATCH_ATTN_RES" in caplog.text


def test_other_signature_is_left_alone(fresh_plugin, monkeypatch, caplog):
    """A function of a known name but another signature (another engine version) is not replaced: a warning names
    it, its signature and the one the drop-in replaces; nothing else to patch is an error, not an exception."""
    def attn_res(x, weights):
        return x

    module = _fake_module("fake_model_other_signature", monkeypatch, attn_res=attn_res)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, module.__name__)
    fresh_plugin.register()
    assert module.attn_res is attn_res
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("fake_model_other_signature.attn_res has the signature (x, weights), not the one k3_ops's drop-in "
               "replaces (prefix, delta, blocks, norm_weight, qk_weight, ...)" in m for m in warning), warning
    assert any(r.levelno == logging.ERROR and "defines none of" in r.getMessage() for r in caplog.records)


# --- patching: module trees shaped like the engines' --------------------------------------------------------
# vLLM-Ascend's Kimi K3 model in each shape, reduced to what k3_ops touches: the real module path, the module
# globals the model calls, their signatures, and a layer that looks them up at call time as the model does. The
# engine's own kernels fail when they run.
_CTX = """
class _ExtraForwardContextProxy:
    flash_comm_v1_enabled = False


_EXTRA_CTX = _ExtraForwardContextProxy()
"""
_KERNEL_4 = """
def apply_attn_res(prefix_sum, block_residual, proj, norm):
    raise AssertionError("vLLM-Ascend's Triton kernel ran")
"""
_KERNEL_5 = """
def apply_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks):
    raise AssertionError("vLLM-Ascend's Triton kernel ran")
"""
_RELEASE = """
import torch

from vllm_ascend.ascend_forward_context import _EXTRA_CTX
from vllm_ascend.ops.triton.kimi_k3.attention_residual import apply_attn_res


def _apply_attention_residual(prefix_sum, block_residual, projection, norm):
    if apply_attn_res is None:
        raise AssertionError("vLLM-Ascend's eager formula ran")
    mixed = apply_attn_res(prefix_sum, block_residual, projection, norm)
    if _EXTRA_CTX.flash_comm_v1_enabled:
        mixed = torch.ops.vllm.maybe_chunk_residual(prefix_sum, mixed)
    return mixed


class KimiK3DecoderLayer:
    def __init__(self, proj, norm):
        self.mlp_res_proj, self.mlp_res_norm = proj, norm

    def mlp_side(self, prefix_sum, block_residual):
        return _apply_attention_residual(prefix_sum, block_residual, self.mlp_res_proj, self.mlp_res_norm)
"""
_MAIN = """
from vllm_ascend.ops.triton.kimi_k3.attention_residual import apply_attn_res


def _apply_ascend_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks):
    if num_valid_blocks <= 0:
        return prefix_sum
    return apply_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks)


class AscendKimiDecoderLayer:
    def __init__(self, proj, norm, prev_valid_blocks):
        self.mlp_res_proj, self.mlp_res_norm, self.prev_valid_blocks = proj, norm, prev_valid_blocks

    def mlp_side(self, prefix_sum, residual):
        return _apply_ascend_attn_res(prefix_sum, residual, self.mlp_res_proj, self.mlp_res_norm,
                                      self.prev_valid_blocks)
"""
_MAIN_FLASH_COMM = """
import torch

from vllm_ascend.ascend_forward_context import _EXTRA_CTX


def _apply_ascend_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks):
    if num_valid_blocks <= 0:
        return prefix_sum
    raise AssertionError("vLLM-Ascend's eager formula ran")
    if _EXTRA_CTX.flash_comm_v1_enabled:
        return torch.ops.vllm.maybe_chunk_residual(prefix_sum, prefix_sum)


class AscendKimiDecoderLayer:
    def __init__(self, proj, norm, prev_valid_blocks):
        self.mlp_res_proj, self.mlp_res_norm, self.prev_valid_blocks = proj, norm, prev_valid_blocks

    def mlp_side(self, prefix_sum, residual):
        return _apply_ascend_attn_res(prefix_sum, residual, self.mlp_res_proj, self.mlp_res_norm,
                                      self.prev_valid_blocks)
"""
_ASCENDC_DIRECT = """
import torch


class AscendKimiDecoderLayer:
    def __init__(self, proj, norm, prev_valid_blocks):
        self.mlp_res_proj, self.mlp_res_norm, self.prev_valid_blocks = proj, norm, prev_valid_blocks

    def mlp_side(self, prefix_sum, residual):
        output, _, _ = torch.ops._C_ascend.attn_res_fwd(
            prefix_sum, None, residual, self.mlp_res_proj.weight, self.mlp_res_norm.weight,
            self.mlp_res_norm.variance_epsilon, self.prev_valid_blocks)
        return output
"""

#: shape -> (the model module, its file, the Triton kernel module's file or None)
ASCEND_SHAPES = {
    "release": ("vllm_ascend.models.kimi_k3", _RELEASE, _KERNEL_4),
    "main": ("vllm_ascend.models.kimi_k3", _MAIN, _KERNEL_5),
    "main-flash-comm": ("vllm_ascend.models.kimi_k3", _MAIN_FLASH_COMM, None),
    "kimi-k3-text": ("vllm_ascend.models.kimi_k3_text", _RELEASE, _KERNEL_4),
}


@pytest.fixture
def module_tree(tmp_path, monkeypatch):
    """Writes a package tree under tmp_path and puts it first on sys.path; afterwards every module it held is
    forgotten again."""
    roots: set[str] = set()

    def write(files: dict[str, str]) -> None:
        for path, text in files.items():
            target = tmp_path / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(text))
            roots.add(path.split("/")[0].removesuffix(".py"))
        importlib.invalidate_caches()

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in [n for n in sys.modules if n.split(".")[0] in roots]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _ascend_tree(shape: str) -> dict[str, str]:
    module, model, kernel = ASCEND_SHAPES[shape]
    files = {"vllm_ascend/__init__.py": "", "vllm_ascend/ascend_forward_context.py": _CTX,
             "vllm_ascend/models/__init__.py": "", module.replace(".", "/") + ".py": model}
    if kernel is not None:
        files.update({"vllm_ascend/ops/__init__.py": "", "vllm_ascend/ops/triton/__init__.py": "",
                      "vllm_ascend/ops/triton/kimi_k3/__init__.py": "",
                      "vllm_ascend/ops/triton/kimi_k3/attention_residual.py": kernel})
    return files


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


needs_no_vllm = pytest.mark.skipif(
    "_vllm_available()", reason="vLLM is installed: these write a vllm package of their own (tests/test_vllm_real.py "
                                "covers the real one)")


def _mlp_side_call(T=4, K=2, C=3, H=64):
    args = Sample(T=T, K=K, cap=C, H=H, dtype=torch.bfloat16).make("cpu", seed=4)
    return args, _Proj(args["proj_weight"].to(torch.bfloat16)), _Norm(args["norm_weight"].to(torch.bfloat16), 1e-6)


@pytest.mark.parametrize("shape", list(ASCEND_SHAPES))
@torch.no_grad()
def test_auto_patches_vllm_ascends_model_when_it_is_imported(fresh_plugin, module_tree, monkeypatch, caplog, shape):
    """K3_OPS_PATCH_ATTN_RES=auto with vllm_ascend installed: register() does not import the model module (vLLM-Ascend
    patches vLLM before its model modules import what they use); the module is patched the moment the engine
    imports it, and its layer's call reaches k3_ops's kernels, never vLLM-Ascend's."""
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module_tree(_ascend_tree(shape))
    name = ASCEND_SHAPES[shape][0]
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "auto")
    fresh_plugin.register()
    assert name not in sys.modules, "register() imported the model module"
    assert f"patches {name} when it is imported" in caplog.text, caplog.text
    model = importlib.import_module(name)
    assert f"k3_ops: patched {name}." in caplog.text, caplog.text
    args, proj, norm = _mlp_side_call()
    layer_cls = getattr(model, "KimiK3DecoderLayer", None) or model.AscendKimiDecoderLayer
    layer = layer_cls(proj, norm) if shape in ("release", "kimi-k3-text") else layer_cls(proj, norm, 2)
    bank = args["block_residual"] if shape not in ("release", "kimi-k3-text") else args["block_residual"][:, :2]
    out = layer.mlp_side(args["prefix_sum"], bank)
    want = reference.attn_res_reference(args["prefix_sum"], args["block_residual"], norm.weight, proj.weight, 2, 1e-6)
    assert torch.equal(out, want)


def test_auto_patches_an_imported_module_at_once(fresh_plugin, module_tree, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module_tree(_ascend_tree("main"))
    model = importlib.import_module("vllm_ascend.models.kimi_k3")
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "auto")
    fresh_plugin.register()
    from k3_ops import vllm_ascend

    assert model.apply_attn_res is vllm_ascend.apply_attn_res
    assert model._apply_ascend_attn_res is vllm_ascend.apply_ascend_attn_res  # no flash-comm step in this shape
    assert ("patched vllm_ascend.models.kimi_k3._apply_ascend_attn_res, vllm_ascend.models.kimi_k3.apply_attn_res"
            in caplog.text), caplog.text


@pytest.mark.parametrize("shape", ["release", "main-flash-comm"])
@torch.no_grad()
def test_flash_comm_step_kept_where_the_model_has_it(fresh_plugin, module_tree, monkeypatch, shape):
    """The replacement of a function that ends with the flash-comm step keeps it, reading the model's own
    ``_EXTRA_CTX`` at every call: ``maybe_chunk_residual(prefix_sum, mixed)`` only while flash-comm is on."""
    define_chunk_residual_op()
    module_tree(_ascend_tree(shape))
    model = importlib.import_module(ASCEND_SHAPES[shape][0])
    fresh_plugin.patch_attn_res(model)
    fn = model._apply_attention_residual if shape == "release" else model._apply_ascend_attn_res
    ctx = importlib.import_module("vllm_ascend.ascend_forward_context")._EXTRA_CTX
    args, proj, norm = _mlp_side_call()
    bank = args["block_residual"][:, :2]
    extra = () if shape == "release" else (2,)
    calls = []
    lib = torch.library.Library("vllm", "IMPL")
    lib.impl("maybe_chunk_residual", lambda x, r: calls.append(x) or r * 2, "CPU")
    keywords = dict(prefix_sum=args["prefix_sum"], block_residual=bank, norm=norm,
                    **({"projection": proj} if shape == "release" else {"proj": proj, "num_valid_blocks": 2}))
    try:
        plain = fn(args["prefix_sum"], bank, proj, norm, *extra)
        monkeypatch.setattr(ctx, "flash_comm_v1_enabled", True)
        chunked = fn(args["prefix_sum"], bank, proj, norm, *extra)
        by_keyword = fn(**keywords)  # the model's own parameter names
    finally:
        lib._destroy()
    assert len(calls) == 2 and calls[0] is args["prefix_sum"] and torch.equal(chunked, plain * 2)
    assert torch.equal(by_keyword, chunked)


def test_already_patched_module_is_left_as_it_is(fresh_plugin, module_tree):
    module_tree(_ascend_tree("release"))
    model = importlib.import_module("vllm_ascend.models.kimi_k3")
    first = fresh_plugin.patch_attn_res(model)
    replacement = model._apply_attention_residual
    assert fresh_plugin.patch_attn_res(model) == first and model._apply_attention_residual is replacement


# Settings that once ended the engine process, and more: register() logs each and goes on, with the ops registered.
BAD_SETTINGS = {
    "relative": ".model",
    "raises-on-import": "k3fake_raises.model",  # its package raises RuntimeError on import
    "empty": "",
    "commas": " , ,",
    "garbage": "!!not a module!!",
    "double-dot": "vllm_ascend..models",
    "attribute": "vllm_ascend.models.kimi_k3._apply_ascend_attn_res",
    "nothing-to-patch": "json",
    "unicode": "модель.ядро",
    "op-absent": "_C_ascend::attn_res_fwd",
    "kernel-module": "vllm_ascend.ops.triton.kimi_k3.attention_residual",
    "long": "a." * 400 + "b",
}


@pytest.mark.parametrize("setting", list(BAD_SETTINGS.values()), ids=list(BAD_SETTINGS))
def test_no_setting_raises_out_of_register(fresh_plugin, module_tree, monkeypatch, caplog, setting):
    """vLLM's plugin loader does not catch what register() raises: no value of K3_OPS_PATCH_ATTN_RES may end the
    engine. Each is logged (what was named, why it is not patched) and the ops are registered regardless."""
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module_tree({**_ascend_tree("main"), "k3fake_raises/__init__.py": "raise RuntimeError('broken package')\n"})
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, setting)
    fresh_plugin.register()  # no exception
    assert fresh_plugin._registered and LOG_MARK in caplog.text
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if setting.strip(" ,"):
        named = setting.strip()
        assert any(named in m or named.split("::")[0] in m for m in problems), (setting, caplog.text)


@pytest.mark.parametrize("setting, message", [
    (".model", r"names '.model', a relative module name; name the module in full"),
    ("k3fake_raises.model", r"names module 'k3fake_raises.model', which cannot be imported \(RuntimeError: broken"),
    ("no_such_module_k3", r"names module 'no_such_module_k3', which cannot be found; set K3_OPS_PATCH_ATTN_RES to "
                          r"auto"),
    ("vllm_ascend.models.kimi_k3._apply_ascend_attn_res",
     r"an attribute of module 'vllm_ascend.models.kimi_k3', not a module"),
    ("json", r"names module 'json', which defines none of _apply_attn_res, attn_res"),
], ids=["relative", "raises-on-import", "missing", "attribute", "nothing-to-patch"])
def test_bad_target_error_says_what_and_why(fresh_plugin, module_tree, monkeypatch, caplog, setting, message):
    """The error names the setting and the rule it breaks; every other entry is still patched."""
    module_tree({**_ascend_tree("main"), "k3fake_raises/__init__.py": "raise RuntimeError('broken package')\n"})
    importlib.import_module("vllm_ascend.models.kimi_k3")  # so that an attribute of it can be recognised
    good = _fake_module("fake_good_model", monkeypatch, attn_res=_vllm_attn_res)
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, f"{setting},fake_good_model")
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    fresh_plugin.register()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and re.search(message, errors[0]), errors
    assert good.attn_res is fresh_plugin.attn_res


def test_module_that_raises_on_import_is_not_imported_here(fresh_plugin, module_tree, monkeypatch, caplog):
    """A named module whose own code raises: register() does not import it, so it does not raise; the engine's own
    import of it raises as it would without k3_ops."""
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module_tree({"k3fake_pkg/__init__.py": "", "k3fake_pkg/model.py": "raise RuntimeError('model module broken')\n"})
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "k3fake_pkg.model")
    fresh_plugin.register()
    assert "patches k3fake_pkg.model when it is imported" in caplog.text
    with pytest.raises(RuntimeError, match="model module broken"):
        importlib.import_module("k3fake_pkg.model")


def test_kernel_module_target_warns_and_names_the_caller(fresh_plugin, module_tree, monkeypatch, caplog):
    """Naming the Triton kernel's module (the model bound ``apply_attn_res`` from it at import): a warning names the
    model module the call comes from, once from the table of known layouts and once from the modules that hold the
    original."""
    module_tree(_ascend_tree("release"))
    importlib.import_module("vllm_ascend.models.kimi_k3")
    kernel = "vllm_ascend.ops.triton.kimi_k3.attention_residual"
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, kernel)
    fresh_plugin.register()
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"names {kernel}, which the Kimi K3 model does not call at run time: vllm_ascend.models.kimi_k3 "
               "binds its function at import" in m for m in warnings_), warnings_
    assert any(m.startswith("k3_ops: vllm_ascend.models.kimi_k3 bound " + kernel + ".apply_attn_res at import")
               for m in warnings_), warnings_


@needs_no_vllm
def test_vllms_model_named_where_vllm_ascend_runs_warns(fresh_plugin, module_tree, monkeypatch, caplog):
    """vLLM's nvidia model named with vLLM-Ascend installed: vLLM-Ascend's model is the one registered, so the
    warning names it; auto patches vLLM-Ascend's module, not vLLM's."""
    module_tree({**_ascend_tree("main"), **_vllm_tree()})
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "vllm.models.kimi_k3.nvidia.model")
    fresh_plugin.register()
    assert any("but vLLM-Ascend is installed and registers its own Kimi K3 model (vllm_ascend.models.kimi_k3 / "
               "vllm_ascend.models.kimi_k3_text), which never calls vllm.models.kimi_k3.nvidia.model"
               in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING), caplog.text


# vLLM's layout, where a test needs it next to vLLM-Ascend's (vLLM itself is not installed here).
_VLLM_MODEL = """
from vllm.models.kimi_k3.nvidia.ops import attn_res


class KimiDecoderLayer:
    pass
"""
_VLLM_KERNEL = """
def attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx, eps,
             output_norm_eps):
    raise AssertionError("vLLM's kernel ran")
"""
_VLLM_WARMUP = """
def _warm_attn_res(worker):
    raise AssertionError("vLLM's AttnRes warmup ran: it compiles kernels the patched model no longer calls")


def kimi_k3_triton_warmup(worker):
    _warm_attn_res(worker)
"""


def _vllm_tree() -> dict[str, str]:
    return {"vllm/__init__.py": "", "vllm/models/__init__.py": "", "vllm/models/kimi_k3/__init__.py": "",
            "vllm/models/kimi_k3/nvidia/__init__.py": "", "vllm/models/kimi_k3/nvidia/model.py": _VLLM_MODEL,
            "vllm/models/kimi_k3/nvidia/ops/__init__.py": "from .attn_res import attn_res\n",
            "vllm/models/kimi_k3/nvidia/ops/attn_res.py": _VLLM_KERNEL,
            "vllm/model_executor/__init__.py": "", "vllm/model_executor/warmup/__init__.py": "",
            "vllm/model_executor/warmup/kimi_k3_triton_warmup.py": _VLLM_WARMUP}


class _Worker:
    """What vLLM's AttnRes warmup reads of its worker."""

    def __init__(self, additional_config=None):
        text = types.SimpleNamespace(attn_res_block_size=12, num_hidden_layers=93, hidden_size=64,
                                     rms_norm_eps=1e-6)
        self.model_config = types.SimpleNamespace(hf_text_config=text, dtype=torch.bfloat16)
        self.scheduler_config = types.SimpleNamespace(max_num_batched_tokens=64)
        self.vllm_config = types.SimpleNamespace(additional_config=additional_config or {})


@needs_no_vllm
def test_patching_vllms_model_redirects_its_attn_res_warmup(fresh_plugin, module_tree, monkeypatch, caplog):
    """Once nvidia/model.py's attn_res is k3_ops's, vLLM's AttnRes warmup would compile kernels nobody calls:
    ``kimi_k3_triton_warmup`` then runs ``warm_attn_res`` (k3_ops.warmup), which logs what it warmed or why not."""
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module_tree(_vllm_tree())
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "auto")
    fresh_plugin.register()
    model = importlib.import_module("vllm.models.kimi_k3.nvidia.model")
    assert model.attn_res is fresh_plugin.attn_res
    warmup = importlib.import_module("vllm.model_executor.warmup.kimi_k3_triton_warmup")
    assert warmup._warm_attn_res is fresh_plugin.warm_attn_res
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    warmup.kimi_k3_triton_warmup(_Worker())
    assert "k3_ops: AttnRes warmup skipped: no CUDA device in this process" in caplog.text


def test_warmup_states_why_it_skips(fresh_plugin, caplog):
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    worker = _Worker()
    worker.model_config.hf_text_config.attn_res_block_size = None
    fresh_plugin.warm_attn_res(worker)
    assert "AttnRes warmup skipped: the model config has no attn_res_block_size" in caplog.text
    fresh_plugin.warm_attn_res(object())  # nothing it can read: a warning, no exception
    assert "AttnRes warmup skipped (AttributeError" in caplog.text


def test_latency_specialized_decode_is_reported_once(fresh_plugin, caplog):
    """decode_backend=latency_specialized (vLLM's SM100 CuteDSL decode executor) bypasses any patch in the steps it
    serves: the warmup says so, once per process."""
    worker = _Worker({"decode_backend": "latency_specialized"})
    worker.model_config.hf_text_config.attn_res_block_size = None
    fresh_plugin.warm_attn_res(worker)
    fresh_plugin.warm_attn_res(worker)
    lines = [r.getMessage() for r in caplog.records if "latency_specialized" in r.getMessage()]
    assert len(lines) == 1 and "which no patch reaches" in lines[0] and "stock forward only" in lines[0]
    fresh_plugin.warm_attn_res(_Worker({"decode_backend": "auto"}))
    assert len([r for r in caplog.records if "latency_specialized" in r.getMessage()]) == 1


@requires_cuda
@pytest.mark.cuda
def test_warmup_compiles_k3_ops_kernels_on_a_gpu(fresh_plugin, caplog):
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    fresh_plugin.warm_attn_res(_Worker())
    line = [r.getMessage() for r in caplog.records if "AttnRes warmup:" in r.getMessage()]
    assert line and int(line[0].split("AttnRes warmup: ")[1].split()[0]) > 0, caplog.text


# --- vLLM-Ascend's AscendC op ---------------------------------------------------------------------------------
# The op's schemas as vLLM-Ascend defines them (argument names and defaults from its README, see
# tests/test_vllm_ascend.py): the fused form as the default overload, the first form as ``mix_only``; a vendor
# kernel that fails if it runs. Defined once per process (a schema cannot be undefined).
_ASCENDC_SCHEMAS = {
    "attn_res_fwd": "(Tensor prefix_sum, Tensor? addend, Tensor(a!) block_residual, Tensor proj_weight, "
                    "Tensor norm_weight, float norm_eps, int num_valid_blocks, Tensor? output_norm_weight=None, "
                    "float output_norm_eps=1e-05, int block_write_idx=-1, bool return_materialized=False, "
                    "bool mix=True, bool optimize_prefill=False) -> (Tensor, Tensor, Tensor)",
    "attn_res_fwd.mix_only": "(Tensor prefix_sum, Tensor block_residual, Tensor proj_weight, Tensor norm_weight, "
                             "float norm_eps=1e-05) -> Tensor",
}
_SCHEMA_LIBS: list[torch.library.Library] = []


@pytest.fixture
def ascendc_op():
    if not hasattr(torch.ops, "_C_ascend") or not hasattr(torch.ops._C_ascend, "attn_res_fwd"):
        lib = torch.library.Library("_C_ascend", "FRAGMENT")
        for name, schema in _ASCENDC_SCHEMAS.items():
            lib.define(name + schema)
        _SCHEMA_LIBS.append(lib)
    vendor = torch.library.Library("_C_ascend", "IMPL")
    for name in _ASCENDC_SCHEMAS:
        vendor.impl(name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("the AscendC kernel ran")),
                    "PrivateUse1")
    yield torch.ops._C_ascend.attn_res_fwd
    vendor._destroy()


def test_ascendc_op_absent_is_reported(fresh_plugin, monkeypatch, caplog):
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "_C_ascend::attn_res_fwd")
    if hasattr(torch.ops, "_C_ascend") and hasattr(torch.ops._C_ascend, "attn_res_fwd"):
        pytest.skip("an earlier test of this process defined _C_ascend::attn_res_fwd")
    fresh_plugin.register()
    assert any(r.levelno == logging.ERROR and "_C_ascend::attn_res_fwd cannot be patched" in r.getMessage()
               for r in caplog.records), caplog.text


@requires_interpreter
@pytest.mark.interpreter
@torch.no_grad()
def test_auto_replaces_the_ascendc_op_a_model_calls_directly(fresh_plugin, module_tree, monkeypatch, caplog,
                                                             ascendc_op, simulated_npu):  # noqa: F811
    """A model that calls ``torch.ops._C_ascend.attn_res_fwd`` itself has no global to replace: auto replaces the
    op's PrivateUse1 kernel (every overload of a known form) when the module is imported, and the layer's call on
    the (simulated) NPU reaches k3_ops's kernels."""
    caplog.set_level(logging.INFO, logger=fresh_plugin.LOGGER_NAME)
    module_tree({"vllm_ascend/__init__.py": "", "vllm_ascend/models/__init__.py": "",
                 "vllm_ascend/models/kimi_k3.py": _ASCENDC_DIRECT})
    monkeypatch.setenv(fresh_plugin.PATCH_ENV, "auto")
    fresh_plugin.register()
    model = importlib.import_module("vllm_ascend.models.kimi_k3")
    assert "k3_ops: patched _C_ascend::attn_res_fwd, _C_ascend::attn_res_fwd.mix_only" in caplog.text, caplog.text
    args, proj, norm = _mlp_side_call()
    device = simulated_npu.device
    npu_proj, npu_norm = _Proj(proj.weight.to(device)), _Norm(norm.weight.to(device), norm.variance_epsilon)
    prefix, bank = args["prefix_sum"].to(device), args["block_residual"].to(device)
    want = reference.attn_res_reference(args["prefix_sum"], args["block_residual"], norm.weight, proj.weight, 2, 1e-6)
    first_form = ascendc_op.mix_only(prefix, bank[:, :2], npu_proj.weight, npu_norm.weight, 1e-6)
    torch.testing.assert_close(first_form.cpu().float(), want.float(), rtol=2**-7, atol=1e-5)
    if not hasattr(torch.ops.kimi_k3.fused_attn_res, "full"):
        pytest.skip("kimi_k3::fused_attn_res.full is not registered in this build of k3_ops")
    out = model.AscendKimiDecoderLayer(npu_proj, npu_norm, 2).mlp_side(prefix, bank)
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=2**-7, atol=1e-5)
