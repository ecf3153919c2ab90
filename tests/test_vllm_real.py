"""k3_ops against a real vLLM 0.33.0 (tools/check_vllm.sh installs it in a side venv and runs these; elsewhere they
skip with a reason): what a K3 deployment actually exercises.

- Plugin load through vLLM's own loader (``vllm.plugins.load_general_plugins``, fresh processes): the ops register,
  the INFO line shows in vLLM's output, ``K3_OPS_PATCH_ATTN_RES`` (a module, or ``auto``) patches the real model
  modules (``vllm.models.kimi_k3.nvidia.model.attn_res``, ``vllm.models.kimi_k3.amd.linear._apply_attn_res``) and
  points vLLM's AttnRes warmup at k3_ops; a typo, a relative name or a package that raises on import is logged and
  the process lives on; naming the kernel module the model bound at import is warned about.
- Both drop-ins against vLLM's own Kimi K3 Triton kernels (``nvidia/ops/attn_res.py``, ``amd/ops/attn_res.py``;
  run on CPU tensors by the Triton interpreter, like k3_ops's), over the model's call forms: K = 0..3 and 8, with
  and without delta, snapshot and output norm, FP8 on and off. prefix and blocks bit-equal; outputs within FP32
  rounding (fp32 model dtype; one bf16 ulp in bf16); FP8 codes within one e4m3 step.
- A toy K3 stack under vLLM's compilation (CompilationMode.VLLM_COMPILE, piecewise split at an attention stand-in,
  @support_torch_compile; on this CPU-only host DeviceConfig("cpu"), fusion passes off, compile_sizes=[], and
  schema-only stand-ins for the torch.ops._C ops that vLLM's FixFunctionalizationPass looks up): one Dynamo graph,
  no graph break, no recompile for T = 1, 7, 16, 17, 512, compiled == eager.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import k3_ops
from k3_ops import vllm_plugin

VLLM_VERSION = "0.33.0"


def _installed_vllm() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


_HAVE = _installed_vllm()
if os.environ.get("K3_OPS_EXPECT_VLLM") == "1" and _HAVE != VLLM_VERSION:
    # tools/check_vllm.sh sets this: there a missing or other vLLM is an error, not a skip.
    raise RuntimeError(f"K3_OPS_EXPECT_VLLM=1 but vllm {_HAVE} is installed, expected {VLLM_VERSION}")

if _HAVE is None:
    pytest.skip("vLLM is not installed (about 9 GB with its torch): tools/check_vllm.sh runs these against "
                f"vllm=={VLLM_VERSION} in a side venv", allow_module_level=True)
if _HAVE != VLLM_VERSION:
    pytest.skip(f"vllm {_HAVE} is installed; these pin vLLM {VLLM_VERSION}'s Kimi K3 contract", allow_module_level=True)
pytestmark = pytest.mark.vllm

NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"
AMD_LINEAR = "vllm.models.kimi_k3.amd.linear"


# --- the plugin through vLLM's own loader ------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import importlib, json, os, sys
    import vllm.plugins
    if os.environ.get("CHECK_CONFIGURED_LOGGING") == "1":
        # What vLLM's engine core and workers do before they load plugins (run_engine_core, worker_main). The
        # front-end process loads them in EngineArgs.__post_init__, before it configures logging.
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig())
    vllm.plugins.load_general_plugins()
    vllm.plugins.load_general_plugins()  # once per process, however often vLLM calls it
    import torch
    result = {"ops": hasattr(torch.ops, "kimi_k3") and hasattr(torch.ops.kimi_k3, "fused_attn_res_")}
    if "k3_ops" in sys.modules:
        result["k3_ops"] = sys.modules["k3_ops"].__file__
    for target in filter(None, os.environ.get("CHECK_MODULE", "").split(",")):
        import k3_ops.vllm_plugin as plugin
        module = importlib.import_module(target)
        result.setdefault("attn_res", {})[target] = getattr(module, "attn_res", None) is plugin.attn_res
        result.setdefault("_apply_attn_res", {})[target] = (getattr(module, "_apply_attn_res", None)
                                                           is plugin.apply_attn_res_vllm)
    if os.environ.get("CHECK_WARMUP") == "1":
        import k3_ops.vllm_plugin as plugin
        from vllm.model_executor.warmup import kimi_k3_triton_warmup
        result["warmup"] = kimi_k3_triton_warmup._warm_attn_res is plugin.warm_attn_res
    print("RESULT " + json.dumps(result))
""")


def _load_plugins(cwd: str | None = None, **env) -> tuple[dict, str]:
    full = {**os.environ, "VLLM_PLUGINS": "k3_ops", "CHECK_CONFIGURED_LOGGING": "1", **env}
    full.pop("K3_OPS_PATCH_APPLY_ATTN_RES", None)
    # Run outside the source tree: `python -c` puts the working directory first on sys.path, where the tree's own
    # k3_ops (built for another torch) would shadow the k3_ops installed next to vLLM, which the plugin must be.
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=full, timeout=600,
                       cwd=cwd or tempfile.gettempdir())
    output = p.stdout + p.stderr
    assert p.returncode == 0, output
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, output
    result = json.loads(line[-1][len("RESULT "):])
    assert result.get("k3_ops", k3_ops.__file__) == k3_ops.__file__, (result, k3_ops.__file__)
    return result, output


@pytest.mark.parametrize("module, attribute", [(NVIDIA_MODEL, "attn_res"), (AMD_LINEAR, "_apply_attn_res")],
                         ids=["nvidia-model", "amd-linear"])
def test_vllm_loader_registers_and_patches(module: str, attribute: str):
    result, output = _load_plugins(K3_OPS_PATCH_ATTN_RES=module, CHECK_MODULE=module)
    assert result["ops"] and result[attribute][module], output
    # vLLM's logging shows the plugin's line (a child of its "vllm" logger), once per process.
    assert output.count("k3_ops 0.1.0: registered kimi_k3::attn_res") == 1, output
    assert f"patched {module}.{attribute}" in output, output


def test_auto_patches_both_model_modules_and_the_warmup():
    """auto without vLLM-Ascend: vLLM's nvidia model (imported by vLLM's own kimi_k3 package on this platform:
    patched at once) and amd/linear.py (patched when imported), and vLLM's AttnRes warmup redirected to k3_ops."""
    result, output = _load_plugins(K3_OPS_PATCH_ATTN_RES="auto", CHECK_MODULE=f"{NVIDIA_MODEL},{AMD_LINEAR}",
                                   CHECK_WARMUP="1")
    assert result["attn_res"][NVIDIA_MODEL] and result["_apply_attn_res"][AMD_LINEAR], output
    assert result["warmup"], output
    assert f"patched {NVIDIA_MODEL}.attn_res" in output and f"patched {AMD_LINEAR}._apply_attn_res" in output, output


@pytest.mark.parametrize("configured", ["1", "0"], ids=["engine-core-order", "front-end-order"])
def test_vllm_loader_survives_a_typo(configured: str):
    """vLLM's loader does not catch plugin errors; k3_ops logs the bad name and the process goes on, unpatched.
    The error shows whether or not vLLM has configured its logging yet (an error reaches Python's last-resort
    handler too; an INFO line does not, which is why the front-end process never shows the registration line)."""
    result, output = _load_plugins(K3_OPS_PATCH_ATTN_RES="vllm.models.kimi_k3.nvidia.modle", CHECK_MODULE=NVIDIA_MODEL,
                                   CHECK_CONFIGURED_LOGGING=configured)
    assert result["ops"] and not result["attn_res"][NVIDIA_MODEL], output
    assert "vllm.models.kimi_k3.nvidia.modle" in output and "K3_OPS_PATCH_ATTN_RES" in output, output
    assert "ERROR" in output or configured == "0", output
    result, output = _load_plugins(K3_OPS_PATCH_ATTN_RES="vllm.envs", CHECK_MODULE=NVIDIA_MODEL)
    assert "which defines none of _apply_attn_res, attn_res" in output, output


@pytest.mark.parametrize("setting, message", [
    (".model", "names '.model', a relative module name"),
    ("k3fake_raises.model", "names module 'k3fake_raises.model', which cannot be imported (RuntimeError: broken"),
], ids=["relative", "raises-on-import"])
def test_vllm_loader_survives_settings_that_once_ended_it(setting: str, message: str, tmp_path):
    """The two settings that ended the engine process through vLLM's loader: a relative name (a TypeError out of
    importlib) and a module whose package raises on import. Both are logged; the process goes on, ops registered."""
    (tmp_path / "k3fake_raises").mkdir()
    (tmp_path / "k3fake_raises" / "__init__.py").write_text("raise RuntimeError('broken package')\n")
    result, output = _load_plugins(cwd=str(tmp_path), K3_OPS_PATCH_ATTN_RES=setting, CHECK_MODULE=NVIDIA_MODEL,
                                   PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path),
                                                                            os.environ.get("PYTHONPATH")])))
    assert result["ops"] and not result["attn_res"][NVIDIA_MODEL], output
    assert message in output, output


def test_vllm_loader_warns_about_the_kernel_module():
    """nvidia/ops/attn_res.py named: nvidia/model.py bound attn_res at import, so the model keeps vLLM's kernel; the
    warning names the module to patch."""
    result, output = _load_plugins(K3_OPS_PATCH_ATTN_RES="vllm.models.kimi_k3.nvidia.ops.attn_res",
                                   CHECK_MODULE=NVIDIA_MODEL)
    assert not result["attn_res"][NVIDIA_MODEL], output
    assert ("names vllm.models.kimi_k3.nvidia.ops.attn_res, which the Kimi K3 model does not call at run time: "
            f"{NVIDIA_MODEL} binds its function at import") in output, output


def test_vllm_plugins_filter_leaves_k3_ops_out():
    result, output = _load_plugins(VLLM_PLUGINS="some_other_plugin")
    assert not result["ops"], output


# --- both drop-ins against vLLM's own kernels --------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_kernels():
    import importlib

    # The modules themselves (nvidia/ops/__init__.py re-exports the function under the module's name).
    return (importlib.import_module("vllm.models.kimi_k3.nvidia.ops.attn_res"),
            importlib.import_module("vllm.models.kimi_k3.amd.ops.attn_res"))


@dataclasses.dataclass(frozen=True)
class Form:
    K: int
    delta: bool
    write: bool
    norm: bool
    quant: torch.dtype | None
    dtype: torch.dtype

    @property
    def id(self) -> str:
        q = {None: "noquant", torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}[self.quant]
        return (f"K{self.K}-{'delta' if self.delta else 'nodelta'}-{'write' if self.write else 'nowrite'}-"
                f"{'norm' if self.norm else 'nonorm'}-{q}-{'bf16' if self.dtype == torch.bfloat16 else 'fp32'}")


FORMS = [Form(K, d, w, n, q, dt) for K in (0, 1, 2, 3, 8) for d in (True, False) for w in (True, False)
         for n in (True, False) for q in (None, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
         for dt in (torch.float32, torch.bfloat16)]
T, C, H = 3, 9, 96


def _inputs(form: Form, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed * 100 + form.K)
    blocks = torch.randn(T, C, H, generator=g) * torch.linspace(0.5, 2.5, C).view(1, C, 1)
    blocks[:, form.K:] = float("nan")  # unused capacity, the snapshot slot included
    return dict(prefix=(torch.randn(T, H, generator=g) * 1.5).to(form.dtype),
                delta=(torch.randn(T, H, generator=g) * 0.7).to(form.dtype) if form.delta else None,
                blocks=blocks.to(form.dtype), norm_weight=1 + 0.1 * torch.randn(H, generator=g),
                qk_weight=torch.randn(H, generator=g) * 2 / H ** 0.5,
                output_norm_weight=(1 + 0.1 * torch.randn(H, generator=g)).to(form.dtype) if form.norm else None,
                num_blocks=form.K, block_write_idx=form.K if form.write else -1, eps=1e-6,
                output_norm_eps=1e-5 if form.norm else 0.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.fixture(params=["reference", "triton"])
def k3_path(request):
    """Which k3_ops kernels the drop-ins reach on these CPU tensors: the registered CPU kernel (the reference, torch's
    own arithmetic), or the CUDA launch policy's Triton kernels under the interpreter, as vLLM's kernels run here
    (the CPU dispatch key pointed at the CUDA kernels for the test)."""
    if request.param == "reference":
        yield request.param
        return
    import warnings

    from k3_ops import _registration

    lib = torch.library.Library("kimi_k3", "IMPL")
    calls = []

    def counted(fn):
        return lambda *args, **kwargs: (calls.append(fn.__name__), fn(*args, **kwargs))[1]

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        lib.impl("attn_res", counted(_registration._attn_res_cuda), "CPU")
        lib.impl("fused_attn_res_", counted(_registration._fused_attn_res_inplace_cuda), "CPU")
    try:
        yield request.param
    finally:
        lib._destroy()  # the reference CPU kernels are registered again
    assert calls, "the drop-ins never reached k3_ops's Triton kernels"


def _vllm_result(form: Form, kernels, monkeypatch, updated_prefix: torch.Tensor | None = None) -> dict:
    """vLLM's own kernels on one call form: the inputs afterwards (in-place prefix, snapshot) and the output; with
    FP8, the AMD kernel's scale and the FP8 codes of vLLM's epilogue (out rounded to the model dtype, times
    1 / scale, clamped) converted by torch: Triton's interpreter converts float32 to float8e4nv wrongly (31.0 ->
    16.0, 17.0 -> 18.0, -100.0 -> -104.0 with triton 3.8), so the codes vLLM's kernel stores here are not what it
    stores on a GPU. k3_ops converts by integer arithmetic and is exact under the interpreter too.

    ``updated_prefix``: run vLLM's kernels on this already updated prefix (no delta, no snapshot) instead: its
    output from exactly the prefix k3_ops's reference computed (torch's add), where vLLM's own add, under the
    interpreter, truncates bf16."""
    nvidia_ops, amd_ops = kernels

    def inputs() -> dict:
        args = _inputs(form)
        if updated_prefix is not None:
            args.update(prefix=updated_prefix.clone(), delta=None, block_write_idx=-1)
        return args

    args = inputs()
    result = dict(args=args, out=nvidia_ops.attn_res(**args))
    amd_args = inputs()
    amd_out = amd_ops.attn_res(**amd_args)
    assert _same(amd_args["prefix"], args["prefix"]) and _same(amd_args["blocks"], args["blocks"])
    _check_close(form.dtype, amd_out, result["out"], "vLLM's AMD kernel vs its NVIDIA kernel")
    if form.quant is not None:
        if form.quant == torch.float8_e4m3fnuz:
            # What vLLM does on a ROCm platform with fnuz FP8 (get_fp8_min_max returns 224 there; this host is not).
            monkeypatch.setattr(amd_ops, "get_fp8_min_max", lambda: (-224.0, 224.0))
        _, scale = amd_ops.attn_res(**inputs(), quant_dtype=form.quant)
        fp8_max = amd_ops.get_fp8_min_max()[1]
        codes = torch.clamp(result["out"].float() * (1.0 / scale), -fp8_max, fp8_max).to(form.quant)
        result.update(scale=scale, q=codes)
    return result


def _check_close(dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # fp32: FP32 rounding only (the kernels sum in different orders; vLLM's rsqrt is approximate on a GPU, exact
    # here). bf16: that and the rounding of the output, possibly to the other neighbour: two bf16 ulps.
    tol = 2e-6 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 4, msg=what)


def _check_fp8(form: Form, path: str, q: torch.Tensor, scale: torch.Tensor, want: dict) -> None:
    assert q.dtype == form.quant and scale.shape == want["scale"].shape == (T, 1) and scale.dtype == torch.float32
    # The row's amax / fp8_max: FP32 rounding (bf16: the amax element may be one ulp off).
    torch.testing.assert_close(scale, want["scale"], rtol=1e-6 if form.dtype == torch.float32 else 2 ** -7, atol=0,
                               msg=form.id)
    # e4m3 codes: equal, or one step apart where the scaled value sits at a rounding boundary (k3_ops divides by the
    # scale, vLLM multiplies by its reciprocal).
    a, b = q.view(torch.uint8).to(torch.int32), want["q"].view(torch.uint8).to(torch.int32)
    magnitude = lambda c: c & 0x7F  # noqa: E731  (e4m3 codes are monotone in magnitude within a sign)
    near_zero = (magnitude(a) <= 1) & (magnitude(b) <= 1)
    close = (((a & 0x80) == (b & 0x80)) & ((magnitude(a) - magnitude(b)).abs() <= 1)) | near_zero
    assert bool(close.all()), f"{form.id}: e4m3 codes differ by more than one step"
    # How many may differ: a few percent where both sides round the output the same way; in bf16 against the
    # reference, the interpreter's truncated vLLM output is one bf16 ulp (2^-8) off for half the elements, which
    # moves a scaled value across an e4m3 rounding boundary (steps of 2^-3) about 1 time in 16 (seen: up to 5 %).
    bound = 0.12 if path == "reference" and form.dtype == torch.bfloat16 else 0.02
    assert (a != b).float().mean() <= bound, f"{form.id}: {(a != b).float().mean():.3f} of the codes differ"


def _check_inputs_afterwards(form: Form, path: str, ours: dict, theirs: dict) -> None:
    for name in ("prefix", "blocks"):
        if path == "triton" or form.dtype == torch.float32:
            # Same arithmetic on both sides (under the interpreter both truncate bf16 stores): bit for bit.
            assert _same(ours[name], theirs[name]), f"{form.id}: {name} differs from vLLM's"
    if path == "reference" and form.delta:
        # The reference is torch's own add (vLLM's rounding on a GPU); vLLM's kernel here truncates bf16.
        assert _same(ours["prefix"], _inputs(form)["prefix"] + _inputs(form)["delta"]), form.id
    if form.write:
        assert _same(ours["blocks"][:, form.K], ours["prefix"]), f"{form.id}: snapshot != the updated prefix"
    others = [i for i in range(C) if not (form.write and i == form.K)]
    assert _same(ours["blocks"][:, others], _inputs(form)["blocks"][:, others]), f"{form.id}: other slots written"


def _same_prefix(form: Form, path: str, ours: dict) -> torch.Tensor | None:
    # Where vLLM's add here (truncating bf16 under the interpreter) and k3_ops's reference (torch's add) give
    # different prefixes, compare the outputs of the same prefix: k3_ops's.
    return ours["prefix"] if path == "reference" and form.dtype == torch.bfloat16 and form.delta else None


@pytest.mark.parametrize("form", [pytest.param(f, id=f.id) for f in FORMS])
@torch.no_grad()
def test_attn_res_against_vllms_kernel(vllm_kernels, k3_path: str, form: Form, monkeypatch):
    ours = _inputs(form)
    got = vllm_plugin.attn_res(**ours, quant_dtype=form.quant)
    _check_inputs_afterwards(form, k3_path, ours, _vllm_result(form, vllm_kernels, monkeypatch)["args"])
    want = _vllm_result(form, vllm_kernels, monkeypatch, _same_prefix(form, k3_path, ours))
    if form.quant is None:
        assert isinstance(got, torch.Tensor) and got.dtype == form.dtype
        _check_close(form.dtype, got, want["out"], form.id)
    else:
        _check_fp8(form, k3_path, *got, want)


class _Norm:
    def __init__(self, weight, eps):
        self.weight, self.variance_epsilon = weight, eps


class _Proj:
    def __init__(self, weight):
        self.weight = weight


@pytest.mark.parametrize("form", [pytest.param(f, id=f.id) for f in FORMS if f.quant != torch.float8_e4m3fnuz])
@torch.no_grad()
def test_apply_attn_res_against_vllms(vllm_kernels, k3_path: str, form: Form, monkeypatch):
    """k3_ops's _apply_attn_res drop-in (as the patch installs it) against amd/linear.py's own, with the module
    arguments the K3 layer passes; with the dynamic per-token FP8 key both return a QuantizedActivation."""
    from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym
    from vllm.models.kimi_k3.amd import linear

    def call(fn, args):
        return fn(args["prefix"], args["blocks"], _Proj(args["qk_weight"].unsqueeze(0)),
                  _Norm(args["norm_weight"], args["eps"]), args["num_blocks"], delta=args["delta"],
                  output_norm=None if args["output_norm_weight"] is None else _Norm(args["output_norm_weight"],
                                                                                      args["output_norm_eps"]),
                  block_write_idx=args["block_write_idx"], quant_key=kFp8DynamicTokenSym if form.quant else None)

    theirs, ours = _inputs(form), _inputs(form)
    vllm_out = call(linear._apply_attn_res, theirs)
    got = call(vllm_plugin.apply_attn_res_vllm, ours)
    _check_inputs_afterwards(form, k3_path, ours, theirs)
    want = _vllm_result(form, vllm_kernels, monkeypatch, _same_prefix(form, k3_path, ours))
    if form.quant is None:
        assert isinstance(got, torch.Tensor) and isinstance(vllm_out, torch.Tensor)
        _check_close(form.dtype, got, want["out"], form.id)
    else:
        assert isinstance(got, QuantizedActivation) and isinstance(vllm_out, QuantizedActivation)
        assert (got.orig_dtype, got.orig_shape, got.quant_key) == (vllm_out.orig_dtype, vllm_out.orig_shape,
                                                                     vllm_out.quant_key)
        _check_fp8(form, k3_path, got.data, got.scale, want)


# --- a toy K3 stack under vLLM's compilation ---------------------------------------------------------------
# Schema-only stand-ins for the vLLM custom ops (torch.ops._C.*) that FixFunctionalizationPass compares every
# auto_functionalized node against: vLLM's compiled extension is not loadable on a CPU-only host, and the pass
# only needs the names to exist (nothing here calls them).
_C_STAND_INS = {
    "rotary_embedding": "(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, Tensor cos_sin_cache, "
                        "bool is_neox) -> ()",
    "fused_add_rms_norm": "(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant": "(Tensor(a!) result, Tensor input, Tensor(b!) residual, Tensor weight, "
                                           "Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant": "(Tensor(a!) result, Tensor input, Tensor weight, Tensor(b!) scale, "
                                        "float epsilon, Tensor? scale_ub, Tensor(c!)? residual) -> ()",
    "rms_norm": "(Tensor(a!) result, Tensor input, Tensor weight, float epsilon) -> ()",
    "rms_norm_static_fp8_quant": "(Tensor(a!) result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
    "silu_and_mul": "(Tensor(a!) result, Tensor input) -> ()",
    "silu_and_mul_quant": "(Tensor(a!) result, Tensor input, Tensor scale) -> ()",
    "fused_qk_norm_rope": "(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, "
                          "float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, "
                          "Tensor position_ids) -> ()",
}
_libs = []


def _define_c_stand_ins() -> None:
    missing = {name: schema for name, schema in _C_STAND_INS.items() if not hasattr(torch.ops._C, name)}
    if missing:
        lib = torch.library.Library("_C", "FRAGMENT")
        for name, schema in missing.items():
            lib.define(name + schema)
        _libs.append(lib)


_TOY_H, _TOY_LAYERS, _TOY_BLOCK = 64, 7, 3
_TOY_C = -(-_TOY_LAYERS // _TOY_BLOCK)


def _toy_attention_op():
    """The attention stand-in, a custom op that the piecewise backend splits the graph at (as vLLM splits at its
    attention ops): tanh(x @ w), taking a tensor or vLLM's QuantizedActivation's (data, scale)."""
    if not hasattr(torch.ops, "k3toy") or not hasattr(torch.ops.k3toy, "attention"):
        @torch.library.custom_op("k3toy::attention", mutates_args=())
        def attention(x: torch.Tensor, scale: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
            xf = x.float() if scale is None else x.float() * scale
            return torch.tanh(xf @ w.float()).to(w.dtype)

        @attention.register_fake
        def _(x, scale, w):
            return torch.empty(x.shape, dtype=w.dtype, device=x.device)
    return torch.ops.k3toy.attention.default


def _toy_model_class(layout: str, compiled: bool):
    """A fresh class per call (support_torch_compile changes the class it decorates)."""
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym

    attention = _toy_attention_op()
    H, L, B, C = _TOY_H, _TOY_LAYERS, _TOY_BLOCK, _TOY_C

    class ToyK3(torch.nn.Module):
        """Kimi K3's residual schedule (nvidia/model.py's attn_res calls, or amd/linear.py's _apply_attn_res calls
        with the attention input quantised to FP8), with stand-ins for attention and the MLP."""

        def __init__(self, *, vllm_config=None, prefix: str = ""):
            super().__init__()
            g = torch.Generator().manual_seed(0)

            def p(*shape, scale=1.0, offset=0.0):
                return torch.nn.Parameter(offset + scale * torch.randn(*shape, generator=g), requires_grad=False)

            self.w_attn = torch.nn.ParameterList([p(H, H, scale=H ** -0.5) for _ in range(L)])
            self.w_mlp = torch.nn.ParameterList([p(H, H, scale=H ** -0.5) for _ in range(L)])
            self.norms = torch.nn.ParameterList([p(H, scale=0.1, offset=1.0) for _ in range(4 * L + 1)])
            self.projs = torch.nn.ParameterList([p(1, H, scale=2 / H ** 0.5) for _ in range(2 * L + 1)])

        def _mix(self, i, prefix, delta, blocks, K, write, norm):
            if layout == "nvidia":
                return vllm_plugin.attn_res(prefix, delta, blocks, self.norms[2 * i], self.projs[i].squeeze(0),
                                            self.norms[2 * i + 1] if norm else None, num_blocks=K,
                                            block_write_idx=write, eps=1e-6, output_norm_eps=1e-5 if norm else 0.0)
            out_norm = _Norm(self.norms[2 * i + 1], 1e-5) if norm else None
            return vllm_plugin.apply_attn_res_vllm(prefix, blocks, _Proj(self.projs[i]), _Norm(self.norms[2 * i], 1e-6),
                                                   K, delta=delta, output_norm=out_norm, block_write_idx=write,
                                                   quant_key=kFp8DynamicTokenSym if norm and i % 2 == 0 else None)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            prefix, delta = hidden_states, None
            blocks = hidden_states.new_empty(hidden_states.size(0), C, H)
            for layer in range(L):
                write = layer % B == 0
                K = -(-layer // B)
                x = self._mix(2 * layer, prefix, delta, blocks, K, layer // B if write else -1, True)
                if isinstance(x, QuantizedActivation):
                    a = attention(x.data, x.scale, self.w_attn[layer])
                else:
                    a = attention(x, None, self.w_attn[layer])
                prefix, delta = (a, None) if write else (prefix, a)
                x = self._mix(2 * layer + 1, prefix, delta, blocks, K + write, -1, True)
                delta = torch.tanh(x @ self.w_mlp[layer].to(x.dtype))
            return self._mix(2 * L, prefix, delta, blocks, C, -1, False)

    # dynamic_arg_dims spelled out: vLLM infers them from annotations, which are strings in this module.
    return support_torch_compile(dynamic_arg_dims={"hidden_states": 0})(ToyK3) if compiled else ToyK3


class _CodeCapture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.codes: list[str] = []

    def emit(self, record):
        self.codes.append(record.getMessage())


def _capture_output_code() -> list[str]:
    """The wrapper code Inductor generates from here on (torch's output_code log artifact), as a list to read."""
    capture = _CodeCapture()
    torch._logging.set_logs(output_code=True)
    logging.getLogger("torch._inductor.codecache.__output_code").addHandler(capture)
    _captures.append(capture)
    return capture.codes


_captures: list[_CodeCapture] = []


@pytest.fixture
def vllm_compile_env(monkeypatch, tmp_path):
    # A fresh compile every time (no on-disk artifacts from an earlier run), in this test's own cache directory.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    import torch._dynamo

    torch._dynamo.reset()
    _define_c_stand_ins()
    yield
    torch._dynamo.reset()
    while _captures:
        logging.getLogger("torch._inductor.codecache.__output_code").removeHandler(_captures.pop())
    torch._logging.set_logs()


@pytest.mark.parametrize("layout", ["nvidia", "amd"])
@torch.no_grad()
def test_toy_k3_under_vllm_compile(vllm_compile_env, layout: str):
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter
    from vllm.config import (
        CompilationConfig,
        CompilationMode,
        CUDAGraphMode,
        DeviceConfig,
        PassConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.config.compilation import DynamicShapesConfig, DynamicShapesType
    from vllm.forward_context import set_forward_context

    eager_cls, compiled_cls = _toy_model_class(layout, False), _toy_model_class(layout, True)
    # Fusion passes off: they pattern-match vLLM's own CUDA ops, absent on a CPU host. Unbacked token counts: the
    # first call below is T = 1, which backed dynamic shapes would specialise on (vLLM's own first call is its
    # profile run at the largest batch size instead).
    no_fusion = {f.name: False for f in dataclasses.fields(PassConfig) if f.name.startswith(("fuse_", "enable_"))}
    config = VllmConfig(
        compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, splitting_ops=["k3toy::attention"], cudagraph_mode=CUDAGraphMode.NONE,
            compile_sizes=[], pass_config=PassConfig(**no_fusion),
            dynamic_shapes_config=DynamicShapesConfig(type=DynamicShapesType.UNBACKED)),
        device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(config):
        model = compiled_cls(vllm_config=config).to(torch.bfloat16)
    generated = _capture_output_code()
    eager = eager_cls().to(torch.bfloat16)
    assert not model.do_not_compile
    counters.clear()

    def compiled_so_far() -> tuple[int, int, int]:
        return (compilation_counter.num_graphs_seen, compilation_counter.num_piecewise_graphs_seen,
                compilation_counter.num_backend_compilations)

    before, seen = compiled_so_far(), None
    for T in (1, 7, 16, 17, 512):
        x = torch.randn(T, _TOY_H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
        with set_forward_context({}, vllm_config=config):
            got = model(x.clone())
        want = eager(x.clone())
        assert torch.equal(_bits(got), _bits(want)), f"T={T}: compiled != eager"
        now = compiled_so_far()
        if seen is None:
            seen = now
            # One Dynamo graph, split at the 7 attention calls into 15 pieces: 8 compiled, 7 attention calls.
            graphs, pieces, compiled = (a - b for a, b in zip(now, before))
            assert (graphs, pieces, compiled) == (1, 2 * _TOY_LAYERS + 1, _TOY_LAYERS + 1), (graphs, pieces, compiled)
        assert now == seen, f"T={T}: vLLM compiled again ({seen} -> {now})"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 1, dict(counters["stats"])
    # The pieces Inductor generated call fused_attn_res_ on the pieces' inputs (the running prefix, the buffer):
    # vLLM's FixFunctionalizationPass leaves the op to Inductor's reinplacing, and no piece clones or copies.
    calls = [line for code in generated for line in code.splitlines() if "kimi_k3.fused_attn_res_.default(" in line]
    assert len(calls) == 2 * _TOY_LAYERS + 1, len(calls)  # every mix has a delta, a snapshot or a norm
    assert not [line for code in generated for line in code.splitlines()
                if re.search(r"\bclone\b|\.copy_\(|aten\.copy", line)], "a piece copies a tensor"
