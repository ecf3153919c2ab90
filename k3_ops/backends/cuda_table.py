"""The CUDA launch table: which kernel, and how configured, a call of T tokens and K valid blocks runs.

``LAUNCH_TABLE`` maps (T bucket, K bucket) to a ``LaunchConfig``; the buckets are the bounds in ``T_BUCKETS`` /
``K_BUCKETS`` (a value goes to the first bound >= it). ``table_entry`` states the rules that fill it, in the order
they apply, each with its reason; the measurements behind them are in docs/kernels.md and the history of each
change in docs/history.md. To try another entry: ``cuda.set_launch_config`` (one cell) or ``config=`` on an entry
point (one call); to change the table, change a rule or a bound here.

The kernel paths a config names (``LaunchConfig.kernel``):

- **token**: ``kernels/attn_res_decode.py``, one program per token; its block rows in [ROWS, next_pow2(H)] tiles
  through an online softmax, or all in one tile beside the prefix row (``rows_per_tile`` 0); no workspace.
- **rows**: ``kernels/attn_res_fwd.py``, a persistent grid (``ctas_per_sm`` programs per SM), each program streaming
  the candidate rows of its tokens as one prefetched sequence; any K.
- **split**: H split over ``cdiv(H, chunk)`` programs per token holding every candidate's chunk; partial statistics
  combined by a second launch (a third scales the output norm). K + 1 <= 16.
- **tiles**: the Ascend kernel's two-pass algorithm on CUDA (opt-in, for comparison).
- **cluster**: the CUDA C++ kernel of csrc_cuda/attn_res_cluster_kernel.h: each token split over a thread-block
  cluster of ``cluster_size`` CTAs exchanging statistics through distributed shared memory (sm_90+, a CUDA build of
  k3_ops._C, 16-bit rows, K <= 8, H a multiple of 8 x cluster_size, unit hidden strides, 16-byte aligned rows).
- **stream**: the CUDA C++ kernel of csrc_cuda/attn_res_stream.cu: two persistent CTAs per SM streaming rows through
  a shared-memory ring (the cluster entry's cluster size 1; the same rules).

A cluster or stream entry runs its ``fallback`` wherever the native kernel cannot: the shape, the device, the build
(at plan time), or the call's layout (per call). Nothing here imports torch or triton.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "LaunchConfig",
    "T_BUCKETS",
    "K_BUCKETS",
    "TOKEN_MAX_T",
    "TOKEN_MAX_T_K16",
    "LOOP_MAX_T",
    "NATIVE_KERNELS",
    "ROWS_CONFIG",
    "CLUSTER_FALLBACK_CONFIG",
    "SERVING_TOKEN_CONFIG",
    "bucket",
    "table_entry",
    "table_config",
    "LAUNCH_TABLE",
]

KERNELS = ("token", "rows", "split", "tiles", "cluster", "stream")

#: The CUDA C++ forward paths (csrc_cuda/attn_res_cluster.cu, attn_res_stream.cu): one native entry point for
#: every call, a ``fallback`` for what they cannot run.
NATIVE_KERNELS = ("cluster", "stream")


@dataclass(frozen=True)
class LaunchConfig:
    """One launch-table entry (``cuda_plan.resolve`` turns it into a ``Plan`` for a shape and a device).

    kernel: "token", "rows", "split", "tiles", "cluster" or "stream".
    num_warps: warps per program; None derives it from the tile size.
    rows_per_tile: token path only, block rows per [ROWS, BLOCK_H] tile (a power of two), or 0: one tile holding
        every block row of the call (next_pow2(K) rows) with the prefix row beside it, no loop (``ONE_TILE``), where
        that tile is at most ``cuda_plan.ONE_TILE_MAX_ELEMENTS`` (else 4-row tiles); either way unpipelined.
    prefix_first: token path with a loop (rows_per_tile >= 1) only: fold the prefix candidate into the online
        softmax before the block rows, not after them, so that its row is dead in the loop (fewer registers, no
        spill) and the fused call stores the new prefix and the snapshot before the loop; other rounding, the same
        in the plain op and the fused call.
    num_stages: token path, and rows path with prefetch 0: software-pipelining depth of the row loads (each stage
        past the first holds a tile in shared memory: (num_stages - 1) x rows_per_tile x next_pow2(H) x itemsize
        bytes on the token path, which must fit the device's opt-in).
    pdl: token, rows, cluster and stream paths: programmatic dependent launch; None = the device's default
        (``cuda.pdl_enabled``).
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
        kernels/attn_res_decode.py, ``kGram`` in csrc_cuda/attn_res_cluster_kernel.h), not over the mix after it; on
        the token path where the plan's tiles have at most 4 rows, else as without it; a cluster plan's fallback
        takes its own. The mix, new_prefix and the snapshot are the same bits; the norm's sum of squares is the FP32
        mix's, not the rounded mix's (within the norm's tolerance).
    gram_tau: with norm_gram, the guard: where |mix|^2 < gram_tau (sum_i p_i |v_i|)^2 (candidates that cancel),
        the norm reduces over its input as without norm_gram.
    onw_ahead: token path, fused calls with the output norm and no FP8 output: load the norm's weight with the
        inputs (``ONW_AHEAD``: its round trip hides behind theirs) rather than after the mix; the same bits either
        way. None: where the tiles have at most 2 rows over at least 8 warps (no spill there). Ahead costs
        registers, which can halve the programs an SM holds.
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
        if self.kernel not in KERNELS:
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
#: K = 5..6 and 7..8 are buckets of their own: at 65-128 tokens they take different tiles.
K_BUCKETS = (1, 2, 4, 6, 8, 16, 32, 64, 1 << 62)

#: The token path up to this many tokens at every K, the rows path above...
TOKEN_MAX_T = 256
#: ... up to this many for K <= 16 (every K of Kimi K3 and up to twice it)...
TOKEN_MAX_T_K16 = 512
#: ... and, one block row at a time, up to this many per K bucket (K = 3..16; no bound at K = 3..8).
LOOP_MAX_T = {4: 1 << 62, 6: 1 << 62, 8: 1 << 62, 16: 4096}
#: Above this many tokens the one-row loop at K = 5..8 keeps 4 row loads in flight, not 3.
LOOP_DEEP_ABOVE_T = 2048
#: The cluster kernel up to this many tokens, per K bucket (K = 2..8).
CLUSTER_MAX_T = {2: 16, 4: 32, 6: 64, 8: 64}
#: The cluster entries' fallback at K = 5..8: the split path up to this many tokens, 4-row tiles above.
SPLIT_MAX_T = 4
#: The one-tile plan loads the output norm's weight after the mix above this many tokens (K <= 2).
ONW_AFTER_ABOVE_T = 128
#: Tiles of several block rows up to this many tokens (K >= 5); one row at a time above.
TILES_MAX_T = 128


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The first bucket bound >= value."""
    for b in buckets:
        if value <= b:
            return b
    return buckets[-1]


#: Large T: the persistent rows kernel with 4 warps (its FP32 accumulator, weight and current row of next_pow2(H)
#: columns take about all the registers of a thread: exactly two 4-warp programs fit an SM), its rows staged through
#: shared memory by Triton's pipeliner (prefetch 0): faster than registers, and the fused epilogue spills far less.
ROWS_CONFIG = LaunchConfig(kernel="rows", num_warps=4, ctas_per_sm=2, prefetch=0, num_stages=3)

#: What a cluster entry without its own ``fallback`` runs where the cluster kernel cannot.
CLUSTER_FALLBACK_CONFIG = LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1)

#: The serving calls' plan (fused_attn_res.quant, fused_attn_res_, the FP32-mix norm) where the table picks the split
#: path, and what a cluster entry leaves to a split fallback: the split kernel has none of the serving flags, and its
#: second launch re-reads prefix_sum after the first would have stored the new prefix into it.
SERVING_TOKEN_CONFIG = LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1)


def _cluster_size(t_bucket: int) -> int:
    # An 8-CTA cluster must fit in one GPC, and fewer such clusters fit at once than a few tokens need: fewer CTAs
    # per token as the tokens grow.
    return 8 if t_bucket <= 8 else 4 if t_bucket <= 32 else 2


def table_entry(t_bucket: int, k_bucket: int) -> LaunchConfig:
    """The default entry of one cell: the first rule that applies. The fused call shares the plain op's plan (its
    mix is the plain op's bit for bit); where the two disagree on a choice the fused call wins, being the call a
    decoder layer makes twice per mix."""
    # Decode at K = 5..8: the cluster kernel puts several SMs on each token. Where it cannot run, the split path
    # (more SMs per token than one program) up to SPLIT_MAX_T tokens, 4-row tiles above.
    if t_bucket <= CLUSTER_MAX_T.get(k_bucket, 0) and k_bucket in (6, 8):
        before = (LaunchConfig(kernel="split", chunk=512) if t_bucket <= SPLIT_MAX_T else
                  LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1))
        return LaunchConfig(kernel="cluster", cluster_size=_cluster_size(t_bucket), min_k=5, fallback=before)
    # K <= 4: one program per token holding every block row in one tile beside the prefix row, 8 warps, no loop;
    # the fused call stores new_prefix and the snapshot as it loads the prefix.
    one_tile = LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8, num_stages=1)
    # Decode at K = 2..4: the cluster kernel, 8 CTAs per token (its 3- and 5-candidate variants need few registers),
    # the one-tile plan where it cannot run. Not at K = 1: one program per token is faster at every T.
    if t_bucket <= CLUSTER_MAX_T.get(k_bucket, 0):
        return LaunchConfig(kernel="cluster", cluster_size=8, min_k=2 if k_bucket == 2 else 3, fallback=one_tile)
    # At K = 1 at every T (the two rows of a token in flight at once beat any loop or persistent kernel on a cold L2;
    # the plain op reaches the copy bandwidth), at K = 2..4 up to TOKEN_MAX_T_K16 tokens.
    if k_bucket == 1 or (t_bucket <= TOKEN_MAX_T_K16 and k_bucket <= 4):
        # Above ONW_AFTER_ABOVE_T tokens at K <= 2 the fused call loads the output norm's weight after the mix:
        # without its registers two 8-warp programs fit an SM. Not below, where one program per SM is all a call
        # has.
        if t_bucket > ONW_AFTER_ABOVE_T and k_bucket <= 2:
            return replace(one_tile, onw_ahead=False)
        return one_tile
    # K = 2 above TOKEN_MAX_T_K16 tokens: tiles of 2 block rows, 4 warps, 2 stages, the prefix first: the fused call
    # keeps its epilogue in registers (the one-tile and rows kernels' fused calls are 13-17 % slower on a cold L2)
    # for 2-3 % on the plain op.
    if k_bucket == 2:
        return LaunchConfig(kernel="token", rows_per_tile=2, num_warps=4, num_stages=2, prefix_first=True)
    # K >= 5 up to TILES_MAX_T tokens: tiles of 4 block rows over 8 warps, unpipelined (a tile's rows are in flight
    # together; a second stage only adds shared-memory traffic); K = 5..6 tiles of 2 rows, which pad 5 or 6 rows to
    # 6 rather than 8 (and at 8 warps load the output norm's weight ahead).
    if t_bucket <= TILES_MAX_T:
        return LaunchConfig(kernel="token", rows_per_tile=2 if k_bucket == 6 else 4, num_warps=8, num_stages=1)
    # Up to LOOP_MAX_T tokens: one program per token, one block row at a time, 4 warps, 3 stages (4 for K = 9..16
    # up to TOKEN_MAX_T_K16 tokens, and for K = 5..8 above LOOP_DEEP_ABOVE_T, where a cold L2 leaves more latency to
    # hide); for K <= 16 the prefix candidate first, its row dead in the loop and the fused call's stores ahead of
    # it. K > 16: up to TOKEN_MAX_T tokens, the prefix last. At K = 3..8 this beats the streaming and rows kernels at
    # every T on a cold L2, the fused call by 8-13 %.
    if t_bucket <= LOOP_MAX_T.get(k_bucket, TOKEN_MAX_T):
        deep = (k_bucket == 16 and t_bucket <= TOKEN_MAX_T_K16) or (k_bucket in (6, 8) and t_bucket > LOOP_DEEP_ABOVE_T)
        return LaunchConfig(kernel="token", rows_per_tile=1, num_warps=4, num_stages=4 if deep else 3,
                            prefix_first=k_bucket <= 16)
    # Everything else: the rows kernel, which reads each candidate row once at any K.
    return ROWS_CONFIG


LAUNCH_TABLE: dict[tuple[int, int], LaunchConfig] = {
    (tb, kb): table_entry(tb, kb) for tb in T_BUCKETS for kb in K_BUCKETS
}


def table_config(T: int, K: int) -> LaunchConfig:
    """The table's entry for a call of T tokens and K valid blocks (K = 0 shares K = 1's)."""
    return LAUNCH_TABLE[(bucket(T, T_BUCKETS), bucket(max(K, 1), K_BUCKETS))]
