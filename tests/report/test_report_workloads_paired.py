"""The workload section's old-against-new table: per overlap point both stage servers
measured, reuse side by side and the difference of median server prompt time with the
report's one bootstrap interval (``report/stats.py``)."""

from __future__ import annotations

import msgspec

from cache_family.report.render import effect_cells
from cache_family.report.stats import bootstrap_median_difference
from cache_family.report.workloads import WorkloadView, workload_sections
from cache_family.schemas.workload_records import (
    ChatTemplateMeasured,
    OverlapPointReceipt,
    SessionsReceipt,
    TurnReceipt,
    WorkloadReceipt,
)


def _receipt(
    arm: str, achieved: float, times: tuple[float, ...], row: str = "cell-0001"
) -> WorkloadReceipt:
    point = OverlapPointReceipt(
        hit_ratio_pct=90,
        prompt_tokens=123,
        shared_prefix_tokens=110,
        reusable_tokens=110,
        designed_ratio_pct=89.43,
        achieved_ratio_pct=achieved,
        band_pp=0.81,
        measured_requests=len(times),
        failed_requests=0,
        accepted=achieved > 0,
        prompt_ms_p50=sorted(times)[len(times) // 2],
        prompt_ms=times,
    )
    return WorkloadReceipt(
        cell_id=f"{row}/{arm}",
        arm=arm,
        kind="prefix-overlap",
        status="accepted",
        synthetic=True,
        rule="exact-prefix",
        overlap=(point,),
    )


def test_old_and_new_overlap_points_are_set_side_by_side_with_an_interval() -> None:
    old_times, new_times = (30.0, 31.0, 29.0, 32.0), (5.0, 6.0, 5.5, 4.5)
    views = [
        WorkloadView("cell-0001/workload-old-overlap/workload.json",
                     _receipt("old-overlap", 0.0, old_times)),
        WorkloadView("cell-0001/workload-new-overlap/workload.json",
                     _receipt("new-overlap", 89.43, new_times)),
    ]  # fmt: skip
    lines = workload_sections(views, {})
    section = lines[lines.index("### Old against new") :]
    effect = bootstrap_median_difference(old_times, new_times)
    assert effect is not None and effect.verdict == "new faster"
    expected = (
        "| cell-0001 | overlap 90 % | 0.00 % | 89.43 % | 4 | 4 | "
        + " | ".join(effect_cells(effect))
        + " |"
    )
    assert expected in section
    # The stage arms say their dialect; synthetic rows stay labelled.
    assert any("OpenAI chat" in line for line in lines)
    assert any("(synthetic: plumbing evidence)" in line for line in lines)


def test_without_both_stage_arms_of_a_row_there_is_no_comparison() -> None:
    views = [
        WorkloadView("cell-0001/workload-new-overlap/workload.json",
                     _receipt("new-overlap", 89.43, (5.0, 6.0))),
        WorkloadView("cell-0002/workload-old-overlap/workload.json",
                     _receipt("old-overlap", 0.0, (30.0, 31.0), "cell-0002")),
    ]  # fmt: skip
    assert "### Old against new" not in workload_sections(views, {})


def _sessions(arm: str, reused: int, times: tuple[float, ...]) -> WorkloadReceipt:
    turn = TurnReceipt(
        turn=1,
        requests=len(times),
        prompt_tokens=200 * len(times),
        expected_reused_tokens=150 * len(times),
        achieved_reused_tokens=reused * len(times),
        prompt_ms_p50=sorted(times)[len(times) // 2],
        prompt_ms=times,
    )
    return WorkloadReceipt(
        cell_id=f"cell-0001/{arm}",
        arm=arm,
        kind="sessions",
        status="accepted",
        synthetic=True,
        sessions=SessionsReceipt(
            users=len(times), turns=2, seed=0, by_turn=(turn,), eviction_turn=None,
            failed_requests=0,
        ),
    )  # fmt: skip


def test_old_and_new_session_turns_are_set_side_by_side_with_an_interval() -> None:
    old_times, new_times = (40.0, 42.0, 41.0), (8.0, 9.0, 7.0)
    views = [
        WorkloadView("a", _sessions("old-sessions", 0, old_times)),
        WorkloadView("b", _sessions("new-sessions", 150, new_times)),
    ]
    lines = workload_sections(views, {})
    effect = bootstrap_median_difference(old_times, new_times)
    assert effect is not None
    expected = (
        "| cell-0001 | sessions turn 1 | 0.00 % | 75.00 % | 3 | 3 | "
        + " | ".join(effect_cells(effect))
        + " |"
    )
    assert expected in lines[lines.index("### Old against new") :]


def test_a_stage_workload_shows_the_chat_template_it_measured() -> None:
    template = ChatTemplateMeasured(
        cell_id="cell-0001/new-overlap",
        pieces="word-pieces",
        piece_count=51935,
        template_source="server-fallback",
        template_tokens=25,
        template_reused_tokens=0,
        rendered_head="<|im_start|>user\n",
        rendered_tail="<|im_end|>\n<|im_start|>assistant\n",
        head_tokens=9,
        tail_tokens=16,
        checked_by="tokenize",
    )
    receipt = msgspec.structs.replace(
        _receipt("new-overlap", 89.43, (5.0,)), chat_template=template
    )
    lines = workload_sections([WorkloadView("w.json", receipt)], {})
    (line,) = [text for text in lines if text.startswith("Chat template:")]
    assert "the server's fallback (the GGUF carries none: llama-server applies ChatML)" in line
    assert "the model's own word tokens (51935 that tokenize back joined)" in line
    assert '`"<|im_start|>user\\n"` + message + `"<|im_end|>\\n<|im_start|>assistant\\n"`' in line
    assert "(9 + 16 tokens)" in line and "25 prompt tokens around each message" in line
    # Without a template record (a native cell, or a receipt from before), no such line.
    plain = workload_sections([WorkloadView("w.json", _receipt("new-overlap", 1.0, (5.0,)))], {})
    assert not [text for text in plain if text.startswith("Chat template:")]
