"""What makes a string unsafe to print, journal or write into JSON as it is."""

from __future__ import annotations

import unicodedata
from typing import Literal

UnsafeCharacter = Literal["not-utf8", "control", "format"]


def unsafe_character(value: str) -> UnsafeCharacter | None:
    """The worst kind of character in ``value`` that would make a shown name lie or fail.

    ``not-utf8``: a lone surrogate (bytes that were not UTF-8, kept by surrogateescape);
    ``control``: a control character; ``format``: an invisible format character such as a
    right-to-left override or a zero-width space, which shows another name than the real one.
    """
    categories = {unicodedata.category(ch) for ch in value}
    if "Cs" in categories:
        return "not-utf8"
    if "Cc" in categories:
        return "control"
    if "Cf" in categories:
        return "format"
    return None
