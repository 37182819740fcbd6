"""The trace replay with its host gone part way: a request that fails with the host no longer
the one spawned stops the replay as every workload's point stops (``workload_stopped``,
reason ``host-exited``, after the replay's own records), the cell faults ``child_exited``,
the requests never sent are journaled unsent, and replay reproduces the run. Against the
in-process FAKE llama-server on trio's fake clock."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import trio
import trio.testing
from fake_hosts.fake_custody import FakeHostScript
from fake_hosts.fake_llama_http import Reply
from run_harness import autojump_clock, cell, records, run  # noqa: F401
from workload_harness import prepared_with, workload

from cache_family.actors.audit.replay import replay
from cache_family.schemas.journal import Fault
from cache_family.schemas.workload_records import (
    TraceReplayed,
    TraceRequestReplayed,
    WorkloadStopped,
)

# Two requests a second of trace time, each extending the prompt before it (512-token blocks).
LINES = tuple((500 * i, 512 * (i + 1), list(range(i + 1))) for i in range(6))


def _trace(path: Path) -> str:
    data = b"".join(
        json.dumps(
            {"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": ids}
        ).encode()
        + b"\n"
        for t, n, ids in LINES
    )
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


async def test_a_host_gone_mid_replay_stops_it_as_a_fault_of_the_cell(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    trace = tmp_path / "trace.jsonl"
    sha256 = _trace(trace)
    seen = 0
    script = FakeHostScript()

    def exit_at_the_third(_index: int, body: dict[str, Any]) -> Reply:
        nonlocal seen
        if not isinstance(body.get("prompt"), list):
            return Reply(first_token_delay=0.01)  # warmup: not the replay's
        seen += 1
        if seen == 3:
            script.exited = True  # the FAKE host is gone: its request fails
            return Reply(behaviour="http_500")
        return Reply(first_token_delay=0.01)

    script.reply = exit_at_the_third
    out = tmp_path / "out"
    spec = {
        "path": str(trace),
        "sha256": sha256,
        "tokens_per_block": 4,
        "output_tokens_cap": 2,
    }
    outcome = await run(prepared_with(tmp_path / "p", trace=spec), out, script)
    assert not outcome.interrupted
    sent = sorted(records(out, TraceRequestReplayed), key=lambda r: r.index)
    assert [r.index for r in sent] == list(range(len(LINES)))  # every request journaled
    # Sent 0.5 s apart: the first two answered, the third failed with its host, then nothing.
    assert [r.sent_s is not None for r in sent] == [True, True, True, False, False, False]
    statuses = [r.request.status if r.request else None for r in sent]
    assert statuses[:2] == ["completed", "completed"] and statuses[2] != "completed"
    assert statuses[3:] == [None, None, None]
    [replayed] = records(out, TraceReplayed)
    assert replayed.launched == 3 and replayed.completed == 2
    [stopped] = records(out, WorkloadStopped)
    assert (stopped.reason, stopped.point_index, stopped.sent) == ("host-exited", 0, 3)
    assert stopped.kind == "trace"
    faults = [f for f in records(out, Fault) if f.cell_id == stopped.cell_id]
    assert [f.kind for f in faults] == ["child_exited"]
    assert workload(out, "native-trace").status == "incomplete"
    assert cell(out, "workload-native-trace").status == "incomplete"
    assert replay(str(out)).exit_code == 0
