"""What every benchmark section shares: options, the ops under test, inputs (warm: one preallocated problem; cold: many
input sets), the environment record, the measurement of a row's cells, progress."""
from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from ..devices import best_device
from .timing import Timer

__all__ = ["DTYPES", "L2_MODES", "Options", "Ops", "k3_ops_ops", "unfused", "Problem", "ColdSets", "environment",
           "commit", "progress", "measure", "measure_cold", "bytes_moved", "footprint", "site_weights", "floor_cells",
           "FLOOR_NAMES", "CPU_NOTE", "l2_modes", "section_params"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6
#: The L2 states a section can time its calls in (``--l2``): the same inputs replayed, or a rotation of input sets.
L2_MODES = ("warm", "cold")
#: The measured floors under a call (``bench.floor``'s geometries), by the row key's name; the cell's floor is the
#: fastest of them.
FLOOR_NAMES = {"floor": "tile", "floor_stream": "stream", "floor_row": "row"}
#: What a CPU run's figures are: printed with every section's table and written with its result.
CPU_NOTE = ("CPU: every op runs its reference formula (the CPU kernel: the FP32 PyTorch formula plus the op's dispatch "
            "and argument checks), timed as wall time per call with a fixed thread count, so the ratios between "
            "columns are not kernel figures; a smoke run of the benchmark, not a kernel benchmark")


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
    full: bool = False  # the full grids (the sections' "full-gpu" / "full-cpu" defaults) instead of the lean ones
    plain: bool = False  # add plain-launch columns (device time of one call, cold L2) to mix and fused
    refs: bool = True  # time the reference formulas (eager FP32 formula, torch.compile of it) where a section has them
    max_ref_tokens: int | None = None  # skip the reference formulas above this T
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    l2: list[str] | None = None  # L2 states to time (L2_MODES); None: the section's default (cold on a GPU)
    extra: dict = field(default_factory=dict)  # section-specific settings (the layer section's "layers")

    def resolved(self) -> Options:
        """These options with the device filled in: the best present (``k3_ops.devices.best_device``: CUDA, an
        NPU, else the CPU), as the main job picks it."""
        return replace(self, device=self.device or best_device().type)

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
        "quick-gpu" and "quick" (with ``quick``), "full-cpu" or "full-gpu" (with ``full``), then "cpu" or "gpu",
        then "all" that has it."""
        value = getattr(self, name)
        if value is not None:
            return value
        kind = "cpu" if self.torch_device.type == "cpu" else "gpu"
        keys = ((f"quick-{kind}", "quick") if self.quick else ()) + ((f"full-{kind}",) if self.full else ())
        for key in keys + (kind, "all"):
            if name in section_defaults.get(key, {}):
                return section_defaults[key][name]
        raise KeyError(f"no default for {name!r}")


@dataclass(frozen=True)
class Ops:
    """The callables a section times, each with the signature of the kimi_k3 op it stands for; None skips it.

    attn_res: ``(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps) -> out``
    fused: ``(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
    out_norm_weight, out_norm_eps) -> (out, new_prefix)``
    fused_inplace: the same arguments ``-> (out, scale)``, the new prefix stored into ``prefix_sum`` (the serving
    call as vLLM's model makes it: ``kimi_k3::fused_attn_res_``)
    backward: ``(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
    output_mask) -> (grad_prefix_sum, grad_block_residual, grad_norm_weight, grad_proj_weight)``

    Pass ``{"name": Ops(...), ...}`` to a section's ``run`` to time kernel variants side by side in one run.
    """

    attn_res: Callable | None = None
    fused: Callable | None = None
    backward: Callable | None = None
    fused_inplace: Callable | None = None


def k3_ops_ops() -> Ops:
    """The registered kimi_k3 ops, through the dispatcher (what a user calls)."""
    import k3_ops  # noqa: F401  (registers the ops)

    lib = torch.ops.kimi_k3
    return Ops(lib.attn_res.default, lib.fused_attn_res.default, lib.attn_res_backward.default,
               lib.fused_attn_res_.default)


def l2_modes(opts: Options, device: torch.device) -> list[str]:
    """The L2 states a section times: ``opts.l2`` (default cold) on CUDA; warm alone elsewhere (no cold method
    there: a CPU run times wall time per call)."""
    modes = list(opts.l2 or ["cold"])
    bad = [m for m in modes if m not in L2_MODES]
    if bad:
        raise ValueError(f"l2 must name states from {L2_MODES}, got {bad[0]!r}")
    return modes if device.type == "cuda" else ["warm"]


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


def footprint(T: int, H: int, itemsize: int, rows: int, weights: int, w_itemsize: int) -> int:
    """Bytes of its input set one call touches: ``rows`` [T, H] rows read or written in the set (the outputs go to
    fresh memory, not counted) and ``weights`` [H] weight vectors."""
    return rows * T * H * itemsize + weights * H * w_itemsize


class ColdSets:
    """``n`` input sets of one call shape, each in its own memory (buffer, prefix, addend and the three weights of
    a call site), for cold-L2 timing (``Timer.cold``): the same layout as ``Problem`` (token-major [T, C, H] or
    block-major [C, T, H] through a ``transpose(0, 1)`` view), NaN in every slot >= K of every set."""

    def __init__(self, n: int, T: int, capacity: int, H: int, dtype: torch.dtype, w_dtype: torch.dtype,
                 device: torch.device, layout: str, K: int):
        if layout not in ("token", "block"):
            raise ValueError(f"layout must be 'token' or 'block', got {layout!r}")
        if n < 1:
            raise ValueError(f"ColdSets: n must be >= 1, got {n}")
        self.n, self.T, self.layout = n, T, layout
        shape = (n * T, capacity, H) if layout == "token" else (capacity, n * T, H)
        self.storage = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 1.0)
        (self.storage[:, K:] if layout == "token" else self.storage[K:]).fill_(float("nan"))
        self.prefix = torch.empty((n * T, H), dtype=dtype, device=device).normal_(0.0, 1.5)
        self.addend = torch.empty((n * T, H), dtype=dtype, device=device).normal_(0.0, 0.5)
        w = torch.empty((3, n, H), dtype=torch.float32, device=device)
        w[0].normal_(1.0, 0.1)
        w[1].normal_(0.0, 2.0 / H**0.5)
        w[2].normal_(1.0, 0.1)
        self.norm_weight, self.proj_weight, self.out_norm_weight = w.to(w_dtype).unbind(0)

    @staticmethod
    def allocated(T: int, capacity: int, H: int, itemsize: int, w_itemsize: int) -> int:
        """Bytes one set holds: the buffer at full capacity, the prefix, the addend, three weights."""
        return (capacity + 2) * T * H * itemsize + 3 * H * w_itemsize

    def blocks(self, i: int) -> torch.Tensor:
        rows = slice(i * self.T, (i + 1) * self.T)
        return self.storage[rows] if self.layout == "token" else self.storage[:, rows].transpose(0, 1)

    def attn_res_args(self, i: int, K: int) -> tuple:
        rows = slice(i * self.T, (i + 1) * self.T)
        return (self.prefix[rows], self.blocks(i), self.norm_weight[i], self.proj_weight[i][None], K, EPS)

    def fused_args(self, i: int, K: int, block_write_idx: int) -> tuple:
        rows = slice(i * self.T, (i + 1) * self.T)
        return (self.prefix[rows], self.addend[rows], self.blocks(i), self.norm_weight[i], self.proj_weight[i][None],
                K, EPS, block_write_idx, self.out_norm_weight[i], EPS)


def _finite(out) -> bool:
    return bool(torch.isfinite(out[0] if isinstance(out, tuple) else out).all())


def _spread(timer: Timer, row: dict, name: str, notes: list, where: str) -> None:
    spread = timer.last
    if spread is None:
        return
    row[f"spread:{name}"] = spread.relative
    if spread.wide:
        notes.append(f"wide spread: {name} at {where}: interquartile range {100 * spread.relative:.0f} % of the "
                     f"median over {spread.samples} samples")


def measure(timer: Timer, impls: dict, args: tuple, row: dict, bw: float, plain: bool, notes: list,
            where: str) -> None:
    """``us:<name>`` (main method: warm-L2 graph replay on CUDA, wall time elsewhere), ``bw:<name>`` (fraction of
    copy bandwidth), ``spread:<name>`` (interquartile range / median; a wide one is noted) and, with ``plain``,
    ``plain:<name>`` (one plain launch) of each callable on ``args``; a non-finite output is noted."""
    for name, fn in impls.items():
        call = partial(fn, *args)
        if not _finite(call()):
            notes.append(f"{name} returned non-finite values at {where}")
        row[f"us:{name}"] = us = timer.primary(call)
        _spread(timer, row, name, notes, where)
        row[f"bw:{name}"] = row["bytes"] / (us * 1e-6) / bw
        if plain and timer.is_cuda:
            row[f"plain:{name}"] = timer.launch(call)


def measure_cold(timer: Timer, impls: dict, set_args: list[tuple], row: dict, bw: float, notes: list,
                 where: str) -> None:
    """As ``measure``, cold L2: each callable timed by ``Timer.cold`` over the input sets ``set_args`` (one
    argument tuple per set)."""
    for name, fn in impls.items():
        calls = [partial(fn, *args) for args in set_args]
        if not _finite(calls[0]()):
            notes.append(f"{name} returned non-finite values at {where}")
        row[f"us:{name}"] = us = timer.cold(calls)
        _spread(timer, row, name, notes, where)
        row[f"bw:{name}"] = row["bytes"] / (us * 1e-6) / bw


def floor_cells(row: dict, first: str | None, limits: dict, nodes: int = 1) -> None:
    """A row's floor columns from its measured floors (``FLOOR_NAMES``): ``floor_us`` the fastest of them and
    ``floor_geometry`` its geometry, ``floor_frac`` = floor / the first kernel's time; and ``limit_us`` = ``nodes``
    graph nodes + bytes / copy bandwidth (the simple limit of a bandwidth-bound captured call, or of ``nodes``
    calls), ``limit_frac`` = that limit / the first kernel's time. Absent where nothing was measured to make them."""
    floors = {n: row[f"us:{n}"] for n in FLOOR_NAMES if row.get(f"us:{n}")}
    ours = row.get(f"us:{first}") if first else None
    if floors:
        name = min(floors, key=floors.get)
        row["floor_us"], row["floor_geometry"] = floors[name], FLOOR_NAMES[name]
        if ours:
            row["floor_frac"] = floors[name] / ours
    node, bw = limits.get("graph_node_us"), limits.get("copy_bandwidth_Bps")
    if node and bw and "bytes" in row:
        row["limit_us"] = nodes * node + 1e6 * row["bytes"] / bw
        if ours:
            row["limit_frac"] = row["limit_us"] / ours


def timing_columns(names: list[str], first: str | None, plain: bool, bw_names: list[str]) -> list[list[str]]:
    """The columns the timed sections share: each name's time, the first kernel's spread, the plain-launch times
    (``plain``), and the share of the copy bandwidth of each of ``bw_names``."""
    columns = [[f"us:{n}", f"{n} us", ".2f"] for n in names]
    if first:
        columns.append([f"spread:{first}", f"{first} IQR/median", ".2f"])
    if plain:
        columns += [[f"plain:{n}", f"{n} plain us", ".2f"] for n in names]
    return columns + [[f"bw:{n}", f"{n} of BW", ".3f"] for n in bw_names]


def floor_columns(rows: list[dict], first: str) -> list[list[str]]:
    """The floor and limit columns (``floor_cells``) of the rows that have them."""
    columns = []
    if any("floor_frac" in r for r in rows):
        columns += [["floor_frac", "floor / " + first, ".2f"], ["floor_geometry", "floor geometry", ""]]
    if any("limit_frac" in r for r in rows):
        columns.append(["limit_frac", "limit / " + first, ".2f"])
    return columns


def section_params(opts: Options, timer: Timer, H: int, capacity: int, modes: list[str], **extra) -> dict:
    """The ``params`` of a section's result: dtypes, shape, timing method, L2 states timed; on a CPU also the
    thread count and ``CPU_NOTE``."""
    params = {"dtype": opts.dtype, "weight_dtype": opts.weight_dtype or opts.dtype, "hidden": H,
              "capacity": capacity, "timing": "CUDA-graph replay" if timer.mode == "graph" else "wall time per call",
              "l2": list(modes), **extra}
    if timer.device.type == "cpu":
        params["threads"] = torch.get_num_threads()
        params["cpu_note"] = CPU_NOTE
    return params


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
