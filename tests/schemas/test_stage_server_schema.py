"""The stage server's listening lines: what the oracle prints is what the reference accepts."""

from __future__ import annotations

import pytest

from cache_family.schemas.stage_server import is_listening_line, listening_line

FIXTURE_CURRENT = (
    '{"schema_version":1,"sequence":1,"type":"status","data":{"message":'
    '"skippy-serving listening: openai=127.0.0.1:9337","context":null}}'
)
FIXTURE_LEGACY = (
    "skippy-server listening: openai=127.0.0.1:9337 model_id=org/m:Q4 backend=fixture "
    "generation_concurrency=1 generation_queue_capacity=256 generation_admission_timeout_secs=30"
)


def test_the_oracles_current_line_is_the_reference_fixture_line() -> None:
    line = listening_line(
        "current", 9337, model_id="org/m:Q4", generation_concurrency=1, backend="x"
    )
    assert line == FIXTURE_CURRENT


@pytest.mark.parametrize(
    ("dialect", "line", "port", "lanes", "accepted"),
    [
        ("current", FIXTURE_CURRENT, 9337, 1, True),
        ("current", FIXTURE_CURRENT, 9338, 1, False),
        ("current", FIXTURE_CURRENT.replace('"sequence":1', '"sequence":0'), 9337, 1, False),
        ("current", FIXTURE_CURRENT.replace('"sequence":1', '"sequence":true'), 9337, 1, False),
        ("current", FIXTURE_CURRENT.replace("status", "event", 1), 9337, 1, False),
        ("legacy", FIXTURE_LEGACY, 9337, 1, True),
        ("legacy", FIXTURE_LEGACY, 9337, 2, False),
        ("legacy", FIXTURE_LEGACY.replace("org/m:Q4", "org/other:Q4"), 9337, 1, False),
        ("legacy", FIXTURE_CURRENT, 9337, 1, False),
        ("current", FIXTURE_LEGACY, 9337, 1, False),
        ("legacy", FIXTURE_LEGACY + " " + "x" * 16384, 9337, 1, False),
    ],
)
def test_a_listening_line_needs_the_exact_port_model_and_lanes(
    dialect: str, line: str, port: int, lanes: int, accepted: bool
) -> None:
    got = is_listening_line(
        dialect,  # type: ignore[arg-type]
        line,
        port,
        model_id="org/m:Q4",
        generation_concurrency=lanes,
    )
    assert got is accepted


def test_the_oracles_legacy_line_is_accepted() -> None:
    line = listening_line(
        "legacy", 41000, model_id="org/m:Q4", generation_concurrency=3, backend="llama-server"
    )
    assert is_listening_line("legacy", line, 41000, model_id="org/m:Q4", generation_concurrency=3)
