#!/usr/bin/env bash
# Static checks: ruff over the repository and mypy (strict) on radixkv/core, radixkv/tiers,
# radixkv/storage and radixkv/server, with the configuration in pyproject.toml. Exits non-zero
# if either fails.
#   bash scripts/lint.sh            # both
#   bash scripts/lint.sh ruff|mypy  # one
# Both are pinned in the dev extra (installed by scripts/dev.sh setup). `scripts/dev.sh test`
# (CI) runs ruff and mypy on the packages in its MYPY_PATHS (the same four).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${RADIXKV_VENV:-.venv}
what=${1:-all}
rc=0
for tool in ruff mypy; do
    [ "$what" = all ] || [ "$what" = "$tool" ] || continue
    if [ ! -x "$VENV/bin/$tool" ]; then
        echo "scripts/lint.sh: $tool is not installed in $VENV" \
             "(run: bash scripts/dev.sh setup)" >&2
        rc=1
        continue
    fi
    echo "== $tool" >&2
    case $tool in
        ruff) "$VENV/bin/ruff" check radixkv kernels benchmarks tests scripts || rc=1 ;;   # as dev.sh
        mypy) "$VENV/bin/mypy" || rc=1 ;;   # files and strictness: [tool.mypy] in pyproject
    esac
done
exit $rc
