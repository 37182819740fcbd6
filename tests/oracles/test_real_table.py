"""The README's real-model table, from a prefix-sweep run's receipts."""

from __future__ import annotations

import json
from pathlib import Path

from cache_family.oracles.real_table import render_real_table, spread

EVIDENCE = "real model org/m:Q4 on CPU (2 CPUs), 1 thread, 1-min load average 1.0 at run start"


def _request(request_id: int, excluded: bool, prompt_ms: float, cache_n: int) -> str:
    row = {
        "request_id": request_id,
        "status": "completed",
        "excluded_warmup": excluded,
        "timings": {"prompt_ms": prompt_ms, "cache_n": cache_n},
    }
    return json.dumps({"rung_index": 0, "concurrency": 1, "row": row})


def _sweep_row(run: Path, cell: str, prefix: int) -> dict[str, object]:
    (run / cell / "native-serial").mkdir(parents=True)
    (run / cell / "native-serial" / "requests.jsonl").write_text(
        "\n".join(
            [
                _request(0, True, 900.0, 0),
                _request(1, False, 30.0, prefix - 4),
                _request(2, False, 50.0, prefix - 4),
                _request(3, False, 40.0, prefix - 4),
            ]
        )
        + "\n"
    )
    (run / cell / "correctness" / "t0").mkdir(parents=True)
    (run / cell / "correctness" / "t0" / "state-handoff.json").write_text(
        json.dumps(
            {
                "recompute_ms": [800.0, 700.0, 900.0],
                "cache_hit_import_ms": [0.5, 0.5, 0.5],
                "cache_hit_decode_ms": [9.5, 19.5, 29.5],
            }
        )
    )
    row = {
        "evidence_class": EVIDENCE,
        "correctness": {
            "topologies": [{"status": "pass", "evidence_dir": f"{cell}/correctness/t0"}]
        },
        "observations": [
            {"arm": "native-serial", "cell_dir": f"{cell}/native-serial", "rungs": []},
            {"arm": "native-concurrent", "rungs": [
                {"rung_summary": {"concurrency": 1, "throughput_requests_per_sec": 0.5}},
                {"rung_summary": {"concurrency": 2, "throughput_requests_per_sec": 0.75}},
            ]},
        ],
    }  # fmt: skip
    (run / cell / "row.json").write_text(json.dumps(row))
    return {
        "prefix_tokens": prefix,
        "result": {"status": "completed", "evidence": f"{cell}/row.json"},
    }


def test_cold_against_hit_per_prefix_with_their_spread(tmp_path: Path) -> None:
    rows = [_sweep_row(tmp_path, "cell-0000", 256), _sweep_row(tmp_path, "cell-0001", 1024)]
    (tmp_path / "cache-family-matrix.json").write_text(json.dumps({"rows": rows}))
    table = render_real_table(tmp_path).splitlines()
    assert table[2] == (
        "| 256 | completed | 900.0 (n=1) | 40.0 (30.0-50.0, n=3) | 252 "
        "| 800.0 (700.0-900.0, n=3) | 20.0 (10.0-30.0, n=3) | c1 0.50, c2 0.75 |"
    )
    assert table[3].startswith("| 1024 | completed | 900.0 (n=1) | 40.0 (30.0-50.0, n=3) | 1020 |")
    assert table[-1] == f"Evidence: {EVIDENCE}."  # the same text once


def test_spread_of_nothing_is_not_a_number() -> None:
    assert spread([]) == "n/a"
    assert spread([2.0]) == "2.0 (n=1)"
