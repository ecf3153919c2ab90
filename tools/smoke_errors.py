"""Smoke check of the bad-input path on this machine's torch build (the ``errors`` stage of tools/gpu_run.sh).

Eager (CPU and, where present, CUDA) and at trace time (FakeTensor -> the C++ Meta kernel). Exit status 0 when
every call raised the expected ValueError. Run before the test suite, so that a crash there is diagnosed alone."""
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import k3_ops  # noqa: F401


def bad_call(p, b, w):
    return torch.ops.kimi_k3.attn_res(p, b, w, w, 9, 1e-6)  # K = 9 > capacity 8


def fake_call(p, b, w):
    with FakeTensorMode() as mode:
        return bad_call(mode.from_tensor(p), mode.from_tensor(b), mode.from_tensor(w))


def main() -> int:
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        p = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
        b = torch.randn(4, 8, 16, device=device, dtype=torch.bfloat16)
        w = torch.ones(16, device=device)
        for what, call in (("eager", bad_call), ("trace-time", fake_call)):
            try:
                call(p, b, w)
            except ValueError as e:
                print(f"{device} {what}: ValueError: {e}", flush=True)
            else:
                print(f"{device} {what}: no error raised", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
