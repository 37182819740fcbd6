"""The chat dialect's workload runner against a chat server that does not report the reuse
it did (the in-process calibration server: OpenAI chat with ``usage.prompt_tokens`` but no
``prompt_tokens_details``): the overlap calibration refuses with ``workload.chat.no_usage``
before any point is journaled, rather than judging reuse it cannot see."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from run_harness import autojump_clock  # noqa: F401

from cache_family.actors.run.calibration_server import CalibrationServer, Pace
from cache_family.actors.run.workload_dialects import WorkloadHost
from cache_family.actors.run.workloads import run_overlap
from cache_family.errors import Refused
from cache_family.schemas.journal import Record
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import OverlapPointMeasured, WorkloadOpened
from cache_family.system.http import LoopbackHttp


async def test_a_chat_server_without_cached_token_counts_is_refused_before_any_point(
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    spec = validate_workload_object(
        {
            "schema_version": 1,
            "prefix_overlap": {"prompt_tokens": 64, "groups": 1, "requests": 2},
        }
    )
    journaled: list[Record] = []

    async def journal(record: Record) -> None:
        journaled.append(record)

    server = CalibrationServer(Pace(ttft_ms=1.0, itl_ms=1.0, tokens=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, 0)
        host = WorkloadHost(
            cell_id="cell-0000/new-overlap",
            base_url=f"http://127.0.0.1:{port}",
            http=LoopbackHttp(),
            journal=journal,
            deadline=trio.current_time() + 60,
            request_timeout_ms=10_000,
            architecture="llama",
            workloads=spec,
            workloads_sha256="",
            prompt_text="",
            ignore_eos=True,
            chat=True,
            model_id="calibration",
        )
        with pytest.raises(Refused) as refused:
            await run_overlap(host)
        nursery.cancel_scope.cancel()
    assert refused.value.refusals[0].code == "workload.chat.no_usage"
    # The cell opened (its chat alphabet as the vocabulary); no point was judged.
    opened = [r for r in journaled if isinstance(r, WorkloadOpened)]
    assert len(opened) == 1 and opened[0].vocabulary_size is not None
    assert not any(isinstance(r, OverlapPointMeasured) for r in journaled)
    # The first calibration message was enough to know: the second was never sent.
    assert len(server.stamps) == 1
