"""The correctness arm of one row, driven by ``CORRECTNESS_TABLE``.

The accepted prompt text is kept in memory for the row's later requests; only its SHA-256 is
journaled.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

import trio

from cache_family.actors.run import custody
from cache_family.actors.run.cell import watch_pins
from cache_family.actors.run.context import RunContext, is_cancellation
from cache_family.actors.run.engine import Handlers, drive
from cache_family.errors import Refused
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.journal import (
    ChildSpawned,
    CorrectnessTopologyRan,
    CorrectnessVerdict,
    PinDrift,
    PinObserved,
)
from cache_family.states.budgets import MEASUREMENT_RESERVE_SECONDS
from cache_family.states.cell import (
    CORRECTNESS_TABLE,
    CorrectnessAction,
    CorrectnessEvent,
    CorrectnessMachine,
    CorrectnessState,
    LiveMachine,
)
from cache_family.states.correctness import (
    FAILED_PROCESS,
    REPORT_NAME,
    STAGE_FAILED,
    STAGE_NOT_RUN,
    StageVerdict,
    TopologyVerdict,
    correctness_argv,
    expectation,
    judge_stage,
    judge_topology,
    redacted_argv,
)
from cache_family.states.plans import CorrectnessPlan, argv_sha256
from cache_family.system.child import ChildCommand, ChildEnded
from cache_family.system.pin_watch import PinWatch
from cache_family.system.process_group import PROCESS_TAG_NAME
from cache_family.system.publish import publish_fresh

REPORT_MAX_BYTES: Final = 16 * MIB


def free_loopback_port() -> int:
    """A fresh ephemeral port for the tool's source/restore bind addresses."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CorrectnessActor:
    """One row's correctness arm. ``await CorrectnessActor(plan, ctx).run()`` returns the
    stage verdict (its prompt text is the row's benchmark prompt when it passed)."""

    def __init__(self, plan: CorrectnessPlan, ctx: RunContext) -> None:
        self.plan = plan
        self.ctx = ctx
        self.machine: CorrectnessMachine = LiveMachine(
            CORRECTNESS_TABLE,
            plan.subject,
            ctx.step_journal(CORRECTNESS_TABLE.name, row_index=plan.row_index),
        )
        self.deadline = math.inf
        self.next_topology = 0
        self.ran: list[tuple[str, TopologyVerdict]] = []
        self.verdict = StageVerdict(STAGE_NOT_RUN, "correctness_never_started")
        self.arm_path = os.path.join(ctx.run_dir, plan.arm_dir)
        # The arm's pins, watched from before their hash to the gate.
        self._watch: PinWatch | None = None

    def __repr__(self) -> str:
        return (
            f"<CorrectnessActor {self.plan.subject} state={self.machine.state.value} "
            f"topology={self.next_topology}/{len(self.plan.spec.topologies)}>"
        )

    async def run(self) -> StageVerdict:
        try:
            return await self._run()
        finally:
            if self._watch is not None:
                self._watch.close()

    async def _run(self) -> StageVerdict:
        self.deadline = self.ctx.budgets.cell_deadline(trio.current_time())
        await drive(
            self,
            self.machine,
            _HANDLERS,
            sync=self.ctx.writer.sync,
            interrupted=self._interrupted,
        )
        return self.verdict

    async def _interrupted(
        self, exc: BaseException, stopping: bool
    ) -> tuple[CorrectnessEvent, bool]:
        """Cancellation or the deadline: the arm's stop event (once); anything else
        propagates (the tool's own failures are verdicts, never exceptions)."""
        if not is_cancellation(exc) or stopping:
            raise exc
        event = self._stop_event()
        if not self.machine.can_fire(event):
            raise exc
        return event, True

    def _stop_event(self) -> CorrectnessEvent:
        kind = self.ctx.stop.classify(self.ctx.stop.run_deadline, trio.current_time())
        self.verdict = StageVerdict(STAGE_FAILED, "cancellation_or_deadline")
        if kind == "cancelled":
            return CorrectnessEvent.CANCELLED
        return CorrectnessEvent.DEADLINE_EXPIRED

    # -- the states' work ------------------------------------------------------------------

    async def _admit(self) -> CorrectnessEvent:
        plan = self.plan
        if plan.refusal is not None:
            self.verdict = StageVerdict(STAGE_NOT_RUN, plan.refusal)
            return CorrectnessEvent.NOT_RUNNABLE
        os.makedirs(self.arm_path, exist_ok=True)
        self._watch = await trio.to_thread.run_sync(watch_pins, plan.pins)
        remaining = self.deadline - MEASUREMENT_RESERVE_SECONDS - trio.current_time()
        results = await self.ctx.verify_pins(plan.pins, remaining)
        drifted = []
        for result in results:
            observed = PinObserved(
                cell_id=plan.arm_dir,
                phase="before",
                name=result.target.name,
                path=result.target.path,
                expected_sha256=result.target.expected_sha256,
                observed_sha256=result.observed_sha256,
                verified_by=result.verified_by,
            )
            await self.ctx.journal(observed)
            if not result.matches:
                drifted.append(result.target.name)
                await self.ctx.journal(
                    PinDrift(
                        cell_id=plan.arm_dir,
                        phase="before",
                        name=observed.name,
                        path=observed.path,
                        expected_sha256=observed.expected_sha256,
                        observed_sha256=observed.observed_sha256,
                        verified_by=observed.verified_by,
                    )
                )
        if drifted:
            self.verdict = StageVerdict(
                STAGE_NOT_RUN, f"pin_mismatch: {', '.join(drifted)} differ from preparation"
            )
            return CorrectnessEvent.NOT_RUNNABLE
        return CorrectnessEvent.ADMITTED

    async def _topology(self) -> CorrectnessEvent:
        if self.next_topology < len(self.plan.spec.topologies):
            return CorrectnessEvent.TOPOLOGY_ENDED
        return CorrectnessEvent.TOPOLOGIES_EXHAUSTED

    async def _gate(self) -> CorrectnessEvent:
        self.verdict = judge_stage(self.plan.spec.topologies, self.ran)
        changed = self._watch.changes() if self._watch is not None else []
        if changed:
            self.verdict = StageVerdict(
                STAGE_FAILED,
                f"pin_drift: {', '.join(changed)} changed while the correctness tool ran",
            )
        if self.verdict.status == "completed":
            return CorrectnessEvent.ACCEPTED
        return CorrectnessEvent.REJECTED

    async def _finalize(self) -> CorrectnessEvent:
        return CorrectnessEvent.VERDICT_JOURNALED

    # -- the actions' effects --------------------------------------------------------------

    async def _run_topology(self) -> None:
        plan, spec = self.plan, self.plan.spec
        index = self.next_topology
        self.next_topology += 1
        topology = spec.topologies[index]
        relative = f"{plan.arm_dir}/topology-{index:02d}"
        evidence = os.path.join(self.ctx.run_dir, relative)
        os.makedirs(evidence, exist_ok=False)
        report_path = os.path.join(evidence, REPORT_NAME)
        argv = correctness_argv(
            spec, topology, report_path, free_loopback_port(), free_loopback_port()
        )
        work_deadline = self.deadline - MEASUREMENT_RESERVE_SECONDS
        ended: ChildEnded | None = None
        problem: str | None = None
        state_dir = ""
        try:
            if trio.current_time() >= work_deadline:
                problem = "the correctness budget was spent before this topology"
            else:
                state_dir = custody.make_private_dir(evidence, "tool")
                tag = self.ctx.cell_process_tag(plan.arm_dir)
                env = custody.host_environment(
                    plan.operator_env, plan.toolkits, plan.native_build, state_dir
                )
                # Journaled with the rest; the child runner ends whatever still carries it.
                env[PROCESS_TAG_NAME] = tag
                command = ChildCommand(
                    argv=tuple(argv),
                    env=env,
                    cwd=state_dir,
                    stdout_path=os.path.join(evidence, "child.stdout.log"),
                    stderr_path=os.path.join(evidence, "child.stderr.log"),
                    deadline=work_deadline,
                    process_tag=tag,
                )

                async def spawned(pid: int, create_time: float) -> None:
                    await self.ctx.journal(
                        ChildSpawned(
                            cell_id=plan.arm_dir,
                            role="correctness",
                            pid=pid,
                            create_time=create_time,
                            pgid=pid,
                            argv_sha256=argv_sha256(argv),
                            executable=argv[0],
                            host_argv=tuple(redacted_argv(argv)),
                            host_env_names=tuple(sorted(env)),
                            effective_environment=custody.recorded_environment(env),
                        )
                    )

                ended = await self.ctx.hosts.child_runner(command, spawned)
                problem = _process_problem(ended)
        except (Refused, OSError) as exc:
            problem = f"the tool could not be started: {exc}"
        except BaseException:
            with trio.CancelScope(shield=True):
                custody.remove_tree(state_dir)
                verdict = TopologyVerdict(status=FAILED_PROCESS, reason="cancelled while it ran")
                await self._ended(index, topology, relative, argv, ended, verdict)
            raise
        removed, error = custody.remove_tree(state_dir)
        if not removed:
            problem = problem or f"the tool's private state dir was not removed: {error}"
        report = None if problem is not None else _read_report(report_path)
        verdict = judge_topology(problem, report, expectation(spec, topology))
        await self._ended(index, topology, relative, argv, ended, verdict)

    async def _ended(
        self,
        index: int,
        topology: str,
        relative: str,
        argv: Sequence[str],
        ended: ChildEnded | None,
        verdict: TopologyVerdict,
    ) -> None:
        self.ran.append((topology, verdict))
        await self._record(index, topology, relative, argv, ended, verdict.reason)
        await self.ctx.journal(
            _topology_record(self.plan.row_index, index, topology, relative, verdict, ended, argv)
        )

    async def _record(
        self,
        index: int,
        topology: str,
        relative: str,
        argv: Sequence[str],
        ended: ChildEnded | None,
        problem: str | None,
    ) -> None:
        """The process record of one topology, next to its report and logs."""
        record = {
            "schema_version": 1,
            "topology": topology,
            "topology_index": index,
            "argv": redacted_argv(argv),
            "pid": ended.pid if ended else None,
            "create_time": ended.create_time if ended else None,
            "exit_code": ended.exit_code if ended else None,
            "timed_out": ended.timed_out if ended else None,
            "forced": ended.forced if ended else None,
            "elapsed_seconds": ended.elapsed_seconds if ended else None,
            "spawn_error": ended.spawn_error if ended else None,
            "problem": problem,
        }
        path = os.path.join(self.ctx.run_dir, relative, "process.json")
        data = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
        # The journal holds the same facts; a missing file is not a lost observation.
        with contextlib.suppress(OSError, Refused):
            await trio.to_thread.run_sync(publish_fresh, path, data)

    async def _journal_verdict(self) -> None:
        verdict = self.verdict
        await self.ctx.journal(
            CorrectnessVerdict(
                row_index=self.plan.row_index,
                status=verdict.status,
                reason=verdict.reason,
                planned_topologies=self.plan.spec.topologies,
                prompt_sha256=verdict.prompt_sha256,
                suffix_prefill_matches=verdict.suffix_prefill_matches,
            )
        )


def _process_problem(ended: ChildEnded) -> str | None:
    if ended.spawn_error is not None:
        return ended.spawn_error
    if ended.timed_out:
        return "the tool ran past the correctness budget and was stopped"
    if ended.forced:
        return f"the tool's group had to be killed (exit {ended.exit_code})"
    if ended.tagged_escapees or ended.surviving_descendants:
        left = sorted({*ended.tagged_escapees, *ended.surviving_descendants})
        return f"the tool left processes outside its group (found by its environment tag): {left}"
    if ended.exit_code != 0:
        return f"the tool exited {ended.exit_code}"
    return None


def _read_report(path: str) -> bytes | None:
    try:
        return read_bounded(path, REPORT_MAX_BYTES, json_path=f"$.{REPORT_NAME}").data
    except (OSError, Refused):
        return None


def _topology_record(
    row_index: int,
    index: int,
    topology: str,
    relative: str,
    verdict: TopologyVerdict,
    ended: ChildEnded | None,
    argv: Sequence[str],
) -> CorrectnessTopologyRan:
    return CorrectnessTopologyRan(
        row_index=row_index,
        topology_index=index,
        topology=topology,
        status=verdict.status,
        reason=verdict.reason,
        refusal_codes=verdict.refusal_codes,
        evidence_dir=relative,
        argv_sha256=argv_sha256(argv),
        pid=ended.pid if ended else None,
        exit_code=ended.exit_code if ended else None,
        forced=ended.forced if ended else False,
        elapsed_ms=ended.elapsed_seconds * 1000 if ended else None,
        prompt_sha256=verdict.prompt_sha256,
        benchmark_prompt_token_count=verdict.benchmark_prompt_token_count,
        suffix_prefill_matches=verdict.suffix_prefill_matches,
        cache_storage_bytes=verdict.cache_storage_bytes,
        cache_hit_import_ms=verdict.cache_hit_import_ms,
        cache_hit_decode_ms=verdict.cache_hit_decode_ms,
        cache_hit_total_ms=verdict.cache_hit_total_ms,
        recompute_total_ms=verdict.recompute_total_ms,
    )


# Each state's work: what it does before the machine takes its way out.
_WORK: Final[
    Mapping[CorrectnessState, Callable[[CorrectnessActor], Awaitable[CorrectnessEvent]]]
] = {
    CorrectnessState.ADMIT: CorrectnessActor._admit,
    CorrectnessState.TOPOLOGY: CorrectnessActor._topology,
    CorrectnessState.GATE: CorrectnessActor._gate,
    CorrectnessState.FINALIZE: CorrectnessActor._finalize,
}

# The one effect handler of each action of the table.
_EFFECTS: Final[Mapping[CorrectnessAction, Callable[[CorrectnessActor], Awaitable[None]]]] = {
    CorrectnessAction.RUN_TOPOLOGY: CorrectnessActor._run_topology,
    CorrectnessAction.JOURNAL_VERDICT: CorrectnessActor._journal_verdict,
}


# Checked here, at import: every state has its work, every action its one handler.
_HANDLERS: Final = Handlers("correctness actor", CORRECTNESS_TABLE, _WORK, _EFFECTS)
