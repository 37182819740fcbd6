"""The bytes a host executes are the bytes its pins saw: it runs from a private copy.

Pins are hashed by path, and a server exec'd by that path a moment later could be other bytes
(a binary swapped after the hash and swapped back before the next one). So, before the
pre-launch pin check, the cell copies what the host loads into a fresh 0700 directory of its
own, the pin check hashes THE COPIES, and the host execs the copy:

  * the native build tree (the install prefix: ``bin/``, ``lib/``): llama-server finds
    libllama.so and the ggml libraries through ``LD_LIBRARY_PATH`` and its RUNPATH
    (``$ORIGIN/../lib``), and both then name the copy's ``lib/``. Links inside the tree stay
    links (relative ones resolve inside the copy; one that leaves the tree makes the copy's
    tree pin differ, and the cell is refused);
  * the server binary: its place in the copied tree when it lies inside the build (so
    ``$ORIGIN`` is the copy's), else a copy of its own.

What is still read by path after the check: libraries the loader finds outside the build
(toolkit trees, the system's, an absolute RUNPATH of a binary outside the build); the model
and its shards (mmapped by the host: a model flipped and flipped back during the ladder is
outside what pins can see); toolkit trees; and a stage server's help probes, which run the
original binary between two hashes of it.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass

from cache_family.actors.custody import make_private_dir, remove_tree


@dataclass(frozen=True, slots=True)
class PrivateCopy:
    """Where a cell's host runs from: ``binary`` to exec, ``native_build`` (the copied tree,
    or None when the binary lies outside the build and only it was copied) for the host's
    environment, ``root`` to remove once the host has ended."""

    root: str
    binary: str
    native_build: str | None


def inside(path: str, tree: str) -> bool:
    return os.path.commonpath([path, tree]) == tree and path != tree


def make_private_copy(binary: str, native_build: str | None, parent: str) -> PrivateCopy:
    """Copy the native build tree and ``binary`` into a new 0700 dir under ``parent``;
    OSError when it cannot (a missing binary, a full disk)."""
    source = os.path.realpath(binary, strict=True)
    tree = os.path.realpath(native_build, strict=True) if native_build else None
    if os.statvfs(parent).f_flag & os.ST_NOEXEC:
        raise OSError(
            errno.EACCES,
            "the run directory is on a filesystem mounted noexec; the host runs from a "
            "private copy there: choose an output on a filesystem that allows executables",
            parent,
        )
    root = make_private_dir(parent, "exec")
    try:
        copied_tree = None
        if tree is not None:
            copied_tree = os.path.join(root, "native")
            shutil.copytree(tree, copied_tree, symlinks=True)
            if inside(source, tree):
                copied = os.path.join(copied_tree, os.path.relpath(source, tree))
                return PrivateCopy(root, copied, copied_tree)
        copied = os.path.join(root, "bin", os.path.basename(source))
        os.mkdir(os.path.dirname(copied), 0o700)
        shutil.copyfile(source, copied)
        os.chmod(copied, stat.S_IRUSR | stat.S_IXUSR)
        return PrivateCopy(root, copied, copied_tree)
    except BaseException:
        remove_tree(root)
        raise
