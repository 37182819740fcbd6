"""The receipt lattice: how statuses compare, combine and downgrade.

Measured statuses form a chain, best first: completed > incomplete > failed > refused.
Unmeasured statuses (missing-model, not-launched, not-run, skipped, unavailable, unmeasured) say
why there is no evidence and stay outside the chain. The one rule: a status never rises after a
downgrade; folds keep a ceiling that only ``meet`` changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, get_args

from cache_family.errors import Refused
from cache_family.schemas.receipts import ReceiptStatus

MEASURED_CHAIN: Final[tuple[ReceiptStatus, ...]] = ("refused", "failed", "incomplete", "completed")
UNMEASURED: Final[frozenset[ReceiptStatus]] = frozenset(
    ("missing-model", "not-launched", "not-run", "skipped", "unavailable", "unmeasured")
)
ALL_STATUSES: Final[tuple[ReceiptStatus, ...]] = get_args(ReceiptStatus)

_RANK: Final = {status: rank for rank, status in enumerate(MEASURED_CHAIN)}


def rank(status: ReceiptStatus) -> int:
    """Position in the measured chain (refused 0 .. completed 3)."""
    try:
        return _RANK[status]
    except KeyError:
        raise Refused.one(
            "receipt.status.unranked",
            "$.status",
            f"status {status!r} is not on the measured chain",
            "only completed, incomplete, failed and refused can be compared",
        ) from None


def meet(a: ReceiptStatus, b: ReceiptStatus) -> ReceiptStatus:
    """The greatest status at or below both; an unmeasured status absorbs nothing and is kept."""
    if a in UNMEASURED:
        return a
    if b in UNMEASURED:
        raise Refused.one(
            "receipt.downgrade.unmeasured",
            "$.status",
            f"cannot lower measured status {a!r} to the unmeasured status {b!r}",
            "downgrade to incomplete, failed or refused; unmeasured statuses are assigned once",
        )
    return a if _RANK[a] <= _RANK[b] else b


def meet_all(
    statuses: Iterable[ReceiptStatus], start: ReceiptStatus = "completed"
) -> ReceiptStatus:
    out = start
    for status in statuses:
        out = meet(out, status)
    return out


def may_follow(before: ReceiptStatus, after: ReceiptStatus) -> bool:
    """True when ``after`` is a legal later value of a receipt that was ``before``."""
    if before in UNMEASURED or after in UNMEASURED:
        return before == after
    return _RANK[after] <= _RANK[before]


def terminal_downgrade(status: ReceiptStatus) -> ReceiptStatus:
    """What a cancellation, deadline expiry or failed interrupt-finish does to a status."""
    return status if status in UNMEASURED else meet(status, "incomplete")
