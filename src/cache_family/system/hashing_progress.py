"""How hashing reports its progress: a protocol the hashing threads call, defined here (low)
so that the hashers never import the console that draws it."""

from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    """Receives byte counts from hashing threads; implementations must be thread-safe."""

    def begin(self, files: int, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def end(self) -> None: ...


class NullProgress:
    """Progress that shows nothing (stderr is not a terminal, or a test)."""

    def begin(self, files: int, total_bytes: int) -> None:
        del files, total_bytes

    def advance(self, nbytes: int) -> None:
        del nbytes

    def end(self) -> None:
        pass
