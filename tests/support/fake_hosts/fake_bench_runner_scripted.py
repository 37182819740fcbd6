"""SCRIPTED FAKE automation runner (and `just`) for the wrapper's fault-injection tests.

Never a real preparation, run or report: it records its argv and the names of its environment
into ``calls.jsonl`` beside itself and writes the files each step would write (the prepared
input, ``production-cache-bench.json``, the tables, a run's report files), so the wrapper's
order, arguments and exit-code propagation can be checked in seconds. ``script.json`` beside it
injects faults: ``{"fail_call": N, "exit": CODE}`` makes the N-th call (1-based, counting every
call of every copy in the directory) exit CODE without writing, and ``{"no_production": true}``
makes runs exit 0 without ``production-cache-bench.json`` (``{"no_prepared": true}``:
preparations without ``cache-family-input.json``), and ``{"hang_call": N}`` makes the N-th call
print ``scripted fake: waiting`` on stdout and wait for a signal (SIGTERM's default action ends
it).
Tests copy it into a temporary directory as an executable named for the role it plays.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def _value(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def main() -> int:
    here = Path(__file__).resolve().parent
    role = Path(sys.argv[0]).name
    argv = sys.argv[1:]
    calls = here / "calls.jsonl"
    number = (len(calls.read_text().splitlines()) if calls.exists() else 0) + 1
    with calls.open("a") as log:
        record = {"role": role, "argv": argv, "env": sorted(os.environ), "pid": os.getpid()}
        log.write(json.dumps(record) + "\n")
    script_path = here / "script.json"
    script = json.loads(script_path.read_text()) if script_path.exists() else {}
    if script.get("fail_call") == number:
        print(f"scripted fake: call {number} fails with {script['exit']}", file=sys.stderr)
        return int(script["exit"])
    if script.get("hang_call") == number:
        print("scripted fake: waiting", flush=True)
        signal.pause()
    if role == "just":  # just --justfile J skippy-workload-oracles-build OUTPUT
        Path(argv[-1], "native", "bin").mkdir(parents=True, exist_ok=True)
        return 0
    if argv[0] == "report-run":  # report-run RUN_DIR: the run's report files
        run = Path(argv[1])
        (run / "plots").mkdir(parents=True, exist_ok=True)
        (run / "plots" / "row-0000-scripted.svg").write_text("<svg></svg>\n")
        (run / "report.md").write_text("# scripted report\n")
        (run / "report.html").write_text("<!DOCTYPE html><svg></svg>\n")
        print(f"Wrote {run / 'report.md'}")
        print(f"Wrote {run / 'report.html'}")
        return 0
    assert argv[0] == "automation", argv
    output = _value(argv, "--output")[0]
    if argv[1] == "cache-family-report":
        Path(output).write_text("scripted tables\n")
        print(f"Wrote {output}")
        return 0
    os.mkdir(output)  # prepare and run both need a fresh directory
    if argv[2] in ("prepare-full", "prepare-use-cases"):
        if script.get("no_prepared"):
            return 0
        Path(output, "cache-family-input.json").write_text(json.dumps({"mode": argv[2]}))
    elif not script.get("no_production"):
        Path(output, "production-cache-bench.json").write_text("[]\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
