"""What every benchmark section shares: options, the ops under test, inputs, the environment record, progress."""
from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from .timing import Timer

__all__ = ["DTYPES", "Options", "Ops", "k3_ops_ops", "unfused", "Problem", "environment", "commit", "progress",
           "measure", "bytes_moved", "site_weights"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6


@dataclass
class Options:
    """The knobs every section reads. ``None`` means "the section's default for this device" (see each section's
    ``DEFAULTS``): the full grid on a GPU, small shapes on a CPU, a smoke grid with ``quick``."""

    device: str | None = None
    dtype: str = "bf16"
    weight_dtype: str | None = None  # None: the I/O dtype, as a checkpoint stores the norm and projection weights
    hidden: int | None = None
    capacity: int | None = None
    tokens: list[int] | None = None
    blocks: list[int] | None = None
    layouts: list[str] | None = None
    rep_ms: float = 20.0
    quick: bool = False
    plain: bool = False  # add plain-launch columns (device time of one call, cold L2) to mix and fused
    refs: bool = True  # time the reference formulas (eager FP32 formula, torch.compile of it) where a section has them
    max_ref_tokens: int | None = None  # skip the reference formulas above this T
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    extra: dict = field(default_factory=dict)  # section-specific settings (the layer section's "layers")

    def resolved(self) -> Options:
        """These options with the device filled in: CUDA when present, else the CPU."""
        return replace(self, device=self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.resolved().device)

    @property
    def io_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def w_dtype(self) -> torch.dtype:
        return DTYPES[self.weight_dtype or self.dtype]

    def pick(self, section_defaults: dict[str, dict], name: str):
        """``name`` from the options, else from the section's defaults for this run, the first of "quick-cpu" or
        "quick-gpu" and "quick" (with ``quick``), then "cpu" or "gpu", then "all" that has it."""
        value = getattr(self, name)
        if value is not None:
            return value
        kind = "cpu" if self.torch_device.type == "cpu" else "gpu"
        for key in ((f"quick-{kind}", "quick") if self.quick else ()) + (kind, "all"):
            if name in section_defaults.get(key, {}):
                return section_defaults[key][name]
        raise KeyError(f"no default for {name!r}")


@dataclass(frozen=True)
class Ops:
    """The callables a section times, each with the signature of the kimi_k3 op it stands for; None skips it.

    attn_res: ``(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps) -> out``
    fused: ``(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
    out_norm_weight, out_norm_eps) -> (out, new_prefix)``
    backward: ``(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
    output_mask) -> (grad_prefix_sum, grad_block_residual, grad_weight)``

    Pass ``{"name": Ops(...), ...}`` to a section's ``run`` to time kernel variants side by side in one run.
    """

    attn_res: Callable | None = None
    fused: Callable | None = None
    backward: Callable | None = None


def k3_ops_ops() -> Ops:
    """The registered kimi_k3 ops, through the dispatcher (what a user calls)."""
    import k3_ops  # noqa: F401  (registers the ops)

    lib = torch.ops.kimi_k3
    return Ops(lib.attn_res.default, lib.fused_attn_res.default, lib.attn_res_backward.default)


def unfused(attn_res: Callable) -> Callable:
    """The fused op's call as the unfused sequence a decoder layer runs without it: torch's add, the snapshot
    copy into the slot, ``attn_res`` and torch's RMSNorm of its output."""

    def call(prefix_sum, addend, block_residual, norm_weight, proj_weight, K, eps, block_write_idx=-1,
             out_norm_weight=None, out_norm_eps=None):
        new_prefix = prefix_sum if addend is None else prefix_sum + addend
        if block_write_idx >= 0:
            block_residual[:, block_write_idx].copy_(new_prefix)
        mix = attn_res(new_prefix, block_residual, norm_weight, proj_weight, K, eps)
        if out_norm_weight is None:
            return mix, new_prefix
        norm_eps = eps if out_norm_eps is None else out_norm_eps
        return torch.nn.functional.rms_norm(mix, (mix.size(-1),), out_norm_weight, norm_eps), new_prefix

    return call


def site_weights(H: int, dtype: torch.dtype, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """(norm_weight [H], proj_weight [1, H], out_norm_weight [H]) of one call site, model-like magnitudes."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    norm_w = 1.0 + 0.1 * torch.randn(H, generator=g)
    proj_w = torch.randn(1, H, generator=g) * 2.0 / H**0.5
    out_w = 1.0 + 0.1 * torch.randn(H, generator=g)
    return tuple(w.to(device=device, dtype=dtype) for w in (norm_w, proj_w, out_w))


class Problem:
    """One preallocated problem at the largest T; every (T, K) takes views of it, as a serving engine does.

    The buffer is token-major [T, C, H] or block-major [C, T, H] (passed as a ``transpose(0, 1)`` view, never
    copied); ``poison(K)`` puts NaN in the slots a call with K valid blocks must never read.
    """

    def __init__(self, max_tokens: int, capacity: int, H: int, dtype: torch.dtype, device: torch.device,
                 layout: str, weight_dtype: torch.dtype | None = None):
        if layout not in ("token", "block"):
            raise ValueError(f"layout must be 'token' or 'block', got {layout!r}")
        self.H, self.capacity, self.layout, self.max_tokens = H, capacity, layout, max_tokens
        shape = (max_tokens, capacity, H) if layout == "token" else (capacity, max_tokens, H)
        # Random values drawn on the device: generating gigabytes on the CPU would dominate the run.
        self.storage = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 1.0)
        self.prefix = torch.empty((max_tokens, H), dtype=dtype, device=device).normal_(0.0, 1.5)
        self.addend = torch.empty((max_tokens, H), dtype=dtype, device=device).normal_(0.0, 0.5)
        self.norm_weight, self.proj_weight, self.out_norm_weight = site_weights(
            H, weight_dtype or dtype, device, seed=0)

    def blocks(self, T: int) -> torch.Tensor:
        """[T, C, H] view of the buffer."""
        return self.storage[:T] if self.layout == "token" else self.storage[:, :T].transpose(0, 1)

    def poison(self, K: int) -> None:
        """NaN in slots >= K, as uninitialised capacity holds: a kernel that reads them returns NaN."""
        self.blocks(self.max_tokens)[:, K:].fill_(float("nan"))

    def restore(self, K: int) -> None:
        """Numbers in slots >= K again, so that a larger K reads real data."""
        self.blocks(self.max_tokens)[:, K:].normal_(0.0, 1.0)

    def attn_res_args(self, T: int, K: int) -> tuple:
        return (self.prefix[:T], self.blocks(T), self.norm_weight, self.proj_weight, K, EPS)

    def fused_args(self, T: int, K: int, block_write_idx: int) -> tuple:
        return (self.prefix[:T], self.addend[:T], self.blocks(T), self.norm_weight, self.proj_weight, K, EPS,
                block_write_idx, self.out_norm_weight, EPS)


def measure(timer: Timer, impls: dict, args: tuple, row: dict, bw: float, plain: bool, notes: list,
            where: str) -> None:
    """``us:<name>`` (main method), ``bw:<name>`` (fraction of copy bandwidth) and, with ``plain``,
    ``plain:<name>`` (one plain launch) of each callable on ``args``; a non-finite output is noted."""
    for name, fn in impls.items():
        call = partial(fn, *args)
        out = call()
        if not bool(torch.isfinite(out[0] if isinstance(out, tuple) else out).all()):
            notes.append(f"{name} returned non-finite values at {where}")
        row[f"us:{name}"] = us = timer.primary(call)
        row[f"bw:{name}"] = row["bytes"] / (us * 1e-6) / bw
        if plain and timer.is_cuda:
            row[f"plain:{name}"] = timer.launch(call)


def bytes_moved(T: int, H: int, itemsize: int, rows_read: int, rows_written: int) -> int:
    return (rows_read + rows_written) * T * H * itemsize


def commit() -> str:
    """The commit being measured: ``K3_OPS_COMMIT`` if set (a copied tree may carry another checkout's git
    metadata), else ``git rev-parse`` where git and a repository are present (with "+dirty" for local
    changes), else "unknown"."""
    env = os.environ.get("K3_OPS_COMMIT")
    if env:
        return env
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=here)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=here)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    """Device, versions and commit, recorded with every section's results."""
    info = {"torch": torch.__version__, "python": platform.python_version(), "commit": commit(),
            "device_type": device.type}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info.update(device=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


class progress:
    """A tqdm progress bar on stderr (``enabled`` None: only when stderr is a terminal); silent without tqdm.
    Use as a context manager and call ``step(label)`` once per measured shape."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=desc, disable=None if enabled is None else not enabled,
                             leave=False, dynamic_ncols=True)

    def step(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)

    def __enter__(self) -> progress:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
