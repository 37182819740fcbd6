"""One process-outcome vocabulary: a host's cleanup, a supervised child's end and the
preparation worker's end share ``ProcessOutcome``'s fields, and the journaled ``HostCleanup``
encodes exactly as before the base existed (its bytes are in journals and ``cell.json``)."""

from __future__ import annotations

import msgspec

from cache_family.actors.prepare.supervisor import WorkerOutcome
from cache_family.schemas.measurement import HostCleanup, ProcessOutcome
from cache_family.system.child import ChildEnded

# ``HostCleanup``'s encoding as journaled before ``ProcessOutcome`` existed (field order is
# declaration order, inherited fields first).
BEFORE = (
    b'{"pid":7,"graceful":true,"forced":false,"exit_code":0,"surviving_descendants":[],'
    b'"port_free":true,"state_dir_removed":true,"elapsed_ms":1.5,"detail":"",'
    b'"escaped_descendants":[],"tagged_escapees":[9],"capture_truncated":false,'
    b'"oversized_lines":0,"grace_shortened":false,"bounded_out":false,"state_dir_error":null}'
)


def test_host_cleanup_encodes_as_it_did_and_decodes_its_old_bytes() -> None:
    cleanup = HostCleanup(
        pid=7,
        graceful=True,
        forced=False,
        exit_code=0,
        port_free=True,
        state_dir_removed=True,
        elapsed_ms=1.5,
        tagged_escapees=(9,),
    )
    assert msgspec.json.encode(cleanup) == BEFORE
    assert msgspec.json.decode(BEFORE, type=HostCleanup) == cleanup


def test_every_kind_of_child_says_its_end_in_the_same_words() -> None:
    shared = set(ProcessOutcome.__struct_fields__)
    for kind in (HostCleanup, ChildEnded, WorkerOutcome):
        assert issubclass(kind, ProcessOutcome)
        assert shared <= set(kind.__struct_fields__)
    ended = ChildEnded(pid=3, graceful=True, exit_code=0, outlived_by_group=True)
    assert ended.left_processes and not ended.clean
    assert WorkerOutcome(pid=None, cancelled=True).forced is False
