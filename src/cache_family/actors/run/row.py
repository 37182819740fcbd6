"""The row actor: one planned row, its arms in order through ``ROW_TABLE``, then ``row.json``.

    correctness -> serial -> concurrent -> finalize

* A row whose model is missing is journaled and kept, never launched: no directory, no cells.
* Every present row runs its correctness arm first (``actors/run/correctness.py``, in
  ``cell-NNNN/correctness``). Only when it passed do the baselines run, each request with the
  prompt text it accepted; otherwise the row keeps the evidence, skips its baselines with the
  reason and is never ``completed``. A row without a usable correctness profile is refused the
  same way (there is no run without correctness: the prepared input always names the tool).
* ``native-serial`` and ``native-concurrent`` each run as one cell (one host session) in
  ``cell-NNNN/native-serial`` and ``cell-NNNN/sweep-native-concurrent``; an arm the plan did not
  schedule is journaled as skipped or unavailable with its reason.
* ``row.json`` is folded from the journal and published even when the row was cancelled or
  ran out of time (shielded and bounded), so nothing a row observed is ever lost.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Final

import trio

from cache_family.actors.journal.writer import publish_row_receipt
from cache_family.actors.run.cell import CellActor, CellPlan, pin_targets
from cache_family.actors.run.context import (
    ARM_CONCURRENT,
    ARM_DIRS,
    ARM_NEW,
    ARM_OLD,
    ARM_SERIAL,
    MEASUREMENT_RESERVE_SECONDS,
    PinTarget,
    RunContext,
    is_cancellation,
)
from cache_family.actors.run.correctness import ARM_CORRECTNESS, CorrectnessActor, CorrectnessPlan
from cache_family.actors.run.load import PromptCuts
from cache_family.actors.run.private_exec import RowExec
from cache_family.actors.run.prompts import PromptChoice, PromptSelector, accepted_prompt
from cache_family.schemas.journal import ArmPlan, RowOpened, RungPlan
from cache_family.schemas.prepared import HostProfile, PreparedInput, PreparedRow, SkipReason
from cache_family.schemas.receipts import RowReceipt
from cache_family.states.cell import ROW_TABLE, LiveMachine, RowEvent, RowMachine, RowState
from cache_family.states.correctness import STAGE_COMPLETED, CorrectnessSpec, StageVerdict
from cache_family.states.handoff import PACKAGE_LAYER_COUNT

ROW_FINALIZE_BOUND_SECONDS: Final = 30.0
CORRECTNESS_NOT_STARTED: Final = "correctness_not_started"

# How the plan's skip reasons read in a row's arm list.
_UNPLANNED: Final[dict[str, tuple[str, str]]] = {
    "layer-package-not-full-GGUF": (
        "unavailable",
        "package-only model: no full GGUF, so no monolithic baseline",
    ),
    "skipped-by-request": ("skipped", "skip_llama_server is set in the plan"),
    "missing-model": ("skipped", "missing-model"),
    "paired-servers-omitted": ("skipped", "paired-servers-omitted"),
}


@dataclass(frozen=True, slots=True)
class RowResult:
    """What the matrix receipt says about one row."""

    index: int
    status: str
    launched: bool
    evidence: str | None = None  # the row.json path, relative to the run dir
    reason: str | None = None
    receipt: RowReceipt | None = None


def row_dir_name(index: int) -> str:
    return f"cell-{index:04d}"


def _arm_plan(arm: str, planned: bool, skip_reason: SkipReason | None) -> ArmPlan:
    if planned:
        return ArmPlan(arm=arm)
    status, reason = _UNPLANNED.get(skip_reason or "", ("skipped", skip_reason or "not planned"))
    return ArmPlan(arm=arm, status=status, reason=reason)


def row_opened_record(
    *,
    row_index: int,
    row_key: str,
    case_key: str,
    prefix_tokens: int,
    use_case: str | None,
    row_dir: str,
    present: bool,
    arms: tuple[ArmPlan, ...],
    synthetic: bool,
) -> RowOpened:
    """``row_opened`` as every row journals it: its correctness arm not run yet (its own
    records replace this once it ran), or never, because the model is missing."""
    return RowOpened(
        row_index=row_index,
        row_key=row_key,
        case_key=case_key,
        prefix_tokens=prefix_tokens,
        use_case=use_case,
        row_dir=row_dir,
        model_status="present" if present else "missing-model",
        arms=arms,
        correctness_status="not-run",
        correctness_reason=CORRECTNESS_NOT_STARTED if present else "missing-model",
        synthetic=synthetic,
    )


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
            ROW_TABLE, f"row-{row.index}", ctx.step_journal("row", row_index=row.index)
        )
        self.dir = row_dir_name(row.index)
        self.cells: list[CellActor] = []
        self.correctness: CorrectnessActor | None = None
        # The correctness arm's accepted prompt: every later request of the row sends it.
        self.prompt: PromptChoice | None = None
        self.prompt_tokens: int | None = None
        # A corpus prompt is cut by the first arm's host and reused by the others.
        self.prompt_cuts = PromptCuts()
        self._stop_recorded = False
        # Set once the row is finalized, also when cancellation unwinds through ``run``.
        self.result: RowResult | None = None

    def __repr__(self) -> str:
        return (
            f"<RowActor {self.row.index} {self.row.output_relative} "
            f"state={self.machine.state.value} cells={len(self.cells)}>"
        )

    # -- plan --------------------------------------------------------------------------------

    def arm_plans(self) -> tuple[ArmPlan, ...]:
        tasks = self.row.tasks
        arms = [
            _arm_plan(ARM_SERIAL, tasks.serial_baseline.planned, tasks.serial_baseline.skip_reason),
            _arm_plan(
                ARM_CONCURRENT,
                tasks.concurrent_baseline.planned,
                tasks.concurrent_baseline.skip_reason,
            ),
        ]
        paired = tasks.paired_serving
        if paired.planned:
            # Planned only when both old and new servers are bound (the plan's rule).
            arms += [ArmPlan(arm=ARM_OLD), ArmPlan(arm=ARM_NEW)]
        return tuple(arms)

    def _stage_profile(self, arm: str) -> tuple[HostProfile | None, str | None]:
        """The case's old or new stage server profile and, if it disagrees with the plan, why."""
        profiles = self.prepared.profile(self.row.key)
        profile = None
        if profiles is not None:
            profile = profiles.old if arm == ARM_OLD else profiles.new
        if profile is None:
            return None, f"the prepared input has no {arm} host profile for this case"
        observed = self.row.model_observation.sha256
        if profile.model_sha256 != observed:
            return profile, f"{arm} profile pins model {profile.model_sha256}, the row {observed}"
        return profile, None

    def _native_profile(self) -> tuple[HostProfile | None, str | None]:
        """The case's native host profile and, if it disagrees with the plan, why."""
        profiles = self.prepared.profile(self.row.key)
        if profiles is None or profiles.native is None:
            return None, "the prepared input has no native host profile for this case"
        native = profiles.native
        observed = self.row.model_observation.sha256
        if native.model_sha256 != observed:
            return native, (
                f"native profile pins model {native.model_sha256}, the row observed {observed}"
            )
        server = self.prepared.tools.native_server
        if server is not None and native.binary_sha256 != server.sha256:
            return native, (
                f"native profile pins server {native.binary_sha256}, preparation pinned "
                f"{server.sha256}"
            )
        return native, None

    def cell_plan(self, arm: str) -> CellPlan:
        if arm in (ARM_OLD, ARM_NEW):
            return self._stage_cell_plan(arm)
        row = self.row
        plan = self.prepared.plan
        profile, refusal = self._native_profile()
        tasks = row.tasks
        if arm == ARM_SERIAL:
            serial = tasks.serial_baseline
            rungs: tuple[RungPlan, ...] = (RungPlan(concurrency=1, requests=serial.runs),)
            output_tokens = serial.output_tokens
            kind: str = "serial"
        else:
            concurrent = tasks.concurrent_baseline
            rungs = tuple(
                RungPlan(concurrency=r.concurrency, requests=r.requests) for r in concurrent.rungs
            )
            output_tokens = concurrent.output_tokens
            kind = "concurrent"
        return CellPlan(
            cell_id=f"{self.dir}/{arm}",
            cell_dir=f"{self.dir}/{ARM_DIRS[arm]}",
            row_index=row.index,
            row_key=row.output_relative,
            arm=arm,
            kind="serial" if kind == "serial" else "concurrent",
            rungs=rungs,
            output_tokens=output_tokens,
            lanes=tasks.concurrent_baseline.parallel,
            # llama-server splits --ctx-size across its --parallel slots (no unified KV when
            # the slot count is explicit), so every slot gets the row's context this way.
            ctx_size=row.ctx * tasks.concurrent_baseline.parallel,
            n_gpu_layers=row.n_gpu_layers,
            prefix_tokens=row.prefix_tokens,
            ttft_slo_ms=float(plan.ttft_slo_ms),
            tpot_slo_ms=float(plan.tpot_slo_ms),
            profile=profile,
            prompt=self.prompt if self.prompt is not None else self.prompts.choose(row),
            pins=pin_targets(profile) if profile is not None else (),
            refusal=refusal,
            synthetic=row.synthetic,
            architecture=row.model_observation.architecture,
            prompt_tokens=self.prompt_tokens,
        )

    def _stage_cell_plan(self, arm: str) -> CellPlan:
        """One retained stage server across the whole ordered ladder, OpenAI chat requests."""
        row, paired = self.row, self.row.tasks.paired_serving
        profile, refusal = self._stage_profile(arm)
        return CellPlan(
            cell_id=f"{self.dir}/{arm}",
            cell_dir=f"{self.dir}/{ARM_DIRS[arm]}",
            row_index=row.index,
            row_key=row.output_relative,
            arm=arm,
            kind="concurrent",
            rungs=tuple(
                RungPlan(concurrency=r.concurrency, requests=r.requests) for r in paired.rungs
            ),
            output_tokens=paired.output_tokens,
            lanes=paired.runtime_lanes,
            ctx_size=paired.shared_ctx_size,
            n_gpu_layers=row.n_gpu_layers,
            prefix_tokens=row.prefix_tokens,
            ttft_slo_ms=float(paired.ttft_slo_ms),
            tpot_slo_ms=float(paired.tpot_slo_ms),
            profile=profile,
            prompt=self.prompt if self.prompt is not None else self.prompts.choose(row),
            pins=pin_targets(profile) if profile is not None else (),
            refusal=refusal,
            synthetic=row.synthetic,
            prompt_tokens=self.prompt_tokens,
            host_kind="stage",
            model_id=profile.model_id if profile is not None else row.model_id,
            architecture=row.model_observation.architecture,
        )

    def correctness_plan(self) -> CorrectnessPlan:
        """The correctness arm of this row: the case's profile, the row's own sizes."""
        row, prepared = self.row, self.prepared
        profiles = prepared.profile(row.key)
        task = row.tasks.correctness
        refusal: str | None = None
        if profiles is None:
            refusal = "correctness_profile_missing: the prepared input has no profile for the case"
        profile = profiles.correctness if profiles is not None else None
        if profile is not None:
            if profile.case_key != row.key:
                refusal = f"correctness_profile_mismatch: profile is for {profile.case_key}"
            elif profile.model_sha256 != row.model_observation.sha256:
                refusal = "correctness_profile_mismatch: the profile pins another model"
            elif profile.correctness_sha256 != prepared.tools.correctness.sha256:
                refusal = "correctness_profile_mismatch: the profile pins another tool"
        prompt = self.prompts.choose(row).text if row.use_case is not None else None
        spec = CorrectnessSpec(
            tool=profile.correctness if profile else prepared.tools.correctness.path,
            model=profile.model if profile else "",
            model_id=row.model_id,
            stage_server=profile.stage_server if profile else prepared.tools.stage_server.path,
            layer_end=row.layer_end,
            ctx_size=row.ctx,
            n_gpu_layers=row.n_gpu_layers,
            activation_width=row.activation_width,
            load_mode=row.load_mode,
            payload=row.payload,
            prefix_tokens=row.prefix_tokens,
            repeats=row.cache_hit_repeats,
            lanes=profile.runtime_lane_count if profile else 1,
            borrow_resident_hits=profile.borrow_resident_hits if profile else False,
            cache_decoded_result_hits=profile.cache_decoded_result_hits if profile else False,
            prompt=prompt,
            topologies=tuple(task.topologies),
            # The synthetic zoo's package has its own layer count; a real one is DeepSeek3's.
            package_layer_count=row.layer_end if row.synthetic else PACKAGE_LAYER_COUNT,
        )
        pins: tuple[PinTarget, ...] = ()
        if profile is not None:
            pins = (
                PinTarget("correctness", profile.correctness, profile.correctness_sha256, "file"),
                PinTarget(
                    "stage_server", profile.stage_server, profile.stage_server_sha256, "file"
                ),
                # The pinned file: a layer package is pinned by its manifest.
                PinTarget(
                    "model",
                    row.model_observation.pinned_file or profile.model,
                    profile.model_sha256,
                    "file",
                ),
                *(
                    PinTarget(f"shard:{shard.name}", shard.logical_path, shard.sha256, "file")
                    for shard in (profile.artifact.shard_pins if profile.artifact else ())
                ),
                PinTarget(
                    "native_build", profile.native_build, profile.native_build_sha256, "tree"
                ),
                *(
                    PinTarget(f"toolkit:{name}", pin.path, pin.sha256, "tree")
                    for name, pin in sorted(profile.toolkit_directories.items())
                ),
            )
        return CorrectnessPlan(
            row_index=row.index,
            arm_dir=f"{self.dir}/{ARM_CORRECTNESS}",
            spec=spec,
            operator_env=dict(profile.settings) if profile else {},
            toolkits={n: p.path for n, p in profile.toolkit_directories.items()} if profile else {},
            native_build=profile.native_build if profile else prepared.native_build.path,
            pins=pins,
            refusal=refusal,
        )

    # -- machine -----------------------------------------------------------------------------

    async def _fire(self, event: RowEvent, *, sync: bool = True) -> None:
        """Fire ``event`` (the machine journals the step) and fsync it, unless ``sync`` is
        False: a step between the row's arms shares the fsync of what follows it with
        nothing outside the journal in between (the next cell's durable ``cell_opened``, or
        the row receipt's fold), as the cell's own steps into ``done`` do."""
        self.machine.fire(event)
        if sync:
            await self.ctx.writer.sync()

    async def _stopped(self) -> None:
        if self._stop_recorded:
            return
        self._stop_recorded = True
        # The run-wide cancellation or deadline record is already journaled by the supervisor.
        kind = self.ctx.stop.classify(self.ctx.stop.run_deadline, trio.current_time())
        event = RowEvent.CANCELLED if kind == "cancelled" else RowEvent.DEADLINE_EXPIRED
        if self.machine.can_fire(event):
            await self._fire(event)

    # -- run ---------------------------------------------------------------------------------

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
        )

    async def run(self) -> RowResult:
        if not self.row.model_observation.present:
            return await self._journal_missing_model()
        arms = self.arm_plans()
        os.makedirs(os.path.join(self.ctx.run_dir, self.dir), exist_ok=True)
        try:
            await self.ctx.journal(self._row_opened(arms, self.dir))
            await self._arms(arms)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                if is_cancellation(exc):
                    await self._stopped()
                self.result = await self._finalize()
            raise
        with trio.CancelScope(shield=True):
            result = await self._finalize()
        self.result = result
        return result

    async def journal_unreached(self) -> RowResult:
        """Journal a row the run never reached (cancelled or out of time): no dir, no cells."""
        if not self.row.model_observation.present:
            return await self._journal_missing_model()
        await self.ctx.journal(self._row_opened(self.arm_plans(), ""))
        self._stop_recorded = False
        await self._stopped()
        self.result = RowResult(
            index=self.row.index,
            status="not-launched",
            launched=False,
            reason="cancellation_or_deadline",
        )
        return self.result

    async def _journal_missing_model(self) -> RowResult:
        """A row whose model is missing is journaled and kept, never launched."""
        await self.ctx.journal(self._row_opened(self.arm_plans(), ""))
        await self._fire(RowEvent.MODEL_MISSING)
        self.result = RowResult(index=self.row.index, status="missing-model", launched=False)
        return self.result

    async def _arms(self, arms: tuple[ArmPlan, ...]) -> None:
        # One RowPins for the row's arms: each pinned file or tree is hashed in full when first
        # verified and at the last cell's post-verify, and identity-checked in between. One
        # RowExec: the private copies every host of the row runs from, made once.
        pins = self.ctx.hosts.row_pins()
        copies = RowExec(os.path.join(self.ctx.run_dir, self.dir))
        try:
            ctx = dataclasses.replace(self.ctx, row_pins=pins, row_exec=copies)
            await self._run_arms(arms, ctx)
        finally:
            # Every cell of the row has ended its host (a cell leaves only after cleanup).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(copies.close)
            if pins is not None:
                pins.close()

    def _exec_pairs(self, arms: tuple[ArmPlan, ...]) -> list[tuple[str, str | None]]:
        """(binary, native build) of each planned host arm that has a usable profile."""
        pairs: list[tuple[str, str | None]] = []
        for arm in arms:
            if arm.status != "planned":
                continue
            if arm.arm in (ARM_OLD, ARM_NEW):
                profile, refusal = self._stage_profile(arm.arm)
            else:
                profile, refusal = self._native_profile()
            if profile is not None and refusal is None:
                pairs.append((profile.binary, profile.native_build))
        return pairs

    async def _run_arms(self, arms: tuple[ArmPlan, ...], ctx: RunContext) -> None:
        await self._wait_if_out_of_time()
        if ctx.row_exec is not None:
            # Made now, the copies are settled (``RACY_SECONDS``) by the time the first cell
            # checks them, so each is hashed once per row and held by identity after that.
            await trio.to_thread.run_sync(ctx.row_exec.prepare, self._exec_pairs(arms))
        self.correctness = CorrectnessActor(self.correctness_plan(), ctx)
        verdict = await self.correctness.run()
        if not self._accept(verdict):
            # The table's skip-baselines step: the fold shows each planned arm as skipped.
            await self._fire(RowEvent.CORRECTNESS_NOT_PASSED, sync=False)
            return
        await self._fire(RowEvent.CORRECTNESS_PASSED, sync=False)
        planned = [a.arm for a in arms if a.status == "planned"]
        for arm in (ARM_SERIAL, ARM_CONCURRENT, ARM_OLD, ARM_NEW):
            if arm in (ARM_OLD, ARM_NEW) and not any(a.arm == arm for a in arms):
                continue
            plan = next(a for a in arms if a.arm == arm)
            if plan.status != "planned":
                await self._fire(RowEvent.ARM_SKIPPED, sync=False)
                continue
            await self._wait_if_out_of_time()
            last = arm == planned[-1]
            cell = CellActor(
                dataclasses.replace(self.cell_plan(arm), last_of_row=last), ctx, self.prompt_cuts
            )
            self.cells.append(cell)
            await cell.run()
            await self._fire(RowEvent.ARM_FINISHED, sync=False)
        await self._fire(RowEvent.ARMS_EXHAUSTED, sync=False)

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

    async def _finalize(self) -> RowResult:
        row = self.row
        relative = f"{self.dir}/row.json"
        if self.machine.state != RowState.FINALIZE:
            # Something outside the table stopped the row (a bug or a journal failure).
            return RowResult(
                index=row.index,
                status="incomplete",
                launched=bool(self.cells),
                reason=f"row stopped in state {self.machine.state.value}",
            )
        with trio.move_on_after(ROW_FINALIZE_BOUND_SECONDS):
            published = await publish_row_receipt(
                self.ctx.writer, self.ctx.run_dir, row.index, relative
            )
            receipt = published.receipt
            await self._fire(RowEvent.RECEIPT_PUBLISHED)
            # Its receipts are on disk: the journal index need not keep the row's lines. The
            # matrix does not need them either: it is folded from the journal file itself.
            self.ctx.writer.index.forget_row(row.index)
            return RowResult(
                index=row.index,
                status=receipt.status,
                launched=bool(self.cells),
                evidence=relative,
                reason=receipt.reason,
                receipt=receipt,
            )
        return RowResult(
            index=row.index,
            status="incomplete",
            launched=bool(self.cells),
            reason="row receipt not published within its time bound",
        )
