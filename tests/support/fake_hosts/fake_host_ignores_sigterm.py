"""FAKE host for fault injection: ignores SIGTERM and forks a grandchild that ignores it too.

Usage: fake_host_ignores_sigterm.py PORT PIDS_JSON [--grandchild-escapes] [--leader-obeys]
With --grandchild-escapes the grandchild calls setsid() and so leaves the host's process
group: only a (pid, create time) record made before signalling can still find it. The
grandchild keeps the inherited stdout/stderr pipes open, as a real leaked helper would.
With --leader-obeys the host itself exits on SIGTERM and only its grandchild ignores it.
"""

from __future__ import annotations

import os
import signal
import sys

from fake_host_common import print_marker, serve_health, write_pids


def main() -> None:
    port, pids_path = int(sys.argv[1]), sys.argv[2]
    escapes = "--grandchild-escapes" in sys.argv[3:]
    leader_obeys = "--leader-obeys" in sys.argv[3:]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = os.fork()
    if grandchild == 0:
        if escapes:
            os.setsid()
        while True:
            signal.pause()
    if leader_obeys:
        # os._exit: no interpreter shutdown to outlast a short grace on a loaded machine.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    write_pids(pids_path, [os.getpid(), grandchild])
    serve_health(port)
    print_marker(port)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
