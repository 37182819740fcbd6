"""The operator declares an OpenAI-compatible server (``openai_server``): the operator input
refuses a malformed declaration with the declaration's own codes at the document's paths, and
preparation pins its binary (and its own tree) and writes every case's ``openai`` profile from
those pins and the case's own model. Without a declaration the prepared input keeps its bytes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hub_fixture import Toolbox, build_toolbox, operator_document, write_tool
from preparation_harness import PRESENT, base_environ, prepare, write_operator

from cache_family.actors.prepare.admission import admit
from cache_family.actors.prepare.worker import WorkerRecord, observe
from cache_family.errors import Refused
from cache_family.schemas.docs import render_operator_reference
from cache_family.schemas.examples import example_operator
from cache_family.schemas.openai_host import OPENAI_HOST_REFUSAL_CODES
from cache_family.schemas.operator import validate_operator_object
from cache_family.schemas.prepared import PreparationRequest, PreparedInput, encode_document
from cache_family.system.pins import Budget, pin_tree

SERVING: dict[str, Any] = {
    "schema_version": 1,
    "module": None,
    "args": ["--model", "{model}", "--alias", "{model_id}", "--host", "{host}", "--port", "{port}"],
    "dialects": ["completions", "chat"],
    "block_size": 16,
    "metrics_path": "/metrics",
    "listening_text": "listening on http://127.0.0.1:{port}",
}


def declared(server: Path, **changes: Any) -> dict[str, Any]:
    declaration: dict[str, Any] = {"binary": str(server), "serving": copy.deepcopy(SERVING)}
    serving = changes.pop("serving", {})
    declaration["serving"].update(serving)
    declaration.update(changes)
    return declaration


@pytest.fixture
def box(tmp_path: Path) -> Toolbox:
    return build_toolbox(tmp_path / "box", PRESENT)


class SilentEvents:
    def emit(self, **event: object) -> None:
        del event

    def phase(self, text: str) -> None:
        del text

    clock = staticmethod(lambda: 0.0)


def observed(box: Toolbox, tmp_path: Path, top: dict[str, object] | None = None) -> PreparedInput:
    operator = write_operator(box, tmp_path / "operator.json", top)
    admission = admit(
        "prepare-full", str(operator), str(tmp_path / "unused"), [], environ=base_environ()
    )
    request = PreparationRequest(
        schema_version=1,
        mode=admission.mode,
        operator=admission.operator,
        corpus_source=admission.corpus_source,
        worker_budget_ms=60_000,
    )
    return observe(request, Budget.seconds(60), SilentEvents(), WorkerRecord())  # type: ignore[arg-type]


# --- the operator input ------------------------------------------------------------------------

MISTAKES = [
    ({"serving": {"args": ["--port", "{port}", "{gpu}"]}}, "openai_host.args.unknown_placeholder"),
    ({"serving": {"args": ["--host", "{host}"]}}, "openai_host.args.no_port"),
    ({"serving": {"args": ["--host=0.0.0.0", "{port}"]}}, "openai_host.args.beyond_loopback"),
    ({"serving": {"dialects": ["chat", "chat"]}}, "openai_host.dialects.empty_or_repeated"),
    ({"serving": {"block_size": 65537}}, "openai_host.block_size.range"),
    ({"serving": {"metrics_path": "metrics"}}, "openai_host.metrics_path.not_absolute"),
    ({"serving": {"listening_text": "ready"}}, "openai_host.listening_text.no_port"),
    ({"serving": {"dialects": ["responses"]}}, "operator.type"),
    ({"serving": {"block_size": "16"}}, "operator.type"),
    ({"serving": {"extra": True}}, "operator.unknown_field"),
    ({"binary": "bin/server"}, "operator.path.not_absolute"),
    ({"tree": "/opt/venv/"}, "operator.path.not_normalized"),
    ({"source_commit": "HEAD"}, "operator.commit.bad_hex"),
]


@pytest.mark.parametrize(("changes", "code"), MISTAKES)
def test_a_malformed_declaration_is_refused_with_its_code_at_its_path(
    box: Toolbox,
    changes: dict[str, Any],
    code: str,
) -> None:
    document = operator_document(box)
    document["openai_server"] = declared(box.native_server, **changes)
    with pytest.raises(Refused) as refused:
        validate_operator_object(document)
    (refusal,) = refused.value.refusals
    assert refusal.code == code
    member = next(iter(changes))
    inner = changes[member]
    where = f"$.openai_server.{member}" + (f".{next(iter(inner))}" if member == "serving" else "")
    assert refusal.path.startswith(where), refusal
    assert refusal.hint


def test_every_mistake_of_a_declaration_is_reported_at_once(box: Toolbox) -> None:
    document = operator_document(box)
    document["openai_server"] = declared(
        box.native_server,
        serving={"args": ["--host", "::"], "block_size": 0, "listening_text": "up"},
    )
    with pytest.raises(Refused) as refused:
        validate_operator_object(document)
    assert sorted(refused.value.codes) == [
        "openai_host.args.beyond_loopback",
        "openai_host.args.no_port",
        "openai_host.block_size.range",
        "openai_host.listening_text.no_port",
    ]


def test_a_declaration_is_optional_and_absent_from_the_encoding(box: Toolbox) -> None:
    plain = validate_operator_object(operator_document(box))
    assert plain.openai_server is None
    assert "openai_server" not in plain.model_dump(mode="json")
    document = operator_document(box)
    document["openai_server"] = declared(box.native_server)
    operator = validate_operator_object(document)
    assert operator.openai_server is not None
    assert operator.openai_server.tree is None and operator.openai_server.source_commit is None
    assert operator.openai_server.serving.block_size == 16
    assert validate_operator_object(operator.model_dump(mode="json")) == operator


def test_prepare_refuses_a_malformed_declaration_before_any_work(
    box: Toolbox,
    tmp_path: Path,
) -> None:
    top = {"openai_server": declared(box.native_server, serving={"args": ["--x"]})}
    operator = write_operator(box, tmp_path / "operator.json", top)
    out = tmp_path / "out"
    code, _stdout, stderr = prepare(box, out, operator=operator)
    assert code != 0
    assert "openai_host.args.no_port" in stderr and "$.openai_server.serving.args" in stderr
    assert "Traceback" not in stderr
    assert not out.exists()


# --- preparation -------------------------------------------------------------------------------


def test_preparation_writes_each_case_a_profile_of_the_declared_server(
    box: Toolbox,
    tmp_path: Path,
) -> None:
    commit = "a" * 40
    top = {"openai_server": declared(box.native_server, source_commit=commit)}
    prepared = observed(box, tmp_path, top)
    native_build = pin_tree(str(box.native_build), Budget.seconds(60)).sha256
    planned = [key for key, profiles in prepared.profiles.items() if profiles.native is not None]
    assert planned
    for key in planned:
        profiles = prepared.profiles[key]
        native, openai = profiles.native, profiles.openai
        assert native is not None and openai is not None, key
        assert openai.host == "openai" and openai.source_commit == commit
        # The declared binary's bytes, the native build as its tree, the case's own model.
        assert (openai.binary, openai.binary_sha256) == (native.binary, native.binary_sha256)
        assert openai.native_build_sha256 == native_build
        assert (openai.model, openai.model_sha256) == (native.model, native.model_sha256)
        assert openai.model_id == native.model_id and openai.artifact == native.artifact
        assert openai.openai is not None and openai.openai.model_dump() == SERVING
    # A package-only case has no monolithic model to serve: no profile, as for the native one.
    for profiles in prepared.profiles.values():
        assert (profiles.openai is None) == (profiles.native is None)
    # The pins travel in the profile only: the prepared tools are the same as without it.
    plain = tmp_path / "plain"
    plain.mkdir()
    assert prepared.tools == observed(box, plain).tools


def test_a_declared_interpreter_tree_is_pinned_as_its_profiles_tree(
    box: Toolbox,
    tmp_path: Path,
) -> None:
    tree = tmp_path / "venv"
    python = write_tool(tree / "bin" / "python", "#!/bin/sh\necho python\n")
    write_tool(tree / "lib" / "server" / "__init__.py", "")
    top = {
        "openai_server": declared(
            python, tree=str(tree), serving={"module": "server", "dialects": ["chat"]}
        )
    }
    prepared = observed(box, tmp_path, top)
    openai = prepared.profiles["llama"].openai
    assert openai is not None and openai.openai is not None
    assert openai.native_build == str(tree.resolve())
    assert openai.native_build_sha256 == pin_tree(str(tree), Budget.seconds(60)).sha256
    assert openai.binary == str(python.resolve()) and openai.openai.module == "server"


def test_a_missing_declared_part_is_refused_typed(
    box: Toolbox,
    tmp_path: Path,
) -> None:
    top = {
        "openai_server": declared(tmp_path / "gone" / "server", tree=str(tmp_path / "absent-tree"))
    }
    with pytest.raises(Refused) as refused:
        observed(box, tmp_path, top)
    paths = {(r.code, r.path) for r in refused.value.refusals}
    assert ("pin.missing", "$.openai_server.binary") in paths
    assert any(path == "$.openai_server.tree" for _, path in paths), paths


def test_a_refused_preparation_keeps_the_declared_tree_it_pinned(
    box: Toolbox, tmp_path: Path
) -> None:
    tree = tmp_path / "venv"
    write_tool(tree / "bin" / "python")
    top = {"openai_server": declared(tmp_path / "gone", tree=str(tree))}
    operator = write_operator(box, tmp_path / "operator.json", top)
    admission = admit("prepare-full", str(operator), str(tmp_path / "unused"), [], environ={})
    request = PreparationRequest(
        schema_version=1,
        mode=admission.mode,
        operator=admission.operator,
        corpus_source=admission.corpus_source,
        worker_budget_ms=60_000,
    )
    record = WorkerRecord()
    with pytest.raises(Refused):
        observe(request, Budget.seconds(60), SilentEvents(), record)  # type: ignore[arg-type]
    assert record.openai_tree is not None
    assert record.openai_tree.sha256 == pin_tree(str(tree), Budget.seconds(60)).sha256
    assert b'"openai_tree"' in encode_document(record.so_far())
    # Without a declared tree the refused observations encode as before.
    assert b'"openai_tree"' not in encode_document(WorkerRecord().so_far())


def test_without_a_declaration_the_prepared_input_keeps_its_bytes(
    box: Toolbox,
    tmp_path: Path,
) -> None:
    prepared = observed(box, tmp_path)
    encoded = encode_document(prepared)
    assert b"openai" not in encoded
    assert all(profiles.openai is None for profiles in prepared.profiles.values())
    document = json.loads(encoded)
    assert all("openai" not in profiles for profiles in document["profiles"].values())


def test_the_readme_declaration_is_accepted_by_the_validator() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Declaring an OpenAI-compatible server", 1)[1]
    block = section.split("```json\n", 1)[1].split("```", 1)[0]
    member = json.loads("{" + block + "}")
    operator = validate_operator_object(example_operator(**member))
    assert operator.openai_server is not None
    assert operator.openai_server.serving.dialects == ["completions", "chat"]


def test_the_declarations_refusal_codes_are_in_the_readme_reference() -> None:
    text = render_operator_reference()
    emitted = {code for _, code in MISTAKES if code.startswith("openai_host.")}
    assert emitted == set(OPENAI_HOST_REFUSAL_CODES) - {"openai_host.shape"}
    for code in emitted:
        assert f"| `{code}` |" in text
    assert "`openai_host.shape`" not in text
