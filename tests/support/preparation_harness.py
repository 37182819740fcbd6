"""Helpers several test modules share (they were in test_preparation.py)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from hub_fixture import (
    Toolbox,
    build_toolbox,
    operator_document,
)

from cache_family.console.preparation import run_prepare

PRESENT = ("llama", "minimax_m27", "deepseek3")


@pytest.fixture
def box(tmp_path: Path) -> Toolbox:
    return build_toolbox(tmp_path / "box", PRESENT)


def write_operator(
    box: Toolbox, path: Path, top: dict[str, object] | None = None, **plan: object
) -> Path:
    document = operator_document(box, **plan)
    document.update(top or {})
    path.write_text(json.dumps(document))
    return path


def base_environ() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", os.defpath)}


def prepare(
    box: Toolbox,
    out: Path,
    *overrides: str,
    command: str = "prepare-full",
    operator: Path | None = None,
    environ: dict[str, str] | None = None,
    **plan: object,
) -> tuple[int, str, str]:
    op = operator or write_operator(box, box.root / "operator.json", **plan)
    stdout, stderr = io.StringIO(), io.StringIO()
    code = run_prepare(
        command,
        str(op),
        str(out),
        list(overrides),
        environ=environ or base_environ(),
        stdout=stdout,
        stderr=stderr,
    )
    return code, stdout.getvalue(), stderr.getvalue()
