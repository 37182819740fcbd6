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
