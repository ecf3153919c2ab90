"""The one timing module of the benchmark: every figure the sections report is measured here.

* ``Timer.graph`` — CUDA-graph replay, warm L2: n back-to-back calls on the same inputs captured in one graph (n
  chosen so that one replay lasts about ``rep_ms``, at most ``max_calls``), the graph replayed ``replays`` times,
  each replay timed with CUDA events; the median replay time divided by n. Launch overhead is amortised, as in a
  captured decode step; the inputs stay in the L2 from one call to the next where they fit.
* ``Timer.cold`` — CUDA-graph replay, cold L2: one graph runs a list of calls in turn, each on its own input set,
  the sets together more than ``COLD_FACTOR`` x the device's L2 (``cold_set_count``), so that every call finds its
  inputs evicted by the others, as a decoder step finds them after the attention and MoE weights streamed through
  the L2; time per call = graph time / calls.
* ``Timer.launch`` — plain launches: each call timed alone with CUDA events, L2 flushed before it (a 256 MiB
  write), median. What a single eager call costs the device when the host keeps up.
* ``Timer.phases`` — one call made of two phases (a forward, then its backward), each sample timing both: the
  phases' medians never exceed the whole call's median, since every sample's phase is part of that sample's whole.
  On CUDA the device time of plain launches with a cold L2 and the host ahead: a spin kernel queued before each
  sample (``host_ahead``) holds the GPU until the host has queued the whole call, as in a training step whose host
  runs ahead of the GPU, so a phase's figure is its kernels' time and not the autograd engine's host time (which
  the host section reports).
* ``Timer.wall`` — wall time per eager call: N back-to-back calls, then one synchronize; the median of a few
  such batches divided by N. Host cost included: the figure an eager caller (prefill above the capture sizes,
  training, debugging) sees. The only method on a CPU, where it is also the "graph" figure.
* ``Timer.copy_bandwidth`` — bytes read + written per second of one large device-to-device copy: the ceiling for
  ops that only stream memory.
* ``collective_graph_us`` — CUDA-graph replay of a call that communicates (tensor parallelism): a fixed number of
  calls per graph on every rank, replays started after a barrier, the slowest rank's median.
* ``Timer.graph_node_us`` — the per-node cost of a trivial one-kernel graph (a one-element add, graph replay):
  the floor under any captured kernel.

Every method keeps the spread of its samples in ``Timer.last`` (median and interquartile range); ``WIDE_SPREAD``
is the relative interquartile range above which a section notes the figure as unreliable. The last two limits
are measured once per ``Timer`` (once per run of the CLI) and reported beside every section.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Timer", "Spread", "synchronize", "cold_set_count", "l2_bytes", "collective_graph_us", "COLD_FACTOR",
           "WIDE_SPREAD", "DEFAULT_L2_BYTES"]

#: The cold sets together exceed this many times the device's L2.
COLD_FACTOR = 3.0
#: The L2 assumed where the device does not report one (an H100's is 50 MB).
DEFAULT_L2_BYTES = 50 * 2**20
#: Samples per ``Timer.phases`` figure on CUDA (each waits behind a spin kernel of ``Timer.host_ahead``).
PHASE_SAMPLES = 60
#: Interquartile range / median above which a figure is noted as having a wide spread.
WIDE_SPREAD = 0.2


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA, an NPU through its torch module, nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()


@dataclass(frozen=True)
class Spread:
    """The samples of one measurement, per call: median and quartiles (us), and how many samples."""

    median: float
    q1: float
    q3: float
    samples: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("Spread.of needs at least one sample, got none")
        xs = sorted(samples)
        if len(xs) == 1:
            return cls(xs[0], xs[0], xs[0], 1)
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(statistics.median(xs), q1, q3, len(xs))

    @property
    def relative(self) -> float:
        """Interquartile range / median (0 for a single sample)."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else math.inf

    @property
    def wide(self) -> bool:
        return self.relative > WIDE_SPREAD


def l2_bytes(device: torch.device) -> int | None:
    """The L2 size of a CUDA ``device`` (``DEFAULT_L2_BYTES`` where its properties do not say); None elsewhere."""
    if device.type != "cuda":
        return None
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return int(size) if size and size > 0 else DEFAULT_L2_BYTES


def cold_set_count(footprint: int, allocated: int, l2: int, *, factor: float = COLD_FACTOR, min_sets: int = 2,
                   budget: int = 8 * 2**30, max_sets: int = 16384) -> int:
    """How many input sets a cold measurement rotates through: the fewest (at least ``min_sets``) whose
    ``footprint`` (bytes one call touches in its set) together exceeds ``factor`` x ``l2``, but no more than
    ``budget`` bytes of sets (``allocated`` bytes each) hold and no more than ``max_sets`` (calls in one graph);
    at large T one set alone is past the L2 already. Where a bound binds, the sets together stay under ``factor``
    x L2 (``cold_ratio`` reports it)."""
    for name, value in (("footprint", footprint), ("allocated", allocated), ("l2", l2)):
        if value <= 0:
            raise ValueError(f"cold_set_count: {name} must be > 0, got {value}")
    if allocated < footprint:
        raise ValueError(f"cold_set_count: allocated must be >= footprint ({footprint}), got {allocated}")
    wanted = max(min_sets, math.floor(factor * l2 / footprint) + 1)
    return max(1, min(wanted, budget // allocated, max_sets))


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
        self.batches = 3 if quick else 7
        self.last: Spread | None = None
        self._limits: dict | None = None
        self._flush: torch.Tensor | None = None
        self._spin_cycles: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def mode(self) -> str:
        """The method of the sections' main figures: graph replay where the device has graphs, else wall time."""
        return "graph" if self.is_cuda else "wall"

    @property
    def l2_bytes(self) -> int | None:
        return l2_bytes(self.device)

    def primary(self, fn: Callable[[], object]) -> float:
        return self.graph(fn) if self.is_cuda else self.wall(fn)

    def _record(self, samples: Sequence[float]) -> float:
        self.last = Spread.of(samples)
        return self.last.median

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

    def _capture(self, calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        return graph

    def _replay_ms(self, graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
        start = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        graph.replay()  # first replay uploads the graph
        for s, e in zip(start, end):
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) for s, e in zip(start, end)]

    def graph(self, fn: Callable[[], object]) -> float:
        """CUDA-graph replay time per call, warm L2 (see the module docstring)."""
        if not self.is_cuda:
            raise RuntimeError(f"graph replay needs a CUDA device, got {self.device}")
        self._warm(fn)
        one = self._capture([fn])
        estimate_ms = max(statistics.median(self._replay_ms(one, 3)), 1e-4)
        del one
        calls = max(1, min(self.max_calls, int(self.rep_ms / estimate_ms)))
        self._settle(1e3 * estimate_ms)
        graph = self._capture([fn] * calls)
        samples = [1e3 * ms / calls for ms in self._replay_ms(graph, self.replays)]
        del graph
        us = self._record(samples)
        self._after_heavy = us >= self.heavy_us
        return us

    def cold(self, calls: Sequence[Callable[[], object]]) -> float:
        """CUDA-graph replay time per call, cold L2: ``calls`` (each bound to its own input set, made so that the
        sets together exceed ``COLD_FACTOR`` x the L2: ``cold_set_count``) run in turn in one graph, that sequence
        repeated while one replay stays within ``rep_ms`` (and ``max_calls`` calls, unless one pass has more);
        the median replay time / the calls in it."""
        if not self.is_cuda:
            raise RuntimeError(f"cold-L2 graph replay needs a CUDA device, got {self.device}")
        if not calls:
            raise ValueError("Timer.cold needs at least one call, got none")
        self._warm(calls[0])
        for fn in calls[1:]:  # the same compile key; each set's first call outside the capture
            fn()
        synchronize(self.device)
        one = self._capture(calls)
        pass_ms = max(statistics.median(self._replay_ms(one, 3)), 1e-4)
        repeats = max(1, min(int(self.rep_ms / pass_ms), self.max_calls // len(calls)))
        self._settle(1e3 * pass_ms / len(calls))
        if repeats > 1:
            del one
            graph = self._capture(list(calls) * repeats)
        else:
            graph = one
        n = len(calls) * repeats
        samples = [1e3 * ms / n for ms in self._replay_ms(graph, self.replays)]
        del graph
        us = self._record(samples)
        self._after_heavy = us >= self.heavy_us
        return us

    def after_heavy_work(self) -> None:
        """Note that heavy device work ran outside the timer (filling a problem's buffers with data or NaN), so
        that the next light measurement settles first (``_settle``)."""
        self._after_heavy = True

    def _settle(self, estimate_us: float) -> None:
        """Leave the device idle for ``settle_s`` before timing a light call (under ``heavy_us`` per call) that
        follows a heavy one. A decode-size call timed right after the grid's heaviest shape runs longer than after
        a second of idle, at the same SM clock, and untimed replays first do not remove the difference; without the
        pause a cell's figure would depend on the cell timed before it."""
        if self._after_heavy and estimate_us < self.heavy_us and self.settle_s > 0:
            self._after_heavy = False
            synchronize(self.device)
            time.sleep(self.settle_s)

    def _flush_l2(self) -> None:
        if self._flush is None:
            self._flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=self.device)
        self._flush.zero_()

    def host_ahead(self, ms: float = 1.0) -> None:
        """Queue a spin kernel of about ``ms`` milliseconds on the current stream, so that the calls the host queues
        next wait for it and start back to back on the GPU, with none of the host's time between them."""
        if self._spin_cycles is None:
            # Cycles per millisecond, measured once (the clock the spin runs at, not the datasheet's).
            probe = 1_000_000
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(probe)  # the first launch loads the kernel
            s.record()
            torch.cuda._sleep(probe)
            e.record()
            torch.cuda.synchronize(self.device)
            self._spin_cycles = int(probe / max(s.elapsed_time(e), 1e-3))
        torch.cuda._sleep(int(ms * self._spin_cycles))

    def _launch_count(self, fn: Callable[[], object]) -> int:
        probe_s, probe_e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        probe_s.record()
        for _ in range(5):
            fn()
        probe_e.record()
        torch.cuda.synchronize(self.device)
        n = max(5, min(self.max_calls, int(5 * self.rep_ms / max(probe_s.elapsed_time(probe_e), 1e-3))))
        return min(n, 20) if self.quick else n

    def launch(self, fn: Callable[[], object], *, flush_l2: bool = True, host_ahead: bool = False) -> float:
        """Device time of one plain launch (with a cold L2 unless ``flush_l2`` is False; with ``host_ahead`` the
        host's own time between its kernels excluded, as in ``phases``), median; wall time per call on a CPU."""
        if not self.is_cuda:
            return self.wall(fn)
        self._warm(fn)
        n = self._launch_count(fn)
        start = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(start, end):
            if host_ahead:
                self.host_ahead()
            if flush_l2:
                self._flush_l2()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return self._record([1e3 * s.elapsed_time(e) for s, e in zip(start, end)])

    def phases(self, first: Callable[[], object], second: Callable[[object], object]) -> tuple[float, float, float]:
        """(whole, first phase, second phase) of the call ``second(first())``, us, each the median over samples
        that time both phases of one call: plain launches with a cold L2 and the host ahead (device time) on CUDA,
        batches of back-to-back calls (wall time) elsewhere. Since each sample's phase is part of that sample's
        whole, no phase's median exceeds the whole's. ``Timer.last`` is the whole's spread."""
        def call():
            return second(first())

        self._warm(call)
        firsts, seconds = [], []
        if self.is_cuda:
            # Each sample waits behind its spin kernel: enough samples for a median, without seconds of spinning.
            n = min(self._launch_count(call), PHASE_SAMPLES)
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
            for e0, e1, e2 in events:
                self.host_ahead()
                self._flush_l2()
                e0.record()
                mid = first()
                e1.record()
                second(mid)
                e2.record()
            torch.cuda.synchronize(self.device)
            for e0, e1, e2 in events:
                firsts.append(1e3 * e0.elapsed_time(e1))
                seconds.append(1e3 * e1.elapsed_time(e2))
        else:
            calls = self._calls_for(call)
            for _ in range(self.batches):
                t_first = t_second = 0.0
                for _ in range(calls):
                    t0 = time.perf_counter()
                    mid = first()
                    synchronize(self.device)
                    t1 = time.perf_counter()
                    second(mid)
                    synchronize(self.device)
                    t2 = time.perf_counter()
                    t_first += t1 - t0
                    t_second += t2 - t1
                firsts.append(1e6 * t_first / calls)
                seconds.append(1e6 * t_second / calls)
        whole = Spread.of([a + b for a, b in zip(firsts, seconds)])
        parts = statistics.median(firsts), statistics.median(seconds)
        self.last = whole
        return whole.median, parts[0], parts[1]

    def _calls_for(self, fn: Callable[[], object]) -> int:
        """Calls per batch that fill ``rep_ms`` (one timed call decides; at most ``max_calls``)."""
        t0 = time.perf_counter()
        fn()
        synchronize(self.device)
        once = max(time.perf_counter() - t0, 1e-7)
        return max(1, min(self.max_calls, int(self.rep_ms * 1e-3 / once)))

    def wall(self, fn: Callable[[], object], calls: int | None = None) -> float:
        """Wall time per eager call: ``calls`` back-to-back calls then one synchronize (``calls`` None: as
        many as fill ``rep_ms``), median over ``batches`` batches."""
        self._warm(fn)
        if calls is None:
            calls = self._calls_for(fn)
        batches = []
        for _ in range(self.batches):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize(self.device)
            batches.append(1e6 * (time.perf_counter() - t0) / calls)
        return self._record(batches)

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
        """The physical limits of this run, measured on first use: copy bandwidth (B/s), graph node (us) and the
        L2 size (bytes; None off CUDA)."""
        if self._limits is None:
            self._limits = {"copy_bandwidth_Bps": self.copy_bandwidth(), "graph_node_us": self.graph_node_us(),
                            "l2_bytes": self.l2_bytes}
            if self.is_cuda:
                torch.cuda.empty_cache()
        return self._limits


def collective_graph_us(fn: Callable[[], object], group, device: torch.device, calls: int = 16,
                        replays: int = 10) -> float:
    """Per-call time (us) of ``fn``, a call that communicates over ``group``, on every rank of it: ``calls``
    back-to-back calls captured in one CUDA graph (a fixed count, not one sized by timing as ``Timer.graph`` does,
    so every rank captures the same collectives), the graph replayed ``replays`` times after a barrier, each
    replay timed with CUDA events. Returns the slowest rank's median: a collective ends with its last rank. A
    collective itself: call it on every rank with the same arguments."""
    import torch.distributed as dist

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm calls on a side stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    samples = []
    for i in range(replays + 1):
        dist.barrier(group=group, device_ids=[device.index])
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i:  # the first replay warms the graph's first launch
            samples.append(start.elapsed_time(end) * 1e3 / calls)
    slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    del graph
    return float(slowest.item())
