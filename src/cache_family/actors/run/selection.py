"""``run --rows KEY,…`` / ``--shard I/N`` / ``--dry-run``: a run of some rows of a
prepared input.

The admitted run keeps the prepared input's pins, budgets and bytes; only its rows are narrowed,
and ``rows_selected`` is journaled right after ``run_started``. Every row still verifies its own
pins on the host that runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from cache_family.actors.run.matrix import AdmittedRun, planned_brief
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.journal import RowsSelected
from cache_family.schemas.prepared import PREPARED_INPUT_MAX_BYTES, PreparedInput, decode_document
from cache_family.states.selection import (
    Selection,
    parse_shard,
    plan_keys,
    row_key,
    select_rows,
    split_row_list,
)
from cache_family.system.host_load import observe_host


def prepared_keys(prepared: PreparedInput) -> dict[str, int]:
    """Every row key of the prepared input -> its plan index."""
    return plan_keys(
        [(r.index, row_key(r.key, r.use_case, r.prefix_tokens)) for r in prepared.rows]
    )


def choose(
    prepared: PreparedInput,
    rows: str | None,
    shard: str | None,
    environ: Mapping[str, str],
) -> Selection:
    """The selection named by ``--rows`` or ``--shard`` (never both: the parser sees to it)."""
    keys = prepared_keys(prepared)
    if shard is not None:
        return select_rows(keys, shard=parse_shard(shard, environ))
    return select_rows(keys, rows=split_row_list(rows or ""))


def narrow(
    admitted: AdmittedRun, selection: Selection, host: HostIdentity | None = None
) -> AdmittedRun:
    """The admitted run restricted to the selected rows, carrying the record that binds them."""
    prepared = admitted.prepared
    keys = prepared_keys(prepared)
    chosen = {keys[key] for key in selection.row_keys}
    kept = [row for row in prepared.rows if row.index in chosen]
    left = [row for row in prepared.rows if row.index not in chosen]
    record = RowsSelected(
        prepared_sha256=admitted.request_sha256,
        how=selection.how,
        row_keys=selection.row_keys,
        shard_index=selection.shard.index if selection.shard else None,
        shard_count=selection.shard.count if selection.shard else None,
        unselected_rows=tuple(planned_brief(prepared, row) for row in left),
        host=host,
    )
    return dataclasses.replace(
        admitted, prepared=prepared.model_copy(update={"rows": kept}), selection=record
    )


def selector(
    rows: str | None, shard: str | None, environ: Mapping[str, str]
) -> Callable[[AdmittedRun], AdmittedRun]:
    """What ``run_command`` applies to the admitted run before creating its output."""

    def apply(admitted: AdmittedRun) -> AdmittedRun:
        selection = choose(admitted.prepared, rows, shard, environ)
        return narrow(admitted, selection, observe_host(environ))

    return apply


def dry_run_keys(
    input_path: str, rows: str | None, shard: str | None, environ: Mapping[str, str]
) -> tuple[str, ...]:
    """``run --input PREPARED --dry-run [--rows …|--shard …]``: the keys of the rows the run
    would run, in plan order (every row without a selection). Raises ``Refused``."""
    raw = read_bounded(input_path, PREPARED_INPUT_MAX_BYTES, what="prepared input")
    prepared = decode_document(raw.data, PreparedInput, what="prepared input")
    if rows is None and shard is None:
        keys = prepared_keys(prepared)
        return tuple(sorted(keys, key=keys.__getitem__))
    return choose(prepared, rows, shard, environ).row_keys
