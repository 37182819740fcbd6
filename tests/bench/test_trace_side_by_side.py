"""The trace bench's side by side with AIPerf (issue 27): the window AIPerf is given, already
scaled, shares exactly the blocks the scaled window does; AIPerf's command replays it on its
timestamps with the block size; its export's lines give each request's lateness against the
schedule; and the local tokenizer is laid out where AIPerf's offline trace loader finds it.
Pure functions on made-up exports: nothing is timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_modules import load_bench

from cache_family.states.trace import TraceRequest, TraceScaling

bench = load_bench("trace_replay")
peers = load_bench("bench_peers")


def _request(line: int, at_ms: float, length: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(
        line=line, timestamp_ms=at_ms, input_length=length, output_length=40, hash_ids=ids
    )


def test_the_scaled_window_keeps_the_ids_and_scales_lengths_times_and_answers() -> None:
    requests = [
        _request(1, 3000.0, 1024, (0, 1)),
        _request(2, 3000.0, 600, (0, 2)),
        _request(3, 6000.0, 100, (7,)),
    ]
    scaling = TraceScaling(tokens_per_block=16, time_scale=0.02, output_tokens_cap=4)
    lines = [json.loads(line) for line in bench.scaled_trace_lines(requests, scaling)]
    assert [line["hash_ids"] for line in lines] == [[0, 1], [0, 2], [7]]
    # 600 = 512 + 88: the last block 88 x 16 / 512 = 2.75, rounded up to 3 tokens.
    assert [line["input_length"] for line in lines] == [32, 19, 4]
    assert [line["output_length"] for line in lines] == [4, 4, 4]
    # From the window's first request, times 0.02: 3 s of trace time is 60 ms.
    assert [line["timestamp"] for line in lines] == [0.0, 0.0, 60.0]
    for line in lines:  # each reads back as the scaled request: ceil(length / B) ids
        assert len(line["hash_ids"]) == -(-line["input_length"] // 16)


def test_aiperfs_trace_command_replays_the_file_on_its_timestamps_with_the_block_size(
    tmp_path: Path,
) -> None:
    argv = peers.aiperf_trace_command(
        Path("/v"), "http://h", Path("/w.jsonl"), 16, tmp_path, peers.HUB_TOKENIZER_ID
    )
    assert argv[argv.index("--input-file") + 1] == "/w.jsonl"
    assert argv[argv.index("--custom-dataset-type") + 1] == "mooncake_trace"
    assert argv[argv.index("--isl-block-size") + 1] == "16"
    assert argv[argv.index("--tokenizer") + 1] == "cache-family/peer-tokenizer"
    assert "--fixed-schedule" in argv and "--request-rate" not in argv


def test_aiperfs_export_gives_each_lines_start_against_its_scheduled_time(
    tmp_path: Path,
) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    ms = 1_000_000
    records = [
        {"metadata": {"session_num": 1, "credit_issued_ns": 1_003 * ms,
                      "request_start_ns": 1_010 * ms}},
        {"metadata": {"session_num": 0, "credit_issued_ns": 1_000 * ms,
                      "request_start_ns": 1_002 * ms}},
        {"metadata": {"session_num": 2, "credit_issued_ns": 1_061 * ms,
                      "request_start_ns": 1_065 * ms}, "error": {"x": 1}},
    ]  # fmt: skip
    (artifacts / "profile_export.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    rows = peers.aiperf_trace_rows(tmp_path)
    assert [(r["line"], r["error"]) for r in rows] == [(1, False), (0, False), (2, True)]
    # Lines 0 and 1 at 0 ms, line 2 at 60 ms; the first line's credit is the zero.
    late = peers.aiperf_trace_lateness_ms(rows, [0.0, 0.0, 0.06])
    assert late == pytest.approx([10.0, 2.0, 5.0])
    assert peers.aiperf_trace_lateness_ms(rows[:1], [0.0, 0.0, 0.06]) == []


def test_the_local_tokenizer_is_laid_out_as_a_hub_cache_snapshot(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    name = peers.hub_cache_tokenizer(tokenizer, tmp_path / "hf")
    repo = tmp_path / "hf" / "hub" / "models--cache-family--peer-tokenizer"
    revision = (repo / "refs" / "main").read_text()
    assert name == "cache-family/peer-tokenizer"
    assert (repo / "snapshots" / revision / "tokenizer.json").read_text() == "{}"
