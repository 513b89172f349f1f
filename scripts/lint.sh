#!/usr/bin/env bash
# Static checks: ruff over the repository and mypy (strict) on radixkv/core, radixkv/tiers and
# radixkv/storage, with the configuration in pyproject.toml. Exits non-zero if either fails.
#   bash scripts/lint.sh            # both
#   bash scripts/lint.sh ruff|mypy  # one
# Needs ruff and mypy in the venv (`.venv/bin/python -m pip install ruff mypy`).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${RADIXKV_VENV:-.venv}
what=${1:-all}
rc=0
for tool in ruff mypy; do
    [ "$what" = all ] || [ "$what" = "$tool" ] || continue
    if [ ! -x "$VENV/bin/$tool" ]; then
        echo "scripts/lint.sh: $tool is not installed in $VENV" \
             "(run: $VENV/bin/python -m pip install ruff mypy)" >&2
        rc=1
        continue
    fi
    echo "== $tool" >&2
    case $tool in
        ruff) "$VENV/bin/ruff" check radixkv benchmarks kernels tests scripts || rc=1 ;;
        mypy) "$VENV/bin/mypy" || rc=1 ;;   # files and strictness: [tool.mypy] in pyproject
    esac
done
exit $rc
