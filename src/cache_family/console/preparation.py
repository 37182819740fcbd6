"""What preparation shows the operator: the worker's phases and hashing bar, the refusals, the
``Wrote`` line and the closing lines of a preparation that did not publish; the exit code.

The work is ``actors/prepare/parent.py`` (the parent) and ``actors/prepare/worker.py`` (the
hidden ``prepare-worker``); they return what happened and print nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import trio

from cache_family.actors.prepare.parent import prepare
from cache_family.actors.prepare.supervisor import GRACE_SECONDS
from cache_family.actors.prepare.worker import observe_request
from cache_family.console.progress import BytesBar, is_terminal
from cache_family.console.refusals import print_refusals, say_failed
from cache_family.exit_codes import ExitCode
from cache_family.system.pins import Budget


class WorkerEvents:
    """Renders the worker's JSON-lines events: phase lines always, a bar on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.bar = BytesBar(stream, "hashing") if is_terminal(stream) else None
        self.phases: list[str] = []

    def handle(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        kind = event.get("event")
        if kind == "phase" and isinstance(event.get("text"), str):
            self.phases.append(event["text"])
            if self.bar is not None:
                self.bar.end()
            print(f"preparation: {event['text']}", file=self.stream, flush=True)
        elif kind == "progress" and self.bar is not None:
            done, total = event.get("done"), event.get("total")
            if isinstance(done, int) and isinstance(total, int):
                self.bar.set_completed(done, total, f"hashing {event.get('files', '?')} file(s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.end()


def run_prepare(
    command: str,
    input_path: str,
    output: str,
    overrides: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    grace_seconds: float = GRACE_SECONDS,
    budget_seconds: float | None = None,
    after_publish: Callable[[Budget], None] | None = None,
) -> int:
    """The parent command with its lines on ``stdout``/``stderr``; the exit code.
    ``budget_seconds`` and ``after_publish`` are the parent's test-only hooks."""
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    events = WorkerEvents(err)

    def started(pid: int) -> None:
        print(f"preparation: worker pid {pid} started", file=err, flush=True)

    try:
        report = prepare(
            command,
            input_path,
            output,
            overrides,
            environ=environ,
            events=events,
            on_start=lambda pid: print(
                f"preparation: worker pid {pid} started", file=err, flush=True
            ),
            grace_seconds=grace_seconds,
            budget_seconds=budget_seconds,
            after_publish=after_publish,
        )
    finally:
        events.close()
    if report.refusals:
        print_refusals(report.refusals, err)
        if report.revoked:
            print(f"preparation: revoked {report.revoked_path}", file=err)
        return report.exit_code
    assert report.published is not None
    print(f"Wrote {report.published.path}", file=out, flush=True)
    return ExitCode.OK


def prepare_command(command: str, input: str, output: str, overrides: list[str]) -> int:
    """``cache-family prepare-full|prepare-use-cases --input ABS --output ABS [overrides]``."""
    code = run_prepare(command, input, output, overrides)
    say_prepare_failed(sys.stderr, command, input, output, code)
    return code


def say_prepare_failed(stream: TextIO, command: str, input: str, output: str, code: int) -> None:
    """The closing lines of a preparation that did not publish: what, evidence, next."""
    again = f"then run `cache-family {command}` again into a fresh --output"
    if code == ExitCode.REFUSED:
        say_failed(
            stream,
            command,
            "refused before any work (the refusals above)",
            f"{input}; nothing was written under {output}",
            f"fix what each refusal names (`cache-family validate --input {input}` lists the "
            f"operator input's), {again}",
        )
    elif code == ExitCode.REFUSED_DURING_WORK:
        say_failed(
            stream,
            command,
            "refused while observing (the refusals above)",
            f"{output}: request.json, observations.json (complete: false) and the worker logs",
            f"fix what each refusal names, {again}",
        )
    elif code == ExitCode.INTERRUPTED:
        say_failed(
            stream,
            command,
            "interrupted by a signal",
            f"{output} (whatever was observed; no prepared input was left)",
            f"when ready, {again}",
        )


def worker_command(input: str, output: str) -> int:
    """Hidden ``cache-family prepare-worker --input REQUEST --output OBSERVATIONS``: its
    refusals on stderr (the parent keeps them in its log); the exit code."""
    result = trio.run(observe_request, input, output)
    if result.refusals:
        print_refusals(result.refusals, sys.stderr)
    return result.exit_code
