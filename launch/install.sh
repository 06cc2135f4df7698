#!/usr/bin/env bash
# Install dragon and everything it needs on a fresh machine (Python 3.11 + pip).
# torch is pinned and installed first: anything that asks for an unpinned torch (including a
# build-isolation environment) would otherwise pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip setuptools wheel
python -m pip install --quiet torch==2.13.0
# DeepSpeed builds from source; without build isolation it sees the torch above. No ops are
# compiled at install; the few used on CPU compile on first use (cached).
DS_BUILD_OPS=0 python -m pip install --quiet --no-build-isolation deepspeed==0.19.8
python -m pip install --quiet -e ".[test]"
python -c "import dragon, deepspeed, torch; print(f'dragon ready: torch {torch.__version__}, deepspeed {deepspeed.__version__}')"
