"""Self-calibration: the verdicts (pure), the receipts that carry them, and the measurement
itself against the in-process calibration server on real loopback sockets."""

from __future__ import annotations

import json

import msgspec
import pytest
import trio
import trio.testing
from cell_journal_builder import CellScript, completed_row, row_records
from fold_journals import journal

from cache_family.actors.run.self_calibration import CALIBRATION_PACE, calibrate_client
from cache_family.schemas.journal import ArmPlan, ClientCalibrated, Record, RungCompleted
from cache_family.schemas.matrix import encode_matrix
from cache_family.schemas.measurement import ClientCalibration, RequestRow, RungSummary
from cache_family.states.calibration import (
    NEAR_OVERHEAD_FACTOR,
    calibration,
    first_content_with_final,
    near_client_overhead,
    rung_latencies,
)
from cache_family.states.fold import JournalIndex, fold_cell
from cache_family.states.matrix import fold_matrix


def test_a_latency_within_ten_times_the_overhead_is_flagged() -> None:
    assert near_client_overhead([5.0, 40.0], 0.5, NEAR_OVERHEAD_FACTOR) is True
    assert near_client_overhead([5.01, 40.0], 0.5, NEAR_OVERHEAD_FACTOR) is False
    assert near_client_overhead([None, 4.0], 0.5, NEAR_OVERHEAD_FACTOR) is True
    # Unknown overhead, or nothing measured: no verdict either way.
    assert near_client_overhead([5.0], None, NEAR_OVERHEAD_FACTOR) is None
    assert near_client_overhead([None], 0.5, NEAR_OVERHEAD_FACTOR) is None
    # A negative overhead (clock noise) counts as none: only a zero latency comes near it.
    assert near_client_overhead([0.1], -0.2, NEAR_OVERHEAD_FACTOR) is False


def test_rung_latencies_are_the_medians_the_receipt_reports() -> None:
    summary = RungSummary(
        concurrency=2,
        requested_requests=4,
        measured_requests=4,
        makespan_seconds=1.0,
        throughput_requests_per_sec=4.0,
        output_tokens_per_sec=32.0,
        goodput_requests_per_sec=None,
        observed_completion_tokens=32,
        ttft_p50_ms=3.0,
        latency_p50_ms=30.0,
    )
    assert rung_latencies(summary, None) == (3.0, 30.0)
    assert rung_latencies(None, None) == ()


def test_a_first_content_that_came_with_the_final_event_is_listed() -> None:
    late = msgspec.structs.replace(completed_row(1), ttft_ms=21.0)  # elapsed 21 ms
    failed = RequestRow(request_id=2, status="failed", ttft_ms=3.0, elapsed_ms=3.0)
    assert first_content_with_final([completed_row(0), late, failed]) == (1,)


def test_calibration_is_client_latency_minus_server_truth() -> None:
    figures = calibration(
        [10.5, 10.7, 11.0], [10.0, 10.0, 10.0], [0.4, 0.5, 0.6], pace=(5.0, 1.0, 8)
    )
    assert figures.requests == 3
    assert figures.overhead_p50_ms == pytest.approx(0.7)
    assert figures.overhead_max_ms == pytest.approx(1.0)
    assert figures.ttft_error_p50_ms == pytest.approx(0.5)
    assert (figures.server_ttft_ms, figures.server_itl_ms, figures.server_tokens) == (5.0, 1.0, 8)
    with pytest.raises(ValueError, match="one server truth per client latency"):
        calibration([1.0], [], [], pace=(5.0, 1.0, 8))


def _with_overhead(records: list[Record], overhead: float) -> list[Record]:
    return [
        msgspec.structs.replace(r, client_overhead_ms=overhead, client_overhead_factor=10.0)
        if isinstance(r, RungCompleted)
        else r
        for r in records
    ]


def test_the_cell_receipt_flags_rungs_near_the_client_overhead() -> None:
    script = CellScript().happy()  # every rung's TTFT p50 is 5 ms
    far = fold_cell(journal(*_with_overhead(script.records, 0.4)), script.cell_id)
    near = fold_cell(journal(*_with_overhead(script.records, 0.6)), script.cell_id)
    unknown = fold_cell(journal(*script.records), script.cell_id)
    assert [r.near_client_overhead for r in far.measurement.rungs] == [False, False]
    assert [r.near_client_overhead for r in near.measurement.rungs] == [True, True]
    assert [r.client_overhead_ms for r in near.measurement.rungs] == [0.6, 0.6]
    assert [r.near_client_overhead for r in unknown.measurement.rungs] == [None, None]
    # A flag describes the measurement; it never changes the cell's verdict.
    assert near.status == far.status == "completed"


def test_the_rung_receipt_lists_requests_whose_ttft_is_their_latency() -> None:
    script = CellScript()
    script.open()
    script.launch()
    script.become_ready()
    script.warmup()
    late = msgspec.structs.replace(completed_row(1), ttft_ms=21.0)
    script.request(0, 0)
    script.request(0, 1, late)
    script.rung_done(0)
    rung = fold_cell(journal(*script.records), script.cell_id).measurement.rungs[0]
    assert rung.first_content_with_final_ids == (1,)


CALIBRATED = ClientCalibration(
    requests=20,
    overhead_p50_ms=0.42,
    overhead_p90_ms=0.61,
    overhead_max_ms=1.3,
    ttft_error_p50_ms=0.4,
    server_ttft_ms=5.0,
    server_itl_ms=1.0,
    server_tokens=8,
)


def test_the_matrix_receipt_records_the_run_calibration_or_why_there_is_none() -> None:
    rows = [row_records(0, [ArmPlan(arm="native-serial")], model_status="missing-model")]
    measured = journal(ClientCalibrated(calibration=CALIBRATED), *rows)
    matrix = fold_matrix(JournalIndex(measured), through_seq=measured[-1].seq)
    assert matrix.client_calibration == CALIBRATED
    assert matrix.client_calibration_error is None
    published = json.loads(encode_matrix(matrix))
    assert published["client_calibration"]["overhead_p50_ms"] == 0.42
    assert list(published)[-2:] == ["client_calibration", "client_calibration_error"]

    failed = journal(ClientCalibrated(error="calibration server: no port"), *rows)
    matrix = fold_matrix(JournalIndex(failed), through_seq=failed[-1].seq)
    assert matrix.client_calibration is None
    assert matrix.client_calibration_error == "calibration server: no port"


async def test_calibration_pairs_each_request_with_the_server_truth(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calibrated = await calibrate_client(requests=10)
    assert calibrated.error is None and calibrated.calibration is not None
    figures = calibrated.calibration
    # Four warm-up requests are left out; the pace is the one the server kept.
    assert figures.requests == 6
    assert figures.server_tokens == CALIBRATION_PACE.tokens
    # On the virtual clock the client takes no time: a wrong pairing or truth would show here
    # as a whole TTFT or inter-token interval.
    assert abs(figures.overhead_p50_ms) < 0.01
    assert abs(figures.overhead_max_ms) < 0.01
    assert figures.ttft_error_p50_ms is not None and abs(figures.ttft_error_p50_ms) < 0.01


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)
