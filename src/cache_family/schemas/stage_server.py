"""A stage server's config file (``stage.json``) and the listening lines of its two dialects.

Members this reader does not know are ignored (the reference writers differ). A captured line
over 16384 bytes never counts as a listening line.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

import msgspec

Dialect = Literal["current", "legacy"]
CURRENT_COMMAND: Final = "serve"
LEGACY_COMMAND: Final = "serve-openai"


class StageConfig(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str = ""
    topology_id: str = ""
    model_id: str
    model_path: str
    source_model_sha256: str = ""
    stage_id: str = "stage-0"
    stage_index: int = 0
    layer_start: int = 0
    layer_end: int
    ctx_size: int
    lane_count: int
    n_gpu_layers: int = 0
    load_mode: str = "runtime-slice"
    bind_addr: str = "127.0.0.1:0"
    upstream: Any = None
    downstream: Any = None
    kv_server: Any = None


def listening_line(
    dialect: Dialect, port: int, *, model_id: str, generation_concurrency: int, backend: str
) -> str:
    """The one line a stage server prints once it answers on ``127.0.0.1:port``."""
    address = f"127.0.0.1:{port}"
    if dialect == "current":
        status = {
            "schema_version": 1,
            "sequence": 1,
            "type": "status",
            "data": {"message": f"skippy-serving listening: openai={address}", "context": None},
        }
        return json.dumps(status, separators=(",", ":"))
    return (
        f"skippy-server listening: openai={address} model_id={model_id} backend={backend} "
        f"generation_concurrency={generation_concurrency}"
    )


LINE_MAX_BYTES: Final = 16384


def is_listening_line(
    dialect: Dialect, line: str, port: int, *, model_id: str, generation_concurrency: int
) -> bool:
    """Whether one captured line of the host is its dialect's listening line for ``port``."""
    if len(line.encode("utf-8", errors="surrogatepass")) > LINE_MAX_BYTES:
        return False
    text = line.strip()
    address = f"127.0.0.1:{port}"
    if dialect == "legacy":
        prefix = f"skippy-server listening: openai={address} model_id={model_id} backend="
        if not text.startswith(prefix):
            return False
        return f"generation_concurrency={generation_concurrency}" in text[len(prefix) :].split()
    try:
        status = json.loads(text)
    except ValueError:
        return False
    if not isinstance(status, dict):
        return False
    sequence, data = status.get("sequence"), status.get("data")
    return (
        status.get("schema_version") == 1
        and not isinstance(sequence, bool)
        and isinstance(sequence, int)
        and sequence > 0
        and status.get("type") == "status"
        and isinstance(data, dict)
        and data.get("message") == f"skippy-serving listening: openai={address}"
    )
