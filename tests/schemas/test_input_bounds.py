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
from operator_documents import valid_document

from cache_family.cli import main
from cache_family.errors import LISTED_PER_GROUP, Refusal, RefusalCap, Refused
from cache_family.schemas import operator
from cache_family.schemas.operator import (
    DOCUMENT_MAX_BYTES,
    JSON_MAX_ENTRIES,
    validate_operator_document,
    validate_operator_object,
    validate_plan_object,
)
from cache_family.schemas.prepared import MAX_ROWS, PreparedInput, decode_document

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


# --- refusals that amplify -------------------------------------------------------------------


def _toolkits_of_unknown_members(entries: int, members: int) -> dict[str, Any]:
    """A valid document whose toolkit_directories holds ``entries`` objects of ``members``
    unknown members each: one refusal per member (and two missing, one bad name per entry)."""
    doc = valid_document()
    doc["toolkit_directories"] = {
        f"T{i}": {f"u{j}": 0 for j in range(members)} for i in range(entries)
    }
    return doc


def test_the_amplifying_mebibyte_is_one_refusal_in_bounded_memory(tmp_path: Path) -> None:
    # About 1,000 entries of about 120 unknown members: 130,000 refusals, 20 MB of stderr and
    # 230 MB of memory before; now the values are counted before any is checked.
    entries = 1
    while len(json.dumps(_toolkits_of_unknown_members(entries + 50, 115))) < DOCUMENT_MAX_BYTES:
        entries += 50
    data = json.dumps(_toolkits_of_unknown_members(entries, 115)).encode()
    assert DOCUMENT_MAX_BYTES - 100_000 < len(data) <= DOCUMENT_MAX_BYTES
    path = tmp_path / "amplifying.json"
    path.write_bytes(data)
    # The child reports its own peak memory (VmHWM: getrusage's figure would carry this
    # process's peak across the fork and exec), so nothing else running changes the figure.
    code = (
        "import sys; from cache_family.cli import main; status = main(); "
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')]; "
        "print(hwm[0].split()[1]); sys.exit(status)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code, "validate", "--input", str(path)],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    err = ran.stderr.decode()
    assert ran.returncode == 2, err
    assert len(ran.stderr) < 2_000
    assert err.startswith("refused: operator.json.too_many_values at $: the document's arrays")
    assert err.count("refused: ") == 1
    peak_kib = int(ran.stdout)
    assert peak_kib < 120 * 1024, f"peak memory {peak_kib} KiB"


def test_one_mistake_repeated_is_listed_a_few_times_with_a_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 30 x 100 unknown members stay under the values bound: each is a refusal, but only the
    # first few of one code under one top-level member are printed, then how many more.
    doc = _toolkits_of_unknown_members(30, 100)
    with pytest.raises(Refused) as refused:
        validate_operator_document(json.dumps(doc).encode())
    codes = refused.value.codes
    assert codes.count("operator.unknown_field") == LISTED_PER_GROUP
    assert codes.count("operator.missing_field") == LISTED_PER_GROUP
    assert codes.count("operator.toolkit.bad_name") == LISTED_PER_GROUP
    more = [
        (r.path, r.message) for r in refused.value.refusals if r.code.endswith(".more_refusals")
    ]
    assert more == [
        (
            "$.toolkit_directories",
            f"{30 * 100 - LISTED_PER_GROUP} more operator.unknown_field refusal(s) under "
            f"$.toolkit_directories not listed (the first {LISTED_PER_GROUP} are)",
        ),
        (
            "$.toolkit_directories",
            f"{30 * 2 - LISTED_PER_GROUP} more operator.missing_field refusal(s) under "
            f"$.toolkit_directories not listed (the first {LISTED_PER_GROUP} are)",
        ),
        (
            "$.toolkit_directories",
            f"{30 - LISTED_PER_GROUP} more operator.toolkit.bad_name refusal(s) under "
            f"$.toolkit_directories not listed (the first {LISTED_PER_GROUP} are)",
        ),
    ]
    path = tmp_path / "repeated.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", "--input", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.encode()) < 8_000
    assert (
        "refused: operator.more_refusals at $.toolkit_directories: 2992 more "
        "operator.unknown_field refusal(s)" in err
    )


def test_the_cap_bounds_refusals_in_all_whatever_their_groups() -> None:
    cap = RefusalCap("test.more", "fix the listed ones", per_group=2, in_all=5)
    for group in range(10):
        for _ in range(3):
            cap.add(Refusal("test.same", f"$.g{group}", "m", "h"), f"$.g{group}")
    listed = cap.refusals()
    assert [r.path for r in listed[:5]] == ["$.g0", "$.g0", "$.g1", "$.g1", "$.g2"]
    assert [(r.path, r.message) for r in listed[5:]] == [
        ("$.g0", "1 more test.same refusal(s) under $.g0 not listed (the first 2 are)"),
        ("$.g1", "1 more test.same refusal(s) under $.g1 not listed (the first 2 are)"),
        ("$", "23 more refusal(s) not listed (the first 5 are)"),
    ]
    assert cap.unlisted == 30 - 5
