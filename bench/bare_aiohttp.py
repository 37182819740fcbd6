"""The issue's original floor, a bare aiohttp client, beside ``bare_client.py`` (h11 on trio).

Same contract and output as ``bare_client.py``; aiohttp is not a project dependency, so the
harness runs this with the AIPerf virtual environment's Python, which has it.

    bench/.venv-aiperf/bin/python bench/bare_aiohttp.py --url http://127.0.0.1:PORT ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from typing import Any

import aiohttp
from bench_peers import request_seq


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic_ns()
    first: int | None = None
    seq: int | None = None
    final: dict[str, Any] | None = None
    ended = 0
    async with session.post(url + "/completion", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            arrived = time.monotonic_ns()
            payload = json.loads(line[6:])
            if payload.get("stop"):
                final, ended = payload, arrived
                break
            if first is None and payload.get("content"):
                first, seq = arrived, request_seq(payload["content"])
    if final is None:
        raise RuntimeError("stream ended without a stop event")
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
        "first_ns": first,
        "seq": seq,
        "server_prompt_ms": final["timings"]["prompt_ms"],
        "server_predicted_ms": final["timings"]["predicted_ms"],
    }


async def run(url: str, concurrency: int, requests: int, tokens: int, prompt: str) -> list[Any]:
    rows: list[Any] = []
    slots = asyncio.Semaphore(concurrency)
    # One connection per request, as llama-server requires.
    connector = aiohttp.TCPConnector(force_close=True, limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

        async def task(index: int) -> None:
            try:
                body = {
                    "prompt": f"{index} {prompt}",
                    "n_predict": tokens,
                    "stream": True,
                    "ignore_eos": True,
                    "cache_prompt": True,
                }
                rows.append(await one(session, url.rstrip("/"), body))
            except (OSError, RuntimeError, ValueError, KeyError, aiohttp.ClientError) as exc:
                rows.append({"error": f"{type(exc).__name__}: {exc}"})
            finally:
                slots.release()

        tasks = []
        for index in range(requests):
            await slots.acquire()
            tasks.append(asyncio.create_task(task(index)))
        await asyncio.gather(*tasks)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt", default="calibration prompt " * 16)
    args = parser.parse_args()
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    rows = asyncio.run(run(args.url, args.concurrency, args.requests, args.tokens, args.prompt))
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    for row in rows:
        print(json.dumps(row))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(json.dumps({"cpu_s": cpu, "requests": len(rows), "wall_s": wall}))


if __name__ == "__main__":
    main()
