"""The row actor: one planned row run through ``ROW_TABLE`` by the one driver, then ``row.json``.

A row whose model is missing is journaled and kept, never launched. Host arms run only after the
correctness arm passed, each request with the prompt it accepted; otherwise the row keeps the
evidence and is never completed. ``row.json`` is published even when the row was cancelled or
ran out of time (shielded, bounded).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Final

import trio

from cache_family.actors.journal.writer import publish_row_receipt
from cache_family.actors.run.cell import CellActor
from cache_family.actors.run.context import RowPins, RunContext, is_cancellation
from cache_family.actors.run.correctness import CorrectnessActor
from cache_family.actors.run.engine import Handlers, drive
from cache_family.actors.run.load import PromptCuts
from cache_family.actors.run.private_exec import RowExec, copied_pins
from cache_family.actors.run.prompts import PromptSelector
from cache_family.schemas.arms import arm_named
from cache_family.schemas.journal import ArmPlan, PinObserved, RowOpened
from cache_family.schemas.prepared import PreparedInput, PreparedRow
from cache_family.schemas.receipts import RowReceipt
from cache_family.schemas.row_result import RowResult
from cache_family.states.budgets import MEASUREMENT_RESERVE_SECONDS
from cache_family.states.cell import (
    ROW_TABLE,
    LiveMachine,
    RowAction,
    RowEvent,
    RowMachine,
    RowState,
)
from cache_family.states.correctness import STAGE_COMPLETED, StageVerdict
from cache_family.states.plans import (
    PinTarget,
    PromptChoice,
    accepted_prompt,
    arm_plans,
    cell_plan,
    correctness_plan,
    declared_arm_plans,
    exec_pairs,
    host_profile,
    pin_targets,
    row_dir_name,
    row_opened_record,
    workload_arm_plans,
)
from cache_family.system.host_load import load_average

# The scope (under the row's directory) of the pins of the row's private copies, hashed beside
# the correctness arm; no cell opens it, so the journal files it with the row.
PRIVATE_COPIES_SCOPE: Final = "private-copies"
# Beyond ``RowPins.racy_seconds``: the copies' change times and the clock may disagree by a tick.
_SETTLE_MARGIN_SECONDS: Final = 0.05


def row_arm_plans(prepared: PreparedInput, row: PreparedRow) -> tuple[ArmPlan, ...]:
    """A row's host arms, then its workload arms (none without a workload file, so such a
    run journals exactly what it did before workloads existed), then a declared
    OpenAI-compatible server's (none without one)."""
    return (
        *arm_plans(row),
        *workload_arm_plans(prepared, row),
        *declared_arm_plans(prepared, row),
    )


@asynccontextmanager
async def run_private_copies(
    prepared: PreparedInput, rows: Sequence[PreparedRow], run_dir: str
) -> AsyncIterator[RowExec]:
    """The private copies the hosts of ``rows`` run from, made now, before the first row,
    so that a row finds them settled (``RACY_SECONDS``) and hashes each once beside its
    correctness arm; removed once every row has ended its hosts. A copy that cannot be made
    now is tried again, and its problem reported, by the first cell that needs it."""
    copies = RowExec(run_dir)
    pairs = [
        pair
        for row in rows
        if row.model_observation.present
        for pair in exec_pairs(prepared, row, row_arm_plans(prepared, row))
    ]
    try:
        await trio.to_thread.run_sync(copies.prepare, pairs)
        yield copies
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(copies.close)


class RowActor:
    """One row of the matrix. ``await RowActor(...).run()`` returns its matrix entry."""

    def __init__(
        self,
        row: PreparedRow,
        prepared: PreparedInput,
        ctx: RunContext,
        prompts: PromptSelector,
    ) -> None:
        self.row = row
        self.prepared = prepared
        self.ctx = ctx
        self.prompts = prompts
        self.machine: RowMachine = LiveMachine(
            ROW_TABLE, f"row-{row.index}", ctx.step_journal(ROW_TABLE.name, row_index=row.index)
        )
        self.dir = row_dir_name(row.index)
        self.cells: list[CellActor] = []
        self.correctness: CorrectnessActor | None = None
        # The correctness arm's accepted prompt: every later request of the row sends it.
        self.prompt: PromptChoice | None = None
        self.prompt_tokens: int | None = None
        # A corpus prompt is cut by the first arm's host and reused by the others.
        self.prompt_cuts = PromptCuts()
        # The row's context for its arms (with its ``RowPins`` and ``RowExec``).
        self._arms_ctx = ctx
        # The host arms not run yet, in run order; the event the last arm action left.
        self._pending: list[ArmPlan] = []
        self._last_planned: str | None = None
        self._arm_event: RowEvent | None = None
        # The row's directory exists (a row whose model is missing, or that the run never
        # reached, has none and publishes no receipt).
        self._on_disk = False
        self._receipt: RowReceipt | None = None
        self._publication_started = False
        # Set once the row is finalized, also when cancellation unwinds through ``run``.
        self.result: RowResult | None = None

    def __repr__(self) -> str:
        return (
            f"<RowActor {self.row.index} {self.row.output_relative} "
            f"state={self.machine.state.value} cells={len(self.cells)}>"
        )

    def arm_plans(self) -> tuple[ArmPlan, ...]:
        return row_arm_plans(self.prepared, self.row)

    def _row_opened(self, arms: tuple[ArmPlan, ...], row_dir: str) -> RowOpened:
        row = self.row
        return row_opened_record(
            row_index=row.index,
            row_key=row.output_relative,
            case_key=row.key,
            prefix_tokens=row.prefix_tokens,
            use_case=row.use_case,
            row_dir=row_dir,
            present=row.model_observation.present,
            arms=arms,
            synthetic=row.synthetic,
            load_average=load_average(),
        )

    # -- run ---------------------------------------------------------------------------------

    async def run(self) -> RowResult:
        arms = self.arm_plans()
        self._pending = list(arms)
        planned = [a.arm for a in arms if a.status == "planned"]
        self._last_planned = planned[-1] if planned else None
        try:
            if not self.row.model_observation.present:
                await self.ctx.journal(self._row_opened(arms, ""))
                await self._drive()
            else:
                os.makedirs(os.path.join(self.ctx.run_dir, self.dir), exist_ok=True)
                self._on_disk = True
                await self.ctx.journal(self._row_opened(arms, self.dir))
                async with self._row_context(arms) as ctx:
                    self._arms_ctx = ctx
                    await self._drive()
        finally:
            self.result = self._result()
        return self.result

    async def journal_unreached(self) -> RowResult:
        """Journal a row the run never reached (cancelled or out of time): no dir, no cells."""
        if not self.row.model_observation.present:
            return await self.run()
        await self.ctx.journal(self._row_opened(self.arm_plans(), ""))
        await self._drive(first=self._stop_event())
        self.result = RowResult(
            index=self.row.index,
            status="not-launched",
            launched=False,
            reason="cancellation_or_deadline",
        )
        return self.result

    async def _drive(self, first: RowEvent | None = None) -> None:
        try:
            await drive(
                self,
                self.machine,
                _HANDLERS,
                sync=self.ctx.writer.sync,
                interrupted=self._interrupted,
                first=first,
            )
        finally:
            if self._receipt is not None:
                # Its receipts are on disk: the journal index need not keep the row's lines.
                # The matrix does not need them either: it is folded from the journal file.
                self.ctx.writer.index.forget_row(self.row.index)

    @asynccontextmanager
    async def _row_context(self, arms: tuple[ArmPlan, ...]) -> AsyncIterator[RunContext]:
        """One RowPins for the row's arms: each pinned file or tree is hashed in full when
        first verified and at the last cell's post-verify, and identity-checked in between.
        The private copies every host of the row runs from: the run's, else the row's own."""
        pins = self.ctx.hosts.pins_of_row()
        owned = None
        if self.ctx.row_exec is None:
            owned = RowExec(os.path.join(self.ctx.run_dir, self.dir))
        copies = self.ctx.row_exec or owned
        try:
            yield dataclasses.replace(self.ctx, row_pins=pins, row_exec=copies)
        finally:
            # Every cell of the row has ended its host (a cell leaves only after cleanup).
            if owned is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(owned.close)
            if pins is not None:
                pins.close()

    def _stop_event(self) -> RowEvent:
        # The run-wide cancellation or deadline record is already journaled by the supervisor.
        kind = self.ctx.stop.classify(self.ctx.stop.run_deadline, trio.current_time())
        return RowEvent.CANCELLED if kind == "cancelled" else RowEvent.DEADLINE_EXPIRED

    async def _interrupted(self, exc: BaseException, stopping: bool) -> tuple[RowEvent, bool]:
        """Cancellation or the run deadline: the row's stop event (once); anything else
        propagates."""
        if not is_cancellation(exc) or stopping:
            raise exc
        event = self._stop_event()
        if not self.machine.can_fire(event):
            raise exc
        return event, True

    def _result(self) -> RowResult:
        row = self.row
        launched = bool(self.cells)
        if not row.model_observation.present:
            return RowResult(index=row.index, status="missing-model", launched=False)
        receipt = self._receipt
        if receipt is not None and self.machine.finished:
            return RowResult(
                index=row.index,
                status=receipt.status,
                launched=launched,
                evidence=f"{self.dir}/row.json",
                reason=receipt.reason,
                receipt=receipt,
            )
        if self._publication_started:
            reason = "row receipt not published within its time bound"
        else:
            # Something outside the table stopped the row (a bug or a journal failure).
            reason = f"row stopped in state {self.machine.state.value}"
        return RowResult(index=row.index, status="incomplete", launched=launched, reason=reason)

    # -- the states' work --------------------------------------------------------------------

    async def _check_correctness(self) -> RowEvent:
        """The row's correctness arm; only a passed one lets the host arms run."""
        if not self.row.model_observation.present:
            return RowEvent.MODEL_MISSING
        ctx = self._arms_ctx
        await self._wait_if_out_of_time()
        copies: tuple[PinTarget, ...] = ()
        if ctx.row_exec is not None:
            copies = await trio.to_thread.run_sync(self._make_copies, ctx.row_exec)
        prompt = self.prompts.choose(self.row).text if self.row.use_case is not None else None
        self.correctness = CorrectnessActor(correctness_plan(self.prepared, self.row, prompt), ctx)
        # The arm's own exception is carried past the nursery bare, not in an ExceptionGroup.
        failure: BaseException | None = None
        async with trio.open_nursery() as beside:
            settling = trio.CancelScope()
            if copies and ctx.row_pins is not None:
                beside.start_soon(self._hash_copies_once_settled, copies, ctx.row_pins, settling)
            try:
                verdict = await self.correctness.run()
            except BaseException as exc:
                failure = exc
                beside.cancel_scope.cancel()
            # Copies not settled yet are left to the first cell; a hash under way finishes.
            settling.cancel()
        if failure is not None:
            raise failure
        if self._accept(verdict):
            return RowEvent.CORRECTNESS_PASSED
        return RowEvent.CORRECTNESS_NOT_PASSED

    def _make_copies(self, row_exec: RowExec) -> tuple[PinTarget, ...]:
        """Make the private copies the row's hosts run from, now, and return the pins of
        those copies that the host cells check before launch (a copy that cannot be made is
        tried again, and its problem reported, by its first cell)."""
        made = row_exec.prepare(exec_pairs(self.prepared, self.row, self._pending))
        targets: dict[tuple[str, str], PinTarget] = {}
        for plan in self._pending:
            if plan.status != "planned":
                continue
            profile, refusal = host_profile(self.prepared, self.row, arm_named(plan.arm))
            copy = made.get((profile.binary, profile.native_build)) if profile else None
            if profile is None or refusal is not None or copy is None:
                continue
            for target in copied_pins(pin_targets(profile), copy):
                if target.name in ("binary", "native_build"):
                    targets.setdefault((target.path, target.expected_sha256), target)
        return tuple(targets.values())

    async def _hash_copies_once_settled(
        self, copies: tuple[PinTarget, ...], pins: RowPins, settling: trio.CancelScope
    ) -> None:
        """Hash the row's fresh private copies beside the correctness arm, once they are old
        enough to be held by identity (``RowPins.racy_seconds``): the row's first host cell
        then checks them by identity, as its later cells do, instead of hashing them on its
        own time. Journaled under the row's ``private-copies`` scope (no cell's: a copy that
        differs is hashed again, and reported, by the first cell that runs it)."""
        with settling:
            settled_ns = self._arms_ctx.row_exec.newest_copy_ns if self._arms_ctx.row_exec else 0
            wait = (settled_ns - time.time_ns()) / 1e9 + pins.racy_seconds
            await trio.sleep(max(wait, 0.0) + _SETTLE_MARGIN_SECONDS)
        if settling.cancelled_caught:
            return
        seconds = self.ctx.stop.run_deadline - MEASUREMENT_RESERVE_SECONDS - trio.current_time()
        results = await pins.verify(copies, max(0.0, seconds))
        scope = f"{self.dir}/{PRIVATE_COPIES_SCOPE}"
        for result in results:
            await self.ctx.journal(
                PinObserved(
                    cell_id=scope,
                    phase="row",
                    name=result.target.name,
                    path=result.target.path,
                    expected_sha256=result.target.expected_sha256,
                    observed_sha256=result.observed_sha256,
                    verified_by=result.verified_by,
                )
            )

    async def _arm_ended(self) -> RowEvent:
        """What the last arm action did: ran a cell, skipped an unplanned arm, or found none."""
        event, self._arm_event = self._arm_event, None
        return event or RowEvent.ARMS_EXHAUSTED

    async def _finalized(self) -> RowEvent | None:
        """Published: the machine may finish. A row with nothing to publish rests here."""
        return RowEvent.RECEIPT_PUBLISHED if self._receipt is not None else None

    # -- the actions' effects ----------------------------------------------------------------

    async def _skip_baselines(self) -> None:
        """Nothing to run: the row's fold shows each planned arm as skipped, with the
        correctness arm's reason."""

    async def _run_serial_cell(self) -> None:
        await self._run_next_arm()

    async def _run_next_cell(self) -> None:
        await self._run_next_arm()

    async def _run_next_arm(self) -> None:
        if not self._pending:
            self._arm_event = None  # the work reports the arms exhausted
            return
        plan = self._pending.pop(0)
        if plan.status != "planned":
            self._arm_event = RowEvent.ARM_SKIPPED
            return
        await self._wait_if_out_of_time()
        choice = self.prompt if self.prompt is not None else self.prompts.choose(self.row)
        planned = cell_plan(
            self.prepared, self.row, arm_named(plan.arm), choice, self.prompt_tokens
        )
        last = plan.arm == self._last_planned
        cell = CellActor(
            dataclasses.replace(planned, last_of_row=last), self._arms_ctx, self.prompt_cuts
        )
        self.cells.append(cell)
        await cell.run()
        self._arm_event = RowEvent.ARM_FINISHED

    async def _publish_row(self) -> None:
        """Fold ``row.json`` from the journal and publish it (a row never opened on disk, one
        never reached, has no receipt: the matrix folds it from ``row_opened``)."""
        if not self._on_disk:
            return
        self._publication_started = True
        published = await publish_row_receipt(
            self.ctx.writer, self.ctx.run_dir, self.row.index, f"{self.dir}/row.json"
        )
        self._receipt = published.receipt

    # -- helpers -----------------------------------------------------------------------------

    def _accept(self, verdict: StageVerdict) -> bool:
        if verdict.status != STAGE_COMPLETED or not verdict.prompt_text:
            return False
        self.prompt = accepted_prompt(verdict.prompt_text, self.row.tasks.correctness.topologies[0])
        self.prompt_tokens = verdict.prompt_token_count
        return True

    async def _wait_if_out_of_time(self) -> None:
        """A cell that could not do any work before the run's deadline is never launched:
        wait for the supervisor's deadline watcher to stop the run instead."""
        deadline = self.ctx.stop.run_deadline
        if trio.current_time() >= deadline - MEASUREMENT_RESERVE_SECONDS:
            await trio.sleep_until(deadline + MEASUREMENT_RESERVE_SECONDS)


# Each state's work: what it does before the machine takes its way out.
_WORK: Final[Mapping[RowState, Callable[[RowActor], Awaitable[RowEvent | None]]]] = {
    RowState.CORRECTNESS: RowActor._check_correctness,
    RowState.SERIAL: RowActor._arm_ended,
    RowState.CONCURRENT: RowActor._arm_ended,
    RowState.FINALIZE: RowActor._finalized,
}

# The one effect handler of each action of the table.
_EFFECTS: Final[Mapping[RowAction, Callable[[RowActor], Awaitable[None]]]] = {
    RowAction.SKIP_BASELINES: RowActor._skip_baselines,
    RowAction.RUN_SERIAL_CELL: RowActor._run_serial_cell,
    RowAction.RUN_NEXT_CELL: RowActor._run_next_cell,
    RowAction.PUBLISH_ROW: RowActor._publish_row,
}

# Checked here, at import: every state has its work, every action its one handler.
_HANDLERS: Final = Handlers("row actor", ROW_TABLE, _WORK, _EFFECTS)
