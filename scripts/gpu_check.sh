#!/usr/bin/env bash
# The one prepared GPU check (benchmarks/gpu_check.py says what it runs and writes).
#
#   bash scripts/gpu_check.sh [--cpu] [--results-dir DIR] [--skip tests engine kernels]
#
# Uses the machine's own python (PYTHON=..., default python3) with torch, triton,
# transformers, safetensors, pytest, hypothesis, xxhash and sortedcontainers; needs no network
# and no `pip install` of this project: the checkout is imported through a temporary import
# root of symlinks (radixkv/ with kernels/ and benchmarks/ placed as radixkv.kernels and
# radixkv.benchmarks, as pyproject.toml maps them). The checkout's kernels/ must never be
# imported as a top-level `kernels` (transformers imports Hugging Face's package of that name,
# a dependency from transformers 5.25), so PYTHONSAFEPATH keeps the checkout itself off
# sys.path. (benchmarks/_common.py:import_root builds the same layout for bench serve
# --compare-code.) With CUDA: <= 8 minutes on one H100/H200, JSON in benchmarks/results/.
# Without CUDA: its CPU self-check (< 2 minutes), exit 0 when that passes.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
ROOT="$(mktemp -d "${TMPDIR:-/tmp}/radixkv-import-root.XXXXXX")"
trap 'rm -rf "$ROOT"' EXIT

mkdir "$ROOT/radixkv"
for entry in "$REPO"/radixkv/* ; do
    ln -s "$entry" "$ROOT/radixkv/$(basename "$entry")"
done
ln -s "$REPO/kernels" "$ROOT/radixkv/kernels"
ln -s "$REPO/benchmarks" "$ROOT/radixkv/benchmarks"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
cd "$REPO"
if ! "$PY" -c 'import torch, triton, transformers, xxhash, sortedcontainers, pytest' ; then
    echo "gpu_check: $PY lacks one of torch, triton, transformers, xxhash," \
         "sortedcontainers, pytest (set PYTHON=...)" >&2
    exit 2
fi
"$PY" -c 'import os, radixkv, radixkv.kernels, radixkv.benchmarks, sys
assert radixkv.__file__.startswith(sys.argv[1]), radixkv.__file__
try:
    import kernels
except ImportError:
    pass
else:
    if os.path.realpath(os.path.dirname(kernels.__file__ or "")) == os.path.realpath(sys.argv[2]):
        raise SystemExit("the checkout is importable as top-level `kernels`: " + kernels.__file__)' \
    "$ROOT" "$REPO/kernels"
# not exec: the EXIT trap removes the import root afterwards
"$PY" -m radixkv.benchmarks.gpu_check "$@"
