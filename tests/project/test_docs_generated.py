"""Documents generated from code must match the code they describe."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_state_machine_document_matches_the_tables() -> None:
    script = _script("gen_state_machine_doc")
    current = (ROOT / "docs" / "state-machines.md").read_text(encoding="utf-8")
    assert current == script.render(), "docs/state-machines.md is stale: run `just docs`"


def test_state_machine_document_lists_every_cell_state() -> None:
    from cache_family.states.cell import CellState

    text = (ROOT / "docs" / "state-machines.md").read_text(encoding="utf-8")
    for state in CellState:
        assert f"| {state.value} |" in text or f"--> {state.value}" in text
