"""Prompt time with and without a cached prefix, on the zoo's tiny Llama or the trained
Gemma 3 270M (``--model real``), in one run.

For each prompt length N (default 128, 512 and 2048 tokens) and each repeat, the script sends
a cold request (N fresh random tokens, never seen by the server) and then a cached request of
the same length N that repeats the cold prompt's first N - S tokens and adds S new ones
(S = 16), so the server can reuse N - S tokens of its prompt cache. Sizes are interleaved
within each repeat so slow drift on a shared machine hits both sides alike. The server runs
with ``--cache-ram 0`` (no host-RAM prompt cache to restore old prompts), one slot, one
thread pinned to CPU 0; this client pins itself to CPU 1. One request is sent first and
excluded (allocation warm-up).

It prints the medians, the ratio cold/cached measured in this same run, and every sample.
On the zoo these are TINY RANDOM-WEIGHT MODEL FIGURES: they show the mechanism's size on this
machine, they are not performance claims about Llama or llama.cpp. With ``--model real`` they
are the trained model's CPU figures on this host (its CPU, threads and load are printed beside
them), never GPU claims; each row adds the difference of medians with its 95 % bootstrap
interval.

    .venv/bin/python bench/prefix_reuse.py [--model zoo|real] [--repeats 5]
        [--sizes 128 512 2048] [--threads 1] [--json OUT] [--append]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from _results import load_average, machine, record

from cache_family.errors import Refused
from cache_family.oracles.native_parts import ensure_parts, serve
from cache_family.oracles.real_model import ensure_real_model
from cache_family.oracles.zoo.vocab import CONTROL_TOKENS, vocabulary
from cache_family.report.stats import bootstrap_median_difference

SUFFIX_TOKENS = 16
MODEL_KEY = "llama"
# The trained model's ordinary pieces: past its control and byte tokens, below its rarest.
REAL_TOKEN_RANGE = (1_000, 200_000)


def fresh_tokens(label: str, n: int, model: str = "zoo") -> list[int]:
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    if model == "real":
        return [int(t) for t in rng.integers(*REAL_TOKEN_RANGE, size=n)]
    n_ordinary = len(vocabulary()[0]) - len(CONTROL_TOKENS)
    return [int(t) for t in rng.integers(0, n_ordinary, size=n)]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(
    sizes: list[int], repeats: int, threads: int, pin: bool, which: str = "zoo"
) -> dict[str, Any]:
    parts = ensure_parts(sys.stderr, build=False)
    if which == "real":
        model = ensure_real_model(sys.stderr, fetch=False).model
    else:
        model = parts.model_path(MODEL_KEY)
    producer = json.loads(parts.producer_json.read_text())
    n_cpus = len(os.sched_getaffinity(0))
    pinned = pin and n_cpus >= 2
    server_cpus = {sorted(os.sched_getaffinity(0))[0]} if pinned else None
    if pinned:
        assert server_cpus is not None
        client_cpus = set(os.sched_getaffinity(0)) - server_cpus
        os.sched_setaffinity(0, client_cpus)
    samples: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    ctx = max(sizes) + 2 * SUFFIX_TOKENS + 64
    with serve(
        parts.llama_server,
        model,
        ctx_size=ctx,
        threads=threads,
        cache_ram_mib=0,
        cpus=server_cpus,
    ) as server:
        server.completion(fresh_tokens("warm-up", 64, which), n_predict=1)
        for repeat in range(repeats):
            for n in sizes:
                cold_prompt = fresh_tokens(f"cold:{n}:{repeat}", n, which)
                cold = server.completion(cold_prompt, n_predict=1)["timings"]
                cached_prompt = cold_prompt[: n - SUFFIX_TOKENS] + fresh_tokens(
                    f"suffix:{n}:{repeat}", SUFFIX_TOKENS, which
                )
                cached = server.completion(cached_prompt, n_predict=1)["timings"]
                samples[n].append({"cold": cold, "cached": cached})
    rows = []
    for n in sizes:
        cold_ms = [s["cold"]["prompt_ms"] for s in samples[n]]
        cached_ms = [s["cached"]["prompt_ms"] for s in samples[n]]
        cold_median = statistics.median(cold_ms)
        cached_median = statistics.median(cached_ms)
        saved = bootstrap_median_difference(cached_ms, cold_ms)
        rows.append(
            {
                "prompt_tokens": n,
                "saved_ms": round(saved.difference, 2) if saved else None,
                "saved_ms_ci95": [round(saved.low, 2), round(saved.high, 2)] if saved else None,
                "cold_prompt_ms_median": round(cold_median, 2),
                "cached_prompt_ms_median": round(cached_median, 2),
                "ratio_cold_over_cached": round(cold_median / cached_median, 2),
                "cold_prompt_ms": [round(v, 2) for v in cold_ms],
                "cached_prompt_ms": [round(v, 2) for v in cached_ms],
                "cold_cache_n": [s["cold"]["cache_n"] for s in samples[n]],
                "cached_cache_n": [s["cached"]["cache_n"] for s in samples[n]],
                "cached_prompt_n": [s["cached"]["prompt_n"] for s in samples[n]],
            }
        )
    real = which == "real"
    return {
        "label": "the trained model's CPU figures on this host, not GPU claims"
        if real
        else "tiny random-weight model figures, not performance claims",
        "model_key": "gemma3_270m (Gemma 3 270M Q4_K_M, trained)" if real else MODEL_KEY,
        "real": real,
        "model": str(model),
        "model_sha256": _sha256(model.resolve()),
        "llama_server_sha256": producer["files"]["native/bin/llama-server"],
        "llama_cpp": f"{producer['source']['package']}=={producer['source']['version']} "
        f"(llama.cpp {producer['source']['llama_cpp_commit'][:12]})",
        "threads": threads,
        "server_cpus": sorted(server_cpus) if server_cpus else "unpinned",
        "client_cpus": sorted(os.sched_getaffinity(0)),
        "machine": machine(),
        "repeats": repeats,
        "suffix_tokens": SUFFIX_TOKENS,
        "rows": rows,
    }


def render(result: dict[str, Any], command: str) -> str:
    lines = [
        f"# Prefix reuse on {_model_words(result)} ({result['label']})",
        f"command: {command}",
        f"server: {result['llama_cpp']}, "
        f"llama-server sha256 {result['llama_server_sha256'][:16]}…, "
        f"-t {result['threads']}, CPUs {result['server_cpus']}; client CPUs "
        f"{result['client_cpus']}; {result['machine']}",
        f"model: {result['model']} (sha256 {result['model_sha256'][:16]}…)",
        f"medians of {result['repeats']} repeats; cached = same length, first N-"
        f"{result['suffix_tokens']} tokens cached",
        "",
        "| prompt tokens | cold prompt_ms | cached prompt_ms | saved ms (95 % CI) "
        "| cold / cached | cached tokens |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        saved = (
            "n/a"
            if row["saved_ms"] is None
            else f"{row['saved_ms']:.1f} ({row['saved_ms_ci95'][0]:.1f} to "
            f"{row['saved_ms_ci95'][1]:.1f})"
        )
        reused = sorted(set(row["cached_cache_n"]))
        lines.append(
            f"| {row['prompt_tokens']} | {row['cold_prompt_ms_median']:.1f} | "
            f"{row['cached_prompt_ms_median']:.1f} | {saved} | "
            f"{row['ratio_cold_over_cached']:.1f}x | {', '.join(map(str, reused))} |"
        )
    lines.append("")
    for row in result["rows"]:
        lines.append(
            f"N={row['prompt_tokens']}: cold {row['cold_prompt_ms']} (cache_n "
            f"{row['cold_cache_n']}); cached {row['cached_prompt_ms']} (cache_n "
            f"{row['cached_cache_n']}, prompt_n {row['cached_prompt_n']})"
        )
    return "\n".join(lines)


def _model_words(result: dict[str, Any]) -> str:
    if result.get("real"):
        return "the trained Gemma 3 270M"
    return f"the zoo's tiny {result['model_key']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=["zoo", "real"],
        default="zoo",
        help="the zoo's tiny Llama, or the trained Gemma 3 270M (`just native-parts` fetches it)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="do not pin server and client")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    parser.add_argument("--append", action="store_true", help="record in bench/RESULTS.md")
    args = parser.parse_args(argv)
    load_before = load_average()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (medians of three or more)")
    if min(args.sizes) <= SUFFIX_TOKENS:
        parser.error(f"every size must exceed the {SUFFIX_TOKENS}-token suffix")
    try:
        result = run(
            sorted(args.sizes), args.repeats, args.threads, pin=not args.no_pin, which=args.model
        )
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"error: {refusal.line()}", file=sys.stderr)
        return 2
    command = " ".join([".venv/bin/python", "bench/prefix_reuse.py", *sys.argv[1:]])
    text = render(result, command)
    print(text)
    if args.append:
        title = f"Prefix reuse on {_model_words(result)}"
        record(title, text, argv=[sys.argv[0], *(argv or sys.argv[1:])], load_before=load_before)
    if args.json:
        args.json.write_text(json.dumps({**result, "command": command}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
