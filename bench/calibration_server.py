"""The calibration server as a process: known TTFT and inter-token interval, and its stamps.

The server itself is ``cache_family.actors.run.calibration_server``
(the run also starts it in-process to
measure its own client). This script serves it on 127.0.0.1 with ``time.monotonic_ns()``
stamps, the clock the bench clients stamp with:

* ``GET /stamps`` answers every finished request's stamps as JSON; ``DELETE /stamps`` clears them.
* ``--stamps FILE`` also appends each finished request as one JSON line.

By default (``--accept drain``) every wake-up of the listener takes all pending connections.
The request's receipt stamp starts its truth, so each event-loop pass a connection waits to be
accepted counts as client error; trio's own listener (``--accept one``) takes one connection a
pass, and at c=64 on a busy core a burst of new connections then waits hundreds of ms.

    .venv/bin/python bench/calibration_server.py --port 0 --ttft-ms 20 --itl-ms 5 --tokens 16
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from cache_family.actors.run.calibration_server import CalibrationServer, Pace

BACKLOG = 1024


async def serve_draining(
    server: CalibrationServer, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """``server``'s connections, accepting every pending one at each wake-up (127.0.0.1)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(BACKLOG)
        listener.setblocking(False)
        server.port = listener.getsockname()[1]
        task_status.started(server.port)
        async with trio.open_nursery() as nursery:
            while True:
                await trio.lowlevel.wait_readable(listener)
                while True:
                    try:
                        accepted, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break  # e.g. ECONNABORTED: that connection is gone, the rest wait
                    stream = trio.SocketStream(trio.socket.from_stdlib_socket(accepted))
                    # The server's own per-connection handler, exactly as its listener runs it.
                    nursery.start_soon(server._connection, stream)


def main(argv: list[str] | None = None, *, ready: Callable[[int], None] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    # An instance's values: on the slotted class the names are its member descriptors.
    defaults = Pace()
    parser.add_argument("--ttft-ms", type=float, default=defaults.ttft_ms)
    parser.add_argument("--itl-ms", type=float, default=defaults.itl_ms)
    parser.add_argument("--tokens", type=int, default=defaults.tokens)
    parser.add_argument("--stamps", type=Path, help="also append each request's stamps here")
    parser.add_argument(
        "--accept",
        choices=("drain", "one"),
        default="drain",
        help="drain: take every pending connection at each wake-up; one: trio's listener",
    )
    args = parser.parse_args(argv)
    server = CalibrationServer(
        Pace(args.ttft_ms, args.itl_ms, args.tokens), stamps_file=args.stamps
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            serve = serve_draining if args.accept == "drain" else None
            if serve is not None:
                port = await nursery.start(serve, server, args.port)
            else:
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
