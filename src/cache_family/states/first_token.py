"""A streamed request's first-token and per-token times: the client's as it read them, unless
the stream itself shows the client could not have observed them, and the server's own."""

from __future__ import annotations

from typing import Final, NamedTuple

from msgspec import UNSET, UnsetType

from cache_family.schemas.measurement import (
    CLIENT_STALLED,
    FIRST_TOKEN_WITH_FINAL,
    RequestRow,
    ServerTimings,
    TtftUnobserved,
)


class FirstToken(NamedTuple):
    """What a completed streamed request reports: both times, or neither and why."""

    ttft_ms: float | None
    tpot_ms: float | None
    unobserved: TtftUnobserved | UnsetType = UNSET


def client_first_token(
    *,
    elapsed_ms: float,
    first_read_ms: float | None,
    read_with_final: bool,
    tokens: int,
    late_ms: float | None = None,
    server_tpot_ms: float | None = None,
    client_lag_ms: float | None = None,
) -> FirstToken:
    """The one rule for a streamed request's client TTFT and TPOT.

    ``first_read_ms``: when the client read the first event carrying a generated token (None:
    none came before the final event); ``read_with_final``: that read also brought the final
    event. Either way the first token's arrival is the response's end: not observable
    (``first_token_with_final``). Where the server timed every event, ``late_ms`` says how
    much later than those timings allow the client read its first token, and
    ``server_tpot_ms`` is the server's own time per token: a first token read later than the
    client's measured lag (``client_lag_ms``; None: not measured, this test is skipped), or a
    client TPOT below the server's own (the tokens read in a burst faster than they were
    made), is not a client figure of the request but of a client that was not scheduled
    (``client_stalled``). Never a figure in place of the missing one."""
    if first_read_ms is None or read_with_final:
        return FirstToken(None, None, FIRST_TOKEN_WITH_FINAL)
    tpot_ms = (elapsed_ms - first_read_ms) / max(tokens - 1, 1)
    if late_ms is not None and client_lag_ms is not None and late_ms > client_lag_ms:
        return FirstToken(None, None, CLIENT_STALLED)
    if server_tpot_ms is not None and tpot_ms < server_tpot_ms:
        return FirstToken(None, None, CLIENT_STALLED)
    return FirstToken(first_read_ms, tpot_ms)


def server_ttft_ms(first: ServerTimings) -> float | None:
    """The server's own first-token time: from starting the prompt (the time the request
    waited for a slot is not in it) to the first generated token it sent."""
    if first.prompt_ms is None or first.predicted_ms is None:
        return None
    return first.prompt_ms + first.predicted_ms


def server_tpot_ms(first: ServerTimings, final: ServerTimings | None, tokens: int) -> float | None:
    """The server's own time per token after the first, as the client's TPOT is taken: its
    generation time from the first generated token to the last, over ``tokens - 1``."""
    if final is None or final.predicted_ms is None or first.predicted_ms is None:
        return None
    return max(final.predicted_ms - first.predicted_ms, 0.0) / max(tokens - 1, 1)


class ServerTimes(NamedTuple):
    ttft_ms: float | None
    tpot_ms: float | None


def server_times(row: RequestRow) -> ServerTimes | None:
    """A row's server-side TTFT and TPOT; None when its server did not time every event."""
    first = row.first_token_timings
    if isinstance(first, UnsetType):
        return None
    tokens = row.tokens_predicted
    return ServerTimes(
        server_ttft_ms(first),
        None if tokens is None else server_tpot_ms(first, row.timings, tokens),
    )


# The done-check of the stalled-client issue: a client TTFT this share of its request's
# elapsed time or more, or a client TPOT below this share of the server's own, is suspect.
SUSPECT_TTFT_SHARE: Final = 0.95
SUSPECT_TPOT_SHARE: Final = 0.1


def server_per_token_ms(row: RequestRow) -> float | None:
    """The server's own time per token after the first: from its per-event timings, else
    from the final event's generation time alone (it runs from the first token)."""
    times = server_times(row)
    if times is not None:
        return times.tpot_ms
    if row.timings is None or row.tokens_predicted is None:
        return None
    return server_tpot_ms(ServerTimings(predicted_ms=0.0), row.timings, row.tokens_predicted)


class Suspect(NamedTuple):
    """Why a row's client figures are suspect, and whether the server's own timings show they
    were faked by a stalled client (rather than, say, a long queue before a short answer)."""

    why: str
    faked: bool


def suspect_client_figures(row: RequestRow) -> Suspect | None:
    """A completed row whose client TTFT is at least ``SUSPECT_TTFT_SHARE`` of its elapsed
    time, or whose client TPOT is below ``SUSPECT_TPOT_SHARE`` of the server's own. Faked:
    the TPOT one always; the TTFT one when the server spent more generating after the first
    token than the client saw between the first token and the end."""
    if row.status != "completed" or row.elapsed_ms is None or row.ttft_ms is None:
        return None
    server_tpot = server_per_token_ms(row)
    if (
        row.tpot_ms is not None
        and server_tpot is not None
        and row.tpot_ms < SUSPECT_TPOT_SHARE * server_tpot
    ):
        return Suspect(f"TPOT {row.tpot_ms:.3f} ms, the server's {server_tpot:.3f} ms", True)
    if row.ttft_ms >= SUSPECT_TTFT_SHARE * row.elapsed_ms:
        seen_ms = row.elapsed_ms - row.ttft_ms
        tokens = row.tokens_predicted or 1
        server_ms = None if server_tpot is None else server_tpot * max(tokens - 1, 1)
        return Suspect(
            f"TTFT {row.ttft_ms:.3f} of {row.elapsed_ms:.3f} ms elapsed; the server generated"
            f" for {'n/a' if server_ms is None else f'{server_ms:.3f}'} ms after it",
            server_ms is not None and server_ms > seen_ms,
        )
    return None
