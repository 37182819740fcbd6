"""The README's operator input reference is generated from the schema and kept current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import AfterValidator

from cache_family.schemas import operator
from cache_family.schemas.docs import (
    README_BEGIN,
    README_END,
    README_HEADING,
    field_rows,
    marked_section,
    render_operator_reference,
    replace_marked_section,
)
from cache_family.schemas.refusal_codes import OPERATOR_REFUSAL_CODES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_section_matches_the_schema() -> None:
    section = marked_section(README.read_text(encoding="utf-8"))
    assert section is not None, (
        f"README.md lacks the {README_BEGIN} ... {README_END} markers; run `just readme-fields`"
    )
    assert section == render_operator_reference(), (
        "README.md's operator input reference is stale; run `just readme-fields`"
    )


def test_every_field_and_code_is_documented() -> None:
    names = {row.field for row in field_rows()}
    assert set(operator.OperatorInput.model_fields) <= names
    assert {f"plan.{name}" for name in operator.PlanInput.model_fields} <= names
    assert "toolkit_directories.<NAME>.sha256" in names
    text = render_operator_reference()
    for code in OPERATOR_REFUSAL_CODES:
        assert f"| `{code}` |" in text


def test_rows_follow_the_schema_metadata() -> None:
    rows = {row.field: row for row in field_rows()}
    assert rows["execution_seconds"].rule.startswith("30..=86400")
    assert rows["plan.concurrency"].type == "array of integer"
    assert "each 1..=1024" in rows["plan.concurrency"].rule
    assert rows["plan.prefix_tokens"].type == "integer or null"
    assert rows["environment"].default == "`{}`"
    assert rows["borrow_resident_hits"].default == "`false`"
    assert rows["plan.catalog"].default == "`null`"
    assert rows["correctness"].default == "required"
    assert rows["plan.old_server.sha256"].type == "string or null"


def test_a_changed_bound_changes_the_table() -> None:
    field = operator.OperatorInput.model_fields["cell_seconds"]
    original = list(field.metadata)
    try:
        field.metadata[:] = [
            AfterValidator(operator.IntRange(15, 7200, "operator.budget.out_of_range"))
        ]
        changed = {row.field: row for row in field_rows()}["cell_seconds"]
    finally:
        field.metadata[:] = original
    assert changed.rule.startswith("15..=7200")


def test_replacing_the_section_keeps_the_rest_of_the_readme() -> None:
    text = f"# Title\n\nintro\n\n{README_BEGIN}\nold\n{README_END}\n\n## After\n"
    replaced = replace_marked_section(text, "new table\n")
    assert replaced == f"# Title\n\nintro\n\n{README_BEGIN}\nnew table\n{README_END}\n\n## After\n"
    appended = replace_marked_section("# Title\n", "body\n")
    assert appended == f"# Title\n\n{README_HEADING}\n\n{README_BEGIN}\nbody\n{README_END}\n"
    assert marked_section(appended) == "body\n"


def test_the_generator_script_checks_and_rewrites(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nprose stays\n", encoding="utf-8")
    script = ROOT / "scripts" / "gen_readme_fields.py"
    run = [sys.executable, str(script), "--readme", str(readme)]
    env = {"PATH": str(Path(sys.executable).parent), "LC_ALL": "C.UTF-8"}
    stale = subprocess.run([*run, "--check"], capture_output=True, text=True, timeout=120, env=env)
    assert stale.returncode == 1 and "just readme-fields" in stale.stdout
    written = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    assert written.returncode == 0, written.stderr
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# Project\n\nprose stays\n")
    assert marked_section(text) == render_operator_reference()
    fresh = subprocess.run([*run, "--check"], capture_output=True, text=True, timeout=120, env=env)
    assert fresh.returncode == 0
