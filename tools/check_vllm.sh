#!/usr/bin/env bash
# Check k3_ops against a real vLLM 0.33.0 install: the tests marked `vllm` (tests/test_vllm_real.py): plugin load
# through vLLM's own loader, both drop-ins against vLLM's own Kimi K3 kernels (run on CPU by the Triton
# interpreter), and a toy K3 stack under vLLM's compilation. Not part of CI (vLLM with its torch is ~9 GB); run it
# before changing the vLLM integration, and record the result in docs/integration.md.
#
#   tools/check_vllm.sh [-h|--help] [-n|--dry-run] [pytest arguments]
#
# K3_OPS_VLLM_VENV picks the side venv (default: .venv-vllm in the repository root), created with vllm==0.33.0
# (which pins torch 2.14.0) on first use and reused afterwards. k3_ops is built into it from a copy of the sources
# (K3_OPS_NO_CUDA=1: the C++ checks and Meta kernels only), so the tree's own k3_ops/_C build, made against another
# torch, is left alone. --dry-run prints the venv, the install and the pytest command, and installs nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${K3_OPS_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION=0.33.0

case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  -n|--dry-run)
    shift
    echo "venv: $VENV ($([ -x "$VENV/bin/python" ] && echo exists || echo "to create"))"
    echo "install: vllm==$VLLM_VERSION pytest expecttest numpy setuptools wheel packaging; k3_ops from a copy (K3_OPS_NO_CUDA=1)"
    echo "run: TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= K3_OPS_EXPECT_VLLM=1 $VENV/bin/pytest -m vllm -p no:cacheprovider -ra tests/test_vllm_real.py $*"
    exit 0 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "vllm==$VLLM_VERSION" pytest expecttest numpy 'setuptools>=77' wheel packaging
"$VENV/bin/python" - "$VLLM_VERSION" <<'PY'
import importlib.metadata, sys
from packaging.version import Version
have = Version(importlib.metadata.version("vllm"))
if have != Version(sys.argv[1]):
    sys.exit(f"check_vllm.sh: the side venv has vllm {have}, this check is for {sys.argv[1]}")
PY

# Build and install k3_ops from a copy of its sources (an in-tree build would share build/ and k3_ops/_C*.so with
# the main environment's torch).
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
cp -r "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/csrc_meta" "$ROOT/csrc_cuda" "$SRC/"
mkdir "$SRC/k3_ops"
(cd "$ROOT/k3_ops" && find . -name '*.py' -print0 | xargs -0 -I{} cp --parents {} "$SRC/k3_ops/")
K3_OPS_NO_CUDA=1 "$VENV/bin/pip" install -q --no-build-isolation --no-deps --force-reinstall "$SRC"

# The tests import the installed k3_ops: run pytest's console script (it does not put the working directory on
# sys.path, which would shadow the install with the source tree). No GPU here: vLLM's Triton kernels and k3_ops's
# run on CPU tensors under the interpreter.
cd "$ROOT"
export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= K3_OPS_EXPECT_VLLM=1
"$VENV/bin/pytest" -m vllm -p no:cacheprovider -ra tests/test_vllm_real.py "$@"
