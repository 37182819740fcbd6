"""File and tree pins: chunked hashing under a budget, completeness rules, parallel threads."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from pathlib import Path

import pytest

from cache_family.console.progress import BytesBar, NullProgress, bytes_progress_for
from cache_family.errors import Refused
from cache_family.system.hashing import CHUNK_BYTES
from cache_family.system.pins import (
    TREE_MAX_DEPTH,
    TREE_MAX_ENTRIES,
    Budget,
    HashJob,
    canonical_regular_file,
    hash_file,
    hash_files,
    pin_tree,
)


def unlimited() -> Budget:
    return Budget.seconds(3600.0)


class FakeClock:
    """A monotonic clock that a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingProgress:
    """Progress that only counts, thread-safely."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.files = 0
        self.total_bytes = 0
        self.done_bytes = 0
        self.began = 0
        self.ended = 0

    def begin(self, files: int, total_bytes: int) -> None:
        with self._lock:
            self.files += files
            self.total_bytes += total_bytes
            self.began += 1

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done_bytes += nbytes

    def end(self) -> None:
        with self._lock:
            self.ended += 1


class CancelAfter(CountingProgress):
    """Cancels the budget once ``limit`` bytes were hashed, as a signal handler would."""

    def __init__(self, budget: Budget, limit: int) -> None:
        super().__init__()
        self.budget = budget
        self.limit = limit

    def advance(self, nbytes: int) -> None:
        super().advance(nbytes)
        if self.done_bytes >= self.limit:
            self.budget.cancel()


class AdvanceClockAfter(CountingProgress):
    def __init__(self, clock: FakeClock, limit: int, seconds: float) -> None:
        super().__init__()
        self.clock = clock
        self.limit = limit
        self.seconds = seconds

    def advance(self, nbytes: int) -> None:
        super().advance(nbytes)
        if self.done_bytes >= self.limit:
            self.clock.now += self.seconds


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --- file pins -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, CHUNK_BYTES, CHUNK_BYTES * 2 + 12345])
def test_file_pin_is_sha256_of_the_bytes(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = write(tmp_path / "f.bin", data)
    progress = CountingProgress()
    pin = hash_file(str(path), unlimited(), progress=progress)
    assert pin.sha256 == hashlib.sha256(data).hexdigest()
    assert pin.size == size == progress.done_bytes


def test_cancel_stops_hashing_at_the_next_chunk(tmp_path: Path) -> None:
    path = write(tmp_path / "big.bin", b"\0" * (CHUNK_BYTES * 8))
    budget = unlimited()
    progress = CancelAfter(budget, CHUNK_BYTES)
    with pytest.raises(Refused) as caught:
        hash_file(str(path), budget, json_path="$.model", progress=progress)
    assert caught.value.codes == ["budget.cancelled"]
    assert caught.value.refusals[0].path == "$.model"
    assert progress.done_bytes == CHUNK_BYTES  # one chunk, then the guard said no


def test_cancel_before_open_reads_nothing(tmp_path: Path) -> None:
    path = write(tmp_path / "f.bin", b"x" * 10)
    budget = unlimited()
    budget.cancel()
    progress = CountingProgress()
    with pytest.raises(Refused) as caught:
        hash_file(str(path), budget, progress=progress)
    assert caught.value.codes == ["budget.cancelled"]
    assert progress.done_bytes == 0


def test_deadline_is_checked_between_chunks(tmp_path: Path) -> None:
    path = write(tmp_path / "big.bin", b"\1" * (CHUNK_BYTES * 4))
    clock = FakeClock()
    budget = Budget.seconds(10.0, clock=clock)
    progress = AdvanceClockAfter(clock, 2 * CHUNK_BYTES, 11.0)
    with pytest.raises(Refused) as caught:
        hash_file(str(path), budget, progress=progress)
    assert caught.value.codes == ["budget.deadline_expired"]
    assert progress.done_bytes == 2 * CHUNK_BYTES


def test_deadline_is_checked_after_the_last_chunk(tmp_path: Path) -> None:
    path = write(tmp_path / "small.bin", b"abc")
    clock = FakeClock()
    budget = Budget.seconds(1.0, clock=clock)
    with pytest.raises(Refused) as caught:
        hash_file(str(path), budget, progress=AdvanceClockAfter(clock, 1, 5.0))
    assert caught.value.codes == ["budget.deadline_expired"]


def test_canonical_regular_file_follows_links_to_the_bytes(tmp_path: Path) -> None:
    target = write(tmp_path / "blobs" / "abc", b"bytes")
    link = tmp_path / "snap" / "model.gguf"
    link.parent.mkdir()
    link.symlink_to("../blobs/abc")
    assert canonical_regular_file(str(link), what="model", json_path="$") == str(target)


def test_fifo_directory_missing_and_relative_tools_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "tool.fifo"
    os.mkfifo(fifo)
    cases = {
        str(fifo): "pin.not_regular",
        str(tmp_path): "pin.not_regular",
        str(tmp_path / "absent"): "pin.missing",
        "relative/tool": "pin.not_absolute",
    }
    for path, code in cases.items():
        with pytest.raises(Refused) as caught:
            canonical_regular_file(path, what="tool", json_path="$.correctness")
        assert caught.value.codes == [code], path
        assert caught.value.refusals[0].path == "$.correctness"


def test_hash_file_opens_with_the_bounded_readers_refusals(tmp_path: Path) -> None:
    """One way to open a regular file without following links, one set of codes."""
    fifo = tmp_path / "swap.fifo"
    os.mkfifo(fifo)  # no writer: a blocking open would hang forever
    link = tmp_path / "link"
    link.symlink_to(write(tmp_path / "target", b"bytes"))
    cases = {
        fifo: "file.not_regular",
        tmp_path: "file.not_regular",
        link: "file.symlink",
        tmp_path / "absent": "file.missing",
    }
    for path, code in cases.items():
        with pytest.raises(Refused) as caught:
            hash_file(str(path), unlimited(), json_path="$.x")
        assert caught.value.codes == [code], path
        assert caught.value.refusals[0].path == "$.x"


# --- parallel hashing ------------------------------------------------------------------------


class ThreadRecorder(CountingProgress):
    """Records which threads hashed; the first chunk of each thread waits at a barrier for
    ``parties`` threads, so only a pool that really runs that many files at once gets past it.

    The barrier turns "uses threads" into a guarantee rather than a scheduling accident: a
    loaded machine only delays the meeting, while a pool of one thread breaks the barrier.
    """

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(parties, timeout=60)

    def advance(self, nbytes: int) -> None:
        super().advance(nbytes)
        name = threading.current_thread().name
        with self._lock:
            first = name not in self.threads
            self.threads.add(name)
        if first:
            self._barrier.wait()


def test_parallel_hashing_keeps_job_order_and_uses_threads(tmp_path: Path) -> None:
    blobs = [os.urandom(CHUNK_BYTES * 3 + i) for i in range(3)]
    paths = [write(tmp_path / f"f{i}", data) for i, data in enumerate(blobs)]
    progress = ThreadRecorder(parties=2)
    pins = hash_files(
        [HashJob(str(p), f"$[{i}]") for i, p in enumerate(paths)],
        unlimited(),
        progress=progress,
        workers=2,
    )
    assert [p.sha256 for p in pins] == [hashlib.sha256(b).hexdigest() for b in blobs]
    assert progress.total_bytes == progress.done_bytes == sum(map(len, blobs))
    assert progress.began == progress.ended == 1
    # Both pool threads met at the barrier: two files were hashed at once, off the caller.
    assert len(progress.threads) == 2
    assert all(name.startswith("pin") for name in progress.threads)


def test_one_refused_file_stops_the_others_and_is_the_reported_reason(tmp_path: Path) -> None:
    big = write(tmp_path / "big", b"\0" * (CHUNK_BYTES * 64))
    progress = CountingProgress()
    with pytest.raises(Refused) as caught:
        hash_files(
            [HashJob(str(tmp_path / "absent"), "$.missing"), HashJob(str(big), "$.big")],
            unlimited(),
            progress=progress,
            workers=2,
        )
    assert caught.value.codes == ["file.missing"]
    assert caught.value.refusals[0].path == "$.missing"


def test_cancelling_parallel_hashing_refuses_every_thread_promptly(tmp_path: Path) -> None:
    paths = [write(tmp_path / f"f{i}", b"\0" * (CHUNK_BYTES * 32)) for i in range(2)]
    budget = unlimited()
    progress = CancelAfter(budget, CHUNK_BYTES)
    with pytest.raises(Refused) as caught:
        hash_files(
            [HashJob(str(p), f"$[{i}]") for i, p in enumerate(paths)],
            budget,
            progress=progress,
            workers=2,
        )
    assert caught.value.codes == ["budget.cancelled"]
    # each thread reads at most one chunk past the cancellation
    assert progress.done_bytes <= 4 * CHUNK_BYTES


# --- tree pins -------------------------------------------------------------------------------


def spec_tree_pin(entries: dict[str, bytes]) -> str:
    """The reference tree pin written out longhand from its definition."""
    total = hashlib.sha256()
    for relative in sorted(entries, key=lambda name: name.encode()):
        encoded = relative.encode()
        total.update(len(encoded).to_bytes(8, "big") + encoded)
        total.update(hashlib.sha256(entries[relative]).digest())
    return total.hexdigest()


def test_tree_pin_follows_the_reference_definition(tmp_path: Path) -> None:
    root = tmp_path / "build"
    write(root / "bin" / "llama-server", b"server")
    write(root / "lib" / "libllama.so.1", b"library")
    write(root / "Z-upper", b"sorts before lowercase bytewise")
    (root / "lib" / "libllama.so").symlink_to("libllama.so.1")
    pin = pin_tree(str(root), unlimited())
    expected = spec_tree_pin(
        {
            "bin/llama-server": b"server",
            "lib/libllama.so.1": b"library",
            "lib/libllama.so": b"library",  # a link counts with its target's bytes, own name
            "Z-upper": b"sorts before lowercase bytewise",
        }
    )
    assert pin.sha256 == expected
    assert (pin.files, pin.size, pin.path) == (4, 6 + 7 + 7 + 31, str(root))


def test_tree_pin_sees_content_and_name_changes(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root / "a", b"one")
    first = pin_tree(str(root), unlimited()).sha256
    (root / "a").write_bytes(b"two")
    second = pin_tree(str(root), unlimited()).sha256
    (root / "a").rename(root / "b")
    third = pin_tree(str(root), unlimited()).sha256
    assert len({first, second, third}) == 3


def test_tree_pin_of_a_symlinked_root_is_its_canonical_tree(tmp_path: Path) -> None:
    root = tmp_path / "real"
    write(root / "f", b"x")
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    pin = pin_tree(str(alias), unlimited())
    assert pin.path == str(root)
    assert pin.sha256 == spec_tree_pin({"f": b"x"})


def tree_refusals(root: Path) -> list[str]:
    with pytest.raises(Refused) as caught:
        pin_tree(str(root), unlimited(), json_path="$.toolkit_directories.CUDA_PATH")
    assert {r.path for r in caught.value.refusals} == {"$.toolkit_directories.CUDA_PATH"}
    return caught.value.codes


def test_incomplete_trees_are_refused_with_every_reason(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    write(root / "ok", b"fine")
    outside = write(tmp_path / "outside", b"elsewhere")
    (root / "out-link").symlink_to(outside)
    (root / "dir-link").symlink_to(root / "sub", target_is_directory=True)
    (root / "sub").mkdir()
    (root / "dangling").symlink_to(root / "nothing")
    os.mkfifo(root / "pipe")
    assert sorted(tree_refusals(root)) == [
        "tree.special_file",
        "tree.symlink_not_file",
        "tree.symlink_not_file",
        "tree.symlink_outside",
    ]


def test_empty_missing_and_file_roots_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert tree_refusals(tmp_path / "empty") == ["tree.empty"]
    assert tree_refusals(tmp_path / "absent") == ["tree.missing"]
    assert tree_refusals(write(tmp_path / "file", b"x")) == ["tree.not_directory"]


def test_depth_limit(tmp_path: Path) -> None:
    ok = tmp_path / "ok"
    write(ok.joinpath(*["d"] * (TREE_MAX_DEPTH - 1), "f"), b"deep but allowed")
    assert pin_tree(str(ok), unlimited()).files == 1
    deep = tmp_path / "deep"
    write(deep.joinpath(*["d"] * TREE_MAX_DEPTH, "f"), b"too deep")
    assert tree_refusals(deep) == ["tree.too_deep"]


def test_entry_limit(tmp_path: Path) -> None:
    root = tmp_path / "many"
    root.mkdir()
    for i in range(TREE_MAX_ENTRIES + 1):
        (root / f"{i:05d}").touch()
    assert tree_refusals(root) == ["tree.too_many_entries"]


def test_tree_hashing_obeys_the_budget(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root / "a", b"a")
    budget = unlimited()
    budget.cancel()
    assert tree_refusals_with(root, budget) == ["budget.cancelled"]


def tree_refusals_with(root: Path, budget: Budget) -> list[str]:
    with pytest.raises(Refused) as caught:
        pin_tree(str(root), budget)
    return caught.value.codes


# --- progress --------------------------------------------------------------------------------


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_quiet_off_a_terminal_and_a_bar_on_one(tmp_path: Path) -> None:
    assert isinstance(bytes_progress_for(io.StringIO()), NullProgress)
    terminal = FakeTerminal()
    sink = bytes_progress_for(terminal)
    assert isinstance(sink, BytesBar)
    data = b"\0" * (CHUNK_BYTES * 2)
    path = write(tmp_path / "f", data)
    hash_files([HashJob(str(path), "$")], unlimited(), progress=sink)
    assert terminal.getvalue()  # the bar was drawn (and cleared: transient)
