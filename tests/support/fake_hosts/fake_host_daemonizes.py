"""FAKE host for fault injection: leaves a daemon behind that escapes the process group AND
the process tree (never a real server).

Usage: fake_host_daemonizes.py PORT DAEMON_PID_JSON (at-start | on-sigterm) [--clear-env]
The daemon comes from a classic double fork: a child calls setsid() (a new session, so group
signals miss it), forks the daemon and exits, so the daemon is re-parented away from the host
and no descendant walk of the host finds it either. It writes its pid to DAEMON_PID_JSON and
then waits forever, ignoring SIGTERM.
  at-start    the daemon is made before the listening line; the host then serves and exits 0
              on SIGTERM
  on-sigterm  the host serves; its SIGTERM handler makes the daemon, waits until the daemon
              wrote its pid, then exits 0 (the group stop looks graceful)
With --clear-env the daemon re-executes itself with an empty environment: the case the
environment tag cannot see (``/proc/PID/environ`` shows the environment at exec time).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from fake_host_common import print_marker, serve_health, write_pids


def _daemon_body(pid_path: str, clear_env: bool) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if clear_env:
        os.execve(sys.executable, [sys.executable, "-c", _REEXEC, pid_path], {})
    write_pids(pid_path, [os.getpid()])
    while True:
        signal.pause()


_REEXEC = (
    "import json, os, signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "path = sys.argv[1]\n"
    "open(path + '.tmp', 'w').write(json.dumps([os.getpid()]))\n"
    "os.replace(path + '.tmp', path)\n"
    "while True: signal.pause()\n"
)


def daemonize(pid_path: str, clear_env: bool) -> None:
    """Double fork; returns in the caller once the intermediate child has exited."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            _daemon_body(pid_path, clear_env)
        os._exit(0)
    os.waitpid(child, 0)


def _wait_for(path: str) -> None:
    # The host's own handler runs in a real process with no event to await.
    while not os.path.exists(path):
        time.sleep(0.01)


def main() -> None:
    port, pid_path, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    clear_env = "--clear-env" in sys.argv[4:]
    if mode == "at-start":
        daemonize(pid_path, clear_env)
        _wait_for(pid_path)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    elif mode == "on-sigterm":

        def on_sigterm(*_: object) -> None:
            daemonize(pid_path, clear_env)
            _wait_for(pid_path)
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_sigterm)
    else:
        sys.exit(f"unknown mode {mode}")
    serve_health(port)
    print_marker(port)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
