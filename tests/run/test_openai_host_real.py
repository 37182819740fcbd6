"""A declared OpenAI-compatible server as a host, for real: the project's own llama-server
launched through ``HostKind.OPENAI`` (its ``/v1`` endpoints, ``--metrics``) on a zoo model,
held in custody like any host (pins before and after, loopback, its own process group), its
concurrency ladder sent as ``/v1/completions``, reuse read from
``usage.prompt_tokens_details.cached_tokens`` and judged by whole blocks of the declared size,
then the overlap workload in its chat dialect. Each receipt re-folds from the journal byte for
byte, as replay does. Tiny random-weight models: plumbing evidence, not performance claims."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import trio
from real_run_harness import cli, operator_for

from cache_family.actors.journal.rows_file import cell_rows
from cache_family.actors.journal.writer import JournalWriter
from cache_family.actors.run.cell import CellActor
from cache_family.actors.run.context import RunContext, RunStop
from cache_family.oracles.demo import DEMO_TRACE, REAL_TRACE, REAL_WORKLOADS, with_trace
from cache_family.oracles.native_parts import Parts
from cache_family.oracles.real_model import ensure_real_model
from cache_family.schemas.arms import (
    OPENAI_ARMS,
    OPENAI_CONCURRENT,
    OPENAI_OPEN_LOOP,
    OPENAI_OVERLAP,
    OPENAI_SESSIONS,
    OPENAI_TRACE,
    Arm,
)
from cache_family.schemas.journal import CellOpened, RungPlan, ServerMetricsRead, read_journal
from cache_family.schemas.measurement import CacheExpectation
from cache_family.schemas.openai_host import admit_serving
from cache_family.schemas.prepared import HostProfile
from cache_family.schemas.receipts import (
    CellReceipt,
    decode_cell_receipt,
    decode_row_receipt,
    encode_receipt,
)
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import (
    WORKLOAD_RECEIPT_NAME,
    decode_workload_receipt,
)
from cache_family.states.budgets import Budgets
from cache_family.states.fold.cell import fold_cell
from cache_family.states.plans import CellPlan, PromptChoice, pin_targets
from cache_family.states.workload_fold import fold_workload
from cache_family.system.pins import Budget, pin_tree

pytestmark = pytest.mark.native

BLOCK = 16
SOURCE = (
    "A cache benchmark sends the same long prefix many times and measures how much of the "
    "prompt the server can serve from memory instead of computing it again. "
) * 4
# What the operator declares of the server beyond its pinned parts.
DECLARATION = {
    "schema_version": 1,
    "module": None,
    "args": [
        "--model",
        "{model}",
        "--alias",
        "{model_id}",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--parallel",
        "{lanes}",
        "--ctx-size",
        "{ctx_size}",
        "--threads",
        "1",
        "--no-webui",
        "--metrics",
    ],
    "dialects": ["completions", "chat"],
    "block_size": BLOCK,
    "metrics_path": "/metrics",
    "listening_text": "listening on http://127.0.0.1:{port}",
}

OVERLAP = {"prompt_tokens": 96, "hit_ratios_pct": [0, 90], "groups": 2, "requests": 4, "seed": 7}
SESSIONS = {
    "users": 2,
    "turns": 3,
    "system_prompt_tokens": 32,
    "user_context_tokens": 16,
    "question_tokens": 8,
    "answer_tokens": 4,
    "seed": 3,
}
OPEN_LOOP = {
    "pattern": "poisson",
    "sweep": {"points": 1, "throughput_concurrency": 2},
    "requests": 16,
    "output_tokens": 4,
    "seed": 30,
    "over_saturation": {"window": 8, "min_in_flight": 4, "max_lateness_ms": 2000},
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _profile(parts: Parts, model: Path) -> HostProfile:
    return HostProfile(
        schema_version=1,
        host="openai",
        binary=str(parts.llama_server),
        binary_sha256=_sha256(parts.llama_server),
        source_commit="0" * 40,
        native_build=str(parts.native_build),
        native_build_sha256=pin_tree(str(parts.native_build), Budget.seconds(120)).sha256,
        model=str(model),
        model_sha256=_sha256(model.resolve()),
        artifact=None,
        model_id="served-model",
        layer_end=1,
        ctx_size=512,
        lane_count=2,
        n_gpu_layers=0,
        port=0,
        environment={"OMP_NUM_THREADS": "1"},
        toolkit_directories={},
        worker={},
        startup_timeout_secs=120,
        execution_timeout_secs=300,
        openai=admit_serving(DECLARATION),
    )


def _plan(
    profile: HostProfile,
    arm: Arm,
    *,
    synthetic: bool = True,
    architecture: str = "llama",
    **sizes: object,
) -> CellPlan:
    values: dict[str, object] = {
        # An OpenAI answer names no slot: the fold lets the cell's first ``lanes`` requests be
        # cold, so the ladder fills both slots in its first rung.
        "rungs": (RungPlan(concurrency=2, requests=4), RungPlan(concurrency=4, requests=8)),
        "output_tokens": 4,
        "lanes": 2,
        "ctx_size": 1024,
    }
    values.update(sizes)
    return CellPlan(
        cell_id=f"cell-0000/{arm.name}",
        cell_dir=f"cell-0000/{arm.directory}",
        row_index=0,
        row_key="zoo-llama-p64",
        arm=arm,
        n_gpu_layers=0,
        # 71 prompt tokens: 70 reusable, of which the declared blocks promise 64.
        prefix_tokens=70,
        ttft_slo_ms=5000.0,
        tpot_slo_ms=1000.0,
        profile=profile,
        prompt=PromptChoice(
            text=SOURCE,
            source="use-case",
            corpus_path="/corpus.json",
            corpus_sha256="d" * 64,
            entry_key="cache",
        ),
        pins=pin_targets(profile),
        synthetic=synthetic,
        architecture=architecture,
        model_id=profile.model_id,
        last_of_row=True,
        **values,  # type: ignore[arg-type]
    )


async def _run_cells(run_dir: Path, plans: list[CellPlan]) -> list[CellReceipt | None]:
    writer = JournalWriter(str(run_dir / "journal.jsonl"), fsync=lambda _fd: None)
    receipts: list[CellReceipt | None] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        stop = RunStop(run_deadline=trio.current_time() + 600)
        ctx = RunContext(
            writer=writer,
            run_dir=str(run_dir),
            budgets=Budgets(stop.run_deadline, 300, request_timeout_ms=60_000),
            stop=stop,
        )
        for plan in plans:
            receipts.append(await CellActor(plan, ctx).run())
        await writer.aclose()
    return receipts


async def test_llama_server_declared_as_an_openai_server_runs_the_ladder_and_overlap(
    native_parts: Parts, tmp_path: Path
) -> None:
    profile = _profile(native_parts, native_parts.model_path("llama"))
    workloads = validate_workload_object({"schema_version": 1, "prefix_overlap": OVERLAP})
    ladder = _plan(profile, OPENAI_CONCURRENT)
    overlap = _plan(
        profile,
        OPENAI_OVERLAP,
        rungs=(),
        output_tokens=4,
        lanes=2,
        ctx_size=2 * (96 + 4 + 8 + 70),
        workloads=workloads,
        cache_ram_mib=0,
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with trio.fail_after(600):
        cell, workload = await _run_cells(run_dir, [ladder, overlap])

    assert cell is not None and cell.status == "completed", cell
    assert cell.arm == "openai-concurrent" and cell.accepted_for_parity
    assert cell.readiness.url.endswith("/v1/models")
    assert cell.cleanup is not None and cell.cleanup.problems() == ()
    # Pinned before launch and after the ladder: the binary, its build tree and the model.
    for identity in (cell.before_identity, cell.after_identity):
        assert [p.name for p in identity] == ["binary", "native_build", "model"]
        assert all(p.matches for p in identity)
    rungs = cell.measurement.rungs
    assert [r.status for r in rungs] == ["completed", "completed"]
    for rung in rungs:
        verdict = rung.cache_verdict
        assert verdict is not None and verdict.rule is not None
        assert verdict.rule.startswith("block")
        # Every warm request reuses at least the whole blocks of the prompt.
        assert verdict.shortfall is False
        assert verdict.expected_cached_tokens == 64
        # llama-server reuses the exact prefix: more than the blocks promise.
        assert verdict.observed_cached_tokens_min == 70

    journal = read_journal((run_dir / "journal.jsonl").read_bytes())
    opened = [line.record for line in journal.lines if isinstance(line.record, CellOpened)]
    assert opened[0].cache_expectation == CacheExpectation(
        architecture=None, rule="block", n_ubatch=512, lanes=2, block_size=BLOCK
    )
    reads = [
        line.record
        for line in journal.lines
        if isinstance(line.record, ServerMetricsRead) and line.record.cell_id == ladder.cell_id
    ]
    # The server's own counters, read around each rung at its declared path.
    assert [(r.scope, r.index, r.status, r.path) for r in reads] == [
        ("rung", 0, "read", "/metrics"),
        ("rung", 1, "read", "/metrics"),
    ]

    # As replay: each receipt re-folds from the journal byte for byte.
    cell_dir = run_dir / ladder.cell_dir
    refolded = fold_cell(
        journal.lines,
        ladder.cell_id,
        through_seq=cell.journal_through_seq,
        rows=cell_rows(str(cell_dir)),
    )
    assert encode_receipt(refolded) == (cell_dir / "cell.json").read_bytes()

    assert workload is not None and workload.status == "completed", workload
    assert workload.cleanup is not None and workload.cleanup.problems() == ()
    workload_dir = run_dir / overlap.cell_dir
    published = (workload_dir / WORKLOAD_RECEIPT_NAME).read_bytes()
    receipt = decode_workload_receipt(published)
    points = receipt.overlap
    assert [p.hit_ratio_pct for p in points] == [0, 90]
    assert receipt.status == "accepted", receipt
    assert (
        fold_workload(journal.lines, overlap.cell_id, through_seq=receipt.journal_through_seq)
        == receipt
    )
    refolded = fold_cell(
        journal.lines,
        overlap.cell_id,
        through_seq=workload.journal_through_seq,
        rows=cell_rows(str(workload_dir)),
    )
    assert encode_receipt(refolded) == (workload_dir / "cell.json").read_bytes()


@pytest.mark.parametrize("model", ["zoo", "gemma3"])
async def test_the_declared_server_runs_sessions_open_loop_and_trace_in_its_chat_dialect(
    native_parts: Parts, tmp_path: Path, model: str
) -> None:
    """Every other workload on the declared server, as the stage servers send them: the
    sessions' turns (each turn's expected reuse the server's counts of the turn before), the
    open-loop sweep as streamed chats, the trace window replayed on its timestamps; on a zoo
    model (the byte alphabet) and on the trained Gemma 3 270M (its own tokenizer and chat
    template). Each receipt accepted, and re-folded from the journal byte for byte."""
    document: dict[str, object] = {"schema_version": 1, "multi_turn": SESSIONS}
    if model == "zoo":
        path, window, ctx = native_parts.model_path("llama"), DEMO_TRACE, 512
        document["open_loop"] = OPEN_LOOP
    else:
        path, window, ctx = ensure_real_model(io.StringIO(), fetch=False).model, REAL_TRACE, 2048
        document["open_loop"] = REAL_WORKLOADS["open_loop"]
    profile = _profile(native_parts, path)
    workloads = validate_workload_object(with_trace(document, window))
    plans = [
        _plan(
            profile,
            arm,
            synthetic=model == "zoo",
            architecture="llama" if model == "zoo" else "gemma3",
            rungs=(),
            output_tokens=4,
            lanes=2,
            ctx_size=2 * ctx,
            workloads=workloads,
            cache_ram_mib=None,
        )
        for arm in (OPENAI_SESSIONS, OPENAI_OPEN_LOOP, OPENAI_TRACE)
    ]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with trio.fail_after(600):
        cells = await _run_cells(run_dir, plans)
    journal = read_journal((run_dir / "journal.jsonl").read_bytes())
    receipts = {}
    for plan, cell in zip(plans, cells, strict=True):
        assert cell is not None and cell.status == "completed", (plan.arm.name, cell)
        assert cell.cleanup is not None and cell.cleanup.problems() == ()
        receipt = decode_workload_receipt(
            (run_dir / plan.cell_dir / WORKLOAD_RECEIPT_NAME).read_bytes()
        )
        assert receipt.arm == plan.arm.name and receipt.status == "accepted", receipt
        assert (
            fold_workload(journal.lines, plan.cell_id, through_seq=receipt.journal_through_seq)
            == receipt
        )
        receipts[plan.arm] = receipt
    sessions = receipts[OPENAI_SESSIONS].sessions
    assert sessions is not None and [t.turn for t in sessions.by_turn] == [0, 1, 2]
    assert all(t.requests == SESSIONS["users"] for t in sessions.by_turn), sessions
    # Past the first turn, the server reused each user's conversation so far.
    for turn in sessions.by_turn[1:]:
        assert turn.expected_reused_tokens > 0
        assert turn.achieved_reused_tokens == turn.expected_reused_tokens, turn
    stages = receipts[OPENAI_OPEN_LOOP].open_loop
    assert [s.stage for s in stages[:2]] == ["synchronous", "throughput"]
    assert all(s.completed > 0 for s in stages[:2]), stages
    # The swept rate sent its schedule, or stopped over-saturated on a loaded machine: either
    # way it launched requests and said why it stopped.
    assert all(s.launched > 0 or s.skipped_because for s in stages[2:]), stages
    trace = receipts[OPENAI_TRACE].trace
    assert trace is not None and len(trace.requests) == window["first"]
    assert all(r.achieved_tokens is not None for r in trace.requests), trace
    assert trace.over_claimed == () and trace.token_count_mismatches == (), trace
    if model == "zoo":
        assert [r.designed_infinite_tokens for r in trace.requests] == [0, 8, 8, 8]


async def test_the_real_gemma_model_behind_the_declared_server_runs_the_ladder(
    native_parts: Parts, tmp_path: Path
) -> None:
    """The real Gemma 3 270M (its GGUF, assembled by ``oracles/real_model.py``) served by
    llama-server declared as an OpenAI server: the reference's body exactly (no
    ``ignore_eos``), each warm request reusing at least the declared whole blocks."""
    real = ensure_real_model(io.StringIO(), fetch=False)
    profile = _profile(native_parts, real.model)
    ladder = _plan(profile, OPENAI_CONCURRENT, synthetic=False, architecture="gemma3")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with trio.fail_after(600):
        (cell,) = await _run_cells(run_dir, [ladder])
    assert cell is not None and cell.status == "completed", cell
    assert cell.measurement.ignore_eos is False
    for rung in cell.measurement.rungs:
        verdict = rung.cache_verdict
        assert verdict is not None and verdict.shortfall is False, verdict
        assert verdict.expected_cached_tokens == 64
    journal = read_journal((run_dir / "journal.jsonl").read_bytes())
    cell_dir = run_dir / ladder.cell_dir
    refolded = fold_cell(
        journal.lines,
        ladder.cell_id,
        through_seq=cell.journal_through_seq,
        rows=cell_rows(str(cell_dir)),
    )
    assert encode_receipt(refolded) == (cell_dir / "cell.json").read_bytes()


def test_an_operator_declared_openai_server_is_prepared_run_and_replayed(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    """The product's route: the operator input declares the project's llama-server as an
    OpenAI-compatible server (``openai_server``), preparation pins it and writes the case's
    ``openai`` profile, the run plays the server's ladder and every workload as arms of the
    row after every other arm, the report shows them, and replay re-folds every receipt
    identically."""
    operator = operator_for(native_parts, oracle_tools, tmp_path, ["llama"])
    declared = json.loads(operator.read_text())
    declared["openai_server"] = {"binary": declared["native_server"], "serving": DECLARATION}
    operator.write_text(json.dumps(declared))
    workloads = tmp_path / "workloads.json"
    every_workload = {
        "schema_version": 1,
        "prefix_overlap": OVERLAP,
        "multi_turn": SESSIONS,
        "open_loop": OPEN_LOOP,
    }
    workloads.write_text(json.dumps(with_trace(every_workload, DEMO_TRACE)))
    prepared_dir = tmp_path / "prepared"
    prepare = cli(
        "prepare-full",
        "--input",
        str(operator),
        "--output",
        str(prepared_dir),
        "--workloads",
        str(workloads),
        cwd=tmp_path,
    )
    assert prepare.returncode == 0, prepare.stderr
    prepared = prepared_dir / "cache-family-input.json"
    (profiles,) = json.loads(prepared.read_text())["profiles"].values()
    # The declared server's profile: the native server's pinned bytes and build tree, the
    # case's own model, and the declaration as the operator wrote it.
    native, openai = profiles["native"], profiles["openai"]
    assert "openai" not in native and openai["openai"] == DECLARATION
    for pinned in ("binary_sha256", "native_build_sha256", "model", "model_sha256", "model_id"):
        assert openai[pinned] == native[pinned], pinned

    out = tmp_path / "run"
    ran = cli("run", "--input", str(prepared), "--output", str(out), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    row = decode_row_receipt((out / "cell-0000" / "row.json").read_bytes())
    observed = {o.arm: (o.planned, o.status) for o in row.observations}
    declared = [o.arm for o in row.observations][-len(OPENAI_ARMS) :]
    assert declared == [arm.name for arm in OPENAI_ARMS]
    for arm in OPENAI_ARMS:
        assert observed[arm.name] == ("planned", "completed"), row.observations
    ladder = decode_cell_receipt(
        (out / "cell-0000" / OPENAI_CONCURRENT.directory / "cell.json").read_bytes()
    )
    assert all(
        r.cache_verdict and r.cache_verdict.shortfall is False for r in ladder.measurement.rungs
    )
    # The run's report has a section for each of the declared server's workloads.
    reported = cli("report-run", str(out), cwd=tmp_path)
    assert reported.returncode == 0, reported.stderr
    markdown = (out / "report.md").read_text()
    for arm in OPENAI_ARMS[1:]:
        assert f"### cell-0000/{arm.name}:" in markdown, arm.name
    # Its ladder against the native baseline's, rung by rung, as old against new is.
    section = markdown.split("## Native baseline versus the declared server\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert "| n native | n declared | Native median ms | Declared median ms |" in section
    rungs = json.loads(prepared.read_text())["rows"][0]["tasks"]["concurrent_baseline"]["rungs"]
    for rung in rungs:
        for metric in ("TTFT", "latency"):
            assert f"| {rung['concurrency']} | {metric} |" in section, (rung, metric, section)
    assert "## Old versus new" not in markdown  # no stage servers in this run
    replayed = cli("replay", str(out), cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert f"cell-0000/{OPENAI_CONCURRENT.directory}/cell.json" in replayed.stdout
