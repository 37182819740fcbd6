"""An open-loop rate the real llama-server on the zoo cannot sustain stops as over-saturated:
one slot, distinct prompts of a few hundred tokens (each takes the tiny model tens of
milliseconds or more on any host here), offered at 200 requests/s. Every scheduled index
still ends with one row, and the requests it answered are real completions."""

from __future__ import annotations

import pytest
import trio

from cache_family.actors.run.open_loop import OpenLoopSender, load_exchange
from cache_family.oracles.native_parts import Parts, serve
from cache_family.schemas.workload import OverSaturation
from cache_family.states.arrivals import SaturationWatch, arrival_schedule

pytestmark = pytest.mark.native

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jolly box "


def test_a_rate_the_server_cannot_sustain_stops_as_over_saturated(native_parts: Parts) -> None:
    schedule = arrival_schedule("poisson", 200.0, seed=4, requests=600)
    rule = OverSaturation(window=32, min_in_flight=8)
    with serve(
        native_parts.llama_server, native_parts.model_path("llama"), ctx_size=1024
    ) as server:
        exchange = load_exchange(
            server.url,
            lambda index: f"{index} {WORDS * 12}",
            output_tokens=2,
            request_timeout_ms=120_000,
            ignore_eos=True,
        )

        async def main() -> object:
            return await OpenLoopSender(
                schedule,
                exchange,
                target_rate_per_s=200.0,
                pattern="poisson",
                watch=SaturationWatch(rule),
            ).run()

        outcome = trio.run(main)
    assert outcome.stop_reason == "workload.arrivals.in_flight_growing", outcome.saturation
    assert outcome.saturation is not None and outcome.launched < 600
    statuses = [row.status for row in outcome.rows]
    assert len(statuses) == 600 and statuses[-1] == "not-launched"
    answered = [row for row in outcome.rows if row.status == "completed"]
    assert answered and all(row.timings is not None for row in answered)
