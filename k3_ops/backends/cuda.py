"""CUDA launch policy for the kimi_k3 Triton kernels (NVIDIA GPUs; also drives the kernels under
``TRITON_INTERPRET=1`` on CPU tensors, which is how CI tests this policy without a GPU).

Forward (``attn_res_forward``, and ``fused_attn_res`` through the same plans), kernel paths:

- **token** (decode sizes: the default up to ``TOKEN_MAX_T`` tokens, ``TOKEN_MAX_T_K16`` for K <= 16, and
  ``LOOP_MAX_T`` for K = 3..16):
  ``kernels/attn_res_decode.py``, one program per token streaming its K block rows in [ROWS, next_pow2(H)] tiles
  through an online softmax, the prefix candidate folded in last (first in the one-row plans at K = 5..16 above 128
  tokens and K = 3..4 above 512: ``LaunchConfig.prefix_first``), or (K <= 4 up to 512 tokens) holding them all in
  one tile with the prefix row beside it; every row read once, no workspace. With
  programmatic dependent launch (PDL) on sm_90+: a captured chain of calls overlaps each launch with its
  predecessor's tail (``K3_OPS_PDL=0`` turns it off).
- **rows** (large T): a persistent grid (``ctas_per_sm`` programs per SM); each program streams the candidate rows
  of its tokens (tokens pid, pid + grid, ...) as one continuous, prefetched sequence through a [next_pow2(H)]
  hidden tile with ``cols < H`` masks and an online softmax. Each candidate row is read once in its native dtype;
  each output row is written once; the folded weight is read once per program. Any K.
- **split** (the fallback of the cluster entries at T <= 4; K + 1 <= 16,
  larger K goes to the token path): H split into P = cdiv(H, chunk) programs per token, each holding a
  [K_PAD, chunk] tile of all candidates in registers; partial (sum v^2, <v, w>) per chunk are written by a first
  launch and combined by a second (a third scales the output norm). The partials live in a buffer allocated per
  call from the caching allocator, like an output.
- **tiles** (opt-in): the Ascend kernel's two-pass algorithm on CUDA, for comparison.
- **cluster** (the default for K = 5..8 up to 64 tokens, K = 3..4 up to 32, K = 2 up to 16): the CUDA C++
  kernel of csrc_cuda/attn_res_cluster_kernel.h, each token split over a thread-block cluster of ``cluster_size``
  CTAs exchanging their partial statistics through distributed shared memory (sm_90+, a CUDA build of
  k3_ops._C, 16-bit rows, K <= 8, H a multiple of 8 x cluster_size, unit hidden strides, 16-byte aligned rows;
  the plain op and every fused call, the output norm and the FP8 output included). Everything else that a
  cluster entry meets runs its ``fallback`` entry.
- **stream** (the default for K = 5..8 above 2048 tokens and K = 3..4 above 4096): the CUDA C++ kernel of
  csrc_cuda/attn_res_stream.cu: two persistent 4-warp CTAs per SM, each thread owning H / 128 columns of every row,
  the rows of the CTA's tokens streamed one at a time through a shared-memory ring (cp.async) with an online
  softmax; the fused epilogue holds only the thread's own columns, the output norm's weight in shared memory.
  Same rules and ``fallback`` as the cluster path (it is the native entry's cluster size 1).

Concurrency: no path keeps state between launches or shares a buffer across calls, so any number of launches may
be in flight on any streams of one device, eagerly or replayed from CUDA graphs (tests/test_concurrency.py).

Launch table: ``LAUNCH_TABLE`` maps (T bucket, K bucket) -> ``LaunchConfig``; buckets are the powers of two in
``T_BUCKETS`` / ``K_BUCKETS`` (a value goes to the first bucket >= it). Benchmarks override an entry with
``set_launch_config`` or bypass the table with ``attn_res_forward(..., config=LaunchConfig(...))``.
Compile keys are small and enumerable (dtype, kernel, tile sizes, VEC, num_warps, stages, PDL, H_STRIDED, the
fused flags), and ``warmup`` compiles every one the table can pick for a model, before graph capture.

Launch path (host time): in a CUDA build the op's CUDA kernel is C++ (csrc_cuda/launch_cache.cpp) and replays the
launches this policy recorded for the call's metadata; this module runs on the first call of each key (and for
calls nothing can replay). Here a resolved plan is cached per (T bucket, K, H, device), and kernels are launched
through ``backends/_launch.py``: the compiled kernel's handle, cached per compile key, is called directly instead
of re-binding ~30 arguments through Triton's JIT on every call.

Layouts: ``prefix_sum`` and ``block_residual`` are read in place at any token / block strides (token-major
[T, C, H] and block-major [C, T, H].transpose(0, 1) views alike); the output is a new contiguous [T, H].
Unit hidden stride is the fast path. A non-unit hidden stride is handled correctly through the
``H_STRIDED`` constexpr (a separate, slower compiled variant, compiled on first use, not by ``warmup``).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace

import torch
import triton

from .. import reference
from ..kernels import attn_res_decode as _decode
from ..kernels import attn_res_fwd as _fwd
from . import (
    TRITON_COMPILE_OPTIONS,
    _backward,
    _launch,
    hidden_strided,
    next_power_of_2,
    prepare_weights,
    stride_vec,
    trivial_attn_res,
)
from ._fused import FusedArgs as _FusedArgs
from ._fused import (
    add_snapshot_args,
    add_snapshot_outputs,
    full_outputs,
    fused_hidden_dims,
    fused_kernel_args,
    fused_token_strides,
    kernel_output,
    trivial_full_call,
    trivial_fused_attn_res,
    trivial_serving_call,
)

__all__ = [
    "LaunchConfig",
    "T_BUCKETS",
    "K_BUCKETS",
    "LAUNCH_TABLE",
    "TOKEN_MAX_T",
    "TOKEN_MAX_T_K16",
    "LOOP_MAX_T",
    "INTERPRETER_NUM_SMS",
    "bucket",
    "set_launch_config",
    "choose_config",
    "num_sms",
    "use_interpreter",
    "pdl_enabled",
    "attn_res_forward",
    "fused_attn_res",
    "SERVING_TOKEN_CONFIG",
    "fused_attn_res_quant",
    "fused_attn_res_",
    "fused_attn_res_full",
    "warmup",
    "BackwardConfig",
    "BACKWARD_CONFIG",
    "choose_backward_plan",
    "attn_res_backward",
]

# --------------------------------------------------------------------------------------------------------------
# Common helpers (shared with the backward / fused launch functions of this module).
# --------------------------------------------------------------------------------------------------------------
#: SM count assumed when the kernels run under the Triton interpreter (CPU tensors): an H200's, so the
#: interpreter exercises the same path choices as the GPU the benchmarks run on.
INTERPRETER_NUM_SMS = 132

_properties_cache: dict[int, object] = {}


def use_interpreter(t: torch.Tensor | torch.device) -> bool:
    """True when kernels on ``t`` (a tensor or a device) run under the Triton interpreter (TRITON_INTERPRET=1, or
    a CPU tensor)."""
    device = t if isinstance(t, torch.device) else t.device
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _properties(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA ``device``, read once per device and cached (launch
    policies consult it on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = _properties_cache.get(index)
    if props is None:
        props = _properties_cache[index] = torch.cuda.get_device_properties(index)
    return props


def num_sms(device: torch.device) -> int:
    """Streaming-multiprocessor count of ``device`` (the interpreter's stand-in H200 count on CPU)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_NUM_SMS


def pdl_enabled(device: torch.device) -> bool:
    """Whether forward launches on ``device`` use programmatic dependent launch: a GPU of compute capability 9.0+
    (not the interpreter), a Triton with ``launch_pdl``, and ``K3_OPS_PDL`` not "0". Read per plan resolution,
    so changing the variable takes effect for new (T bucket, K, H) plans; ``clear_plan_cache()`` resets all."""
    if use_interpreter(device) or os.environ.get("K3_OPS_PDL", "1") == "0":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return _properties(device).major >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL_CONTEXT = _NullContext()


def _device_guard(t: torch.Tensor):
    # Triton launches on the *current* device; make it the tensors' device (a no-op context when it already is,
    # the common case, which costs no device switch).
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NULL_CONTEXT


def _stream(t: torch.Tensor) -> int | None:
    # The raw current stream of the tensors' device (what Triton's driver would look up), or None off-GPU.
    return torch._C._cuda_getCurrentRawStream(t.device.index) if t.device.type == "cuda" else None


# --------------------------------------------------------------------------------------------------------------
# Launch table.
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    """One launch-table entry.

    kernel: "token", "rows", "split", "tiles", "cluster" or "stream".
    num_warps: warps per program; None derives it from the tile size.
    rows_per_tile: token path only, block rows per [ROWS, BLOCK_H] tile (a power of two), or 0: one tile holding
        every block row of the call (next_pow2(K) rows) with the prefix row beside it, no loop (``ONE_TILE``), where
        that tile is at most ``ONE_TILE_MAX_ELEMENTS`` (else 4-row tiles); either way unpipelined.
    prefix_first: token path with a loop (rows_per_tile >= 1) only: fold the prefix candidate into the online
        softmax before the block rows, not after them, so that its row is dead in the loop (sm_90, triton 3.8: the
        fused call's 120-byte spill at one row per tile and 4 warps goes, and 4-row tiles take 243 registers, not
        255) and the fused call stores the new prefix and the snapshot before the loop; other rounding, the same
        in the plain op and the fused call. The table's one-row plans at K = 5..16 (above 128 tokens) set it.
    num_stages: token path, and rows path with prefetch 0: software-pipelining depth of the row loads (each stage
        past the first holds a tile in shared memory: (num_stages - 1) x rows_per_tile x next_pow2(H) x itemsize
        bytes on the token path, which must fit the device's opt-in, 227 KB on an H200).
    pdl: token, rows, cluster and stream paths: programmatic dependent launch; None = ``pdl_enabled(device)``.
    ctas_per_sm: rows path only, persistent programs per SM (the grid is min(T, SMs x ctas_per_sm)).
    tokens_per_prog: tiles path only, tokens handled by one program.
    chunk: split path only, hidden elements per program (power of two).
    prefetch: rows path only, candidate rows held in registers ahead of the one being reduced (1 or 2), or 0 to
        let Triton's pipeliner stage them in shared memory ``num_stages`` deep.
    maxnreg: register cap per thread (None: the compiler's choice); caps buy occupancy at the risk of spills.
    tile_h: tiles path only (the two-pass [K_PAD, tile_h] kernel also used on Ascend), hidden tile width.
    cluster_size: cluster path only, CTAs per token (2, 4 or 8).
    min_k: cluster and stream paths only, the smallest K it runs; smaller K, and calls or shapes it cannot run,
        take ``fallback`` (None: ``CLUSTER_FALLBACK_CONFIG``).
    norm_gram: token and cluster paths, fused calls with the output norm: the norm's sum of squares from the
        candidates' pairwise products, reduced (cluster: exchanged) with their statistics (``NORM_GRAM`` in
        kernels/attn_res_decode.py, ``kGram`` in csrc_cuda/attn_res_cluster_kernel.h), not over the mix after it; on the
        token path where the plan's tiles have at most 4 rows (a one-tile plan at K <= 4, loops of 1, 2 or 4 rows),
        else as without it; a cluster plan's fallback takes its own. The mix, new_prefix and the snapshot are the
        same bits; the norm's sum of squares is the FP32 mix's, not the rounded mix's (within the norm's
        tolerance).
    gram_tau: with norm_gram, the guard: where |mix|^2 < gram_tau (sum_i p_i |v_i|)^2 (candidates that cancel),
        the norm reduces over its input as without norm_gram.
    onw_ahead: token path, fused calls with the output norm and no FP8 output: load the norm's weight with the
        inputs (``ONW_AHEAD``: its round trip hides behind theirs) rather than after the mix; the same bits either
        way. None: where the tiles have at most 2 rows over at least 8 warps. Ahead costs registers: the one-tile
        plan's fused call at K = 1 takes 154 with it and 122 without (sm_90, triton 3.6, bf16 weights), one
        program of 8 warps per SM against two.
    """

    kernel: str = "rows"
    num_warps: int | None = None
    rows_per_tile: int = 4
    num_stages: int = 3
    pdl: bool | None = None
    ctas_per_sm: int = 2
    tokens_per_prog: int = 1
    chunk: int = 512
    prefetch: int = 1
    maxnreg: int | None = None
    tile_h: int = 1024
    cluster_size: int = 8
    min_k: int = 1
    fallback: LaunchConfig | None = None
    prefix_first: bool = False
    norm_gram: bool = False
    gram_tau: float = 2.0 ** -6
    onw_ahead: bool | None = None

    def __post_init__(self):
        if self.kernel not in ("token", "rows", "split", "tiles", "cluster", "stream"):
            raise ValueError("LaunchConfig.kernel must be 'token', 'rows', 'split', 'tiles', 'cluster' or 'stream', "
                             f"got {self.kernel!r}")
        if self.cluster_size not in (2, 4, 8):
            raise ValueError(f"LaunchConfig.cluster_size must be 2, 4 or 8, got {self.cluster_size}")
        if self.prefetch not in (0, 1, 2):
            raise ValueError(f"LaunchConfig.prefetch must be 0, 1 or 2, got {self.prefetch}")
        for name in ("chunk", "tile_h"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two >= 16, got {v}")
        if self.rows_per_tile == 0 and self.kernel != "token":
            raise ValueError(f"LaunchConfig.rows_per_tile 0 (one tile) is the token path's only, got kernel "
                             f"{self.kernel!r}")
        if self.rows_per_tile < 0 or self.rows_per_tile & (self.rows_per_tile - 1):
            raise ValueError("LaunchConfig.rows_per_tile must be a power of two >= 1, or 0 for one tile, got "
                             f"{self.rows_per_tile}")
        for name in ("ctas_per_sm", "tokens_per_prog", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"LaunchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_first and (self.kernel != "token" or self.rows_per_tile == 0):
            raise ValueError("LaunchConfig.prefix_first is the token path's with rows_per_tile >= 1 only, got kernel "
                             f"{self.kernel!r}, rows_per_tile {self.rows_per_tile}")
        if self.norm_gram and not (self.kernel == "cluster" or (self.kernel == "token" and self.rows_per_tile <= 4)):
            raise ValueError("LaunchConfig.norm_gram is the cluster path's, or the token path's with rows_per_tile 0, "
                             f"1, 2 or 4, only; got kernel {self.kernel!r}, rows_per_tile {self.rows_per_tile}")
        if not self.gram_tau >= 0.0:
            raise ValueError(f"LaunchConfig.gram_tau must be >= 0, got {self.gram_tau}")
        if self.onw_ahead is not None and self.kernel != "token":
            raise ValueError(f"LaunchConfig.onw_ahead is the token path's only, got kernel {self.kernel!r}")


T_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 1 << 62)
#: K = 5..6 and 7..8 are buckets of their own: at 65-128 tokens they take different tiles (``_default_entry``).
K_BUCKETS = (1, 2, 4, 6, 8, 16, 32, 64, 1 << 62)
#: Split path only while K + 1 fits the [K_PAD, chunk] register tile.
SPLIT_MAX_CANDIDATES = 16
#: The largest tile (rows x next_pow2(H)) a one-tile token plan holds (rows_per_tile 0); larger K take 4-row tiles.
ONE_TILE_MAX_ELEMENTS = 8 * 8192
#: The token path is the default up to this many tokens at every K, the rows path above (docs/benchmarks.md,
#: "Plain mix")...
TOKEN_MAX_T = 256
#: ... except for K <= 16 (every K of Kimi K3 and up to twice it; the K buckets 1..16), which keeps the token path
#: up to this many tokens...
TOKEN_MAX_T_K16 = 512
#: ... and K = 3..16 further, up to this many tokens per K bucket (the one-row plan, the prefix first, 3 stages).
LOOP_MAX_T = {4: 4096, 6: 2048, 8: 2048, 16: 4096}


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The first bucket bound >= value."""
    for b in buckets:
        if value <= b:
            return b
    return buckets[-1]


#: The large-T rows kernel as the table runs it (and as the streaming entries' fallback): "Large T" below.
ROWS_CONFIG = LaunchConfig(kernel="rows", num_warps=4, ctas_per_sm=2, prefetch=0, num_stages=3)


def _default_entry(t_bucket: int, k_bucket: int) -> LaunchConfig:
    # From one H200 sweep (docs/benchmarks.md, "Plain mix"; bf16, H = 7168, graph replay):
    # - T <= 4, K = 5..8: the split path: more SMs per token than one program can use, its partials in a per-call
    #   buffer between two launches (T = 1, K = 8: 4.7 us against 5.7 for the best per-token tile; at K = 4 the
    #   split's second launch costs more than it saves: 5.4 us against 4.0).
    # - K <= 4 up to 512 tokens (but the cluster entries below, and where the cluster kernel cannot run): one
    #   program per token, every block row in one tile (next_pow2(K) rows) with the
    #   prefix row beside it, 8 warps, no loop (``rows_per_tile`` 0); the fused call stores new_prefix and the
    #   snapshot at their load. Same run (tools/plan_variants.py one_tile, at 9d8ab42) against the entries before
    #   it (K = 1..2: tiles of K rows, 8 warps, up to 128 tokens; K = 3..4: 4-row tiles, 8 warps; 129-256 tokens:
    #   one row at a time, 4 warps, 3 stages): the plain op at T = 1 / 64 / 128, K = 1 1.92 / 2.18 / 2.57 us
    #   against 2.47 / 2.71 / 3.02, K = 4 3.18 / 3.55 / 4.15 against 3.77 / 4.16 / 4.69; the fused call with its
    #   output norm K = 1 3.14 / 3.33 / 3.80 against 3.37 / 3.65 / 4.21, K = 4 4.30 / 4.61 / 5.11 against 5.11 /
    #   5.57 / 6.40. At T = 256 the fused call gains at every K (K = 1 / 3 / 4: 6.80 / 9.21 / 9.74 against 8.47 /
    #   10.67 / 11.89) and so does the plain op at K = 1, 2, 4, but the plain op at K = 3 loses (7.09 against
    #   6.73): the plain op shares the fused call's plan (its mix is the fused call's bit for bit), and the fused
    #   call is the one a decoder layer makes twice. At 257-512 tokens the same plan replaces the rows kernel
    #   (tools/plan_variants.py one_tile_large at f5a5419, same run): the fused call at T = 384 / 512, K = 1 9.92 /
    #   14.60 us against 14.52 / 17.07, K = 4 16.11 / 22.49 against 27.19 / 28.61; the plain op at K = 1 5.19 / 6.02
    #   against 7.77 / 7.86, K = 2 6.59 / 8.01 against 9.98 / 10.06, but at T = 512, K = 3 / 4 15.13 / 16.70
    #   against 12.41 / 14.99; the layer step at T = 512 1162.3 against 1261.4. Not above: at T = 768-1024 the
    #   fused call loses at K = 1..2 (T = 1024, K = 1 35.37 against 32.84) and the plain op at K = 3..4.
    # - K >= 5 at 129-256 tokens and K = 5..8 at 257-512 tokens (K = 9..16: below): one program per token, one row at a
    #   time, 4 warps, 3 stages. At T = 512, K = 8, against the rows kernel, same run: the fused call 35.37 against
    #   42.92 us, the plain op 25.40 against 25.11; at T = 1024 / 2048 the fused call 68.29 / 133.72 against 81.23 /
    #   157.46 but the plain op 47.13 / 89.12 against 46.51 / 89.12, and at K <= 4 the plain op loses 4-10 %: the rows
    #   kernel stays there. At K = 5..8 that plan folds the prefix candidate first (``prefix_first``; its row dead in
    #   the loop, the fused call's stores before it): same run at 149d12a (tools/plan_variants.py prefix_first,
    #   docs/data/prefix_first_h200_149d12a.txt), the table timed before and after it, the fused call at T = 192 / 256 /
    #   384 / 512, K = 8 13.83 / 15.44 / 27.60 / 30.43 us against 15.54-15.55 / 16.71-16.77 / 31.51-31.53 / 33.38 (K =
    #   5: 10.31 / 10.86 / 21.62 / 25.06 against 11.89-11.90 / 12.21-12.22 / 24.95 / 27.48-27.53), the plain op 9.87 /
    #   10.34 / 21.31 / 23.70 against 10.78-10.80 / 11.21-11.26 / 20.53-20.55 / 24.19-24.21 (it loses at T = 384 only,
    #   2-5 % at every K: the fused call is the one a layer makes twice), the layer step at T = 512 1050.4 against
    #   1126.4-1130.0. Not in the tiles at 65-128 tokens: the fused call there 7.79-8.75 us against 6.88-8.72 (T = 80 /
    #   128, K = 5..8). Around that plan, same run at 16132f0 (tools/plan_variants.py loop_plans,
    #   docs/data/loop_plans_*_h200_16132f0.json): at K = 5..8 2 stages, 8 warps and 2-row tiles lose (T = 256, K =
    #   8, fused: 17.61 / 20.39 / 19.48 us against 15.44), and 4 stages gain 0.3-4 % at T = 192, K = 5 and 8 and
    #   T = 384, K = 8 but lose elsewhere, up to 6.6 % (T = 256, K = 8 in the same 129-256 bucket: 15.82).
    # - K = 9..16 at 129-512 tokens (the rows kernel at 257-512 before): the same one-row plan with 4 stages, the
    #   prefix first. Same run (loop_plans) against one row with the prefix last, 3 stages (the entry before, up to
    #   256 tokens) and the rows kernel (above): the fused call at T = 192 / 256 / 384 / 512, K = 12 15.82 / 17.36 /
    #   32.97 / 36.71 us against 18.74-18.78 / 19.79-19.81 / 54.65-54.75 / 55.27-55.32, K = 16 19.27 / 21.05 /
    #   40.05 / 43.44 against 22.91-22.97 / 23.90-23.93 / 68.87-68.92 / 69.33-69.46; the plain op K = 16 16.81 /
    #   17.67 / 34.28 / 37.55 against 17.70-17.71 / 18.41-18.42 / 42.63-42.64 / 42.69-42.70. (At T = 384, 8 warps
    #   took the plain op lower, 31.92 at K = 16, but the fused call higher, 45.10.) Untimed at K > 16.
    # - Above 512 tokens, K = 5..8 up to 2048 and K = 9..16 up to 4096 (``LOOP_MAX_T``; the rows kernel before): the
    #   one-row plan, the prefix first, 3 stages. Same run at f779dc5 (tools/plan_variants.py loop_large,
    #   docs/data/loop_large_*_h200_f779dc5.json), the table timed first and last: the fused call at T = 768 / 1024 /
    #   2048, K = 8 43.59 / 56.72 / 108.69 us against 62.35 / 81.57 / 157.88-158.05 (K = 5: 35.78 / 46.37 / 87.55
    #   against 45.64-45.80 / 59.38-59.48 / 114.04-114.09; K = 16 at T = 4096: 296.36 against 519.86-520.21), the
    #   plain op at K = 8 34.46 / 44.91 / 86.39 against 35.75-35.78 / 46.39-46.46 / 89.00 and at K = 16 13-17 %
    #   faster, but at K = 5 2-3 % slower (T = 1024: 34.16 against 33.04-33.07; the fused call is the one a layer
    #   makes twice). 4 stages: the fused call 1-5 % slower at every cell, the plain op within 2 % either way. Not
    #   at K = 5..8 above 2048 tokens, where the streaming kernel gains less against the plain op's loss (T = 4096,
    #   K = 8: the fused call 210.92 against 225.72-225.94, the plain op 167.06 against 163.61; K = 5: 167.91
    #   against 178.76-178.79, 123.25 against 118.43).
    # - Above 512 tokens, K = 3..4 up to 4096 (the K bucket 4 of ``LOOP_MAX_T``; the rows kernel before, the
    #   streaming kernel above): the same plan. Same run at bf31833 (tools/plan_variants.py loop_large_small_k,
    #   docs/data/loop_large_small_k_*_h200_bf31833.json), the table timed first and last: the fused call at
    #   T = 768 / 1024 / 2048 / 4096, K = 4 33.01 / 42.53 / 79.67 / 152.16 us against 40.56 / 52.50-52.56 /
    #   100.12-100.13 / 193.39-193.48 (K = 3: 30.37 / 39.22 / 73.29 / 139.37 against 35.64-35.65 / 45.87-45.91 /
    #   86.41-86.47 / 166.09-166.19), the plain op 4-7 % slower at K = 4 (T = 1024: 30.34 against 28.62-28.63)
    #   and 7-12 % at K = 3 (24.23 -> 26.72): the fused call is the one a decoder layer makes twice, and a
    #   training step's forward is a small part of its backward's time. Not at K = 1..2, where the plain op
    #   loses more than the fused call gains (K = 1, T = 4096: 66.49 against 49.42 plain, 107.53 against
    #   114.13-114.31 fused; K = 2, T = 2048: 41.89 against 35.41-35.42, 63.54 against 72.62-72.66); 4 stages
    #   lose the fused call 2-11 % against 3.
    # - K >= 5 at 65-128 tokens (K = 5..8 at 1-64 tokens where the cluster kernel cannot run): one program per
    #   token, tiles of 4 block rows, 8 warps, no software pipelining (a tile's 4 rows are already in flight
    #   together; a second stage only adds shared-memory traffic); at 65-128 tokens, K = 5..6 tiles of 2 rows
    #   (4-row tiles pad K = 5 / 6 to 8 rows, 2-row tiles to 6; at 2 rows and 8 warps the fused call also loads
    #   its output norm's weight with the inputs). Two runs at f31b667 (docs/data/token_tiles_k56_h200_f31b667.txt),
    #   the table measured before and after the variants: T = 128, K = 5 the fused call 6.84 / 7.07 us against
    #   7.60-7.69 and the plain op 5.69 / 5.92 against 5.90-6.08; K = 6 7.21 against 7.86-7.90 and 6.04 against
    #   6.11-6.24; at K = 7..8 2-row tiles lose the plain op (T = 128, K = 8: 7.10-7.45 against 6.53-6.74).
    # - Large T: the persistent rows kernel with 4 warps: its [8192]-wide FP32 accumulator, weight and current row
    #   need ~255 registers per thread, so exactly two 4-warp programs fit an SM. It stages its rows through shared
    #   memory (prefetch 0: Triton's pipeliner, cp.async, 3 stages) rather than registers (prefetch 1): 0.919 /
    #   0.826 of copy bandwidth at T = 16384 (K = 1 / 8) against 0.83 / 0.79, and the fused op, which shares the
    #   plan, spills 80-132 bytes pipelined (triton 3.6-3.9) against ~1 KB with prefetch 1 (tools/ptxas_info.py).
    # - The cluster kernel (csrc_cuda/attn_res_cluster_kernel.h) for K = 5..8 up to 64 tokens, K = 3..4 up to 32 and
    #   K = 2 up to 16, for the plain op and every fused call on 16-byte rows (so that a fused call's mix is the plain
    #   op's bit for bit); other layouts take the entry the table had before it (``fallback``). Same run
    #   (tools/plan_variants.py cluster_table and cluster_wide, docs/data/cluster_table_*), against those entries:
    #   K = 5..8 at 17-64 tokens (4-row tiles before) the plain op 3.21-4.71 us against 5.76-6.32, the fused call
    #   with its output norm 4.51-6.12 against 7.34-7.98; K = 3..4 up to 32 tokens (one tile before; 8 CTAs per
    #   token) the plain op 2.36-3.10 against 3.11-3.39, the fused call 3.54-4.42 against 4.21-4.46; K = 2 up to
    #   16 tokens (the 2-block variant, 8 CTAs; tools/plan_variants.py cluster_k12,
    #   docs/data/cluster_k12_*_h200_fa2daf6.json) at T = 8..16 2.17-2.33 against 2.52-2.55, fused 3.41-3.56
    #   against 3.70-3.73. It loses at K = 1 at every T (T = 1 with the 2-block variant: 2.10 against 1.91 us
    #   plain, 3.37 with 4 CTAs against 3.15 fused), at K = 2 from 32 tokens (4 CTAs at 24 tokens: 2.52 against
    #   2.57), at K <= 4 from 64 tokens and at K = 5..8 from 128 (T = 128, K = 8: 9.09 against 7.30 with 2 CTAs per
    #   token, whose 448-thread CTAs at about 120 registers fit one per SM).
    # - K = 5..8 above 2048 tokens and K = 3..4 above 4096: the streaming kernel (csrc_cuda/attn_res_stream.cu),
    #   rows through a shared-memory ring, each thread's columns of the mix in registers and the output norm's
    #   weight in shared memory (the rows kernel's fused epilogue spills). Same run against the rows kernel: the
    #   fused call at K = 8, T = 4096 / 16384 225.3 / 829.3 us against 308.2 / 1182.1, the plain op 163.8 / 592.9
    #   against 174.2 / 665.3; K = 4 at T = 16384 576.8 and 360.9 against 745.0 and 386.0. Not below: at T = 1024,
    #   K = 8 the fused call gains (70.7 against 81.8) but the plain op, which shares the plan, loses (50.8 against
    #   46.6); at T = 4096, K = 4 the plain op ties (103.4 against 102.6), and at K = 1 it loses at every T.
    if (t_bucket > 2048 and k_bucket in (6, 8)) or (t_bucket > 4096 and k_bucket == 4):
        return LaunchConfig(kernel="stream", min_k=3, fallback=ROWS_CONFIG)
    # The cluster entries. At K = 5..8 the CTAs per token fall as the tokens grow (8 up to 8 tokens, 4 up to 32, 2
    # up to 64): an 8-CTA cluster must fit in one GPC, and fewer of them than 16 tokens' fit at once (T = 12 / 16,
    # K = 5, plain: 8 CTAs 3.01 / 3.56 us, 4 CTAs 3.09 / 3.12). At K = 3..4 (the 5-candidate variant, fewer
    # registers) 8 CTAs per token beat the one-tile plan at every measured T up to 32; 4 CTAs were up to 0.09 us
    # faster at T = 16 and 0.3-0.4 us slower at T = 32 (the fused call 4.72 / 4.87 against 4.31 / 4.42 at K = 3 / 4).
    if t_bucket <= 64 and k_bucket in (6, 8):
        before = (LaunchConfig(kernel="split", chunk=512) if t_bucket <= 4 else
                  LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1))
        size = 8 if t_bucket <= 8 else 4 if t_bucket <= 32 else 2
        return LaunchConfig(kernel="cluster", cluster_size=size, min_k=5, fallback=before)
    one_tile = LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8, num_stages=1)
    if (t_bucket <= 32 and k_bucket == 4) or (t_bucket <= 16 and k_bucket == 2):
        return LaunchConfig(kernel="cluster", cluster_size=8, min_k=2 if k_bucket == 2 else 3, fallback=one_tile)
    if t_bucket <= TOKEN_MAX_T_K16 and k_bucket <= 4:
        # Above 128 tokens at K <= 2 the fused call loads its output norm's weight after the mix: without the
        # weight's registers two 8-warp programs fit an SM at K = 1 (122 registers against 154). Same run on an H100
        # at a598858 (tools/plan_variants.py onw_after, docs/data/onw_after_h100_a598858.txt), the table timed first
        # and last: the fused call at T = 192 / 256 / 384 / 512, K = 1 4.86 / 5.15 / 8.16 / 13.35 us against 6.05 /
        # 6.40 / 9.68 / 16.37, K = 2 6.65 / 7.13 / 12.15 / 19.97 against 7.05-7.07 / 7.58 / 12.40 / 20.38-20.42; the
        # layer step at T = 512 1165.5 against 1169.6-1170.0. Not at 1..128 tokens, where one program per SM is
        # all a call has: K = 1 at T = 64 / 128 3.32 / 3.86 against 3.22 / 3.68. At K = 2 there two H100 runs
        # (a598858, 42a8524) timed after the mix 3-4 % faster and one H200 run (85e4caa, an earlier kernel) 2-6 %
        # slower: the weight stays ahead (docs/benchmarks.md, "The output norm's weight ahead, above 128 tokens").
        if t_bucket > 128 and k_bucket <= 2:
            return replace(one_tile, onw_ahead=False)
        return one_tile
    if t_bucket <= 128:
        return LaunchConfig(kernel="token", rows_per_tile=2 if k_bucket == 6 else 4, num_warps=8, num_stages=1)
    if t_bucket <= LOOP_MAX_T.get(k_bucket, TOKEN_MAX_T):
        # K = 3..16 (the K buckets 4, 6, 8 and 16 here) fold the prefix first; K = 9..16 with 4 stages up to 512
        # tokens.
        return LaunchConfig(kernel="token", rows_per_tile=1, num_warps=4,
                            num_stages=4 if k_bucket == 16 and t_bucket <= TOKEN_MAX_T_K16 else 3,
                            prefix_first=k_bucket <= 16)
    return ROWS_CONFIG


LAUNCH_TABLE: dict[tuple[int, int], LaunchConfig] = {
    (tb, kb): _default_entry(tb, kb) for tb in T_BUCKETS for kb in K_BUCKETS
}
_table_lock = threading.Lock()


def set_launch_config(t_bucket: int, k_bucket: int, config: LaunchConfig) -> LaunchConfig:
    """Replace one table entry (for tuning); returns the previous one. Buckets must be in T_BUCKETS/K_BUCKETS."""
    if t_bucket not in T_BUCKETS or k_bucket not in K_BUCKETS:
        raise ValueError(f"(t_bucket, k_bucket) must come from T_BUCKETS={T_BUCKETS} and K_BUCKETS={K_BUCKETS}, "
                         f"got ({t_bucket}, {k_bucket})")
    with _table_lock:
        old = LAUNCH_TABLE[(t_bucket, k_bucket)]
        LAUNCH_TABLE[(t_bucket, k_bucket)] = config
        _plan_cache.clear()
    _launch.clear_recipes()
    return old


def _rows_warps(block_h: int) -> int:
    return min(16, max(4, block_h // 1024))


def _split_warps(k_pad: int, chunk: int) -> int:
    # About 64 fp32 tile values per thread.
    return min(16, max(1, (k_pad * chunk) // (64 * 32)))


@dataclass(frozen=True)
class _Plan:
    """A table entry resolved for one shape: exactly what is launched (the compile key lives here). Hashed once
    (it is part of every launch's cache key)."""

    kernel: str
    num_warps: int
    block_h: int = 0  # token, rows
    rows_per_tile: int = 0  # token
    one_tile: bool = False  # token: every block row in one tile of rows_per_tile rows
    prefix_first: bool = False  # token with a loop: the prefix candidate folded before the block rows
    norm_gram: bool = False  # token (tiles of at most 4 rows), cluster: the norm's sum of squares from the statistics
    gram_tau: float = 0.0  # with norm_gram: its guard (LaunchConfig.gram_tau)
    onw_ahead: bool = False  # token: a fused call's output norm weight loaded with the inputs (no FP8 output)
    pdl: bool = False  # token, rows, cluster, stream
    tokens_per_prog: int = 1  # tiles
    ctas_per_sm: int = 0  # rows
    chunk: int = 0  # split
    k_pad: int = 0  # split, tiles
    p: int = 0  # split: programs per token
    p_pad: int = 0  # split
    prefetch: int = 1  # rows
    num_stages: int = 1  # token, rows with prefetch 0
    maxnreg: int | None = None
    tile_h: int = 0  # tiles
    cluster_size: int = 0  # cluster
    fallback: _Plan | None = None  # cluster: the plan of the calls it does not run

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(tuple(self.__dict__.values())))

    def __hash__(self) -> int:
        return self._hash


#: Resolved default plans by (T bucket, K, H, device): choose_config's table walk happens once per key.
_plan_cache: dict[tuple, _Plan] = {}


def clear_plan_cache() -> None:
    """Forget resolved plans and the C++ launch recipes made from them (after changing ``K3_OPS_PDL``;
    ``set_launch_config`` clears both itself)."""
    with _table_lock:
        _plan_cache.clear()
    _launch.clear_recipes()


def choose_config(T: int, K: int, H: int, device: torch.device, config: LaunchConfig | None = None) -> _Plan:
    """Resolve the launch for a shape: the table entry for (bucket(T), bucket(K)), or ``config`` if given."""
    if config is None:
        key = (bucket(T, T_BUCKETS), K, H, device)
        plan = _plan_cache.get(key)
        if plan is None:
            plan = _plan_cache[key] = _resolve(K, H, device, LAUNCH_TABLE[(key[0], bucket(max(K, 1), K_BUCKETS))])
        return plan
    return _resolve(K, H, device, config)


#: The CUDA C++ forward paths (csrc_cuda/attn_res_cluster.cu, attn_res_stream.cu): one native entry, every call,
#: a ``fallback`` plan for what they cannot run.
NATIVE_KERNELS = ("cluster", "stream")

#: The cluster kernel's FP8 output kinds (csrc_cuda/attn_res_cluster.h, Fp8Kind) by out_dtype.
_CLUSTER_FP8_KINDS = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e4m3fnuz: 2}

#: What a cluster config runs where the cluster kernel cannot: the shape, the device or the build (``_resolve``), or
#: the call (``_launch_forward``: the fused op, other layouts).
CLUSTER_FALLBACK_CONFIG = LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1)


def cluster_supported(K: int, H: int, device: torch.device, cluster_size: int, element_size: int = 2) -> bool:
    """Whether the cluster kernel (csrc_cuda/attn_res_cluster_kernel.h), or with cluster_size 1 the streaming kernel
    (csrc_cuda/attn_res_stream.cu), can run this shape on ``device``: a CUDA build of k3_ops._C, a GPU of compute
    capability 9.0+, 16-bit rows, K <= 8 and H a multiple of 8 x cluster_size (streaming: of 8 x 1, 2, 4, 7 or 8,
    at most 128 threads). The layout (unit hidden strides, 16-byte aligned rows) is checked per call."""
    if use_interpreter(device) or not _has_cuda_kernels() or K < 1:
        return False
    from .. import _C

    return _properties(device).major >= 9 and _C.attn_res_cluster_threads(K, H, element_size, cluster_size) > 0


def _cluster_layout_ok(tensors) -> bool:
    # 16-byte vectors: unit hidden strides, rows (pointers and token / block strides) on 16-byte boundaries.
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return False
    return True


def _resolve(K: int, H: int, device: torch.device, config: LaunchConfig) -> _Plan:
    block_h = next_power_of_2(H)
    if config.kernel == "split" and K + 1 > SPLIT_MAX_CANDIDATES:
        # More candidates than the split tile holds: the per-token kernel, which takes any K.
        config = LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1)
    if config.kernel in NATIVE_KERNELS:
        # One native entry: the streaming kernel is its cluster size 1 (csrc_cuda/attn_res_cluster.h).
        cluster_size = config.cluster_size if config.kernel == "cluster" else 1
        fallback = _resolve(K, H, device, config.fallback or CLUSTER_FALLBACK_CONFIG)
        if K < config.min_k or not cluster_supported(K, H, device, cluster_size):
            return fallback
        pdl = pdl_enabled(device) if config.pdl is None else bool(config.pdl and not use_interpreter(device))
        gram = config.norm_gram and config.kernel == "cluster"
        return _Plan(config.kernel, 0, pdl=pdl, cluster_size=cluster_size, fallback=fallback, norm_gram=gram,
                     gram_tau=config.gram_tau if gram else 0.0)
    if config.kernel == "token":
        pdl = pdl_enabled(device) if config.pdl is None else bool(config.pdl and not use_interpreter(device))
        rows, one_tile, stages = config.rows_per_tile, config.rows_per_tile == 0, config.num_stages
        if one_tile:
            rows, stages = next_power_of_2(max(K, 1)), 1
            if rows * block_h > ONE_TILE_MAX_ELEMENTS:
                # A tile that large only spills: the decode default's 4-row tiles, unpipelined (staged fp32 tiles
                # of 8192 columns would not fit the shared memory).
                rows, one_tile = 4, False
        gram = config.norm_gram and rows <= 4
        warps = config.num_warps or _rows_warps(block_h)
        # The output norm's weight ahead by default where it costs no spill: same run, the fused call at K = 1 / 2,
        # T = 1..128 3.38-4.61 us against 3.52-4.69; 4-row tiles and 4 warps spill. The table's entries above 128
        # tokens load it after the mix (``_default_entry``; docs/benchmarks.md, "The output norm's weight ahead,
        # above 128 tokens").
        ahead = rows <= 2 and warps >= 8 if config.onw_ahead is None else config.onw_ahead
        return _Plan("token", warps, block_h=block_h, rows_per_tile=rows, one_tile=one_tile,
                     prefix_first=config.prefix_first and not one_tile, norm_gram=gram,
                     gram_tau=config.gram_tau if gram else 0.0, onw_ahead=ahead, pdl=pdl, num_stages=stages,
                     maxnreg=config.maxnreg)
    if config.kernel == "split":
        k_pad = next_power_of_2(K + 1)
        chunk = min(config.chunk, block_h)
        p = triton.cdiv(H, chunk)
        return _Plan("split", config.num_warps or _split_warps(k_pad, chunk), chunk=chunk, k_pad=k_pad, p=p,
                     p_pad=next_power_of_2(p), maxnreg=config.maxnreg)
    if config.kernel == "tiles":
        k_pad = next_power_of_2(K + 1)
        tile_h = min(config.tile_h, block_h)
        return _Plan("tiles", config.num_warps or _split_warps(k_pad, tile_h), k_pad=k_pad, tile_h=tile_h,
                     tokens_per_prog=config.tokens_per_prog, maxnreg=config.maxnreg)
    pdl = pdl_enabled(device) if config.pdl is None else bool(config.pdl and not use_interpreter(device))
    return _Plan("rows", config.num_warps or _rows_warps(block_h), block_h=block_h, pdl=pdl,
                 ctas_per_sm=config.ctas_per_sm, prefetch=config.prefetch,
                 num_stages=config.num_stages if config.prefetch == 0 else 1, maxnreg=config.maxnreg)


# --------------------------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------------------------
def attn_res_forward(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, num_valid_blocks: int, eps: float, *,
                     config: LaunchConfig | None = None) -> torch.Tensor:
    """kimi_k3::attn_res on CUDA tensors (or CPU tensors under the Triton interpreter).

    Args (already checked by ``k3_ops._C.check_attn_res``):
        prefix_sum: [T, H] bf16/fp16/fp32 (fp64 goes to the reference), any strides.
        block_residual: [T, C, H] same dtype, any strides (token-major or block-major view); only slots < K read.
        norm_weight: [H]; proj_weight: [H] or [1, H]; any floating dtype (non bf16/fp16/fp32 cast to fp32).
        num_valid_blocks: K in [0, C]. eps: > 0.
        config: bypass the launch table (benchmarks / tuning); None uses ``LAUNCH_TABLE``.
    Returns: a new contiguous [T, H] tensor of prefix_sum.dtype.
    """
    out = trivial_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
    if out is not None:
        return out
    T, H = prefix_sum.shape
    K = int(num_valid_blocks)
    nw, pw = prepare_weights(norm_weight, proj_weight)
    out = torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
    plan = choose_config(T, K, H, prefix_sum.device, config)
    _launch_forward(plan, prefix_sum, block_residual, nw, pw, out, K, float(eps))
    return out


def _launch_forward(plan: _Plan, prefix_sum, block_residual, nw, pw, out, K: int, eps: float,
                    fused: _FusedArgs | None = None) -> None:
    T, H = prefix_sum.shape
    if (H > 1 and prefix_sum.stride(1) != 1 and plan.kernel in ("token", "rows")
            and not (fused and fused.inplace and fused.addend is not None)):
        # A hidden-strided prefix row is copied (a [T, H] copy) so that the kernel reads it with the unit-stride
        # layout: the strided variant would reduce in another order and give other bits than the same values
        # passed contiguously. Not for the in-place serving call with an addend, which must store into the caller's
        # prefix (without one it stores nothing there).
        _launch.unrecordable()  # the copy is device work outside the recorded launches
        prefix_sum = prefix_sum.contiguous()
    ps_t, ps_h = prefix_sum.stride()
    bs_t, bs_c, bs_h = block_residual.stride()
    os_t = out.stride(0)
    h_strided = hidden_strided((prefix_sum, 1), (block_residual, 2), *fused_hidden_dims(fused))
    vec = stride_vec(prefix_sum.dtype, (ps_t, bs_t, bs_c, os_t, *fused_token_strides(fused)))
    args = (prefix_sum, block_residual, nw, pw, out, T, K, H, eps,
            ps_t // vec, ps_h, bs_t // vec, bs_c // vec, bs_h, os_t // vec)
    interpreted = use_interpreter(prefix_sum)
    # Fused serving variant: the same kernels with their fused arguments (runtime) and flags (constexpr).
    runtime, flags = {}, {}
    if fused is not None:
        for name, value in fused_kernel_args(fused, vec).items():
            (flags if name.isupper() else runtime)[name] = value
    # The per-token kernel takes H as a constexpr (H_EXACT): part of its key.
    key = (plan, vec, h_strided, *flags.items(), *((H,) if plan.kernel == "token" else ()))

    def constexprs() -> dict:
        # fp32 I/O scores in FP64 (see kernels/attn_res_fwd.py, _stats): part of the compile key via the dtype.
        common = dict(VEC=vec, H_STRIDED=h_strided, ACC64=prefix_sum.dtype == torch.float32,
                      num_warps=plan.num_warps, **flags, **TRITON_COMPILE_OPTIONS)
        # A register cap and PDL are compile options of the GPU backend only (the interpreter takes neither).
        if plan.maxnreg and not interpreted:
            common["maxnreg"] = plan.maxnreg
        if plan.pdl:
            common["launch_pdl"] = True
        if plan.kernel == "token":
            # The output norm's weight loaded ahead (kernels/attn_res_decode.py) where the plan says so
            # (LaunchConfig.onw_ahead); the FP8 output has only the other epilogue.
            ahead = plan.onw_ahead and flags.get("OUT_NORM", False) and not flags.get("FP8_OUT", False)
            return dict(BLOCK_H=plan.block_h, ROWS=plan.rows_per_tile, NUM_STAGES=plan.num_stages,
                        USE_PDL=plan.pdl, H_EXACT=H, **common, **({"ONW_AHEAD": True} if ahead else {}),
                        **({"ONE_TILE": True} if plan.one_tile else {}),
                        **({"PREFIX_FIRST": True} if plan.prefix_first else {}),
                        **({"NORM_GRAM": True, "GRAM_TAU": plan.gram_tau}
                           if plan.norm_gram and flags.get("OUT_NORM", False) else {}))
        if plan.kernel == "rows":
            return dict(BLOCK_H=plan.block_h, PREFETCH=plan.prefetch, NUM_STAGES=plan.num_stages,
                        USE_PDL=plan.pdl, **common)
        if plan.kernel == "tiles":
            return dict(BLOCK_H=plan.tile_h, K_PAD=plan.k_pad, COMPENSATED=common.pop("ACC64"), **common)
        return dict(CHUNK=plan.chunk, K_PAD=plan.k_pad, P_PAD=plan.p_pad, **common)

    if plan.kernel in NATIVE_KERNELS:
        # The plain op and every fused call, on 16-byte rows (so a fused call's mix is the plain op's, and an FP8
        # call's output the quantised output of the same call without FP8, bit for bit); other layouts: the plan
        # the table names for them.
        # Not the calls only a Triton plan serves: a rounded-mix output (fused_attn_res.full's return_mix) and a new
        # prefix into rows of another token stride than H (its sum_out); the native kernels have neither.
        fused_ok = fused is None or (
            (fused.addend is None or fused.addend.dtype == prefix_sum.dtype) and fused.mix_out is None
            and (fused.new_prefix is None or fused.new_prefix.is_contiguous()))
        onw = None if fused is None else fused.out_norm_weight
        rows = (prefix_sum, block_residual, out,
                *(t for t in (() if fused is None else (fused.new_prefix, fused.addend)) if t is not None))
        if (fused_ok and prefix_sum.element_size() == 2 and all(w.data_ptr() % 16 == 0 for w in (nw, pw, onw)
                                                                if w is not None) and _cluster_layout_ok(rows)):
            # The Gram norm: the cluster kernel's, with the output norm (the streaming kernel has none).
            gram = plan.norm_gram and onw is not None and plan.cluster_size > 1
            if fused is None:
                cluster = (prefix_sum, block_residual, nw, pw, out, None, None, None, None)
                flags, floats = (-1, 0, 0, 0, 0), (eps, 1.0, 0.0, 0.0)
            else:
                fp8 = _CLUSTER_FP8_KINDS[fused.out_dtype]
                cluster = (prefix_sum, block_residual, nw, pw, out, fused.addend, fused.new_prefix, onw, fused.scale)
                flags = (fused.write_idx, int(fused.inplace), int(fused.round_mix), fp8, int(gram))
                floats = (eps, fused.out_eps, reference.FP8_MAX.get(fused.out_dtype, 0.0),
                          plan.gram_tau if gram else 0.0)
            _launch.launch_native("cluster_fwd", cluster, (K, plan.cluster_size, plan.pdl, *flags), floats)
            from .. import _C

            with _device_guard(prefix_sum):
                _C.attn_res_cluster_forward(*cluster, K, floats[0], floats[1], floats[2], flags[0], plan.cluster_size,
                                            plan.pdl, bool(flags[1]), bool(flags[2]), flags[3], bool(flags[4]),
                                            floats[3])
            return
        return _launch_forward(plan.fallback, prefix_sum, block_residual, nw, pw, out, K, eps, fused)
    stream = _stream(prefix_sum)
    with _device_guard(prefix_sum):
        if plan.kernel == "token":
            _launch.launch(_decode.attn_res_token_kernel, (T,), args, runtime, key, constexprs, ntensors=5,
                           interpreted=interpreted, stream=stream)
        elif plan.kernel == "rows":
            grid = (min(T, num_sms(prefix_sum.device) * plan.ctas_per_sm),)
            _launch.launch(_fwd.attn_res_rows_kernel, grid, args, runtime, key, constexprs, ntensors=5,
                           interpreted=interpreted, stream=stream)
        elif plan.kernel == "tiles":
            # The Ascend kernel's algorithm on CUDA: per token, pass 1 reads [K_PAD, tile_h] tiles of all
            # candidates at once (statistics), pass 2 re-reads them (L1/L2 hits) for the output.
            tiles_args = (*args[:9], plan.tokens_per_prog, *args[9:])
            _launch.launch(_fwd.attn_res_npu_kernel, (triton.cdiv(T, plan.tokens_per_prog),), tiles_args, runtime,
                           key, constexprs, ntensors=5, interpreted=interpreted, stream=stream)
        else:
            out_norm = fused is not None and fused.out_norm_weight is not None
            # The partials of this call (FP64 per chunk and candidate; with OUT_NORM one more per chunk, the partial
            # sum of squares of the rounded mix): a fresh buffer, so concurrent calls never share one.
            partials = _launch.scratch((T * plan.p_pad * (2 * plan.k_pad + int(out_norm)),), torch.float64,
                                       prefix_sum.device)
            split_args = (*args[:5], partials, *args[5:])
            for phase in (1, 2, 3) if out_norm else (1, 2):
                _launch.launch(_fwd.attn_res_split_kernel, (plan.p, T), split_args, runtime, (*key, phase),
                               lambda phase=phase: dict(constexprs(), PHASE=phase), ntensors=6,
                               interpreted=interpreted, stream=stream)


# --------------------------------------------------------------------------------------------------------------
# Warm-up: compile every key the table can pick (before CUDA-graph capture).
# --------------------------------------------------------------------------------------------------------------
def _warmup_plans(device: torch.device, H: int, max_num_valid_blocks: int,
                  max_num_tokens: int) -> dict[_Plan, tuple[int, int]]:
    """Every distinct plan (compile key) the table picks for T in 1..max_num_tokens and K in 1..max K, each with
    its smallest example (T, K). Plans depend on T only through its bucket."""
    ts = sorted({min(b, max_num_tokens) for b in T_BUCKETS})
    plans: dict[_Plan, tuple[int, int]] = {}
    for K in range(1, max_num_valid_blocks + 1):
        for T in ts:
            plans.setdefault(choose_config(T, K, H, device), (T, K))
    return plans


#: fused_attn_res.full's call forms that ``warmup(full=True)`` compiles (vLLM-Ascend's, docs/fused_attn_res.md), as
#: (addend, snapshot, output norm, round_mix, return_mix, sum_out): its fused op with and without an addend and a
#: snapshot, the rounded-mix norm, with and without the pre-norm mix returned; its Triton form, the new prefix into
#: sum_out, with the FP32-mix norm or none. (The calls with an addend, no sum_out and no return_mix are fused_attn_res's
#: own variants.)
FULL_FORMS = tuple((addend, write, True, True, ret, False) for addend in (True, False) for write in (False, True)
                   for ret in (False, True)) + ((True, False, True, False, False, True),
                                                (True, False, False, True, False, True))
#: fused_attn_res.full's mix=False calls, as (addend, snapshot): the add, with or without the snapshot; the snapshot.
ADD_SNAPSHOT_FORMS = ((True, False), (True, True), (False, True))


def warmup(hidden_size: int, dtype: torch.dtype, device: torch.device | str | None = None,
           max_num_valid_blocks: int = 8, max_num_tokens: int = 65536, fused: bool = True, serving: bool = False,
           weight_dtype: torch.dtype | None = None, full: bool = False) -> int:
    """Compile every launch-table key for one model before CUDA-graph capture; returns the number of plans run.

    Each distinct plan (compile key) that the table can pick for T in 1..max_num_tokens and K in
    1..max_num_valid_blocks runs once on a small zero-filled token-major problem, which compiles it and caches its
    launch handle. Buffers whose token / block strides are multiples of 16 bytes (every token-major or block-major
    buffer when H * itemsize is) share these kernels. fp64 runs the reference: nothing to compile. Re-run after
    changing ``LAUNCH_TABLE`` or ``K3_OPS_PDL``.

    ``fused=True`` also compiles each plan's fused_attn_res variants that a Kimi K3 decoder layer uses (residual
    addend and output RMSNorm, with and without the block snapshot). ``serving=True`` also compiles the in-place
    serving call vLLM's Kimi K3 model makes (fused_attn_res_ with and without a delta, with and without the
    snapshot, the output norm of the FP32 mix; no FP8 output). ``full=True`` also compiles fused_attn_res.full's
    call forms (``FULL_FORMS``, ``ADD_SNAPSHOT_FORMS``: vLLM-Ascend's). ``weight_dtype``: the dtype of the norm and
    projection weights (a pointer's dtype is part of a compile key); None compiles for the I/O dtype and fp32.
    Other flag combinations compile on first use, outside capture.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return 0
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    H = int(hidden_size)
    plans = _warmup_plans(device, H, max_num_valid_blocks, max_num_tokens)
    weight_dtypes = [weight_dtype] if weight_dtype is not None else list(dict.fromkeys([dtype, torch.float32]))
    with torch.no_grad():
        for wdtype in weight_dtypes:
            w = torch.ones(H, dtype=wdtype, device=device)
            for plan, (T, K) in plans.items():
                prefix = torch.zeros((T, H), dtype=dtype, device=device)
                blocks = torch.zeros((T, K, H), dtype=dtype, device=device)
                out = torch.empty((T, H), dtype=dtype, device=device)
                spare = torch.zeros((T, K + 1, H), dtype=dtype, device=device)  # slot K takes the snapshot
                # A cluster plan's fallback runs the calls the cluster kernel leaves to it: compiled too.
                for p in (plan,) if plan.fallback is None else (plan, plan.fallback):
                    _launch_forward(p, prefix, blocks, w, w, out, K, 1e-6)
                    if fused:
                        for write_idx in (-1, K):
                            args, out = _FusedArgs.allocate(prefix, prefix, write_idx, w, 1e-6)
                            _launch_forward(p, prefix, spare, w, w, out, K, 1e-6, args)
                if serving:
                    serving_plan = _serving_plan(plan, T, K, H, device)
                    for p in (serving_plan,) if serving_plan.fallback is None else (serving_plan,
                                                                                     serving_plan.fallback):
                        for addend in (prefix, None):
                            for write_idx in (-1, K):
                                target = torch.zeros((T, H), dtype=dtype, device=device)  # updated in place
                                args, out = _FusedArgs.allocate(target, addend, write_idx, w, 1e-6, inplace=True,
                                                                round_mix=False)
                                _launch_forward(p, target, spare, w, w, kernel_output(out), K, 1e-6, args)
                if full:
                    _warmup_full(plan, T, K, H, prefix, spare, w)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(plans)


def _warmup_full(plan: _Plan, T: int, K: int, H: int, prefix: torch.Tensor, spare: torch.Tensor,
                 w: torch.Tensor) -> None:
    # Each form on the plan fused_attn_res_full would take (the serving plan where the form has a serving flag) and
    # on that plan's fallback (the calls a native kernel leaves to it), then the add-and-snapshot kernel.
    for addend, write, norm, round_mix, ret, into in FULL_FORMS:
        sum_out = torch.empty_like(prefix) if into else None
        args, out = _FusedArgs.allocate_full(prefix, prefix if addend else None, K if write else -1,
                                             w if norm else None, 1e-6, round_mix=round_mix, return_mix=ret,
                                             sum_out=sum_out)
        base = _serving_plan(plan, T, K, H, prefix.device) if args.serving else plan
        for p in (base,) if base.fallback is None else (base, base.fallback):
            _launch_forward(p, prefix, spare, w, w, out, K, 1e-6, args)
    for addend, write in ADD_SNAPSHOT_FORMS:
        _launch_add_snapshot(prefix, prefix if addend else None, torch.empty_like(prefix) if addend else None, spare,
                             K if write else -1)


# --------------------------------------------------------------------------------------------------------------
# Fused serving variant.
# --------------------------------------------------------------------------------------------------------------
def fused_attn_res(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                   norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                   block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                   out_norm_eps: float | None = None, *, round_mix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res on CUDA tensors (or CPU tensors under the Triton interpreter); arguments already
    checked by ``k3_ops._C.check_fused_attn_res``. Returns ``(out, new_prefix)``, new contiguous [T, H]; writes
    ``block_residual[:, block_write_idx]`` when ``block_write_idx >= 0``, nothing else.

    The forward's launch plan for (T, K) with the kernels' fused flags (kernels/attn_res_fwd.py): the add,
    the new_prefix and snapshot stores and the RMSNorm epilogue happen inside the mix kernel, in one launch on
    the token and rows paths (the opt-in split path takes two, three with the output norm). Same plan and
    arithmetic as ``attn_res_forward`` for the same T and K, so ``out`` equals it bit for bit without the norm.
    fp64 and T = 0 run the reference composition (no kernel).
    """
    trivial = trivial_fused_attn_res(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                     eps, block_write_idx, out_norm_weight, out_norm_eps, attn_res_forward, round_mix)
    if trivial is not None:
        return trivial
    if not round_mix and out_norm_weight is not None:
        # The FP32-mix norm: the serving flags' launch (fused_attn_res_quant's, without the FP8 output).
        fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                         eps if out_norm_eps is None else out_norm_eps, round_mix=False)
        _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
        return out, fused.new_prefix
    T, H = prefix_sum.shape
    K = int(num_valid_blocks)
    fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                     eps if out_norm_eps is None else out_norm_eps)
    nw, pw = prepare_weights(norm_weight, proj_weight)
    plan = choose_config(T, K, H, prefix_sum.device)
    _launch_forward(plan, prefix_sum, block_residual, nw, pw, out, K, float(eps), fused)
    return out, fused.new_prefix


#: The plan of every serving call (fused_attn_res.quant, fused_attn_res_) where the table picks the split path
#: (T <= 4), and of those a cluster plan leaves to its split fallback (rows off 16-byte boundaries): the per-token
#: kernel with 4-row tiles. The split kernel has none of the serving flags (the FP32-mix norm, the FP8 epilogue,
#: the in-place prefix store), and its second launch re-reads prefix_sum after the first would have stored the new
#: prefix into it.
SERVING_TOKEN_CONFIG = LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1)

#: Cluster plans with a serving-capable fallback, by (table plan, fallback): made once per plan.
_serving_cluster_plans: dict[tuple, _Plan] = {}


def _serving_plan(plan: _Plan, T: int, K: int, H: int, device: torch.device) -> _Plan:
    # The table's plan where it has the serving flags (token, rows, cluster); a split fallback or plan replaced
    # by SERVING_TOKEN_CONFIG's.
    if plan.kernel in ("rows", "token"):
        return plan
    if plan.kernel in NATIVE_KERNELS and plan.fallback.kernel in ("rows", "token"):
        return plan
    token = choose_config(T, K, H, device, SERVING_TOKEN_CONFIG)
    if plan.kernel not in NATIVE_KERNELS:
        return token
    key = (plan, token)
    found = _serving_cluster_plans.get(key)
    if found is None:
        found = _serving_cluster_plans[key] = replace(plan, fallback=token)
    return found


def _launch_serving(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                    proj_weight: torch.Tensor, K: int, eps: float, fused: _FusedArgs, out: torch.Tensor) -> None:
    T, H = prefix_sum.shape
    nw, pw = prepare_weights(norm_weight, proj_weight)
    plan = _serving_plan(choose_config(T, K, H, prefix_sum.device), T, K, H, prefix_sum.device)
    _launch_forward(plan, prefix_sum, block_residual, nw, pw, kernel_output(out), K, float(eps), fused)


def fused_attn_res_quant(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                         norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                         block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                         out_norm_eps: float | None = None, *, out_dtype: torch.dtype,
                         round_mix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.quant on CUDA tensors (or CPU tensors under the Triton interpreter); arguments
    already checked by ``k3_ops._C.check_fused_attn_res_quant``. Returns ``(q, new_prefix, scale)``: q [T, H] of the
    FP8 out_dtype, new_prefix [T, H], scale [T, 1] fp32; writes ``block_residual[:, block_write_idx]`` when
    ``block_write_idx >= 0``, nothing else. One launch of the token or rows kernel with its serving flags
    (``SERVING_TOKEN_CONFIG`` where the table picks the split path); fp64 and T = 0 run the reference composition.
    """
    trivial = trivial_serving_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                   eps, block_write_idx, out_norm_weight, out_norm_eps, inplace=False,
                                   out_dtype=out_dtype, round_mix=round_mix, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                     eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                     out_dtype=out_dtype)
    _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
    return out, fused.new_prefix, fused.scale


def fused_attn_res_(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                    norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                    block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                    out_norm_eps: float | None = None, *, out_dtype: torch.dtype | None = None,
                    round_mix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res_ on CUDA tensors (or CPU tensors under the Triton interpreter); arguments already
    checked by ``k3_ops._C.check_fused_attn_res_inplace``. Stores round(prefix_sum + addend) back into prefix_sum
    (with an addend), snapshots it into ``block_residual[:, block_write_idx]`` (when >= 0), and returns
    ``(out, scale)`` (scale [T, 1] fp32 with an FP8 out_dtype, else empty): one launch of the token or rows kernel
    with its serving flags, the in-place prefix store included (``SERVING_TOKEN_CONFIG`` where the table picks the
    split path).
    fp64 and T = 0 run the reference composition.
    """
    trivial = trivial_serving_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                   eps, block_write_idx, out_norm_weight, out_norm_eps, inplace=True,
                                   out_dtype=out_dtype, round_mix=round_mix, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    fused, out = _FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                     eps if out_norm_eps is None else out_norm_eps, inplace=True,
                                     round_mix=round_mix, out_dtype=out_dtype)
    _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out)
    return out, fused.scale if fused.scale is not None else out.new_empty((0,), dtype=torch.float32)


def fused_attn_res_full(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                        norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                        block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                        out_norm_eps: float | None = None, *, round_mix: bool = True, return_mix: bool = False,
                        mix: bool = True, sum_out: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.full on CUDA tensors (or CPU tensors under the Triton interpreter); arguments already
    checked by ``k3_ops._C.check_fused_attn_res_full``. Returns ``(out, new_prefix, mix)``, each output not produced
    an empty [0] tensor; writes ``block_residual[:, block_write_idx]`` (>= 0) and ``sum_out`` (given), nothing else.

    One launch: the table's plan for the calls fused_attn_res makes (an addend, the new prefix into a fresh tensor
    or ``sum_out``, the rounded-mix norm), so their ``out`` is fused_attn_res's bit for bit; the serving plan
    (``_serving_plan``) for those only the serving flags serve: the new prefix kept in prefix_sum (no addend), the
    FP32-mix norm, ``return_mix``. The native cluster / stream kernels store no mix and new prefixes only at token
    stride H: such calls run their plan's Triton fallback. ``mix=False``: ``attn_res_add_snapshot_kernel`` (no launch
    without an addend, ``sum_out`` or snapshot). fp64 and T = 0 run the reference composition.
    """
    trivial = trivial_full_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                block_write_idx, out_norm_weight, out_norm_eps, round_mix=round_mix,
                                return_mix=return_mix, mix=mix, sum_out=sum_out, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    if not mix:
        target, new_prefix = add_snapshot_outputs(prefix_sum, addend, sum_out)
        _launch_add_snapshot(prefix_sum, addend, target, block_residual, block_write_idx)
        return full_outputs(None, prefix_sum, None, new_prefix)
    T, H = prefix_sum.shape
    K = int(num_valid_blocks)
    fused, out = _FusedArgs.allocate_full(prefix_sum, addend, block_write_idx, out_norm_weight,
                                          eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                          return_mix=return_mix, sum_out=sum_out)
    if fused.serving:
        _launch_serving(prefix_sum, block_residual, norm_weight, proj_weight, K, eps, fused, out)
    else:
        nw, pw = prepare_weights(norm_weight, proj_weight)
        _launch_forward(choose_config(T, K, H, prefix_sum.device), prefix_sum, block_residual, nw, pw, out, K,
                        float(eps), fused)
    return full_outputs(fused, prefix_sum, out, None if sum_out is not None else fused.new_prefix)


def _launch_add_snapshot(prefix_sum: torch.Tensor, addend: torch.Tensor | None, new_prefix: torch.Tensor | None,
                         block_residual: torch.Tensor, block_write_idx: int) -> None:
    # One program per token (a row of H elements is a few KB: the grid, not the program, carries the bandwidth).
    # Launched without PDL: it waits for its predecessor as any launch does, and a PDL successor's gdc_wait waits for
    # its completion (it never triggers its dependents early).
    if new_prefix is None and block_write_idx < 0:
        return  # nothing to write: the new prefix is prefix_sum itself
    args, runtime, flags = add_snapshot_args(prefix_sum, addend, new_prefix, block_residual, block_write_idx, 1)
    key = ("add_snapshot", *flags.items())

    def constexprs() -> dict:
        return dict(flags, num_warps=4, **TRITON_COMPILE_OPTIONS)

    with _device_guard(prefix_sum):
        _launch.launch(_fwd.attn_res_add_snapshot_kernel, (prefix_sum.size(0),), args, runtime, key, constexprs,
                       ntensors=2, interpreted=use_interpreter(prefix_sum), stream=_stream(prefix_sum))


# --------------------------------------------------------------------------------------------------------------
# Backward: kimi_k3::attn_res_backward. Kernels in k3_ops.kernels.attn_res_bwd; the device-independent
# part of the launch (trivial cases, allocation, strides) lives in backends/_backward.py, shared with npu.py.
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackwardConfig:
    """Knobs of the backward launch (tuned on the H200 with ``python -m k3_ops.bench train --bwd-configs``).

    kernel: "auto" (default: "single_read" where it runs, else "stats_apply" when T x (K + 1) >=
        SPLIT_BACKWARD_MIN_ROWS, else "rows"), "single_read" (the CUDA C++ kernel of csrc_cuda/attn_res_bwd.cu:
        one program per SM, each token read once from DRAM; needs a build with the CUDA sources, sm_80+, bf16 /
        fp16 candidates, H % 8 == 0, H <= 8192, K <= 8, unit hidden strides and 16-byte aligned rows; elsewhere
        the Triton choice "auto" would make without it), "stats_apply" (the two-stream split:
        ``attn_res_bwd_stats_kernel``, then
        ``attn_res_bwd_scalars_kernel``, then ``attn_res_bwd_apply_kernel``, on (token range, column chunk)
        grids), "rows" (``attn_res_bwd_rows_kernel``, the single-read streaming kernel: one whole row per step
        over all warps) or "tiles" (``attn_res_bwd_kernel``: [K_PAD, BLOCK_H] candidate tiles of ``tile_elems``
        elements, two passes per token; the Ascend algorithm). stats_apply and rows need H <= ROWS_BACKWARD_MAX_H;
        wider rows fall back to "tiles".
    programs_per_sm: rows / tiles: programs per SM; grid = min(T, SMs x programs_per_sm), each program walking
        a contiguous token range (a larger grid also means a larger dw workspace, [grid, H] fp64).
    num_warps, num_stages: warps per program and software-pipelining depth (shared-memory stages; 1 = none);
        None takes the resolved kernel's measured default from ``BACKWARD_KERNEL_DEFAULTS``.
    tile_elems: "tiles" only: K_PAD x BLOCK_H, BLOCK_H = tile_elems // K_PAD (a power of two, at least 16, at
        most next_power_of_2(H)).
    acc64: FP64 per-token statistics / softmax backward / dw accumulation (the accuracy contract's margin; see
        kernels/attn_res_bwd.py). False is plain FP32: cheaper, but its error is the eager formula's size.
    maxnreg: register cap per thread (a CUDA compile option; None: ptxas decides).
    apply_block: "stats_apply" only: columns per program (a power of two) of both of its kernels.
    stats_programs_per_sm: "stats_apply" only: its statistics kernel's grid, about SMs x stats_programs_per_sm
        programs (token ranges x column chunks); num_warps and num_stages describe that kernel.
    apply_warps, apply_stages, apply_programs_per_sm: "stats_apply" only: the same for its apply kernel.
    vectors_per_thread: "single_read" only: how a program holds the token's rows. 0: in shared memory, one 16-byte
        column vector per thread and row (H / 8 threads: 28 warps at H = 7168 at 64 registers); 1 or 2: in
        registers, that many vectors per thread and row (H / 8 / vectors_per_thread threads, 64 or 128 registers).
        None (default): 2 for K <= SINGLE_READ_SMEM_MIN_K - 1 (the 3- and 6-row variants, which hold their
        rows in registers without spilling), 0 from there on; either falls back to the other where its shared
        memory does not fit the device's opt-in (H200, H = 7168, T = 4096-16384: 0 is 1.34-1.36x faster than 2
        at K = 8, 2 is 0-1 % faster at K = 1-4; docs/benchmarks.md, "Tuning").

    Defaults: the fastest configurations timed on the H200 (docs/benchmarks.md, "Training" and "Tuning"; their
    history in docs/history.md): the CUDA C++ single-read kernel wherever it runs (1.13-1.19x faster than the
    split at T = 4096-16384, K = 1 and 8, register layout, at 8bb7b0e; the shared-memory layout from K = 5,
    1.5-1.6x faster than the split at K = 8, at 1a44818); for the Triton kernels the split with
    1-warp programs over 1024-column chunks for both streams (no cross-warp reduction in the statistics; 32
    elements per thread in the apply pass), 8 programs per SM for each (one wave: ptxas gives them 221-241
    registers, so 8 fit an SM), 3 stages, FP64 statistics and dw accumulation (at 318af1a: 1.26-1.57x faster
    than rows from T x (K + 1) = 8192 rows up), rows below the threshold (one launch instead of four).
    Per-kernel warps / stages when left None: ``BACKWARD_KERNEL_DEFAULTS``.
    """

    kernel: str = "auto"
    programs_per_sm: int = 1
    num_warps: int | None = None
    num_stages: int | None = None
    tile_elems: int = 2048
    acc64: bool = True
    maxnreg: int | None = None
    apply_block: int = 1024
    apply_warps: int = 1
    apply_stages: int = 3
    apply_programs_per_sm: int = 8
    stats_programs_per_sm: int = 8
    vectors_per_thread: int | None = None

    def __post_init__(self):
        if self.apply_block < 16 or self.apply_block & (self.apply_block - 1):
            raise ValueError(f"BackwardConfig.apply_block must be a power of two >= 16, got {self.apply_block}")
        if self.apply_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"BackwardConfig.apply_warps must be a power of two in [1, 32], got {self.apply_warps}")
        for name in ("apply_stages", "apply_programs_per_sm", "stats_programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"BackwardConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.programs_per_sm < 1:
            raise ValueError(f"BackwardConfig.programs_per_sm must be >= 1, got {self.programs_per_sm}")
        if self.tile_elems < 16 or self.tile_elems & (self.tile_elems - 1):
            raise ValueError(f"BackwardConfig.tile_elems must be a power of two >= 16, got {self.tile_elems}")
        if self.kernel not in ("auto", "single_read", "tiles", "rows", "stats_apply"):
            raise ValueError("BackwardConfig.kernel must be 'auto', 'single_read', 'stats_apply', 'rows' or 'tiles', "
                             f"got {self.kernel!r}")
        if self.vectors_per_thread not in (None, 0, 1, 2):
            raise ValueError(f"BackwardConfig.vectors_per_thread must be 0, 1, 2 or None, got "
                             f"{self.vectors_per_thread}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"BackwardConfig.num_stages must be >= 1 or None, got {self.num_stages}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"BackwardConfig.num_warps must be a power of two in [1, 32] or None, got "
                             f"{self.num_warps}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"BackwardConfig.maxnreg must be in [24, 255] or None, got {self.maxnreg}")


#: The widest row the rows backward holds in registers (larger H uses the tiles kernel; stats_apply shares the
#: bound, its statistics kernel being the newer, less-tested path for wide rows).
ROWS_BACKWARD_MAX_H = 8192

#: Per-kernel (num_warps, num_stages) when the config leaves them None; each the fastest measured on the H200
#: (docs/benchmarks.md, "Training"): rows 8 warps / 2 stages; stats_apply's statistics kernel 1 warp / 3 stages
#: (its three sums per row reduce within the warp: 1.4x faster than 2 warps at K = 8);
#: tiles 8 warps / 3 stages (2048-element tiles).
BACKWARD_KERNEL_DEFAULTS = {"rows": (8, 2), "stats_apply": (1, 3), "tiles": (8, 3)}

#: "auto" picks the stats/apply split from this many token-candidate rows, T x (K + 1), on: the smallest shape
#: measured on the H200 with the 1-warp split (318af1a), T = 4096, K = 1, where the split beat the rows kernel by
#: 1.26x under plain launches (1.28x in kernel time), though that op is near host-bound there (the training
#: benchmark read 266-565 us for it in three runs); below it, unmeasured, the rows kernel's single launch (the
#: split's four launches cost host time that small shapes do not hide).
SPLIT_BACKWARD_MIN_ROWS = 8192

#: Programs per SM of the split's per-token scalars kernel (1 warp each, a few tokens each; its own grid, so
#: that the apply kernel's smaller one does not thin it out: at T = 16384, K = 8 it took 29 us with 2112
#: programs, 48 us with 1056).
SCALARS_PROGRAMS_PER_SM = 16

#: Warps of the weight-gradient reduction, whatever the gradient kernel's (8: what rows and tiles always used).
REDUCE_NUM_WARPS = 8

#: "single_read" with vectors_per_thread None: the shared-memory-resident layout (0) from this K on, the
#: register-resident one (2) below it. K + 2 rows of one vector pair each fill 128 registers from K = 5 (the
#: 10-row variant spills), where the register-resident program's 14 warps (H = 7168) are too few to hide latency:
#: on the H200 at K = 8 the 28-warp shared-memory layout is 1.34-1.36x faster (T = 4096-16384); at K = 1, 2, 4
#: the register layout is 0-2 % faster (docs/data/attn_res_bwd_layouts_h200_796c85e.json).
SINGLE_READ_SMEM_MIN_K = 5

#: The default backward launch configuration; benchmarks pass ``config=`` to ``attn_res_backward`` instead.
BACKWARD_CONFIG = BackwardConfig()


def _has_cuda_kernels() -> bool:
    from .. import _C

    return bool(getattr(_C, "has_cuda_kernels", False))


def single_read_supported(K: int, H: int, device: torch.device, element_size: int = 2,
                          vectors_per_thread: int = 2) -> bool:
    """Whether the CUDA C++ single-read backward can run this shape on ``device``: a k3_ops build with the CUDA
    sources, a GPU (not the interpreter) of compute capability 8.0+ whose per-block shared memory opt-in holds
    one program's (the token's K + 2 rows plus an FP64 [H] row), 16-bit candidates, K <= 8, H % 8 == 0,
    H <= 8192. Row layout (unit hidden strides, 16-byte aligned rows) is checked per call on the tensors."""
    if use_interpreter(device) or not _has_cuda_kernels() or K < 1:
        return False
    from .. import _C

    smem = _C.attn_res_bwd_single_read_smem_bytes(K, H, element_size, vectors_per_thread)
    if smem == 0:
        return False
    props = _properties(device)
    return (props.major, props.minor) >= (8, 0) and smem <= props.shared_memory_per_block_optin


def _single_read_layout_ok(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor) -> bool:
    # The C++ kernel copies 16-byte vectors: unit hidden strides (a hidden-strided grad_out is made contiguous by
    # the launch) and rows starting on 16-byte boundaries (pointer and token / block strides).
    rows = [(prefix_sum, (prefix_sum.stride(0),)),
            (block_residual, (block_residual.stride(0), block_residual.stride(1)))]
    if grad_out.stride(1) == 1:
        rows.append((grad_out, (grad_out.stride(0),)))
    return (prefix_sum.stride(1) == 1 and block_residual.stride(2) == 1
            and all(t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides) for t, strides in rows))


def choose_backward_plan(T: int, K: int, H: int, device: torch.device,
                         config: BackwardConfig | None = None, element_size: int = 2) -> _backward.BackwardPlan:
    """Resolve the backward launch for a shape (compile key: kernel, k_pad, block_h, num_warps, num_stages).

    element_size: the candidates' (the single-read CUDA kernel reads 16-bit dtypes only)."""
    config = config or BACKWARD_CONFIG
    k_pad = next_power_of_2(K + 1)
    kernel = config.kernel
    if kernel in ("auto", "single_read"):
        # The measured layout for this K first, then the other one (their shared memory differs by a few
        # hundred bytes, so where one does not fit the other rarely does; the Triton kernels come next).
        preferred = (0, 2) if K >= SINGLE_READ_SMEM_MIN_K else (2, 0)
        for vpt in preferred if config.vectors_per_thread is None else (config.vectors_per_thread,):
            if single_read_supported(K, H, device, element_size, vpt):
                return _backward.BackwardPlan(num_programs=min(T, num_sms(device)), block_h=H, k_pad=k_pad,
                                              acc64=True, kernel="single_read", vectors_per_thread=vpt,
                                              reduce_options=(("num_warps", REDUCE_NUM_WARPS),))
    whole_row = next_power_of_2(H) <= ROWS_BACKWARD_MAX_H
    if kernel in ("auto", "single_read"):
        kernel = "stats_apply" if T * (K + 1) >= SPLIT_BACKWARD_MIN_ROWS else "rows"
    kernel = kernel if kernel != "tiles" and whole_row else "tiles"
    block_h = next_power_of_2(H) if kernel != "tiles" else min(next_power_of_2(H), max(16, config.tile_elems // k_pad))
    warps, stages = BACKWARD_KERNEL_DEFAULTS[kernel]
    options = [("num_warps", config.num_warps or warps)]
    if config.maxnreg and not use_interpreter(device):
        options.append(("maxnreg", config.maxnreg))  # a GPU compile option; the interpreter takes none
    apply = {}
    programs = min(T, num_sms(device) * config.programs_per_sm)
    if kernel == "stats_apply":
        # Both kernels: a (token ranges, column chunks) grid of about SMs x programs-per-SM programs.
        block = min(config.apply_block, next_power_of_2(H))
        chunks = triton.cdiv(H, block)
        programs = min(T, triton.cdiv(num_sms(device) * config.stats_programs_per_sm, chunks))
        apply = dict(apply_block=block, apply_options=(("num_warps", config.apply_warps),),
                     apply_num_stages=config.apply_stages,
                     apply_programs=min(T, triton.cdiv(num_sms(device) * config.apply_programs_per_sm, chunks)),
                     scalars_programs=min(T, num_sms(device) * SCALARS_PROGRAMS_PER_SM))
    return _backward.BackwardPlan(num_programs=programs, block_h=block_h,
                                  k_pad=k_pad, acc64=config.acc64, num_stages=config.num_stages or stages,
                                  kernel=kernel, launch_options=tuple(options), **apply,
                                  reduce_options=(("num_warps", REDUCE_NUM_WARPS),))


def attn_res_backward(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                      norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                      output_mask, *, config: BackwardConfig | None = None):
    """kimi_k3::attn_res_backward on CUDA tensors (or CPU tensors under the Triton interpreter).

    Args (already checked by ``k3_ops._C.check_attn_res_backward``):
        grad_out: [T, H] of prefix_sum.dtype, any strides (a non-unit hidden stride, e.g. the expanded gradient
            of ``out.sum()``, is copied to contiguous first).
        prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps: as for ``attn_res_forward``
            (any token / block strides, block-major views included; only slots < K are read).
        output_mask: [want grad_prefix_sum, want grad_block_residual, want grad_weight].
        config: bypass ``BACKWARD_CONFIG`` (benchmarks / tuning).
    Returns:
        (grad_prefix_sum: new contiguous [T, H] of prefix_sum.dtype,
         grad_block_residual: new contiguous [T, C, H] of block_residual.dtype, exact zeros at slots >= K,
         grad_weight: [H] fp32 (fp64 for fp64 inputs), dL/dw of w = norm_weight * proj_weight, reduced over
         tokens in a fixed order: identical bits from run to run);
        an output not asked for by output_mask is an empty 1-D tensor and costs nothing.
    """
    trivial = _backward.trivial_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                  num_valid_blocks, eps, output_mask)
    if trivial is not None:
        return trivial
    T, C, H = block_residual.shape
    plan = choose_backward_plan(T, int(num_valid_blocks), H, prefix_sum.device, config, prefix_sum.element_size())
    if plan.kernel == "single_read" and not _single_read_layout_ok(grad_out, prefix_sum, block_residual):
        # The choice "auto" makes without the C++ kernel (element size 0 rules it out): the Triton kernels take
        # any strides and alignment.
        plan = choose_backward_plan(T, int(num_valid_blocks), H, prefix_sum.device, config, element_size=0)
    with _device_guard(prefix_sum):
        return _backward.run_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                               num_valid_blocks, eps, output_mask, plan)
