"""Shared parts of the scripted FAKE hosts used by fault-injection tests (never a real server).

A fake host prints llama-server's exact listening line and answers ``GET /health`` on a real
127.0.0.1 socket, so host custody is exercised against a real child process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HealthHandler(BaseHTTPRequestHandler):
    healthy = True

    def do_GET(self) -> None:
        if self.path != "/health":
            self.send_error(404)
            return
        if self.healthy:
            status, body = 200, {"status": "ok"}
        else:
            status, body = 503, {"error": {"code": 503, "message": "Loading model"}}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        sys.stdout.write("fake-host: " + format % args + "\n")
        sys.stdout.flush()


def serve_health(port: int, *, healthy: bool = True) -> ThreadingHTTPServer:
    handler = type("Handler", (HealthHandler,), {"healthy": healthy})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def print_marker(port: int) -> None:
    sys.stderr.write(f"srv  llama_server: listening on http://127.0.0.1:{port}\n")
    sys.stderr.flush()


def dump_env(path: str) -> None:
    with open(path, "w") as handle:
        json.dump(dict(os.environ), handle)


def write_pids(path: str, pids: list[int]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(pids, handle)
    os.replace(tmp, path)
