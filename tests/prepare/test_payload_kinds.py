"""Only resident-kv and kv-recurrent are production cache modes: anything else (the
reference's experimental full-state included) is refused with that reason wherever a
payload is read: the catalog loader, a plan's own catalog, a prepared input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, get_args

import pytest
from hub_fixture import build_toolbox
from preparation_harness import prepare, write_operator

from cache_family.cli import main
from cache_family.errors import Refused
from cache_family.schemas.catalog import (
    PRODUCTION_PAYLOADS,
    Payload,
    load_catalog,
    packaged_catalog,
)
from cache_family.schemas.prepared import (
    CorrectnessProfile,
    CorrectnessTask,
    PreparedRow,
    read_prepared_input,
)

NOT_PRODUCTION = ["full-state", "FullState", "resident_kv", "", "kv-recurrent "]


def test_one_list_of_production_payloads_everywhere() -> None:
    assert set(get_args(Payload)) == set(PRODUCTION_PAYLOADS)
    for model in (PreparedRow, CorrectnessTask, CorrectnessProfile):
        annotation = model.model_fields["payload"].annotation
        assert set(get_args(annotation)) == set(PRODUCTION_PAYLOADS), model.__name__


def _catalog_with(tmp_path: Path, payload: str, index: int = 0) -> Path:
    document = json.loads(Path(packaged_catalog().path).read_bytes())
    document["presets"][index]["payload"] = payload
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("payload", NOT_PRODUCTION)
def test_the_catalog_loader_refuses_a_payload_that_is_not_a_production_mode(
    tmp_path: Path, payload: str
) -> None:
    with pytest.raises(Refused) as refused:
        load_catalog(str(_catalog_with(tmp_path, payload, index=3)))
    (refusal,) = refused.value.refusals
    assert (refusal.code, refusal.path) == (
        "catalog.payload.not_production",
        "$.presets[3].payload",
    )
    assert "not a production cache mode" in refusal.message
    assert "resident-kv and kv-recurrent" in refusal.message


def test_a_plan_naming_a_full_state_catalog_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    box = build_toolbox(tmp_path / "box", ("llama",))
    catalog = _catalog_with(tmp_path, "full-state")
    pin = {"path": str(catalog), "sha256": hashlib.sha256(catalog.read_bytes()).hexdigest()}
    operator = write_operator(box, tmp_path / "operator.json", catalog=pin, cases=["llama"])
    out = tmp_path / "out"
    code, stdout, err = prepare(box, out, operator=operator)
    assert (code, stdout) == (2, "")
    assert "refused: catalog.payload.not_production at $.presets[0].payload" in err
    assert not out.exists()


def _prepared(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    from run_harness import make_prepared

    path = make_prepared(tmp_path / "prep")
    return path, json.loads(path.read_bytes())


def _edit_row(document: dict[str, Any], payload: str) -> str:
    document["rows"][0]["payload"] = payload
    return "$.rows[0].payload"


def _edit_task(document: dict[str, Any], payload: str) -> str:
    document["rows"][0]["tasks"]["correctness"]["payload"] = payload
    return "$.rows[0].tasks.correctness.payload"


def _edit_profile(document: dict[str, Any], payload: str) -> str:
    key = next(iter(document["profiles"]))
    document["profiles"][key]["correctness"]["payload"] = payload
    return f"$.profiles.{key}.correctness.payload"


@pytest.mark.parametrize("edit", [_edit_row, _edit_task, _edit_profile])
def test_prepared_input_admission_refuses_a_full_state_payload(tmp_path: Path, edit: Any) -> None:
    path, document = _prepared(tmp_path)
    where = edit(document, "full-state")
    path.write_text(json.dumps(document))
    with pytest.raises(Refused) as refused:
        read_prepared_input(str(path))
    assert [(r.code, r.path) for r in refused.value.refusals] == [
        ("prepared.payload.not_production", where)
    ]
    assert "not a production cache mode" in str(refused.value)


def test_run_refuses_a_full_state_prepared_input_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, document = _prepared(tmp_path)
    _edit_row(document, "full-state")
    path.write_text(json.dumps(document))
    out = tmp_path / "run"
    assert main(["run", "--input", str(path), "--output", str(out)]) == 2
    assert "refused: prepared.payload.not_production at $.rows[0].payload" in (
        capsys.readouterr().err
    )
    assert not out.exists()


def test_a_use_case_prepared_input_cannot_record_an_unused_corpus(tmp_path: Path) -> None:
    path, document = _prepared(tmp_path)
    document["mode"] = "use-cases"
    document["unused_corpus"] = {"path": "/c.json", "reason": "r"}
    path.write_text(json.dumps(document))
    with pytest.raises(Refused) as refused:
        read_prepared_input(str(path))
    assert "mode use-cases records no unused corpus" in str(refused.value)
