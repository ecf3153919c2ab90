"""Same-run comparisons of launch plans for the serving path (H200 data in docs/benchmarks.md, "Tuning").

Each variant is a rule that replaces the launch table's plan for some (T, K) and leaves the others alone; every
variant runs through the bench sections (``k3_ops.bench`` mix, fused, layer: graph replay, NaN in unused slots)
beside the table's own plans, so each ratio is taken within one run. The rules are the alternatives the current
table was chosen against.

Usage, on the GPU machine: python tools/plan_variants.py [section ...] [--out DIR]

- k12: the K = 1 / 2 entries before the 8-warp K-row tiles (1 row, 4 warps, 3 stages; 2-row tiles with 3 stages
  at T <= 4, 4-row tiles above), plain and fused, T = 1..256.
- rows: the rows kernel at T > 256 with 8 warps (1 or 2 programs per SM, 3 or 4 stages) or 16 warps.
- token: the per-token kernel at T = 512..2048 (K-row tiles with 8 warps; one row with 4 warps, 3 stages).
- layer: the layer schedule against the previous defaults (the k12 entries, and every fused call on a cluster
  entry's fallback, as before the cluster kernel had the output norm).
- stream: the streaming CUDA C++ kernel (csrc_cuda/attn_res_stream.cu) against the table, plain and fused,
  T = 64..16384, K = 1, 4, 8.
- layer_stream: the layer schedule with the streaming kernel at T >= 32.
- stream_edges: the table (the streaming kernel at K = 5..8 above 2048 tokens, K = 3..4 above 4096) beside the
  rows kernel and the streaming kernel on either side of those edges, T = 2048 and 8192, K = 2, 5, 8.
- one_tile: the per-token kernel with every block row in one tile and the prefix beside it (rows_per_tile 0,
  8 warps) at T <= 256 and K <= 4, plain and fused, T = 1, 8, 16, 64, 128, 256, K = 1..4.
- layer_one_tile: the layer schedule with that plan at T <= 256 and K <= 4.
- cluster_wide: the cluster kernel (8, 4 or 2 CTAs per token) at every K = 1..8 up to 512 tokens, the table's own
  entry as its fallback, plain and fused, T = 1..512, K = 1, 2, 4, 8.
- layer_cluster: the layer schedule with the cluster kernel (8 or 4 CTAs per token) at every K.
- cluster_table: the table (the cluster kernel at K = 2 up to 16 tokens, K = 3..4 up to 32 and K = 5..8 up to 64)
  beside the entries it had before there (the one-tile plan at K <= 4; 4-row tiles at K = 5..8 from 17 tokens) and
  the cluster kernel with 8, 4 and 2 CTAs per token, T = 1..64, K = 3, 4, 5, 8.
- layer_cluster_table: the layer schedule with the table and with those entries before it.
- cluster_blocks: the table alone at the cluster kernel's shapes, T = 1..64, K = 2, 4..8; run from two builds
  side by side, it times a kernel change (the variant per block count) against the kernel before it.
- layer_table: the layer schedule with the table alone, T = 1, 8, 64, 512 (the same use).
- one_tile_blocks: the table alone at the one-tile plan's shapes (and the cluster entries among them), T = 1..512,
  K = 1..4, plain and fused (the same use, for a change to the one-tile kernel).
- decode_short: the table alone at T = 1, 64, 256, K = 1, 2, 4, plain and fused (the same use, fewer shapes than
  one_tile_blocks, for A/B runs of several builds).
- loop_blocks: the table alone where it runs a loop over the block rows (K = 5 and 8 at 256-1024 tokens: the
  per-token kernel's one-row plan, the rows kernel above 512 tokens), plain and fused (the same use, for a change
  to the kernels' per-row steps).
- large_blocks: the table alone at T = 4096, K = 1, 2, 4, 8, plain and fused (the same use: what a change does
  where nothing may get slower).
- layer_decode: the layer schedule with the table alone at T = 1, 8, 64: one build's side of an A/B of two builds
  timed in turn.
- cluster_k12: the cluster kernel (8 or 4 CTAs per token, its 2-block variant) at K = 1 and 2 up to 32 tokens beside
  the table, plain and fused.
- one_tile_w16: the one-tile plan with 16 warps (16 columns per thread, not 32) where the table runs it with 8 at
  K = 1 and 2 (K = 1 up to 256 tokens, K = 2 from 17), plain and fused, T = 1, 8, 24, 64, 256.
- one_tile_large: the one-tile plan (8 warps) above 256 tokens at K <= 4, plain and fused, T = 384, 512, 768,
  1024, 2048, K = 1..4 (the rows kernel's range before 4fb5ecc; since then the table runs it up to 512 tokens).
- layer_one_tile_large: the layer schedule with that plan at K <= 4 up to 512 tokens (at every T, so it also
  replaces the cluster entries at K = 2..4 up to 32 tokens: docs/data/one_tile_large_h200_f5a5419.txt).
- token_tiles: the per-token kernel's tiles at K = 5..8, 65-256 tokens: the table (2-row tiles at K = 5..6 up to
  128 tokens since they replaced 4-row ones there, tiles4_before), 2-row tiles with 8 warps (1 or 2 stages), one
  row with 8 warps and 3 stages; plain and fused, T = 80, 128, 192, 256, K = 5..8; the table timed first and last.
- token_tiles_layouts: the same variants, plain, token- and block-major, T = 128 and 16384, K = 5 and 8.
- prefix_first: the table's loop plans (K = 5..8 at 65-512 tokens) with the prefix candidate folded before the
  block rows (LaunchConfig.prefix_first) and after them, beside the table (which folds it first in its one-row
  plans at 129-512 tokens since the run of this section at 149d12a), timed first and last; plain and fused,
  T = 80..512.
- layer_prefix_first: the layer schedule with them (its K = 5..8 sites at T = 512).
- loop_plans: the one-row plan at 129-512 tokens, K >= 5, with the prefix last (the table before 149d12a's run),
  and with it first at 2 or 4 stages, 8 warps, 2-row tiles (8 warps unpipelined, 4 warps 2 stages); plain and
  fused, T = 192..512, K = 5, 8, 12, 16; the table timed first and last.
- layer_loop_plans: the layer schedule with them, T = 512.
- loop_large: that plan (one row, 4 warps, the prefix first, 3 or 4 stages) above 512 tokens at K >= 5, where the
  table runs the rows kernel (the streaming kernel at K = 5..8 above 2048 tokens); plain and fused, T = 768..4096,
  K = 5, 8, 16; the table timed first and last.
- loop_large_small_k: the same plan (3 or 4 stages) above 512 tokens at K = 1..4, where the table runs the rows
  kernel up to 4096 tokens; plain and fused, T = 768..4096, K = 1..4; the table timed first and last.
- norm_gram: the table's per-token plans with the output norm's sum of squares from the candidates' pairwise
  products (LaunchConfig.norm_gram; tiles of at most 4 rows), and where the table runs the cluster kernel its
  token fallback with and without it; the fused call only (the plain op has no norm: the same kernel), T = 1..1024,
  K = 1, 2, 4, 8; the table timed first and last.
- layer_norm_gram: the layer schedule with the same rule at every site.
- norm_gram_cluster: the table's cluster entries with the Gram norm (the cluster kernel's kGram: the norm's sum of
  squares from the first exchange, the second exchange only where the guard asks for it), every other entry the
  table's; the fused call only, T = 1..64, K = 2, 4, 5, 8; the table timed first and last.
- layer_norm_gram_cluster: the layer schedule with that rule, T = 1, 8, 64 (no cluster entry above 64 tokens).
- onw_after: the table's one-tile plans at K = 1..2 with the output norm's weight loaded after the mix
  (LaunchConfig.onw_ahead False; the table loads it after above 128 tokens only) and ahead (True) at every T; the
  fused call only, T = 1..512; the table timed first and last.
- layer_onw_after: the layer schedule with those rules, T = 1, 64, 512.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops.backends import cuda  # noqa: E402
from k3_ops.bench import fused, layer, mix  # noqa: E402
from k3_ops.bench.common import Ops, Options  # noqa: E402

_table_choice = cuda.choose_config


def token(rows: int, warps: int, stages: int = 1, prefix_first: bool = False) -> cuda.LaunchConfig:
    return cuda.LaunchConfig(kernel="token", rows_per_tile=rows, num_warps=warps, num_stages=stages,
                             prefix_first=prefix_first)


def rows_kernel(warps: int, ctas_per_sm: int, stages: int) -> cuda.LaunchConfig:
    return cuda.LaunchConfig(kernel="rows", num_warps=warps, ctas_per_sm=ctas_per_sm, prefetch=0,
                             num_stages=stages)


def table_entry(T: int, K: int) -> cuda.LaunchConfig:
    """The launch table's own entry for (T, K), before it resolves."""
    return cuda.LAUNCH_TABLE[(cuda.bucket(T, cuda.T_BUCKETS), cuda.bucket(max(K, 1), cuda.K_BUCKETS))]


def variant(rule) -> Ops:
    """Ops whose plan choice is ``rule(T, K, fused_call)``: a LaunchConfig, "fallback" (a cluster plan's
    fallback), or None (the table's plan)."""
    def wrap(fn, fused_call: bool):
        def choose(T, K, H, device, config=None):
            plan = _table_choice(T, K, H, device, config)
            choice = None if config is not None else rule(T, K, fused_call)
            if choice is None:
                return plan
            if choice == "fallback":
                return plan.fallback if plan.kernel in cuda.NATIVE_KERNELS else plan
            return _table_choice(T, K, H, device, choice)

        def call(*args):
            cuda.choose_config = choose
            try:
                return fn(*args)
            finally:
                cuda.choose_config = _table_choice
        return call
    return Ops(attn_res=wrap(cuda.attn_res_forward, False), fused=wrap(cuda.fused_attn_res, True))


def previous_k12(T: int, K: int):
    if K == 1 and T <= 256:
        return token(1, 4, 3)
    if K == 2 and T <= 4:
        return token(2, 8, 3)
    if K == 2 and T <= 128:
        return token(4, 8, 1)
    return None


TABLE = variant(lambda T, K, f: None)
STREAM = cuda.LaunchConfig(kernel="stream")
ONE_TILE = cuda.LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8)
ONE_TILE_W16 = cuda.LaunchConfig(kernel="token", rows_per_tile=0, num_warps=16)


def cluster_everywhere(size: int, max_t: int = 512) -> Ops:
    """The cluster kernel with ``size`` CTAs per token at every K >= 1 up to ``max_t`` tokens; the table's own entry
    for (T, K) runs what it leaves (K = 0, other layouts)."""
    def rule(T, K, f):
        if T > max_t:
            return None
        own = table_entry(T, K)
        own = own.fallback if own.kernel == "cluster" and own.fallback is not None else own
        return cuda.LaunchConfig(kernel="cluster", cluster_size=size, min_k=1, fallback=own)
    return variant(rule)


def previous_cluster(T: int, K: int):
    """The entries the cluster kernel replaced at K = 2 up to 16 tokens, K = 3..4 up to 32 and K = 5..8 at 17-64."""
    if (3 <= K <= 4 and T <= 32) or (K == 2 and T <= 16):
        return ONE_TILE
    if 5 <= K <= 8 and 16 < T <= 64:
        return token(4, 8)
    return None


def one_tile_w16(T: int, K: int):
    """The one-tile plan with 16 warps where the table runs it with 8 at K = 1..2."""
    return ONE_TILE_W16 if T <= 256 and (K == 1 or (K == 2 and T > 16)) else None


def one_tile(max_t: int = 256) -> Ops:
    return variant(lambda T, K, f: ONE_TILE if T <= max_t and K <= 4 else None)


def token_tiles(config: cuda.LaunchConfig) -> Ops:
    """``config`` for K = 5..8 at 65-256 tokens (the table: 4-row tiles, 2-row at K = 5..6, up to 128 tokens; one
    row with 4 warps above)."""
    return variant(lambda T, K, f: config if 64 < T <= 256 and K >= 5 else None)


def prefix_order(first: bool) -> Ops:
    """The table's own loop plans (the per-token kernel with rows_per_tile >= 1) with the prefix candidate folded
    first (``first``) or last; every other entry as the table has it."""
    def rule(T, K, f):
        own = table_entry(T, K)
        if own.kernel == "token" and own.rows_per_tile >= 1:
            return dataclasses.replace(own, prefix_first=first)
        return None
    return variant(rule)


def loop_plan(config: cuda.LaunchConfig, tokens: tuple[int, int] = (129, 512),
              blocks: tuple[int, int] = (5, 1 << 62)) -> Ops:
    """``config`` at ``tokens`` (first, last) and ``blocks`` (first, last K; default every K >= 5). The table at
    129-512 tokens: one row, 4 warps, the prefix first, 3 stages at K = 5..8 and (since 2c759f6) 4 at K = 9..16;
    before 2c759f6, K > 8 took one row with the prefix last up to 256 tokens and the rows kernel above."""
    return variant(lambda T, K, f: config if tokens[0] <= T <= tokens[1] and blocks[0] <= K <= blocks[1] else None)


#: The loop_plans section's variants: the one-row plan around the table's (the prefix last as before, other
#: stages and warps), 2-row tiles, each with the prefix first; the table timed first and last.
LOOP_PLANS = {"table": TABLE, "prefix_last": loop_plan(token(1, 4, 3)),
              "pf_s2": loop_plan(token(1, 4, 2, True)), "pf_s4": loop_plan(token(1, 4, 4, True)),
              "pf_w8_s3": loop_plan(token(1, 8, 3, True)), "pf_2row_w8": loop_plan(token(2, 8, 1, True)),
              "pf_2row_w4_s2": loop_plan(token(2, 4, 2, True)), "table_again": TABLE}


#: The token_tiles section's variants, the table measured first and again last: at some shapes the first plan timed
#: after a change of shape took up to 1 us more than the same plan timed again (docs/benchmarks.md, "Plain mix").
TOKEN_TILES = {"table": TABLE,
               "tiles4_before": variant(lambda T, K, f: token(4, 8) if 64 < T <= 128 and 5 <= K <= 6 else None),
               "tiles2_w8": token_tiles(token(2, 8, 1)), "row_w8_s3": token_tiles(token(1, 8, 3)),
               "tiles2_w8_s2": token_tiles(token(2, 8, 2)), "table_again": TABLE}


#: The loop_large section's variants: the one-row loop plan, the prefix first, above 512 tokens at K >= 5 (the
#: table: the rows kernel, the streaming kernel at K = 5..8 above 2048 tokens), the table timed first and last.
LOOP_LARGE = {"table": TABLE, **{f"pf_s{st}": loop_plan(token(1, 4, st, True), (513, 1 << 62)) for st in (3, 4)},
              "table_again": TABLE}

#: The loop_large_small_k section's variants: the same plan at K = 1..4 above 512 tokens (the table: the rows
#: kernel up to 4096 tokens, the streaming kernel above at K = 3..4).
LOOP_LARGE_SMALL_K = {"table": TABLE, **{f"pf_s{st}": loop_plan(token(1, 4, st, True), (513, 1 << 62), (1, 4))
                                         for st in (3, 4)}, "table_again": TABLE}


def norm_gram_choice(T: int, K: int, fused_call: bool, on_cluster: str) -> cuda.LaunchConfig | None:
    """The table's own per-token plan for a fused call with ``norm_gram`` (where its tiles have at most 4 rows; the
    others unchanged); where the table names the cluster kernel, ``on_cluster``: "table" keeps it, "fallback" runs
    its token fallback as it is, "fallback_gram" that fallback with norm_gram. None: the table's plan."""
    own = table_entry(T, K)
    if not fused_call:
        return None  # the plain op (the layer's final mix): no norm, its own plan
    if own.kernel == "cluster":
        if on_cluster == "table" or own.fallback is None or own.fallback.kernel != "token":
            return None
        return own.fallback if on_cluster == "fallback" else dataclasses.replace(own.fallback, norm_gram=True)
    if own.kernel == "token" and own.rows_per_tile <= 4:
        return dataclasses.replace(own, norm_gram=True)
    return None


def norm_gram(on_cluster: str) -> Ops:
    return variant(lambda T, K, f: norm_gram_choice(T, K, f, on_cluster))


def cluster_gram(T: int, K: int, fused_call: bool) -> cuda.LaunchConfig | None:
    """The table's cluster entry with ``norm_gram`` for a fused call; None (the table's plan) elsewhere."""
    own = table_entry(T, K)
    return dataclasses.replace(own, norm_gram=True) if fused_call and own.kernel == "cluster" else None


CLUSTER_GRAM = {"table": TABLE, "cluster_gram": variant(cluster_gram), "table_again": TABLE}

#: kGram where the H100 run of norm_gram_cluster had it faster (K <= 4, T <= 16; then K = 2 and 4 only: slower at
#: K = 3), the table elsewhere.
CLUSTER_GRAM_SMALL = {"table": TABLE, "cluster_gram_small": variant(lambda T, K, f: cluster_gram(T, K, f)
                                                                    if K <= 4 and T <= 16 else None),
                      "cluster_gram_k24": variant(lambda T, K, f: cluster_gram(T, K, f)
                                                  if K in (2, 4) and T <= 16 else None),
                      "table_again": TABLE}

NORM_GRAM = {"table": TABLE, "gram": norm_gram("table"), "cluster_fallback": norm_gram("fallback"),
             "cluster_fallback_gram": norm_gram("fallback_gram"), "table_again": TABLE}


def onw_placed(ahead: bool) -> Ops:
    """The table's one-tile plans at K <= 2 with the output norm's weight loaded with the inputs
    (``LaunchConfig.onw_ahead`` True) or after the mix (False); every other entry the table's."""
    def rule(T, K, f):
        own = table_entry(T, K)
        if own.kernel == "token" and own.rows_per_tile == 0 and K <= 2:
            return dataclasses.replace(own, onw_ahead=ahead)
        return None
    return variant(rule)


#: The onw_after section's variants: the weight after the mix at every one-tile shape with K <= 2 (the table: above
#: 128 tokens, where a second 8-warp program per SM has work: 122-128 registers against 154-164 at K = 1), and
#: ahead at every one (the table's rule before); the table timed first and last.
ONW_AFTER = {"table": TABLE, "after": onw_placed(False), "ahead": onw_placed(True), "table_again": TABLE}


SECTIONS = {
    "k12": ({"table": TABLE, "previous": variant(lambda T, K, f: previous_k12(T, K))},
            dict(tokens=[1, 2, 4, 8, 16, 32, 64, 128, 256], blocks=[1, 2]), (mix, fused)),
    "rows": ({"table": TABLE, **{f"rows_w{w}_c{c}_s{s}": variant(lambda T, K, f, w=w, c=c, s=s:
                                                                  rows_kernel(w, c, s) if T > 256 else None)
                                 for w, c, s in ((8, 1, 3), (8, 1, 4), (16, 1, 6), (8, 2, 3))}},
             dict(tokens=[512, 1024, 4096], blocks=[1, 8]), (mix, fused)),
    "token": ({"table": TABLE,
               "token_k_rows_w8": variant(lambda T, K, f: None if T <= 256 else token(min(K, 2) if K <= 2 else 4, 8)),
               "token_1row_w4": variant(lambda T, K, f: token(1, 4, 3) if T > 256 else None)},
              dict(tokens=[512, 1024, 2048], blocks=[1, 2, 4, 8]), (mix, fused)),
    "layer": ({"table": TABLE,
               "previous": variant(lambda T, K, f: previous_k12(T, K) or ("fallback" if f else None))},
              dict(tokens=[1, 8, 64, 512]), (layer,)),
    "stream": ({"table": TABLE, "stream": variant(lambda T, K, f: STREAM if T >= 16 else None)},
               dict(tokens=[64, 128, 256, 512, 1024, 4096, 16384], blocks=[1, 4, 8]), (mix, fused)),
    "layer_stream": ({"table": TABLE, "stream": variant(lambda T, K, f: STREAM if T >= 32 else None)},
                     dict(tokens=[1, 8, 64, 512]), (layer,)),
    "one_tile": ({"table": TABLE, "one_tile_w8": one_tile()},
                 dict(tokens=[1, 8, 16, 64, 128, 256], blocks=[1, 2, 3, 4]), (mix, fused)),
    "layer_one_tile": ({"table": TABLE, "one_tile_w8": one_tile()}, dict(tokens=[1, 8, 64, 512]), (layer,)),
    "cluster_wide": ({"table": TABLE, **{f"cluster{n}": cluster_everywhere(n) for n in (8, 4, 2)}},
                     dict(tokens=[1, 4, 16, 32, 64, 128, 256, 512], blocks=[1, 2, 4, 8]), (mix, fused)),
    "layer_cluster": ({"table": TABLE, **{f"cluster{n}": cluster_everywhere(n) for n in (8, 4)}},
                      dict(tokens=[1, 8, 64, 512]), (layer,)),
    "cluster_table": ({"table": TABLE, "previous": variant(lambda T, K, f: previous_cluster(T, K)),
                       **{f"cluster{n}": cluster_everywhere(n, 64) for n in (8, 4, 2)}},
                      dict(tokens=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64], blocks=[3, 4, 5, 8]), (mix, fused)),
    "layer_cluster_table": ({"table": TABLE, "previous": variant(lambda T, K, f: previous_cluster(T, K))},
                            dict(tokens=[1, 8, 64, 512]), (layer,)),
    "cluster_blocks": ({"table": TABLE}, dict(tokens=[1, 2, 4, 8, 16, 32, 64], blocks=[2, 4, 5, 6, 7, 8]),
                       (mix, fused)),
    "layer_table": ({"table": TABLE}, dict(tokens=[1, 8, 64, 512]), (layer,)),
    "one_tile_blocks": ({"table": TABLE}, dict(tokens=[1, 8, 16, 64, 128, 256, 512], blocks=[1, 2, 3, 4]),
                        (mix, fused)),
    "decode_short": ({"table": TABLE}, dict(tokens=[1, 64, 256], blocks=[1, 2, 4]), (mix, fused)),
    "loop_blocks": ({"table": TABLE}, dict(tokens=[256, 512, 1024], blocks=[5, 8]), (mix, fused)),
    "large_blocks": ({"table": TABLE}, dict(tokens=[4096], blocks=[1, 2, 4, 8]), (mix, fused)),
    # The decode sizes only, for A/B builds timed in turn (each build's own table).
    "layer_decode": ({"table": TABLE}, dict(tokens=[1, 8, 64]), (layer,)),
    "cluster_k12": ({"table": TABLE, **{f"cluster{n}": cluster_everywhere(n, 32) for n in (8, 4)}},
                    dict(tokens=[1, 2, 4, 8, 12, 16, 24, 32], blocks=[1, 2]), (mix, fused)),
    "one_tile_w16": ({"table": TABLE, "one_tile_w16": variant(lambda T, K, f: one_tile_w16(T, K))},
                     dict(tokens=[1, 8, 24, 64, 256], blocks=[1, 2]), (mix, fused)),
    "one_tile_large": ({"table": TABLE, "one_tile_w8": one_tile(2048)},
                       dict(tokens=[384, 512, 768, 1024, 2048], blocks=[1, 2, 3, 4]), (mix, fused)),
    "layer_one_tile_large": ({"table": TABLE, "one_tile_w8": one_tile(512)}, dict(tokens=[1, 8, 64, 512]),
                             (layer,)),
    "prefix_first": ({"table": TABLE, "prefix_last": prefix_order(False), "prefix_first": prefix_order(True),
                      "table_again": TABLE},
                     dict(tokens=[80, 128, 192, 256, 384, 512], blocks=[5, 6, 7, 8]), (mix, fused)),
    "layer_prefix_first": ({"table": TABLE, "prefix_last": prefix_order(False), "prefix_first": prefix_order(True),
                            "table_again": TABLE},
                           dict(tokens=[1, 8, 64, 512]), (layer,)),
    "loop_plans": (LOOP_PLANS, dict(tokens=[192, 256, 384, 512], blocks=[5, 8, 12, 16]), (mix, fused)),
    "layer_loop_plans": (LOOP_PLANS, dict(tokens=[512]), (layer,)),
    "loop_large": (LOOP_LARGE, dict(tokens=[768, 1024, 2048, 4096], blocks=[5, 8, 16]), (mix, fused)),
    "loop_large_small_k": (LOOP_LARGE_SMALL_K, dict(tokens=[768, 1024, 2048, 4096], blocks=[1, 2, 3, 4]),
                           (mix, fused)),
    "token_tiles": (TOKEN_TILES, dict(tokens=[80, 128, 192, 256], blocks=[5, 6, 7, 8]), (mix, fused)),
    # One buffer for 16384 tokens, as the main job's: a block-major token's rows lie 235 MB apart.
    "token_tiles_layouts": (TOKEN_TILES, dict(tokens=[128, 16384], blocks=[5, 8], layouts=["token", "block"]),
                            (mix,)),
    "norm_gram": (NORM_GRAM, dict(tokens=[1, 8, 16, 32, 64, 128, 256, 512, 1024], blocks=[1, 2, 4, 8]), (fused,)),
    "layer_norm_gram": ({"table": TABLE, "gram": norm_gram("table"), "gram_no_cluster": norm_gram("fallback_gram"),
                         "table_again": TABLE}, dict(tokens=[1, 8, 64, 512]), (layer,)),
    "norm_gram_cluster": (CLUSTER_GRAM, dict(tokens=[1, 8, 16, 32, 64], blocks=[2, 4, 5, 8]), (fused,)),
    "layer_norm_gram_cluster": (CLUSTER_GRAM, dict(tokens=[1, 8, 64]), (layer,)),
    "norm_gram_cluster_small": (CLUSTER_GRAM_SMALL, dict(tokens=[1, 2, 4, 8, 16], blocks=[2, 3, 4]), (fused,)),
    "layer_norm_gram_cluster_small": (CLUSTER_GRAM_SMALL, dict(tokens=[1, 8, 64]), (layer,)),
    "onw_after": (ONW_AFTER, dict(tokens=[1, 64, 128, 192, 256, 384, 512], blocks=[1, 2]), (fused,)),
    "layer_onw_after": (ONW_AFTER, dict(tokens=[1, 64, 512]), (layer,)),
    "stream_edges": ({"table": TABLE, "rows": variant(lambda T, K, f: rows_kernel(4, 2, 3)),
                      "stream": variant(lambda T, K, f: STREAM)},
                     dict(tokens=[2048, 8192], blocks=[2, 5, 8]), (mix, fused)),
}


def output_dir(doc: str) -> str:
    """The probes' command line (``--out DIR``, default "."): the directory, created; ``doc``: the script's
    docstring, whose first line describes it."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", default=".", help="directory for the JSON files")
    out = p.parse_args().out
    os.makedirs(out, exist_ok=True)
    return out


def options(**grid) -> Options:
    """The bench options of every same-run comparison in tools/: no reference rows, 10 ms per measurement,
    token-major buffers unless ``grid`` names its layouts (``grid``: tokens, blocks, layouts, ...)."""
    return Options(**{"refs": False, "rep_ms": 10, "layouts": ["token"], **grid})


def save(result: dict, path: str, label: str) -> None:
    """Write one section's result as JSON and print its rows, one line each: '<label> T= K= <name>=<us> ...'."""
    with open(path, "w") as f:
        json.dump(result, f, default=str)
    for row in result["rows"]:
        times = " ".join(f"{k[3:]}={v:.2f}" for k, v in row.items() if k.startswith("us:"))
        print(f"{label} T={row['T']} K={row.get('K', row.get('K_final'))} {times}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--out", default=".", help="directory for plan_variants_<section>_<bench section>.json")
    args = p.parse_args()
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"sections must come from {', '.join(SECTIONS)}, got {', '.join(unknown)}")
    os.makedirs(args.out, exist_ok=True)
    for name in args.sections or list(SECTIONS):
        ops, grid, modules = SECTIONS[name]
        for module in modules:
            result = module.run(options(**grid), ops=ops)
            section = result["section"]
            save(result, os.path.join(args.out, f"plan_variants_{name}_{section}.json"), f"{name} {section}")


if __name__ == "__main__":
    main()
