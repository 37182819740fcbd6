"""Validating a document: two passes over the same bytes, so one run names every problem.

Pass 1 is pydantic (no coercion), pass 2 the cross checks; pydantic's errors become refusals in
one place (``_translate``). Size, nesting and container lengths are bounded first, so every
later step is linear in its input.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from cache_family.errors import Refusal, RefusalCap, Refused, json_path
from cache_family.schemas.json_shape import containers
from cache_family.schemas.operator.cross_checks import (
    _operator_cross_entry,
    _plan_cross_entry,
    _refusal,
)
from cache_family.schemas.operator.limits import (
    DOCUMENT_MAX_BYTES,
    JSON_MAX_DEPTH,
    JSON_MAX_ENTRIES,
    JSON_MAX_VALUES,
    Loc,
)
from cache_family.schemas.operator.models import _PASS_TWO_DONE, OperatorInput, PlanInput
from cache_family.schemas.refusal_codes import default_hint

_M = TypeVar("_M", bound=BaseModel)

_EXPECTED: Final[Mapping[str, str]] = {
    "int_type": "an integer",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
    "invalid_key": "a string member name",
}


def _json_kind(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int():
            return "an integer"
        case float():
            return "a number with a fraction or exponent"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return f"a Python {type(value).__name__}"


def _loc(parts: Iterable[object]) -> Loc:
    return tuple(p if isinstance(p, str | int) else str(p) for p in parts if p != "[key]")


def _translate(error: ErrorDetails, base: Loc) -> list[tuple[Loc, Refusal]]:
    kind = error["type"]
    loc = (*base, *_loc(error["loc"]))
    ctx: Mapping[str, Any] = error.get("ctx") or {}
    if "." in kind:  # one of ours, raised by a rule above
        carried = ctx.get("refusals")
        if isinstance(carried, tuple) and carried:
            return [(loc, r) for r in carried if isinstance(r, Refusal)]
        return [
            (
                loc,
                Refusal(
                    kind,
                    json_path(loc),
                    str(ctx.get("message", error["msg"])),
                    str(ctx.get("hint", default_hint(kind))),
                ),
            )
        ]
    name = str(loc[-1]) if loc else "document"
    if kind == "missing":
        return [_refusal("operator.missing_field", loc, f"required member {name!r} is missing")]
    if kind == "extra_forbidden":
        return [_refusal("operator.unknown_field", loc, f"unknown member {name!r}")]
    expected = _EXPECTED.get(kind)
    got = _json_kind(error.get("input"))
    if expected is None:
        return [_refusal("operator.type", loc, f"{error['msg']} (got {got})")]
    return [_refusal("operator.type", loc, f"expected {expected}, got {got}")]


def _order(loc: Loc) -> tuple[int, int]:
    """Document order: the schema's field order, then the plan's; unknown members last."""
    fields = list(OperatorInput.model_fields)
    top = fields.index(loc[0]) if loc and loc[0] in fields else len(fields)
    plan_fields = list(PlanInput.model_fields)
    inner = (
        plan_fields.index(loc[1])
        if len(loc) > 1 and loc[0] == "plan" and loc[1] in plan_fields
        else len(plan_fields)
    )
    return top, inner


def _capped() -> RefusalCap:
    return RefusalCap("operator.more_refusals", default_hint("operator.more_refusals"))


def _group(loc: Loc) -> str:
    """Refusals are capped per code under each top-level member (the document's own: "$")."""
    return json_path(loc[:1]) if len(loc) > 1 else "$"


def _ordered(found: Sequence[tuple[Loc, Refusal]]) -> tuple[Refusal, ...]:
    """In document order, at most a few of each code under each top-level member."""
    cap = _capped()
    for loc, refusal in dict.fromkeys(sorted(found, key=lambda item: _order(item[0]))):
        cap.add(refusal, _group(loc))
    return cap.refusals()


def _pass_one(
    model: type[_M], obj: object, base: Loc
) -> tuple[_M | None, list[tuple[Loc, Refusal]]]:
    try:
        return model.model_validate(obj, strict=True, context=_PASS_TWO_DONE), []
    except ValidationError as exc:
        found: list[tuple[Loc, Refusal]] = []
        for error in exc.errors():
            found.extend(_translate(error, base))
        return None, found


# --------------------------------------------------------------------------------------
# Public entry points.


def _unexplained(path: str) -> Refusal:
    # Unreachable while pydantic reports at least one error per failure; kept so that a
    # future pydantic cannot turn a refusal into a bare exception.
    return Refusal("operator.type", path, "the document was refused", default_hint("operator.type"))


def _containers(root: object, base: Loc) -> Iterator[tuple[list[Any] | dict[Any, Any], Loc, int]]:
    return containers(root, base, max_depth=JSON_MAX_DEPTH, max_entries=JSON_MAX_ENTRIES)


def _bounded_shape(root: object, base: Loc) -> tuple[object, list[tuple[Loc, Refusal]]]:
    """Bound the document's nesting and container sizes before any per-entry work.

    Every later step (surrogate cleaning, pydantic, the cross-entry rules, one refusal per
    bad entry) is linear in what it is given; without this a 1 MiB array of bad entries
    produced half a million refusals, and a few hundred nested arrays a RecursionError.
    Too deep refuses the document outright, and so do more than JSON_MAX_VALUES values in
    all (many containers of bad entries: pydantic alone took 230 MB to list their errors);
    an over-long container is refused and only its first JSON_MAX_ENTRIES entries are
    checked further.
    """
    found: list[tuple[Loc, Refusal]] = []
    values = 0
    for node, loc, depth in _containers(root, base):
        if depth > JSON_MAX_DEPTH:
            message = f"the document nests deeper than {JSON_MAX_DEPTH} levels here"
            raise Refused((_refusal("operator.json.too_deep", loc, message)[1],))
        values += min(len(node), JSON_MAX_ENTRIES)
        if len(node) > JSON_MAX_ENTRIES:
            what = "array" if isinstance(node, list) else "object"
            found.append(
                _refusal(
                    "operator.json.too_many_entries",
                    loc,
                    f"the {what} has {len(node)} entries, more than {JSON_MAX_ENTRIES}; "
                    f"only the first {JSON_MAX_ENTRIES} were checked",
                )
            )
    if values > JSON_MAX_VALUES:
        message = (
            f"the document's arrays and objects hold more than {JSON_MAX_VALUES} values "
            f"({values} counted); none was checked further"
        )
        raise Refused((_refusal("operator.json.too_many_values", base, message)[1],))
    return (_truncated(root) if found else root), found


def _truncated(node: object) -> object:
    # Recursion is safe here: _bounded_shape has already bounded the depth.
    if isinstance(node, list):
        return [_truncated(item) for item in node[:JSON_MAX_ENTRIES]]
    if isinstance(node, dict):
        return {
            key: _truncated(item) for key, item in itertools.islice(node.items(), JSON_MAX_ENTRIES)
        }
    return node


_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(value: object, loc: Loc, found: list[tuple[Loc, Refusal]]) -> object:
    """Replace unpaired surrogates (valid JSON escapes, invalid Unicode) and refuse each one.

    pydantic gives up on a whole object when a member name holds one, which would hide every
    other refusal of the document; cleaning first keeps them all reportable.
    """
    if isinstance(value, str):
        if _SURROGATE.search(value):
            found.append(
                _refusal(
                    "operator.text.surrogate",
                    loc,
                    "the text holds an unpaired UTF-16 surrogate escape",
                )
            )
            return _SURROGATE.sub("\ufffd", value)
        return value
    if isinstance(value, list):
        return [_without_surrogates(item, (*loc, i), found) for i, item in enumerate(value)]
    if isinstance(value, dict):
        cleaned: dict[object, object] = {}
        for key, item in value.items():
            name = key
            if isinstance(key, str) and _SURROGATE.search(key):
                name = _SURROGATE.sub("\ufffd", key)
                found.append(
                    _refusal(
                        "operator.text.surrogate",
                        (*loc, name),
                        "the member name holds an unpaired UTF-16 surrogate escape",
                    )
                )
            cleaned[name] = _without_surrogates(item, (*loc, str(name)), found)
        return cleaned
    return value


def validate_operator_object(obj: object) -> OperatorInput:
    """Validate decoded JSON; raise :class:`Refused` carrying every refusal found."""
    if not isinstance(obj, dict):
        raise Refused.one(
            "operator.type",
            "$",
            f"the operator input is {_json_kind(obj)}, not an object",
            default_hint("operator.type"),
        )
    obj, found = _bounded_shape(obj, ())
    obj = _without_surrogates(obj, (), found)
    assert isinstance(obj, dict)
    model, structural = _pass_one(OperatorInput, obj, ())
    found += structural
    found += _operator_cross_entry(obj)
    if found or model is None:
        raise Refused(_ordered(found) or (_unexplained("$"),))
    return model


def validate_plan_object(obj: object) -> PlanInput:
    """Validate a plan on its own (e.g. after CLI overrides); paths read ``$.plan...``."""
    base: Loc = ("plan",)
    if not isinstance(obj, dict):
        raise Refused.one(
            "operator.type",
            json_path(base),
            f"the plan is {_json_kind(obj)}, not an object",
            default_hint("operator.type"),
        )
    obj, found = _bounded_shape(obj, base)
    assert isinstance(obj, dict)
    model, structural = _pass_one(PlanInput, obj, base)
    found += structural
    found += _plan_cross_entry(obj, base)
    if found or model is None:
        raise Refused(_ordered(found) or (_unexplained(json_path(base)),))
    return model


class _Members(dict[str, Any]):
    """A decoded JSON object that remembers member names it saw more than once."""

    repeated: tuple[str, ...] = ()


def _members(pairs: list[tuple[str, Any]]) -> _Members:
    obj = _Members(pairs)
    if len(obj) != len(pairs):
        counts = Counter(name for name, _ in pairs)
        obj.repeated = tuple(name for name, count in counts.items() if count > 1)
    return obj


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _repeated_members(root: object) -> tuple[Refusal, ...]:
    cap = _capped()
    for node, loc, _ in _containers(root, ()):
        for name in getattr(node, "repeated", ()):
            at = (*loc, name)
            message = f"member {name!r} appears more than once"
            cap.add(_refusal("operator.json.duplicate_key", at, message)[1], _group(at))
    listed = sorted(cap.listed, key=lambda r: r.path)
    return (*listed, *cap.refusals()[len(listed) :])


def validate_operator_document(data: bytes) -> OperatorInput:
    """Decode UTF-8 JSON bytes and validate them; raise :class:`Refused` on any problem."""
    if len(data) > DOCUMENT_MAX_BYTES:
        raise Refused.one(
            "operator.json.too_large",
            "$",
            f"the operator input has {len(data)} bytes, more than {DOCUMENT_MAX_BYTES}",
            default_hint("operator.json.too_large"),
        )
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the operator input is not UTF-8 (byte {exc.start})",
            default_hint("operator.json.decode"),
        ) from None
    try:
        obj = json.loads(text, object_pairs_hook=_members, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the operator input is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            default_hint("operator.json.decode"),
        ) from None
    except RecursionError:
        raise Refused.one(
            "operator.json.too_deep",
            "$",
            f"the document nests deeper than {JSON_MAX_DEPTH} levels",
            default_hint("operator.json.too_deep"),
        ) from None
    except ValueError as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the operator input cannot be decoded: {exc}",
            default_hint("operator.json.decode"),
        ) from None
    repeated = _repeated_members(obj)
    try:
        model = validate_operator_object(obj)
    except Refused as refused:
        raise Refused((*repeated, *refused.refusals)) from None
    if repeated:
        raise Refused(tuple(repeated))
    return model
