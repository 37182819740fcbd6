"""FAKE llama-server for a fault-injection test of the stage server oracle: answers
``/health`` and ``/v1/models`` (the ``--alias`` given) on ``--port``, and on SIGTERM writes
far more log than a pipe holds to stdout before it exits 0, as a real server logging its
shutdown under load does. A parent that stopped reading its output blocks it for good."""

from __future__ import annotations

import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

FLOOD_BYTES = 512 * 1024


def main(argv: list[str]) -> int:
    port = int(argv[argv.index("--port") + 1])
    alias = argv[argv.index("--alias") + 1]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                body = {"status": "ok"}
            else:
                body = {"object": "list", "data": [{"id": alias, "object": "model"}]}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    stopping = threading.Event()

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("fake llama-server: listening", flush=True)
    stopping.wait()
    line = "fake llama-server: shutting down, releasing slot " + "x" * 60 + "\n"
    for _ in range(FLOOD_BYTES // len(line) + 1):
        sys.stdout.write(line)
    sys.stdout.flush()
    print("fake llama-server: stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
