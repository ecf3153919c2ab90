"""Benchmarks of the kimi_k3 ops: ``python -m k3_ops.bench [mix|fused|layer|host|train ...]`` (also run by
``python -m k3_ops``), and the commands ``report``, ``plan`` and ``variants``.

One package, one timing module (``timing``: CUDA-graph replay with a warm L2 and with a cold one, plain launches,
the two phases of a training step, wall time per eager call, copy bandwidth, the graph-node floor, all measured in
the run they are reported in, each with its spread) and one writer (``writer``: a table on stdout, JSON, Markdown
and a PNG per section). Sections, each a module with ``run(opts, timer, ops)``:

* ``mix`` — the plain ``attn_res`` over T x K, warm and cold L2, beside its floors and the bandwidth limit;
* ``fused`` — ``fused_attn_res`` and the in-place ``fused_attn_res_`` beside the unfused sequence and the floors;
* ``layer`` — a 24-layer decode step of fused calls captured as one CUDA graph, warm, and cold with a stand-in
  for the layers between its calls;
* ``host`` — wall time per eager call beside ``torch.add`` and the same call's graph-replay time;
* ``train`` — forward + backward, each phase of the same steps, peak memory;
* ``tp`` — the tensor-parallel serving call (all-reduce of the partial + ``fused_attn_res_``) beside NCCL's and
  torch's symmetric-memory all-reduce + the op, under ``torchrun`` (one process per GPU); only when named.

Commands: ``report`` writes docs/benchmarks.md from the main job's JSON in docs/data/ (``report``), ``plan`` draws
the launch table (``plan``), ``variants`` times a launch-table cell's alternatives beside its entry
(``variants``). ``floor`` holds the floor kernels the sections time beside each call.

Sections take the callables to time (``Ops``), so a script can time kernel variants side by side in one run::

    from k3_ops.bench import Ops, Options, Timer, mix, writer
    timer = Timer("cuda")
    result = mix.run(Options(tokens=[1, 64], l2=["warm", "cold"]), timer,
                     {"new": Ops(attn_res=new_fn), "old": Ops(attn_res=old_fn)})
    writer.write(result, "bench_out")

On a machine without a GPU every section runs on small shapes through the CPU kernel (the reference formula),
timed as wall time per call with a fixed thread count, so the README's main job works everywhere: a smoke run of
the benchmark, not a kernel benchmark.
"""
from __future__ import annotations

from . import fused, host, layer, mix, train, writer
from .cli import main
from .common import Ops, Options, k3_ops_ops, unfused
from .timing import Timer

__all__ = ["Ops", "Options", "Timer", "k3_ops_ops", "unfused", "main", "mix", "fused", "layer", "host", "train",
           "writer"]
