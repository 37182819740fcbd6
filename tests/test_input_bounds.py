"""Every operator input ends in a verdict within a bound, whatever its shape or its name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cache_family.errors import Refused
from cache_family.schemas import operator
from cache_family.schemas.operator import (
    DOCUMENT_MAX_BYTES,
    JSON_MAX_ENTRIES,
    validate_operator_document,
    validate_operator_object,
    validate_plan_object,
)
from cache_family.schemas.prepared import MAX_ROWS, PreparedInput, decode_document
from test_cli_validate import valid_document

# Far above what the bounded validation needs (well under a second here), far below the
# minutes the quadratic duplicate scan took. Measured as this process's CPU time, so a loaded
# machine (other processes, fewer free cores) cannot make it flaky.
GENEROUS_SECONDS = 10.0


def _filled(field: str, item: str) -> bytes:
    """A valid document whose plan.<field> is an array of ``item`` filling 1 MiB."""
    doc = valid_document()
    doc["plan"][field] = "FILL"
    text = json.dumps(doc)
    count = (DOCUMENT_MAX_BYTES - len(text)) // (len(item) + 1)
    data = text.replace('"FILL"', "[" + ",".join([item] * count) + "]").encode()
    assert DOCUMENT_MAX_BYTES - 2 * len(item) - 8 < len(data) <= DOCUMENT_MAX_BYTES
    return data


SHAPES = {
    "unknown-cases": ("cases", '"x"'),
    "empty-cases": ("cases", '""'),
    "distinct-use-cases": ("use_cases", None),
    "zero-rungs": ("concurrency", "0"),
    "zero-prefixes": ("prefix_sweep", "0"),
    "empty-arrays": ("cases", "[]"),
    "empty-objects": ("cases", "{}"),
    "nested-arrays": ("cases", "[" * 40 + "]" * 40),
}


def _shape(name: str) -> bytes:
    field, item = SHAPES[name]
    if item is not None:
        return _filled(field, item)
    doc = valid_document()
    doc["plan"][field] = [f"u{i}" for i in range(100_000)]
    data = json.dumps(doc).encode()
    assert len(data) <= DOCUMENT_MAX_BYTES
    return data


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_one_mebibyte_input_is_refused_with_bounded_work(name: str) -> None:
    data = _shape(name)
    started = time.process_time()
    with pytest.raises(Refused) as refused:
        validate_operator_document(data)
    elapsed = time.process_time() - started
    # The refusal count is the deterministic measure of the work done: one per checked
    # entry at most, and only the first JSON_MAX_ENTRIES entries of an array are checked.
    assert len(refused.value.refusals) <= JSON_MAX_ENTRIES + 16
    assert elapsed < GENEROUS_SECONDS


class _Counted:
    """A hashable item that counts the equality comparisons made against it."""

    comparisons = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        _Counted.comparisons += 1
        return isinstance(other, _Counted) and other.value == self.value


def test_finding_repeated_entries_is_linear_not_quadratic() -> None:
    items = [_Counted(i) for i in range(3000)] + [_Counted(7), _Counted(7), _Counted(11)]
    _Counted.comparisons = 0
    repeated = operator._repeated(items)
    assert [item.value for item in repeated] == [7, 11]  # type: ignore[attr-defined]
    # A scan of the entries seen so far made ~4.5 million comparisons here.
    assert _Counted.comparisons <= 3 * len(items)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [33, 300, 900, 5000])
def test_deep_nesting_is_a_refusal_not_a_recursion_error(depth: int) -> None:
    doc = valid_document()
    doc["plan"]["cases"] = _nested(depth)
    if depth < 990:  # what the standard JSON parser itself can still read
        with pytest.raises(Refused) as from_bytes:
            validate_operator_document(json.dumps(doc).encode())
        assert from_bytes.value.codes == ["operator.json.too_deep"]
    with pytest.raises(Refused) as from_object:
        validate_operator_object(doc)
    assert from_object.value.codes == ["operator.json.too_deep"]
    with pytest.raises(Refused) as plan_alone:
        validate_plan_object(doc["plan"])
    assert plan_alone.value.codes == ["operator.json.too_deep"]


def test_nesting_within_the_bound_keeps_every_refusal() -> None:
    doc = valid_document()
    doc["plan"]["cases"] = [_nested(20)]
    doc["cell_seconds"] = 1
    with pytest.raises(Refused) as refused:
        validate_operator_object(doc)
    assert refused.value.codes == ["operator.type", "operator.budget.out_of_range"]


def _cli() -> list[str]:
    return [sys.executable, "-c", "import sys; from cache_family.cli import main; sys.exit(main())"]


def _strict_env() -> dict[str, str]:
    return {"PATH": os.defpath, "PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C.UTF-8"}


def test_a_file_name_that_is_not_utf8_gets_a_verdict_on_a_strict_stdout(tmp_path: Path) -> None:
    name = os.fsencode(tmp_path) + b"/op\xff\xfe.json"
    with open(name, "wb") as out:
        out.write(json.dumps(valid_document()).encode())
    for extra in ([], ["--json"]):
        ran = subprocess.run(
            [*_cli(), "validate", "--input", os.fsdecode(name), *extra],
            capture_output=True, env=_strict_env(), timeout=120, check=False,
        )  # fmt: skip
        err = ran.stderr.decode("utf-8")
        assert ran.returncode == 2, err
        assert "Traceback" not in err
        if extra:  # --json: the verdict is the document on stdout, as for any refusal
            verdict = json.loads(ran.stdout)
            assert verdict["valid"] is False
            assert [r["code"] for r in verdict["refusals"]] == ["cli.path.not_utf8"]
            assert "op\\udcff\\udcfe.json" in verdict["refusals"][0]["message"]
            continue
        assert "refused: cli.path.not_utf8 at --input: " in err
        assert "op\\udcff\\udcfe.json" in err


def test_unencodable_text_is_escaped_rather_than_fatal() -> None:
    # Any message may name a file found on disk (a tree pin lists a directory's entries);
    # the CLI's streams escape what they cannot encode instead of raising.
    code = (
        "from cache_family.cli import _never_fail_on_encoding; _never_fail_on_encoding(); "
        "import sys; print('out \\udcff'); print('err \\udcfe', file=sys.stderr)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, env={**_strict_env(), "PYTHONIOENCODING": "ascii:strict"},
        timeout=120, check=False,
    )  # fmt: skip
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, b"out \\udcff\n", b"err \\udcfe\n")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (list(range(MAX_ROWS + 1)), f"more than {MAX_ROWS}"),
        (_nested(40), "nests deeper than 32"),
        ([[0] * 8000] * 300, "values"),
    ],
    ids=["long", "deep", "many-values"],
)
def test_a_prepared_document_of_any_shape_gets_one_refusal(rows: Any, message: str) -> None:
    # Validation would report one error per bad value (a 32 MiB document: millions, and
    # gigabytes of memory); the shape is refused first, with one refusal.
    data = json.dumps({"schema_version": 1, "rows": rows}).encode()
    with pytest.raises(Refused) as refused:
        decode_document(data, PreparedInput, what="prepared input")
    (refusal,) = refused.value.refusals
    assert refusal.code == "prepared.decode"
    assert message in refusal.message
