"""Helpers several test modules share (they were in test_run_budgets.py)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
import trio
import trio.testing
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner, fake_opener, hasher
from hub_fixture import build_toolbox, operator_document

from cache_family.actors.prepare.admission import admit
from cache_family.actors.prepare.worker import observe
from cache_family.actors.run.context import HostSettings
from cache_family.actors.run.matrix import (
    MatrixOutcome,
    admit_run,
    supervise,
)
from cache_family.console.progress import (
    RunProgress,
)
from cache_family.schemas.catalog import packaged_catalog
from cache_family.schemas.journal import (
    JournalLine,
    read_journal,
)
from cache_family.schemas.matrix import (
    MATRIX_FILENAME,
    decode_matrix,
)
from cache_family.schemas.prepared import (
    PreparationRequest,
    encode_document,
)
from cache_family.schemas.receipts import (
    decode_cell_receipt,
    decode_row_receipt,
)
from cache_family.system.pins import Budget

HERE = Path(__file__).parent


FAKE_SERVER = HERE / "fake_hosts" / "fake_run_llama_server.py"


FAKE_CORRECTNESS = HERE / "fake_hosts" / "fake_correctness_tool.py"


SERIAL = "cell-0000/native-serial"


CONCURRENT = "cell-0000/native-concurrent"


@contextmanager
def thread_aware_autojump() -> Iterator[trio.testing.MockClock]:
    """trio's autojump clock, held still while a worker thread runs.

    The journal writer and receipt publication use worker threads, which take real time; a
    plain autojump clock sees the run loop idle meanwhile and jumps to the next deadline (the
    run's own execution deadline), which no real run would ever do. Autojump is switched off
    while any ``trio.to_thread.run_sync`` call is in flight and back on when none is.
    """
    clock = trio.testing.MockClock(autojump_threshold=0)
    real_run_sync = trio.to_thread.run_sync
    in_flight = 0

    async def counted_run_sync(*args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight
        in_flight += 1
        clock.autojump_threshold = math.inf
        try:
            return await real_run_sync(*args, **kwargs)
        finally:
            in_flight -= 1
            if in_flight == 0:
                clock.autojump_threshold = 0

    with mock.patch.object(trio.to_thread, "run_sync", counted_run_sync):
        yield clock


@pytest.fixture
def autojump_clock() -> Iterator[trio.testing.MockClock]:
    """The thread-aware autojump clock as the test's trio clock (pytest-trio's fixture name)."""
    with thread_aware_autojump() as clock:
        yield clock


class _SilentEvents:
    def emit(self, **event: object) -> None:
        del event

    def phase(self, text: str) -> None:
        del text

    clock = staticmethod(lambda: 0.0)


def make_prepared(
    root: Path,
    *,
    keys: Sequence[str] = ("qwen3_dense",),
    top: dict[str, object] | None = None,
    **plan: object,
) -> Path:
    """Prepare (for real: pins, plan, profiles) a run input whose native server is the FAKE
    ``fake_run_llama_server.py``; returns the path of ``cache-family-input.json``."""
    root.mkdir(parents=True, exist_ok=True)
    box = build_toolbox(root, list(keys))
    server = root / "tools" / "fake-llama-server"
    server.write_text(fake_server_launcher(server))
    server.chmod(0o755)
    correctness = root / "tools" / "fake-skippy-correctness"
    shutil.copy(FAKE_CORRECTNESS, correctness)
    correctness.chmod(0o755)
    plan = {"concurrency": [1, 2], "concurrent_requests": 2, "llama_repeats": 3, **plan}
    document = operator_document(box, **plan)
    document["native_server"] = str(server)
    document["correctness"] = str(correctness)
    document.update(top or {})
    operator = root / "operator.json"
    operator.write_text(json.dumps(document))
    admission = admit(
        "prepare-full", str(operator), str(root / "unused"), [], environ={"PATH": "/usr/bin:/bin"}
    )
    request = PreparationRequest(
        schema_version=1,
        mode=admission.mode,
        operator=admission.operator,
        corpus_source=admission.corpus_source,
        worker_budget_ms=60_000,
    )
    prepared = observe(request, Budget.seconds(60), _SilentEvents())  # type: ignore[arg-type]
    path = root / "cache-family-input.json"
    path.write_bytes(encode_document(prepared))
    return path


def fake_server_launcher(server: Path, *, before: str = "") -> str:
    """The FAKE llama-server as the run sees it: a launcher script (the pinned "binary") that
    runs ``fake_run_llama_server.py`` with its behaviour file, named by absolute path so that
    the private copy the run executes finds it too. ``before``: shell run first."""
    behaviour = f"{server}.behaviour.json"
    return (
        f"#!/bin/sh\n{before}"
        f"FAKE_LLAMA_BEHAVIOUR='{behaviour}' exec {sys.executable} {FAKE_SERVER} \"$@\"\n"
    )


async def run(
    input_path: Path,
    out: Path,
    script: FakeHostScript,
    *,
    pins: Any = None,
    host_opener: Any = None,
    progress_stream: io.StringIO | None = None,
    child_runner: Any = None,
    progress: RunProgress | None = None,
) -> MatrixOutcome:
    admitted = admit_run(str(input_path), str(out))
    os.mkdir(admitted.output)
    hosts = HostSettings(
        host_opener=host_opener or fake_opener(script),
        pin_hasher=pins or hasher(),
        # A fake hasher answers by call, not by bytes: it must see every verification.
        row_pins=None,
        child_runner=child_runner or fake_child_runner(),
    )
    progress = progress or RunProgress(
        progress_stream or io.StringIO(),
        len(admitted.prepared.rows),
        synthetic=admitted.prepared.catalog.synthetic,
    )
    return await supervise(admitted, hosts, progress)


def journal(out: Path) -> tuple[JournalLine, ...]:
    read = read_journal((out / "journal.jsonl").read_bytes())
    assert read.chain_break is None
    return read.lines


def records(out: Path, kind: type) -> list[Any]:
    return [line.record for line in journal(out) if isinstance(line.record, kind)]


def cell(out: Path, name: str) -> Any:
    return decode_cell_receipt((out / "cell-0000" / name / "cell.json").read_bytes())


def row(out: Path) -> Any:
    return decode_row_receipt((out / "cell-0000" / "row.json").read_bytes())


def matrix(out: Path) -> Any:
    return decode_matrix((out / MATRIX_FILENAME).read_bytes())


def synthetic_catalog(root: Path) -> dict[str, str]:
    """The packaged presets written as a synthetic catalog file (as the zoo's catalog is
    marked), and the plan's ``catalog`` member pinning it."""
    packaged = packaged_catalog().catalog
    catalog = msgspec.structs.replace(
        packaged,
        synthetic=True,
        presets=tuple(msgspec.structs.replace(p, synthetic=True) for p in packaged.presets),
    )
    root.mkdir(parents=True, exist_ok=True)
    path = root / "synthetic-catalog.json"
    data = msgspec.json.encode(catalog)
    path.write_bytes(data)
    return {"path": str(path), "sha256": hashlib.sha256(data).hexdigest()}
