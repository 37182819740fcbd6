#!/usr/bin/python3
"""FAKE llama-server for `cache-family run` fault injection (never a real server, never timed).

It takes llama-server's command line (``--port P`` is all it reads), prints the exact listening
line, and answers on 127.0.0.1:P: ``/health``, ``/tokenize`` and ``/detokenize`` (one token per
character) and ``/completion`` (plain or streamed, llama-server's field layout, ``cache_n`` =
the prompt's length minus one after the first request, as a warm prefix cache would report).

Its behaviour comes from ``<this file>.behaviour.json`` if present (the run gives hosts only an
explicit environment, so a file beside the binary is the test's channel; the run executes a
private copy of the launcher ``make_prepared`` writes, which names that file in
``FAKE_LLAMA_BEHAVIOUR``):
  {"completion_delay": seconds before each /completion answers (default 0),
   "stream_delay": seconds before each streamed /completion answers (default 0),
   "stop_on_stream": true to stop itself with SIGSTOP once a streamed request arrived
                     (right after notifying it), so no race with a test's signal exists,
   "ignore_sigterm": "always", or "after_stream" (once a streamed request arrived) to
                     survive SIGTERM (custody must SIGKILL it); otherwise SIGTERM exits 0,
   "notify_fifo": a FIFO the host writes one line to at events the test waits for:
                  "stream <pid>" when a streamed /completion arrives, "sigterm <pid>"
                  when SIGTERM arrives,
   "record_argv": a path the host writes its argv and environment to,
   "daemonize": "at_start" or "on_sigterm": leave a daemon behind that escapes the process
                group and the process tree (setsid and a double fork) and ignores SIGTERM;
                it writes its pid to "daemon_dir"/<pid> (made before the listening line, or
                in the SIGTERM handler before the host exits 0),
   "marker_file": a path the host appends its pid to when it starts (which bytes ran),
   "metrics": serve llama-server's token counters at GET /metrics (as with --metrics),
              counted from the requests it answered; without it /metrics is 404,
   "metrics_cached_skew": tokens the served cached-token counter adds for each request
                          beyond what the request itself reported (a server whose own
                          totals disagree with its per-request figures),
   "metrics_body": a literal body /metrics serves instead (a malformed exposition)}
Every connection is closed after one answer, as llama-server does after a stream.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# A launcher (the run executes a private copy of it) names the file; else it lies beside this.
BEHAVIOUR_PATH = (
    os.environ.get("FAKE_LLAMA_BEHAVIOUR") or os.path.realpath(__file__) + ".behaviour.json"
)


def _behaviour() -> dict[str, Any]:
    try:
        with open(BEHAVIOUR_PATH) as handle:
            loaded: dict[str, Any] = json.load(handle)
            return loaded
    except FileNotFoundError:
        return {}


BEHAVIOUR = _behaviour()
_served = 0
_stream_seen = False
_lock = threading.Lock()
# What the server counted of the requests it answered (llama-server's /metrics counters).
_counted = {"prompt": 0, "cached": 0, "predicted": 0}


def _exposition() -> bytes:
    if "metrics_body" in BEHAVIOUR:
        return str(BEHAVIOUR["metrics_body"]).encode()
    lines = []
    for name, value in (
        ("llamacpp:prompt_tokens_total", _counted["prompt"]),
        ("llamacpp:prompt_tokens_cached_total", _counted["cached"]),
        ("llamacpp:tokens_predicted_total", _counted["predicted"]),
    ):
        lines += [f"# TYPE {name} counter", f"{name} {value}"]
    lines += ["# TYPE llamacpp:requests_processing gauge", "llamacpp:requests_processing 0"]
    return ("\n".join(lines) + "\n").encode()


def _notify(event: str) -> None:
    path = BEHAVIOUR.get("notify_fifo")
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, f"{event} {os.getpid()}\n".encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _final(prompt: str, n_predict: int, cache_n: int) -> dict[str, Any]:
    return {
        "content": "x" * n_predict,
        "stop": True,
        "stop_type": "limit",
        "truncated": False,
        "tokens_predicted": n_predict,
        "tokens_evaluated": len(prompt),
        "timings": {
            "prompt_n": len(prompt) - cache_n,
            "prompt_ms": 1.0,
            "predicted_n": n_predict,
            "predicted_ms": 1.0,
            "cache_n": cache_n,
        },
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def _json(self, status: int, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length", "0"))
        loaded: dict[str, Any] = json.loads(self.rfile.read(length) or b"{}")
        return loaded

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/metrics" and BEHAVIOUR.get("metrics"):
            data = _exposition()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        global _served, _stream_seen
        body = self._body()
        if self.path == "/tokenize":
            self._json(200, {"tokens": [ord(c) for c in body.get("content", "")]})
        elif self.path == "/detokenize":
            self._json(200, {"content": "".join(chr(t) for t in body.get("tokens", []))})
        elif self.path == "/completion":
            time.sleep(float(BEHAVIOUR.get("completion_delay", 0)))
            prompt = str(body.get("prompt", ""))
            n_predict = int(body.get("n_predict", 1))
            with _lock:
                cache_n = max(len(prompt) - 1, 0) if _served else 0
                _served += 1
                _counted["prompt"] += len(prompt) - cache_n
                _counted["cached"] += cache_n + int(BEHAVIOUR.get("metrics_cached_skew", 0))
                _counted["predicted"] += n_predict
            if body.get("stream"):
                _stream_seen = True
                _notify("stream")
                if BEHAVIOUR.get("stop_on_stream"):
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(float(BEHAVIOUR.get("stream_delay", 0)))
            final = _final(prompt, n_predict, cache_n)
            if not body.get("stream"):
                self._json(200, final)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(n_predict - 1):
                event = {"content": "x", "stop": False, "tokens": [120]}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            final["content"] = "x" if n_predict > 1 else final["content"]
            self.wfile.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        else:
            self._json(404, {"error": "not found"})

    def log_message(self, format: str, *args: object) -> None:
        sys.stdout.write("fake-run-llama-server: " + format % args + "\n")
        sys.stdout.flush()


def _daemonize() -> None:
    """Double fork: the daemon is in a session of its own and no child of this host; returns
    once the daemon has written its pid."""
    directory = BEHAVIOUR["daemon_dir"]
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            path = os.path.join(directory, str(os.getpid()))
            with open(path + ".tmp", "w") as handle:
                handle.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            os.write(write_end, b"x")
            while True:
                signal.pause()
        os._exit(0)
    os.waitpid(child, 0)
    os.read(read_end, 1)


def _on_sigterm(*_: object) -> None:
    mode = BEHAVIOUR.get("ignore_sigterm")
    if mode == "always" or (mode == "after_stream" and _stream_seen):
        _notify("sigterm")
        return
    if BEHAVIOUR.get("daemonize") == "on_sigterm":
        _daemonize()
    os._exit(0)


def main() -> None:
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    signal.signal(signal.SIGTERM, _on_sigterm)
    if BEHAVIOUR.get("marker_file"):
        with open(BEHAVIOUR["marker_file"], "a") as handle:
            handle.write(f"{os.getpid()}\n")
    if BEHAVIOUR.get("daemonize") == "at_start":
        _daemonize()
    if BEHAVIOUR.get("record_argv"):
        with open(BEHAVIOUR["record_argv"], "w") as handle:
            json.dump({"argv": argv, "env": dict(os.environ)}, handle)
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stderr.write(f"srv  llama_server: listening on http://127.0.0.1:{port}\n")
    sys.stderr.flush()
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
