"""Rows of ``production-cache-bench.json`` files, as the combined report reads them.

Only the members the report uses are read (see the README's `cache-family report`
section); rows of our run and rich rows of other producers both parse.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from cache_family.errors import Refusal, Refused
from cache_family.report.decode import Reader, Refusals, Where
from cache_family.schemas.bounded import MIB
from cache_family.schemas.receipts import REAL_EVIDENCE_PREFIX
from cache_family.schemas.refusal_codes import report_hint

MAX_INPUTS: Final = 32
MAX_INPUT_BYTES: Final = 16 * MIB
MAX_ROWS: Final = 100_000
MAX_SERIES: Final = 100_000

# Words in a row's notes or evidence class that mark it as plumbing evidence, not a measurement.
_PLUMBING_WORDS: Final = re.compile(r"\b(synthetic|scripted)\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class SkippyFigures:
    status: str | None = None
    cache_storage_bytes: int | None = None
    cache_hit_import_ms: tuple[float | None, ...] | None = None
    cache_hit_decode_ms: tuple[float | None, ...] | None = None
    cache_hit_total_ms: float | None = None
    recompute_total_ms: float | None = None


@dataclass(frozen=True, slots=True)
class BaselineFigures:
    status: str | None = None
    warm_median_ms: float | None = None
    warm_mean_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One row; ``file`` and ``index`` say where it came from, for refusals while rendering."""

    file: str
    index: int
    family: str = ""
    model_id: str = ""
    payload: str | None = None
    stage_load_mode: str = ""
    use_case: str | None = None
    use_case_label: str | None = None
    prefix_tokens: int | None = None
    benchmark_prompt_token_count: int | None = None
    notes: str = ""
    resident_kv_bytes_per_token: int | None = None
    skippy: SkippyFigures = field(default_factory=SkippyFigures)
    llama_server: BaselineFigures = field(default_factory=BaselineFigures)
    # From a synthetic catalog or scripted tools: never shown as a performance claim.
    plumbing: bool = False
    # What a real model's figures are (model, CPU, threads, load, GPUs); None otherwise.
    real_evidence: str | None = None


def _row(reader: Reader, file: str, index: int, value: Any) -> ReportRow | None:
    where: Where = [index]
    if not isinstance(value, dict):
        reader.wrong(where, "an object (a row)", value)
        return None
    skippy = reader.obj(value, "skippy", where)
    at_skippy: Where = [index, "skippy"]
    llama = reader.obj(value, "llama_server", where)
    at_llama: Where = [index, "llama_server"]
    case = reader.obj(value, "case", where)
    imports = reader.opt_series(skippy, "cache_hit_import_ms", at_skippy, limit=MAX_SERIES)
    decodes = reader.opt_series(skippy, "cache_hit_decode_ms", at_skippy, limit=MAX_SERIES)
    if imports is not None and decodes is not None:
        if len(imports) != len(decodes):
            reader.refuse(
                "report.timing.series_mismatch",
                at_skippy,
                f"cache_hit_import_ms has {len(imports)} samples but cache_hit_decode_ms "
                f"has {len(decodes)}",
            )
        else:
            for i, (a, b) in enumerate(zip(imports, decodes, strict=True)):
                if a is not None and b is not None and not math.isfinite(a + b):
                    reader.refuse(
                        "report.timing.sum_overflow",
                        [*at_skippy, "cache_hit_import_ms", i],
                        "import + decode of this repeat is not a finite number",
                    )
    notes = reader.text(value, "notes", where)
    synthetic = reader.opt_flag(value, "synthetic", where)
    evidence_class = reader.opt_text(value, "evidence_class", where)
    plumbing = (
        synthetic is True
        or _PLUMBING_WORDS.search(evidence_class or "") is not None
        or _PLUMBING_WORDS.search(notes) is not None
    )
    return ReportRow(
        file=file,
        index=index,
        family=reader.text(value, "family", where),
        model_id=reader.text(value, "model_id", where),
        payload=reader.opt_text(value, "payload", where),
        stage_load_mode=reader.text(value, "stage_load_mode", where),
        use_case=reader.opt_text(value, "use_case", where),
        use_case_label=reader.opt_text(value, "use_case_label", where),
        prefix_tokens=reader.opt_count(value, "prefix_tokens", where),
        benchmark_prompt_token_count=reader.opt_count(value, "benchmark_prompt_token_count", where),
        notes=notes,
        resident_kv_bytes_per_token=reader.opt_count(
            case, "resident_kv_bytes_per_token", [index, "case"]
        ),
        skippy=SkippyFigures(
            status=reader.opt_text(skippy, "status", at_skippy),
            cache_storage_bytes=reader.opt_count(skippy, "cache_storage_bytes", at_skippy),
            cache_hit_import_ms=imports,
            cache_hit_decode_ms=decodes,
            cache_hit_total_ms=reader.opt_ms(skippy, "cache_hit_total_ms", at_skippy),
            recompute_total_ms=reader.opt_ms(skippy, "recompute_total_ms", at_skippy),
        ),
        llama_server=BaselineFigures(
            status=reader.opt_text(llama, "status", at_llama),
            warm_median_ms=reader.opt_ms(llama, "warm_median_ms", at_llama),
            warm_mean_ms=reader.opt_ms(llama, "warm_mean_ms", at_llama),
        ),
        plumbing=plumbing,
        real_evidence=evidence_class
        if not plumbing and evidence_class and evidence_class.startswith(REAL_EVIDENCE_PREFIX)
        else None,
    )


def read_rows(inputs: Sequence[str], refusals: Refusals) -> list[ReportRow]:
    """Every row of ``inputs`` (absolute paths, in order); problems go to ``refusals``."""
    if not 1 <= len(inputs) <= MAX_INPUTS:
        raise Refused(
            (
                Refusal(
                    "report.input_count",
                    "$",
                    f"{len(inputs)} input files given, not 1..={MAX_INPUTS}",
                    report_hint("report.input_count"),
                ),
            )
        )
    rows: list[ReportRow] = []
    for file in inputs:
        reader = Reader(file, what="report input", sink=refusals)
        ok, document = reader.load(MAX_INPUT_BYTES)
        if ok and not _document_rows(reader, file, document, rows):
            break
    return rows


def rows_from_bytes(file: str, data: bytes, refusals: Refusals) -> list[ReportRow]:
    """The rows of one file's bytes (the run's own production-cache-bench.json, before or
    without writing it), read exactly as ``read_rows`` reads a file; the caller bounds the
    size."""
    rows: list[ReportRow] = []
    reader = Reader(file, what="report input", sink=refusals)
    ok, document = reader.parse(data)
    if ok:
        _document_rows(reader, file, document, rows)
    return rows


def _document_rows(reader: Reader, file: str, document: Any, rows: list[ReportRow]) -> bool:
    """Append the document's rows; False once the rows in all exceed ``MAX_ROWS``."""
    if not isinstance(document, list):
        reader.wrong([], "an array of rows", document)
        return True
    total = len(rows) + len(document)
    if total > MAX_ROWS:
        reader.refuse(
            "report.too_many_rows",
            [],
            f"this file brings the rows to {total}, more than {MAX_ROWS} in all",
        )
        return False
    for index, value in enumerate(document):
        row = _row(reader, file, index, value)
        if row is not None:
            rows.append(row)
    return True
