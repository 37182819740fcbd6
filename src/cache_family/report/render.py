"""The combined README tables: full-GGUF rows, the use-case matrix with its prompt sources,
and package-only rows, in the reference renderer's exact text.

Pure: rows in, text out. The one way rendering refuses is a metadata-derived cache size
that overflows 64 bits, for a row shown in a table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cache_family.errors import Refusal, json_path
from cache_family.report.decode import U64_MAX, Refusals
from cache_family.report.rows import ReportRow
from cache_family.report.sources import SourceEntry
from cache_family.report.stats import MIN_SAMPLES, MedianDifference, median
from cache_family.schemas.refusal_codes import report_hint

FAMILY_ORDER: Final = (
    "Qwen3Next",
    "Falcon-H1",
    "Llama",
    "Qwen3 dense",
    "DeepSeek2",
    "GLM-4.7 Flash",
    "GLM4",
    "Gemma4 A4B",
    "Gemma4 E4B",
    "Gemma3",
    "Gemma2",
    "OLMo",
    "MiniMax M2.7",
)
USE_CASE_ORDER: Final = (
    "tool_calling",
    "text_to_sql",
    "coding_agent_loop",
    "issue_fixing",
    "code_refinement",
    "few_shot_reasoning",
    "open_chat",
    "summarization_rag",
)
PAYLOAD_LABELS: Final = {
    "resident-kv": "ResidentKv",
    "kv-recurrent": "KvRecurrent",
    "full-state": "FullState",
    "recurrent-only": "RecurrentOnly",
}
RUNTIME_SLICE: Final = "runtime-slice"
#: Shown in the Notes cell of a row from a synthetic catalog or scripted tools.
PLUMBING_LABEL: Final = "synthetic (plumbing evidence, not a performance claim)"
MIB_BYTES: Final = 1024 * 1024


def cell(text: str) -> str:
    """Text for a table cell: no column break, no line break, no code span."""
    return text.replace("|", "/").replace("\n", " ").replace("\r", " ").replace("`", "'")


def _rank(text: str, roster: Sequence[str]) -> tuple[int, str]:
    """Roster position first, then the text: unknown names after the roster, alphabetically."""
    try:
        return roster.index(text), text
    except ValueError:
        return len(roster), text


def _number(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def format_ms(value: float | None) -> str:
    # Python's fixed-point formatting rounds exact ties to even, as the reference's does.
    return "n/a" if value is None else f"{value:.1f}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    if value < MIB_BYTES:
        return f"{float(value) / 1024.0:.1f} KiB"
    return f"{float(value) / float(MIB_BYTES):.1f} MiB"


def _payload(row: ReportRow) -> str:
    if row.payload is None:
        return "n/a"
    return cell(PAYLOAD_LABELS.get(row.payload, row.payload))


def hit_ms(row: ReportRow) -> float | None:
    """Median of per-repeat import + decode when both series exist, else the total."""
    imports = row.skippy.cache_hit_import_ms
    decodes = row.skippy.cache_hit_decode_ms
    if imports is None or decodes is None:
        return row.skippy.cache_hit_total_ms
    pairs = zip(imports, decodes, strict=False)
    sums = [a + b for a, b in pairs if a is not None and b is not None]
    return median(sums) if sums else None


@dataclass(frozen=True, slots=True)
class Baseline:
    value: float
    label: str


def baseline(row: ReportRow, *, package: bool) -> Baseline | None:
    """llama-server warm median, else warm mean (status ok); package rows fall back to
    Skippy's own stage recompute."""
    llama = row.llama_server
    if llama.status == "ok":
        if llama.warm_median_ms is not None:
            return Baseline(llama.warm_median_ms, "llama-server warm median")
        if llama.warm_mean_ms is not None:
            return Baseline(llama.warm_mean_ms, "llama-server warm mean")
    if package and row.skippy.recompute_total_ms is not None:
        return Baseline(row.skippy.recompute_total_ms, "Skippy stage recompute")
    return None


def speedup(row: ReportRow, *, package: bool) -> float | None:
    """baseline / hit, only for a row whose correctness passed: a failed row is never a claim."""
    if row.skippy.status != "pass":
        return None
    base = baseline(row, package=package)
    hit = hit_ms(row)
    if base is None or hit is None or not hit > 0.0:
        return None
    value = base.value / hit
    return value if math.isfinite(value) else None


def _win(row: ReportRow, *, package: bool, bold: bool) -> str:
    value = speedup(row, package=package)
    if value is None:
        return "n/a"
    if row.plumbing:
        return f"{value:.2f}x (synthetic)"
    # A real model's figure says where it was measured right beside it.
    where = "" if row.real_evidence is None else " (CPU, see Notes)" if bold else " (CPU)"
    return f"**{value:.2f}x faster**{where}" if bold else f"{value:.2f}x{where}"


def _storage(row: ReportRow, refusals: Refusals) -> tuple[int | None, str]:
    if row.skippy.cache_storage_bytes is not None:
        return row.skippy.cache_storage_bytes, "measured"
    per_token = row.resident_kv_bytes_per_token
    if row.payload == "resident-kv" and per_token is not None and row.prefix_tokens is not None:
        total = per_token * row.prefix_tokens
        if total > U64_MAX:
            refusals.add(
                Refusal(
                    "report.storage_overflow",
                    json_path([row.index, "case", "resident_kv_bytes_per_token"]),
                    f"{row.file}: {per_token} bytes per token x {row.prefix_tokens} prefix "
                    "tokens overflows 64 bits",
                    report_hint("report.storage_overflow"),
                )
            )
            return None, "n/a"
        return total, "metadata-derived"
    return None, "n/a"


def _notes(row: ReportRow) -> str:
    if not row.plumbing and row.real_evidence is not None:
        return cell(row.real_evidence) + (f"; {cell(row.notes)}" if row.notes else "")
    if not row.plumbing:
        return cell(row.notes)
    return PLUMBING_LABEL + (f"; {cell(row.notes)}" if row.notes else "")


def _table(rows: Sequence[ReportRow], *, package: bool, refusals: Refusals) -> str:
    title = "Baseline" if package else "llama-server warm median ms"
    align = "---" if package else "---:"
    lines = [
        "| Family | Representative model ref | Production payload | Correctness | Prefix tokens "
        f"| Prompt tokens | {title} | Skippy hit median ms | Skippy win | Cache bytes "
        "| Size method | Notes |",
        f"| --- | --- | --- | --- | ---: | ---: | {align} | ---: | ---: | ---: | --- | --- |",
    ]
    for row in rows:
        stored, method = _storage(row, refusals)
        base = baseline(row, package=package)
        if package:
            base_text = "n/a" if base is None else base.label
        else:
            base_text = format_ms(None if base is None else base.value)
        fields = (
            cell(row.family),
            f"`{cell(row.model_id)}`",
            f"`{_payload(row)}`",
            cell(row.skippy.status if row.skippy.status is not None else "missing"),
            _number(row.prefix_tokens),
            _number(row.benchmark_prompt_token_count),
            base_text,
            format_ms(hit_ms(row)),
            _win(row, package=package, bold=True),
            _bytes(stored),
            method,
            _notes(row),
        )
        lines.append("| " + " | ".join(fields) + " |")
    return "\n".join(lines)


def _matrix(rows: Sequence[ReportRow]) -> str:
    families = sorted({row.family for row in rows}, key=lambda f: _rank(f, FAMILY_ORDER))
    keys = sorted(
        {row.use_case for row in rows if row.use_case is not None},
        key=lambda k: _rank(k, USE_CASE_ORDER),
    )
    # Later rows replace earlier ones: the last duplicate (use case, family) wins.
    by_cell: dict[tuple[str, str], ReportRow] = {}
    labels: dict[str, str] = {}
    for row in rows:
        key = row.use_case or ""
        by_cell[(key, row.family)] = row
        labels[key] = row.use_case_label if row.use_case_label is not None else key
    lines = [
        "| Use case | " + " | ".join(cell(f) for f in families) + " |",
        "| --- | " + " | ".join("---:" for _ in families) + " |",
    ]
    for key in keys:
        values = [cell(labels.get(key, key))]
        for family in families:
            found = by_cell.get((key, family))
            values.append("n/a" if found is None else _win(found, package=False, bold=False))
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def _sources(entries: Sequence[SourceEntry]) -> str:
    lines = [
        "| Use case | Dataset | Config | Split | Row |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for entry in sorted(entries, key=lambda e: _rank(e.key, USE_CASE_ORDER)):
        label = entry.label if entry.label is not None else entry.key
        row_idx = "" if entry.row_idx is None else str(entry.row_idx)
        lines.append(
            f"| {cell(label)} | `{cell(entry.dataset)}` | `{cell(entry.config)}` "
            f"| `{cell(entry.split)}` | {row_idx} |"
        )
    return "\n".join(lines)


def _code_span(text: str) -> str:
    """Text inside a Markdown code span on one line."""
    return text.replace("`", "'").replace("\n", " ").replace("\r", " ")


# The matrix note's lines 2 to 4 and the first sources line: the combined report's wording,
# and the in-run producer's, whose settings and corpus come from each row's own plan.
_MATRIX_SETTINGS: Final = (
    "the same requested prefix tokens, one generated token, Skippy",
    "`--runtime-lane-count 1`, llama-server `--parallel 1`, and the same full-GGUF",
    "family set as the table above. Values are Skippy warm-hit latency speedup over",
)
_PRODUCER_MATRIX_SETTINGS: Final = (
    "the prefix tokens, one generated token, Skippy runtime lanes and llama-server",
    "parallelism that each row's owning plan and profile set, and the same full-GGUF",
    "family set as the table above. Values are Skippy warm-hit latency speedup over",
)
PRODUCER_SOURCES_LINE: Final = (
    "Prompt sources come from the owning plan's selected corpus, with source"
)


@dataclass(frozen=True, slots=True)
class ReferenceSection:
    """One of the report's three tables with its heading and text; ``rows``: how many rows
    its table shows (a run that measured none of them has nothing to show there)."""

    key: str
    lines: tuple[str, ...]
    rows: int


FULL_SECTION: Final = "full-gguf"
USE_CASE_SECTION: Final = "use-case"
PACKAGE_SECTION: Final = "package-only"


def reference_sections(
    rows: Sequence[ReportRow],
    sources: Sequence[SourceEntry],
    corpus_shown: str,
    refusals: Refusals,
    *,
    producer: bool = False,
) -> tuple[ReferenceSection, ...]:
    """The full-GGUF table, the use-case matrix with its sources, and the package-only table,
    each ending in an empty line; overflows go to ``refusals``."""
    ordered = sorted(rows, key=lambda row: _rank(row.family, FAMILY_ORDER))

    def has_case(row: ReportRow) -> bool:
        return bool(row.use_case)

    def baseline_ok(row: ReportRow) -> bool:
        return row.stage_load_mode == RUNTIME_SLICE and row.llama_server.status == "ok"

    full = [r for r in ordered if not has_case(r) and baseline_ok(r)]
    package = [r for r in ordered if not has_case(r) and r.stage_load_mode != RUNTIME_SLICE]
    matrix = [r for r in ordered if has_case(r) and baseline_ok(r)]
    return (
        ReferenceSection(
            FULL_SECTION,
            (
                "### Full-GGUF llama-server vs Skippy",
                "",
                "Rows are ordered so related runtime/cache families appear next to each other.",
                "",
                _table(full, package=False, refusals=refusals),
                "",
            ),
            len(full),
        ),
        ReferenceSection(
            USE_CASE_SECTION,
            (
                "### Use-Case Benchmark Matrix",
                "",
                "This matrix uses one Hugging Face-sourced representative prompt per use case,",
                *(_PRODUCER_MATRIX_SETTINGS if producer else _MATRIX_SETTINGS),
                "llama-server warm-cache latency. DeepSeek3 stays in the package-only section",
                "because there is no practical local full-GGUF llama-server baseline for that",
                "artifact.",
                "",
                _matrix(matrix),
                "",
                PRODUCER_SOURCES_LINE
                if producer
                else f"Prompt sources are checked in at `{_code_span(corpus_shown)}` with source",
                "dataset metadata:",
                "",
                _sources(sources),
                "",
            ),
            len(matrix),
        ),
        ReferenceSection(
            PACKAGE_SECTION,
            (
                "### Package-Only Giant Models",
                "",
                "These rows validate cache strategy for models where a full llama-server",
                "baseline is not operationally useful because monolithic residency is too large.",
                "",
                _table(package, package=True, refusals=refusals),
                "",
            ),
            len(package),
        ),
    )


def render_report(
    rows: Sequence[ReportRow],
    sources: Sequence[SourceEntry],
    corpus_shown: str,
    refusals: Refusals,
    *,
    producer: bool = False,
) -> str:
    """The report text (ending in one newline): every section, each table even when it has
    no row, as the reference writes it; overflows go to ``refusals``. ``producer``: the
    in-run variant a run writes as ``production-cache-bench.md`` (``corpus_shown`` is then
    not used)."""
    sections = reference_sections(rows, sources, corpus_shown, refusals, producer=producer)
    return "\n".join(line for section in sections for line in section.lines)


def effect_cells(effect: MedianDifference | None) -> list[str]:
    """Old median, new median, difference, interval, relative difference, verdict (the
    old-against-new cells of every table that compares the two arms)."""
    if effect is None:
        return ["n/a"] * 5 + [f"fewer than {MIN_SAMPLES} requests"]
    relative = effect.relative
    return [
        format_ms(effect.median_old),
        format_ms(effect.median_new),
        f"{effect.difference:+.1f}",
        f"[{effect.low:+.1f}, {effect.high:+.1f}]",
        "n/a" if relative is None else f"{relative:+.1%}",
        effect.verdict,
    ]
