"""The README's complete operator input example stays valid, and the options its opening
sections name exist."""

from __future__ import annotations

import re
from pathlib import Path

from cache_family.cli import build_parser
from cache_family.oracles.demo import PLANS, _parser
from cache_family.schemas.operator import validate_operator_document

README = Path(__file__).resolve().parents[2] / "README.md"


def operator_example() -> bytes:
    text = README.read_text(encoding="utf-8")
    match = re.search(
        r"<!-- operator-example:begin -->\n```json\n(.*?)```\n<!-- operator-example:end -->",
        text,
        re.S,
    )
    assert match is not None, "README.md lacks the operator-example block"
    return match.group(1).encode("utf-8")


def test_the_readme_operator_example_is_accepted_by_the_validator() -> None:
    operator = validate_operator_document(operator_example())
    assert operator.plan.old_server is not None and operator.plan.new_server is not None
    assert operator.native_server is not None and operator.artifact_tool is not None


def test_the_demo_and_run_options_the_readme_names_exist() -> None:
    text = README.read_text(encoding="utf-8")
    demo_help = _parser().format_help()
    for flag in re.findall(r"\./bootstrap demo (--[a-z-]+)", text):
        assert flag in demo_help, flag
        assert flag[2:] in PLANS or flag in ("--quiet", "--hosts"), flag
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    run_help = run.format_help()
    for flag in ("--quiet", "--json-events"):
        assert f"run {flag}" in text and flag in run_help
