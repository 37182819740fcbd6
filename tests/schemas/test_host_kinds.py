"""Every host kind answers every server question from its facts (``schemas/host_kinds.py``)."""

from __future__ import annotations

from cache_family.schemas.arms import ARMS, HostKind
from cache_family.schemas.host_kinds import (
    HOST_KIND_FACTS,
    LLAMA_SERVER_READINESS,
    host_readiness,
    llama_server_listening_marker,
)
from cache_family.schemas.stage_server import listening_line


def test_every_host_kind_and_every_host_arm_has_its_facts() -> None:
    assert set(HOST_KIND_FACTS) == set(HostKind)
    for kind, facts in HOST_KIND_FACTS.items():
        assert facts.kind == kind
    for arm in ARMS:
        if arm.host_kind is not None:
            assert arm.profile is not None
            assert HOST_KIND_FACTS[arm.host_kind].readiness_path.startswith("/")


def test_llama_server_is_ready_by_its_line_and_health() -> None:
    readiness = host_readiness("llama-server")
    assert readiness is LLAMA_SERVER_READINESS and readiness.path == "/health"
    assert readiness.is_listening_line(llama_server_listening_marker(9000), 9000)
    assert not readiness.is_listening_line(llama_server_listening_marker(9000), 9001)
    assert readiness.is_ready_answer({"status": "ok"})
    assert not readiness.is_ready_answer({"status": "loading model"})
    assert not readiness.is_ready_answer(["ok"])


def test_a_stage_server_is_ready_by_its_dialects_line_and_its_model_listed() -> None:
    readiness = host_readiness("legacy", model_id="org/m:Q4", lane_count=2)
    assert readiness.path == "/v1/models"
    line = listening_line(
        "legacy", 9000, model_id="org/m:Q4", generation_concurrency=2, backend="cpu"
    )
    assert readiness.is_listening_line(line, 9000)
    assert not host_readiness("legacy", model_id="org/m:Q4", lane_count=3).is_listening_line(
        line, 9000
    )
    assert not host_readiness("current", model_id="org/m:Q4").is_listening_line(line, 9000)
    assert readiness.is_ready_answer({"data": [{"id": "other"}, {"id": "org/m:Q4"}]})
    assert not readiness.is_ready_answer({"data": [{"id": "other"}]})
    assert not readiness.is_ready_answer({"status": "ok"})
