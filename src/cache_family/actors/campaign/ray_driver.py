"""``cache-family campaign --input PREPARED --output CAMPAIGN --ray ADDRESS|local``: rows
on hosts.

One Ray task per row with ``max_retries=0``: a row is never silently run twice, and each row's
own run checks the prepared pins on its node. A row whose node was lost is ``host.lost`` (never
rerun); SIGINT or SIGTERM cancels every task (each ends its row's process group within the
grace), the rows that arrived are merged, and the exit code is 130.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

import msgspec
import psutil

from cache_family.actors.campaign.arrival import (
    OBJECT_STORE,
    ROW_UNSEALED,
    ROWS_DIR,
    SHARED_OUTPUT,
    Arrived,
    arrive_in_place,
    arrive_through_store,
    host_of,
    resume_journal,
)
from cache_family.actors.campaign.journal import (
    CampaignJournal,
    journal_sealed,
    opened_record,
)
from cache_family.actors.campaign.local_cluster import (
    LOCAL_CLUSTER_EVIDENCE,
    end_left_cluster,
    enter_loopback_namespace,
    local_cluster,
)
from cache_family.actors.campaign.merge import MergeOutcome, Missing, ShardRead, merge_campaign
from cache_family.actors.campaign.placement import LoadedPlacement, brief_key, load_placement
from cache_family.actors.campaign.resume import (
    ResumePlan,
    check_bytes,
    move_aside,
    plan_resume,
    read_request,
)
from cache_family.actors.campaign.row_return import DEFAULT_CHUNK_BYTES, read_chunk
from cache_family.actors.campaign.row_task import (
    DEFAULT_GRACE_SECONDS,
    release_row,
    row_argv,
    run_row,
    run_row_in_work_dir,
)
from cache_family.actors.run.matrix import admit_run, planned_brief
from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.campaign import (
    CAMPAIGN_REQUEST,
    CampaignRequest,
    decode_manifest,
    encode_request,
)
from cache_family.schemas.journal import PlannedRowBrief
from cache_family.schemas.prepared import PREPARED_INPUT_MAX_BYTES, PreparedInput, decode_document
from cache_family.system.host_load import NODE_ID_ENV, NODE_LABELS_ENV
from cache_family.system.process_group import end_processes
from cache_family.system.publish import publish_fresh, replace_atomically

RAY_DIR: Final = "ray"
POLL_SECONDS: Final = 0.2
# After a cancel: how long the tasks get to end their rows before they are killed.
CANCEL_SLACK_SECONDS: Final = 30.0
# A lost node's row processes that SIGKILL reached are waited for this long at most.
ROW_KILL_WAIT_SECONDS: Final = 5.0
HOST_LOST: Final = "host.lost"
CANCELLED: Final = "cancelled"
TASK_FAILED: Final = "row.task_failed"


@dataclass
class _Stop:
    signal_name: str | None = None

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def asked(self) -> bool:
        return self.signal_name is not None


@dataclass(frozen=True, slots=True)
class CampaignResult:
    code: int
    outcome: MergeOutcome | None
    lines: list[str] = field(default_factory=list)
    # Rows a signal cancelled (before they started, or while they ran).
    cancelled_rows: int = 0


def _on_node(
    spec: dict[str, str], chunk_bytes: int, input_data: bytes | None, grace_seconds: float
) -> dict[str, object]:  # pragma: no cover - runs in a Ray worker
    """The Ray task: name the node to the row through its environment, then run the row
    (into the shared --output, or in the node's own work directory for the object store)."""
    import ray

    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    labels = {
        k: v for k, v in dict(context.get_node_labels()).items() if not k.startswith("ray.io/")
    }
    environ = {
        **os.environ,
        NODE_ID_ENV: node_id,
        NODE_LABELS_ENV: ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
    }
    node = {"node_id": node_id, "labels": labels}
    if input_data is None:
        argv = row_argv(spec["input_path"], spec["row_dir"], spec["key"])
        return run_row(argv, environ, spec["log"], grace_seconds, node=node)
    return run_row_in_work_dir(spec, chunk_bytes, input_data, environ, grace_seconds, node)


def _chunk_on_node(
    node_row_dir: str, manifest: bytes, index: int
) -> bytes:  # pragma: no cover - runs in a Ray worker
    return read_chunk(node_row_dir, decode_manifest(manifest), index)


def _task_options(rule_placement: LoadedPlacement | None, key: str, local: bool) -> dict[str, Any]:
    rule = rule_placement.by_row.get(key) if rule_placement else None
    options: dict[str, Any] = {
        "max_retries": 0,
        "num_cpus": rule.cpus if rule else 1,
        "num_gpus": rule.gpus if rule else 0,
    }
    if local:
        options["resources"] = {"cf.row": 1}
    if rule is not None and rule.labels:
        options["label_selector"] = dict(rule.labels)
    return options


@dataclass(frozen=True, slots=True)
class RowsOut:
    """How the driver sends rows out and takes them back."""

    campaign_id: str
    input_path: str
    input_sha256: str
    row_return: str = OBJECT_STORE
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


def drive(
    address: str,
    campaign: str,
    plan: Sequence[PlannedRowBrief],
    placement: LoadedPlacement | None,
    stop: _Stop,
    out: RowsOut,
    journal: CampaignJournal,
    *,
    local: bool,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    on_submitted: Any = None,
    node_ip_address: str | None = None,
) -> tuple[dict[str, ShardRead], dict[str, Missing]]:
    """Submit one task per row, wait for all of them (cancelling them all on a signal),
    journal each row as it arrives verified; the arrived rows (by directory) and the rows
    without one."""
    import ray
    from ray.exceptions import RayError, RayTaskError, TaskCancelledError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(
        address=address, log_to_driver=False, logging_level="ERROR",
        _node_ip_address=node_ip_address,
    )  # fmt: skip
    # Ray puts handlers of its own in place (SIGTERM ends the driver at once): the
    # campaign's come back, so a signal cancels the tasks instead.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop.handler)
    try:
        task = ray.remote(_on_node)
        chunk_task = ray.remote(_chunk_on_node)
        release_task = ray.remote(release_row)
        rows_dir = os.path.join(campaign, ROWS_DIR)
        through_store = out.row_return == OBJECT_STORE
        input_ref = None
        if through_store:
            input_ref = ray.put(read_bounded(out.input_path, PREPARED_INPUT_MAX_BYTES,
                                             what="prepared input").data)  # fmt: skip
        refs: dict[Any, tuple[str, str, int]] = {}
        selectors: dict[Any, dict[str, str]] = {}
        stranded: set[Any] = set()  # cancelled: no alive node has their labels any more
        for brief in plan:
            key = brief_key(brief)
            name = f"row-{brief.index:04d}"
            spec = {
                "key": key,
                "name": name,
                "campaign_id": out.campaign_id,
                "input_sha256": out.input_sha256,
                "input_path": out.input_path,
                "row_dir": os.path.join(rows_dir, name),
                "log": os.path.join(rows_dir, f"{name}.log"),
            }
            options = _task_options(placement, key, local)
            ref = task.options(**options).remote(spec, out.chunk_bytes, input_ref, grace_seconds)
            refs[ref] = (key, name, brief.index)
            selectors[ref] = options.get("label_selector", {})
        if on_submitted is not None:
            on_submitted()
        shards: dict[str, ShardRead] = {}
        missing: dict[str, Missing] = {}
        pending = list(refs)
        cancel_deadline: float | None = None

        def fetcher(result: dict[str, object]) -> Any:
            pinned = NodeAffinitySchedulingStrategy(node_id=result["node_id"], soft=False)

            def fetch(index: int) -> bytes:
                ref = chunk_task.options(
                    num_cpus=0, max_retries=0, scheduling_strategy=pinned
                ).remote(result["node_row_dir"], result["manifest"], index)
                return bytes(ray.get(ref))

            return fetch

        while pending:
            if stop.signal_name is not None and cancel_deadline is None:
                for ref in pending:
                    ray.cancel(ref)
                cancel_deadline = time.monotonic() + grace_seconds + CANCEL_SLACK_SECONDS
            if cancel_deadline is not None and time.monotonic() > cancel_deadline:
                for ref in pending:
                    ray.cancel(ref, force=True)
                cancel_deadline = float("inf")
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_SECONDS)
            lost = False
            for ref in done:
                key, name, index = refs[ref]
                result: dict[str, object] | None = None
                why = Missing(ROW_UNSEALED)
                try:
                    result = ray.get(ref)
                except TaskCancelledError:
                    if ref in stranded:
                        why = Missing(HOST_LOST, "no alive node has its labels")
                    else:
                        why = Missing(CANCELLED, "cancelled before its row sealed")
                except RayTaskError as exc:
                    why = Missing(TASK_FAILED, str(exc)[:2000])
                except RayError as exc:
                    why = Missing(HOST_LOST, f"{type(exc).__name__}")
                    lost = True
                arrived: Arrived | Missing | None = None
                if not through_store:
                    host = host_of(result) if result is not None else None
                    arrived = arrive_in_place(campaign, name, key, index, host, SHARED_OUTPUT)
                    if result is not None and arrived is None:
                        why = Missing(ROW_UNSEALED, f"the row's run exited "
                                      f"{result.get('returncode')}", host)  # fmt: skip
                elif result is not None:
                    try:
                        arrived = arrive_through_store(
                            result, campaign, name, key, index, out.input_sha256,
                            fetcher(result),
                        )  # fmt: skip
                    except RayError as exc:
                        arrived = Missing(HOST_LOST, f"{type(exc).__name__} while its chunks "
                                          "were fetched", host_of(result))  # fmt: skip
                        lost = True
                    finally:
                        if isinstance(result.get("chunks"), int) and int(result["chunks"]) > 1:  # type: ignore[call-overload]
                            _release(ray, release_task, result)
                if isinstance(arrived, Arrived):
                    journal.append(arrived.record)
                    shards[arrived.shard.root] = arrived.shard
                    print(f"row arrived: {key} ({arrived.record.how}, {arrived.record.files} "
                          f"files, {arrived.record.size} bytes)", flush=True)  # fmt: skip
                else:
                    missing[key] = arrived if isinstance(arrived, Missing) else why
            if lost:
                stranded |= _strand(ray, pending, selectors)
        return shards, missing
    finally:
        ray.shutdown()


def _release(ray: Any, release_task: Any, result: Mapping[str, object]) -> None:
    """Remove the row the node kept for its chunks (best effort: a lost node keeps it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pinned = NodeAffinitySchedulingStrategy(node_id=result["node_id"], soft=False)
    with contextlib.suppress(Exception):
        ref = release_task.options(num_cpus=0, max_retries=0, scheduling_strategy=pinned).remote(
            result["node_row_dir"]
        )
        ray.get(ref, timeout=30)


def _strand(ray: Any, pending: Sequence[Any], selectors: Mapping[Any, dict[str, str]]) -> set[Any]:
    """After a node was lost: cancel the waiting rows whose labels no alive node has (they
    would wait for ever); they end ``host.lost``."""
    alive = [node.get("Labels") or {} for node in ray.nodes() if node.get("Alive")]
    stranded = {
        ref
        for ref in pending
        if selectors.get(ref)
        and not any(selectors[ref].items() <= labels.items() for labels in alive)
    }
    for ref in stranded:
        ray.cancel(ref)
    return stranded


def end_row_processes(markers: Sequence[str], grace_seconds: float) -> list[int]:
    """End every process still running a row of this campaign (a lost node's orphans on a
    local cluster; their command lines name the campaign's rows or its node work
    directories): SIGTERM, the grace, SIGKILL. The pids it ended."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = process.info["cmdline"] or ()
            if any(marker in part for part in cmdline for marker in markers):
                found.append(process)
    end_processes(found, grace=grace_seconds, kill_wait=ROW_KILL_WAIT_SECONDS)
    return [p.pid for p in found]


@contextlib.contextmanager
def _signals_as(stop: _Stop) -> Iterator[None]:
    previous = {s: signal.signal(s, stop.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_campaign(
    input_path: str | None,
    output: str,
    ray_address: str,
    *,
    placement_file: str | None = None,
    hosts: int = 1,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    resume: bool = False,
    row_return: str = OBJECT_STORE,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> CampaignResult:
    """Admit, drive, merge; raises ``Refused`` before anything is written. With ``resume``,
    ``output`` is an earlier campaign: only its rows without a finished run run again."""
    local = ray_address == "local"
    if not local and hosts != 1:
        raise Refused.one(
            "campaign.hosts_without_local",
            "$.hosts",
            "--hosts starts local nodes; it goes only with --ray local",
            "drop --hosts, or use --ray local",
        )
    resumed: ResumePlan | None = None
    continued = False
    if resume:
        campaign = os.path.abspath(output)
        request = read_request(campaign)
        # What the cluster of a driver killed outright left running is ended first.
        left = end_left_cluster(os.path.join(campaign, LOCAL_CLUSTER_EVIDENCE))
        check_bytes(request.input_path, request.input_sha256, "prepared input")
        check_bytes(request.placement_path, request.placement_sha256, "placement file")
        input_path, placement_file = request.input_path, request.placement_path
        raw = read_bounded(input_path, PREPARED_INPUT_MAX_BYTES, what="prepared input")
        prepared = decode_document(raw.data, PreparedInput, what="prepared input")
        plan = [planned_brief(prepared, row) for row in prepared.rows]
        # A journal its driver left unsealed goes on; a sealed one moves aside.
        continued = journal_sealed(campaign) is False
        if continued:  # its chain is checked before anything moves
            CampaignJournal.continued(campaign).close()
        resumed = plan_resume(
            campaign, plan, os.path.join(campaign, ROWS_DIR), request, keep_journal=continued
        )
        to_run = list(resumed.rerun)
    else:
        assert input_path is not None
        left = 0
        admitted = admit_run(input_path, output)
        campaign, input_path, prepared = admitted.output, admitted.input_path, admitted.prepared
        plan = [planned_brief(prepared, row) for row in prepared.rows]
        to_run = plan
        request = CampaignRequest(input_path=input_path, input_sha256=admitted.request_sha256)
    placement = load_placement(placement_file, plan) if placement_file else None
    if placement is not None and not resume:
        request = msgspec.structs.replace(
            request, placement_path=placement.pin.path, placement_sha256=placement.pin.sha256
        )
    fresh = opened_record(prepared, request.input_sha256, placement.pin if placement else None)
    stop = _Stop()
    lines: list[str] = []
    if left:
        lines.append(f"ended {left} process(es) the stopped driver's local cluster left")
    verified: dict[str, ShardRead] = {}
    parent_netns = 0
    with _signals_as(stop):
        if local:
            parent_netns = enter_loopback_namespace()
        if resumed is None:
            os.makedirs(os.path.join(campaign, ROWS_DIR))
            publish_fresh(os.path.join(campaign, CAMPAIGN_REQUEST), encode_request(request))
            journal = CampaignJournal.create(campaign, fresh)
        else:
            move_aside(resumed.moves)
            journal, verified = resume_journal(campaign, resumed, fresh, plan, continued)
            lines.append(
                f"resume: {len(resumed.kept)} row(s) kept, {len(resumed.rerun)} to run again"
            )
        out = RowsOut(
            campaign_id=journal.opened.campaign_id,
            input_path=input_path,
            input_sha256=request.input_sha256,
            row_return=row_return,
            chunk_bytes=chunk_bytes,
        )
        timings: dict[str, float] = {}
        evidence: dict[str, object] = {}
        shards: dict[str, ShardRead]
        missing: dict[str, Missing]
        started = time.monotonic()
        if local:
            session_dir = os.path.join(campaign, RAY_DIR)
            evidence_path = os.path.join(campaign, LOCAL_CLUSTER_EVIDENCE)
            with local_cluster(
                session_dir, hosts, parent_netns, stop.asked, evidence_path
            ) as cluster:
                timings["cluster_start_seconds"] = time.monotonic() - started
                rows_started = time.monotonic()
                if stop.asked():  # during the start-up: no row is submitted
                    shards, missing = {}, _cancelled_before_start(to_run)
                else:
                    shards, missing = drive(
                        cluster.address, campaign, to_run, placement, stop, out, journal,
                        local=True, grace_seconds=grace_seconds,
                        node_ip_address=cluster.node_ip_address,
                    )  # fmt: skip
                timings["rows_seconds"] = time.monotonic() - rows_started
                evidence = cluster.evidence()
            ended = end_row_processes(
                (os.path.join(campaign, ROWS_DIR), out.campaign_id), grace_seconds
            )
            if ended:
                lines.append(f"ended {len(ended)} row process(es) a lost node left")
        else:
            shards, missing = drive(
                ray_address, campaign, to_run, placement, stop, out, journal,
                local=False, grace_seconds=grace_seconds,
            )  # fmt: skip
        outcome: MergeOutcome | None = None
        merge_started = time.monotonic()

        def write_evidence() -> None:
            # Written before the merge binds the directory's files (it binds this one too):
            # the merge's time is the shards' verification and the fold.
            timings["merge_seconds"] = time.monotonic() - merge_started
            if local:
                _write_evidence(campaign, {**evidence, "rows": len(to_run), **timings})

        shards = {**verified, **shards}
        try:
            if shards:
                outcome = merge_campaign(
                    campaign, sorted(shards), placement_file=placement_file, missing=missing,
                    before_binding=write_evidence, journal=journal, verified=shards,
                )  # fmt: skip
            else:
                lines.append("no row sealed a run directory: nothing to merge")
                write_evidence()
        finally:
            journal.close()
    if stop.signal_name is not None:
        cancelled = sum(why.reason == CANCELLED for why in missing.values())
        return CampaignResult(ExitCode.INTERRUPTED, outcome, lines, cancelled_rows=cancelled)
    if outcome is not None and outcome.status == "completed":
        return CampaignResult(ExitCode.COMPLETED, outcome, lines)
    return CampaignResult(ExitCode.NOT_COMPLETED, outcome, lines)


def _write_evidence(campaign: str, evidence: Mapping[str, object]) -> None:
    """What each test host's namespace held while the cluster was up (its interfaces, routes,
    listening endpoints and TCP sockets), and the driver's own times (cluster start, the rows,
    the merge; bench/campaign_driver.py reads them)."""
    data = json.dumps(evidence, indent=2) + "\n"
    replace_atomically(os.path.join(campaign, LOCAL_CLUSTER_EVIDENCE), data.encode("utf-8"))


def _cancelled_before_start(rows: Sequence[PlannedRowBrief]) -> dict[str, Missing]:
    why = Missing(CANCELLED, "cancelled while the local cluster started")
    return {brief_key(brief): why for brief in rows}


def interrupted_line(result: CampaignResult) -> str:
    """What an interrupted campaign says: cancelled rows only when a row was cancelled."""
    if result.cancelled_rows:
        return (
            f"interrupted: {result.cancelled_rows} row(s) were cancelled and their hosts cleaned up"
        )
    status = result.outcome.status if result.outcome is not None else "not merged"
    return (
        "interrupted after every row had ended: no row was cancelled; the merged matrix is "
        f"{status}"
    )


def campaign_main(
    input_path: str | None,
    output: str,
    ray_address: str,
    placement_file: str | None,
    hosts: int,
    *,
    resume: bool = False,
    row_return: str = OBJECT_STORE,
) -> tuple[int, list[str]]:
    """The exit code and the lines to print (refusals are raised for the CLI to print)."""
    result = run_campaign(
        input_path, output, ray_address, placement_file=placement_file, hosts=hosts,
        resume=resume, row_return=row_return,
    )  # fmt: skip
    lines = list(result.lines)
    if result.outcome is not None:
        lines.append(f"{result.outcome.status}: {result.outcome.matrix_path}")
        lines.append(f"campaign journal head: {result.outcome.head}")
    if result.code == ExitCode.INTERRUPTED:
        lines.append(interrupted_line(result))
    print("\n".join(lines), file=sys.stdout, flush=True)
    return int(result.code), lines
