#!/usr/bin/env bash
# Both matrices and their combined README tables: scripts/skippy-cache-family-bench.sh [OUTPUT_DIR]
# The sequence and its environment contract are defined once, in `cache-family bench`
# (src/cache_family/console/bench_sequence.py; README "The wrapper"); this script only sets up .venv
# the way every other entry point does and hands over, so both read the same variables.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
status=0
"$root/bootstrap" --install-only >&2 || status=$?
if [ "$status" -ne 0 ]; then
    echo "bench: failed: setting up $root/.venv (bootstrap exited $status)" >&2
    echo "bench: evidence: the bootstrap lines above; $root/.venv" >&2
    echo "bench: next: fix what bootstrap names, check with $root/bootstrap --install-only, rerun" >&2
    exit "$status"
fi
exec "$root/.venv/bin/python" -m cache_family.cli bench "$@"
