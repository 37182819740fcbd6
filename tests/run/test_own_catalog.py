"""An operator's own catalog names its own preset keys and families, prepared and run for
real (a zoo model re-keyed, so the row stays fast and labelled synthetic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_run_harness import cli, operator_for, sha256_of

from cache_family.oracles.native_parts import Parts
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix

pytestmark = pytest.mark.native


def _own_catalog(parts: Parts, path: Path) -> None:
    zoo = json.loads(parts.zoo_catalog.read_text())
    [llama] = [p for p in zoo["presets"] if p["key"] == "llama"]
    own = {**llama, "key": "my_llama", "family": "My Llama"}
    path.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "synthetic": True,
                "family_order": ["My Llama"],
                "use_case_order": zoo["use_case_order"],
                "presets": [own],
            },
            indent=2,
        )
    )


def test_a_catalog_with_its_own_keys_and_family_is_prepared_and_run(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    catalog = tmp_path / "my-catalog.json"
    _own_catalog(native_parts, catalog)
    operator = operator_for(native_parts, oracle_tools, tmp_path, ["my_llama"])
    document = json.loads(operator.read_text())
    document["plan"]["catalog"] = {"path": str(catalog), "sha256": sha256_of(catalog)}
    document["plan"]["concurrency"] = [1]
    operator.write_text(json.dumps(document))

    validated = cli("validate", "--input", str(operator), cwd=tmp_path)
    assert validated.returncode == 0, validated.stderr
    prepared = tmp_path / "prepared"
    prepare = cli("prepare-full", "--input", str(operator), "--output", str(prepared), cwd=tmp_path)
    assert prepare.returncode == 0, prepare.stderr
    out = tmp_path / "run"
    ran = cli(
        "run", "--input", str(prepared / "cache-family-input.json"), "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed"
    assert matrix.catalog is not None and matrix.catalog.path == str(catalog)
    assert [(r.case, r.result.status) for r in matrix.rows] == [("my_llama", "completed")]
    [entry] = json.loads((out / "production-cache-bench.json").read_bytes())
    assert entry["family"] == "My Llama"

    # A key the operator's catalog does not hold is refused by preparation, against it.
    document["plan"]["cases"] = ["llama"]
    operator.write_text(json.dumps(document))
    refused = cli(
        "prepare-full", "--input", str(operator), "--output", str(tmp_path / "again"),
        cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "planning.unknown_case" in refused.stderr and "my_llama" in refused.stderr
