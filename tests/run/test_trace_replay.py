"""The trace runner (actors/run/trace_replay.py) on trio's autojump clock against the
calibration server (which counts a token-id prompt as its ids and reuses nothing): every
request of the window is sent on its scaled timestamp, checked against the server's count and
journaled with its design, lateness and losses; a queue past ``max_in_flight`` stops the
replay as over-saturated, the rest of the window journaled as not sent."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cache_family.actors.run.calibration_server import CalibrationServer, Pace
from cache_family.actors.run.trace_replay import run_trace
from cache_family.actors.run.workload_dialects import WorkloadHost
from cache_family.errors import Refused
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import (
    TraceReceipt,
    TraceReplayed,
    TraceRequestReplayed,
    WorkloadReceipt,
)
from cache_family.states.workload_fold import fold_workload
from cache_family.system.http import LoopbackHttp

CELL = "cell-0000/native-trace"
LINES = (
    (0, 1024, [0, 1]),
    (0, 1536, [0, 1, 2]),
    (1000, 600, [0, 3]),
    (1000, 512, [4]),
    (2000, 1536, [0, 1, 2]),
    (2000, 2048, [0, 1, 2, 5]),
)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def _trace(path: Path) -> str:
    data = b"".join(
        json.dumps(
            {"timestamp": t, "input_length": n, "output_length": 9, "hash_ids": ids}
        ).encode()
        + b"\n"
        for t, n, ids in LINES
    )
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


async def _replay(
    tmp_path: Path, pace: Pace, **trace: Any
) -> tuple[list[Record], WorkloadReceipt, CalibrationServer]:
    sha256 = _trace(tmp_path / "trace.jsonl")
    spec = validate_workload_object(
        {
            "schema_version": 1,
            "trace": {
                "path": str(tmp_path / "trace.jsonl"),
                "sha256": sha256,
                "tokens_per_block": 8,
                "time_scale": 0.5,
                "output_tokens_cap": 2,
                **trace,
            },
        }
    )
    journaled: list[Record] = []

    async def journal(record: Record) -> None:
        journaled.append(record)

    server = CalibrationServer(pace)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, 0)
        host = WorkloadHost(
            cell_id=CELL,
            base_url=f"http://127.0.0.1:{port}",
            http=LoopbackHttp(),
            journal=journal,
            deadline=trio.current_time() + 600,
            request_timeout_ms=60_000,
            architecture="llama",
            workloads=spec,
            workloads_sha256="",
            prompt_text="",
            ignore_eos=True,
            slots=1,
            slot_context_tokens=64,
        )
        await run_trace(host)
        nursery.cancel_scope.cancel()
    lines = [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(journaled, start=1)
    ]
    return journaled, fold_workload(lines, CELL), server


async def test_every_request_is_sent_on_its_scaled_timestamp_and_checked(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    journaled, receipt, server = await _replay(tmp_path, Pace(ttft_ms=20.0, itl_ms=5.0, tokens=2))
    sent = [r for r in journaled if isinstance(r, TraceRequestReplayed)]
    # Half the trace's time: 0, 0, 0.5, 0.5, 1, 1 s; on the fake clock exactly on time.
    assert [(r.scheduled_s, r.sent_s) for r in sent] == [
        (0.0, 0.0), (0.0, 0.0), (0.5, 0.5), (0.5, 0.5), (1.0, 1.0), (1.0, 1.0)
    ]  # fmt: skip
    assert len(server.stamps) == 6
    assert all(s.tokens == 2 for s in server.stamps)  # output_length 9 capped at 2
    # Each prompt as the server counted it: 512-token blocks as 8 tokens, 600 as 8 + 2.
    counted = [r.request.prompt_tokens if r.request else None for r in sent]
    assert counted == [16, 24, 10, 8, 24, 32]
    assert [r.designed_infinite_tokens for r in sent] == [0, 16, 8, 0, 24, 24]
    assert [r.last_sender for r in sent] == [None, 0, 1, None, 1, 4]
    trace = receipt.trace
    assert isinstance(trace, TraceReceipt)
    assert trace.token_count_mismatches == () and trace.over_claimed == ()
    assert [r.lateness_ms for r in trace.requests] == [0.0] * 6
    # The calibration server reuses nothing: measured, not refused.
    assert trace.efficiency == 0.0 and receipt.status == "accepted"
    assert [(loss.index, loss.last_sender) for loss in trace.losses] == [
        (1, 0), (2, 1), (4, 1), (5, 4)
    ]  # fmt: skip


async def test_a_queue_past_its_limit_stops_the_replay_as_over_saturated(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    journaled, receipt, _ = await _replay(
        tmp_path,
        Pace(ttft_ms=5000.0, itl_ms=5.0, tokens=2),
        over_saturation={"max_in_flight": 2},
    )
    [replayed] = [r for r in journaled if isinstance(r, TraceReplayed)]
    assert replayed.stop_reason == "workload.arrivals.in_flight_growing"
    # The third send found three in flight; what went with it at the same instant is cut.
    assert replayed.launched >= 3 and "more than 2" in (replayed.stop_detail or "")
    trace = receipt.trace
    assert isinstance(trace, TraceReceipt)
    assert len(trace.requests) == 6
    assert [r.verdict for r in trace.requests][4:] == ["not-launched"] * 2
    assert all(r.lateness_ms is not None for r in trace.requests[:3])
    assert trace.refusal == "workload.arrivals.in_flight_growing"
    assert receipt.status == "refused"


async def test_a_trace_whose_bytes_changed_since_preparation_is_refused(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    _trace(tmp_path / "trace.jsonl")
    document = {"schema_version": 1, "trace": {"path": str(tmp_path / "trace.jsonl")}}
    document["trace"]["sha256"] = "0" * 64  # type: ignore[index]
    journaled: list[Record] = []

    async def journal(record: Record) -> None:
        journaled.append(record)

    host = WorkloadHost(
        cell_id=CELL,
        base_url="http://127.0.0.1:9",  # never asked: the refusal comes first
        http=LoopbackHttp(),
        journal=journal,
        deadline=trio.current_time() + 600,
        request_timeout_ms=1000,
        architecture="llama",
        workloads=validate_workload_object(document),
        workloads_sha256="",
        prompt_text="",
        ignore_eos=True,
    )
    with pytest.raises(Refused) as caught:
        await run_trace(host)
    assert caught.value.codes == ["trace.pin_mismatch"]
    # The stop before any request is journaled, nothing sent.
    assert [type(r).__name__ for r in journaled] == ["WorkloadStopped"]
