"""FAKE host for fault injection, one scripted behaviour per run (never a real server).

Usage: fake_host_scripted.py MODE PORT [ENV_DUMP_JSON]
  graceful    listening line, healthy /health, exits 0 on SIGTERM
  silent      never prints the listening line, waits to be killed
  exit-early  exits with status 3 before printing anything
  unhealthy   listening line, /health answers 503 forever
  noisy       graceful, after writing one 100 KiB line and 300 KiB of short lines to stdout
With ENV_DUMP_JSON the host writes its whole environment there first.
"""

from __future__ import annotations

import signal
import sys

from fake_host_common import dump_env, print_marker, serve_health


def main() -> None:
    mode, port = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        dump_env(sys.argv[3])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if mode == "exit-early":
        sys.exit(3)
    if mode == "noisy":
        sys.stdout.write("x" * (100 * 1024) + "\n")
        for index in range(300 * 1024 // 64):
            sys.stdout.write(f"{index:063d}\n")
        sys.stdout.flush()
    if mode in ("graceful", "noisy", "unhealthy"):
        serve_health(port, healthy=mode != "unhealthy")
        print_marker(port)
    elif mode != "silent":
        sys.exit(f"unknown mode {mode}")
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
