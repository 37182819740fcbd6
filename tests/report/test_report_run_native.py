"""`cache-family report-run` on a real demo run (real llama-server, the tiny model zoo), and
its `report.html` in headless Chromium (Debian's `chromium`; `./bootstrap test` installs it
when missing and root, otherwise the browser test is skipped with the reason)."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import msgspec
import pytest
from browser_check import WIDTHS, assert_compact, browser, open_page, png_width

from cache_family.cli import main
from cache_family.report.render import format_ms
from cache_family.report.run import read_run
from cache_family.report.run_report import SYNTHETIC_BANNER, render_run_report
from cache_family.report.stats import MIN_SAMPLES
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.receipts import (
    ArmObservation,
    decode_cell_receipt,
    decode_row_receipt,
    encode_receipt,
)

pytestmark = pytest.mark.native

#: The page's table border colour (#c8c8c8 in report/html.py's style).
TABLE_BORDER = (200, 200, 200)


@pytest.fixture(scope="session")
def demo_run(demo_standard: Path) -> Path:
    """The full-GGUF run of the real demo (conftest's ``demo_standard``, shared)."""
    return demo_standard / "full-gguf"


@pytest.fixture
def run_copy(demo_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(demo_run, copy)
    return copy


def concurrent_cells(run: Path) -> list[tuple[int, Path]]:
    matrix = json.loads((run / "cache-family-matrix.json").read_text())
    out = []
    for entry in matrix["rows"]:
        evidence = entry["result"].get("evidence")
        if evidence is None:
            continue
        row = decode_row_receipt((run / evidence).read_bytes())
        for obs in row.observations:
            if obs.arm == "native-concurrent" and obs.cell_dir is not None:
                out.append((row.row_index, run / obs.cell_dir / "cell.json"))
    return out


def test_the_plots_of_a_real_run_exist_are_linked_and_show_its_numbers(run_copy: Path) -> None:
    assert main(["report-run", str(run_copy)]) == 0
    markdown = (run_copy / "report.md").read_text()
    html = (run_copy / "report.html").read_text()
    assert f"> {SYNTHETIC_BANNER}" in markdown
    cells = concurrent_cells(run_copy)
    assert len(cells) >= 10  # every full-GGUF zoo row but the package-only one
    for row_index, cell_path in cells:
        plots = sorted((run_copy / "plots").glob(f"row-{row_index:04d}-*.svg"))
        assert len(plots) == 1, row_index
        name = f"plots/{plots[0].name}"
        assert f"]({name})" in markdown and f'href="{name}"' in html
        svg = plots[0].read_text()
        cell = decode_cell_receipt(cell_path.read_bytes())
        for rung in cell.measurement.rungs:
            summary = rung.rung_summary
            assert summary is not None
            c = rung.concurrency
            # Every curve names the output tokens each request asked for.
            name = f"native-concurrent, {rung.output_tokens} output tok/req"
            if summary.ttft_p50_ms is not None:
                p50 = f"{name}, p50 at concurrency {c}: {format_ms(summary.ttft_p50_ms)} ms"
                assert p50 in svg and p50 in html
            else:
                assert "not observable: native-concurrent" in svg
            rate = f"{summary.throughput_requests_per_sec:.2f}"
            assert f"{name} at concurrency {c}: {rate} requests/s" in svg
    for _, cell_path in cells:
        link = cell_path.relative_to(run_copy).as_posix()
        assert f"[cell.json]({link})" in markdown and f'href="{link}"' in html
    assert "paired serving not run" in markdown


def test_no_streamed_request_of_the_demo_passes_its_whole_response_off_as_its_first_token(
    demo_standard: Path,
) -> None:
    """Every request that generated more than one token either has a first-token time
    before its end or says why it has none (the first token came with the final event)."""
    checked = 0
    for rows_file in sorted(demo_standard.glob("*/cell-*/*/requests.jsonl")):
        for line in rows_file.read_text().splitlines():
            row = msgspec.json.decode(json.dumps(json.loads(line)["row"]), type=RequestRow)
            if row.status != "completed" or (row.tokens_predicted or 0) <= 1:
                continue
            if row.ttft_ms is None:
                # A serial baseline is not streamed; a streamed request says why.
                assert "native-serial" in str(rows_file) or row.ttft_unobserved, (rows_file, row)
                continue
            checked += 1
            assert row.elapsed_ms is not None and row.ttft_ms < row.elapsed_ms, (rows_file, row)
            assert row.ttft_unobserved is msgspec.UNSET
    assert checked > 0


def test_the_report_of_a_real_run_is_byte_identical_when_rendered_again(run_copy: Path) -> None:
    assert main(["report-run", str(run_copy)]) == 0
    again = render_run_report(read_run(str(run_copy)))
    assert again == render_run_report(read_run(str(run_copy)))
    for name, data in again.items():
        assert (run_copy / name).read_bytes() == data, name


def _faster(rows: tuple[RequestRow, ...]) -> tuple[RequestRow, ...]:
    """The same requests, each served faster than the fastest original one (per metric), so
    every bootstrap resample sees the new arm faster, whatever the real timings were."""

    def scaler(values: list[float]) -> float:
        return 0.5 * min(values) / max(values)

    ttft = scaler([r.ttft_ms for r in rows if r.ttft_ms is not None] or [1.0])
    elapsed = scaler([r.elapsed_ms for r in rows if r.elapsed_ms is not None])
    return tuple(
        msgspec.structs.replace(
            r,
            ttft_ms=None if r.ttft_ms is None else r.ttft_ms * ttft,
            elapsed_ms=None if r.elapsed_ms is None else r.elapsed_ms * elapsed,
        )
        for r in rows
    )


def test_old_and_new_cells_in_a_real_run_are_compared_per_rung(run_copy: Path) -> None:
    """Constructed from the real receipts: the row's native ladder stands in for skippy-old,
    and skippy-new serves every request faster than the fastest old one, so the interval
    excludes 0."""
    row_index, cell_path = concurrent_cells(run_copy)[0]
    native = decode_cell_receipt(cell_path.read_bytes())
    row_path = cell_path.parent.parent / "row.json"
    row = decode_row_receipt(row_path.read_bytes())
    # The demo ran real old and new stage servers; constructed cells replace them here, so
    # that the bootstrap interval has a known difference to find.
    assert {o.arm for o in row.observations} >= {"skippy-old", "skippy-new"}
    observations = [o for o in row.observations if not o.arm.startswith("skippy-")]
    for arm in ("skippy-old", "skippy-new"):
        rungs = tuple(
            msgspec.structs.replace(r, rows=r.rows if arm == "skippy-old" else _faster(r.rows))
            for r in native.measurement.rungs
        )
        cell_dir = f"{row.row_dir}/sweep-{arm}"
        cell = msgspec.structs.replace(
            native,
            arm=arm,
            cell_id=f"{row.row_dir}/{arm}",
            cell_dir=cell_dir,
            measurement=msgspec.structs.replace(native.measurement, rungs=rungs),
        )
        (run_copy / cell_dir).mkdir(exist_ok=True)
        (run_copy / cell_dir / "cell.json").write_bytes(encode_receipt(cell))
        observations.append(
            ArmObservation(arm=arm, planned="planned", status="completed", cell_dir=cell_dir)
        )
    row_path.write_bytes(
        encode_receipt(msgspec.structs.replace(row, observations=tuple(observations)))
    )
    # The demo already rendered this run's report: start from no plots, so the one found
    # below is the command's.
    shutil.rmtree(run_copy / "plots", ignore_errors=True)
    markdown = render_run_report(read_run(str(run_copy)))["report.md"].decode()
    comparisons = [
        line
        for line in markdown.splitlines()
        if line.startswith(f"| {row.row_key} | ") and ("| TTFT |" in line or "| latency |" in line)
    ]
    assert len(comparisons) == 2 * len(native.measurement.rungs)
    for rung, ttft, latency in zip(
        native.measurement.rungs, comparisons[::2], comparisons[1::2], strict=True
    ):
        assert latency.endswith("| new faster |"), latency
        observed = [r for r in rung.rows if r.ttft_ms is not None and not r.excluded_warmup]
        if len(observed) >= MIN_SAMPLES:
            assert ttft.endswith("| new faster |"), ttft
        else:  # first tokens that came with the final event are not compared
            assert ttft.endswith(("| not observable |", f"| fewer than {MIN_SAMPLES} requests |"))
    svg = next((run_copy / "plots").glob(f"row-{row_index:04d}-*.svg"), None)
    assert svg is None  # render_run_report wrote nothing; the command writes
    assert main(["report-run", str(run_copy)]) == 0
    svg_text = next((run_copy / "plots").glob(f"row-{row_index:04d}-*.svg")).read_text()
    tokens = native.measurement.rungs[0].output_tokens
    assert f"skippy-new, {tokens} output tok/req</text>" in svg_text  # its legend entry


# --- the page in a real browser -------------------------------------------------------------


def _png_rows(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the unfiltered scanlines of an 8-bit RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        previous = line
    return width, channels, rows


def _border_lines(png: bytes) -> int:
    """Scanlines holding a run of at least 300 table-border pixels: the tables' rules."""
    width, channels, rows = _png_rows(png)
    count = 0
    target = bytes(TABLE_BORDER)
    for line in rows:
        run = best = 0
        for x in range(width):
            if line[x * channels : x * channels + 3] == target:
                run += 1
                best = max(best, run)
            else:
                run = 0
        count += best >= 300
    return count


@pytest.mark.parametrize("width", WIDTHS)
def test_the_html_opens_in_chromium_without_console_errors_or_overflow_and_shows_the_tables(
    width: int, run_copy: Path, tmp_path: Path
) -> None:
    browser()  # skips, saying so, without Chromium
    assert main(["report-run", str(run_copy)]) == 0
    page = run_copy / "report.html"
    shot = tmp_path / "report.png"
    opened = open_page(page, width, screenshot=shot)
    assert opened.console == []
    assert opened.layout["offenders"] == [], opened.layout
    assert opened.layout["scroll"] <= opened.layout["client"], opened.layout
    assert opened.dom.count("<table>") >= 10
    assert SYNTHETIC_BANNER in opened.dom
    assert 'id="summary"' in opened.dom
    assert opened.dom.count("<svg ") == len(concurrent_cells(run_copy))
    if width >= 1200:
        # The first screen holds the summary table: its horizontal rules are on the image.
        assert _border_lines(shot.read_bytes()) >= 3


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("run", ["full-gguf", "workloads"])
def test_the_demos_full_gguf_and_workload_reports_read_in_chromium(
    run: str, width: int, demo_standard: Path, tmp_path: Path
) -> None:
    """The real demo's full-GGUF run and its workload run: compact tables (at 1400 px none
    scrolls sideways, per-rung rows hold one line), only the sections the run measured, and
    a whole-page screenshot of each in the test's directory."""
    browser()  # skips, saying so, without Chromium
    copy = tmp_path / run
    shutil.copytree(demo_standard / run, copy)
    assert main(["report-run", str(copy)]) == 0
    shot = tmp_path / f"{run}-{width}.png"
    opened = open_page(copy / "report.html", width, full_page=shot)
    assert opened.console == []
    assert_compact(opened.layout, width)
    assert png_width(shot) == max(width, 500)
    markdown = (copy / "report.md").read_text()
    # Neither run has use-case rows: no use-case matrix, one line says so.
    assert "Use-Case Benchmark Matrix" not in markdown
    assert "| Use case |" not in markdown
    (not_run,) = [line for line in markdown.splitlines() if line.startswith("Not in this run")]
    assert "use-case rows" in not_run
    if run == "workloads":
        # Its two zoo rows are full-GGUF rows; no package-only row was planned.
        assert "Package-Only Giant Models" not in markdown and "package-only rows" in not_run
        assert "## Workloads" in markdown
        assert ">offered rate (requests/s)</text>" in opened.dom
        assert ">designed overlap (%)</text>" in opened.dom
    else:
        assert "Package-Only Giant Models" in markdown  # the zoo's DeepSeek3 layer package
        assert "workloads" in not_run
    assert "| 0/0 |" not in markdown  # closed-loop stages say so; no cell counts nothing
