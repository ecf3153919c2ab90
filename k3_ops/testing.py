"""Numerical comparison helpers shared by the tests, the main job and the benchmark.

Errors are always reported as max-abs, mean-abs and relative RMS against a float64 truth, plus where
NaNs disagree, because a bare "not close" tells a kernel author nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ErrorStats", "error_stats", "assert_close", "assert_accuracy_contract"]


@dataclass(frozen=True)
class ErrorStats:
    max_abs: float
    mean_abs: float
    rel_rms: float
    nan_mismatch: int  # positions where exactly one side is NaN

    def __str__(self) -> str:
        return (f"max_abs={self.max_abs:.3e} mean_abs={self.mean_abs:.3e} rel_rms={self.rel_rms:.3e}"
                f" nan_mismatch={self.nan_mismatch}")


def error_stats(actual: torch.Tensor, truth: torch.Tensor) -> ErrorStats:
    """Error of ``actual`` against ``truth`` computed in float64 on the CPU (NaN pairs are excluded)."""
    a = actual.detach().to("cpu", torch.float64)
    t = truth.detach().to("cpu", torch.float64)
    if a.shape != t.shape:
        raise ValueError(f"shapes differ: actual {tuple(a.shape)} vs truth {tuple(t.shape)}")
    a_nan, t_nan = a.isnan(), t.isnan()
    both = ~(a_nan | t_nan)
    diff = (a - t)[both].abs()
    ref = t[both]
    if diff.numel() == 0:
        return ErrorStats(0.0, 0.0, 0.0, int((a_nan ^ t_nan).sum()))
    rms_ref = ref.square().mean().sqrt().item()
    rel_rms = diff.square().mean().sqrt().item() / rms_ref if rms_ref > 0 else diff.square().mean().sqrt().item()
    return ErrorStats(diff.max().item(), diff.mean().item(), rel_rms, int((a_nan ^ t_nan).sum()))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, what: str = "") -> None:
    """Like torch.testing.assert_close, but the message always carries the error statistics."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    stats = error_stats(actual, expected)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    ok = torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[:3].tolist()
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} elements differ "
                             f"(atol={atol}, rtol={rtol}); {stats}; first at {bad}")


def assert_accuracy_contract(kernel_out: torch.Tensor, eager_out: torch.Tensor, truth: torch.Tensor, *,
                             factor: float = 1.25, what: str = "") -> tuple[ErrorStats, ErrorStats]:
    """The kernels' accuracy contract: max-abs and mean-abs errors against the float64 truth are each at
    most ``factor`` times those of the FP32 eager formula rounded to the same output dtype."""
    k, e = error_stats(kernel_out, truth), error_stats(eager_out, truth)
    if k.nan_mismatch or e.nan_mismatch:
        raise AssertionError(f"{what}: NaN positions differ from the truth (kernel {k}, eager {e})")
    # A tiny absolute floor keeps exact-zero eager errors (e.g. K = 0 copies) from demanding exactness
    # beyond representability; it is far below one ulp of any output dtype at the tested magnitudes.
    floor = 1e-12
    if k.max_abs > factor * e.max_abs + floor or k.mean_abs > factor * e.mean_abs + floor:
        raise AssertionError(f"{what}: kernel error exceeds {factor}x eager: kernel {k}; eager {e}")
    return k, e
