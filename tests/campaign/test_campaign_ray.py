"""``cache-family campaign --ray local``: a real Ray cluster of separated test hosts.

Few and bounded (the CI machine has 2 cores): each test starts one cluster of two one-CPU nodes,
each in its own network namespace with its own work directory, joined to the head over a bridge
inside the driver's namespace, which has no link out (root only); rows come back through the
object store. Rows are those of the FAKE llama-server of ``run_harness.make_prepared`` (a
qwen3_dense row that launches hosts, cheap missing-model llama rows). Signals are sent at
moments the FAKE host reports through a FIFO or the driver says a row arrived; after each test
no process is left in any of the cluster's namespaces and its work directories are gone.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from run_harness import make_prepared
from signal_harness import Fifo, behave, wait_exit

from cache_family.actors.campaign.local_cluster import processes_in
from cache_family.schemas.campaign import CAMPAIGN_JOURNAL, RowArrived, ShardMerged, read_campaign
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="--ray local needs root for its namespace"),
]

CLI = Path(sys.executable).parent / "cache-family"
BRIDGE_NET = ipaddress.ip_network("10.213.0.0/24")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # Short: Ray's unix sockets must fit in 107 bytes (the driver links to its session dir,
    # but the campaign's rows and logs read better under a short root too).
    path = Path(tempfile.mkdtemp(prefix="cfr-"))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def prepared_pair(root: Path) -> Path:
    return make_prepared(root / "p", prefix_sweep=[16, 32], cases=["qwen3_dense", "llama"])


def placement(root: Path) -> Path:
    path = root / "placement.json"
    path.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "rules": [
                    {"preset": "qwen3_dense", "labels": {"cf.host": "host-1"}},
                    {"family": "Llama", "labels": {"cf.host": "host-0"}},
                ],
            }
        )
    )
    return path


def campaign_argv(prepared: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(CLI), "campaign", "--input", str(prepared), "--output", str(out),
        "--ray", "local", "--hosts", "2", *extra,
    ]  # fmt: skip


def processes_naming(path: Path) -> list[int]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(str(path) in part for part in process.info["cmdline"] or ()):
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


def arrivals(out: Path) -> list[RowArrived]:
    read = read_campaign((out / CAMPAIGN_JOURNAL).read_bytes())
    assert read.problem is None
    return [line.record for line in read.lines if isinstance(line.record, RowArrived)]


def ip_of(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host = ipaddress.ip_address(address.rsplit(":", 1)[0])
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
        return host.ipv4_mapped
    return host


def private(address: str) -> bool:
    host = ip_of(address)
    return host.is_loopback or host.is_unspecified or host in BRIDGE_NET


def assert_separated(evidence: dict[str, Any], hosts: int) -> None:
    head = evidence["head"]
    assert sorted(head["interfaces"]) == sorted(
        ["lo", "cf-br0", *(f"cf-b{i}" for i in range(hosts))]
    )
    nodes = evidence["nodes"]
    assert [n["label"] for n in nodes] == [f"host-{i}" for i in range(hosts)]
    assert len({n["netns"] for n in nodes}) == hosts
    assert len({n["work_dir"] for n in nodes}) == hosts
    for index, node in enumerate(nodes):
        assert sorted(node["interfaces"]) == ["cf-h" + str(index), "lo"]
        assert node["address"] == f"10.213.0.{10 + index}"
        assert node["listening"], node
    for where in (head, *nodes):
        assert not any(route.startswith("0.0.0.0/0") for route in where["routes"]), where
        beyond = [s for s in where["tcp"] if not (private(s["local"]) and private(s["remote"]))]
        assert beyond == []
    # Some node talked to the head over the bridge.
    head_ip = ipaddress.ip_address("10.213.0.1")
    assert any(ip_of(s["remote"]) == head_ip for n in nodes for s in n["tcp"]), nodes


def nothing_left(evidence: dict[str, Any]) -> list[int]:
    """Every process still inside one of the cluster's namespaces (none may be)."""
    namespaces = {int(h["netns"]) for h in evidence["holders"]} | {
        int(n["netns"]) for n in evidence["nodes"]
    }
    left = [p.pid for p in processes_in(namespaces, float(evidence["started_at"]))]
    assert not Path(evidence["work_root"]).exists()
    assert not Path(evidence["session_link"]).parent.exists()
    return left


def shard_records(out: Path) -> list[ShardMerged]:
    read = read_campaign((out / CAMPAIGN_JOURNAL).read_bytes())
    assert read.problem is None
    return [line.record for line in read.lines if isinstance(line.record, ShardMerged)]


def test_rows_land_on_their_labelled_nodes_on_loopback_and_the_campaign_replays(
    short_tmp: Path,
) -> None:
    prepared = prepared_pair(short_tmp)
    out = short_tmp / "c"
    done = subprocess.run(
        campaign_argv(prepared, out, "--placement", str(placement(short_tmp))),
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"completed: {out / MATRIX_FILENAME}" in done.stdout
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert [row.result.status for row in matrix.rows] == [
        "completed", "missing-model", "completed", "missing-model",
    ]  # fmt: skip
    # Each row ran on the node its placement names, once (one run directory per row).
    for record in shard_records(out):
        (key,) = record.row_keys
        want = "host-1" if key.startswith("qwen3_dense/") else "host-0"
        assert record.host is not None and record.host.labels == {"cf.host": want}, key
        assert record.host.node_id
    assert sorted(p.name for p in (out / "rows").iterdir() if p.is_dir()) == [
        "row-0000", "row-0001", "row-0002", "row-0003",
    ]  # fmt: skip
    # Each row came back through the object store, journaled as it arrived.
    arrived = arrivals(out)
    assert sorted(r.row_key for r in arrived) == sorted(r.row_keys[0] for r in shard_records(out))
    assert {r.how for r in arrived} == {"object-store"}
    # Separated hosts: each node alone in its namespace with its own address, joined to the
    # head only over the bridge; no namespace has a default route or a socket beyond them.
    evidence = json.loads((out / "local-cluster.json").read_text())
    assert_separated(evidence, hosts=2)
    # Ray's session directories are the campaign's; nothing of the cluster is left running.
    assert any(p.name.startswith("session_") for p in (out / "ray").iterdir())
    assert processes_naming(out) == []
    assert nothing_left(evidence) == []
    replayed = subprocess.run(
        [str(CLI), "replay", str(out)], capture_output=True, text=True, check=False
    )
    assert replayed.returncode == 0, replayed.stdout
    assert "replay: campaign identical" in replayed.stdout


async def test_sigint_mid_ladder_cancels_every_row_leaves_no_process_and_resume_finishes(
    short_tmp: Path,
) -> None:
    prepared = prepared_pair(short_tmp)
    fifo = Fifo(short_tmp / "notify")
    behave(prepared, stream_delay=3600, notify_fifo=str(fifo.path))
    out = short_tmp / "c"
    with open(short_tmp / "driver.log", "wb") as log:
        driver = await trio.lowlevel.open_process(
            campaign_argv(prepared, out),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin"},
        )
    try:
        event, host_pid = (await fifo.next_line()).split()
        assert event == "stream"  # a qwen3_dense row's ladder is in its host
        driver.send_signal(signal.SIGINT)
        code = await wait_exit(driver)
    finally:
        fifo.close()
        if driver.returncode is None:
            driver.kill()
    assert code == 130, (short_tmp / "driver.log").read_text()[-4000:]
    assert not psutil.pid_exists(int(host_pid)) or psutil.Process(int(host_pid)).status() == (
        psutil.STATUS_ZOMBIE
    )
    assert processes_naming(out) == []
    first_cluster = json.loads((out / "local-cluster.json").read_text())
    assert nothing_left(first_cluster) == []
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "incomplete"
    statuses = {row.index: row.result for row in matrix.rows}
    # The row in its ladder sealed as cancelled; no qwen3_dense row completed.
    assert statuses[0].status == "incomplete" or statuses[2].status == "incomplete"
    assert all(statuses[i].status != "completed" for i in (0, 2))

    # --resume runs only the rows without a finished run; the finished ones are kept as they are.
    kept = {
        name: (out / "rows" / name / "journal.jsonl").read_bytes()
        for name in ("row-0001", "row-0003")
        if (out / "rows" / name / "journal.jsonl").is_file()
    }
    behave(prepared)  # the FAKE host answers at once now
    resumed = subprocess.run(
        [str(CLI), "campaign", "--resume", str(out), "--ray", "local", "--hosts", "2"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-4000:]
    assert f"{len(kept)} row(s) kept" in resumed.stdout
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed"
    for name, journal in kept.items():
        assert (out / "rows" / name / "journal.jsonl").read_bytes() == journal
    assert (out / "superseded" / "1" / CAMPAIGN_JOURNAL).is_file()
    assert processes_naming(out) == []
    assert nothing_left(json.loads((out / "local-cluster.json").read_text())) == []
    assert subprocess.run([str(CLI), "replay", str(out)], check=False).returncode == 0


def node_of(host_pid: int) -> tuple[psutil.Process, psutil.Process]:
    """The Ray worker running the host's row and that node's raylet (ancestors of the host:
    host <- the row's run <- the task's worker <- the raylet)."""
    ancestors = psutil.Process(host_pid).parents()
    worker = next(
        p for p in ancestors if "_on_node" in " ".join(p.cmdline()) or "ray::" in p.name()
    )
    raylet = next(p for p in ancestors if "raylet" in p.name())
    return worker, raylet


async def test_a_node_lost_mid_row_makes_the_row_host_lost_never_run_twice(
    short_tmp: Path,
) -> None:
    prepared = make_prepared(short_tmp / "p", prefix_sweep=[16], cases=["qwen3_dense", "llama"])
    rules = short_tmp / "placement.json"
    rules.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "rules": [
                    {"row": "qwen3_dense/none/16", "labels": {"cf.host": "host-1"}},
                    {"row": "llama/none/16", "labels": {"cf.host": "host-0"}},
                ],
            }
        )
    )
    fifo = Fifo(short_tmp / "notify")
    behave(prepared, stream_delay=3600, notify_fifo=str(fifo.path))
    out = short_tmp / "c"
    with open(short_tmp / "driver.log", "wb") as log:
        driver = await trio.lowlevel.open_process(
            campaign_argv(prepared, out, "--placement", str(rules)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin"},
        )
    try:
        event, host_pid = (await fifo.next_line()).split()
        assert event == "stream"
        worker, raylet = node_of(int(host_pid))
        # The node goes away as a lost host does: its raylet and the row's worker die at once.
        raylet.kill()
        worker.kill()
        code = await wait_exit(driver)
    finally:
        fifo.close()
        if driver.returncode is None:
            driver.kill()
    assert code == 1, (short_tmp / "driver.log").read_text()[-4000:]
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "incomplete"
    lost = next(row for row in matrix.rows if row.case == "qwen3_dense")
    assert (lost.result.status, lost.result.reason) == ("incomplete", "host.lost")
    # Never run twice, never placed: its node was lost before the row came back.
    assert "row-0000" not in [p.name for p in (out / "rows").iterdir()]
    assert all("qwen3_dense/none/16" not in r.row_keys for r in shard_records(out))
    # The row's orphaned run (and its host) were ended with the campaign.
    assert processes_naming(out) == []
    assert nothing_left(json.loads((out / "local-cluster.json").read_text())) == []
    assert subprocess.run([str(CLI), "replay", str(out)], check=False).returncode == 0


async def arrivals_said(driver: trio.Process, wanted: int) -> list[str]:
    """The driver's own "row arrived" lines, read from its output until ``wanted`` came."""
    assert driver.stdout is not None
    said: list[str] = []
    buffer = b""
    with trio.fail_after(600):
        while len(said) < wanted:
            chunk = await driver.stdout.receive_some(4096)
            assert chunk, "the driver ended before its rows arrived"
            buffer += chunk
            *lines, rest = buffer.split(b"\n")
            buffer = rest
            said += [line.decode() for line in lines if line.startswith(b"row arrived: ")]
    return said


async def test_a_driver_killed_outright_leaves_a_journal_that_resume_continues(
    short_tmp: Path,
) -> None:
    prepared = prepared_pair(short_tmp)
    fifo = Fifo(short_tmp / "notify")
    behave(prepared, stream_delay=3600, notify_fifo=str(fifo.path))
    out = short_tmp / "c"
    driver = await trio.lowlevel.open_process(
        campaign_argv(prepared, out, "--placement", str(placement(short_tmp))),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"},
    )
    try:
        # The llama rows (host-0) arrive; a qwen3_dense row (host-1) is in its ladder.
        said = await arrivals_said(driver, 2)
        event, _ = (await fifo.next_line()).split()
        assert event == "stream"
        driver.kill()
        assert await wait_exit(driver) == -signal.SIGKILL
    finally:
        fifo.close()
        if driver.returncode is None:
            driver.kill()
    llama = ["llama/none/16", "llama/none/32"]
    assert sorted(line.split()[2] for line in said) == llama
    # Every arrival is on disk, the journal unsealed; replay names the rows still missing.
    left_journal = (out / CAMPAIGN_JOURNAL).read_bytes()
    read = read_campaign(left_journal)
    assert read.problem is None
    assert sorted(r.row_key for r in arrivals(out)) == llama
    replayed = subprocess.run(
        [str(CLI), "replay", str(out)], capture_output=True, text=True, check=False
    )
    assert replayed.returncode == 1, replayed.stdout
    assert "replay: campaign incomplete" in replayed.stdout
    assert "missing: qwen3_dense/none/16, qwen3_dense/none/32" in replayed.stdout
    # The killed driver's cluster is still running (resume ends it first).
    killed_cluster = json.loads((out / "local-cluster.json").read_text())
    namespaces = {int(h["netns"]) for h in killed_cluster["holders"]}
    assert processes_in(namespaces, float(killed_cluster["started_at"]))
    kept = {name: (out / "rows" / name / "journal.jsonl").read_bytes() for name in
            ("row-0001", "row-0003")}  # fmt: skip

    behave(prepared)  # the FAKE host answers at once now
    resumed = subprocess.run(
        [str(CLI), "campaign", "--resume", str(out), "--ray", "local", "--hosts", "2"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-4000:]
    assert "2 row(s) kept, 2 to run again" in resumed.stdout
    assert "local cluster left" in resumed.stdout
    # The chain goes on from the last line the killed driver wrote: one journal, no rerun.
    journal = (out / CAMPAIGN_JOURNAL).read_bytes()
    assert journal.startswith(left_journal)
    assert read_campaign(journal).problem is None
    assert sorted(r.row_key for r in arrivals(out)) == sorted(
        [*llama, "qwen3_dense/none/16", "qwen3_dense/none/32"]
    )
    for name, row_journal in kept.items():
        assert (out / "rows" / name / "journal.jsonl").read_bytes() == row_journal
    assert decode_matrix((out / MATRIX_FILENAME).read_bytes()).status == "completed"
    assert nothing_left(killed_cluster) == []
    assert nothing_left(json.loads((out / "local-cluster.json").read_text())) == []
    replayed = subprocess.run(
        [str(CLI), "replay", str(out)], capture_output=True, text=True, check=False
    )
    assert replayed.returncode == 0, replayed.stdout
    assert "replay: campaign identical" in replayed.stdout


# The driver's own entry with a chunk size far below a row's bytes (the CLI keeps 8 MiB), in
# its own process as the CLI's would be (it enters a network namespace).
CAMPAIGN_IN_SMALL_CHUNKS = """
import json, sys
from cache_family.actors.campaign import ray_driver
result = ray_driver.run_campaign(sys.argv[1], sys.argv[2], "local", hosts=2, chunk_bytes=4096)
print(json.dumps({"code": int(result.code), "status": result.outcome.status}))
"""


def test_rows_larger_than_the_chunk_size_come_back_whole_through_the_object_store(
    short_tmp: Path,
) -> None:
    prepared = make_prepared(short_tmp / "p", prefix_sweep=[16], cases=["qwen3_dense", "llama"])
    out = short_tmp / "c"
    done = subprocess.run(
        [sys.executable, "-c", CAMPAIGN_IN_SMALL_CHUNKS, str(prepared), str(out)],
        env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 0, "status": "completed"}
    arrived = arrivals(out)
    assert sorted(r.row_key for r in arrived) == ["llama/none/16", "qwen3_dense/none/16"]
    # Every row spanned several chunks, and arrived whole (its replay is the merge's).
    assert all(r.how == "object-store" and r.size > 2 * 4096 for r in arrived)
    assert nothing_left(json.loads((out / "local-cluster.json").read_text())) == []
    replayed = subprocess.run(
        [str(CLI), "replay", str(out)], capture_output=True, text=True, check=False
    )
    assert replayed.returncode == 0, replayed.stdout


def test_a_shared_output_stays_possible(short_tmp: Path) -> None:
    prepared = make_prepared(short_tmp / "p", prefix_sweep=[16], cases=["qwen3_dense", "llama"])
    out = short_tmp / "c"
    done = subprocess.run(
        [*campaign_argv(prepared, out), "--row-return", "shared-output"],
        env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    arrived = arrivals(out)
    assert sorted(r.row_key for r in arrived) == ["llama/none/16", "qwen3_dense/none/16"]
    assert {r.how for r in arrived} == {"shared-output"}
    # The nodes wrote the rows and their logs straight into the campaign's rows/.
    assert (out / "rows" / "row-0000.log").stat().st_size > 0
    assert nothing_left(json.loads((out / "local-cluster.json").read_text())) == []
    assert subprocess.run([str(CLI), "replay", str(out)], check=False).returncode == 0
