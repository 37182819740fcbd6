"""Server metrics: recorded expositions of llama.cpp, vLLM and SGLang (labelled facts in
``tests/fixtures/server_metrics/facts.json``) parse to the token totals each server means;
malformed and oversized ones are refused with their codes; the verdict sets the server's
totals beside the client's sums and flags a disagreement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cell_journal_builder import CellScript
from fold_journals import journal

from cache_family.errors import Refused
from cache_family.schemas.journal import ServerMetricsRead
from cache_family.schemas.receipts import encode_receipt
from cache_family.schemas.refusal_codes import SERVER_METRICS_REFUSAL_CODES
from cache_family.schemas.server_metrics import CounterDelta, ServerMetricsVerdict, TokenSums
from cache_family.states.fold import fold_cell
from cache_family.states.server_metrics import (
    COUNTER_SAMPLES_MAX,
    EXPOSITION_MAX_BYTES,
    counter_deltas,
    metrics_verdict,
    parse_counters,
    token_totals,
    verdict_of,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "server_metrics"
FACTS: dict[str, Any] = json.loads((FIXTURES / "facts.json").read_text())


def _read(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def _refused_code(data: bytes) -> str:
    with pytest.raises(Refused) as caught:
        parse_counters(data)
    (code,) = caught.value.codes
    assert caught.value.refusals[0].hint == SERVER_METRICS_REFUSAL_CODES[code].hint
    return code


@pytest.mark.parametrize("fact", FACTS["pairs"], ids=[p["server"] for p in FACTS["pairs"]])
def test_a_recorded_pair_reads_as_its_server_means_it(fact: dict[str, Any]) -> None:
    deltas = counter_deltas(
        parse_counters(_read(fact["before"])), parse_counters(_read(fact["after"]))
    )
    totals = token_totals(deltas)
    assert totals is not None, fact["label"]
    assert totals.server == fact["server"]
    assert totals.prompt_tokens == fact["prompt_tokens"], fact["label"]
    assert totals.cached_tokens == fact["cached_tokens"], fact["label"]
    assert totals.predicted_tokens == fact["predicted_tokens"], fact["label"]
    assert [list(pair) for pair in totals.cached_by_source] == fact["cached_by_source"]


def test_gauges_and_created_timestamps_are_not_counters() -> None:
    counters = parse_counters(_read("vllm-before.prom"))
    names = {name for name, _labels in counters}
    assert "vllm:num_requests_running" not in names
    assert "vllm:gpu_prefix_cache_hit_rate" not in names
    assert not any(name.endswith("_created") for name in names)
    assert ("vllm:prefix_cache_hits_total", (("engine", "0"), ("model_name", "facts/model"))) in (
        counters
    )


def test_the_captured_llama_exposition_names_every_counter_the_mapping_reads() -> None:
    counters = parse_counters(_read("llamacpp-after-two-requests.prom"))
    assert counters[("llamacpp:prompt_tokens_total", ())] == 23
    assert counters[("llamacpp:prompt_tokens_cached_total", ())] == 21
    assert counters[("llamacpp:tokens_predicted_total", ())] == 4
    # A gauge of the same exposition is never read as an interval's figure.
    assert ("llamacpp:prompt_tokens_seconds", ()) not in counters


@pytest.mark.parametrize("fact", FACTS["refused"], ids=[f["file"] for f in FACTS["refused"]])
def test_a_malformed_exposition_is_refused_with_its_code(fact: dict[str, Any]) -> None:
    assert _refused_code(_read(fact["file"])) == fact["code"], fact["label"]


def test_an_oversized_exposition_is_refused_unparsed() -> None:
    captured = _read("llamacpp-after-two-requests.prom")
    padding = b"# padding comment line of an exposition far past the cap\n"
    oversized = captured + padding * (EXPOSITION_MAX_BYTES // len(padding) + 1)
    assert len(oversized) > EXPOSITION_MAX_BYTES
    assert _refused_code(oversized) == "server_metrics.oversized"
    # The same exposition under the cap parses.
    assert parse_counters(captured + padding * 10)


def test_more_counter_samples_than_are_kept_is_refused() -> None:
    lines = ["# TYPE many_total counter"]
    lines += [f'many_total{{n="{n}"}} {n}' for n in range(COUNTER_SAMPLES_MAX + 1)]
    data = ("\n".join(lines) + "\n").encode()
    assert len(data) < EXPOSITION_MAX_BYTES
    assert _refused_code(data) == "server_metrics.oversized"
    assert len(parse_counters(("\n".join(lines[:-1]) + "\n").encode())) == COUNTER_SAMPLES_MAX


def test_a_counter_that_went_down_or_vanished_is_a_reset() -> None:
    after = parse_counters(_read("llamacpp-after-two-requests.prom"))
    fresh = parse_counters(_read("llamacpp-fresh.prom"))
    with pytest.raises(Refused) as down:
        counter_deltas(after, fresh)
    assert down.value.codes == ["server_metrics.counter_reset"]
    assert "llamacpp:prompt_tokens_total" in str(down.value)
    with pytest.raises(Refused) as vanished:
        counter_deltas(
            parse_counters(_read("sglang-after.prom")), parse_counters(_read("sglang-before.prom"))
        )
    assert vanished.value.codes == ["server_metrics.counter_reset"]


def test_an_exposition_of_no_known_server_gives_no_totals() -> None:
    data = b"# TYPE http_requests_total counter\nhttp_requests_total 7\n"
    deltas = counter_deltas({}, parse_counters(data))
    assert deltas == (CounterDelta(name="http_requests_total", delta=7.0),)
    assert token_totals(deltas) is None
    verdict = metrics_verdict(
        "read", reason=None, refusal_code=None, counters=deltas, client=TokenSums()
    )
    assert verdict.server is None and verdict.agreement == "incomparable"


def _llama_deltas() -> tuple[CounterDelta, ...]:
    return counter_deltas(
        parse_counters(_read("llamacpp-fresh.prom")),
        parse_counters(_read("llamacpp-after-two-requests.prom")),
    )


def test_the_verdict_agrees_when_the_client_sums_what_the_server_counted() -> None:
    # The captured pair's two requests as the client saw them: 22 + 22 prompt tokens, 0 + 21
    # cached, 2 + 2 generated.
    client = TokenSums(accounted=2, prompt_tokens=44, cached_tokens=21, predicted_tokens=4)
    record = ServerMetricsRead(
        cell_id="c", scope="rung", index=0, status="read", counters=_llama_deltas(), client=client
    )
    verdict = verdict_of(record)
    assert verdict.agreement == "agrees" and verdict.disagreeing == ()
    assert verdict.server is not None and verdict.server.cached_tokens == 21
    assert verdict.client == client


def test_the_verdict_flags_each_figure_that_disagrees() -> None:
    client = TokenSums(accounted=2, prompt_tokens=44, cached_tokens=42, predicted_tokens=5)
    verdict = metrics_verdict(
        "read", reason=None, refusal_code=None, counters=_llama_deltas(), client=client
    )
    assert verdict.agreement == "disagrees"
    assert verdict.disagreeing == ("cached_tokens", "predicted_tokens")


def test_requests_without_their_accounting_make_the_verdict_incomparable() -> None:
    client = TokenSums(accounted=1, unaccounted=1, prompt_tokens=22, cached_tokens=0)
    verdict = metrics_verdict(
        "read", reason=None, refusal_code=None, counters=_llama_deltas(), client=client
    )
    assert verdict.agreement == "incomparable" and verdict.server is not None


def test_a_host_without_metrics_says_so_and_nothing_is_guessed() -> None:
    record = ServerMetricsRead(
        cell_id="c",
        scope="rung",
        index=1,
        status="none",
        reason="this host kind serves no /metrics",
        client=TokenSums(accounted=3, prompt_tokens=30, cached_tokens=20),
    )
    verdict = verdict_of(record)
    assert verdict.status == "none" and verdict.reason == "this host kind serves no /metrics"
    assert verdict.server is None and verdict.agreement is None


# --- the receipts -------------------------------------------------------------------------------


def _rung_read(index: int, client: TokenSums) -> ServerMetricsRead:
    return ServerMetricsRead(
        cell_id=CellScript().cell_id,
        scope="rung",
        index=index,
        status="read",
        path="/metrics",
        counters=_llama_deltas(),
        client=client,
    )


def test_the_cell_receipt_sets_the_server_totals_beside_each_rung_and_flags_a_disagreement() -> (
    None
):
    script = CellScript().happy()
    agreeing = TokenSums(accounted=2, prompt_tokens=44, cached_tokens=21, predicted_tokens=4)
    disagreeing = TokenSums(accounted=2, prompt_tokens=44, cached_tokens=40, predicted_tokens=4)
    lines = journal(*script.records, _rung_read(0, agreeing), _rung_read(1, disagreeing))
    receipt = fold_cell(lines, script.cell_id, rows=script.rows_source)
    first, second = receipt.measurement.rungs
    assert isinstance(first.server_metrics, ServerMetricsVerdict)
    assert first.server_metrics.agreement == "agrees"
    assert isinstance(second.server_metrics, ServerMetricsVerdict)
    assert second.server_metrics.agreement == "disagrees"
    assert second.server_metrics.disagreeing == ("cached_tokens",)
    assert receipt.measurement.server_metrics_disagreeing_rungs == (1,)
    # The disagreement is flagged, never hidden: the measurement itself stands.
    assert receipt.status == "completed"
    published = json.loads(encode_receipt(receipt))
    assert published["measurement"]["rungs"][1]["server_metrics"]["server"]["server"] == (
        "llama.cpp"
    )
    # Re-folding the same lines gives the same bytes (replay's comparison).
    again = fold_cell(lines, script.cell_id, rows=script.rows_source)
    assert encode_receipt(again) == encode_receipt(receipt)


def test_a_cell_without_reads_writes_no_server_metrics_at_all() -> None:
    script = CellScript().happy()
    published = json.loads(encode_receipt(fold_cell(journal(*script.records), script.cell_id)))
    assert all("server_metrics" not in rung for rung in published["measurement"]["rungs"])
    assert "server_metrics_disagreeing_rungs" not in published["measurement"]
