"""The bounded GGUF header reader: real files written by the ``gguf`` library, and hand-made
byte strings for the damaged cases a library writer would never produce."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from cache_family.errors import Refused
from cache_family.schemas.gguf_header import (
    LIST_KEEP_ITEMS,
    STRING_KEEP_BYTES,
    ZOO_SYNTHETIC_TAG,
    read_gguf_header,
)


def write_model(
    path: Path,
    arch: str = "qwen3",
    *,
    blocks: int = 4,
    vocab: int = 100,
    tensor_bytes: int = 0,
    endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
    description: str | None = None,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    writer.add_name("header test")
    if description is not None:
        writer.add_description(description)
    writer.add_block_count(blocks)
    writer.add_context_length(4096)
    writer.add_token_list([f"tok{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_tags(["first", ZOO_SYNTHETIC_TAG])
    writer.add_bool("test.flag", True)
    writer.add_float64("test.f64", 1.5)
    writer.add_int8("test.i8", -3)
    writer.add_array("test.nested", [[1, 2], [3]])
    count = max(tensor_bytes // 4, 1)
    writer.add_tensor("blk.0.w.weight", np.zeros((count,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def codes(path: Path, **kwargs: int) -> list[str]:
    with pytest.raises(Refused) as caught:
        read_gguf_header(str(path), **kwargs)  # type: ignore[arg-type]
    return caught.value.codes


def test_a_real_header_gives_the_models_own_claims(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", "llama", blocks=16, description="a test model")
    header = read_gguf_header(str(path), json_path="$.x")
    assert (header.architecture, header.block_count, header.context_length) == ("llama", 16, 4096)
    assert header.version == 3 and header.byte_order == "little" and header.tensor_count == 1
    assert header.text("general.description") == "a test model"
    assert header.metadata["test.flag"] is True and header.whole_number("test.flag") is None
    assert header.metadata["test.f64"] == 1.5 and header.metadata["test.i8"] == -3
    assert header.arrays == {
        "tokenizer.ggml.tokens": 100,
        "tokenizer.ggml.scores": 100,
        "test.nested": 2,
    }
    assert header.split_count is None
    assert header.tags == ("first", ZOO_SYNTHETIC_TAG)
    info = os.stat(path)
    assert header.identity == (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    assert header.header_bytes < info.st_size


def test_a_big_endian_header_is_read_too(tmp_path: Path) -> None:
    path = write_model(tmp_path / "be.gguf", "gemma2", blocks=26, endianess=gguf.GGUFEndian.BIG)
    header = read_gguf_header(str(path))
    assert (header.byte_order, header.architecture, header.block_count) == ("big", "gemma2", 26)


def test_tensor_data_is_never_read(tmp_path: Path) -> None:
    path = write_model(tmp_path / "big.gguf", tensor_bytes=4 * 1024 * 1024)
    header = read_gguf_header(str(path))
    # then the tensor bytes are replaced by an unreadable hole: the header alone still parses
    with path.open("r+b") as handle:
        handle.truncate(header.header_bytes)
        handle.truncate(64 * 1024**3)
    assert read_gguf_header(str(path)).block_count == 4


def test_a_large_vocabulary_is_stepped_over_quickly(tmp_path: Path) -> None:
    tokens = [f"token-{i}".encode() for i in range(262_144)]
    vocabulary = key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(tokens))
    vocabulary += b"".join(struct.pack("<Q", len(t)) + t for t in tokens)
    path = tmp_path / "vocab.gguf"
    path.write_bytes(raw_header(vocabulary, string_pair("general.architecture", "qwen3")))
    # CPU time of this process, not wall time: other processes on a loaded machine cannot
    # make it fail; only per-entry work in the reader can.
    started = time.process_time()
    header = read_gguf_header(str(path))
    assert header.arrays["tokenizer.ggml.tokens"] == 262_144
    assert header.architecture == "qwen3"
    assert header.header_bytes == path.stat().st_size
    assert time.process_time() - started < 2.0


def test_only_short_string_lists_are_kept(tmp_path: Path) -> None:
    many = key("general.tags") + struct.pack("<IIQ", 9, 8, LIST_KEEP_ITEMS + 1)
    many += b"".join(struct.pack("<Q", 1) + b"t" for _ in range(LIST_KEEP_ITEMS + 1))
    path = tmp_path / "tags.gguf"
    path.write_bytes(raw_header(many))
    header = read_gguf_header(str(path))
    assert header.tags == () and header.arrays == {"general.tags": LIST_KEEP_ITEMS + 1}


def test_the_zoo_writes_the_tag_this_reader_looks_for() -> None:
    from cache_family.oracles.zoo import base

    assert base.SYNTHETIC_TAG == ZOO_SYNTHETIC_TAG


def test_a_long_string_is_counted_not_kept(tmp_path: Path) -> None:
    path = write_model(tmp_path / "long.gguf", description="x" * (STRING_KEEP_BYTES + 1))
    header = read_gguf_header(str(path))
    assert header.text("general.description") is None
    assert header.arrays["general.description"] == -1


def test_the_byte_bound_holds(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", vocab=4096)
    assert codes(path, max_bytes=1024) == ["gguf.header_too_large"]


def raw_header(*pairs: bytes, version: int = 3, kv_count: int | None = None) -> bytes:
    count = len(pairs) if kv_count is None else kv_count
    return b"GGUF" + struct.pack("<IQQ", version, 0, count) + b"".join(pairs)


def key(name: str | bytes) -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    return struct.pack("<Q", len(raw)) + raw


def string_pair(name: str, value: str) -> bytes:
    return key(name) + struct.pack("<IQ", 8, len(value)) + value.encode()


def u32_pair(name: str, value: int) -> bytes:
    return key(name) + struct.pack("<II", 4, value)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "gguf.not_gguf"),
        (b"GG", "gguf.not_gguf"),
        (b"\x7fELF" + b"\0" * 60, "gguf.not_gguf"),
        (b'{"not": "a model"}', "gguf.not_gguf"),
        (raw_header(version=1), "gguf.unsupported_version"),
        (raw_header(version=7), "gguf.unsupported_version"),
        (raw_header(string_pair("general.architecture", "llama"), kv_count=2), "gguf.truncated"),
        (raw_header(string_pair("general.architecture", "llama"))[:-2], "gguf.truncated"),
        (raw_header(key("a.key") + struct.pack("<I", 99)), "gguf.malformed"),
        (raw_header(key("a.key") + struct.pack("<IB", 7, 2)), "gguf.malformed"),
        (raw_header(key(b"\xff\xfe") + struct.pack("<II", 4, 1)), "gguf.malformed"),
        (raw_header(u32_pair("a.b", 1), u32_pair("a.b", 2)), "gguf.malformed"),
        (raw_header(key("arr") + struct.pack("<IIQ", 9, 42, 1)), "gguf.malformed"),
        # an array claiming 2**60 strings: refused by the bound, not by trying them all
        (raw_header(key("arr") + struct.pack("<IIQ", 9, 8, 2**60)), "gguf.header_too_large"),
        (raw_header(key("s") + struct.pack("<IQ", 8, 2**62)), "gguf.header_too_large"),
    ],
)
def test_damaged_headers_are_refused_typed(tmp_path: Path, data: bytes, code: str) -> None:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    assert codes(path) == [code]


def test_a_header_without_an_architecture_says_so(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    path.write_bytes(raw_header(u32_pair("llama.block_count", 16)))
    header = read_gguf_header(str(path))
    assert (header.architecture, header.block_count, header.context_length) == (None, None, None)
    assert header.whole_number("llama.block_count") == 16


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m.gguf")
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    assert codes(link) == ["file.symlink"]
    assert codes(fifo) == ["file.not_regular"]
    assert codes(tmp_path) == ["file.not_regular"]
    assert codes(tmp_path / "absent.gguf") == ["file.missing"]
