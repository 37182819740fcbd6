"""Fuzzing the documents the tool reads from outside: operator inputs, prepared inputs, use-case
corpora and report inputs. Each must end in its model or in well-formed typed refusals (the
report reader: rows and collected refusals), never in another exception.

Two sizes of the same properties: a few dozen documents of each kind in the default run, and
``FUZZ_LONG_EXAMPLES`` of each (10,000 in all) under ``@pytest.mark.long``, which the default
run leaves out (``just fuzz-long`` runs it; docs/reliability.md records its figures). Every
property counts the documents it really checked and asserts the count, so the figure printed
is the figure tested.

Mutations start from a valid document of each kind (the operator strategy of
``test_operator_property``, a real prepared input, the packaged corpus, the golden report
inputs): one structural change (drop or add a member, retype or replace a value with
arbitrary JSON, nest deeply) or one byte flipped in the encoded text.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from operator_documents import valid_document
from operator_strategies import MUTATIONS, assert_well_formed, operator_inputs

from cache_family.errors import Refused
from cache_family.report.decode import Refusals
from cache_family.report.rows import rows_from_bytes
from cache_family.schemas.catalog import decode_strict
from cache_family.schemas.corpus import Corpus, check_corpus, default_corpus_path
from cache_family.schemas.operator import OperatorInput, validate_operator_document
from cache_family.schemas.prepared import PreparedInput, decode_document

FUZZ_LONG_EXAMPLES = 2_500  # of each of the four kinds: 10,000 documents
FUZZ_SHORT_EXAMPLES = 25
GOLDEN_REPORT = Path(__file__).resolve().parents[1] / "support" / "golden" / "report"

Doc = Any


@dataclass
class Tally:
    checked: int = 0
    refused: int = 0


def well_formed(refused: Refused) -> None:
    assert refused.refusals
    for refusal in refused.refusals:
        assert refusal.code and "." in refusal.code and refusal.path.startswith("$"), refusal
        for text in (refusal.code, refusal.path, refusal.message, refusal.hint):
            assert isinstance(text, str) and text


# --- mutations of any JSON document ---------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=10,
)  # fmt: skip


def _containers(node: Doc, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path] if isinstance(node, dict | list) else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _containers(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node[:8]):  # enough variety, bounded work
            found += _containers(value, (*path, index))
    return found


def _at(node: Doc, path: tuple[Any, ...]) -> Doc:
    for step in path:
        node = node[step]
    return node


#: An integer literal past CPython's 4,300-digit limit on int() of text: json.loads raises a
#: plain ValueError for it (not a JSONDecodeError), which once escaped the report's reader.
LONG_INTEGER: Final = "1" * 5000
_LONG_INTEGER_MARK: Final = "cache-family:long-integer"


def with_long_integer(doc: Doc) -> bytes:
    """``doc`` encoded, each ``_LONG_INTEGER_MARK`` string in it written as ``LONG_INTEGER``
    (json.dumps itself cannot write such an int)."""
    return json.dumps(doc).replace(f'"{_LONG_INTEGER_MARK}"', LONG_INTEGER).encode()


@st.composite
def mutated(draw: st.DrawFn, original: Doc) -> bytes:
    """One structural mutation of ``original`` (which is left alone), or one flipped byte."""
    doc = copy.deepcopy(original)
    kinds = ["drop", "add", "replace", "nest", "flip", "long-int"]
    kind = draw(st.sampled_from(kinds), label="kind")
    if kind == "flip":
        data = bytearray(json.dumps(doc).encode())
        at = draw(st.integers(0, len(data) - 1), label="at")
        data[at] ^= draw(st.integers(1, 255), label="xor")
        return bytes(data)
    target = _at(doc, draw(st.sampled_from(_containers(doc)), label="where"))
    slots = list(target) if isinstance(target, dict) else list(range(len(target)))
    if kind == "add" or not slots:
        value = draw(json_values, label="value")
        if isinstance(target, dict):
            target[draw(st.text(max_size=10), label="key")] = value
        else:
            target.append(value)
    else:
        slot = draw(st.sampled_from(slots), label="slot")
        if kind == "drop":
            del target[slot]
        elif kind == "replace":
            target[slot] = draw(json_values, label="value")
        elif kind == "long-int":
            target[slot] = _LONG_INTEGER_MARK
            return with_long_integer(doc)
        else:  # nest: a value buried deep, the shape that once overflowed the stack
            target[slot] = draw(st.sampled_from([40, 400, 4000]), label="depth") * [0]
            for _ in range(draw(st.integers(1, 600), label="levels")):
                target[slot] = [target[slot]]
    return json.dumps(doc).encode()


# --- the valid starting points ------------------------------------------------------------------


@cache
def prepared_document(root: str) -> Doc:
    from run_harness import make_prepared

    return json.loads(make_prepared(Path(root) / "prep").read_bytes())


@cache
def corpus_document() -> Doc:
    return json.loads(Path(default_corpus_path()).read_bytes())


@cache
def report_documents() -> tuple[Doc, ...]:
    return tuple(json.loads(path.read_bytes()) for path in sorted(GOLDEN_REPORT.glob("*/*.json"))
                 if path.name.startswith("production-cache-bench"))  # fmt: skip


# --- one check per kind -------------------------------------------------------------------------


def check_operator(tally: Tally, draw: Callable[..., Any], doc: Doc) -> None:
    mutation = draw(st.sampled_from(MUTATIONS), label="mutation")
    mutation(draw, doc)
    try:
        assert isinstance(validate_operator_document(json.dumps(doc).encode()), OperatorInput)
    except Refused as refused:
        assert_well_formed(refused)
        tally.refused += 1
    tally.checked += 1


def check_prepared(tally: Tally, data: bytes) -> None:
    try:
        assert isinstance(decode_document(data, PreparedInput, what="prepared input"),
                          PreparedInput)  # fmt: skip
    except Refused as refused:
        well_formed(refused)
        tally.refused += 1
    tally.checked += 1


def check_corpus_bytes(tally: Tally, data: bytes) -> None:
    try:
        corpus = decode_strict(data, Corpus, code_prefix="corpus", what="use-case corpus")
        problems = check_corpus(corpus)
        if problems:
            raise Refused(tuple(problems))
    except Refused as refused:
        well_formed(refused)
        tally.refused += 1
    tally.checked += 1


def check_report(tally: Tally, data: bytes) -> None:
    refusals = Refusals()
    rows = rows_from_bytes("production-cache-bench.json", data, refusals)
    assert isinstance(rows, list)
    if refusals:
        well_formed(Refused(tuple(refusals.listed)))
        tally.refused += 1
    tally.checked += 1


def fuzz(kind: str, examples: int, tmp_root: Path) -> Tally:
    """Run one kind's property for ``examples`` documents; the tally of what it checked."""
    tally = Tally()
    config = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    if kind == "operator":

        @config
        @given(data=st.data(), doc=operator_inputs())
        def prop_operator(data: st.DataObject, doc: Doc) -> None:
            check_operator(tally, data.draw, doc)

        prop_operator()
    elif kind == "prepared":
        base = prepared_document(str(tmp_root))

        @config
        @given(data=st.data())
        def prop_prepared(data: st.DataObject) -> None:
            check_prepared(tally, data.draw(mutated(base)))

        prop_prepared()
    elif kind == "corpus":

        @config
        @given(data=st.data())
        def prop_corpus(data: st.DataObject) -> None:
            check_corpus_bytes(tally, data.draw(mutated(corpus_document())))

        prop_corpus()
    else:

        @config
        @given(data=st.data())
        def prop_report(data: st.DataObject) -> None:
            doc = data.draw(st.sampled_from(report_documents()))
            check_report(tally, data.draw(mutated(doc)))

        prop_report()
    return tally


KINDS = ("operator", "prepared", "corpus", "report")


def _first_number_marked(node: Doc) -> bool:
    """Replace the first integer found (depth first) with the long-integer mark."""
    items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
    for key, value in items:
        if isinstance(value, int) and not isinstance(value, bool):
            node[key] = _LONG_INTEGER_MARK
            return True
        if isinstance(value, dict | list) and _first_number_marked(value):
            return True
    return False


def test_an_integer_of_5000_digits_ends_in_typed_refusals_for_every_reader(
    tmp_path: Path,
) -> None:
    """Each kind's reader, given its valid document with its first integer 5,000 digits long,
    refuses it typed (the report reader raised a bare ValueError)."""
    bases = {
        "operator": valid_document,
        "prepared": lambda: copy.deepcopy(prepared_document(str(tmp_path))),
        "corpus": lambda: {**copy.deepcopy(corpus_document()), "version": _LONG_INTEGER_MARK},
        "report": lambda: copy.deepcopy(report_documents()[0]),
    }
    for kind, base in bases.items():
        doc = base()
        assert kind == "corpus" or _first_number_marked(doc), kind
        data = with_long_integer(doc)
        assert LONG_INTEGER.encode() in data
        tally = Tally()
        if kind == "operator":
            with pytest.raises(Refused) as refused:
                validate_operator_document(data)
            well_formed(refused.value)
            tally.refused += 1
        elif kind == "prepared":
            check_prepared(tally, data)
        elif kind == "corpus":
            check_corpus_bytes(tally, data)
        else:
            check_report(tally, data)
        assert tally.refused == 1, kind


@pytest.mark.parametrize("kind", KINDS)
def test_a_few_mutated_documents_of_each_kind_end_in_a_model_or_typed_refusals(
    kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tally = fuzz(kind, FUZZ_SHORT_EXAMPLES, tmp_path_factory.getbasetemp())
    assert tally.checked >= FUZZ_SHORT_EXAMPLES


@pytest.mark.long
@pytest.mark.parametrize("kind", KINDS)
def test_long_fuzz_of_each_kind(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    tally = fuzz(kind, FUZZ_LONG_EXAMPLES, tmp_path_factory.getbasetemp())
    # Printed for docs/reliability.md (`just fuzz-long` runs with -s).
    print(f"\nfuzz-long {kind}: {tally.checked} documents checked, {tally.refused} refused typed")
    assert tally.checked >= FUZZ_LONG_EXAMPLES


def test_a_prepared_sha256_that_is_not_hex_is_refused_typed_not_a_key_error(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Found by the long fuzz: one flipped byte in a prepared input's catalog SHA-256 raised
    KeyError (the prepared code had no registered hint) instead of a refusal."""
    doc = copy.deepcopy(prepared_document(str(tmp_path_factory.getbasetemp())))
    doc["catalog"]["sha256"] = "v" + doc["catalog"]["sha256"][1:]
    with pytest.raises(Refused) as refused:
        decode_document(json.dumps(doc).encode(), PreparedInput, what="prepared input")
    assert [(r.code, r.path) for r in refused.value.refusals] == [
        ("prepared.invalid", "$.catalog.sha256")
    ]
    assert "SHA-256 'v" in refused.value.refusals[0].message


def test_a_prepared_row_key_that_is_not_text_is_refused_typed_not_a_type_error(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Found by the long fuzz: a row whose ``key`` is a list raised TypeError (unhashable)
    while rows were matched with their model observations."""
    doc = copy.deepcopy(prepared_document(str(tmp_path_factory.getbasetemp())))
    doc["rows"][-1]["key"] = []
    with pytest.raises(Refused) as refused:
        decode_document(json.dumps(doc).encode(), PreparedInput, what="prepared input")
    assert {r.code for r in refused.value.refusals} == {"prepared.invalid"}
