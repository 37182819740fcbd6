"""The one rule for a streamed request's client TTFT and TPOT, the server's own figures, and
the stalled-client check: plain data in, decisions out."""

from __future__ import annotations

import msgspec
import pytest

from cache_family.schemas.measurement import RequestRow, ServerTimings
from cache_family.states.first_token import (
    FirstToken,
    client_first_token,
    server_per_token_ms,
    server_times,
    suspect_client_figures,
)
from cache_family.states.metrics import rung_summary

FIRST = ServerTimings(prompt_n=100, prompt_ms=20.0, predicted_n=1, predicted_ms=0.001, cache_n=0)
FINAL = ServerTimings(prompt_n=100, prompt_ms=20.0, predicted_n=9, predicted_ms=8.001, cache_n=0)


def judge(**overrides: object) -> FirstToken:
    values: dict[str, object] = {
        "elapsed_ms": 40.0,
        "first_read_ms": 30.0,
        "read_with_final": False,
        "tokens": 9,
    }
    values.update(overrides)
    return client_first_token(**values)  # type: ignore[arg-type]


def test_a_first_token_read_on_time_gives_both_client_figures() -> None:
    assert judge() == FirstToken(30.0, 10.0 / 8)
    # The server's figures do not replace the client's: a TPOT at or above the server's own
    # and a first token read within the client's lag stand.
    assert judge(late_ms=0.5, server_tpot_ms=1.25, client_lag_ms=1.0) == FirstToken(30.0, 1.25)


@pytest.mark.parametrize(
    "overrides",
    [{"first_read_ms": None}, {"read_with_final": True}],
)
def test_no_first_token_before_the_final_read_is_first_token_with_final(
    overrides: dict[str, object],
) -> None:
    assert judge(**overrides, late_ms=0.0, server_tpot_ms=0.0) == FirstToken(
        None, None, "first_token_with_final"
    )


def test_a_first_token_read_later_than_the_client_lag_is_client_stalled() -> None:
    assert judge(late_ms=5.0, client_lag_ms=2.0) == FirstToken(None, None, "client_stalled")
    # Without a measured lag this test is not made; at the lag, it stands.
    assert judge(late_ms=5.0).unobserved is msgspec.UNSET
    assert judge(late_ms=2.0, client_lag_ms=2.0).unobserved is msgspec.UNSET


def test_never_a_client_tpot_below_the_servers_own() -> None:
    # 10 ms seen over 8 gaps is 1.25 ms a token; the server took 1.3.
    assert judge(server_tpot_ms=1.3) == FirstToken(None, None, "client_stalled")
    assert judge(server_tpot_ms=1.25).ttft_ms == 30.0


def test_the_servers_own_times_need_its_per_event_timings() -> None:
    row = RequestRow(
        request_id=0,
        status="completed",
        elapsed_ms=40.0,
        tokens_predicted=9,
        timings=FINAL,
        first_token_timings=FIRST,
    )
    times = server_times(row)
    assert times is not None
    assert times.ttft_ms == pytest.approx(20.001)
    assert times.tpot_ms == pytest.approx(1.0)
    older = msgspec.structs.replace(row, first_token_timings=msgspec.UNSET)
    assert server_times(older) is None
    # The check's per-token time falls back on the final event's generation time.
    assert server_per_token_ms(older) == pytest.approx(8.001 / 8)


def row_of(ttft_ms: float, elapsed_ms: float, tpot_ms: float, **extra: object) -> RequestRow:
    return RequestRow(
        request_id=3,
        status="completed",
        elapsed_ms=elapsed_ms,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        tokens_predicted=9,
        timings=FINAL,
        **extra,  # type: ignore[arg-type]
    )


def test_the_check_flags_a_burst_read_as_faked() -> None:
    # The case: TTFT 99 % of the response, TPOT far below the server's own.
    suspect = suspect_client_figures(row_of(99.6, 100.0, 0.05))
    assert suspect is not None and suspect.faked
    assert "TPOT 0.050 ms" in suspect.why


def test_the_check_tells_a_long_queue_before_a_short_answer_from_a_stall() -> None:
    # 97 % of the time before the first token, but the client saw the 8 ms the server
    # spent generating: a long wait, not a stalled client.
    honest = suspect_client_figures(row_of(300.0, 309.0, 9.0 / 8))
    assert honest is not None and not honest.faked
    # The client saw 3 ms of the server's 8: faked (at a TPOT above a tenth of the server's).
    faked = suspect_client_figures(row_of(300.0, 303.0, 3.0 / 8))
    assert faked is not None and faked.faked
    assert suspect_client_figures(row_of(30.0, 40.0, 10.0 / 8)) is None
    # A figure that is not observable is not a suspect one.
    unobserved = RequestRow(
        request_id=0, status="completed", elapsed_ms=5.0, ttft_unobserved="client_stalled"
    )
    assert suspect_client_figures(unobserved) is None


def test_rows_and_summaries_without_per_event_timings_encode_as_before() -> None:
    """The new members are written only when the server timed every event, so the rows and
    summaries of older runs, re-folded by replay, keep their bytes."""
    old_line = b'{"request_id":0,"status":"completed","ttft_ms":5.0,"elapsed_ms":6.0}'
    older = msgspec.json.decode(old_line, type=RequestRow)
    assert older.first_token_timings is msgspec.UNSET
    assert b"first_token" not in msgspec.json.encode(older)
    summary = rung_summary([older], concurrency=1, requested_requests=1, makespan_seconds=1.0)
    assert b"server_" not in msgspec.json.encode(summary)
    timed = msgspec.structs.replace(
        older, tokens_predicted=9, timings=FINAL, first_token_timings=FIRST, first_token_late_ms=0.0
    )
    encoded = msgspec.json.encode(timed)
    assert b'"first_token_late_ms":0.0' in encoded
    assert msgspec.json.decode(encoded, type=RequestRow) == timed
    summary = rung_summary([timed], concurrency=1, requested_requests=1, makespan_seconds=1.0)
    assert summary.server_ttft_p50_ms == pytest.approx(20.001)
    assert summary.server_tpot_p99_ms == pytest.approx(1.0)


def test_a_negative_lateness_is_refused_like_a_negative_time() -> None:
    bad = RequestRow(
        request_id=0, status="completed", elapsed_ms=6.0, ttft_ms=5.0, first_token_late_ms=-1.0
    )
    with pytest.raises(Exception) as caught:
        rung_summary([bad], concurrency=1, requested_requests=1, makespan_seconds=1.0)
    assert "metrics.negative_latency" in str(caught.value.codes)  # type: ignore[attr-defined]
