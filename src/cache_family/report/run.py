"""A run directory's receipts as the run report reads them (`cache-family report-run`).

Only published receipts are read, never the journal; every read is bounded and a path a receipt
names must stay inside the run directory. Receipts are published bottom-up, so one that another
names but is missing was removed and is refused.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final, TypeVar

import msgspec

from cache_family.errors import Refused
from cache_family.report.decode import Reader, Refusals, Where
from cache_family.report.rows import ReportRow, read_rows
from cache_family.report.sources import SourceEntry, read_sources
from cache_family.report.workloads import WorkloadView, read_workloads
from cache_family.schemas.bounded import MIB
from cache_family.schemas.corpus import default_corpus_path
from cache_family.schemas.matrix import MATRIX_FILENAME, MatrixReceipt, MatrixRow
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.receipts import (
    ArmObservation,
    CacheVerdict,
    CellReceipt,
    RowReceipt,
    RungReceipt,
)
from cache_family.schemas.request_rows import RowsFileDigest, stream_rows

PRODUCTION_FILENAME: Final = "production-cache-bench.json"
CELL_FILENAME: Final = "cell.json"
MAX_RECEIPT_BYTES: Final = 64 * MIB
MAX_MATRIX_ROWS: Final = 100_000

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ArmView:
    """One arm of a row: its observation in ``row.json`` and, when published, its cell."""

    observation: ArmObservation
    #: ``cell.json`` relative to the run directory, when the row names a cell directory.
    cell_path: str | None
    cell: CellReceipt | None
    #: Per rung index, ``measured_values`` streamed from the cell's rows file when its rows
    #: are there (``Measurement.rows_file``) and the file holds; else None (rows inline).
    file_values: dict[int, dict[str, array[float]]] | None = None

    @property
    def verdicts(self) -> dict[int, CacheVerdict]:
        """The cache verdict of each rung that has one, by rung index (from ``cell.json``)."""
        if self.cell is None:
            return {}
        rungs = self.cell.measurement.rungs
        return {r.rung_index: r.cache_verdict for r in rungs if r.cache_verdict is not None}

    @property
    def arm(self) -> str:
        return self.observation.arm

    @property
    def rungs(self) -> tuple[RungReceipt, ...]:
        return () if self.cell is None else self.cell.measurement.rungs

    @property
    def concurrent(self) -> bool:
        """A ladder arm, whatever its name: its cell says so, or a rung has a ladder summary
        (a serial baseline has only serial summaries)."""
        if self.cell is not None and self.cell.measurement.kind == "concurrent":
            return True
        return any(r.rung_summary is not None for r in self.rungs) or any(
            r.rung_summary is not None for r in self.observation.rungs
        )


@dataclass(frozen=True, slots=True)
class RowView:
    entry: MatrixRow
    #: ``row.json`` relative to the run directory, when the matrix names one.
    row_path: str | None
    receipt: RowReceipt | None
    arms: tuple[ArmView, ...] = ()


@dataclass(frozen=True, slots=True)
class ReferenceInputs:
    """What the reference sections render: production rows and the corpus's sources."""

    rows: tuple[ReportRow, ...]
    sources: tuple[SourceEntry, ...]
    corpus_shown: str
    #: The production-cache-bench.json read, relative to the output directory.
    href: str


@dataclass(frozen=True, slots=True)
class RunReceipts:
    """Everything ``render_run_report`` needs; paths in it are relative, so rendering is pure."""

    matrix: MatrixReceipt
    rows: tuple[RowView, ...]
    #: The run directory relative to the output directory ("" when they are the same).
    run_href: str
    reference: ReferenceInputs | None = None
    # Each workload cell's ``workload.json`` (``report/workloads.py``).
    workloads: tuple[WorkloadView, ...] = ()


def _inside(reader: Reader, text: str, where: Where) -> str | None:
    """A relative POSIX path that stays inside the run directory, or None after a refusal."""
    pure = PurePosixPath(text)
    if not text or pure.is_absolute() or ".." in pure.parts or "\\" in text or "\x00" in text:
        reader.refuse("report.receipt", where, f"path {text!r} is not inside the run directory")
        return None
    return str(pure)


def _convert(reader: Reader, value: Any, kind: type[_T], what: str) -> _T | None:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        reader.refuse("report.receipt", [], f"not a {what}: {exc}")
        return None


def _load(
    root: str, relative: str, what: str, refusals: Refusals, named_by: Reader, where: Where
) -> tuple[Reader, Any] | None:
    """The JSON of ``root/relative``, which ``named_by`` names at ``where``; None after a
    refusal (a missing receipt is one)."""
    path = os.path.join(root, relative)
    if not os.path.lexists(path):
        named_by.refuse("report.receipt", where, f"{what} {relative} is missing")
        return None
    reader = Reader(path, what=what, sink=refusals, finite=True)
    ok, document = reader.load(MAX_RECEIPT_BYTES)
    if not ok:
        return None
    if not isinstance(document, dict):
        reader.wrong([], f"an object (a {what})", document)
        return None
    return reader, document


def _arm(
    root: str, row_reader: Reader, index: int, obs: ArmObservation, refusals: Refusals
) -> ArmView:
    cell_path: str | None = None
    cell: CellReceipt | None = None
    if obs.cell_dir is not None:
        where: Where = ["observations", index, "cell_dir"]
        inside = _inside(row_reader, obs.cell_dir, where)
        if inside is not None:
            cell_path = f"{inside}/{CELL_FILENAME}"
            loaded = _load(root, cell_path, "cell receipt", refusals, row_reader, where)
            if loaded is not None:
                reader, document = loaded
                cell = _convert(reader, document, CellReceipt, "cell receipt")
    rows_file = cell.measurement.rows_file if cell is not None else None
    return ArmView(
        observation=obs,
        cell_path=cell_path,
        cell=cell,
        file_values=(
            None
            if rows_file is None or cell_path is None
            else _file_values(root, cell_path, rows_file, refusals)
        ),
    )


def _cache_n(row: RequestRow) -> float | None:
    return (
        None if row.timings is None or row.timings.cache_n is None else float(row.timings.cache_n)
    )


def _server_ms(row: RequestRow) -> float | None:
    """The request as the server timed it: ``timings.prompt_ms + predicted_ms``."""
    timings = row.timings
    if timings is None or timings.prompt_ms is None or timings.predicted_ms is None:
        return None
    return timings.prompt_ms + timings.predicted_ms


#: The per-request values the run report compares (TTFT, latency), counts (``cache_n``) or
#: sets beside the client's time (``server``: the same request timed inside the server).
ROW_VALUES: Final[tuple[tuple[str, Callable[[RequestRow], float | None]], ...]] = (
    ("TTFT", lambda r: r.ttft_ms),
    ("latency", lambda r: r.elapsed_ms),
    ("cache_n", _cache_n),
    ("server", _server_ms),
)


def measured_values(rows: Iterable[RequestRow]) -> dict[str, array[float]]:
    """``ROW_VALUES`` of the requests a summary counts: completed, not an excluded warmup."""
    out: dict[str, array[float]] = {name: array("d") for name, _ in ROW_VALUES}
    _add_measured(out, rows)
    return out


def _add_measured(out: dict[str, array[float]], rows: Iterable[RequestRow]) -> None:
    for row in rows:
        if row.status != "completed" or row.excluded_warmup:
            continue
        for name, pick in ROW_VALUES:
            value = pick(row)
            if value is not None:
                out[name].append(value)


def _file_values(
    root: str, cell_path: str, rows_file: RowsFileDigest, refusals: Refusals
) -> dict[int, dict[str, array[float]]] | None:
    """Each rung's ``measured_values`` streamed from the cell's rows file: 8 bytes a value,
    never the rows; None (refused) when the file does not hold to its receipt's digest."""
    path = os.path.join(root, os.path.dirname(cell_path), rows_file.path)
    values: dict[int, dict[str, array[float]]] = {}
    try:
        for line in stream_rows(path, rows_file):
            rung = values.get(line.rung_index)
            if rung is None:
                rung = values[line.rung_index] = measured_values(())
            _add_measured(rung, (line.row,))
    except Refused as refused:
        for refusal in refused.refusals:
            refusals.add(refusal)
        return None
    return values


def _row(root: str, matrix_reader: Reader, i: int, entry: MatrixRow, sink: Refusals) -> RowView:
    evidence = entry.result.evidence
    if evidence is None:
        return RowView(entry=entry, row_path=None, receipt=None)
    where: Where = ["rows", i, "result", "evidence"]
    row_path = _inside(matrix_reader, evidence, where)
    if row_path is None:
        return RowView(entry=entry, row_path=None, receipt=None)
    loaded = _load(root, row_path, "row receipt", sink, matrix_reader, where)
    if loaded is None:
        return RowView(entry=entry, row_path=row_path, receipt=None)
    reader, document = loaded
    receipt: RowReceipt | None = _convert(reader, document, RowReceipt, "row receipt")
    if receipt is None:
        return RowView(entry=entry, row_path=row_path, receipt=None)
    arms = tuple(_arm(root, reader, k, obs, sink) for k, obs in enumerate(receipt.observations))
    return RowView(entry=entry, row_path=row_path, receipt=receipt, arms=arms)


def _href(path: str, output: str) -> str:
    return Path(os.path.relpath(path, output)).as_posix()


def _corpus_shown(corpus: str | None) -> tuple[str, str]:
    """(absolute path, text shown). The default corpus is named relative to its checkout so
    the report's bytes do not depend on where the command ran."""
    if corpus is not None:
        return str(Path(corpus).absolute()), corpus
    path = default_corpus_path()
    return path, _href(path, str(Path(path).parent.parent))


def read_run(
    run_dir: str,
    output_dir: str | None = None,
    *,
    production: str | None = None,
    corpus: str | None = None,
) -> RunReceipts:
    """The receipts of ``run_dir`` for a report written to ``output_dir`` (default: the run
    directory). ``production`` defaults to the run's own production-cache-bench.json when it
    has one. Raises ``Refused`` with every problem found."""
    root = str(Path(run_dir).absolute())
    output = root if output_dir is None else str(Path(output_dir).absolute())
    refusals = Refusals()
    matrix_reader = Reader(
        os.path.join(root, MATRIX_FILENAME), what="run matrix", sink=refusals, finite=True
    )
    ok, document = matrix_reader.load(MAX_RECEIPT_BYTES)
    matrix: MatrixReceipt | None = None
    if ok and isinstance(document, dict) and "rows" not in document and "reason" in document:
        # The failed-pipeline matrix: the run wrote no row receipts to report.
        matrix_reader.refuse(
            "report.receipt",
            [],
            f"the run's pipeline failed ({document.get('reason')}): there are no receipts "
            "to report",
        )
    elif ok:
        matrix = _convert(matrix_reader, document, MatrixReceipt, "run matrix receipt")
    if matrix is not None and len(matrix.rows) > MAX_MATRIX_ROWS:
        matrix_reader.refuse("report.receipt", ["rows"], f"more than {MAX_MATRIX_ROWS} rows")
        matrix = None
    rows: Sequence[RowView] = ()
    if matrix is not None:
        rows = [_row(root, matrix_reader, i, e, refusals) for i, e in enumerate(matrix.rows)]
    reference: ReferenceInputs | None = None
    own = os.path.join(root, PRODUCTION_FILENAME)
    if production is None and os.path.lexists(own):
        production = own
    if production is not None:
        production_path = str(Path(production).absolute())
        corpus_path, shown = _corpus_shown(corpus)
        reference = ReferenceInputs(
            rows=tuple(read_rows([production_path], refusals)),
            sources=read_sources(corpus_path, refusals),
            corpus_shown=shown,
            href=_href(production_path, output),
        )
    refusals.raise_any()
    assert matrix is not None  # a missing matrix was refused above
    run_href = "" if output == root else _href(root, output)
    workloads = read_workloads(root, ((a.arm, a.cell_path) for r in rows for a in r.arms))
    return RunReceipts(
        matrix=matrix, rows=tuple(rows), run_href=run_href, reference=reference, workloads=workloads
    )
