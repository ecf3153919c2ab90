"""Build k3_ops._C: the kimi_k3 schemas, Meta kernels and shared argument checks (C++), plus, where a CUDA
toolkit and a CUDA build of torch are present, the CUDA C++ of csrc_cuda/ (the single-read backward, the cluster and
streaming forwards, the launch cache). The toolkit needs nvcc and the CUDA runtime's headers only (no cuBLAS,
cuSPARSE or cuSOLVER headers: the sources include c10's CUDA headers, not ATen/cuda/CUDAContext.h).

No CUDA or Ascend toolkit is needed: without one this is a CPU-only C++ build and the device kernels are Triton,
registered from Python (the CUDA backward then uses its Triton kernels only). Build with torch already installed
and *without* build isolation (`pip install --no-build-isolation -e .`): an isolated build environment has no
torch to compile against, and letting pip fetch one there would pull a multi-GB CUDA build. Set
K3_OPS_NO_CUDA=1 to skip the CUDA sources even where they could build.

GPU architectures: TORCH_CUDA_ARCH_LIST when set; else the visible GPUs' (torch's own choice); else, on a build
host with a CUDA toolkit but no visible GPU (an image build), DEFAULT_CUDA_ARCHS (see ``cuda_arch_list``) instead
of torch's IndexError. The kernels need sm_80 or newer (cp.async). This file never runs git or pip, and importing
it builds nothing (``setup()`` runs only as the build script).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from packaging.version import Version
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc_meta").glob("*.cpp"))
CUDA_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc_cuda").glob("*.c*"))
WITH_CUDA = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("K3_OPS_NO_CUDA") != "1"

#: Built for when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset: sm_80 (A100; the kernels' floor) and sm_90
#: (H100 / H200, where they are tuned), plus sm_100 (B200 / GB200) with a CUDA 12.8+ toolkit, which is the first
#: to know it. The newest entry also carries PTX, so later GPUs JIT-compile it.
DEFAULT_CUDA_ARCHS = ("8.0", "9.0")
BLACKWELL_CUDA = Version("12.8")


def cuda_arch_list(env_value: str | None, visible_capabilities: Sequence[tuple[int, int]],
                   cuda_version: str | None) -> str | None:
    """The TORCH_CUDA_ARCH_LIST to build with, or None to leave torch's choice alone.

    env_value: the user's TORCH_CUDA_ARCH_LIST (kept whenever set). visible_capabilities: (major, minor) of each
    visible GPU (torch builds for those). cuda_version: torch.version.cuda. Only with neither does it return the
    default list, e.g. "8.0;9.0;10.0+PTX" for CUDA 12.8 and later, "8.0;9.0+PTX" before.
    """
    if (env_value and env_value.strip()) or visible_capabilities:
        return None
    archs = list(DEFAULT_CUDA_ARCHS)
    if cuda_version and Version(cuda_version) >= BLACKWELL_CUDA:
        archs.append("10.0")
    return ";".join(archs) + "+PTX"


def _visible_capabilities() -> list[tuple[int, int]]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def _extension():
    if not WITH_CUDA:
        return CppExtension("k3_ops._C", SOURCES, extra_compile_args=["-O2"])
    archs = cuda_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"), _visible_capabilities(), torch.version.cuda)
    if archs is not None:
        # torch reads the variable when it computes the nvcc flags, inside build_ext.
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        print(f"k3_ops: no GPU visible and TORCH_CUDA_ARCH_LIST unset: building for {archs}")
    # -Xptxas -v prints registers, shared memory and spills per kernel into the build log (tools/gpu_run.sh keeps
    # it as build.log): a spill in the single-read kernel costs more than any tuning knob gains.
    return CUDAExtension(
        "k3_ops._C",
        SOURCES + CUDA_SOURCES,
        define_macros=[("K3_WITH_CUDA", None)],
        extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3", "-lineinfo", "-Xptxas", "-v"]},
    )


if __name__ == "__main__":  # the build script (setuptools runs it so); a plain import only defines the above
    setup(
        packages=find_packages(include=["k3_ops", "k3_ops.*"]),
        ext_modules=[_extension()],
        # Ninja (when installed) compiles the sources in parallel; without it BuildExtension falls back to setuptools.
        cmdclass={"build_ext": BuildExtension},
    )
