"""``run --rows`` / ``--shard`` / ``--dry-run``: one row (or one shard) of a prepared input.

The pure part (row keys, rendezvous shards, the scheduler's index) is checked with plain data
and Hypothesis; the command is a real ``cache-family run`` process against the FAKE llama-server
(``fake_run_llama_server.py``) of ``test_run_budgets.make_prepared``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from run_harness import make_prepared

from cache_family.actors.audit.replay import replay
from cache_family.errors import Refused
from cache_family.schemas.journal import RowsSelected, RunStarted, read_journal
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.states.selection import (
    Shard,
    parse_shard,
    plan_keys,
    row_key,
    select_rows,
    shard_of,
)
from cache_family.system.host_load import NODE_ID_ENV, NODE_LABELS_ENV, observe_host

CLI = Path(sys.executable).parent / "cache-family"
ENV = {"PATH": "/usr/bin:/bin"}

keys_strategy = st.lists(
    st.text(alphabet="abcdefgh_/0123456789", min_size=1, max_size=12), unique=True, max_size=40
)


# --- the pure part --------------------------------------------------------------------------


def test_a_row_key_names_case_use_case_and_prefix() -> None:
    assert row_key("qwen3_dense", None, 512) == "qwen3_dense/none/512"
    assert row_key("llama", "coding", 64) == "llama/coding/64"


@settings(max_examples=200, deadline=None)
@given(keys=keys_strategy, count=st.integers(min_value=1, max_value=9))
def test_shards_0_to_n_minus_1_cover_every_row_exactly_once(keys: list[str], count: int) -> None:
    plan = {key: index for index, key in enumerate(keys)}
    seen: list[str] = []
    for index in range(count):
        selection = select_rows(plan, shard=Shard(index, count))
        # Each shard keeps plan order.
        assert list(selection.row_keys) == sorted(selection.row_keys, key=plan.__getitem__)
        seen.extend(selection.row_keys)
    assert sorted(seen) == sorted(keys)


@settings(max_examples=100, deadline=None)
@given(keys=keys_strategy, added=keys_strategy, count=st.integers(min_value=1, max_value=9))
def test_adding_rows_to_the_plan_moves_no_other_row(
    keys: list[str], added: list[str], count: int
) -> None:
    before = {key: shard_of(key, count) for key in keys}
    grown = list(dict.fromkeys([*keys, *added]))
    plan = {key: index for index, key in enumerate(grown)}
    after = {
        key: index
        for index in range(count)
        for key in select_rows(plan, shard=Shard(index, count)).row_keys
    }
    assert {key: after[key] for key in keys} == before


def test_unknown_and_repeated_row_keys_are_refused_with_their_codes() -> None:
    plan = {"a/none/1": 0, "b/none/1": 1}
    with pytest.raises(Refused) as refused:
        select_rows(plan, rows=["b/none/1", "nope", "b/none/1"])
    assert refused.value.codes == ["run.rows.unknown", "run.rows.repeated"]
    assert select_rows(plan, rows=["b/none/1", "a/none/1"]).row_keys == ("a/none/1", "b/none/1")


def test_a_plan_with_two_rows_of_one_key_is_refused() -> None:
    with pytest.raises(Refused) as refused:
        plan_keys([(0, "a/none/1"), (1, "a/none/1")])
    assert refused.value.codes == ["run.rows.ambiguous_key"]


def test_auto_shard_reads_the_schedulers_index() -> None:
    assert parse_shard("auto/3", {"SLURM_ARRAY_TASK_ID": "2"}) == Shard(2, 3)
    assert parse_shard("auto/3", {"JOB_COMPLETION_INDEX": "0"}) == Shard(0, 3)
    # A Slurm array numbered from 1: its first task is shard 0.
    assert parse_shard(
        "auto/3", {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1"}
    ) == Shard(2, 3)
    assert parse_shard("1/4", {}) == Shard(1, 4)


@pytest.mark.parametrize(
    ("text", "environ", "code"),
    [
        ("auto/3", {}, "run.shard.no_index"),
        ("auto/3", {"SLURM_ARRAY_TASK_ID": "x"}, "run.shard.no_index"),
        ("auto/3", {"SLURM_ARRAY_TASK_ID": "1", "JOB_COMPLETION_INDEX": "2"}, "run.shard.no_index"),
        ("auto/3", {"JOB_COMPLETION_INDEX": "3"}, "run.shard.out_of_range"),
        ("3/3", {}, "run.shard.out_of_range"),
        ("1/0", {}, "run.shard.malformed"),
        ("-1/3", {}, "run.shard.malformed"),
        ("1", {}, "run.shard.malformed"),
    ],
)
def test_a_shard_without_a_valid_index_is_refused(
    text: str, environ: dict[str, str], code: str
) -> None:
    with pytest.raises(Refused) as refused:
        parse_shard(text, environ)
    assert refused.value.codes == [code]


# --- the command ----------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args],
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two prefixes of every packaged case; only qwen3_dense has a model in the fixture hub,
    # so every other row is a cheap missing-model row.
    return make_prepared(tmp_path_factory.mktemp("prep") / "p", prefix_sweep=[16, 32])


def test_dry_run_lists_a_shards_rows_and_the_shards_cover_the_plan(prepared: Path) -> None:
    everything = cli("run", "--input", str(prepared), "--dry-run")
    assert everything.returncode == 0, everything.stderr
    plan = everything.stdout.split()
    assert "qwen3_dense/none/16" in plan and len(plan) == len(set(plan))
    shards = [
        cli("run", "--input", str(prepared), "--dry-run", "--shard", f"{i}/3") for i in (0, 1, 2)
    ]
    assert all(shard.returncode == 0 for shard in shards)
    assert sorted(key for shard in shards for key in shard.stdout.split()) == sorted(plan)
    auto = cli(
        "run", "--input", str(prepared), "--dry-run", "--shard", "auto/3",
        env={"SLURM_ARRAY_TASK_ID": "1"},
    )  # fmt: skip
    assert auto.stdout == shards[1].stdout
    missing = cli("run", "--input", str(prepared), "--dry-run", "--shard", "auto/3")
    assert missing.returncode == 2 and "run.shard.no_index" in missing.stderr


def test_one_row_runs_alone_journals_its_selection_and_replays(
    prepared: Path, tmp_path: Path
) -> None:
    out = tmp_path / "one"
    done = cli(
        "run", "--input", str(prepared), "--output", str(out), "--quiet",
        "--rows", "qwen3_dense/none/16,llama/none/32",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    read = read_journal((out / "journal.jsonl").read_bytes())
    records = [line.record for line in read.lines]
    started, selected = records[0], records[1]
    assert isinstance(started, RunStarted) and isinstance(selected, RowsSelected)
    assert selected.prepared_sha256 == started.request_sha256
    assert selected.how == "rows"
    assert selected.host is not None and selected.host.hostname == socket.gethostname()
    assert selected.row_keys == ("qwen3_dense/none/16", "llama/none/32")
    ran = {(brief.case, brief.prefix_tokens) for brief in started.planned_rows}
    assert ran == {("qwen3_dense", 16), ("llama", 32)}
    # The journal alone still names the whole plan.
    everything = cli("run", "--input", str(prepared), "--dry-run").stdout.split()
    assert len(started.planned_rows) + len(selected.unselected_rows) == len(everything)
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed"
    assert [(row.case, row.result.status) for row in matrix.rows] == [
        ("qwen3_dense", "completed"),
        ("llama", "missing-model"),
    ]
    # The row keeps its plan index (and so its directory name).
    assert matrix.rows[0].index == 0 and (out / "cell-0000" / "row.json").is_file()
    assert replay(str(out)).exit_code == 0


def test_a_run_without_rows_journals_exactly_as_before(prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "whole"
    done = cli("run", "--input", str(prepared), "--output", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    records = [line.record for line in read_journal((out / "journal.jsonl").read_bytes()).lines]
    assert not any(isinstance(record, RowsSelected) for record in records)
    started = records[0]
    assert isinstance(started, RunStarted)
    assert len(started.planned_rows) == len(
        cli("run", "--input", str(prepared), "--dry-run").stdout.split()
    )


def test_unknown_row_keys_refuse_before_anything_is_written(prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "never"
    refused = cli("run", "--input", str(prepared), "--output", str(out), "--rows", "nope/none/1")
    assert refused.returncode == 2
    assert "run.rows.unknown" in refused.stderr
    assert not out.exists()


def test_the_host_is_observed_from_the_schedulers_variables_and_the_driver(
    tmp_path: Path,
) -> None:
    gpu = tmp_path / "gpus" / "0000:01:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 42\n")
    host = observe_host(
        {NODE_ID_ENV: "abc123", NODE_LABELS_ENV: "cf.host=big, zone=a"},
        gpu_info=str(tmp_path / "gpus" / "*" / "information"),
    )
    assert host.hostname == socket.gethostname()
    assert host.node_id == "abc123"
    assert host.labels == {"cf.host": "big", "zone": "a"}
    assert host.gpus == ("NVIDIA H100 80GB HBM3",)
    bare = observe_host({}, gpu_info=str(tmp_path / "none" / "*"))
    assert (bare.node_id, bare.labels, bare.gpus) == (None, {}, ())
