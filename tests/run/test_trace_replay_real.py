"""The trace replay against a real llama-server on the zoo: a small Mooncake-format window
sent open-loop on its (scaled) timestamps, every request journaled with its design and the
server's count. On one slot of an attention model each request that extends the slot's last
prompt reuses what the trace designed (within the server's one-token granularity), the
request after a detour loses its reuse and names the request that last sent those blocks,
and with prompt caching off the replay measures (not refuses) no reuse; a server killed
mid-replay stops it with the host gone (``workload_stopped`` host-exited). Tiny random-weight
models: plumbing evidence, not performance claims."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from cache_family.actors.run.server_metrics import MetricsWatch
from cache_family.actors.run.trace_replay import run_trace
from cache_family.actors.run.workload_dialects import WorkloadHost, WorkloadHostLost
from cache_family.oracles.native_parts import Parts, RunningServer, serve
from cache_family.schemas.journal import JournalLine, Record, ServerMetricsRead
from cache_family.schemas.workload import WorkloadFile, validate_workload_object
from cache_family.schemas.workload_records import (
    TraceReceipt,
    TraceReplayed,
    TraceRequestReplayed,
    WorkloadStopped,
)
from cache_family.states.cache_reuse import expected_cached_tokens
from cache_family.states.server_metrics import verdict_of
from cache_family.states.workload_fold import fold_workload
from cache_family.system.http import LoopbackHttp, Response

pytestmark = pytest.mark.native

CELL = "cell-0000/native-trace"
# Each line extends the one before it but the fourth (a detour on block 5): 512-token blocks.
CHAIN = (
    (0, 1024, [0, 1]),
    (1000, 1536, [0, 1, 2]),
    (2000, 2048, [0, 1, 2, 3]),
    (3000, 1024, [0, 5]),
    (4000, 2560, [0, 1, 2, 3, 4]),
)


def _trace(path: Path) -> bytes:
    data = b"".join(
        json.dumps(
            {"timestamp": t, "input_length": n, "output_length": 40, "hash_ids": ids}
        ).encode()
        + b"\n"
        for t, n, ids in CHAIN
    )
    path.write_bytes(data)
    return data


def _spec(trace: Path, sha256: str) -> WorkloadFile:
    """The trace at 16 tokens a block, sends 200 ms apart (each answered long before the next
    on the zoo), answers capped at 2 tokens."""
    return validate_workload_object(
        {
            "schema_version": 1,
            "trace": {
                "path": str(trace),
                "sha256": sha256,
                "tokens_per_block": 16,
                "time_scale": 0.2,
                "output_tokens_cap": 2,
            },
        }
    )


def _replay(
    parts: Parts, trace: Path, sha256: str, extra_args: list[str], model: str = "llama"
) -> tuple[list[Record], TraceReceipt]:
    spec = _spec(trace, sha256)
    journaled: list[Record] = []

    async def journal(record: Record) -> None:
        journaled.append(record)

    with serve(
        parts.llama_server, parts.model_path(model), ctx_size=256, extra_args=extra_args
    ) as server:

        async def main() -> bool:
            http = LoopbackHttp()
            # The host's counters are read around the replay when it serves them.
            path = "/metrics" if "--metrics" in extra_args else None
            host = WorkloadHost(
                cell_id=CELL,
                base_url=server.url,
                http=http,
                journal=journal,
                deadline=trio.current_time() + 120,
                request_timeout_ms=60_000,
                architecture=model,
                workloads=spec,
                workloads_sha256="",
                prompt_text="",
                ignore_eos=True,
                slots=1,
                slot_context_tokens=256,
                metrics=MetricsWatch(
                    cell_id=CELL, base_url=server.url, path=path, http=http, journal=journal
                ),
            )
            return await run_trace(host)

        assert trio.run(main)
    lines = [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(journaled, start=1)
    ]
    receipt = fold_workload(lines, CELL)
    assert receipt.status == "accepted" and isinstance(receipt.trace, TraceReceipt), receipt
    return journaled, receipt.trace


def test_a_replayed_window_reuses_what_the_trace_designed_on_one_attention_slot(
    native_parts: Parts, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    sha256 = hashlib.sha256(_trace(trace)).hexdigest()
    journaled, receipt = _replay(native_parts, trace, sha256, ["--metrics"])
    sent = [r for r in journaled if isinstance(r, TraceRequestReplayed)]
    [replayed] = [r for r in journaled if isinstance(r, TraceReplayed)]
    assert replayed.sha256 == sha256 and replayed.tokens_per_block == 16
    assert replayed.block_tokens == 512 and replayed.time_scale == 0.2
    # Lateness for every send, and each request answered with the server's own count.
    assert [r.index for r in sent] == [0, 1, 2, 3, 4]
    assert all(r.sent_s is not None and r.sent_s >= r.scheduled_s for r in sent)
    assert all(r.request is not None and r.request.status == "completed" for r in sent)
    assert [r.designed_infinite_tokens for r in sent] == [0, 32, 48, 16, 64]

    trace_receipt = receipt
    rows = trace_receipt.requests
    assert [r.prompt_tokens for r in rows] == [32, 48, 64, 32, 80]
    assert all(r.verdict is None for r in rows), rows
    # The chain on one slot: the server reused the slot's last prompt, as designed.
    for row in (rows[1], rows[2]):
        assert (
            row.designed_infinite_tokens - 1 <= row.achieved_tokens <= row.designed_infinite_tokens
        )
    # The detour shares block 0 with the slot; the request after it loses blocks 1..3, last
    # sent by request 2.
    assert rows[3].achieved_tokens in (15, 16)
    assert rows[4].achieved_tokens == 16
    [loss] = trace_receipt.losses
    assert (loss.index, loss.designed_tokens, loss.last_sender) == (4, 64, 2)
    assert trace_receipt.over_claimed == () and trace_receipt.token_count_mismatches == ()
    # The server's own counters over the whole replay agree with the requests' own figures.
    [read] = [r for r in journaled if isinstance(r, ServerMetricsRead)]
    assert (read.scope, read.index, read.status) == ("trace", 0, "read")
    verdict = verdict_of(read)
    assert verdict.server is not None and verdict.server.prompt_tokens == 256
    assert verdict.agreement == "agrees", verdict


def test_a_server_with_prompt_caching_off_is_measured_at_no_reuse(
    native_parts: Parts, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    sha256 = hashlib.sha256(_trace(trace)).hexdigest()
    _, receipt = _replay(native_parts, trace, sha256, ["--no-cache-prompt"])
    trace_receipt = receipt
    assert trace_receipt.measured_requests == 5
    assert trace_receipt.designed_infinite_tokens == 32 + 48 + 16 + 64
    assert trace_receipt.achieved_tokens == 0 and trace_receipt.efficiency == 0.0
    assert len(trace_receipt.losses) == 4
    assert all(r.lateness_ms is not None for r in trace_receipt.requests)


def test_a_recurrent_model_reuses_by_its_checkpoint_rule(
    native_parts: Parts, tmp_path: Path
) -> None:
    """The hybrid family restores a checkpoint of the slot's last prompt, never more than the
    trace designed: each chained request reuses what the checkpoint rule gives of it."""
    trace = tmp_path / "trace.jsonl"
    sha256 = hashlib.sha256(_trace(trace)).hexdigest()
    _, receipt = _replay(native_parts, trace, sha256, [], model="qwen3next")
    rows = receipt.requests
    assert all(r.verdict is None for r in rows), rows
    for previous, row in ((rows[0], rows[1]), (rows[1], rows[2])):
        assert row.achieved_tokens == expected_cached_tokens(
            "checkpoint",
            prompt_tokens=row.prompt_tokens,
            common_prefix=row.designed_infinite_tokens,
            previous_prompt_tokens=previous.prompt_tokens,
        ), rows
    assert all((r.achieved_tokens or 0) <= r.designed_infinite_tokens for r in rows)


class _KillsTheServerAt(LoopbackHttp):
    """The replay's own HTTP client, which SIGKILLs the real server (and reaps it) just before
    the ``at``-th ``/completion``: that request finds its host really gone."""

    def __init__(self, server: RunningServer, at: int) -> None:
        super().__init__()
        self.server, self.at, self.completions = server, at, 0

    @asynccontextmanager
    async def request(
        self, method: str, url: str, *, json_body: Any = None, headers: Any = ()
    ) -> AsyncIterator[Response]:
        if url.endswith("/completion"):
            self.completions += 1
            if self.completions == self.at:
                self.server.process.kill()
                await trio.to_thread.run_sync(self.server.process.wait)
        async with super().request(method, url, json_body=json_body, headers=headers) as got:
            yield got


def test_a_server_killed_mid_replay_stops_it_with_the_host_gone(
    native_parts: Parts, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    sha256 = hashlib.sha256(_trace(trace)).hexdigest()
    spec = _spec(trace, sha256)
    journaled: list[Record] = []

    async def journal(record: Record) -> None:
        journaled.append(record)

    with serve(native_parts.llama_server, native_parts.model_path("llama"), ctx_size=256) as server:

        async def main() -> None:
            host = WorkloadHost(
                cell_id=CELL,
                base_url=server.url,
                http=_KillsTheServerAt(server, 3),
                journal=journal,
                deadline=trio.current_time() + 120,
                request_timeout_ms=60_000,
                architecture="llama",
                workloads=spec,
                workloads_sha256="",
                prompt_text="",
                ignore_eos=True,
                host_alive=lambda: server.process.poll() is None,
                slots=1,
                slot_context_tokens=256,
            )
            await run_trace(host)

        with pytest.raises(WorkloadHostLost):
            trio.run(main)
    sent = [r for r in journaled if isinstance(r, TraceRequestReplayed)]
    assert [r.index for r in sent] == [0, 1, 2, 3, 4]  # every request journaled
    statuses = [r.request.status if r.request else None for r in sent]
    assert statuses[:2] == ["completed", "completed"]
    assert "completed" not in statuses[2:]  # none answered once the server was gone
    [replayed] = [r for r in journaled if isinstance(r, TraceReplayed)]
    [stopped] = [r for r in journaled if isinstance(r, WorkloadStopped)]
    assert (stopped.kind, stopped.reason, stopped.sent) == (
        "trace",
        "host-exited",
        replayed.launched,
    )
    # The stop comes after the replay's own records, as every workload's stopped point does.
    assert journaled[-1] is stopped and journaled[-2] is replayed
