"""The llama-cpp-python bindings install only hash-pinned distributions: its own
dependencies and build backend from ``llama_bindings_lock.json``, the rest from
``requirements.lock``, with pip in hash-checking mode and no dependency resolution."""

from __future__ import annotations

import re
from pathlib import Path

from lock_reading import _locked
from packaging.utils import canonicalize_name

from cache_family.oracles import llama_bindings, native_build

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def test_every_line_pip_is_given_carries_a_hash(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python.tar.gz"
    dependencies, bindings = llama_bindings.requirement_files(sdist)
    for line in (*dependencies.splitlines(), *bindings.splitlines()):
        _requirement, *hashes = line.split()
        assert hashes and all(_SHA256.match(h.removeprefix("--hash=sha256:")) for h in hashes)
    assert bindings == f"{sdist} --hash=sha256:{native_build.source_pin().sdist_sha256}\n"
    argv = llama_bindings.pip_install("/r.txt")
    assert {"--require-hashes", "--no-deps", "--no-build-isolation"} <= set(argv)
    assert argv[-2:] == ["-r", "/r.txt"]


def test_the_bindings_dependencies_are_pinned_here_or_in_the_project_lock() -> None:
    pinned = llama_bindings.lock()
    entries = [*pinned["build"], *pinned["runtime"]]
    here = {canonicalize_name(e["name"]) for e in entries}
    project = set(_locked())
    assert not here & project, "one pin per distribution"
    # What llama-cpp-python 0.3.36 declares, and what each pinned entry requires in turn.
    needed = {canonicalize_name(n) for n in pinned["bindings_requires"]}
    needed |= {canonicalize_name(r) for e in entries for r in e["requires"]}
    assert needed <= here | project, needed - (here | project)
    for entry in entries:
        assert entry["sha256"] and all(_SHA256.match(d) for d in entry["sha256"])
