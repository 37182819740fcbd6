"""A trace file read for preparation's pin and for the replay: streamed, bounded, every
line checked (``states/trace.py``), hashed as read."""

from __future__ import annotations

from cache_family.schemas.workload import TraceReplay
from cache_family.states.trace import (
    TRACE_FILE_MAX_BYTES,
    TRACE_JSON_PATH,
    TRACE_LINE_MAX_BYTES,
    TraceRequest,
    TraceScaling,
    TraceWindow,
    distinct_ids,
    read_mooncake,
    refuse,
)
from cache_family.system.line_file import BoundedLines


def read_trace(spec: TraceReplay) -> tuple[list[TraceRequest], str]:
    """The window's requests of the trace file, checked line by line, and the SHA-256 of
    every byte read (blocking: run it in a thread)."""
    lines = BoundedLines(
        spec.path,
        max_bytes=TRACE_FILE_MAX_BYTES,
        max_line_bytes=TRACE_LINE_MAX_BYTES,
        what="trace",
        json_path=TRACE_JSON_PATH,
    )
    requests = read_mooncake(lines, trace_window(spec), spec.block_tokens)
    assert lines.sha256 is not None  # read through
    return requests, lines.sha256


def trace_window(spec: TraceReplay) -> TraceWindow:
    return TraceWindow(first=spec.first, from_ms=spec.from_ms, until_ms=spec.until_ms)


def trace_scaling(spec: TraceReplay) -> TraceScaling:
    return TraceScaling(
        tokens_per_block=spec.tokens_per_block,
        block_tokens=spec.block_tokens,
        time_scale=spec.time_scale,
        output_tokens_cap=spec.output_tokens_cap,
    )


def pin_trace(spec: TraceReplay) -> tuple[TraceReplay, int]:
    """The section with the SHA-256 of the trace's bytes (preparation pins it), and the
    distinct hash ids of its window (the plan sizes a chat replay's first characters by
    them); a trace whose bytes differ from a SHA-256 the workload file names is refused."""
    requests, sha256 = read_trace(spec)
    if spec.sha256 is not None and spec.sha256 != sha256:
        raise refuse(
            "trace.pin_mismatch",
            None,
            f"{spec.path} has SHA-256 {sha256}, the workload file names {spec.sha256}",
        )
    return spec.model_copy(update={"sha256": sha256}), distinct_ids(requests)


__all__ = ["pin_trace", "read_trace", "trace_scaling", "trace_window"]
