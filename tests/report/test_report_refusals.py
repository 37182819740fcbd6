"""`cache-family report` refuses malformed inputs before writing: every refusal names the file
and the JSON path, the exit status is 2, and an existing output keeps its bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cache_family.cli import main
from cache_family.schemas.refusal_codes import REPORT_REFUSAL_CODES

PRECIOUS = b"# hand-written README\n\nnot to be touched\n"
README = Path(__file__).resolve().parents[2] / "README.md"


def good_row(**over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "family": "Llama",
        "model_id": "org/model:Q4",
        "payload": "resident-kv",
        "stage_load_mode": "runtime-slice",
        "use_case": None,
        "prefix_tokens": 128,
        "benchmark_prompt_token_count": 129,
        "notes": "",
        "case": {"resident_kv_bytes_per_token": 32768},
        "skippy": {
            "status": "pass",
            "cache_storage_bytes": 1024,
            "cache_hit_import_ms": [0.5, 0.5],
            "cache_hit_decode_ms": [1.0, 1.0],
            "cache_hit_total_ms": 1.5,
            "recompute_total_ms": 9.0,
        },
        "llama_server": {"status": "ok", "warm_mean_ms": 3.0, "warm_median_ms": 3.0},
    }
    row.update(over)
    return row


def with_skippy(**over: Any) -> dict[str, Any]:
    row = good_row()
    row["skippy"] = {**row["skippy"], **over}
    return row


def run_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *inputs: Path, corpus: Path | None = None
) -> tuple[int, str]:
    output = tmp_path / "README.md"
    output.write_bytes(PRECIOUS)
    before = sorted(os.listdir(tmp_path))
    argv = ["report", "--output", str(output)]
    for path in inputs:
        argv += ["--input", str(path)]
    if corpus is not None:
        argv += ["--use-case-corpus", str(corpus)]
    status = main(argv)
    assert output.read_bytes() == PRECIOUS, "an existing output must keep its bytes"
    assert sorted(os.listdir(tmp_path)) == before, "nothing else is written"
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    return status, captured.err


# (case name, file text, code, JSON path)
MALFORMED: list[tuple[str, str, str, str]] = [
    (
        "NaN total",
        json.dumps([with_skippy(cache_hit_total_ms=float("nan"))]),
        "report.timing.non_finite",
        "$[0].skippy.cache_hit_total_ms",
    ),
    (
        "Infinity in a series",
        json.dumps([with_skippy(cache_hit_import_ms=[0.5, float("inf")])]),
        "report.timing.non_finite",
        "$[0].skippy.cache_hit_import_ms[1]",
    ),
    (
        "a number beyond the float range",
        json.dumps([good_row()]).replace('"warm_median_ms": 3.0', '"warm_median_ms": 1e400'),
        "report.timing.non_finite",
        "$[0].llama_server.warm_median_ms",
    ),
    (
        "negative baseline",
        json.dumps([good_row(llama_server={"status": "ok", "warm_median_ms": -0.5})]),
        "report.timing.negative",
        "$[0].llama_server.warm_median_ms",
    ),
    (
        "negative sample",
        json.dumps([with_skippy(cache_hit_decode_ms=[1.0, -1.0])]),
        "report.timing.negative",
        "$[0].skippy.cache_hit_decode_ms[1]",
    ),
    (
        "mismatched series",
        json.dumps([with_skippy(cache_hit_decode_ms=[1.0, 1.0, 1.0])]),
        "report.timing.series_mismatch",
        "$[0].skippy",
    ),
    (
        "a repeat whose sum overflows",
        json.dumps([with_skippy(cache_hit_import_ms=[1e308, 0.5], cache_hit_decode_ms=[1e308, 1])]),
        "report.timing.sum_overflow",
        "$[0].skippy.cache_hit_import_ms[0]",
    ),
    (
        "series too long",
        json.dumps([with_skippy(cache_hit_import_ms=[0] * 100_001, cache_hit_decode_ms=None)]),
        "report.timing.series_too_long",
        "$[0].skippy.cache_hit_import_ms",
    ),
    ("null family", json.dumps([good_row(family=None)]), "report.type", "$[0].family"),
    ("null notes", json.dumps([good_row(notes=None)]), "report.type", "$[0].notes"),
    ("null skippy", json.dumps([good_row(skippy=None)]), "report.type", "$[0].skippy"),
    ("null case", json.dumps([good_row(case=None)]), "report.type", "$[0].case"),
    (
        "null llama_server",
        json.dumps([good_row(llama_server=None)]),
        "report.type",
        "$[0].llama_server",
    ),
    (
        "128.0 as an integer",
        json.dumps([good_row(prefix_tokens=128.0)]),
        "report.type",
        "$[0].prefix_tokens",
    ),
    (
        "a string where a number is",
        json.dumps([good_row(llama_server={"status": "ok", "warm_median_ms": "3.0"})]),
        "report.type",
        "$[0].llama_server.warm_median_ms",
    ),
    (
        "a boolean count",
        json.dumps([with_skippy(cache_storage_bytes=True)]),
        "report.type",
        "$[0].skippy.cache_storage_bytes",
    ),
    (
        "a number as status",
        json.dumps([with_skippy(status=1)]),
        "report.type",
        "$[0].skippy.status",
    ),
    (
        "a non-boolean synthetic flag",
        json.dumps([good_row(synthetic="yes")]),
        "report.type",
        "$[0].synthetic",
    ),
    (
        "negative prefix",
        json.dumps([good_row(prefix_tokens=-1)]),
        "report.out_of_range",
        "$[0].prefix_tokens",
    ),
    (
        "a count beyond 64 bits",
        json.dumps([good_row(case={"resident_kv_bytes_per_token": 2**64})]),
        "report.out_of_range",
        "$[0].case.resident_kv_bytes_per_token",
    ),
    ("an object, not an array", json.dumps({"rows": []}), "report.type", "$"),
    ("a row that is not an object", json.dumps([good_row(), "row"]), "report.type", "$[1]"),
    (
        "a repeated member",
        '[{"family": "Llama", "family": "Gemma3"}]',
        "report.duplicate_field",
        "$[0].family",
    ),
    ("not JSON", '[{"family": "Llama",]', "report.json", "$"),
    # Past CPython's 4,300-digit limit on int(): a ValueError traceback and exit 1 before.
    ("an integer of 5000 digits", '[{"prefix_tokens": ' + "1" * 5000 + "}]", "report.json", "$"),
    ("nesting too deep", "[" * 200_000 + "]" * 200_000, "report.json", "$"),
    ("a lone surrogate", '[{"family": "\\ud800"}]', "report.bad_text", "$[0].family"),
    (
        "storage overflow in a shown row",
        json.dumps(
            [
                with_skippy(cache_storage_bytes=None)
                | {"prefix_tokens": 2**33, "case": {"resident_kv_bytes_per_token": 2**31}}
            ]
        ),
        "report.storage_overflow",
        "$[0].case.resident_kv_bytes_per_token",
    ),
]


@pytest.mark.parametrize(("name", "text", "code", "path"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_is_refused_naming_file_and_path(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    text: str,
    code: str,
    path: str,
) -> None:
    good = tmp_path / "a-good.json"
    good.write_text(json.dumps([good_row()]))
    bad = tmp_path / "b-bad.json"
    bad.write_text(text, encoding="utf-8")
    status, err = run_report(tmp_path, capsys, good, bad)
    assert status == 2, name
    assert f"refused: {code} at {path}: {bad}: " in err
    assert str(good) not in err  # the good file is not blamed


def test_invalid_utf8_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'[{"family": "\xff"}]')
    status, err = run_report(tmp_path, capsys, bad)
    assert status == 2
    assert f"refused: report.json at $: {bad}: report input is not UTF-8" in err


def test_every_problem_of_every_file_is_listed_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = tmp_path / "one.json"
    one.write_text(json.dumps([good_row(family=None), with_skippy(cache_hit_total_ms=-1)]))
    two = tmp_path / "two.json"
    two.write_text(json.dumps([good_row(prefix_tokens=1.5)]))
    status, err = run_report(tmp_path, capsys, one, two)
    assert status == 2
    assert f"report.type at $[0].family: {one}" in err
    assert f"report.timing.negative at $[1].skippy.cache_hit_total_ms: {one}" in err
    assert f"report.type at $[0].prefix_tokens: {two}" in err


def test_a_flood_of_refusals_is_capped_with_a_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([good_row(family=None)] * 40))
    status, err = run_report(tmp_path, capsys, bad)
    assert status == 2
    assert err.count("refused: report.type") == 32
    assert "refused: report.more_refusals at $: 8 more refusal(s) not listed" in err


def test_more_than_32_inputs_are_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = [tmp_path / f"missing-{i}.json" for i in range(33)]  # never opened
    status, err = run_report(tmp_path, capsys, *inputs)
    assert status == 2
    assert "refused: report.input_count at $: 33 input files given, not 1..=32" in err
    assert "file.missing" not in err


def test_32_inputs_are_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs = []
    for i in range(32):
        path = tmp_path / f"in-{i:02d}.json"
        path.write_text(json.dumps([good_row(model_id=f"m/{i}")]))
        inputs.append(str(path))
    argv = ["report", *[a for p in inputs for a in ("--input", p)]]
    assert main(argv) == 0
    assert capsys.readouterr().out.count("| Llama | `m/") == 32


def test_a_file_over_16_mib_is_refused_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as handle:  # sparse: the size is checked before reading
        handle.truncate(16 * 1024 * 1024 + 1)
    status, err = run_report(tmp_path, capsys, big)
    assert status == 2
    assert f"refused: file.too_large at $: report input {big} has 16777217 bytes" in err


def test_more_than_100000_rows_in_all_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{}] * 60_000))
    two = tmp_path / "two.json"
    two.write_text(json.dumps([{}] * 40_001))
    status, err = run_report(tmp_path, capsys, one, two)
    assert status == 2
    assert f"refused: report.too_many_rows at $: {two}: this file brings the rows to 100001" in err


def test_a_missing_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.json"
    status, err = run_report(tmp_path, capsys, missing)
    assert status == 2
    assert f"refused: file.missing at $: report input {missing} does not exist" in err


@pytest.mark.parametrize(
    ("corpus", "code", "path"),
    [
        (
            {"use_cases": [{"key": "x", "source": {"dataset": None}}]},
            "report.type",
            "$.use_cases[0].source.dataset",
        ),
        (
            {"use_cases": [{"key": "x", "source": {"row_idx": 1.0}}]},
            "report.type",
            "$.use_cases[0].source.row_idx",
        ),
        ({"use_cases": None}, "report.type", "$.use_cases"),
        ({}, "report.missing_field", "$.use_cases"),
        ({"version": 1}, "report.missing_field", "$.use_cases"),
        ([], "report.type", "$"),
        ({"use_cases": [{"key": "x"}] * 10_001}, "report.corpus_too_large", "$.use_cases"),
    ],
)
def test_a_malformed_corpus_is_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    corpus: Any,
    code: str,
    path: str,
) -> None:
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([good_row()]))
    corpus_path = tmp_path / "corpus.json"
    corpus_path.write_text(json.dumps(corpus))
    status, err = run_report(tmp_path, capsys, rows, corpus=corpus_path)
    assert status == 2
    assert f"refused: {code} at {path}: {corpus_path}: " in err


def test_a_corpus_with_an_integer_of_5000_digits_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([good_row()]))
    corpus_path = tmp_path / "corpus.json"
    corpus_path.write_text(
        '{"version": 1, "use_cases": [{"key": "x", "source": {"row_idx": ' + "7" * 5000 + "}}]}"
    )
    status, err = run_report(tmp_path, capsys, rows, corpus=corpus_path)
    assert status == 2
    assert (
        f"refused: report.json at $: {corpus_path}: use-case corpus holds an integer literal "
        "of more than 4300 digits" in err
    )


def test_an_unwritable_output_is_refused_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([good_row()]))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    status = main(["report", "--input", str(rows), "--output", str(blocker / "sub" / "R.md")])
    assert status == 2
    assert "refused: report.output_unwritable" in capsys.readouterr().err
    directory = tmp_path / "dir.md"
    directory.mkdir()
    assert main(["report", "--input", str(rows), "--output", str(directory)]) == 2
    assert sorted(os.listdir(tmp_path)) == ["dir.md", "file", "rows.json"]
    assert os.listdir(directory) == []


def test_every_report_code_is_documented_in_the_readme() -> None:
    text = README.read_text(encoding="utf-8")
    for code in REPORT_REFUSAL_CODES:
        assert f"`{code}`" in text, code
