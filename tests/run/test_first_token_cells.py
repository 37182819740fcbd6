"""A run's cells judge each streamed request's first token by the run's own measured client
lag and the server's per-event timings. Real matrix, row and cell actors, journal, folds and
replay; the hosts are in-process FAKE llama HTTP endpoints on trio's autojump clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio.testing
from fake_hosts.fake_custody import FakeHostScript
from fake_hosts.fake_llama_http import Reply
from run_harness import (  # the run harness and its autojump clock fixture
    autojump_clock,
    cell,
    make_prepared,
    matrix,
    run,
)

from cache_family.actors.audit.first_tokens import check_first_tokens
from cache_family.actors.audit.replay import replay

__all__ = ["autojump_clock"]


def held_first_token(_index: int, body: dict[str, Any]) -> Reply:
    """Every streamed answer's first token reaches the client 10 ms late, with the second."""
    behaviour = "first_token_held" if body["stream"] else "ok"
    return Reply(behaviour, first_token_delay=0.01, token_delay=0.01)


async def test_a_first_token_read_later_than_the_runs_measured_lag_is_client_stalled(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """On the autojump clock the run's self-calibration measures no client overhead, so a
    first token read 10 ms after the server's timings say it was sent is not observable; the
    server's own figures stand in the receipt, the check finds nothing faked, and replay
    re-folds the same receipts."""
    out = tmp_path / "out"
    outcome = await run(make_prepared(tmp_path / "p"), out, FakeHostScript(reply=held_first_token))
    assert outcome.status == "completed"
    calibration = matrix(out).client_calibration
    assert calibration is not None and calibration.overhead_p50_ms < 10
    sweep = cell(out, "sweep-native-concurrent")
    rows = [row for rung in sweep.measurement.rungs for row in rung.rows]
    assert rows and all(row.status == "completed" for row in rows)
    for row in rows:
        assert row.ttft_ms is None and row.tpot_ms is None
        assert row.ttft_unobserved == "client_stalled"
        assert row.first_token_late_ms == pytest.approx(10)
    for rung in sweep.measurement.rungs:
        summary = rung.rung_summary
        assert summary is not None and summary.ttft_unobserved_count == summary.measured_requests
        assert summary.server_ttft_p50_ms == 5.5
        assert summary.server_tpot_p50_ms == pytest.approx(10)
    check = check_first_tokens(str(out))
    assert check.requests == check.per_event == len(rows)
    assert check.unobserved == {"client_stalled": len(rows)} and check.faked == []
    assert replay(str(out)).exit_code == 0
