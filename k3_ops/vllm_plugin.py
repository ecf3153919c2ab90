"""vLLM / vLLM-Ascend integration: the ``vllm.general_plugins`` entry point and drop-ins for vLLM 0.33's Kimi K3
model (``vllm/models/kimi_k3/``), with its exact contract. See docs/integration.md.

pyproject.toml declares::

    [project.entry-points."vllm.general_plugins"]
    k3_ops = "k3_ops.vllm_plugin:register"

vLLM loads every plugin of that group in every process it starts (API server, engine core, each worker) and calls
it once there, before the model is built; its loader does not catch what a plugin raises, so ``register`` never
raises for a configuration problem: it logs it. ``register`` makes the ``torch.ops.kimi_k3`` ops available in that
process (importing k3_ops loads the schemas, Meta kernels and device kernels), patches the model modules named in
``K3_OPS_PATCH_ATTN_RES`` and logs once per process, through the ``vllm.k3_ops`` logger: vLLM configures only its
``vllm`` logger (with its own handler, propagation off), so only a child of it shows up in vLLM's output. It is
idempotent and thread-safe.

The drop-ins, each with the signature and semantics of the vLLM function it replaces:

- :func:`attn_res` for ``vllm.models.kimi_k3.nvidia.ops.attn_res`` (what ``nvidia/model.py`` calls, on CUDA, CPU,
  XPU and vLLM-Ascend; with the AMD ops module's ``quant_dtype`` keyword too): one ``kimi_k3::fused_attn_res_`` call,
  the prefix updated in place, the output norm of the FP32 mix.
- :func:`apply_attn_res` for ``vllm.models.kimi_k3.amd.linear._apply_attn_res`` (ROCm), returning the FP8
  pair ``(data, scale)`` where vLLM returns a ``QuantizedActivation``; :func:`apply_attn_res_vllm` wraps the pair
  into vLLM's ``QuantizedActivation`` and is what the patch installs.

``K3_OPS_PATCH_ATTN_RES`` holds comma-separated module paths; in each, ``register`` replaces ``_apply_attn_res``
(if the module defines it) or else ``attn_res``, in every process. A module that cannot be imported or defines
neither is logged as an error naming the module, the attributes looked for and the variable, and left alone
(the engine then runs vLLM's own kernel there).
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType
from typing import Any

import torch

import k3_ops
from k3_ops import reference
from k3_ops.ops import _LinearLike, _norm_eps, _RMSNormLike

__all__ = ["register", "attn_res", "apply_attn_res", "apply_attn_res_vllm", "fp8_dtype_of", "patch_attn_res",
           "PATCH_ENV", "LEGACY_PATCH_ENV", "PATCH_ATTRIBUTES", "LOGGER_NAME"]

#: A child of vLLM's ``vllm`` logger, which is the only one vLLM's logging configuration gives a handler.
LOGGER_NAME = "vllm.k3_ops"
logger = logging.getLogger(LOGGER_NAME)

PATCH_ENV = "K3_OPS_PATCH_ATTN_RES"
#: The variable's earlier name (it only ever patched ``_apply_attn_res``); still read, with a warning.
LEGACY_PATCH_ENV = "K3_OPS_PATCH_APPLY_ATTN_RES"
#: The attributes a patched module may define, in the order they are looked for.
PATCH_ATTRIBUTES = ("_apply_attn_res", "attn_res")
_MODULE_HINT = ("vllm.models.kimi_k3.nvidia.model (CUDA, CPU, XPU, vLLM-Ascend) or vllm.models.kimi_k3.amd.linear "
                "(ROCm)")
_OPS = ("attn_res", "attn_res_backward", "fused_attn_res", "fused_attn_res_")

_lock = threading.Lock()
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
    """vLLM general-plugin entry point: make the kimi_k3 ops available in this process and patch the modules named
    in ``K3_OPS_PATCH_ATTN_RES`` (idempotent, thread-safe, logs once; never raises for a bad module name)."""
    global _registered
    if _registered:  # the common case after the first call: no lock, no work
        return
    with _lock:
        if _registered:
            return
        # Importing this module already imported k3_ops (its parent package), which registered the ops.
        # Resolving each one makes a broken install fail here, at plugin load, not inside the model.
        ops = [getattr(torch.ops.kimi_k3, name).default.name() for name in _OPS]
        patched = []
        for name in _modules_to_patch():
            try:
                patched.append(f"{name}.{patch_attn_res(name)}")
            except (ImportError, AttributeError) as e:
                # vLLM's plugin loader does not catch plugin errors: raising here would kill the engine process
                # over a typo in an environment variable. The engine runs vLLM's own kernel in that module instead.
                logger.error("k3_ops: %s; vLLM's own AttnRes kernel stays in place there", e)
        _registered = True
    logger.info("k3_ops %s: registered %s%s", k3_ops.__version__, ", ".join(ops),
                f"; patched {', '.join(patched)}" if patched else "")


def _modules_to_patch() -> list[str]:
    value = os.environ.get(PATCH_ENV)
    if value is None and os.environ.get(LEGACY_PATCH_ENV):
        value = os.environ[LEGACY_PATCH_ENV]
        logger.warning("k3_ops: %s is the old name of %s; reading it", LEGACY_PATCH_ENV, PATCH_ENV)
    return [name.strip() for name in (value or "").split(",") if name.strip()]


def patch_attn_res(module: str | ModuleType) -> str:
    """Replace a Kimi K3 model module's AttnRes entry point with k3_ops's; returns the attribute replaced.

    ``module`` (a module or its dotted name) must define ``_apply_attn_res`` (replaced by
    :func:`apply_attn_res_vllm`) or else ``attn_res`` (replaced by :func:`attn_res`). Idempotent. Raises
    ImportError for a module that cannot be imported and AttributeError for one that defines neither, each naming
    the module, the attributes looked for and ``K3_OPS_PATCH_ATTN_RES``.
    """
    if isinstance(module, str):
        try:
            module = importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"{PATCH_ENV} names module {module!r}, which cannot be imported ({e}); set {PATCH_ENV} "
                              f"to the Kimi K3 model module of this vLLM, e.g. {_MODULE_HINT}") from e
    for name, replacement in zip(PATCH_ATTRIBUTES, (apply_attn_res_vllm, attn_res)):
        if callable(getattr(module, name, None)):
            if getattr(module, name) is not replacement:
                setattr(module, name, replacement)
            return name
    raise AttributeError(f"{PATCH_ENV} names module {module.__name__!r}, which defines neither "
                         f"{' nor '.join(PATCH_ATTRIBUTES)} (the functions k3_ops replaces); set {PATCH_ENV} to the "
                         f"module that does, e.g. {_MODULE_HINT}")
