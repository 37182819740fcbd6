"""The run's own client, timed against the calibration server before the first ladder.

The product's own load client sends to it exactly as a rung does; what the client adds on this
machine is its latency minus the server's stamped truth (``states/calibration.py``). Both sides
stamp on trio's clock.
"""

from __future__ import annotations

from typing import Final

import trio

from cache_family.actors.run.calibration_server import CalibrationServer, Pace
from cache_family.actors.run.load import Clock, LoadRun
from cache_family.schemas.journal import ClientCalibrated
from cache_family.schemas.measurement import LoadRequest
from cache_family.states.calibration import calibration
from cache_family.system.http import LoopbackHttp

# Short enough to cost about half a second, long enough that the server's pacing, not the
# client, decides when each event is written.
CALIBRATION_PACE: Final = Pace(ttft_ms=5.0, itl_ms=1.0, tokens=8)
CALIBRATION_REQUESTS: Final = 24
# The first requests warm the client's code paths and the server's; they are left out.
CALIBRATION_WARMUP: Final = 4
CALIBRATION_BOUND_SECONDS: Final = 30.0
CALIBRATION_PROMPT: Final = "calibration " * 32


async def calibrate_client(
    *,
    requests: int = CALIBRATION_REQUESTS,
    pace: Pace = CALIBRATION_PACE,
    clock: Clock = trio.current_time,
) -> ClientCalibrated:
    """Measure, and say what was measured or why nothing was, as the journal record."""
    server = CalibrationServer(pace, clock_ns=lambda: round(clock() * 1e9))
    with trio.move_on_after(CALIBRATION_BOUND_SECONDS):
        try:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(server.serve)
                request = LoadRequest(
                    base_url=f"http://127.0.0.1:{port}",
                    prompt=CALIBRATION_PROMPT,
                    requests=requests,
                    concurrency=1,
                    output_tokens=pace.tokens,
                    stream=True,
                    request_timeout_ms=10_000,
                    warmup_requests=min(CALIBRATION_WARMUP, requests - 1),
                    ignore_eos=True,
                )
                outcome = await LoadRun(request, clock=clock, client=LoopbackHttp()).run()
                nursery.cancel_scope.cancel()
        except OSError as exc:
            return ClientCalibrated(error=f"calibration server: {exc}")
        client: list[float] = []
        truth: list[float] = []
        ttft_error: list[float] = []
        for row in outcome.rows:
            timings = row.timings
            if row.status != "completed" or row.excluded_warmup or timings is None:
                continue
            if row.elapsed_ms is None or timings.prompt_ms is None or timings.predicted_ms is None:
                continue
            client.append(row.elapsed_ms)
            truth.append(timings.prompt_ms + timings.predicted_ms)
            if row.ttft_ms is not None:
                ttft_error.append(row.ttft_ms - timings.prompt_ms)
        if not client:
            failed = next((row.error for row in outcome.rows if row.error), outcome.stop_reason)
            return ClientCalibrated(error=f"no calibration request completed: {failed}")
        figures = calibration(
            client, truth, ttft_error, pace=(pace.ttft_ms, pace.itl_ms, pace.tokens)
        )
        return ClientCalibrated(calibration=figures)
    return ClientCalibrated(error=f"not finished within {CALIBRATION_BOUND_SECONDS} s")
