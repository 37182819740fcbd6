"""The OpenAI-compatible host declaration: each mistake refused with its own code and hint, the
command line filled in placeholder by placeholder, readiness by its line and its model."""

from __future__ import annotations

from typing import Any

import pytest

from cache_family.errors import Refused
from cache_family.schemas.measurement import CacheExpectation
from cache_family.schemas.openai_host import (
    OPENAI_HOST_REFUSAL_CODES,
    OpenAIReadiness,
    admit_serving,
    openai_argv,
)
from cache_family.states.cache_reuse import (
    CacheTallier,
    block_expectation,
    expected_cached_tokens,
    rule_text,
)


def declaration(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "schema_version": 1,
        "module": None,
        "args": ["--host", "{host}", "--port", "{port}", "--model", "{model}"],
        "dialects": ["completions", "chat"],
        "block_size": 16,
        "metrics_path": "/metrics",
        "listening_text": "listening on http://127.0.0.1:{port}",
    }
    document.update(changes)
    return document


MISTAKES = [
    ({"args": ["--port", "{port}", "--x", "{gpu}"]}, "openai_host.args.unknown_placeholder"),
    ({"args": ["--host", "{host}"]}, "openai_host.args.no_port"),
    ({"args": ["--host", "0.0.0.0", "--port", "{port}"]}, "openai_host.args.beyond_loopback"),
    ({"args": ["--host=::", "--port", "{port}"]}, "openai_host.args.beyond_loopback"),
    ({"dialects": []}, "openai_host.dialects.empty_or_repeated"),
    ({"dialects": ["chat", "chat"]}, "openai_host.dialects.empty_or_repeated"),
    ({"block_size": 0}, "openai_host.block_size.range"),
    ({"metrics_path": "metrics"}, "openai_host.metrics_path.not_absolute"),
    ({"listening_text": "Uvicorn running"}, "openai_host.listening_text.no_port"),
    ({"dialects": ["responses"]}, "openai_host.shape"),
    ({"block_size": "16"}, "openai_host.shape"),
    ({"extra": True}, "openai_host.shape"),
]


@pytest.mark.parametrize(("changes", "code"), MISTAKES)
def test_each_mistake_is_refused_with_its_code_and_hint(changes: dict[str, Any], code: str) -> None:
    with pytest.raises(Refused) as refused:
        admit_serving(declaration(**changes))
    assert code in refused.value.codes
    assert all(r.hint == OPENAI_HOST_REFUSAL_CODES[r.code].hint for r in refused.value.refusals)


def test_every_code_is_exercised() -> None:
    assert {code for _, code in MISTAKES} == set(OPENAI_HOST_REFUSAL_CODES)


def test_the_command_line_fills_only_the_placeholders() -> None:
    serving = admit_serving(
        declaration(
            module="vllm.entrypoints.openai.api_server",
            args=[
                "--host",
                "{host}",
                "--port={port}",
                "{model}",
                "--served-model-name",
                "{model_id}",
                "--max-num-seqs",
                "{lanes}",
                "--max-model-len",
                "{ctx_size}",
                '{"json": "kept"}',
            ],
        )
    )
    argv = openai_argv(
        serving, "/tree/bin/python", port=4100, model="/m", model_id="m", lanes=3, ctx_size=512
    )
    assert argv == [
        "/tree/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port=4100",
        "/m",
        "--served-model-name",
        "m",
        "--max-num-seqs",
        "3",
        "--max-model-len",
        "512",
        '{"json": "kept"}',
    ]
    assert serving.ladder_dialect == "completions"
    assert admit_serving(declaration(dialects=["chat"])).ladder_dialect == "chat"


def test_readiness_is_the_declared_line_then_the_model_listed() -> None:
    readiness = OpenAIReadiness("listening on http://127.0.0.1:{port}", "served")
    assert readiness.path == "/v1/models"
    assert readiness.is_listening_line("I srv listening on http://127.0.0.1:4100", 4100)
    assert not readiness.is_listening_line("I srv listening on http://127.0.0.1:4101", 4100)
    assert readiness.is_ready_answer({"object": "list", "data": [{"id": "served"}]})
    assert not readiness.is_ready_answer({"data": [{"id": "other"}]})


def test_the_block_rule_promises_whole_blocks_of_the_usable_prefix() -> None:
    def expected(prompt: int, common: int, block: int | None = 16) -> int:
        return expected_cached_tokens(
            "block", prompt_tokens=prompt, common_prefix=common, block_size=block
        )

    assert expected(71, 71) == 64  # 70 usable (all but the last token): four blocks
    assert expected(65, 65) == 64
    assert expected(64, 64) == 48  # 63 usable
    assert expected(200, 40) == 32
    assert expected(10, 10) == 0
    assert expected(71, 71, None) == 0
    expectation = block_expectation(16, 2)
    assert expectation == CacheExpectation(
        architecture=None, rule="block", n_ubatch=512, lanes=2, block_size=16
    )
    assert "blocks of 16 tokens" in rule_text(expectation)
    tallier = CacheTallier(expectation)
    assert tallier.block_size == 16
