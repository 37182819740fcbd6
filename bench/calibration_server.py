"""The calibration server as a process: known TTFT and inter-token interval, and its stamps.

The server itself is ``cache_family.oracles.calibration`` (the run also starts it in-process to
measure its own client). This script serves it on 127.0.0.1 with ``time.monotonic_ns()``
stamps, the clock the bench clients stamp with:

* ``GET /stamps`` answers every finished request's stamps as JSON; ``DELETE /stamps`` clears them.
* ``--stamps FILE`` also appends each finished request as one JSON line.

    .venv/bin/python bench/calibration_server.py --port 0 --ttft-ms 20 --itl-ms 5 --tokens 16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import trio

from cache_family.oracles.calibration import CalibrationServer, Pace


def main(argv: list[str] | None = None, *, ready: Callable[[int], None] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ttft-ms", type=float, default=Pace.ttft_ms)
    parser.add_argument("--itl-ms", type=float, default=Pace.itl_ms)
    parser.add_argument("--tokens", type=int, default=Pace.tokens)
    parser.add_argument("--stamps", type=Path, help="also append each request's stamps here")
    args = parser.parse_args(argv)
    server = CalibrationServer(
        Pace(args.ttft_ms, args.itl_ms, args.tokens), stamps_file=args.stamps
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, args.port)
            # The harness reads this line to learn the port.
            print(f"listening http://127.0.0.1:{port}", flush=True)
            if ready is not None:
                ready(port)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
