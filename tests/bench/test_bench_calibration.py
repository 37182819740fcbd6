"""The calibration server's stamps keep its schedule, seen through real loopback requests.

Only lower bounds are asserted: the server may be late on a loaded machine (its stamps then
say so), but it never writes an event before its scheduled time, and the timings it reports
are exactly its stamps.
"""

from __future__ import annotations

import json

import trio
from bench_modules import load_bench

server_mod = load_bench("calibration_server")
client_mod = load_bench("bare_client")
TTFT_MS = 30.0
ITL_MS = 4.0
TOKENS = 5


async def test_stamps_keep_the_schedule_and_match_the_reported_timings() -> None:
    server = server_mod.CalibrationServer(server_mod.Pace(TTFT_MS, ITL_MS, TOKENS))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, 0)
        rows = await client_mod.run(f"http://127.0.0.1:{port}", 8, 16, TOKENS, "hello")
        nursery.cancel_scope.cancel()
    assert all("error" not in row for row in rows), rows
    assert len(server.stamps) == 16
    by_prompt_ms = {row["server_prompt_ms"] for row in rows}
    for stamps in server.stamps:
        # One event per token plus the final event, each no earlier than its schedule.
        assert len(stamps.events_ns) == TOKENS + 1
        assert stamps.events_ns == sorted(stamps.events_ns)
        for index, written in enumerate(stamps.events_ns[:TOKENS]):
            assert written - stamps.received_ns >= (TTFT_MS + index * ITL_MS) * 1e6 - 1e4
        truth = stamps.truth()
        assert truth["ttft_ms"] >= TTFT_MS - 0.01
        assert truth["ttft_ms"] in by_prompt_ms  # what the client read is the stamp itself
    for row in rows:
        # Client time includes the server's: connect, send and read add, never subtract.
        assert row["ttft_ms"] >= row["server_prompt_ms"]
        assert row["latency_ms"] >= row["server_prompt_ms"] + row["server_predicted_ms"]


async def test_chat_stream_ends_with_usage_and_done() -> None:
    server = server_mod.CalibrationServer(server_mod.Pace(1.0, 1.0, 3))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, 0)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        await stream.send_all((head + body).encode())
        received = bytearray()
        while chunk := await stream.receive_some(65536):
            received += chunk
        nursery.cancel_scope.cancel()
    text = received.decode()
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["usage"]["completion_tokens"] == 3
    assert last["choices"][0]["finish_reason"] == "length"
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert contents == ["<1>", " tok", " tok"]
    assert len(server.stamps) == 1 and server.stamps[0].truth()["ttft_ms"] >= 1.0 - 0.01


async def test_the_draining_listener_serves_a_burst_and_the_floor_names_each_request() -> None:
    server = server_mod.CalibrationServer(server_mod.Pace(5.0, 1.0, 3))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server_mod.serve_draining, server, 0)
        # 32 connections at once: the listener takes them as a burst of pending ones.
        rows = await client_mod.run(f"http://127.0.0.1:{port}", 32, 64, 3, "hello")
        nursery.cancel_scope.cancel()
    assert server.port == port
    assert all("error" not in row for row in rows), rows
    assert sorted(s.seq for s in server.stamps) == list(range(1, 65))
    # The floor reads the request number from the first token, so its rows pair with stamps.
    by_seq = {s.seq: s for s in server.stamps}
    assert sorted(row["seq"] for row in rows) == list(range(1, 65))
    for row in rows:
        stamps = by_seq[row["seq"]]
        # One clock on both sides: nothing is received before it was started, nor read
        # before it was written.
        assert row["start_ns"] <= row["sent_ns"]
        assert row["start_ns"] <= stamps.received_ns
        assert row["first_ns"] >= stamps.first_content_ns
