"""What a rung's receipt derives from its rows, tallied one row at a time (``RungFacts``).

The load actor tallies each row as its request ends and journals the facts with
``rung_completed``, so no fold holds a rung's rows; replay streams the rows file through the
same tally and compares. A tally keeps a few bytes per request, never a row.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping

from cache_family.errors import Refused
from cache_family.schemas.journal import COHORT_OPENAI, CellOpened, RungCompleted
from cache_family.schemas.measurement import (
    CacheExpectation,
    RequestDigest,
    RequestRow,
    RungFacts,
    RungSummary,
    SerialSummary,
)
from cache_family.schemas.request_rows import RequestRowLine
from cache_family.states import parity
from cache_family.states.cache_reuse import CacheTallier
from cache_family.states.calibration import first_content_with_final
from cache_family.states.metrics import RungAccumulator, SerialAccumulator

# A concurrent rung reported without a makespan cannot be summarised.
MAKESPAN_MISSING = "fold.makespan_missing"


class RungTally:
    """One rung's rows in, its ``RungFacts`` out; ``serial`` rungs get a serial summary."""

    def __init__(
        self,
        requested: int,
        *,
        serial: bool,
        ttft_slo_ms: float | None = None,
        tpot_slo_ms: float | None = None,
        expectation: CacheExpectation | None = None,
        digests: bool = False,
    ) -> None:
        """``digests``: keep each request's parity digests (a stage server's rung of at most
        parity's request cap; a larger one cannot be compared anyway)."""
        self.serial = serial
        self._summary: SerialAccumulator | RungAccumulator = (
            SerialAccumulator(requested)
            if serial
            else RungAccumulator(
                requested, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms, compact=True
            )
        )
        self._cache = CacheTallier(expectation)
        self._first_with_final = array("q")
        self._digests: list[RequestDigest] | None = (
            [] if digests and requested <= parity.MAX_REQUESTS else None
        )
        self.rows = self.completed = 0

    def add(self, row: RequestRow) -> None:
        self.rows += 1
        self.completed += row.status == "completed"
        self._summary.add(row)
        self._cache.add(row)
        if not self.serial and first_content_with_final((row,)):
            self._first_with_final.append(row.request_id)
        if self._digests is not None:
            self._digests.append(
                RequestDigest(
                    request_id=row.request_id,
                    status=row.status,
                    content_sha256=row.content_sha256,
                    first_chunk_sha256=row.first_chunk_sha256,
                )
            )

    def facts(self, *, concurrency: int, makespan_seconds: float | None) -> RungFacts:
        """The facts as of the rows added so far (call again after more rows)."""
        rung: RungSummary | None = None
        serial: SerialSummary | None = None
        refusals: tuple[str, ...] = ()
        try:
            if isinstance(self._summary, SerialAccumulator):
                serial = self._summary.summary()
            elif makespan_seconds is None:
                refusals = (MAKESPAN_MISSING,)
            else:
                rung = self._summary.summary(
                    concurrency=concurrency, makespan_seconds=makespan_seconds
                )
        except Refused as refused:
            refusals = tuple(sorted(set(refused.codes)))
        return RungFacts(
            rows=self.rows,
            completed=self.completed,
            rung_summary=rung,
            serial_summary=serial,
            summary_refusals=refusals,
            first_content_with_final_ids=tuple(sorted(self._first_with_final)),
            cache=self._cache.tally(),
            digests=tuple(sorted(self._digests or (), key=lambda d: d.request_id)),
        )


def tally_cell(
    opened: CellOpened, completed: Mapping[int, RungCompleted], lines: Iterable[RequestRowLine]
) -> dict[int, RungFacts]:
    """Each reported rung's facts from the cell's rows file (replay's re-derivation of what
    its ``rung_completed`` records hold); rows of a rung never reported are not tallied."""
    tallies: dict[int, RungTally] = {}
    for line in lines:
        record = completed.get(line.rung_index)
        if record is None:
            continue
        tally = tallies.get(line.rung_index)
        if tally is None:
            tally = tallies[line.rung_index] = RungTally(
                record.requested_requests,
                serial=opened.measurement_kind == "serial",
                ttft_slo_ms=opened.ttft_slo_ms,
                tpot_slo_ms=opened.tpot_slo_ms,
                expectation=opened.cache_expectation,
                digests=opened.cohort == COHORT_OPENAI,
            )
        tally.add(line.row)
    return {
        index: tally.facts(
            concurrency=completed[index].concurrency,
            makespan_seconds=completed[index].makespan_seconds,
        )
        for index, tally in tallies.items()
    }
