"""The stage server oracle (``skippy serve`` / ``serve-openai``) as a real child process.

Native tests run it over the real ``llama-server`` build and the zoo's tiny llama model; its
stdout and stderr share one pipe, so the order of its lines is the order it wrote them.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cache_family.schemas.gguf_header import read_gguf_header
from cache_family.schemas.stage_server import listening_line

STARTUP_SECONDS = 300.0
# The native_parts fixture's type (oracles' Parts); named loosely so this file does not pin
# the module that defines it.
Parts = Any


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def stage_json(tmp_path: Path, model: Path, model_id: str = "tiny/llama:F16", **extra: Any) -> Path:
    header = read_gguf_header(os.path.realpath(model))
    config = {
        "run_id": "cache-family-serving-cell",
        "topology_id": "cache-family-single-stage",
        "model_id": model_id,
        "model_path": str(model),
        "source_model_sha256": "0" * 64,
        "stage_id": "stage-0",
        "stage_index": 0,
        "layer_start": 0,
        "layer_end": header.block_count,
        "ctx_size": 1024,
        "lane_count": 2,
        "n_gpu_layers": 0,
        "load_mode": "runtime-slice",
        "execution_contract": "",
        "bind_addr": "127.0.0.1:0",
        "upstream": None,
        "downstream": None,
        "kv_server": None,
        **extra,
    }
    path = tmp_path / "stage.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def oracle_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "cache_family.oracles.stage_server", *args]


@dataclass
class Served:
    process: subprocess.Popen[str]
    port: int
    lines: list[str] = field(default_factory=list)
    feed: queue.Queue[str | None] = field(default_factory=queue.Queue)

    def wait_for(self, wanted: str, seconds: float = STARTUP_SECONDS) -> None:
        while True:
            line = self.feed.get(timeout=seconds)
            if line is None:
                raise AssertionError("the stage server ended:\n" + "".join(self.lines[-40:]))
            if line.rstrip("\n") == wanted:
                return

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def _drain(served: Served) -> None:
    assert served.process.stdout is not None
    for line in served.process.stdout:
        served.lines.append(line)
        served.feed.put(line)
    served.feed.put(None)


@contextmanager
def stage_server(
    native_parts: Parts, config: Path, command: str = "serve", *leading: str, lanes: int = 2
) -> Iterator[Served]:
    port = free_port()
    env = {
        "PATH": "/usr/bin:/bin",
        "LLAMA_STAGE_BUILD_DIR": str(native_parts.native_build),
        "OMP_NUM_THREADS": "1",
        "SKIPPY_TELEMETRY_STDERR": "1",
    }
    process = subprocess.Popen(
        oracle_argv(
            *leading,
            command,
            "--config",
            str(config),
            "--bind-addr",
            f"127.0.0.1:{port}",
            "--generation-concurrency",
            str(lanes),
            "--telemetry-level",
            "debug",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    served = Served(process, port)
    reader = threading.Thread(target=_drain, args=(served,), daemon=True)
    reader.start()
    try:
        yield served
    finally:
        # SIGTERM first: the stage server ends its backend, which runs in a session of its
        # own; SIGKILL alone left that llama-server behind after every test.
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        reader.join(timeout=10)


def chat(served: Served, content: str, **extra: Any) -> httpx.Response:
    body = {
        "model": "tiny/llama:F16",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(served.url("/v1/chat/completions"), json=body, timeout=120)


@pytest.mark.native
def test_marker_follows_models_through_the_relay_then_stream_then_sigterm_leaves_nothing(
    native_parts: Parts, tmp_path: Path
) -> None:
    config = stage_json(tmp_path, native_parts.model_path("llama"))
    with stage_server(native_parts, config) as served:
        marker = listening_line(
            "current", served.port, model_id="tiny/llama:F16", generation_concurrency=2, backend=""
        )
        served.wait_for(marker)
        text = "".join(served.lines)
        checked = text.index(f"/v1/models answered through 127.0.0.1:{served.port}")
        assert text.index("srv  llama_server: listening on") < checked < text.index(marker)
        assert text.count(marker) == 1

        models = httpx.get(served.url("/v1/models"), timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny/llama:F16"]
        assert models["data"][0]["cache_family_oracle"]["prefix_reuse"] == "on"

        chunks: list[dict[str, Any]] = []
        body = {
            "model": "tiny/llama:F16",
            "messages": [{"role": "user", "content": "tell me about the sea"}],
            "max_tokens": 5,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", served.url("/v1/chat/completions"), json=body, timeout=120) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        generated = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert generated
        # The relay asks llama-server for its own timings on every chunk and passes them on:
        # the generation time runs on from the first generated token.
        predicted = [(c["timings"]["predicted_n"], c["timings"]["predicted_ms"]) for c in generated]
        assert predicted == sorted(predicted) and predicted[0][0] >= 1
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 0

        family = psutil.Process(served.process.pid).children(recursive=True)
        assert [p.name() for p in family] == ["llama-server"]
        os.kill(served.process.pid, signal.SIGTERM)
        assert served.process.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive and len(gone) == 1
        assert not psutil.pid_exists(family[0].pid) or family[0].status() == psutil.STATUS_ZOMBIE
        assert "stopped (SIGTERM)" in "".join(served.lines)


def timings_cache_n(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    cached: int = reply.json()["timings"]["cache_n"]
    return cached


@pytest.mark.native
def test_prefix_reuse_off_is_the_same_output_without_cache_hits(
    native_parts: Parts, tmp_path: Path
) -> None:
    config = stage_json(tmp_path, native_parts.model_path("llama"), lane_count=1)
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    outputs = {}
    for reuse in ("on", "off"):
        with stage_server(
            native_parts, config, "serve-openai", "--prefix-reuse", reuse, lanes=1
        ) as served:
            served.wait_for(
                listening_line(
                    "legacy",
                    served.port,
                    model_id="tiny/llama:F16",
                    generation_concurrency=1,
                    backend="llama-server",
                )
            )
            first = chat(served, prompt)
            second = chat(served, prompt)
            hits = timings_cache_n(first), timings_cache_n(second)
            assert hits[1] > 0 if reuse == "on" else hits == (0, 0)
            outputs[reuse] = second.json()["choices"][0]["message"]["content"]
            meta = httpx.get(served.url("/v1/models"), timeout=30).json()["data"][0]
            assert meta["cache_family_oracle"]["prefix_reuse"] == reuse
            assert f"serving option prefix_reuse={reuse}" in "".join(served.lines)
    assert outputs["on"] == outputs["off"]


@pytest.mark.native
def test_a_busy_port_stops_the_stage_before_any_child(native_parts: Parts, tmp_path: Path) -> None:
    config = stage_json(tmp_path, native_parts.model_path("llama"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            oracle_argv(
                "serve",
                "--config",
                str(config),
                "--bind-addr",
                f"127.0.0.1:{port}",
                "--generation-concurrency",
                "1",
            ),
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "LLAMA_STAGE_BUILD_DIR": str(native_parts.native_build)},
            timeout=60,
            check=False,
        )
    assert result.returncode == 1 and result.stdout == ""
    assert "child:" not in result.stderr


@pytest.mark.parametrize("command", ["serve", "serve-openai"])
def test_both_dialects_answer_help(command: str) -> None:
    result = subprocess.run(
        oracle_argv(command, "--help"), capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0
    for flag in ("--config", "--bind-addr", "--generation-concurrency", "--telemetry-level"):
        assert flag in result.stdout


def test_an_unknown_command_or_flag_is_refused() -> None:
    for args in (["serve-grpc", "--help"], ["serve", "--config", "x", "--bogus"]):
        result = subprocess.run(
            oracle_argv(*args), capture_output=True, text=True, check=False, timeout=60
        )
        assert result.returncode == 2, args


def test_a_layer_package_stage_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "stage.json"
    config.write_text(
        json.dumps(
            {
                "model_id": "m",
                "model_path": str(tmp_path / "m.gguf"),
                "layer_end": 4,
                "ctx_size": 64,
                "lane_count": 1,
                "load_mode": "layer-package",
            }
        )
    )
    result = subprocess.run(
        oracle_argv(
            "serve",
            "--config",
            str(config),
            "--bind-addr",
            "127.0.0.1:0",
            "--generation-concurrency",
            "1",
        ),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    assert "stage_server.config_unsupported" in result.stderr


@pytest.mark.native
def test_a_child_that_dies_ends_the_stage_server_with_a_failure(
    native_parts: Parts, tmp_path: Path
) -> None:
    config = stage_json(tmp_path, native_parts.model_path("llama"))
    with stage_server(native_parts, config, "serve-openai", lanes=2) as served:
        served.wait_for(
            listening_line(
                "legacy",
                served.port,
                model_id="tiny/llama:F16",
                generation_concurrency=2,
                backend="llama-server",
            )
        )
        (child,) = psutil.Process(served.process.pid).children(recursive=True)
        child.kill()
        assert served.process.wait(timeout=60) == 1
        assert "llama-server exited with -9" in "".join(served.lines)


def test_a_child_logging_its_shutdown_past_the_pipe_still_exits_on_sigterm(
    tmp_path: Path,
) -> None:
    """FAKE llama-server (fault injection) that logs half a megabyte when told to stop: the
    stage server keeps reading its output while it waits, so the child ends on SIGTERM, not
    by SIGKILL after a grace (a run's host custody kills the stage server first, and the
    child, in its own session, outlived it)."""
    from cache_family.oracles.zoo import BUILDERS

    fake = (
        Path(__file__).parent.parent / "support/fake_hosts/fake_llama_server_floods_on_sigterm.py"
    )
    build = tmp_path / "fake-build"
    (build / "bin").mkdir(parents=True)
    binary = build / "bin" / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + fake.read_text())
    binary.chmod(0o755)
    (tmp_path / "model").mkdir()
    model = BUILDERS["llama"](tmp_path / "model", 0).files[0]
    config = stage_json(tmp_path, model)

    @dataclass
    class FakeParts:
        native_build: Path

    with stage_server(FakeParts(build), config, "serve-openai", lanes=2) as served:
        served.wait_for(
            listening_line(
                "legacy",
                served.port,
                model_id="tiny/llama:F16",
                generation_concurrency=2,
                backend="llama-server",
            ),
            seconds=60,
        )
        os.killpg(served.process.pid, signal.SIGTERM)
        assert served.process.wait(timeout=60) == 0
    output = "".join(served.lines)
    assert "fake llama-server: stopped" in output
    assert "llama-server exited with 0" in output, output[-2000:]
