"""A GGUF file's header metadata, read with a byte bound and never touching tensor data.

Short scalars, strings and string arrays are kept, other arrays stepped over. Everything read
counts against ``max_bytes``; a header needing more, a truncated one, an unknown value type, a
repeated or non-UTF-8 key is refused with a ``gguf.*`` code.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from cache_family.errors import Refused
from cache_family.schemas.bounded import KIB, MIB, open_regular_file

GGUF_MAGIC: Final = b"GGUF"
SUPPORTED_VERSIONS: Final = (2, 3)
# Real headers hold vocabularies of up to ~260k tokens with their merges: some 20 MiB.
HEADER_MAX_BYTES: Final = 64 * MIB
STRING_KEEP_BYTES: Final = 4 * KIB
# Reads start small and double, so a small header pulls in little of the tensor data after it.
FIRST_READ_BYTES: Final = 64 * KIB
READ_CHUNK_BYTES: Final = MIB
ARRAY_MAX_DEPTH: Final = 4
LIST_KEEP_ITEMS: Final = 64
#: What the zoo (``oracles/zoo/base.py``) writes into ``general.tags``: the one synthetic mark.
ZOO_SYNTHETIC_TAG: Final = "cache-family-bench-zoo:synthetic-random-weights"

Scalar = int | float | bool | str
FileIdentity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns

# value type -> (struct format character, byte size); strings (8) and arrays (9) are special
_FIXED: Final[Mapping[int, tuple[str, int]]] = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_STRING: Final = 8
_ARRAY: Final = 9


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """What a GGUF header says about its model; ``identity`` is the file as it was read."""

    path: str
    version: int
    byte_order: Literal["little", "big"]
    tensor_count: int
    metadata: Mapping[str, Scalar]
    lists: Mapping[str, tuple[str, ...]]  # short string arrays, e.g. general.tags
    arrays: Mapping[str, int]  # other arrays' element counts; strings too long to keep: -1
    header_bytes: int
    identity: FileIdentity
    # Arrays the reader was asked to keep whole (a vocabulary's tokens, scores and types).
    kept: Mapping[str, tuple[Scalar, ...]] = field(default_factory=dict)

    def text(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None

    def whole_number(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def tags(self) -> tuple[str, ...]:
        return self.lists.get("general.tags", ())

    @property
    def architecture(self) -> str | None:
        return self.text("general.architecture")

    @property
    def block_count(self) -> int | None:
        arch = self.architecture
        return None if arch is None else self.whole_number(f"{arch}.block_count")

    @property
    def nextn_predict_layers(self) -> int:
        """Multi-token-prediction layers counted in block_count beyond the trunk (GLM-4.7)."""
        arch = self.architecture
        found = None if arch is None else self.whole_number(f"{arch}.nextn_predict_layers")
        return found or 0

    @property
    def context_length(self) -> int | None:
        arch = self.architecture
        return None if arch is None else self.whole_number(f"{arch}.context_length")

    @property
    def sliding_window(self) -> int | None:
        """A sliding-window family's window in tokens (``<arch>.attention.sliding_window``)."""
        arch = self.architecture
        return None if arch is None else self.whole_number(f"{arch}.attention.sliding_window")

    @property
    def split_count(self) -> int | None:
        return self.whole_number("split.count")


def _refuse(code: str, where: str, message: str, hint: str) -> Refused:
    return Refused.one(code, where, message, hint)


class _Source:
    """The header's bytes, fetched in chunks as parsing needs them, never past the bound."""

    def __init__(
        self,
        read: Callable[[int], bytes],
        max_bytes: int,
        path: str,
        where: str,
        keep: frozenset[str] = frozenset(),
    ) -> None:
        self._read = read
        self.keep = keep
        self.max_bytes = max_bytes
        self.path = path
        self.where = where
        self.data = bytearray()
        self.pos = 0
        self.order = "<"
        self._eof = False
        self._chunk = FIRST_READ_BYTES

    def need(self, count: int) -> None:
        end = self.pos + count
        if end > self.max_bytes:
            raise _refuse(
                "gguf.header_too_large",
                self.where,
                f"{self.path}: the GGUF header needs more than {self.max_bytes} bytes",
                "this is not a model preparation can admit; check the file",
            )
        while len(self.data) < end and not self._eof:
            want = max(self._chunk, end - len(self.data))
            self._chunk = min(2 * self._chunk, READ_CHUNK_BYTES)
            chunk = self._read(min(want, self.max_bytes - len(self.data)))
            if not chunk:
                self._eof = True
            self.data += chunk
        if len(self.data) < end:
            raise _refuse(
                "gguf.truncated",
                self.where,
                f"{self.path} ends inside its GGUF header (at byte {len(self.data)})",
                "the download is incomplete: fetch the model again",
            )

    def unpack(self, fmt: str, size: int) -> int | float | bool:
        self.need(size)
        value: int | float | bool = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def u32(self) -> int:
        return int(self.unpack("I", 4))

    def u64(self) -> int:
        return int(self.unpack("Q", 8))

    def raw(self, count: int) -> bytes:
        self.need(count)
        out = bytes(self.data[self.pos : self.pos + count])
        self.pos += count
        return out

    def skip(self, count: int) -> None:
        self.need(count)
        self.pos += count

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` length-prefixed strings (a vocabulary: the header's bulk)."""
        # every string takes at least its 8-byte length: refuse a count no bound allows
        self.need(count * 8)
        length_of = struct.Struct(self.order + "Q").unpack_from
        data = self.data  # need() extends this same bytearray in place
        for _ in range(count):
            if self.pos + 8 > len(data):
                self.need(8)
            length = length_of(data, self.pos)[0]
            self.pos += 8
            if self.pos + length > len(data):
                self.need(length)
            self.pos += length

    def malformed(self, what: str) -> Refused:
        return _refuse(
            "gguf.malformed",
            self.where,
            f"{self.path}: malformed GGUF header at byte {self.pos}: {what}",
            "the file is damaged or not a GGUF model: fetch it again",
        )


def _value(
    source: _Source, kind: int, depth: int, key: str
) -> tuple[Scalar | tuple[Scalar, ...] | None, int]:
    """One value: (kept value or None, element count of a skipped array or long string)."""
    if kind in _FIXED:
        fmt, size = _FIXED[kind]
        if kind == 7:
            byte = source.raw(1)[0]
            if byte > 1:
                raise source.malformed(f"{key!r} is a bool stored as {byte}")
            return bool(byte), 0
        return source.unpack(fmt, size), 0
    if kind == _STRING:
        length = source.u64()
        if length > STRING_KEEP_BYTES:
            source.skip(length)
            return None, -1
        return source.raw(length).decode("utf-8", errors="replace"), 0
    if kind == _ARRAY:
        if depth >= ARRAY_MAX_DEPTH:
            raise source.malformed(f"{key!r} nests arrays more than {ARRAY_MAX_DEPTH} deep")
        element = source.u32()
        count = source.u64()
        if depth == 0 and key in source.keep and (element in _FIXED or element == _STRING):
            return _whole_array(source, element, count, key), 0
        if element in _FIXED:
            source.skip(count * _FIXED[element][1])
        elif element == _STRING and count <= LIST_KEEP_ITEMS:
            items = [_value(source, _STRING, depth + 1, key)[0] for _ in range(count)]
            kept = tuple(item for item in items if isinstance(item, str))
            return (kept, 0) if len(kept) == count else (None, count)
        elif element == _STRING:
            source.skip_strings(count)
        elif element == _ARRAY:
            source.need(count * 12)
            for _ in range(count):
                _value(source, _ARRAY, depth + 1, key)
        else:
            raise source.malformed(f"{key!r} is an array of unknown type {element}")
        return None, count
    raise source.malformed(f"{key!r} has unknown value type {kind}")


def _whole_array(source: _Source, element: int, count: int, key: str) -> tuple[Scalar, ...]:
    """Every element of a kept array (strings decoded as UTF-8, bad bytes replaced)."""
    if element == _STRING:
        source.need(count * 8)
        items: list[Scalar] = []
        for _ in range(count):
            items.append(source.raw(source.u64()).decode("utf-8", errors="replace"))
        return tuple(items)
    fmt, size = _FIXED[element]
    source.need(count * size)
    values = struct.unpack_from(f"{source.order}{count}{fmt}", source.data, source.pos)
    source.pos += count * size
    if element == 7 and any(v not in (0, 1) for v in values):
        raise source.malformed(f"{key!r} holds a bool that is neither 0 nor 1")
    return tuple(values)


def _parse(source: _Source, identity: FileIdentity) -> GgufHeader:
    try:
        source.need(4)
    except Refused:
        raise _refuse(
            "gguf.not_gguf",
            source.where,
            f"{source.path} is too short to be a GGUF file",
            "point the catalog key at a GGUF model file",
        ) from None
    if source.raw(4) != GGUF_MAGIC:
        raise _refuse(
            "gguf.not_gguf",
            source.where,
            f"{source.path} does not start with the GGUF magic",
            "point the catalog key at a GGUF model file",
        )
    version = source.u32()
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped not in SUPPORTED_VERSIONS:
            raise _refuse(
                "gguf.unsupported_version",
                source.where,
                f"{source.path} is GGUF version {version}, not one of {SUPPORTED_VERSIONS}",
                "convert the model with a current gguf converter",
            )
        source.order, version = ">", swapped
    tensor_count = source.u64()
    kv_count = source.u64()
    metadata: dict[str, Scalar] = {}
    lists: dict[str, tuple[str, ...]] = {}
    arrays: dict[str, int] = {}
    kept: dict[str, tuple[Scalar, ...]] = {}
    for _ in range(kv_count):
        raw_key = source.raw(source.u64())
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise source.malformed(f"key {raw_key[:64]!r} is not UTF-8") from None
        if key in metadata or key in lists or key in arrays or key in kept:
            raise source.malformed(f"key {key!r} appears twice")
        value, count = _value(source, source.u32(), 0, key)
        if isinstance(value, tuple) and key in source.keep:
            kept[key] = value
        elif value is None:
            arrays[key] = count
        elif isinstance(value, tuple):
            lists[key] = tuple(str(item) for item in value)
        else:
            metadata[key] = value
    return GgufHeader(
        path=source.path,
        version=version,
        byte_order="big" if source.order == ">" else "little",
        tensor_count=tensor_count,
        metadata=metadata,
        lists=lists,
        arrays=arrays,
        header_bytes=source.pos,
        identity=identity,
        kept=kept,
    )


def file_identity(info: os.stat_result) -> FileIdentity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def read_gguf_header(
    path: str,
    *,
    max_bytes: int = HEADER_MAX_BYTES,
    json_path: str = "$",
    keep_arrays: frozenset[str] = frozenset(),
) -> GgufHeader:
    """Read the metadata of the regular file ``path`` (a final symlink is refused);
    ``keep_arrays``: top-level arrays of numbers or strings to return whole in ``kept``."""
    with open_regular_file(path, subject=path, json_path=json_path) as (fd, info):
        source = _Source(lambda n: os.read(fd, n), max_bytes, path, json_path, keep_arrays)
        try:
            return _parse(source, file_identity(info))
        except OSError as exc:
            raise _refuse(
                "file.unreadable",
                json_path,
                f"{path} could not be read: {exc.strerror}",
                "check the file and the disk",
            ) from None
