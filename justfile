# cache-family-bench recipes. `./bootstrap RECIPE` sets up .venv first, then runs `just RECIPE`.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := justfile_directory() / ".venv/bin"

# List the recipes.
default:
    @{{just_executable()}} --list --justfile {{justfile()}}

# --- demo -------------------------------------------------------------------

# Run the main job end to end on the embedded default (tiny model zoo, real llama-server).
[group('demo')]
demo *OUT: native-parts
    {{venv}}/python -m cache_family.oracles.demo {{OUT}}

# --- checks -----------------------------------------------------------------

# Run the whole test suite (builds or reuses the cached llama-server and model zoo first).
[group('checks')]
test *ARGS: native-parts
    {{venv}}/python -m pytest {{ARGS}}

# Run the suite without building first: native tests use cached parts, or skip (with a reason) when absent.
[group('checks')]
test-fast *ARGS:
    CACHE_FAMILY_SKIP_NATIVE=1 {{venv}}/python -m pytest {{ARGS}}

# Lint: ruff over src and tests, mypy --strict over src.
[group('checks')]
lint:
    {{venv}}/ruff check src tests bench
    {{venv}}/ruff format --check src
    {{venv}}/mypy --strict src/

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

# --- operator ---------------------------------------------------------------

# Pass arguments verbatim to the cache-family command (operator-guide spelling).
[group('operator')]
[positional-arguments]
automation-run *ARGS:
    {{venv}}/cache-family "$@"

# --- docs -------------------------------------------------------------------

# Regenerate README.md's operator input reference from the schema.
[group('docs')]
readme-fields:
    {{venv}}/python scripts/gen_readme_fields.py

# Regenerate docs/state-machines.md from the cell and row tables.
[group('docs')]
docs:
    {{venv}}/python scripts/gen_state_machine_doc.py
