"""How the harness drives each peer and reads its per-request export.

Both peers run offline from their own virtual environments (``just bench-peers-install``)
with the tokenizer directory written by ``peer_tokenizer.py``, against the calibration
server's OpenAI chat endpoint, streaming, one connection per request where the peer lets us
choose. Rows come back as ``start_wall_ns`` (epoch ns), ``ttft_ms``, ``latency_ms`` (the
peer's own end-to-end figure), ``tpot_ms`` and, when the peer exports it, the server's
request number ``seq`` (the calibration server names it in the first token and the id).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 64
_SEQ = re.compile(r"(?:chatcmpl-|^<)(\d+)")


def request_seq(text: object) -> int | None:
    """The calibration server's request number in a first token (``<N>``) or an id."""
    found = _SEQ.search(text) if isinstance(text, str) else None
    return int(found.group(1)) if found else None


def aiperf_command(
    venv: Path, url: str, c: int, n: int, tokens: int, out: Path, tokenizer: Path
) -> list[str]:
    return [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--model", "calibration",
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--concurrency", str(c),
        "--request-count", str(n),
        # A local directory: AIPerf's HF_HUB_OFFLINE path would look it up as a repo id.
        "--tokenizer", str(tokenizer),
        "--prompt-input-tokens-mean", str(PROMPT_TOKENS),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(tokens),
        "--prompt-output-tokens-stddev", "0",
        "--use-server-token-count",
        "--connection-reuse-strategy", "never",
        "--output-artifact-dir", str(out / "artifacts"),
        "--ui-type", "none",
        "--workers-max", "1",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]  # fmt: skip


def aiperf_rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    export = out / "artifacts" / "profile_export.jsonl"
    for line in export.read_text().splitlines():
        record = json.loads(line)
        metrics = record.get("metrics") or {}
        if record.get("error") or "time_to_first_token" not in metrics:
            continue
        ttft = metrics["time_to_first_token"]["value"]
        latency = metrics["request_latency"]["value"]
        count = metrics.get("usage_completion_tokens", metrics.get("output_sequence_length"))
        tokens = int(count["value"]) if count else 1
        rows.append(
            {
                "start_wall_ns": record["metadata"]["request_start_ns"],
                "ttft_ms": ttft,
                "latency_ms": latency,
                "tpot_ms": (latency - ttft) / max(tokens - 1, 1),
            }
        )
    return rows


def guidellm_command(
    venv: Path, url: str, c: int, n: int, tokens: int, out: Path, tokenizer: Path
) -> list[str]:
    return [
        str(venv / "bin" / "guidellm"),
        "run",
        "--backend", f"kind=openai_http,target={url},model=calibration",
        "--profile", f"kind=concurrent,streams={c}",
        "--constraint", f"kind=max_requests,count={n}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--output", f"kind=json,path={out / 'benchmarks.json'}",
        "--disable-console-interactive",
    ]  # fmt: skip


def guidellm_rows(out: Path) -> list[dict[str, Any]]:
    report = json.loads((out / "benchmarks.json").read_text())
    rows = []
    for benchmark in report["benchmarks"]:
        for request in benchmark["requests"]["successful"]:
            timings = request["info"]["timings"]
            start = timings["request_start"]
            first = timings["first_token_iteration"]
            end = timings["request_end"]
            tokens = (request.get("output_metrics") or {}).get("text_tokens") or 1
            ttft, latency = (first - start) * 1000, (end - start) * 1000
            seq = request_seq(request.get("response_id") or request.get("output") or "")
            rows.append(
                {
                    "start_wall_ns": int(start * 1e9),
                    "ttft_ms": ttft,
                    "latency_ms": latency,
                    "tpot_ms": (latency - ttft) / max(int(tokens) - 1, 1),
                    "seq": seq,
                }
            )
    return rows


# --- open-loop rates (issue 20): the same target rate and request count for each peer ---------


def aiperf_rate_command(
    venv: Path,
    url: str,
    rate: float,
    pattern: str,
    n: int,
    tokens: int,
    out: Path,
    tokenizer: Path,
    seed: int,
) -> list[str]:
    """AIPerf sending ``n`` requests at ``rate`` per second on its ``pattern`` schedule
    (``constant`` or ``poisson``), pooled connections (its default), one worker."""
    return [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--model", "calibration",
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--request-rate", f"{rate:g}",
        "--arrival-pattern", pattern,
        "--request-count", str(n),
        "--random-seed", str(seed),
        "--tokenizer", str(tokenizer),
        "--prompt-input-tokens-mean", str(PROMPT_TOKENS),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(tokens),
        "--prompt-output-tokens-stddev", "0",
        "--use-server-token-count",
        "--output-artifact-dir", str(out / "artifacts"),
        "--ui-type", "none",
        "--workers-max", "1",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]  # fmt: skip


def aiperf_send_rows(out: Path) -> list[dict[str, Any]]:
    """Per request: AIPerf's own stamps (epoch ns) of the credit's issue and the request's
    start, and whether it failed. AIPerf exports no scheduled time: the credit is issued when
    its pacer wakes, so start minus issue leaves the pacer's own lateness out."""
    rows = []
    export = out / "artifacts" / "profile_export.jsonl"
    for line in export.read_text().splitlines():
        record = json.loads(line)
        meta = record.get("metadata") or {}
        rows.append(
            {
                "issued_ns": meta.get("credit_issued_ns"),
                "start_ns": meta.get("request_start_ns"),
                "error": bool(record.get("error")),
            }
        )
    return rows


def guidellm_rate_command(
    venv: Path,
    url: str,
    rate: float,
    pattern: str,
    n: int,
    tokens: int,
    out: Path,
    tokenizer: Path,
    seed: int,
) -> list[str]:
    """GuideLLM's ``constant`` or ``poisson`` profile at ``rate``, stopped after ``n``."""
    return [
        str(venv / "bin" / "guidellm"),
        "run",
        "--backend", f"kind=openai_http,target={url},model=calibration",
        "--profile", f"kind={pattern},rate={rate:g}",
        "--seed", f"kind=static,value={seed}",
        "--constraint", f"kind=max_requests,count={n}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--output", f"kind=json,path={out / 'benchmarks.json'}",
        "--disable-console-interactive",
    ]  # fmt: skip


def guidellm_send_rows(out: Path) -> list[dict[str, Any]]:
    """Per request: GuideLLM's targeted start (its schedule) and its request start, epoch
    seconds as it exports them, and whether it failed."""
    report = json.loads((out / "benchmarks.json").read_text())
    rows = []
    for benchmark in report["benchmarks"]:
        for status, requests in benchmark["requests"].items():
            for request in requests if isinstance(requests, list) else ():
                timings = request["info"]["timings"]
                rows.append(
                    {
                        "targeted_s": timings.get("targeted_start"),
                        "start_s": timings.get("request_start"),
                        "error": status != "successful",
                    }
                )
    return rows


# --- trace replay (issue 27): a Mooncake-format window on its own timestamps ----------------

#: The name AIPerf is given for the local tokenizer laid out as a hub cache snapshot.
HUB_TOKENIZER_ID = "cache-family/peer-tokenizer"
_HUB_REVISION = "0" * 40


def hub_cache_tokenizer(tokenizer: Path, hf_home: Path) -> str:
    """The local tokenizer directory copied into ``hf_home`` as a hub cache snapshot, and the
    name that finds it there offline. AIPerf's trace loaders write prompts in worker processes
    that force ``HF_HUB_OFFLINE`` and then resolve the name through the hub cache
    (``snapshot_download(local_files_only=True)``), which refuses a directory path
    (``HFValidationError: Repo id must be in the form 'repo_name' or
    'namespace/repo_name'``); nothing is fetched either way."""
    repo = hf_home / "hub" / ("models--" + HUB_TOKENIZER_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / _HUB_REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    for source in tokenizer.iterdir():
        if source.is_file():
            (snapshot / source.name).write_bytes(source.read_bytes())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_HUB_REVISION)
    return HUB_TOKENIZER_ID


def aiperf_trace_command(
    venv: Path, url: str, trace: Path, block_tokens: int, out: Path, tokenizer_id: str
) -> list[str]:
    """AIPerf replaying ``trace`` (Mooncake JSONL, already scaled) on its timestamps
    (``--fixed-schedule``), each hash id a block of ``block_tokens`` tokens, pooled
    connections (its default), one worker."""
    return [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--model", "calibration",
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--input-file", str(trace),
        "--custom-dataset-type", "mooncake_trace",
        "--fixed-schedule",
        "--isl-block-size", str(block_tokens),
        "--tokenizer", tokenizer_id,
        "--use-server-token-count",
        "--output-artifact-dir", str(out / "artifacts"),
        "--ui-type", "none",
        "--workers-max", "1",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]  # fmt: skip


def aiperf_trace_rows(out: Path) -> list[dict[str, Any]]:
    """Per request: its line in the trace file (AIPerf's ``session_num``: a trace line is a
    one-turn session, numbered in file order), the credit's issue and the request's start
    (epoch ns), and whether it failed."""
    rows = []
    export = out / "artifacts" / "profile_export.jsonl"
    for line in export.read_text().splitlines():
        record = json.loads(line)
        meta = record.get("metadata") or {}
        rows.append(
            {
                "line": meta.get("session_num"),
                "issued_ns": meta.get("credit_issued_ns"),
                "start_ns": meta.get("request_start_ns"),
                "error": bool(record.get("error")),
            }
        )
    return rows


def aiperf_trace_lateness_ms(rows: list[dict[str, Any]], schedule_s: list[float]) -> list[float]:
    """Each request's start minus its line's scheduled offset, both from the first line's
    credit (AIPerf exports no schedule time: its first credit stands for the schedule's zero,
    so the pacer's own lateness on that first credit is left out)."""
    zero = [r["issued_ns"] for r in rows if r["line"] == 0 and r["issued_ns"] is not None]
    if not zero:
        return []
    return [
        (r["start_ns"] - zero[0]) / 1e6 - 1000 * schedule_s[r["line"]]
        for r in rows
        if r["start_ns"] is not None and isinstance(r["line"], int) and r["line"] < len(schedule_s)
    ]
