"""The receipt lattice: how statuses compare, combine and downgrade.

Measured statuses form a chain, best first::

    completed > incomplete > failed > refused

``completed``  every planned step ran and custody was clean.
``incomplete`` evidence was produced but something is missing or untrusted: a rung cut short, a
               late custody/cleanup failure, pin drift after the run, or a terminal refusal
               (cancellation, deadline expiry, failed interrupt-finish).
``failed``     the work was attempted and produced no usable evidence (host never ready, pins
               wrong before launch, port busy).
``refused``    the tool declined to start the work (invalid profile or plan); the bottom, so
               that combining a failure with a refusal is deterministic.

Unmeasured statuses say why there is no evidence at all and are outside the chain:
``missing-model`` (model absent, row kept without launch), ``not-launched`` (stopped by
cancellation or deadline before launch), ``not-run`` (a planned step that never reported),
``skipped`` (disabled by request), ``unavailable`` (not possible for this artifact, e.g. the
package-only baseline), ``unmeasured`` (nothing planned to measure). A downgrade leaves them as
they are: there is nothing to lower.

The one rule: a receipt's status never rises after a downgrade. Folds keep a *ceiling* that only
:func:`meet` ever changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, get_args

from cache_family.errors import Refused
from cache_family.schemas.receipts import ReceiptStatus, TerminalRefusal

MEASURED_CHAIN: Final[tuple[ReceiptStatus, ...]] = ("refused", "failed", "incomplete", "completed")
UNMEASURED: Final[frozenset[ReceiptStatus]] = frozenset(
    ("missing-model", "not-launched", "not-run", "skipped", "unavailable", "unmeasured")
)
ALL_STATUSES: Final[tuple[ReceiptStatus, ...]] = get_args(ReceiptStatus)
TERMINAL_REFUSALS: Final[tuple[TerminalRefusal, ...]] = get_args(TerminalRefusal)

_RANK: Final = {status: rank for rank, status in enumerate(MEASURED_CHAIN)}


def is_measured(status: ReceiptStatus) -> bool:
    return status in _RANK


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


def as_terminal_refusal(name: str) -> TerminalRefusal:
    for candidate in TERMINAL_REFUSALS:
        if candidate == name:
            return candidate
    raise Refused.one(
        "receipt.terminal_refusal.unknown",
        "$.terminal_refusal",
        f"{name!r} is not a terminal refusal",
        f"use one of {', '.join(TERMINAL_REFUSALS)}",
    )
