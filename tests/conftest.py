"""Shared fixtures. Keep this file small and generic; each fixture says what it costs."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from cache_family.errors import Refused
from cache_family.oracles.native_parts import SKIP_NATIVE_ENV, Parts, ensure_parts


@pytest.fixture(scope="session")
def native_parts() -> Parts:
    """The real llama-server build and the tiny model zoo (see ``oracles/native_parts.py``).

    Never compiles: a missing build fails the test (``just test`` builds it first through
    ``just native-parts``), except under ``CACHE_FAMILY_SKIP_NATIVE=1``, where it is skipped
    with the reason. The zoo is written on first use (about 2 s) and reused afterwards.
    """
    try:
        return ensure_parts(sys.stderr, build=False)
    except Refused as refused:
        if os.environ.get(SKIP_NATIVE_ENV) == "1" and "native.build_absent" in refused.codes:
            pytest.skip(f"{SKIP_NATIVE_ENV}=1 and {refused.refusals[0].message}")
        pytest.fail(f"the real parts are missing: {refused}", pytrace=False)


@pytest.fixture(scope="session")
def oracle_tools(native_parts: Parts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The native build and the reference workload oracles installed as an operator names
    them (``OUTPUT/native``, ``OUTPUT/cargo/debug/{skippy,skippy-correctness,...}``): a copy
    of the cached build (about a second), once per session. Needs the real parts."""
    from cache_family.oracles import native_build

    out = tmp_path_factory.mktemp("oracle-tools")
    native_build.install(out, io.StringIO(), tools=True)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out ``@pytest.mark.long`` tests unless the ``-m`` expression names ``long``
    (``just fuzz-long``): a plain run, or ``-m "not native"``, never pays for them."""
    if "long" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("long") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(scope="session")
def demo_standard(native_parts: Parts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real ``./bootstrap demo`` (its default plan: every zoo family in both matrices, one
    use case; the wrapper's whole sequence, report-run and replay; 8 to 14 minutes on the
    loaded 2-core host), shared by the tests that read a real run. Returns its output dir."""
    from cache_family.oracles.demo import PLANS, run_demo

    out = tmp_path_factory.mktemp("demo-standard") / "demo"
    progress, stdout = io.StringIO(), io.StringIO()
    code = run_demo(out, progress, plan=PLANS["standard"], stdout=stdout)
    assert code == 0, progress.getvalue()
    (out / "demo-stdout.txt").write_text(stdout.getvalue())
    (out / "demo-stderr.txt").write_text(progress.getvalue())
    return out
