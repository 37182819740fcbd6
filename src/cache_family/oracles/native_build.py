"""Build a real ``llama-server`` from llama.cpp source obtained through a package registry.

The source is the ``llama-cpp-python`` sdist, checked against ``llama_cpp_source.json`` before
anything is unpacked; one shared-library build gives both ``llama-server`` and the ``libllama``
the bindings load. The cache key covers the sdist pin and every build option. ``install(...,
tools=True)`` also writes the oracle launchers under ``OUTPUT/cargo/debug/``, pinned in
``producer.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any, TextIO

from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import read_bounded
from cache_family.system.hashing import sha256_file
from cache_family.system.pins import tree_digest
from cache_family.system.publish import replace_atomically, replace_with_symlink

SERVER_NAME = "llama-server"
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


@dataclass(frozen=True, slots=True)
class SourcePin:
    package: str
    version: str
    sdist_name: str
    sdist_sha256: str
    llama_cpp_commit: str
    vendored_root: str


def source_pin() -> SourcePin:
    text = resources.files("cache_family.oracles").joinpath("llama_cpp_source.json").read_text()
    raw = json.loads(text)
    return SourcePin(**raw)


def build_options(jobs: int | None = None) -> dict[str, str]:
    """The CMake cache entries of the build; part of the cache key."""
    del jobs  # parallelism does not change the output
    return {
        "CMAKE_BUILD_TYPE": "Release",
        "GGML_NATIVE": "OFF",
        "BUILD_SHARED_LIBS": "ON",
        "LLAMA_BUILD_SERVER": "ON",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_CURL": "OFF",
        "LLAMA_BUILD_UI": "OFF",
        # Defaults to ON and then downloads the web UI from a hub, which must never happen.
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "CMAKE_BUILD_WITH_INSTALL_RPATH": "ON",
        "CMAKE_INSTALL_RPATH": "$ORIGIN/../lib",
    }


BUILD_TARGETS = ("llama-server", "llama")


def cache_root() -> Path:
    override = os.environ.get("CACHE_FAMILY_CACHE")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "cache-family"


def cache_key(pin: SourcePin, options: dict[str, str]) -> str:
    material = json.dumps(
        {
            "sdist_sha256": pin.sdist_sha256,
            "options": options,
            "targets": list(BUILD_TARGETS),
            "machine": platform.machine(),
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(material).hexdigest()[:24]


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """One installer or zoo writer per target at a time, across processes."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tool_env() -> dict[str, str]:
    """Only what a compiler or pip needs; never the caller's whole environment."""
    keep = (
        "PATH",
        "HOME",
        "LANG",
        "SSL_CERT_FILE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "CC",
        "CXX",
        "TMPDIR",
    )
    env = {name: os.environ[name] for name in keep if name in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env


def find_toolchain() -> dict[str, str]:
    env = tool_env()
    cc = (
        env.get("CC")
        or shutil.which("cc", path=env["PATH"])
        or shutil.which("gcc", path=env["PATH"])
    )
    cxx = (
        env.get("CXX")
        or shutil.which("c++", path=env["PATH"])
        or shutil.which("g++", path=env["PATH"])
    )
    if not cc or not cxx:
        raise Refused.one(
            "native.no_compiler",
            "$",
            "no C/C++ compiler found on PATH (cc/c++ or gcc/g++)",
            "install a toolchain, e.g. `apt-get install build-essential`",
        )
    cmake = shutil.which("cmake", path=env["PATH"])
    if not cmake:
        raise Refused.one(
            "native.no_cmake",
            "$",
            "cmake not found on PATH",
            "install cmake, e.g. `apt-get install cmake`",
        )
    return {"cc": cc, "cxx": cxx, "cmake": cmake}


def compiler_version(cxx: str) -> str:
    out = subprocess.run(
        [cxx, "--version"], capture_output=True, text=True, env=tool_env(), check=False, timeout=30
    )
    return (out.stdout.splitlines() or ["unknown"])[0].strip()


def fetch_sdist(pin: SourcePin, log: TextIO) -> Path:
    """Return the cached sdist, downloading it through pip when absent; pin-checked."""
    store = cache_root() / "sdist"
    store.mkdir(parents=True, exist_ok=True)
    cached = store / pin.sdist_name
    if cached.is_file() and sha256_file(cached) == pin.sdist_sha256:
        return cached
    print(
        f"native: downloading {pin.package}=={pin.version} sdist from the package registry",
        file=log,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=store) as tmp:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--disable-pip-version-check",
                "-d",
                tmp,
                f"{pin.package}=={pin.version}",
            ],
            capture_output=True,
            text=True,
            env=tool_env(),
            check=False,
            timeout=1800,
        )
        got = Path(tmp) / pin.sdist_name
        if result.returncode != 0 or not got.is_file():
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise Refused.one(
                "native.registry_unreachable",
                "$",
                f"could not download {pin.package}=={pin.version}: {' | '.join(tail)}",
                f"check that the package registry is reachable, or place the sdist at {cached}",
            )
        observed = sha256_file(got)
        if observed != pin.sdist_sha256:
            raise Refused.one(
                "native.pin_mismatch",
                "$",
                f"{pin.sdist_name} has sha256 {observed}, the repository pins {pin.sdist_sha256}",
                "the registry served different bytes; do not build from them",
            )
        got.replace(cached)
    return cached


def _unpack_vendored(sdist: Path, pin: SourcePin, into: Path) -> Path:
    prefix = pin.vendored_root.rstrip("/") + "/"
    with tarfile.open(sdist, "r:gz") as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        archive.extractall(into, members=members, filter="data")
    return into / pin.vendored_root


def _run_logged(argv: list[str], cwd: Path, log_path: Path, progress: TextIO, label: str) -> None:
    started = time.monotonic()
    interactive = progress.isatty()
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=tool_env(),
        )
        assert proc.stdout is not None
        last_shown = -1
        for line in proc.stdout:
            log.write(line)
            match = _PROGRESS.match(line)
            if match:
                percent = int(match.group(1))
                if percent != last_shown and (interactive or percent % 10 == 0):
                    last_shown = percent
                    elapsed = time.monotonic() - started
                    text = f"native: {label} {percent:3d}% ({elapsed:4.0f}s)"
                    print(
                        ("\r" + text) if interactive else text,
                        end="" if interactive else "\n",
                        file=progress,
                        flush=True,
                    )
        code = proc.wait()
    if interactive and last_shown >= 0:
        print(file=progress)
    if code != 0:
        raise Refused.one(
            "native.build_failed",
            "$",
            f"{label} failed with exit code {code}",
            f"read the build log at {log_path}",
        )


def cached_build_entry() -> Path | None:
    """The complete cache entry for the pinned source and options, or None; never builds."""
    entry = cache_root() / "llama.cpp" / cache_key(source_pin(), build_options())
    return entry if (entry / "build-info.json").is_file() else None


def build_into_cache(progress: TextIO, jobs: int | None = None) -> Path:
    """Return the cache entry holding ``bin/llama-server`` and ``lib/``; build when absent."""
    pin = source_pin()
    options = build_options()
    entry = cache_root() / "llama.cpp" / cache_key(pin, options)
    if (entry / "build-info.json").is_file():
        return entry
    build_started = time.monotonic()
    toolchain = find_toolchain()
    sdist = fetch_sdist(pin, progress)
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".building-", dir=entry.parent))
    try:
        source = _unpack_vendored(sdist, pin, work / "src")
        build = work / "build"
        log_path = work / "build.log"
        configure = [
            toolchain["cmake"],
            "-S",
            str(source),
            "-B",
            str(build),
            f"-DCMAKE_C_COMPILER={toolchain['cc']}",
            f"-DCMAKE_CXX_COMPILER={toolchain['cxx']}",
        ]
        configure += [f"-D{k}={v}" for k, v in options.items()]
        print(
            f"native: building llama.cpp {pin.llama_cpp_commit[:12]} (cold build takes "
            "about 12 minutes on 2 cores; cached afterwards)",
            file=progress,
            flush=True,
        )
        _run_logged(configure, work, log_path, progress, "configure")
        n_jobs = jobs or os.cpu_count() or 2
        _run_logged(
            [
                toolchain["cmake"],
                "--build",
                str(build),
                "--config",
                "Release",
                "-j",
                str(n_jobs),
                "--target",
                *BUILD_TARGETS,
            ],
            work,
            log_path,
            progress,
            "build",
        )
        staged = work / "entry"
        (staged / "bin").mkdir(parents=True)
        (staged / "lib").mkdir()
        built_bin = build / "bin"
        shutil.copy2(built_bin / SERVER_NAME, staged / "bin" / SERVER_NAME)
        for lib in sorted(built_bin.glob("*.so*")):
            # Keep the soname links as links: three copies of each library would triple
            # the tree that every cell re-hashes.
            shutil.copy2(lib, staged / "lib" / lib.name, follow_symlinks=False)
        shutil.copy2(log_path, staged / "build.log")
        info = {
            "source": {
                "package": pin.package,
                "version": pin.version,
                "sdist_sha256": pin.sdist_sha256,
                "llama_cpp_commit": pin.llama_cpp_commit,
                "llama_cpp_commit_scope": "declared by the sdist's vendored git metadata",
            },
            "options": options,
            "targets": list(BUILD_TARGETS),
            "compiler": compiler_version(toolchain["cxx"]),
            "cmake": compiler_version(toolchain["cmake"]),
            "machine": platform.machine(),
            # Cold configure + compile time; producer.json's "seconds" is only the install.
            "build_seconds": round(time.monotonic() - build_started, 1),
        }
        (staged / "build-info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        try:
            staged.rename(entry)
        except OSError:
            if not (entry / "build-info.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return entry


PRODUCER_NAME = "cache-family-bench native build"
_OUTPUT_JSON_PATH = "$.output"
_PRODUCER_LIMIT = 16 * 1024 * 1024
# libX.so, libX.so.0, libX.so.0.25.3: one library's soname chain.
_SONAME_CHAIN = re.compile(r"^(?P<base>.+\.so)(?:\.\d+)*$")


def _output_unusable(path: Path, why: str) -> Refused:
    return Refused.one(
        "native.output_unusable",
        _OUTPUT_JSON_PATH,
        f"{path} {why}",
        "give an absolute output directory that is new, empty or an earlier install's",
    )


def _not_ours(path: Path, why: str) -> Refused:
    return Refused.one(
        "native.output_not_ours",
        _OUTPUT_JSON_PATH,
        f"{path} {why}",
        "an install replaces only its own earlier OUTPUT/native (OUTPUT/producer.json names "
        "it); remove that path yourself or choose another output directory",
    )


def _own_producer(output: Path) -> dict[str, Any] | None:
    """OUTPUT/producer.json as an earlier install wrote it, or None if it is not one."""
    try:
        raw = read_bounded(str(output / "producer.json"), _PRODUCER_LIMIT, what="producer record")
        loaded = json.loads(raw.data)
    except (Refused, ValueError):
        return None
    if isinstance(loaded, dict) and loaded.get("producer") == PRODUCER_NAME:
        return loaded
    return None


def check_output(output: Path) -> None:
    """Refuse, before any build, an OUTPUT an install may not write into.

    OUTPUT must be absent or a directory. ``OUTPUT/native``, ``OUTPUT/cargo`` and
    ``OUTPUT/producer.json`` must be absent or an earlier install's: a real directory that
    ``producer.json`` names. Nothing else there is ever removed.
    """
    producer_path = output / "producer.json"
    try:
        if output.exists() and not output.is_dir():
            raise _output_unusable(output, "exists and is not a directory")
        if output.is_symlink() and not output.exists():
            raise _output_unusable(output, "is a dangling symlink")
        producer = _own_producer(output)
        if (producer_path.is_symlink() or producer_path.exists()) and producer is None:
            raise _not_ours(producer_path, "exists and is not this tool's producer record")
        for own, key in ((output / "native", "native"), (output / TOOLS_DIR, "tools_dir")):
            if own.is_symlink():
                raise _not_ours(own, "is a symlink; an install never writes one there")
            if own.exists():
                if not own.is_dir():
                    raise _not_ours(own, "exists and is not a directory")
                if producer is None or producer.get(key) != str(own):
                    raise _not_ours(own, "exists and no producer.json of an install names it")
    except OSError as error:
        raise _output_unusable(output, f"cannot be inspected: {error.strerror}") from None


def link_identical_sonames(lib: Path) -> list[str]:
    """Make byte-identical copies in one library's soname chain relative links again.

    A cache entry built before the builder kept soname links holds every library three times
    (``libX.so``, ``libX.so.0``, ``libX.so.0.25.3``). The longest name keeps the bytes and
    each shorter name links to the next longer one, as CMake lays them out. A chain whose
    copies differ is left alone. Returns the names that became links.
    """
    chains: dict[str, list[Path]] = {}
    for path in sorted(lib.iterdir()):
        match = _SONAME_CHAIN.match(path.name)
        if match and path.is_file() and not path.is_symlink():
            chains.setdefault(match["base"], []).append(path)
    linked: list[str] = []
    for members in chains.values():
        if len(members) < 2:
            continue
        chain = sorted(members, key=lambda p: (len(p.name), p.name))
        if len({sha256_file(p) for p in chain}) != 1:
            continue
        for shorter, longer in itertools.pairwise(chain):
            replace_with_symlink(shorter, longer.name)
            linked.append(shorter.name)
    return linked


def install(
    output: Path, progress: TextIO, jobs: int | None = None, *, tools: bool = False
) -> dict[str, Any]:
    """Place the build under ``OUTPUT/native`` and write ``OUTPUT/producer.json``.

    Refuses before building anything when OUTPUT is not usable or ``OUTPUT/native`` is not
    an earlier install's (``check_output``); replaces an earlier install whole. ``tools`` also
    writes the oracle launchers under ``OUTPUT/cargo/debug`` (``write_tools``).
    """
    if not output.is_absolute():
        raise Refused.one(
            "native.output_not_absolute",
            "$",
            f"{output} is not absolute",
            "give an absolute output directory",
        )
    check_output(output)
    started = time.monotonic()
    entry = build_into_cache(progress, jobs)
    native = output / "native"
    try:
        for earlier in (native, output / TOOLS_DIR):
            if earlier.exists():
                shutil.rmtree(earlier)  # an earlier install's, by check_output
        (native / "bin").mkdir(parents=True)
        shutil.copy2(entry / "bin" / SERVER_NAME, native / "bin" / SERVER_NAME)
        shutil.copytree(entry / "lib", native / "lib", symlinks=True)
        link_identical_sonames(native / "lib")
        info = json.loads((entry / "build-info.json").read_text())
        files = sorted(p for p in native.rglob("*") if p.is_file() and not p.is_symlink())
        links = sorted(p for p in native.rglob("*") if p.is_symlink())
        producer = {
            "schema_version": 1,
            "producer": PRODUCER_NAME,
            **info,
            "cache_entry": str(entry),
            "native": str(native),
            "files": {str(p.relative_to(output)): sha256_file(p) for p in files},
            # soname links, by target: their bytes are the files above
            "links": {str(p.relative_to(output)): os.readlink(p) for p in links},
            "seconds": round(time.monotonic() - started, 3),
        }
        if tools:
            producer.update(write_tools(output, native))
        text = json.dumps(producer, indent=2, sort_keys=True) + "\n"
        replace_atomically(output / "producer.json", text.encode())
    except OSError as error:
        where = error.filename if error.filename is not None else output
        raise _output_unusable(
            Path(where), f"could not be written: {error.strerror or type(error).__name__}"
        ) from None
    print(f"native: {native / 'bin' / SERVER_NAME}", file=progress, flush=True)
    for relative in producer.get("tools", {}):
        print(f"oracle: {output / relative}", file=progress, flush=True)
    return producer


# --- the oracle launchers -----------------------------------------------------------------------

#: Where the guide's tool paths live under OUTPUT: ``cargo/debug/<tool>``.
TOOLS_DIR = "cargo"
TOOLS_SUBDIR = ("cargo", "debug")
DISTRIBUTION = "cache-family-bench"


@dataclass(frozen=True, slots=True)
class OracleTool:
    """One launcher: the guide's file name, the oracle module it runs and its fixed options."""

    name: str
    module: str
    role: str
    args: tuple[str, ...] = ()
    serving_option: dict[str, str] = field(default_factory=dict)


ORACLE_TOOLS: tuple[OracleTool, ...] = (
    OracleTool(
        "skippy",
        "stage_server",
        "stage_server and new_server: the stage server, reusing cached prompt prefixes",
        serving_option={"prefix_reuse": "on"},
    ),
    OracleTool(
        "skippy-prefix-reuse-off",
        "stage_server",
        "old_server of the demo: the same stage server with prefix reuse off",
        args=("--prefix-reuse", "off"),
        serving_option={"prefix_reuse": "off"},
    ),
    OracleTool("skippy-correctness", "correctness", "correctness: state handoff"),
    OracleTool("skippy-package-builder", "package_builder", "artifact_tool: admission"),
)


def package_source_sha256(root: Path | None = None) -> str:
    """The tree pin (reference rule) of the ``cache_family`` package's files, bytecode left out.

    A launcher's bytes name the interpreter and this pin; ``oracles/launch.py`` refuses to run
    other source, so pinning the launcher pins the code that answers.
    """
    import cache_family

    root = Path(cache_family.__file__).resolve().parent if root is None else root
    entries = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not name.endswith((".pyc", ".pyo")):
                relative = path.relative_to(root).as_posix().encode()
                entries.append((relative, bytes.fromhex(sha256_file(path))))
    return tree_digest(sorted(entries))


#: The native build a launcher was written with; an oracle uses it when the run names none.
ORACLE_NATIVE_ENV = "CACHE_FAMILY_ORACLE_NATIVE"


def launcher_script(tool: OracleTool, python: str, native: Path, source_sha256: str) -> str:
    argv = [python, "-I", "-m", "cache_family.oracles.launch", source_sha256, tool.module]
    command = " ".join(shlex.quote(part) for part in [*argv, *tool.args])
    return (
        "#!/bin/sh\n"
        f"# {tool.name}: cache-family-bench reference workload oracle (not a Skippy build).\n"
        f"# Runs cache_family.oracles.{tool.module} on the package source pinned below, with\n"
        "# this interpreter; the native build is the run's LLAMA_STAGE_BUILD_DIR, else this one.\n"
        f"{ORACLE_NATIVE_ENV}={shlex.quote(str(native))}\n"
        f"export {ORACLE_NATIVE_ENV}\n"
        f'exec {command} "$@"\n'
    )


def write_tools(output: Path, native: Path) -> dict[str, Any]:
    """Write every launcher under ``OUTPUT/cargo/debug``; returns producer.json's tool part."""
    python = sys.executable
    resolved = os.path.realpath(python)
    source = package_source_sha256()
    directory = output.joinpath(*TOOLS_SUBDIR)
    directory.mkdir(parents=True)
    tools: dict[str, Any] = {}
    for tool in ORACLE_TOOLS:
        path = directory / tool.name
        path.write_text(launcher_script(tool, python, native, source))
        path.chmod(0o755)
        tools[str(path.relative_to(output))] = {
            "sha256": sha256_file(path),
            "module": f"cache_family.oracles.{tool.module}",
            "args": list(tool.args),
            "role": tool.role,
            "serving_option": tool.serving_option or None,
        }
    return {
        "tools_dir": str(output / TOOLS_DIR),
        "tools": tools,
        "oracle_runtime": {
            "distribution": DISTRIBUTION,
            "version": metadata.version(DISTRIBUTION),
            "package_source_sha256": source,
            "package_source_scope": "tree pin of the cache_family package files the "
            "launchers refuse to run without",
            "interpreter": python,
            "interpreter_resolved": resolved,
            "interpreter_sha256": sha256_file(Path(resolved)),
            "python_version": platform.python_version(),
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m cache_family.oracles.native_build OUTPUT_DIR", file=sys.stderr)
        return ExitCode.REFUSED
    try:
        install(Path(args[0]).absolute(), sys.stderr, tools=True)
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"error: {refusal.line()}", file=sys.stderr)
        return ExitCode.REFUSED
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
