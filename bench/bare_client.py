"""The floor: the least a streaming client can do, so other clients' overhead has a baseline.

One new connection per request (as llama-server requires), h11 over trio streams, no
validation beyond finding the events: ``POST /completion`` with ``stream: true``, stamp the
start, the arrival of the first content event and the arrival of the ``stop: true`` event on
``time.monotonic_ns()`` (the calibration server's clock), keep the final event's ``timings``.
It prints one JSON line per request and a last line with the CPU the load itself used
(``resource.getrusage`` around the run, so interpreter start-up and imports are not counted).

    .venv/bin/python bench/bare_client.py --url http://127.0.0.1:PORT --concurrency 8 \
        --requests 64 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import h11
import trio
from bench_peers import request_seq

READ_SIZE = 64 * 1024


async def one(host: str, port: int, body: bytes) -> dict[str, Any]:
    started = time.monotonic_ns()
    first: int | None = None
    seq: int | None = None
    final: dict[str, Any] | None = None
    ended = 0
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        headers = [
            ("host", f"{host}:{port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("connection", "close"),
        ]
        request = h11.Request(method="POST", target="/completion", headers=headers)
        await stream.send_all(conn.send(request) + conn.send(h11.Data(data=body)))
        # From here on the request is in the server's socket: what remains until its receipt
        # stamp is the server's accept and read, not this client.
        sent = time.monotonic_ns()
        conn.send(h11.EndOfMessage())
        pending = b""
        while final is None:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(READ_SIZE))
                continue
            if isinstance(event, h11.Response) and event.status_code != 200:
                raise RuntimeError(f"HTTP {event.status_code}")
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                raise RuntimeError("stream ended without a stop event")
            if not isinstance(event, h11.Data):
                continue
            arrived = time.monotonic_ns()
            pending += event.data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                payload = json.loads(line[6:])
                if payload.get("stop"):
                    final, ended = payload, arrived
                elif first is None and payload.get("content"):
                    first, seq = arrived, request_seq(payload["content"])
    timings = final["timings"]
    first = first if first is not None else ended
    tokens = int(final["tokens_predicted"])
    latency = (ended - started) / 1e6
    ttft = (first - started) / 1e6
    return {
        "ttft_ms": ttft,
        "latency_ms": latency,
        "tpot_ms": (latency - ttft) / max(tokens - 1, 1),
        "tokens": tokens,
        "start_ns": started,
        "sent_ns": sent,
        "first_ns": first,
        "seq": seq,
        "server_prompt_ms": timings["prompt_ms"],
        "server_predicted_ms": timings["predicted_ms"],
    }


async def run(url: str, concurrency: int, requests: int, tokens: int, prompt: str) -> list[Any]:
    hostport = url.removeprefix("http://").rstrip("/")
    host, _, port = hostport.partition(":")
    rows: list[Any] = []
    slots = trio.Semaphore(concurrency)

    async def task(index: int) -> None:
        try:
            body = {
                "prompt": f"{index} {prompt}",
                "n_predict": tokens,
                "stream": True,
                "ignore_eos": True,
                "cache_prompt": True,
            }
            rows.append(await one(host, int(port), json.dumps(body).encode()))
        except (OSError, RuntimeError, ValueError, KeyError, h11.ProtocolError) as exc:
            rows.append({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            slots.release()

    async with trio.open_nursery() as nursery:
        for index in range(requests):
            await slots.acquire()
            nursery.start_soon(task, index)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt", default="calibration prompt " * 16)
    args = parser.parse_args(argv)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    rows = trio.run(run, args.url, args.concurrency, args.requests, args.tokens, args.prompt)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    for row in rows:
        print(json.dumps(row))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(json.dumps({"cpu_s": cpu, "requests": len(rows), "wall_s": wall}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
