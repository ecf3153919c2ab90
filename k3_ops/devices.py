"""The devices the command lines take (``--device`` of ``python -m k3_ops`` and ``python -m k3_ops.bench``): which
one is best here, and, for a device asked for by name, what this machine lacks to run on it.

A command asked for a device it cannot use ends with one line naming what is missing and how to get it (exit
status 2, as argparse's own errors), not with the traceback torch raises on first use (``Expected one of cpu,
cuda, ... device type at start of device string: npu``, ``Torch not compiled with CUDA enabled``).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

__all__ = ["DEVICE_TYPES", "DEVICE_HELP", "best_device", "device_arg", "unavailable", "require"]

#: What ``--device`` takes, with an optional index (``cuda:1``).
DEVICE_TYPES = ("cpu", "cuda", "npu")
#: The ``--device`` help both commands print, so that they say the same.
DEVICE_HELP = "cpu, cuda or npu, with an optional index (cuda:1) (default: the best present: CUDA, an NPU, else cpu)"


def best_device() -> torch.device:
    """CUDA when a GPU is visible, else an Ascend NPU (where the user's setup imported torch_npu), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    npu = getattr(torch, "npu", None)  # present only once torch_npu has been imported (or autoloaded by torch)
    if npu is not None and npu.is_available():
        return torch.device("npu")
    return torch.device("cpu")


def device_arg(text: str) -> str:
    """``--device``'s argparse type: ``cpu``, ``cuda`` or ``npu``, each with an optional ``:index``. Parsed here, not by
    ``torch.device``: torch knows ``npu`` only once torch_npu is imported, and would reject it with a traceback."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES or (index and not index.isdigit()) or (not index and text.endswith(":")):
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DEVICE_TYPES)} with an optional index (cuda:1), "
                                         f"got {text!r}")
    return text


def _npu_problem() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as e:  # noqa: BLE001 - torch_npu fails in many ways without the Ascend runtime (CANN)
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return f"torch_npu does not import ({type(e).__name__}{': ' + first if first else ''})"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "torch_npu imports but sees no NPU (torch.npu.is_available() is False)"
    return None


def unavailable(device: str) -> str | None:
    """None where ``device`` (``device_arg``'s form) can run here, else what is missing and how to get it, in one
    line."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        if torch.version.cuda is None:
            found = f"this torch ({torch.__version__}) is a CPU-only build"
        elif not torch.cuda.is_available():
            found = "torch.cuda.is_available() is False (no GPU visible: check the driver and CUDA_VISIBLE_DEVICES)"
        elif index and int(index) >= torch.cuda.device_count():
            found = f"only {torch.cuda.device_count()} CUDA device(s) visible"
        else:
            return None
        return (f"--device {device} needs an NVIDIA GPU and a CUDA build of torch (install your CUDA build of torch "
                f"first, see README \"Set up and run\"); {found}")
    if kind == "npu":
        found = _npu_problem()
        if found is None and index and int(index) >= torch.npu.device_count():
            found = f"only {torch.npu.device_count()} NPU(s) visible"
        if found is None:
            return None
        return (f"--device {device} needs torch_npu and an Ascend NPU (pip install torch_npu matching torch "
                f"{torch.__version__.split('+')[0]}; see README \"Supported versions and devices\"); {found}")
    return None


def require(device: str, prog: str) -> None:
    """End the command ``prog`` (exit status 2, one line on stderr) where ``device`` cannot run here."""
    problem = unavailable(device)
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        raise SystemExit(2)
