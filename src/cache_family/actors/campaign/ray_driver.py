"""``cache-family campaign --input PREPARED --output CAMPAIGN --ray ADDRESS|local``: rows
on hosts.
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

from cache_family.actors.campaign.local_cluster import (
    enter_loopback_namespace,
    interfaces,
    local_cluster,
    tcp_endpoints,
)
from cache_family.actors.campaign.merge import MergeOutcome, Missing, merge_campaign
from cache_family.actors.campaign.placement import LoadedPlacement, brief_key, load_placement
from cache_family.actors.campaign.resume import (
    ResumePlan,
    check_bytes,
    move_aside,
    plan_resume,
    read_request,
)
from cache_family.actors.campaign.row_task import DEFAULT_GRACE_SECONDS, row_argv, run_row
from cache_family.actors.run.matrix import admit_run, planned_brief
from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.campaign import CAMPAIGN_REQUEST, CampaignRequest, encode_request
from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.journal import (
    JOURNAL_FILENAME,
    JournalSealed,
    PlannedRowBrief,
    read_journal,
)
from cache_family.schemas.prepared import PREPARED_INPUT_MAX_BYTES, PreparedInput, decode_document
from cache_family.system.host_load import NODE_ID_ENV, NODE_LABELS_ENV
from cache_family.system.publish import publish_fresh

ROWS_DIR: Final = "rows"
RAY_DIR: Final = "ray"
LOCAL_CLUSTER_EVIDENCE: Final = "local-cluster.json"
POLL_SECONDS: Final = 0.2
# After a cancel: how long the tasks get to end their rows before they are killed.
CANCEL_SLACK_SECONDS: Final = 30.0
HOST_LOST: Final = "host.lost"
CANCELLED: Final = "cancelled"
TASK_FAILED: Final = "row.task_failed"
ROW_UNSEALED: Final = "row.unsealed"


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
    argv: Sequence[str], log_path: str, grace_seconds: float
) -> dict[str, object]:  # pragma: no cover - runs in a Ray worker
    """The Ray task: name the node to the row through its environment, then run the row."""
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
    return run_row(argv, environ, log_path, grace_seconds, node={"node_id": node_id,
                                                               "labels": labels})  # fmt: skip


def sealed(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, JOURNAL_FILENAME), "rb") as journal:
            read = read_journal(journal.read())
    except OSError:
        return False
    return (
        read.chain_break is None
        and bool(read.lines)
        and isinstance(read.lines[-1].record, JournalSealed)
    )


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


def drive(
    address: str,
    input_path: str,
    campaign: str,
    plan: Sequence[PlannedRowBrief],
    placement: LoadedPlacement | None,
    stop: _Stop,
    *,
    local: bool,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    on_submitted: Any = None,
) -> tuple[list[str], dict[str, Missing]]:
    """Submit one task per row, wait for all of them (cancelling them all on a signal);
    the sealed row directories and the rows without one."""
    import ray
    from ray.exceptions import RayError, RayTaskError, TaskCancelledError

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    # Ray puts handlers of its own in place (SIGTERM ends the driver at once): the
    # campaign's come back, so a signal cancels the tasks instead.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop.handler)
    try:
        task = ray.remote(_on_node)
        rows_dir = os.path.join(campaign, ROWS_DIR)
        refs: dict[Any, tuple[str, str]] = {}
        selectors: dict[Any, dict[str, str]] = {}
        stranded: set[Any] = set()  # cancelled: no alive node has their labels any more
        for brief in plan:
            key = brief_key(brief)
            row_dir = os.path.join(rows_dir, f"row-{brief.index:04d}")
            argv = row_argv(input_path, row_dir, key)
            log = os.path.join(rows_dir, f"row-{brief.index:04d}.log")
            options = _task_options(placement, key, local)
            ref = task.options(**options).remote(argv, log, grace_seconds)
            refs[ref] = (key, row_dir)
            selectors[ref] = options.get("label_selector", {})
        if on_submitted is not None:
            on_submitted()
        shards: list[str] = []
        missing: dict[str, Missing] = {}
        pending = list(refs)
        cancel_deadline: float | None = None
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
                key, row_dir = refs[ref]
                try:
                    result = ray.get(ref)
                except TaskCancelledError:
                    if ref in stranded:
                        reason, detail, host = HOST_LOST, "no alive node has its labels", None
                    else:
                        reason, detail, host = CANCELLED, "cancelled before its row sealed", None
                except RayTaskError as exc:
                    reason, detail, host = TASK_FAILED, str(exc)[:2000], None
                except RayError as exc:
                    reason, detail, host = HOST_LOST, f"{type(exc).__name__}", None
                    lost = True
                else:
                    reason = ROW_UNSEALED
                    detail = f"the row's run exited {result.get('returncode')}"
                    host = _host_of(result)
                if sealed(row_dir):
                    shards.append(row_dir)
                else:
                    missing[key] = Missing(reason, detail, host)
            if lost:
                stranded |= _strand(ray, pending, selectors)
        return shards, missing
    finally:
        ray.shutdown()


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


def _host_of(result: Mapping[str, object]) -> HostIdentity | None:
    hostname = result.get("hostname")
    if not isinstance(hostname, str):
        return None
    labels = result.get("labels")
    node_id = result.get("node_id")
    return HostIdentity(
        hostname=hostname,
        node_id=node_id if isinstance(node_id, str) else None,
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
    )


def end_row_processes(rows_dir: str, grace_seconds: float) -> list[int]:
    """End every process still running a row of this campaign (a lost node's orphans on a
    local cluster): SIGTERM, the grace, SIGKILL. The pids it ended."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(rows_dir in part for part in process.info["cmdline"] or ()):
                found.append(process)
    for process in found:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(found, timeout=grace_seconds)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)
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
    if resume:
        campaign = os.path.abspath(output)
        request = read_request(campaign)
        check_bytes(request.input_path, request.input_sha256, "prepared input")
        check_bytes(request.placement_path, request.placement_sha256, "placement file")
        input_path, placement_file = request.input_path, request.placement_path
        raw = read_bounded(input_path, PREPARED_INPUT_MAX_BYTES, what="prepared input")
        prepared = decode_document(raw.data, PreparedInput, what="prepared input")
        plan = [planned_brief(prepared, row) for row in prepared.rows]
        resumed = plan_resume(campaign, plan, os.path.join(campaign, ROWS_DIR), request)
        to_run = list(resumed.rerun)
    else:
        assert input_path is not None
        admitted = admit_run(input_path, output)
        campaign, input_path = admitted.output, admitted.input_path
        plan = [planned_brief(admitted.prepared, row) for row in admitted.prepared.rows]
        to_run = plan
        request = CampaignRequest(input_path=input_path, input_sha256=admitted.request_sha256)
    placement = load_placement(placement_file, plan) if placement_file else None
    if placement is not None and not resume:
        request = msgspec.structs.replace(
            request, placement_path=placement.pin.path, placement_sha256=placement.pin.sha256
        )
    stop = _Stop()
    lines: list[str] = []
    with _signals_as(stop):
        if local:
            enter_loopback_namespace()
        if resumed is None:
            os.makedirs(os.path.join(campaign, ROWS_DIR))
            publish_fresh(os.path.join(campaign, CAMPAIGN_REQUEST), encode_request(request))
        else:
            move_aside(resumed.moves)
            lines.append(
                f"resume: {len(resumed.kept)} row(s) kept, {len(resumed.rerun)} to run again"
            )
        timings: dict[str, float] = {}
        evidence: dict[str, object] = {}
        shards: list[str]
        missing: dict[str, Missing]
        started = time.monotonic()
        if local:
            session_dir = os.path.join(campaign, RAY_DIR)
            with local_cluster(session_dir, hosts, stop.asked) as cluster:
                timings["cluster_start_seconds"] = time.monotonic() - started
                rows_started = time.monotonic()
                if stop.asked():  # during the start-up: no row is submitted
                    shards, missing = [], _cancelled_before_start(to_run)
                else:
                    shards, missing = drive(
                        cluster.address, input_path, campaign, to_run, placement, stop,
                        local=True, grace_seconds=grace_seconds,
                    )  # fmt: skip
                timings["rows_seconds"] = time.monotonic() - rows_started
                evidence = {"hosts": hosts, "interfaces": interfaces(), "tcp": tcp_endpoints()}
            ended = end_row_processes(os.path.join(campaign, ROWS_DIR), grace_seconds)
            if ended:
                lines.append(f"ended {len(ended)} row process(es) a lost node left")
        else:
            shards, missing = drive(
                ray_address, input_path, campaign, to_run, placement, stop,
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

        if resumed is not None:
            shards = sorted([*resumed.kept, *shards])
        if shards:
            outcome = merge_campaign(
                campaign, shards, placement_file=placement_file, missing=missing,
                before_binding=write_evidence,
            )  # fmt: skip
        else:
            lines.append("no row sealed a run directory: nothing to merge")
            write_evidence()
    if stop.signal_name is not None:
        cancelled = sum(why.reason == CANCELLED for why in missing.values())
        return CampaignResult(ExitCode.INTERRUPTED, outcome, lines, cancelled_rows=cancelled)
    if outcome is not None and outcome.status == "completed":
        return CampaignResult(ExitCode.COMPLETED, outcome, lines)
    return CampaignResult(ExitCode.NOT_COMPLETED, outcome, lines)


def _write_evidence(campaign: str, evidence: Mapping[str, object]) -> None:
    """What the loopback-only namespace held while the cluster was up (its interfaces and
    the endpoints of every TCP socket in it: nothing left 127.0.0.1), and the driver's own
    times (cluster start, the rows, the merge; bench/campaign_driver.py reads them)."""
    path = os.path.join(campaign, LOCAL_CLUSTER_EVIDENCE)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(evidence, handle, indent=2)
        handle.write("\n")


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
) -> tuple[int, list[str]]:
    """The exit code and the lines to print (refusals are raised for the CLI to print)."""
    result = run_campaign(
        input_path, output, ray_address, placement_file=placement_file, hosts=hosts,
        resume=resume,
    )  # fmt: skip
    lines = list(result.lines)
    if result.outcome is not None:
        lines.append(f"{result.outcome.status}: {result.outcome.matrix_path}")
        lines.append(f"campaign journal head: {result.outcome.head}")
    if result.code == ExitCode.INTERRUPTED:
        lines.append(interrupted_line(result))
    print("\n".join(lines), file=sys.stdout, flush=True)
    return int(result.code), lines
