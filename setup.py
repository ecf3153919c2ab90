"""Build k3_ops._C: the kimi_k3 schemas, Meta kernels and shared argument checks (C++, CPU only).

No CUDA or Ascend toolkit is needed: device kernels are Triton, registered from Python. Build with
torch already installed and *without* build isolation (`pip install --no-build-isolation -e .`):
an isolated build environment has no torch to compile against, and letting pip fetch one there
would pull a multi-GB CUDA build. This file never runs git or pip.
"""
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc_meta").glob("*.cpp"))

setup(
    packages=find_packages(include=["k3_ops", "k3_ops.*"]),
    ext_modules=[
        CppExtension(
            "k3_ops._C",
            SOURCES,
            extra_compile_args=["-O2"],
        )
    ],
    # Ninja (when installed) compiles the sources in parallel; without it BuildExtension falls back to setuptools.
    cmdclass={"build_ext": BuildExtension},
)
