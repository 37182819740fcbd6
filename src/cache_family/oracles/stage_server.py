"""Reference oracle of the Skippy stage server (``skippy serve`` / ``skippy serve-openai``).

It supervises the native build's real ``llama-server`` as a child (own process group, explicit
environment, loopback) and relays the OpenAI chat API to it. The listening line is printed only
after ``/v1/models`` answered through our own address. SIGTERM or SIGINT stops the child's group
and exits 0; a child that dies on its own exits 1. ``--prefix-reuse off`` (the demo's old arm)
forbids any prompt reuse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import h11
import httpx
import msgspec
import trio

from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.gguf_header import read_gguf_header
from cache_family.schemas.stage_server import (
    CURRENT_COMMAND,
    LEGACY_COMMAND,
    Dialect,
    StageConfig,
    listening_line,
)
from cache_family.system.process_group import PROCESS_TAG_NAME, stop_group

PROGRAM: Final = "skippy"
BACKEND: Final = "llama-server"
NATIVE_ENV: Final = "CACHE_FAMILY_ORACLE_NATIVE"
CONFIG_MAX_BYTES: Final = MIB
BODY_MAX_BYTES: Final = 16 * MIB
STARTUP_SECONDS: Final = 600.0
# Below the grace a run's host custody gives this program (5 s) before its SIGKILL, which
# would leave the child (its own session) running: stop it, and say so, within ours.
STOP_GRACE_SECONDS: Final = 3.0
# After SIGKILL, still within that grace.
KILL_WAIT_SECONDS: Final = 1.5
CHILD_LINE_MAX: Final = 4096
TELEMETRY_LEVELS: Final = ("off", "error", "warn", "info", "debug", "trace")
# Names the child may inherit: the host basics and the operator's allowlisted device settings.
_CHILD_ENV_NAMES: Final = (
    "PATH",
    "HOME",
    "TMPDIR",
    "TMP",
    "TEMP",
    "LANG",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    # The cell's environment tag: the backend runs in a session of its own, so host custody
    # finds it by this tag if it outlives the stage server (a SIGKILLed stage, say).
    PROCESS_TAG_NAME,
)
_CHILD_ENV_PREFIXES: Final = ("GGML_", "XDG_")

PrefixReuse = Literal["on", "off"]
#: llama-server's own text endpoints, relayed as they are: a chat workload renders its
#: template and checks its text token for token through them (``actors/run/chat_text.py``).
TEXT_ENDPOINTS: Final = ("/apply-template", "/tokenize", "/detokenize")


@dataclass(frozen=True, slots=True)
class ServingOption:
    prefix_reuse: PrefixReuse

    @property
    def server_args(self) -> list[str]:
        return ["--no-cache-prompt", "--cache-ram", "0"] if self.prefix_reuse == "off" else []

    def describe(self) -> dict[str, Any]:
        return {
            "prefix_reuse": self.prefix_reuse,
            "llama_server_args": self.server_args,
            "request_cache_prompt": "forced false" if self.prefix_reuse == "off" else "as sent",
        }


def _refused(code: str, message: str, hint: str) -> Refused:
    return Refused.one(code, "$", message, hint)


# --- the config and the child's command line ----------------------------------------------------


def load_config(path: str) -> StageConfig:
    raw = read_bounded(os.path.abspath(path), CONFIG_MAX_BYTES, what="stage config")
    try:
        config = msgspec.json.decode(raw.data, type=StageConfig)
    except msgspec.DecodeError as error:
        raise _refused(
            "stage_server.config_invalid",
            f"{path} is not a stage config: {error}",
            "give the stage.json the run wrote",
        ) from None
    problems = []
    if config.load_mode != "runtime-slice":
        problems.append(f"load_mode {config.load_mode!r} (only runtime-slice is served)")
    if config.stage_index != 0 or config.layer_start != 0:
        problems.append("a stage other than the first (this oracle serves whole models)")
    if config.upstream is not None or config.downstream is not None:
        problems.append("an upstream or downstream stage")
    if config.ctx_size <= 0 or not 1 <= config.lane_count <= 1024:
        problems.append(f"ctx_size {config.ctx_size} / lane_count {config.lane_count}")
    if not config.model_id or any(c.isspace() for c in config.model_id):
        problems.append(f"model_id {config.model_id!r}")
    if problems:
        raise _refused(
            "stage_server.config_unsupported",
            f"{path} asks for " + "; ".join(problems),
            "serve a single whole-model runtime-slice stage",
        )
    model = os.path.realpath(config.model_path)
    header = read_gguf_header(model)
    block_count = header.block_count
    whole = {block_count, (block_count or 0) - header.nextn_predict_layers}
    if block_count is None or config.layer_end not in whole:
        raise _refused(
            "stage_server.layer_range",
            f"layer_end {config.layer_end} does not cover the model's {block_count} blocks",
            "serve the whole model (layer_end = its block count)",
        )
    return config


def native_server() -> Path:
    for name in ("LLAMA_STAGE_BUILD_DIR", NATIVE_ENV):
        root = os.environ.get(name)
        if root:
            binary = Path(root) / "bin" / BACKEND
            if binary.is_file() and os.access(binary, os.X_OK):
                return binary
            raise _refused(
                "stage_server.no_llama_server",
                f"{name}={root} holds no executable bin/{BACKEND}",
                "point LLAMA_STAGE_BUILD_DIR at a native build with bin/llama-server",
            )
    raise _refused(
        "stage_server.no_llama_server",
        f"neither LLAMA_STAGE_BUILD_DIR nor {NATIVE_ENV} is set",
        "run the tool through its launcher, or set LLAMA_STAGE_BUILD_DIR",
    )


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    env = {
        name: value
        for name, value in environ.items()
        if name in _CHILD_ENV_NAMES or name.startswith(_CHILD_ENV_PREFIXES)
    }
    env.setdefault("PATH", "/usr/bin:/bin")
    return env


def child_argv(
    binary: Path, config: StageConfig, option: ServingOption, port: int, environ: Mapping[str, str]
) -> list[str]:
    argv = [
        str(binary),
        "--model",
        config.model_path,
        "--alias",
        config.model_id,
        "--ctx-size",
        str(config.ctx_size),
        "--parallel",
        str(config.lane_count),
        "--n-gpu-layers",
        str(config.n_gpu_layers),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-webui",
        *option.server_args,
    ]
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        argv += ["--threads", threads, "--threads-batch", threads]
    return argv


def loopback_port(bind_addr: str) -> int:
    host, _, port = bind_addr.rpartition(":")
    if host != "127.0.0.1" or not port.isdigit() or int(port) > 65535:
        raise _refused(
            "stage_server.bind_addr",
            f"--bind-addr {bind_addr!r} is not 127.0.0.1:PORT",
            "bind the loopback address only",
        )
    return int(port)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# --- HTTP ---------------------------------------------------------------------------------------


class _Connection:
    """One client connection spoken with h11: one request, one response, then close."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER)

    async def _next(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some(64 * 1024))

    async def request(self) -> tuple[h11.Request, bytes] | None:
        head = await self._next()
        if not isinstance(head, h11.Request):
            return None
        body = bytearray()
        while True:
            event = await self._next()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > BODY_MAX_BYTES:
                    await self.send(413, _error("request body too large", "invalid_request_error"))
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return head, bytes(body)
            else:
                return None

    async def _write(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            await self.stream.send_all(data)

    async def start(self, status: int, content_type: str, length: int | None = None) -> None:
        headers = [("content-type", content_type), ("connection", "close")]
        if length is not None:
            headers.append(("content-length", str(length)))
        await self._write(h11.Response(status_code=status, headers=headers))

    async def data(self, chunk: bytes) -> None:
        if chunk:
            await self._write(h11.Data(data=chunk))

    async def end(self) -> None:
        await self._write(h11.EndOfMessage())

    async def send(self, status: int, document: Any) -> None:
        body = json.dumps(document).encode()
        await self.start(status, "application/json", len(body))
        await self.data(body)
        await self.end()


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


@dataclass
class Relay:
    """The OpenAI surface on our address, relayed to the child ``llama-server``."""

    config: StageConfig
    option: ServingOption
    upstream: httpx.AsyncClient
    admission: trio.Semaphore

    async def models(self) -> tuple[int, Any]:
        reply = await self.upstream.get("/v1/models")
        if reply.status_code != 200:
            return 502, _error(f"llama-server /v1/models answered {reply.status_code}", "upstream")
        served = reply.json().get("data") or [{}]
        entry = {
            **served[0],
            "id": self.config.model_id,
            "object": "model",
            "owned_by": "cache-family-bench reference oracle",
            "cache_family_oracle": {"backend": BACKEND, **self.option.describe()},
        }
        return 200, {"object": "list", "data": [entry]}

    async def chat(self, connection: _Connection, body: bytes) -> None:
        try:
            request = json.loads(body)
        except ValueError:
            await connection.send(400, _error("the body is not JSON", "invalid_request_error"))
            return
        if not isinstance(request, dict):
            await connection.send(400, _error("the body is not an object", "invalid_request_error"))
            return
        model = request.get("model")
        if model is not None and model != self.config.model_id:
            await connection.send(404, _error(f"no model {model!r} here", "model_not_found"))
            return
        if self.option.prefix_reuse == "off":
            request["cache_prompt"] = False
        if request.get("stream") is True:
            # llama-server's own timings on every chunk, relayed as they come: the client
            # checks its reads against them (an OpenAI client ignores the extra field).
            request.setdefault("timings_per_token", True)
        async with self.admission:
            if request.get("stream") is True:
                await self._stream(connection, request)
                return
            reply = await self.upstream.post("/v1/chat/completions", json=request)
            content_type = reply.headers.get("content-type", "application/json")
            await connection.start(reply.status_code, content_type, len(reply.content))
            await connection.data(reply.content)
            await connection.end()

    async def text(self, connection: _Connection, target: str, body: bytes) -> None:
        """One of ``TEXT_ENDPOINTS``: no generation, no slot, so no admission."""
        reply = await self.upstream.post(
            target, content=body, headers={"content-type": "application/json"}
        )
        content_type = reply.headers.get("content-type", "application/json")
        await connection.start(reply.status_code, content_type, len(reply.content))
        await connection.data(reply.content)
        await connection.end()

    async def _stream(self, connection: _Connection, request: dict[str, Any]) -> None:
        async with self.upstream.stream("POST", "/v1/chat/completions", json=request) as reply:
            content_type = reply.headers.get("content-type", "text/event-stream")
            await connection.start(reply.status_code, content_type)
            async for chunk in reply.aiter_raw():
                await connection.data(chunk)
            await connection.end()

    async def handle(self, stream: trio.SocketStream) -> None:
        connection = _Connection(stream)
        with contextlib.suppress(
            trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError
        ):
            async with stream:
                got = await connection.request()
                if got is None:
                    return
                request, body = got
                target, method = request.target.decode("latin-1"), request.method.decode()
                try:
                    if target == "/v1/models" and method == "GET":
                        await connection.send(*await self.models())
                    elif target == "/v1/chat/completions" and method == "POST":
                        await self.chat(connection, body)
                    elif target in TEXT_ENDPOINTS and method == "POST":
                        await self.text(connection, target, body)
                    else:
                        await connection.send(404, _error(f"no {method} {target}", "not_found"))
                except (httpx.HTTPError, ValueError, AttributeError) as error:
                    # An upstream failure or an unreadable upstream reply ends this exchange,
                    # never the server.
                    _say(f"{method} {target}: upstream failed: {error!r}")
                    if connection.h11.our_state is h11.SEND_RESPONSE:
                        await connection.send(502, _error(f"llama-server: {error}", "upstream"))


# --- supervision --------------------------------------------------------------------------------


@dataclass
class _Ending:
    code: int = ExitCode.FAILED
    reason: str = "startup did not finish"


def _say(text: str) -> None:
    print(f"{PROGRAM}: {text}", file=sys.stderr, flush=True)


async def _pump(stream: trio.abc.ReceiveStream) -> None:
    """Relay the child's output to stderr, each line prefixed and cut to a bounded length."""
    pending = b""
    async for chunk in stream:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > CHILD_LINE_MAX:
            lines.append(pending)
            pending = b""
        for line in lines:
            text = line[:CHILD_LINE_MAX].decode("utf-8", errors="replace")
            sys.stderr.write(f"[{BACKEND}] {text}\n")
        sys.stderr.flush()


async def _upstream_ready(client: httpx.AsyncClient, process: trio.Process) -> None:
    deadline = trio.current_time() + STARTUP_SECONDS
    while trio.current_time() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"{BACKEND} exited with {process.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            reply = await client.get("/health", timeout=2.0)
            if reply.status_code == 200 and reply.json().get("status") == "ok":
                return
        await trio.sleep(0.05)
    raise RuntimeError(f"{BACKEND} was not healthy within {STARTUP_SECONDS:.0f} s")


async def _answers_models(port: int, model_id: str) -> None:
    """``/v1/models`` through our own address must list the model before we say we listen."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        reply = await client.get(f"http://127.0.0.1:{port}/v1/models")
    ids = [entry.get("id") for entry in reply.json().get("data", [])]
    if reply.status_code != 200 or model_id not in ids:
        raise RuntimeError(f"/v1/models answered {reply.status_code} without {model_id!r}")


async def _stop(process: trio.Process) -> None:
    """End the child's whole group with the one group stopper (shielded, bounded).

    The child's output is read on meanwhile: a child that logs its shutdown into a full pipe
    nobody reads (the pump ended with the serving nursery) blocks and never exits.
    """
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as draining:
            if process.stdout is not None and process.returncode is None:
                draining.start_soon(_pump, process.stdout)
            await stop_group(process, grace=STOP_GRACE_SECONDS, kill_wait=KILL_WAIT_SECONDS)
            draining.cancel_scope.cancel()


async def serve(args: argparse.Namespace) -> int:
    dialect: Dialect = "current" if args.command == CURRENT_COMMAND else "legacy"
    option = ServingOption(args.prefix_reuse)
    config = load_config(args.config)
    port = loopback_port(args.bind_addr)
    binary = native_server()
    # Bind first: a busy port refuses the stage before any child starts.
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    upstream_port = free_port()
    argv = child_argv(binary, config, option, upstream_port, os.environ)
    _say(
        f"serving option prefix_reuse={option.prefix_reuse} "
        f"({json.dumps(option.describe(), sort_keys=True)}); child: {' '.join(argv)}"
    )
    ending = _Ending()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child_environment(os.environ),
            start_new_session=True,
        )
        try:
            upstream = httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{upstream_port}",
                timeout=httpx.Timeout(None, connect=10.0),
                # llama-server closes a connection after each streamed reply: never reuse one.
                limits=httpx.Limits(max_keepalive_connections=0),
            )
            async with upstream, trio.open_nursery() as nursery:
                assert process.stdout is not None
                nursery.start_soon(_pump, process.stdout)

                async def on_signal() -> None:
                    async for signum in signals:
                        ending.code, ending.reason = ExitCode.OK, signal.Signals(signum).name
                        nursery.cancel_scope.cancel()
                        return

                async def on_child_exit() -> None:
                    code = await process.wait()
                    ending.code, ending.reason = ExitCode.FAILED, f"{BACKEND} exited with {code}"
                    nursery.cancel_scope.cancel()

                nursery.start_soon(on_signal)
                nursery.start_soon(on_child_exit)
                try:
                    await _upstream_ready(upstream, process)
                    relay = Relay(
                        config, option, upstream, trio.Semaphore(args.generation_concurrency)
                    )
                    await nursery.start(trio.serve_listeners, relay.handle, listeners)
                    await _answers_models(port, config.model_id)
                    _say(f"ready: /v1/models answered through 127.0.0.1:{port}")
                except (RuntimeError, httpx.HTTPError, ValueError) as error:
                    ending.reason = f"not ready: {error}"
                    nursery.cancel_scope.cancel()
                    return ExitCode.FAILED
                line = listening_line(
                    dialect,
                    port,
                    model_id=config.model_id,
                    generation_concurrency=args.generation_concurrency,
                    backend=BACKEND,
                )
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        finally:
            await _stop(process)
            _say(f"stopped ({ending.reason}); {BACKEND} exited with {process.returncode}")
    return ending.code


# --- command line -------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Reference oracle of the Skippy stage server (cache-family-bench): serves "
        "the OpenAI chat API for one stage config by supervising the native llama-server.",
    )
    top.add_argument(
        "--prefix-reuse",
        choices=("on", "off"),
        default="on",
        help="off: no request reuses an earlier prompt's KV (llama-server --no-cache-prompt "
        "--cache-ram 0, cache_prompt forced false); the demo's old arm",
    )
    commands = top.add_subparsers(dest="command", required=True)
    for command, dialect in ((CURRENT_COMMAND, "current"), (LEGACY_COMMAND, "legacy")):
        sub = commands.add_parser(
            command, help=f"serve one stage; prints the {dialect} dialect's listening line"
        )
        sub.add_argument("--config", required=True, help="the stage.json the run wrote")
        sub.add_argument("--bind-addr", required=True, help="127.0.0.1:PORT (0: any free port)")
        sub.add_argument("--generation-concurrency", type=_positive, required=True)
        sub.add_argument("--telemetry-level", choices=TELEMETRY_LEVELS, default="info")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    started = time.monotonic()
    try:
        code = trio.run(serve, args)
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"{PROGRAM}: error: {refusal.line()}", file=sys.stderr)
        return ExitCode.REFUSED
    except OSError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return ExitCode.FAILED
    _say(f"exit {code} after {time.monotonic() - started:.1f} s")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
