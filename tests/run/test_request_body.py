"""The /completion body the cells send: the reference's exactly for a real catalog, with
``ignore_eos`` only for a synthetic one, and the receipt says which; a streamed one (a ladder
rung) also asks for the server's per-event ``timings_per_token``. Real actors, journal and
folds; the hosts are in-process FAKE llama HTTP endpoints recording every body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio.testing
from fake_hosts.fake_custody import FakeHostScript
from fake_hosts.fake_llama_http import Reply
from run_harness import (  # the run harness and its autojump clock fixture
    autojump_clock,
    cell,
    make_prepared,
    records,
    run,
    synthetic_catalog,
)

from cache_family.schemas.journal import CellOpened

__all__ = ["autojump_clock"]

REFERENCE_KEYS = ["prompt", "n_predict", "temperature", "top_k", "cache_prompt", "stream"]


def extensions(body: dict[str, Any], *synthetic: str) -> list[str]:
    """The keys a body carries beyond the reference's, in order."""
    streamed = ["timings_per_token"] if body["stream"] else []
    return [*REFERENCE_KEYS, *synthetic, *streamed]


def recording() -> tuple[FakeHostScript, list[dict[str, Any]]]:
    bodies: list[dict[str, Any]] = []

    def reply(_index: int, body: dict[str, Any]) -> Reply:
        bodies.append(dict(body))
        return Reply(first_token_delay=0.01, token_delay=0.0)

    return FakeHostScript(reply=reply), bodies


async def test_a_real_catalog_sends_the_reference_body_and_the_receipt_says_so(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script, bodies = recording()
    out = tmp_path / "out"
    outcome = await run(make_prepared(tmp_path / "p"), out, script)
    assert outcome.status == "completed"
    assert bodies and all(list(body) == extensions(body) for body in bodies)
    assert {body["stream"] for body in bodies} == {False, True}
    assert all(
        (body["temperature"], body["top_k"], body["cache_prompt"]) == (0, 1, True)
        for body in bodies
    )
    for name in ("native-serial", "sweep-native-concurrent"):
        assert cell(out, name).measurement.ignore_eos is False
    assert {c.ignore_eos for c in records(out, CellOpened)} == {False}


async def test_a_synthetic_catalog_adds_ignore_eos_and_the_receipt_says_so(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    script, bodies = recording()
    out = tmp_path / "out"
    prepared = make_prepared(tmp_path / "p", catalog=synthetic_catalog(tmp_path / "catalog"))
    outcome = await run(prepared, out, script)
    assert outcome.status == "completed"
    assert bodies and all(list(body) == extensions(body, "ignore_eos") for body in bodies)
    assert all(body["ignore_eos"] is True for body in bodies)
    for name in ("native-serial", "sweep-native-concurrent"):
        assert cell(out, name).measurement.ignore_eos is True
    # The cell opened with its cache expectation: the row's GGUF architecture and its rule.
    expectations = {c.cache_expectation for c in records(out, CellOpened)}
    assert len(expectations) == 1
    (expectation,) = expectations
    assert expectation is not None and expectation.n_ubatch == 512
    assert (expectation.architecture, expectation.rule) == ("qwen3", "exact-prefix")
    assert expectation.lanes == 1
