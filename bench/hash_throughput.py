"""Pin hashing throughput next to ``sha256sum`` on the same files, in one run.

The script writes ``--files`` files of ``--size-mib`` random bytes (default 2 x 1 GiB) into a
temporary directory, reads each once so every contender starts from the page cache, then for
each of ``--repeats`` rounds (contenders interleaved, so drift on a shared machine hits all
alike) times:

* one file: ``cache_family.system.pins.hash_files`` (1 MiB chunks, budget checked between
  chunks) against ``sha256sum FILE``;
* all files: ``hash_files`` with one thread per file against ``sha256sum`` run on the files
  one after another (one process each) and against one ``sha256sum F1 F2 ...`` process.

When ``openssl`` is installed, ``openssl dgst -sha256 FILE`` is timed on the one file too:
coreutils' ``sha256sum`` can be a slow build, so the OpenSSL ratio is the one to judge.

Every digest is compared with ``sha256sum``'s. It prints the medians, throughput and the
ratios (their seconds / our seconds: above 1 means we are faster); ``--json`` writes every
sample, ``--append`` records the output in bench/RESULTS.md.

    .venv/bin/python bench/hash_throughput.py [--files 2] [--size-mib 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _results import load_average, machine, record

from cache_family.system.pins import Budget, HashJob, hash_files

MIB = 1024 * 1024


def write_random(path: Path, size: int) -> None:
    with path.open("wb") as handle:
        left = size
        while left:
            chunk = os.urandom(min(16 * MIB, left))
            handle.write(chunk)
            left -= len(chunk)


def sha256sum(paths: list[Path]) -> dict[str, str]:
    done = subprocess.run(
        ["sha256sum", *map(str, paths)], capture_output=True, text=True, check=True
    )
    digests = {}
    for line in done.stdout.splitlines():
        digest, _, name = line.partition("  ")
        digests[name] = digest
    return digests


def openssl_dgst(paths: list[Path]) -> dict[str, str]:
    done = subprocess.run(
        ["openssl", "dgst", "-sha256", "-r", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
    )
    digests = {}
    for line in done.stdout.splitlines():
        digest, _, name = line.partition(" *")
        digests[name] = digest
    return digests


def ours(paths: list[Path], workers: int) -> dict[str, str]:
    pins = hash_files(
        [HashJob(str(p), str(p)) for p in paths], Budget.seconds(3600), workers=workers
    )
    return {pin.path: pin.sha256 for pin in pins}


def timed(action: Callable[[], dict[str, str]]) -> tuple[float, dict[str, str]]:
    start = time.perf_counter()
    digests = action()
    return time.perf_counter() - start, digests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the files (default: TMPDIR)")
    parser.add_argument("--json", default=None, help="write every sample here")
    parser.add_argument("--append", action="store_true", help="record in bench/RESULTS.md")
    args = parser.parse_args()
    load_before = load_average()
    if args.files < 2:
        parser.error("--files must be at least 2 (the parallel case needs two)")
    size = args.size_mib * MIB

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hash-bench-") as tmp:
        paths = [Path(tmp) / f"blob-{i}.bin" for i in range(args.files)]
        for path in paths:
            write_random(path, size)
        expected = sha256sum(paths)  # also warms the page cache for everyone

        contenders: dict[str, Callable[[], dict[str, str]]] = {
            "ours, 1 file, 1 thread": lambda: ours(paths[:1], 1),
            "sha256sum, 1 file": lambda: sha256sum(paths[:1]),
            f"ours, {args.files} files, {args.files} threads": lambda: ours(paths, args.files),
            f"sha256sum, {args.files} files one after another": lambda: {
                k: v for p in paths for k, v in sha256sum([p]).items()
            },
            f"sha256sum, {args.files} files in one process": lambda: sha256sum(paths),
        }
        if shutil.which("openssl"):
            contenders["openssl dgst -sha256, 1 file"] = lambda: openssl_dgst(paths[:1])
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, action in contenders.items():
                seconds, digests = timed(action)
                for path, digest in digests.items():
                    if expected[path] != digest:
                        raise SystemExit(f"{name}: digest of {path} differs from sha256sum's")
                samples[name].append(seconds)

    median = {name: statistics.median(values) for name, values in samples.items()}
    names = list(contenders)
    one_ours, one_sum, many_ours, many_serial, many_one_proc = (median[n] for n in names[:5])
    load = os.getloadavg()
    out: list[str] = []

    def say(text: str = "") -> None:
        """Print a line; with --append it is also what is recorded."""
        print(text)
        out.append(text)

    say(f"machine: {machine()}, {ssl.OPENSSL_VERSION}")
    version = subprocess.run(["sha256sum", "--version"], capture_output=True, text=True)
    say(version.stdout.splitlines()[0])
    say(
        f"files: {args.files} x {args.size_mib} MiB random bytes, page cache warm; "
        f"medians of {args.repeats}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    say()
    say("| contender | median s | GiB/s | samples s |")
    say("|---|---:|---:|---|")
    for name in names:
        volume = size * (1 if "1 file" in name else args.files)
        samples_text = ", ".join(f"{s:.3f}" for s in samples[name])
        say(
            f"| {name} | {median[name]:.3f} | {volume / median[name] / 1024**3:.2f} | "
            f"{samples_text} |"
        )
    say()
    say(f"one file: ours vs sha256sum = {one_sum / one_ours:.2f}x (target >= 0.9x)")
    if "openssl dgst -sha256, 1 file" in median:
        one_openssl = median["openssl dgst -sha256, 1 file"]
        say(f"one file: ours vs openssl dgst -sha256 = {one_openssl / one_ours:.2f}x")
    say(
        f"{args.files} files: ours vs sha256sum one after another = "
        f"{many_serial / many_ours:.2f}x (target >= 1.6x)"
    )
    say(f"{args.files} files: ours vs one sha256sum process = {many_one_proc / many_ours:.2f}x")
    say(
        f"{args.files} files on {args.files} threads vs our 1 file = "
        f"{args.files * one_ours / many_ours:.2f}x of {args.files}x ideal parallel speed-up"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "files": args.files,
                    "size_mib": args.size_mib,
                    "repeats": args.repeats,
                    "samples": samples,
                    "medians": median,
                    "load_average": load,
                },
                indent=2,
            )
        )
    if args.append:
        body = "\n".join(out)
        record("Pin hashing throughput", body, argv=sys.argv, load_before=load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
