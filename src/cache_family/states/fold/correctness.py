"""The correctness arm's fold: a row's topology verdicts in, its correctness observation out."""

from __future__ import annotations

from cache_family.schemas.journal import (
    CorrectnessTopologyRan,
    CorrectnessVerdict,
    RowOpened,
)
from cache_family.schemas.receipts import (
    CORRECTNESS_UNRECORDED,
    CorrectnessObservation,
    CorrectnessTopology,
    ReceiptStatus,
    TerminalRefusal,
)


class CorrectnessFold:
    """The row's correctness arm from its topology and verdict records."""

    def __init__(self) -> None:
        self.topologies: list[CorrectnessTopologyRan] = []
        self.verdict: CorrectnessVerdict | None = None

    def apply(self, record: CorrectnessTopologyRan | CorrectnessVerdict) -> None:
        if isinstance(record, CorrectnessVerdict):
            self.verdict = self.verdict or record
        else:
            self.topologies.append(record)

    @property
    def passed(self) -> bool:
        return self.verdict is not None and self.verdict.status == "completed"

    def shortfall(self, terminal: TerminalRefusal | None) -> tuple[ReceiptStatus, str] | None:
        """The present row's status and reason when its correctness arm did not pass (a row
        stopped before its correctness began is judged by the stop instead)."""
        if self.passed:
            return None
        if self.verdict is None and not self.topologies:
            return None if terminal is not None else ("incomplete", "correctness_not_run")
        verdict = self.verdict
        reason = (verdict.reason if verdict else None) or "correctness_incomplete"
        refused = verdict is not None and reason.startswith("correctness_report_refused")
        return ("failed" if refused else "incomplete"), reason.split(":", 1)[0]

    def skip_reason(self) -> str | None:
        """Why the planned baselines did not run: correctness did not pass."""
        if self.verdict is None or self.passed:
            return None
        return f"correctness {self.verdict.status}: baselines skipped"

    def observation(
        self, opened: RowOpened | None, terminal: TerminalRefusal | None
    ) -> CorrectnessObservation:
        if opened is None:
            return CORRECTNESS_UNRECORDED
        verdict = self.verdict
        if verdict is None and not self.topologies:
            return CorrectnessObservation(
                status=opened.correctness_status,
                reason=opened.correctness_reason,
                terminal_refusal=terminal if opened.model_status == "present" else None,
            )
        return CorrectnessObservation(
            status=verdict.status if verdict else "failed-or-incomplete",
            reason=verdict.reason if verdict else "correctness_journal_ended_before_verdict",
            planned_topologies=verdict.planned_topologies if verdict else (),
            topologies=tuple(
                CorrectnessTopology(
                    topology=t.topology,
                    status=t.status,
                    reason=t.reason,
                    evidence_dir=t.evidence_dir or None,
                    cache_storage_bytes=t.cache_storage_bytes,
                    cache_hit_import_ms=t.cache_hit_import_ms,
                    cache_hit_decode_ms=t.cache_hit_decode_ms,
                    cache_hit_total_ms=t.cache_hit_total_ms,
                    recompute_total_ms=t.recompute_total_ms,
                    benchmark_prompt_token_count=t.benchmark_prompt_token_count,
                    suffix_prefill_matches=t.suffix_prefill_matches,
                    refusal_codes=t.refusal_codes,
                )
                for t in self.topologies
            ),
            prompt_sha256=verdict.prompt_sha256 if verdict else None,
            terminal_refusal=terminal,
            suffix_prefill_matches=verdict.suffix_prefill_matches if verdict else None,
        )
