"""The load actor and host custody against the real llama-server and a tiny real GGUF model.

Numbers from a tiny random-weight model are not performance claims; this checks that the
protocol, the validation and the cache evidence hold on the real server.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio

from cache_family.actors.run.custody import HostConfig, host_custody, host_environment
from cache_family.actors.run.load import build_benchmark_prompt, run_load
from cache_family.oracles.native_parts import Parts
from cache_family.schemas.measurement import HostEvent, LoadRequest, ServerTimings
from cache_family.states.first_token import server_per_token_ms

pytestmark = pytest.mark.native

SOURCE = (
    "A cache benchmark sends the same long prefix many times and measures how much of the "
    "prompt the server can serve from memory instead of computing it again. "
)


async def test_serial_baseline_and_two_rung_ladder_on_one_retained_host(
    native_parts: Parts, tmp_path: Path
) -> None:
    events: list[HostEvent] = []

    async def observe(event: HostEvent) -> None:
        events.append(event)

    (tmp_path / "state").mkdir()
    config = HostConfig(
        label="native",
        state_parent=str(tmp_path / "state"),
        log_dir=str(tmp_path / "logs"),
        grace_seconds=10,
    )
    with trio.fail_after(300):
        async with host_custody(config, observe) as host:
            env = host_environment({}, {}, str(native_parts.native_build), host.state_dir)
            argv = [
                str(native_parts.llama_server),
                "--model",
                str(native_parts.model_path("llama")),
                "--ctx-size",
                "2048",
                "--n-gpu-layers",
                "0",
                "--host",
                "127.0.0.1",
                "--port",
                str(host.port),
                "--parallel",
                "2",
                "--threads",
                "1",
                "--no-webui",
            ]
            await host.launch(argv, env)
            await host.wait_ready(120)
            pid, created = host.pid, host.create_time

            prompt = await build_benchmark_prompt(host.base_url, SOURCE, 128)
            assert prompt.token_count == 129

            serial = await run_load(
                LoadRequest(
                    base_url=host.base_url,
                    prompt=prompt.text,
                    requests=4,
                    concurrency=1,
                    output_tokens=1,
                    stream=False,
                    request_timeout_ms=60_000,
                ),
                deadline=trio.current_time() + 120,
            )
            assert serial.status == "completed", serial.rows
            assert serial.rows[0].excluded_warmup
            summary = serial.serial_summary
            assert summary is not None and summary.complete
            assert summary.warm_requests == 3
            # The prompt prefix is served from the server's cache on every warm request.
            assert summary.warm_cache_n_min is not None and summary.warm_cache_n_min > 0
            for row in serial.rows:
                assert row.tokens_evaluated == 129
                assert row.timings is not None
                assert row.timings.prompt_n is not None and row.timings.cache_n is not None
                assert row.timings.prompt_n + row.timings.cache_n == 129

            for concurrency in (1, 2):
                assert host.still_same()
                rung = await run_load(
                    LoadRequest(
                        base_url=host.base_url,
                        prompt=prompt.text,
                        requests=4,
                        concurrency=concurrency,
                        output_tokens=128,
                        stream=True,
                        request_timeout_ms=60_000,
                    ),
                    deadline=trio.current_time() + 120,
                )
                assert rung.status == "completed", rung.rows
                rung_summary = rung.rung_summary
                assert rung_summary is not None and rung_summary.complete
                assert rung_summary.observed_completion_tokens == 4 * 128
                assert rung_summary.concurrency == concurrency
                # The server timed every event: its own first-token and token times are
                # there whatever the client read, labelled as the server's (unless it held
                # every token back until its final event).
                timed = [r for r in rung.rows if isinstance(r.first_token_timings, ServerTimings)]
                assert isinstance(rung_summary.server_ttft_p50_ms, float) == bool(timed)
                assert isinstance(rung_summary.server_tpot_p50_ms, float) == bool(timed)
                for row in rung.rows:
                    assert row.tokens_predicted == 128
                    assert row.timings is not None and row.timings.predicted_n == 128
                    first = row.first_token_timings
                    if isinstance(first, ServerTimings):
                        assert first.predicted_n is not None and first.predicted_n >= 1
                        assert isinstance(row.first_token_late_ms, float)
                        assert row.first_token_late_ms >= 0
                    else:
                        assert row.ttft_unobserved == "first_token_with_final"
                    assert row.elapsed_ms is not None
                    if row.ttft_ms is None:
                        # A busy machine may keep the client from reading while the server
                        # streams: its figures are then not observable, with the reason.
                        assert row.tpot_ms is None
                        assert row.ttft_unobserved in ("first_token_with_final", "client_stalled")
                    else:
                        assert row.ttft_unobserved is msgspec.UNSET
                        assert 0 < row.ttft_ms < row.elapsed_ms
                        # Never a TPOT below the server's own time per token.
                        server_tpot = server_per_token_ms(row)
                        assert row.tpot_ms is not None and server_tpot is not None
                        assert row.tpot_ms >= server_tpot
                    assert row.stop_type == "limit"
                    assert row.first_chunk_sha256 is not None
                    assert row.content_sha256 is not None and len(row.content_sha256) == 64
            assert (host.pid, host.create_time) == (pid, created)
    outcome = host.outcome
    assert outcome is not None
    assert outcome.clean, outcome
    assert [type(e).__name__ for e in events] == [
        "HostSpawned",
        "HostMarkerSeen",
        "HostReady",
        "HostCleaned",
    ]
