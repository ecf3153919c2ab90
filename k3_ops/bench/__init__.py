"""Benchmarks of the kimi_k3 ops: ``python -m k3_ops.bench [mix|fused|layer|host|train ...]`` (also run by
``python -m k3_ops``).

One package, one timing module (``timing``: CUDA-graph replay, plain launches, wall time per eager call, copy
bandwidth, the graph-node floor, all measured in the run they are reported in) and one writer (``writer``: a
table on stdout, JSON, Markdown and a PNG per section). Sections, each a module with ``run(opts, timer, ops)``:

* ``mix`` — the plain ``attn_res`` over T x K, token- and block-major, with the fraction of copy bandwidth;
* ``fused`` — ``fused_attn_res`` (addend, snapshot, output norm) beside the unfused sequence;
* ``layer`` — a 24-layer decode step of fused calls captured as one CUDA graph, beside the unfused step;
* ``host`` — wall time per eager call beside ``torch.add`` and the same call's graph-replay time;
* ``train`` — forward + backward, peak memory, the backward op alone.

Sections take the callables to time (``Ops``), so a script can time kernel variants side by side in one run::

    from k3_ops.bench import Ops, Options, Timer, mix, writer
    timer = Timer("cuda")
    result = mix.run(Options(tokens=[1, 64]), timer, {"new": Ops(attn_res=new_fn), "old": Ops(attn_res=old_fn)})
    writer.write(result, "bench_out")

On a machine without a GPU every section runs on small shapes through the CPU kernel (the reference), timed as
wall time per call, so the README's main job works everywhere.
"""
from __future__ import annotations

from . import fused, host, layer, mix, train, writer
from .cli import main
from .common import Ops, Options, k3_ops_ops, unfused
from .timing import Timer

__all__ = ["Ops", "Options", "Timer", "k3_ops_ops", "unfused", "main", "mix", "fused", "layer", "host", "train",
           "writer"]
