"""Build k3_ops._C: the kimi_k3 schemas, Meta kernels and shared argument checks (C++), plus, where a CUDA
toolkit and a CUDA build of torch are present, the CUDA C++ kernels of csrc_cuda/ (the single-read backward).

No CUDA or Ascend toolkit is needed: without one this is a CPU-only C++ build and the device kernels are Triton,
registered from Python (the CUDA backward then uses its Triton kernels only). Build with torch already installed
and *without* build isolation (`pip install --no-build-isolation -e .`): an isolated build environment has no
torch to compile against, and letting pip fetch one there would pull a multi-GB CUDA build. Set
K3_OPS_NO_CUDA=1 to skip the CUDA sources even where they could build; TORCH_CUDA_ARCH_LIST picks the GPU
architectures (default: the visible GPUs'; the kernels need sm_80 or newer for cp.async). This file never runs
git or pip.
"""
import os
from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc_meta").glob("*.cpp"))
CUDA_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc_cuda").glob("*.c*"))
WITH_CUDA = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("K3_OPS_NO_CUDA") != "1"

if WITH_CUDA:
    # -Xptxas -v prints registers, shared memory and spills per kernel into the build log (tools/gpu_run.sh
    # shows them): a spill in the single-read kernel costs more than any tuning knob gains.
    extension = CUDAExtension(
        "k3_ops._C",
        SOURCES + CUDA_SOURCES,
        define_macros=[("K3_WITH_CUDA", None)],
        extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3", "-lineinfo", "-Xptxas", "-v"]},
    )
else:
    extension = CppExtension("k3_ops._C", SOURCES, extra_compile_args=["-O2"])

setup(
    packages=find_packages(include=["k3_ops", "k3_ops.*"]),
    ext_modules=[extension],
    # Ninja (when installed) compiles the sources in parallel; without it BuildExtension falls back to setuptools.
    cmdclass={"build_ext": BuildExtension},
)
