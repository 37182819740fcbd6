# cache-family-bench recipes. `./bootstrap RECIPE` sets up .venv first, then runs `just RECIPE`.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := justfile_directory() / ".venv/bin"

# List the recipes.
default:
    @{{just_executable()}} --list --justfile {{justfile()}}

# --- demo -------------------------------------------------------------------

# The mission end to end on the tiny model zoo: the wrapper's sequence, report-run, replay ([--quick|--full] [--quiet] [OUT]).
[group('demo')]
demo *ARGS: native-parts
    {{venv}}/python -m cache_family.oracles.demo {{ARGS}}

# --- checks -----------------------------------------------------------------

# Lint, then run the whole test suite (builds or reuses the cached llama-server and model zoo first).
[group('checks')]
test *ARGS: lint native-parts browser
    {{venv}}/python -m pytest {{ARGS}}

# Run the suite without building first: native tests use cached parts, or skip (with a reason) when absent.
[group('checks')]
test-fast *ARGS:
    CACHE_FAMILY_SKIP_NATIVE=1 {{venv}}/python -m pytest {{ARGS}}

# Run the whole suite three times in a row with a CPU hog on every core: no test may depend on scheduling.
[group('checks')]
test-stress *ARGS: native-parts browser
    #!/usr/bin/env bash
    set -euo pipefail
    hogs=()
    for _ in $(seq "$(nproc)"); do (while :; do :; done) & hogs+=("$!"); done
    trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
    for run in 1 2 3; do
        echo "test-stress: run $run of 3 with $(nproc) busy loops beside it" >&2
        {{venv}}/python -m pytest -q {{ARGS}}
    done

# The long fuzz: 2,500 mutated documents of each kind (operator, prepared input, corpus, report), 10,000 in all.
[group('checks')]
fuzz-long *ARGS:
    CACHE_FAMILY_SKIP_NATIVE=1 {{venv}}/python -m pytest -m long -s -q -p no:cacheprovider tests/project/test_fuzz_long.py {{ARGS}}

# Regenerate docs/fault-matrix.md from the fault table in tests/project/test_fault_matrix.py.
[group('docs')]
fault-matrix-doc:
    PYTHONPATH=tests/support {{venv}}/python tests/project/test_fault_matrix.py > docs/fault-matrix.md.tmp
    mv docs/fault-matrix.md.tmp docs/fault-matrix.md

# Lint: ruff (check and format) over src, tests and bench, mypy --strict over src, the layer contracts.
[group('checks')]
lint:
    {{venv}}/ruff check src tests bench
    {{venv}}/ruff format --check src tests bench
    {{venv}}/mypy --strict src/
    {{venv}}/lint-imports --no-cache

# Format the code in place.
[group('checks')]
fmt:
    {{venv}}/ruff format src tests bench
    {{venv}}/ruff check --fix src tests bench

# --- native parts -------------------------------------------------------------

# Build llama-server into OUTPUT/native (cached) and the reference oracles into OUTPUT/cargo/debug.
[group('native')]
skippy-workload-oracles-build OUTPUT:
    {{venv}}/python -m cache_family.oracles.native_build "{{OUTPUT}}"

# Build (or reuse) the real parts the tests use: llama-server and the tiny model zoo.
[group('native')]
native-parts:
    {{venv}}/python -m cache_family.oracles.native_parts

# Install Debian's chromium for the browser test of report.html when missing (root only; never fails).
[group('native')]
browser:
    #!/bin/sh
    command -v chromium >/dev/null 2>&1 && exit 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "browser: installing Debian's chromium for the report.html browser test" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
            && exit 0
        echo "browser: WARNING: chromium could not be installed; the browser test of report.html WILL BE SKIPPED" >&2
    else
        echo "browser: WARNING: chromium is missing and this is not root; the browser test of report.html WILL BE SKIPPED" >&2
    fi

# --- operator ---------------------------------------------------------------

# Pass arguments verbatim to the cache-family command (operator-guide spelling).
[group('operator')]
[positional-arguments]
automation-run *ARGS:
    {{venv}}/cache-family "$@"

# --- setup ------------------------------------------------------------------

# Re-resolve requirements.lock from PyPI (versions + hashes, Python 3.11 linux x86_64); `just lock --upgrade` moves pins.
[group('setup')]
lock *ARGS:
    {{venv}}/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], "pip", sep="\n")' \
        | {{venv}}/uv pip compile pyproject.toml - --extra dev --generate-hashes \
            --python-version 3.11 --python-platform x86_64-unknown-linux-gnu \
            --custom-compile-command "just lock" --output-file requirements.lock --quiet {{ARGS}}

# --- docs -------------------------------------------------------------------

# Regenerate README.md's operator input reference from the schema.
[group('docs')]
readme-fields:
    {{venv}}/python scripts/gen_readme_fields.py

# Regenerate docs/state-machines.md from the cell and row tables.
[group('docs')]
docs:
    {{venv}}/python scripts/gen_state_machine_doc.py

# --- bench ------------------------------------------------------------------

# Install the peer harnesses (AIPerf 0.13, GuideLLM 0.8 with CPU torch) into bench/.venv-* and write their offline tokenizer.
[group('bench')]
bench-peers-install:
    #!/usr/bin/env bash
    set -euo pipefail
    cd "{{justfile_directory()}}/bench"
    install() {
        local venv="$1"; shift
        # The project's interpreter (Python 3.11) makes the peers' environments too.
        [ -x "$venv/bin/python" ] || "{{venv}}/python" -m venv "$venv"
        "$venv/bin/python" -m pip install -q -c peers-constraints.txt "$@"
    }
    install .venv-aiperf "aiperf==0.13.*"
    install .venv-guidellm "guidellm==0.8.*" "torch==2.13.0"
    # A CUDA torch would be a silent 6 GB detour: refuse any nvidia-* package.
    .venv-guidellm/bin/python -c 'import importlib.metadata as m, sys; gpu = sorted(d.metadata["Name"] for d in m.distributions() if d.metadata["Name"].lower().startswith("nvidia-")); sys.exit(f"bench-peers-install: CUDA packages in .venv-guidellm: {gpu}") if gpu else None'
    {{venv}}/python peer_tokenizer.py .peer-tokenizer

# Issue 13's benchmarks in one run, one target table, recorded in bench/RESULTS.md (--only fidelity,overhead,pins,journal,million,calibration; --quick --no-record: a smoke).
[group('bench')]
[positional-arguments]
bench-harness *ARGS:
    {{venv}}/python bench/harness.py "$@"

# Journal and replay at scale: appends/s, durable/s and replay lines/s against plain write loops, and a 1M-request cell's time and peak RSS (--append records them in bench/RESULTS.md).
[group('bench')]
[positional-arguments]
bench-journal *ARGS:
    {{venv}}/python bench/journal_bench.py "$@"

# A 1,000,000-request cell through the journal, the fold (rows to requests.jsonl), publication and replay: time and peak RSS of each (--append records them in bench/RESULTS.md).
[group('bench')]
[positional-arguments]
bench-million-cell *ARGS:
    {{venv}}/python bench/million_cell.py "$@"

# Pin cost per cell for a 100 GiB sparse multi-shard model: identity checks against full re-hashes (--append records them in bench/RESULTS.md).
[group('bench')]
[positional-arguments]
bench-pins *ARGS:
    {{venv}}/python bench/pins_bench.py "$@"
