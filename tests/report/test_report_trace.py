"""The trace replay's report section: the scaling beside every figure, the totals, the
efficiency by prefix depth, the losses naming the request that last sent the blocks, and the
old-against-new line where both stage servers replayed the trace."""

from __future__ import annotations

from cache_family.report.workloads import WorkloadView, workload_sections
from cache_family.schemas.workload_records import (
    TraceReplayed,
    TraceRequestReplayed,
    WorkloadReceipt,
    WorkloadRequest,
)
from cache_family.states.trace_fold import trace_receipt

SHA = "c0ffee" + "0" * 58


def _receipt(arm: str, achieved: tuple[int, ...]) -> WorkloadReceipt:
    cell = f"cell-0000/{arm}"
    designed = (0, 32, 48, 16, 64)
    sent = [
        TraceRequestReplayed(
            cell_id=cell,
            index=i,
            line=i + 1,
            scheduled_s=0.2 * i,
            sent_s=0.2 * i + 0.001,
            designed_infinite_tokens=d,
            designed_lru_tokens=d,
            shared_blocks=d // 16,
            last_sender=None if not d else i - 1,
            request=WorkloadRequest(
                position=i,
                status="completed",
                prompt_tokens=80,
                cached_tokens=a,
                prompt_ms=10.0 + i,
                designed_prompt_tokens=80,
            ),
        )
        for i, (d, a) in enumerate(zip(designed, achieved, strict=True))
    ]
    replayed = TraceReplayed(
        cell_id=cell,
        path="/data/trace.jsonl",
        sha256=SHA,
        format="mooncake",
        block_tokens=512,
        tokens_per_block=16,
        time_scale=0.2,
        output_tokens_cap=2,
        window_json='{"first": 5, "from_ms": null, "until_ms": null}',
        requests=5,
        distinct_ids=6,
        lru_capacity_tokens=256,
        launched=5,
        completed=5,
        lateness_p50_ms=1.0,
        lateness_p99_ms=1.0,
        lateness_max_ms=1.0,
    )
    trace = trace_receipt(replayed, sent)
    return WorkloadReceipt(
        cell_id=cell, arm=arm, kind="trace", status="accepted", synthetic=True, trace=trace
    )


def test_the_trace_section_shows_scaling_totals_depths_losses_and_figures() -> None:
    receipt = _receipt("native-trace", (0, 32, 47, 16, 16))
    svgs: dict[str, str] = {}
    lines = workload_sections([WorkloadView("cell-0000/workload-native-trace/workload.json",
                                            receipt)], svgs)  # fmt: skip
    text = "\n".join(lines)
    assert "each 512-token block replayed as 16 tokens" in text
    assert "replay time = trace time × 0.2" in text and "window first 5" in text
    # 32 + 47 + 16 + 16 of 32 + 48 + 16 + 64 designed.
    assert "| 160 | 160 | 111 | 69.38 % |" in text
    assert text.index("Scaling: ") < text.index("![trace replay")
    assert "Reuse lost at 1 requests: 4 (16 of 64, last sent by 3)." in text
    assert "| 4-7 | 1 | 25.00 % |" in text
    assert sorted(svgs) == [
        "plots/workload-cell-0000_native-trace-by-depth.svg",
        "plots/workload-cell-0000_native-trace-over-time.svg",
        "plots/workload-cell-0000_native-trace.svg",
    ]
    over_time = svgs["plots/workload-cell-0000_native-trace-over-time.svg"]
    assert "Server prompt time, median per slice" in over_time
    assert "Efficiency (achieved / designed)" in over_time
    for name, svg in svgs.items():
        assert "B=16 of 512, time ×0.2" in svg, name
        assert f"]({name})" in text


def test_old_and_new_trace_replays_are_compared() -> None:
    views = [
        WorkloadView("cell-0000/workload-old-trace/workload.json",
                     _receipt("old-trace", (0, 0, 0, 0, 0))),
        WorkloadView("cell-0000/workload-new-trace/workload.json",
                     _receipt("new-trace", (0, 32, 48, 16, 16))),
    ]  # fmt: skip
    lines = workload_sections(views, {})
    section = lines[lines.index("### Old against new") :]
    [line] = [x for x in section if "trace replay" in x]
    assert "| 0.00 % | 70.00 % |" in line
