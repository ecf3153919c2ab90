"""setup.py's GPU-architecture choice (a pure function, so CI tests it without nvcc or a GPU), and that importing
setup.py builds nothing and that it never shells out (no git, no pip)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import setuptools

SETUP_PY = Path(__file__).resolve().parents[1] / "setup.py"


@pytest.fixture(scope="module")
def setup_module():
    calls = []
    real = setuptools.setup
    setuptools.setup = lambda *a, **k: calls.append(1)  # a build would call it; an import must not
    try:
        spec = importlib.util.spec_from_file_location("k3_ops_setup_under_test", SETUP_PY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        setuptools.setup = real
    assert calls == [], "importing setup.py ran setup()"
    return module


@pytest.mark.parametrize("env, caps, cuda, expected", [
    (None, [], "13.0", "8.0;9.0;10.0+PTX"),  # an image build host: nvcc 13, no GPU, nothing set
    ("", [], "12.8", "8.0;9.0;10.0+PTX"),  # an empty variable counts as unset
    ("  ", [], "12.6", "8.0;9.0+PTX"),  # before 12.8 nvcc does not know sm_100
    (None, [], "11.8", "8.0;9.0+PTX"),
    (None, [], "12.10", "8.0;9.0;10.0+PTX"),  # compared as versions, not strings ("12.10" < "12.8" as strings)
    ("9.0a", [], "13.0", None),  # the user's list wins
    (None, [(9, 0)], "13.0", None),  # a visible GPU: torch builds for it
    ("8.0", [(8, 0), (9, 0)], "12.4", None),
], ids=["nvcc13-no-gpu", "empty-env", "blank-env-cuda12.6", "cuda11.8", "cuda12.10", "user-list", "visible-gpu",
        "both"])
def test_cuda_arch_list(setup_module, env, caps, cuda, expected):
    assert setup_module.cuda_arch_list(env, caps, cuda) == expected


def test_default_list_covers_the_documented_architectures(setup_module):
    archs = setup_module.cuda_arch_list(None, [], "13.0").replace("+PTX", "").split(";")
    assert {"8.0", "9.0"} <= set(archs) and archs == sorted(archs, key=lambda a: tuple(map(int, a.split("."))))


def test_setup_py_never_runs_git_or_pip():
    source = SETUP_PY.read_text()
    assert not re.search(r"\b(subprocess|os\.system|popen|check_output)\b", source), "setup.py must not shell out"
    assert not re.search(r"[\"']git[\"']|[\"']pip[\"']", source)
