"""The one timing module of the benchmark: every figure the sections report is measured here.

* ``Timer.graph`` — CUDA-graph replay: n back-to-back calls captured in one graph (n chosen so that one replay
  lasts about ``rep_ms``, at most ``max_calls``), the graph replayed ``replays`` times, each replay timed with
  CUDA events; the median replay time divided by n. Launch overhead is amortised, as in a captured decode step.
  The same method as ``triton.testing.do_bench_cudagraph`` with ``return_mode="median"``.
* ``Timer.launch`` — plain launches: each call timed alone with CUDA events, L2 flushed before it (a 256 MiB
  write), median. What a single eager call costs the device when the host keeps up.
* ``Timer.wall`` — wall time per eager call: N back-to-back calls, then one synchronize; the median of a few
  such batches divided by N. Host cost included: the figure an eager caller (prefill above the capture sizes,
  training, debugging) sees. The only method on a CPU, where it is also the "graph" figure.
* ``Timer.copy_bandwidth`` — bytes read + written per second of one large device-to-device copy: the ceiling for
  ops that only stream memory.
* ``Timer.graph_node_us`` — the per-node cost of a trivial one-kernel graph (a one-element add, graph replay):
  the floor under any captured kernel.

The last two are measured once per ``Timer`` (once per run of the CLI) and reported beside every section.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["Timer", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA, an NPU through its torch module, nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()


class Timer:
    """Times callables on one device. All results are microseconds per call (floats).

    ``rep_ms`` is the time budget of one measurement (per graph replay, per batch of eager calls); ``quick``
    shortens every measurement (fewer replays and batches) for smoke runs.
    """

    def __init__(self, device: torch.device | str, rep_ms: float = 20.0, *, quick: bool = False,
                 max_calls: int = 1000, settle_s: float = 1.0, heavy_us: float = 40.0):
        self.device = torch.device(device)
        self.rep_ms = rep_ms
        self.settle_s = settle_s
        self.heavy_us = heavy_us
        self._after_heavy = False
        self.quick = quick
        self.max_calls = max_calls
        self.replays = 3 if quick else 10
        self._limits: dict | None = None
        self._flush: torch.Tensor | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def mode(self) -> str:
        """The method of the sections' main figures: graph replay where the device has graphs, else wall time."""
        return "graph" if self.is_cuda else "wall"

    def primary(self, fn: Callable[[], object]) -> float:
        return self.graph(fn) if self.is_cuda else self.wall(fn)

    # ------------------------------------------------------------------------------------------------ methods
    def _warm(self, fn: Callable[[], object]) -> None:
        """Compile, autotune and allocate outside any capture; on CUDA also once on a side stream, which is
        where capture runs (torch's capture warm-up rule)."""
        fn()
        if self.is_cuda:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
        synchronize(self.device)

    def _capture(self, fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return graph

    def _replay_ms(self, graph: torch.cuda.CUDAGraph, replays: int) -> float:
        start = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        graph.replay()  # first replay uploads the graph
        for s, e in zip(start, end):
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))

    def graph(self, fn: Callable[[], object]) -> float:
        """CUDA-graph replay time per call (see the module docstring)."""
        if not self.is_cuda:
            raise RuntimeError(f"graph replay needs a CUDA device, got {self.device}")
        self._warm(fn)
        one = self._capture(fn, 1)
        estimate_ms = max(self._replay_ms(one, 3), 1e-4)
        del one
        calls = max(1, min(self.max_calls, int(self.rep_ms / estimate_ms)))
        self._settle(1e3 * estimate_ms)
        graph = self._capture(fn, calls)
        ms = self._replay_ms(graph, self.replays)
        del graph
        us = 1e3 * ms / calls
        self._after_heavy = us >= self.heavy_us
        return us

    def after_heavy_work(self) -> None:
        """Note that heavy device work ran outside the timer (filling a problem's buffers with data or NaN), so
        that the next light measurement settles first (``_settle``)."""
        self._after_heavy = True

    def _settle(self, estimate_us: float) -> None:
        """Leave the device idle for ``settle_s`` before timing a light call (under ``heavy_us`` per call) that
        follows a heavy one. On the H200 a decode-size call timed right after the grid's heaviest one (T = 16384,
        K = 8) took up to 12 % longer, in every one of five measurements in a row, than after one second of idle,
        at the same SM clock; untimed replays first did not remove it (tools/timing_probe.py,
        docs/benchmarks.md, "Method"). So a cell's figure would depend on the cell timed before it."""
        if self._after_heavy and estimate_us < self.heavy_us and self.settle_s > 0:
            self._after_heavy = False
            synchronize(self.device)
            time.sleep(self.settle_s)

    def launch(self, fn: Callable[[], object], *, flush_l2: bool = True) -> float:
        """Device time of one plain launch (with a cold L2 unless ``flush_l2`` is False), median; wall time per
        call on a CPU."""
        if not self.is_cuda:
            return self.wall(fn)
        self._warm(fn)
        if flush_l2 and self._flush is None:
            self._flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=self.device)
        probe_s, probe_e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        probe_s.record()
        for _ in range(5):
            fn()
        probe_e.record()
        torch.cuda.synchronize(self.device)
        n = max(5, min(self.max_calls, int(5 * self.rep_ms / max(probe_s.elapsed_time(probe_e), 1e-3))))
        if self.quick:
            n = min(n, 20)
        start = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(start, end):
            if flush_l2:
                self._flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(start, end))

    def wall(self, fn: Callable[[], object], calls: int | None = None) -> float:
        """Wall time per eager call: ``calls`` back-to-back calls then one synchronize (``calls`` None: as
        many as fill ``rep_ms``), median over a few batches."""
        self._warm(fn)
        if calls is None:
            t0 = time.perf_counter()
            fn()
            synchronize(self.device)
            once = max(time.perf_counter() - t0, 1e-7)
            calls = max(1, min(self.max_calls, int(self.rep_ms * 1e-3 / once)))
        batches = []
        for _ in range(3 if self.quick else 7):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize(self.device)
            batches.append((time.perf_counter() - t0) / calls)
        return 1e6 * statistics.median(batches)

    # ----------------------------------------------------------------------------------------- physical limits
    def copy_bandwidth(self) -> float:
        """Bytes read + written per second of one large copy (2 GiB on a GPU, 64 MiB on a CPU; 1/8 of it quick)."""
        nbytes = (2 * 2**30 if self.device.type != "cpu" else 64 * 2**20) // (8 if self.quick else 1)
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=self.device).normal_()
        dst = torch.empty_like(src)
        if self.is_cuda:
            us = self.launch(lambda: dst.copy_(src), flush_l2=False)  # the buffers are far larger than L2
        else:
            us = self.wall(lambda: dst.copy_(src))
        self.after_heavy_work()
        return 2 * nbytes / (us * 1e-6)

    def graph_node_us(self) -> float | None:
        """Per-call time of a one-element add under graph replay (None without CUDA graphs)."""
        if not self.is_cuda:
            return None
        x = torch.zeros(1, device=self.device)
        return self.graph(lambda: x.add_(1.0))

    def limits(self) -> dict:
        """The physical limits of this run, measured on first use: copy bandwidth (B/s) and graph node (us)."""
        if self._limits is None:
            self._limits = {"copy_bandwidth_Bps": self.copy_bandwidth(), "graph_node_us": self.graph_node_us()}
            if self.is_cuda:
                torch.cuda.empty_cache()
        return self._limits
