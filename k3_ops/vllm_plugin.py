"""vLLM / vLLM-Ascend integration: the ``vllm.general_plugins`` entry point, which routes the installed engine's Kimi
K3 model to k3_ops's kernels, and drop-ins for vLLM 0.33's Kimi K3 model (``vllm/models/kimi_k3/``) with its exact
contract (vLLM-Ascend's own model: :mod:`k3_ops.vllm_ascend`). See docs/integration.md.

pyproject.toml declares::

    [project.entry-points."vllm.general_plugins"]
    k3_ops = "k3_ops.vllm_plugin:register"

vLLM loads every plugin of that group in every process it starts (API server, engine core, each worker) and calls
it once there, before the model is built; its loader does not catch what a plugin raises, so nothing in
``register`` raises for a configuration problem, however wrong: it logs it and goes on. ``register`` makes the
``torch.ops.kimi_k3`` ops available in that process (importing k3_ops loads the schemas, Meta kernels and device
kernels), arranges the patches that ``K3_OPS_PATCH_ATTN_RES`` asks for and logs once per process, through the
``vllm.k3_ops`` logger: vLLM configures only its ``vllm`` logger (with its own handler, propagation off), so only a
child of it shows up in vLLM's output. It is idempotent and thread-safe.

``K3_OPS_PATCH_ATTN_RES`` holds comma-separated entries:

- ``auto``: the Kimi K3 model modules of the installed engine: vLLM-Ascend's (``vllm_ascend.models.kimi_k3``,
  ``vllm_ascend.models.kimi_k3_text``) where ``vllm_ascend`` is installed (it registers its own Kimi K3 classes, so
  vLLM's are never called there), vLLM's (``vllm.models.kimi_k3.nvidia.model``, ``vllm.models.kimi_k3.amd.linear``)
  otherwise;
- a module path: that module, whatever it is (a warning says when the model does not call it);
- ``_C_ascend::attn_res_fwd``: vLLM-Ascend's AscendC op itself (its PrivateUse1 kernel replaced by
  :func:`k3_ops.vllm_ascend.attn_res_fwd`; ``auto`` does this where the model calls the op directly).

In a module, every entry point k3_ops has a drop-in for is replaced (:data:`DROP_INS`), if its signature is the one the
drop-in replaces. A module that is not imported yet is patched the moment it is, by an import hook, never imported
here: vLLM-Ascend applies its own patches to vLLM before its model modules import what they use, and importing one
from a plugin would bind the unpatched names. Patching ``vllm.models.kimi_k3.nvidia.model`` also points vLLM's AttnRes
warmup (``vllm.model_executor.warmup.kimi_k3_triton_warmup._warm_attn_res``) at ``k3_ops.warmup``.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

import k3_ops
from k3_ops import reference, vllm_ascend
from k3_ops.ops import _LinearLike, _norm_eps, _RMSNormLike

__all__ = ["register", "attn_res", "apply_attn_res", "apply_attn_res_vllm", "fp8_dtype_of", "patch_attn_res",
           "patch_ascendc_op", "warm_attn_res", "PATCH_ENV", "LEGACY_PATCH_ENV", "AUTO", "ASCENDC_OP", "DROP_INS",
           "VLLM_MODEL_MODULES", "ASCEND_MODEL_MODULES", "LOGGER_NAME"]

#: A child of vLLM's ``vllm`` logger, which is the only one vLLM's logging configuration gives a handler.
LOGGER_NAME = "vllm.k3_ops"
logger = logging.getLogger(LOGGER_NAME)

PATCH_ENV = "K3_OPS_PATCH_ATTN_RES"
#: The variable's earlier name (it only ever patched ``_apply_attn_res``); still read, with a warning.
LEGACY_PATCH_ENV = "K3_OPS_PATCH_APPLY_ATTN_RES"
AUTO = "auto"
ASCENDC_OP = "_C_ascend::attn_res_fwd"
#: vLLM's Kimi K3 model modules: nvidia/model.py (CUDA, CPU, XPU) and amd/linear.py (the layers of the ROCm model).
VLLM_MODEL_MODULES = ("vllm.models.kimi_k3.nvidia.model", "vllm.models.kimi_k3.amd.linear")
#: vLLM-Ascend's: kimi_k3.py (its release and main lines), kimi_k3_text.py (the vllm-ascend-kimi-k3 repository).
ASCEND_MODEL_MODULES = ("vllm_ascend.models.kimi_k3", "vllm_ascend.models.kimi_k3_text")
#: Kernel modules whose function the model module binds at import (``from ... import attn_res``): patching one of
#: them does not reach the model. Value: the module that calls it.
_BOUND_AT_IMPORT = {
    "vllm.models.kimi_k3.nvidia.ops": "vllm.models.kimi_k3.nvidia.model",
    "vllm.models.kimi_k3.nvidia.ops.attn_res": "vllm.models.kimi_k3.nvidia.model",
    "vllm.models.kimi_k3.amd.ops": "vllm.models.kimi_k3.amd.linear",
    "vllm.models.kimi_k3.amd.ops.attn_res": "vllm.models.kimi_k3.amd.linear",
    "vllm_ascend.ops.triton.kimi_k3.attention_residual": "vllm_ascend.models.kimi_k3",
}
_WARMUP_MODULE = "vllm.model_executor.warmup.kimi_k3_triton_warmup"
_OPS = ("attn_res", "attn_res_backward", "fused_attn_res", "fused_attn_res_")

_lock = threading.Lock()  # register()
_registered = False


# --- the drop-ins ------------------------------------------------------------------------------------------
def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, norm_weight: torch.Tensor,
             qk_weight: torch.Tensor, output_norm_weight: torch.Tensor | None, num_blocks: int, block_write_idx: int,
             eps: float, output_norm_eps: float, *, quant_dtype: torch.dtype | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.33's Kimi K3 ``attn_res`` kernel call, on k3_ops's kernels.

    With a ``delta``, ``prefix`` is overwritten IN PLACE with round(prefix + delta) (the layer keeps it as its
    running residual); ``block_write_idx >= 0`` copies that row into ``blocks[:, block_write_idx]``; the mix of
    ``blocks[:, :num_blocks]`` and the updated prefix follows, then, with ``output_norm_weight``, the RMSNorm of the
    FP32 mix (``output_norm_eps``; ignored without the weight, where vLLM passes 0.0). Returns the output, a new
    [T, H] tensor of prefix's dtype; with ``quant_dtype`` (``torch.float8_e4m3fn`` / ``float8_e4m3fnuz``) the pair
    ``(q, scale)``: the output rounded to prefix's dtype, ``scale = max(amax, 1e-10) / fp8_max`` per token ([T, 1]
    fp32), ``q = clamp(out / scale, -fp8_max, fp8_max)``.

    Shapes as vLLM's: prefix / delta [T, H]; blocks [T, C, H] (any strides, block-major views included);
    norm_weight, qk_weight, output_norm_weight [H]. k3_ops checks what vLLM asserts and more (e.g.
    ``num_blocks <= block_write_idx < C``); bad arguments raise before anything is written.
    """
    if delta is None and block_write_idx < 0 and output_norm_weight is None and quant_dtype is None:
        # Nothing but the mix: the plain op, whose launch table also has the small-T paths.
        return torch.ops.kimi_k3.attn_res.default(prefix, blocks, norm_weight, qk_weight, num_blocks, eps)
    out, scale = torch.ops.kimi_k3.fused_attn_res_.default(
        prefix, delta, blocks, norm_weight, qk_weight, num_blocks, eps, block_write_idx, output_norm_weight,
        None if output_norm_weight is None else output_norm_eps, out_dtype=quant_dtype, round_mix=False)
    return out if quant_dtype is None else (out, scale)


def _batch_invariant() -> bool:
    # vLLM's batch-invariant mode keeps the activation unquantised here (its _apply_attn_res does).
    try:
        import vllm.envs as envs
    except ImportError:
        return False
    return bool(envs.VLLM_BATCH_INVARIANT)


def fp8_dtype_of(quant_key: Any) -> torch.dtype | None:
    """The FP8 dtype to fuse for ``quant_key``: its dtype when it describes what vLLM's ``_apply_attn_res`` fuses
    (``kFp8DynamicTokenSym``: e4m3 data, a dynamic fp32 per-token scale, symmetric, no second scale) and vLLM is
    not in batch-invariant mode; None (an unquantised output) for any other key, as vLLM does."""
    if quant_key is None:
        return None
    scale = getattr(quant_key, "scale", None)
    fused = (getattr(quant_key, "dtype", None) in reference.FP8_MAX and getattr(quant_key, "symmetric", False)
             and getattr(quant_key, "scale2", None) is None and scale is not None
             and getattr(scale, "static", True) is False and getattr(scale, "dtype", None) == torch.float32
             and tuple(getattr(scale, "group_shape", ())) == (1, -1))
    return quant_key.dtype if fused and not _batch_invariant() else None


def apply_attn_res(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj: _LinearLike, norm: _RMSNormLike,
                   num_valid_blocks: int, *, delta: torch.Tensor | None = None,
                   output_norm: _RMSNormLike | None = None, block_write_idx: int = -1, quant_key: Any = None,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.33's ``vllm.models.kimi_k3.amd.linear._apply_attn_res``, on k3_ops's kernels.

    ``proj`` is a ``Linear(H, 1)``-like module (``.weight`` [1, H]), ``norm`` and ``output_norm`` RMSNorm-like
    modules (``.weight`` [H], ``.variance_epsilon`` or ``.eps``). Computes :func:`attn_res` with those weights and
    epsilons: ``prefix_sum`` updated in place with ``delta``, the snapshot at ``block_write_idx``, the FP32-mix
    norm with ``output_norm``. Returns a tensor, or, where ``quant_key`` asks for the dynamic per-token FP8 output
    (:func:`fp8_dtype_of`), the pair ``(data, scale)`` that vLLM wraps as
    ``QuantizedActivation(data, scale, prefix_sum.dtype, prefix_sum.shape, quant_key)``
    (:func:`apply_attn_res_vllm` does). Without any keyword it is the plain mix, differentiable like
    ``k3_ops.attn_res``.
    """
    return attn_res(prefix_sum, delta, block_residual, norm.weight, proj.weight,
                    None if output_norm is None else output_norm.weight, num_valid_blocks, block_write_idx,
                    _norm_eps(norm), 0.0 if output_norm is None else _norm_eps(output_norm),
                    quant_dtype=fp8_dtype_of(quant_key))


def apply_attn_res_vllm(prefix_sum: torch.Tensor, block_residual: torch.Tensor, proj: _LinearLike,
                        norm: _RMSNormLike, num_valid_blocks: int, *, delta: torch.Tensor | None = None,
                        output_norm: _RMSNormLike | None = None, block_write_idx: int = -1, quant_key: Any = None):
    """:func:`apply_attn_res` with vLLM's return type: the FP8 pair as a vLLM ``QuantizedActivation`` (what
    ``K3_OPS_PATCH_ATTN_RES`` installs as a module's ``_apply_attn_res``; needs vLLM installed)."""
    result = apply_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks, delta=delta,
                            output_norm=output_norm, block_write_idx=block_write_idx, quant_key=quant_key)
    if isinstance(result, tuple):
        from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation

        data, scale = result
        return QuantizedActivation(data, scale, prefix_sum.dtype, prefix_sum.shape, quant_key)
    return result


# --- the plugin --------------------------------------------------------------------------------------------
def register() -> None:
    """vLLM general-plugin entry point: make the kimi_k3 ops available in this process and arrange the patches that
    ``K3_OPS_PATCH_ATTN_RES`` asks for (idempotent, thread-safe, logs once; never raises for a setting)."""
    global _registered
    if _registered:  # the common case after the first call: no lock, no work
        return
    with _lock:
        if _registered:
            return
        # Importing this module already imported k3_ops (its parent package), which registered the ops.
        # Resolving each one makes a broken install fail here, at plugin load, not inside the model.
        ops = [getattr(torch.ops.kimi_k3, name).default.name() for name in _OPS]
        try:
            arranged = _arrange_patches()
        except Exception as e:  # vLLM's loader would let it end the engine process
            logger.error("k3_ops: %s=%r could not be applied (%s: %s); the engine's own AttnRes kernels stay in place",
                         PATCH_ENV, os.environ.get(PATCH_ENV), type(e).__name__, e)
            arranged = []
        _registered = True
    logger.info("k3_ops %s: registered %s%s", k3_ops.__version__, ", ".join(ops),
                "".join(f"; {line}" for line in arranged))


def _entries() -> list[str]:
    value = os.environ.get(PATCH_ENV)
    if value is None and os.environ.get(LEGACY_PATCH_ENV):
        value = os.environ[LEGACY_PATCH_ENV]
        logger.warning("k3_ops: %s is the old name of %s; reading it", LEGACY_PATCH_ENV, PATCH_ENV)
    return [entry.strip() for entry in (value or "").split(",") if entry.strip()]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a package whose import raises is not usable either
        return False


def _hint(ascend: bool) -> str:
    if ascend:
        return f"{AUTO}, or {ASCEND_MODEL_MODULES[0]} (vLLM-Ascend registers its own Kimi K3 model)"
    return f"{AUTO}, or {VLLM_MODEL_MODULES[0]} (CUDA, CPU, XPU) or {VLLM_MODEL_MODULES[1]} (ROCm)"


def _arrange_patches() -> list[str]:
    """Patch now what is imported, arrange the rest for when it is; one line per target for the INFO line."""
    ascend = _installed("vllm_ascend")
    lines: list[str] = []
    seen: set[str] = set()
    for entry in _entries():
        if entry.lower() == AUTO:
            targets = [(name, False) for name in (ASCEND_MODEL_MODULES if ascend else VLLM_MODEL_MODULES)]
        else:
            targets = [(entry, True)]
        for name, explicit in targets:
            if name in seen:
                continue
            seen.add(name)
            line = _arrange_op(explicit=True) if name == ASCENDC_OP else _arrange_module(name, explicit, ascend)
            if line:
                lines.append(line)
    return lines


def _arrange_module(name: str, explicit: bool, ascend: bool) -> str | None:
    module = sys.modules.get(name)
    if module is None:
        try:
            spec = importlib.util.find_spec(name)  # imports the parent packages, not the module
        except Exception as e:  # a relative name, garbage, a parent whose import raises ...
            if explicit:
                logger.error("k3_ops: %s; the engine's own AttnRes kernels stay in place there",
                             _bad_name(name, e, ascend))
            else:
                logger.warning("k3_ops: %s=%s: %s cannot be imported (%s: %s); left alone", PATCH_ENV, AUTO, name,
                               type(e).__name__, e)
            return None
        if spec is None:
            if explicit:
                logger.error("k3_ops: %s names module %r, which cannot be found; set %s to %s; the engine's own "
                             "AttnRes kernels stay in place there", PATCH_ENV, name, PATCH_ENV, _hint(ascend))
            return None  # auto: that layout is not in this install
        module = sys.modules.get(name)  # a parent package may have imported it
    if explicit:
        _warn_if_not_called(name, ascend)
    if module is not None:
        return _patch_reported(module)
    _ImportHook.call_after_import(name, _patch_on_import)
    return f"patches {name} when it is imported"


def _bad_name(name: str, error: Exception, ascend: bool) -> str:
    if name.startswith("."):
        return f"{PATCH_ENV} names {name!r}, a relative module name; name the module in full, e.g. {_hint(ascend)}"
    parent, _, leaf = name.rpartition(".")
    holder = sys.modules.get(parent)
    if isinstance(error, ModuleNotFoundError) and holder is not None and hasattr(holder, leaf):
        return (f"{PATCH_ENV} names {name!r}, an attribute of module {parent!r}, not a module; name the module "
                f"({parent}) and k3_ops replaces the entry points it has a drop-in for")
    return (f"{PATCH_ENV} names module {name!r}, which cannot be imported ({type(error).__name__}: {error}); set "
            f"{PATCH_ENV} to the Kimi K3 model module of this engine, e.g. {_hint(ascend)}")


def _warn_if_not_called(name: str, ascend: bool) -> None:
    """An explicit target the engine's model never calls: say which module it calls instead."""
    caller = _BOUND_AT_IMPORT.get(name)
    if caller is not None:
        logger.warning("k3_ops: %s names %s, which the Kimi K3 model does not call at run time: %s binds its "
                       "function at import and keeps the original; patch %s instead (or set %s=%s)", PATCH_ENV,
                       name, caller, caller, PATCH_ENV, AUTO)
    elif ascend and name.startswith("vllm.models.kimi_k3."):
        logger.warning("k3_ops: %s names %s, but vLLM-Ascend is installed and registers its own Kimi K3 model "
                       "(%s), which never calls %s; patch %s instead (or set %s=%s)", PATCH_ENV, name,
                       " / ".join(ASCEND_MODEL_MODULES), name, ASCEND_MODEL_MODULES[0], PATCH_ENV, AUTO)


def _patch_reported(module: ModuleType) -> str | None:
    try:
        names = patch_attn_res(module)
    except AttributeError as e:
        if module.__name__.startswith("vllm_ascend.") and "attn_res_fwd" in _module_code_names(module, {}):
            return _arrange_op(explicit=False)  # the model calls the AscendC op directly: no global to replace
        logger.error("k3_ops: %s; the engine's own AttnRes kernels stay in place there", e)
        return None
    except Exception as e:  # whatever a module does on attribute access: the other targets still get patched
        logger.error("k3_ops: patching %s failed (%s: %s); the engine's own AttnRes kernels stay in place there",
                     module.__name__, type(e).__name__, e)
        return None
    return "patched " + ", ".join(f"{module.__name__}.{n}" for n in names)


def _patch_on_import(module: ModuleType) -> None:
    line = _patch_reported(module)
    if line:
        logger.info("k3_ops: %s", line)


class _ImportHook:
    """Runs a callback right after a module is first imported (its code executed, before the importer gets it):
    how a model module is patched in each process without importing it early. A ``sys.meta_path`` finder that
    lets the other finders find the module and wraps its loader's ``exec_module``."""

    _callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
    _local = threading.local()
    # Its own lock, held for dictionary updates only: the callbacks run inside an import, and a lock held across
    # an import elsewhere (register's) could then wait on that import.
    _lock = threading.Lock()

    @classmethod
    def call_after_import(cls, name: str, callback: Callable[[ModuleType], None]) -> None:
        with cls._lock:
            cls._callbacks.setdefault(name, []).append(callback)
            if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
                sys.meta_path.insert(0, _ImportHook())

    @classmethod
    def forget(cls) -> None:
        """Drop every pending callback and the finder (tests)."""
        with cls._lock:
            cls._callbacks.clear()
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ImportHook)]

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self._callbacks or getattr(self._local, "busy", False):
            return None
        self._local.busy = True  # the other finders' find_spec may import; never wrap recursively
        try:
            spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                         for s in [f.find_spec(fullname, path, target)] if s is not None), None)
        finally:
            self._local.busy = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)  # the module's own errors are the importer's, as without k3_ops
            with self._lock:
                callbacks = self._callbacks.pop(fullname, [])
                if not self._callbacks:
                    sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            for callback in callbacks:
                try:
                    callback(module)
                except Exception as e:  # never break the engine's own import
                    logger.error("k3_ops: patching %s after its import failed (%s: %s); the engine's own AttnRes "
                                 "kernels stay in place there", fullname, type(e).__name__, e)

        loader.exec_module = exec_then_patch  # this module's loader instance only
        return spec


# --- what is replaced in a module --------------------------------------------------------------------------
_Params = tuple[tuple[str, ...], ...]


def _drop_in(fn: Callable) -> Callable:
    fn.__k3_ops_drop_in__ = True
    return fn


def _flash_comm_ctx(module: ModuleType, original: Callable) -> Any:
    """The model's ``_EXTRA_CTX`` where its function ends with the flash-comm step (its code calls
    ``torch.ops.vllm.maybe_chunk_residual``), else None: the drop-in then keeps that step exactly where the model
    has it."""
    return getattr(module, "_EXTRA_CTX", None) if "maybe_chunk_residual" in _code_names(original) else None


def _bind_ctx(fn: Callable, name: str) -> Callable[[ModuleType, Callable], Callable]:
    def make(module: ModuleType, original: Callable) -> Callable:
        ctx = _flash_comm_ctx(module, original)
        if ctx is None:
            return fn

        def bound(*args: Any, **kwargs: Any) -> torch.Tensor:
            return fn(*args, **kwargs, extra_ctx=ctx)

        bound.__name__ = bound.__qualname__ = name
        bound.__doc__ = fn.__doc__
        return _drop_in(bound)
    return make


#: The entry points a model module may define -> (the leading parameter names its signature must have, alternatives
#: per position; a factory ``(module, original) -> replacement``). Every one a module defines is replaced, except
#: ``attn_res`` next to ``_apply_attn_res``: vLLM's amd/linear.py imports its ops module's kernel under that name and
#: calls it only through ``_apply_attn_res``.
DROP_INS: dict[str, tuple[_Params, Callable[[ModuleType, Callable], Callable]]] = {
    # vLLM 0.33: amd/linear.py (ROCm, and the layers vLLM-Ascend's main line derives from).
    "_apply_attn_res": ((("prefix_sum",), ("block_residual",), ("proj",), ("norm",), ("num_valid_blocks",)),
                        lambda module, original: apply_attn_res_vllm),
    # vLLM 0.33: nvidia/model.py's kernel call (CUDA, CPU, XPU).
    "attn_res": ((("prefix",), ("delta",), ("blocks",), ("norm_weight",), ("qk_weight",)),
                 lambda module, original: attn_res),
    # vLLM-Ascend, release line and vllm-ascend-kimi-k3: the wrapper with the flash-comm step (form 1).
    "_apply_attention_residual": ((("prefix_sum",), ("block_residual",), ("projection", "proj"), ("norm",)),
                                  _bind_ctx(vllm_ascend.apply_attention_residual, "_apply_attention_residual")),
    # vLLM-Ascend, main line (form 2).
    "_apply_ascend_attn_res": ((("prefix_sum",), ("block_residual",), ("proj", "projection"), ("norm",),
                                ("num_valid_blocks",)),
                               _bind_ctx(vllm_ascend.apply_ascend_attn_res, "_apply_ascend_attn_res")),
    # vLLM-Ascend's Triton module global (forms 1, 2 and 4).
    "apply_attn_res": ((("prefix_sum",), ("block_residual",), ("proj", "projection"), ("norm",)),
                       lambda module, original: vllm_ascend.apply_attn_res),
}


#: The drop-ins DROP_INS installs as they are (the flash-comm closures carry ``__k3_ops_drop_in__``).
_DROP_IN_FUNCTIONS = (attn_res, apply_attn_res_vllm, vllm_ascend.apply_attn_res, vllm_ascend.apply_attention_residual,
                      vllm_ascend.apply_ascend_attn_res)


def _has_params(fn: Callable, expected: _Params) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= len(expected) and all(p in alts for p, alts in zip(positional, expected))


def patch_attn_res(module: str | ModuleType) -> list[str]:
    """Replace a Kimi K3 model module's AttnRes entry points with k3_ops's drop-ins; returns their names.

    ``module`` (a module, or its dotted name: imported here) gets every entry point of :data:`DROP_INS` it defines
    replaced, where its signature is the one the drop-in replaces (else left alone, with a warning). Idempotent.
    Raises ImportError for a module that cannot be imported and AttributeError for one with nothing to replace,
    each naming the module, the entry points looked for and ``K3_OPS_PATCH_ATTN_RES``.
    """
    ascend = _installed("vllm_ascend")
    if isinstance(module, str):
        try:
            module = importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"{PATCH_ENV} names module {module!r}, which cannot be imported ({e}); set "
                              f"{PATCH_ENV} to the Kimi K3 model module of this engine, e.g. {_hint(ascend)}") from e
    patched, originals = [], {}
    for name, (params, make) in DROP_INS.items():
        original = getattr(module, name, None)
        if not callable(original) or (name == "attn_res" and callable(getattr(module, "_apply_attn_res", None))):
            continue
        if any(original is f for f in _DROP_IN_FUNCTIONS) or getattr(original, "__k3_ops_drop_in__", False):
            patched.append(name)
            continue
        if not _has_params(original, params):
            logger.warning("k3_ops: %s.%s has the signature %s, not the one k3_ops's drop-in replaces (%s, ...); "
                           "left alone", module.__name__, name, _signature(original),
                           ", ".join("|".join(alts) for alts in params))
            continue
        setattr(module, name, make(module, original))
        patched.append(name)
        originals[name] = original
    if not patched:
        raise AttributeError(f"{PATCH_ENV} names module {module.__name__!r}, which defines none of "
                             f"{', '.join(DROP_INS)} (the entry points k3_ops replaces); set {PATCH_ENV} to the "
                             f"module that does, e.g. {_hint(ascend)}")
    _after_patch(module, originals)
    return patched


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unknown)"


def _after_patch(module: ModuleType, originals: dict[str, Callable]) -> None:
    for name, original in originals.items():
        holders = _holders(original, module)
        if holders:
            logger.warning("k3_ops: %s bound %s.%s at import and keep the original: calls from there do not reach "
                           "k3_ops; patch %s instead", ", ".join(holders), module.__name__, name, holders[-1])
    if module.__name__ == VLLM_MODEL_MODULES[0] and "attn_res" in originals:
        _arrange_warmup()
    if module.__name__ in VLLM_MODEL_MODULES:
        _warn_latency_specialized(_current_vllm_config())
    if module.__name__.startswith("vllm_ascend.") and "attn_res_fwd" in _module_code_names(module, originals):
        _arrange_op(explicit=False)


def _holders(original: Callable, module: ModuleType) -> list[str]:
    """The other modules that hold ``original``, where ``module`` defines it: they imported it by name."""
    if getattr(original, "__module__", None) != module.__name__:
        return []
    found = []
    for other_name, other in list(sys.modules.items()):
        if other is module or other is None or other_name.startswith("k3_ops"):
            continue
        try:
            if any(value is original for value in list(vars(other).values())):
                found.append(other_name)
        except Exception:  # a module object without a plain namespace
            continue
    return sorted(found)


def _code_names(fn: Any) -> set[str]:
    """Every global and attribute name a function's code (nested code included) refers to."""
    names: set[str] = set()
    stack = [getattr(fn, "__code__", None)]
    while stack:
        code = stack.pop()
        if isinstance(code, types.CodeType):
            names.update(code.co_names)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def _module_code_names(module: ModuleType, replaced: dict[str, Callable]) -> set[str]:
    """The names the code a module defines (functions, class methods) refers to, without the functions replaced."""
    skip = set(map(id, replaced.values()))
    names: set[str] = set()
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) != module.__name__ or id(value) in skip:
            continue
        members = list(vars(value).values()) if isinstance(value, type) else [value]
        for member in members:
            member = getattr(member, "__func__", getattr(member, "fget", member))  # static/class method, property
            names |= _code_names(member)
    return names


# --- vLLM-Ascend's AscendC op -------------------------------------------------------------------------------
_op_libs: list[torch.library.Library] = []
#: The AscendC op's overloads by argument count -> the drop-in: its first form, and the fused form with and
#: without the trailing ``optimize_prefill``.
_ASCENDC_FORMS = {5: vllm_ascend.attn_res_fwd_mix, 12: vllm_ascend.attn_res_fwd, 13: vllm_ascend.attn_res_fwd}


def patch_ascendc_op() -> list[str]:
    """Replace the PrivateUse1 kernel of every overload of vLLM-Ascend's ``torch.ops._C_ascend.attn_res_fwd`` with
    k3_ops's drop-in of its form (:func:`k3_ops.vllm_ascend.attn_res_fwd`, or :func:`~k3_ops.vllm_ascend.
    attn_res_fwd_mix` for the five-argument form); its schema and Meta kernel stay vLLM-Ascend's. Returns the
    overloads replaced. Raises AttributeError where the op is not registered (vLLM-Ascend's extension not loaded)
    or has no overload of a known form."""
    packet = torch.ops._C_ascend.attn_res_fwd
    replaced, lib = [], torch.library.Library("_C_ascend", "IMPL")
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        fn = _ASCENDC_FORMS.get(len(schema.arguments))
        if fn is None:
            logger.warning("k3_ops: _C_ascend::attn_res_fwd.%s has a form k3_ops has no drop-in for (%s); left alone",
                           overload, schema)
            continue
        name = "attn_res_fwd" if overload == "default" else f"attn_res_fwd.{overload}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl(name, fn, "PrivateUse1")
        replaced.append(name)
    if not replaced:
        lib._destroy()
        raise AttributeError(f"_C_ascend::attn_res_fwd has no overload of a form k3_ops replaces "
                             f"({packet.overloads()})")
    _op_libs.append(lib)
    return replaced


def _arrange_op(explicit: bool) -> str | None:
    """Replace the AscendC op's kernel now, or right after vLLM-Ascend's extension registers it."""
    try:
        return "patched " + ", ".join(f"_C_ascend::{n}" for n in patch_ascendc_op())
    except (AttributeError, RuntimeError) as e:
        extension = "vllm_ascend.vllm_ascend_C"
        if extension not in sys.modules and _installed(extension):
            _ImportHook.call_after_import(extension, lambda module: _arrange_op_logged())
            return f"patches {ASCENDC_OP} when {extension} registers it"
        (logger.error if explicit else logger.warning)(
            "k3_ops: %s cannot be patched (%s); vLLM-Ascend's AscendC kernel stays in place", ASCENDC_OP, e)
        return None


def _arrange_op_logged() -> None:
    line = _arrange_op(explicit=True)
    if line:
        logger.info("k3_ops: %s", line)


# --- vLLM's AttnRes warmup and its specialized decode ------------------------------------------------------
def _arrange_warmup() -> None:
    module = sys.modules.get(_WARMUP_MODULE)
    if module is not None:
        _patch_warmup(module)
    elif _installed(_WARMUP_MODULE):
        _ImportHook.call_after_import(_WARMUP_MODULE, _patch_warmup)
    else:
        logger.info("k3_ops: this vLLM has no %s; k3_ops's kernels compile in vLLM's dummy runs before graph "
                    "capture", _WARMUP_MODULE)


def _patch_warmup(module: ModuleType) -> None:
    if callable(getattr(module, "_warm_attn_res", None)):
        module._warm_attn_res = warm_attn_res
    else:
        logger.info("k3_ops: %s has no _warm_attn_res; k3_ops's kernels compile in vLLM's dummy runs before graph "
                    "capture", module.__name__)


def warm_attn_res(worker: Any) -> None:
    """What vLLM's ``kimi_k3_triton_warmup`` calls in place of its ``_warm_attn_res`` once nvidia/model.py is patched:
    ``k3_ops.warmup`` for the model's hidden size, dtype, block count and token budget (every launch configuration
    the serving calls can pick, in place of vLLM's kernels, which the patched model no longer calls). Logs what it
    warmed, or why it skipped; never raises (the kernels then compile in vLLM's dummy runs before graph capture)."""
    try:
        vllm_config = getattr(worker, "vllm_config", None)
        _warn_latency_specialized(vllm_config)
        config = worker.model_config.hf_text_config
        block_size = getattr(config, "attn_res_block_size", None)
        if block_size is None:
            logger.info("k3_ops: AttnRes warmup skipped: the model config has no attn_res_block_size")
            return
        max_blocks = -(-int(config.num_hidden_layers) // int(block_size))
        if not torch.cuda.is_available():
            logger.info("k3_ops: AttnRes warmup skipped: no CUDA device in this process")
            return
        dtype = worker.model_config.dtype
        scheduler = getattr(worker, "scheduler_config", None) or getattr(vllm_config, "scheduler_config", None)
        max_tokens = int(getattr(scheduler, "max_num_batched_tokens", 0) or 65536)
        device = torch.device("cuda", torch.cuda.current_device())
        count = k3_ops.warmup(int(config.hidden_size), dtype, device, max_num_valid_blocks=max_blocks,
                              max_num_tokens=max_tokens, serving=True)
        logger.info("k3_ops: AttnRes warmup: %d kernel configurations (H=%d, %s, K <= %d, T <= %d) in place of "
                    "vLLM's kernels", count, int(config.hidden_size), dtype, max_blocks, max_tokens)
    except Exception as e:  # a failed warmup must not end the engine
        logger.warning("k3_ops: AttnRes warmup skipped (%s: %s); k3_ops's kernels compile in vLLM's dummy runs "
                       "before graph capture", type(e).__name__, e)


def _current_vllm_config() -> Any:
    try:
        from vllm.config.vllm import get_current_vllm_config_or_none
    except Exception:  # another vLLM: nothing to look at
        return None
    return get_current_vllm_config_or_none()


_latency_warned = False


def _warn_latency_specialized(vllm_config: Any) -> None:
    """vLLM's ``decode_backend=latency_specialized`` (its SM100 CuteDSL decode executor) runs the decode steps it
    serves with its own AttnRes kernels, past any patch: say so, once per process."""
    global _latency_warned
    extra = getattr(vllm_config, "additional_config", None)
    if _latency_warned or not isinstance(extra, dict) or extra.get("decode_backend") != "latency_specialized":
        return
    _latency_warned = True
    logger.warning("k3_ops: decode_backend=latency_specialized: vLLM's specialized decode runs its own CuteDSL "
                   "AttnRes kernels in the decode steps it serves, which no patch reaches; k3_ops's kernels run in "
                   "the stock forward only (prefills, larger batches, steps it falls back on)")
