"""Helpers several test modules share (they were in test_lock.py)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def _locked() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) from a `--generate-hashes` lock file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current: str | None = None
    for line in (ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines():
        pin = _PIN.match(line)
        if pin:
            current = canonicalize_name(pin.group(1))
            assert current not in entries, f"{current} is pinned twice"
            entries[current] = (pin.group(2), [])
        elif line.strip().startswith("--hash=sha256:") and current is not None:
            entries[current][1].append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
        elif line and not line.startswith((" ", "#")):
            raise AssertionError(f"requirements.lock line is not a pin: {line!r}")
    return entries
