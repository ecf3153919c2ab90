"""vLLM / vLLM-Ascend integration: the ``vllm.general_plugins`` entry point and an ``_apply_attn_res`` drop-in.

pyproject.toml declares::

    [project.entry-points."vllm.general_plugins"]
    k3_ops = "k3_ops.vllm_plugin:register"

vLLM loads every plugin of that group in every process it starts (API server, engine core, each worker)
and calls it once there, before the model is built. ``register`` makes the ``torch.ops.kimi_k3`` ops
available in that process (importing k3_ops loads the schemas, Meta kernels and device kernels) and logs
once per process. It is idempotent and thread-safe: calling it again, from any thread, does nothing.

Model code then calls the ops directly, or swaps its helper for the drop-in::

    from k3_ops.vllm_plugin import apply_attn_res as _apply_attn_res

``apply_attn_res(prefix_sum, block_residual, proj, norm, num_valid_blocks)`` has the engines' signature
(``proj`` a Linear(H, 1)-like module, ``norm`` an RMSNorm-like module with ``.variance_epsilon`` or
``.eps``). Without editing the model file, set ``K3_OPS_PATCH_APPLY_ATTN_RES`` to a comma-separated list of
model modules (e.g. the K3 model's module path in your vLLM build); ``register`` then replaces each module's
``_apply_attn_res`` with the drop-in, in every process. See docs/integration.md.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType

import torch

import k3_ops
from k3_ops.ops import apply_attn_res

__all__ = ["register", "apply_attn_res", "patch_apply_attn_res", "PATCH_ENV"]

logger = logging.getLogger(__name__)

PATCH_ENV = "K3_OPS_PATCH_APPLY_ATTN_RES"
_HELPER_NAME = "_apply_attn_res"
_OPS = ("attn_res", "attn_res_backward", "fused_attn_res")

_lock = threading.Lock()
_registered = False


def register() -> None:
    """vLLM general-plugin entry point: make the kimi_k3 ops available in this process (idempotent)."""
    global _registered
    if _registered:  # the common case after the first call: no lock, no work
        return
    with _lock:
        if _registered:
            return
        # Importing this module already imported k3_ops (its parent package), which registered the ops.
        # Resolving each one makes a broken install fail here, at plugin load, not inside the model.
        ops = [getattr(torch.ops.kimi_k3, name).default.name() for name in _OPS]
        patched = [patch_apply_attn_res(name) for name in _modules_to_patch()]
        _registered = True
    logger.info("k3_ops %s: registered %s%s", k3_ops.__version__, ", ".join(ops),
                f"; {_HELPER_NAME} patched in {', '.join(m.__name__ for m in patched)}" if patched else "")


def _modules_to_patch() -> list[str]:
    return [name.strip() for name in os.environ.get(PATCH_ENV, "").split(",") if name.strip()]


def patch_apply_attn_res(module: str | ModuleType) -> ModuleType:
    """Replace ``module._apply_attn_res`` with :func:`apply_attn_res` (the module or its dotted name).

    Idempotent. The module must already define ``_apply_attn_res`` (so that a typo in the module name or a
    model without the helper fails loudly instead of silently doing nothing). Returns the module.
    """
    mod = importlib.import_module(module) if isinstance(module, str) else module
    current = getattr(mod, _HELPER_NAME, None)
    if current is None:
        raise AttributeError(f"{PATCH_ENV}: module {mod.__name__} must define {_HELPER_NAME} to be patched, "
                             f"got a module without it")
    if current is not apply_attn_res:
        setattr(mod, _HELPER_NAME, apply_attn_res)
    return mod
