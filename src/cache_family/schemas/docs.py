"""The README's operator input reference, rendered from the models themselves.

Rows come from walking the models' fields and their rule metadata, so a changed bound, field or
refusal code changes the generated text and the README test notices. Pure: ``just readme-
fields`` writes the result.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from cache_family.schemas import operator
from cache_family.schemas.openai_host import OPENAI_HOST_REFUSAL_CODES
from cache_family.schemas.refusal_codes import OPERATOR_REFUSAL_CODES

README_BEGIN = "<!-- operator-fields:begin -->"
README_END = "<!-- operator-fields:end -->"
README_HEADING = "## Operator input reference"


@dataclass(frozen=True, slots=True)
class FieldRow:
    field: str
    type: str
    default: str
    rule: str


@dataclass(frozen=True, slots=True)
class _Shape:
    """What one annotation says: its type in words, its rules, and a model to expand."""

    text: str
    rules: tuple[str, ...]
    model: type[BaseModel] | None
    model_suffix: str  # how nested rows are named below this field, e.g. ".<NAME>"


def _metadata_rules(metadata: list[Any] | tuple[Any, ...]) -> list[str]:
    rules: list[str] = []
    for item in metadata:
        if isinstance(item, operator.Rule):
            rules.append(item.text)
        else:
            func = getattr(item, "func", None)  # AfterValidator(rule object)
            rule = getattr(func, "rule", None)
            if isinstance(rule, str):
                rules.append(rule)
    return rules


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _shape(annotation: Any) -> _Shape:
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *metadata = get_args(annotation)
        inner = _shape(base)
        return _Shape(
            inner.text,
            (*_metadata_rules(metadata), *inner.rules),
            inner.model,
            inner.model_suffix,
        )
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1 and len(get_args(annotation)) == 2:
            inner = _shape(members[0])
            return _Shape(f"{inner.text} or null", inner.rules, inner.model, inner.model_suffix)
        raise TypeError(f"no words for the union {annotation!r}")
    if origin is list:
        (item,) = get_args(annotation)
        inner = _shape(item)
        rules = tuple(f"each {r}" for r in inner.rules)
        return _Shape(f"array of {inner.text}", rules, inner.model, "[]")
    if origin is dict:
        key, value = get_args(annotation)
        inner = _shape(value)
        rules = tuple(f"each value {r}" for r in inner.rules)
        return _Shape(f"object of {_shape(key).text} → {inner.text}", rules, inner.model, ".<NAME>")
    if origin is Literal:
        values = get_args(annotation)
        kinds = {_shape(type(value)).text for value in values}
        if len(kinds) != 1:
            raise TypeError(f"no words for the literal {annotation!r}")
        allowed = " or ".join(json.dumps(value) for value in values)
        rule = f"must be {allowed}" if len(values) == 1 else f"one of {allowed}"
        return _Shape(kinds.pop(), (rule,), None, "")
    if _is_model(annotation):
        return _Shape("object", (), annotation, "")
    words = {int: "integer", str: "string", bool: "boolean"}
    if annotation in words:
        return _Shape(words[annotation], (), None, "")
    raise TypeError(f"no words for the type {annotation!r}")


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return f"`{json.dumps(info.default_factory())}`"  # type: ignore[call-arg]
    if info.default is PydanticUndefined:
        return "required"
    return f"`{json.dumps(info.default)}`"


def field_rows(model: type[BaseModel] = operator.OperatorInput, prefix: str = "") -> list[FieldRow]:
    """One row per field, nested models expanded beneath their field, in schema order."""
    rows: list[FieldRow] = []
    for name, info in model.model_fields.items():
        shape = _shape(info.annotation)
        words = [*_metadata_rules(info.metadata), *shape.rules]
        if info.description:
            words.append(info.description)
        full = f"{prefix}{name}"
        rows.append(FieldRow(full, shape.text, _default(info), "; ".join(words)))
        if shape.model is not None:
            rows.extend(field_rows(shape.model, f"{full}{shape.model_suffix}."))
    return rows


def _environment_rows() -> Iterator[tuple[str, str]]:
    free = (
        f"any value of 1..={operator.ENV_VALUE_MAX_BYTES} bytes without control or invisible "
        "format characters"
    )
    for name in operator.ENV_PLAIN_NAMES:
        yield f"`{name}`", free
    for first, second in operator.ENV_ALIAS_PAIRS:
        yield f"`{first}` = `{second}` (alias pair)", f"{free}; both names given: equal values"
    yield f"`{operator.ENV_GGML_PREFIX}*` (other)", free
    yield (
        "secret-looking names, refused whatever they start with: containing "
        + ", ".join(operator.ENV_SECRET_MARKERS)
        + "; or with a whole segment (split at `_`, digits and case changes) "
        + ", ".join(operator.ENV_SECRET_WORDS),
        "none (`operator.environment.secret_name`)",
    )


def _cell(text: str) -> str:
    """Escape a table cell; `*` outside code spans would otherwise start emphasis."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("*", "\\*") for i, p in enumerate(parts))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render_operator_reference() -> str:
    """The markdown that belongs between the README markers (without the markers)."""
    lines = [
        "<!-- generated by `just readme-fields` from src/cache_family/schemas/; "
        "edit the schema, not this table -->",
        "",
        "Every member of the operator input (`schema_version` 1). Unknown members are "
        'refused, and nothing is coerced: `"8"` is not 8 and `true` is not 1. '
        "`cache-family validate --input OP.json` reports every refusal of a document at once.",
        "",
    ]
    lines += _table(
        ("field", "type", "default", "rule"),
        [(f"`{r.field}`", r.type, r.default, r.rule) for r in field_rows()],
    )
    lines += ["", "### Environment names", ""]
    lines += _table(("name", "allowed values"), list(_environment_rows()))
    lines += ["", "### Refusal codes", ""]
    lines += _table(
        ("code", "meaning", "default hint"),
        [
            (f"`{c.code}`", c.meaning, c.hint)
            for codes in (OPERATOR_REFUSAL_CODES, OPENAI_HOST_REFUSAL_CODES)
            for c in codes.values()
            # In the operator input a mistyped declaration is refused member by member with
            # the operator.* codes, never as one openai_host.shape.
            if c.code != "openai_host.shape"
        ],
    )
    return "\n".join(lines) + "\n"


def marked_section(text: str) -> str | None:
    """The text between the README markers, or None when the markers are absent."""
    start = text.find(README_BEGIN)
    end = text.find(README_END)
    if start < 0 or end < start:
        return None
    return text[start + len(README_BEGIN) : end].strip("\n") + "\n"


def replace_marked_section(text: str, body: str) -> str:
    """``text`` with ``body`` between the markers; heading and markers appended if absent."""
    block = f"{README_BEGIN}\n{body.rstrip()}\n{README_END}"
    start = text.find(README_BEGIN)
    end = text.find(README_END)
    if start < 0 or end < start:
        return f"{text.rstrip()}\n\n{README_HEADING}\n\n{block}\n"
    return text[:start] + block + text[end + len(README_END) :]
