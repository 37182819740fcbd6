#!/usr/bin/python3
"""FAKE ``skippy-correctness state-handoff`` for run tests with FAKE hosts (never measures).

It reads the reference command line and writes a ``state-handoff.json`` that echoes it and
passes the gate (status pass, K and K + 1 tokens, R samples whose mean is the total), with a
fixed prompt (or ``--prompt``). Tests whose hosts are fakes use it: as a real child process
where the run is a real process (``test_run_signals``), in process through
``fake_child_runner`` where the run is on trio's autojump clock (``test_run_budgets``).

``edit`` (in process) or ``<this file>.edit.json`` (as a child) changes report members, to
provoke what a real tool cannot be made to write (a wrong model id, a foreign range, ...).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

FAKE_PROMPT = "fake correctness prompt: the same words every time, for every topology"


def _flags(argv: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") and "=" in word:
            name, value = word[2:].split("=", 1)
            out[name] = value
        elif word.startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[word[2:]] = words[i + 1]
            i += 1
        elif word.startswith("--"):
            out[word[2:]] = "true"
        i += 1
    return out


def report_for(argv: Sequence[str], edit: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The passing report for ``argv`` (``state-handoff`` and its flags), then ``edit``."""
    flags = _flags(argv)
    k = int(flags["prefix-token-count"])
    repeats = int(flags["cache-hit-repeats"])
    imports = [0.25] * repeats
    decodes = [0.5] * repeats
    report: dict[str, Any] = {
        "mode": "state-handoff",
        "status": "pass",
        "matches": True,
        "predicted_token_matches": True,
        "cache_hit_matches": True,
        "suffix_prefill_matches": True,
        "model_identity": {"model_id": flags["model-id"]},
        "state_payload_kind": flags["state-payload-kind"],
        "stage_index": int(flags["state-stage-index"]),
        "layer_start": int(flags["state-layer-start"]),
        "layer_end": int(flags["state-layer-end"]),
        "requested_prefix_token_count": k,
        "benchmark_prompt_token_count": k + 1,
        "benchmark_prompt_text": flags.get("prompt", FAKE_PROMPT),
        "activation_width": int(flags["activation-width"]),
        "cache_hit_repeats": repeats,
        "cache_hit_import_ms": imports,
        "cache_hit_decode_ms": decodes,
        "cache_hit_total_ms": 0.75,
        "recompute_total_ms": 2.0,
        "cache_storage_bytes": 4096,
        "evidence": "FAKE correctness tool",
    }
    report.update(edit or {})
    return report


def write_report(argv: Sequence[str], edit: Mapping[str, Any] | None = None) -> int:
    flags = _flags(argv)
    with open(flags["report-out"], "x") as out:
        json.dump(report_for(argv, edit), out)
    return 0


def main() -> int:
    edit_path = os.path.abspath(__file__) + ".edit.json"
    edit = None
    if os.path.exists(edit_path):
        with open(edit_path) as f:
            edit = json.load(f)
    return write_report(sys.argv[1:], edit)


if __name__ == "__main__":
    raise SystemExit(main())
