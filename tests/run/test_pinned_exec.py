"""The bytes a host executes are the bytes its pins hashed (``actors/run/private_exec.py``).

A real run (real custody, real pin hashing, the FAKE llama-server launcher as the pinned
binary) with one fault-injection seam: the pin hasher. Right after the pre-launch hash it
swaps the pinned binary for other code, and it swaps the original back before the hash after
the ladder; the attack that once ran other code as the journaled host with a completed receipt.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import trio
from fake_hosts.fake_custody import FakeHostScript
from run_harness import cell, fake_server_launcher, make_prepared, records, run

from cache_family.actors.run import custody
from cache_family.actors.run.context import PinResult, hash_pins
from cache_family.actors.run.custody import host_environment
from cache_family.actors.run.private_exec import make_private_copy
from cache_family.oracles.native_parts import Parts
from cache_family.schemas.journal import ChildSpawned, PinObserved
from cache_family.states.plans import PinTarget
from cache_family.system.pins import Budget, pin_tree

NATIVE_CELLS = ("native-serial", "sweep-native-concurrent")


async def test_a_binary_swapped_between_the_pin_check_and_exec_never_runs(tmp_path: Path) -> None:
    prepared = make_prepared(tmp_path / "p")
    server = tmp_path / "p" / "tools" / "fake-llama-server"
    original = server.read_bytes()
    ran_swapped = tmp_path / "swapped-code-ran"
    swapped = fake_server_launcher(server, before=f"echo $$ >> '{ran_swapped}'\n").encode()
    swaps = 0

    async def swapping_hasher(targets: Sequence[PinTarget], seconds: float) -> list[PinResult]:
        nonlocal swaps
        if not any(t.name == "binary" for t in targets):
            return await hash_pins(targets, seconds)
        if server.read_bytes() == swapped:  # the check after the ladder: restore first
            server.write_bytes(original)
            return await hash_pins(targets, seconds)
        results = await hash_pins(targets, seconds)
        server.write_bytes(swapped)  # in place, as `cp` would: same inode, other bytes
        swaps += 1
        return results

    out = tmp_path / "out"
    with trio.fail_after(120):
        await run(
            prepared,
            out,
            FakeHostScript(),
            pins=swapping_hasher,
            host_opener=lambda config, observe: custody.host_custody(config, observe),
        )
    assert swaps == 2  # one swap per native cell, each between its hash and its exec
    assert not ran_swapped.exists()  # the swapped code never ran
    spawned = {c.cell_id: c for c in records(out, ChildSpawned)}
    copies = set()
    for name in NATIVE_CELLS:
        receipt = cell(out, name)
        assert receipt.status == "completed"
        cell_id = receipt.cell_id
        before = [
            p
            for p in records(out, PinObserved)
            if p.cell_id == cell_id and p.phase == "before" and p.name == "binary"
        ]
        assert len(before) == 1 and before[0].observed_sha256 == before[0].expected_sha256
        copy = before[0].path
        assert Path(copy).is_relative_to(out) and copy != str(server)
        # The host exec'd exactly the file whose bytes were hashed before launch.
        assert spawned[cell_id].executable == copy
        assert not Path(copy).exists()  # the run's private copy went with its hosts
        copies.add(copy)
    assert len(copies) == 1  # made once for the run, run by both native cells
    assert server.read_bytes() == original


def test_the_real_server_runs_with_the_shared_libraries_of_its_private_copy(
    native_parts: Parts, tmp_path: Path
) -> None:
    """llama-server's own code is in shared libraries (libllama-server-impl.so, libllama.so,
    ggml): from the private copy, the loader maps every one of them from the copy (what the
    copy's tree pin hashed), none from the pinned build."""
    copy = make_private_copy(
        str(native_parts.llama_server), str(native_parts.native_build), str(tmp_path)
    )
    budget = Budget.seconds(120)
    assert copy.native_build is not None
    assert (
        pin_tree(copy.native_build, budget).sha256
        == pin_tree(str(native_parts.native_build), budget).sha256
    )
    env = host_environment(
        {}, {}, copy.native_build, str(tmp_path), basics={"PATH": "/usr/bin:/bin"}
    )
    # The dynamic loader says which file it initialised for each library.
    ran = subprocess.run(
        [copy.binary, "--version"],
        env={**env, "LD_DEBUG": "files"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    loaded = re.findall(r"calling init: (\S+)", ran.stderr.decode(errors="replace"))
    ours = [path for path in loaded if "/libllama" in path or "/libggml" in path]
    assert any("libllama-server-impl" in path for path in ours), loaded
    assert ours and all(Path(path).is_relative_to(copy.root) for path in ours), ours
