"""The ``llama-cpp-python`` bindings on the project's own ``libllama``, installed without
compiling.

They are built from the native build's own pinned sdist with ``CMAKE_ARGS=-DLLAMA_BUILD=OFF``
and load its shared library through ``LLAMA_CPP_LIB_PATH``; nothing imports them before ``load``
has set that variable, so ``cache-family`` works without them.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata, resources
from pathlib import Path
from typing import Any, TextIO

from cache_family.errors import Refused
from cache_family.oracles import native_build

#: The variable the bindings read at import: the directory holding ``libllama.so``.
LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"
#: The native build directory a correctness tool is given by the run (``<native>/lib``).
STAGE_BUILD_ENV = "LLAMA_STAGE_BUILD_DIR"
_LIBRARY = "libllama.so"


def requirement() -> str:
    pin = native_build.source_pin()
    return f"{pin.package}=={pin.version}"


def installed() -> bool:
    pin = native_build.source_pin()
    try:
        return metadata.version(pin.package) == pin.version
    except metadata.PackageNotFoundError:
        return False


LOCK_NAME = "llama_bindings_lock.json"


def lock() -> dict[str, Any]:
    """The hash-pinned build backend and runtime dependencies (``llama_bindings_lock.json``)."""
    text = resources.files("cache_family.oracles").joinpath(LOCK_NAME).read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def requirement_files(sdist: Path) -> tuple[str, str]:
    """The two requirements files of the install, every line with its ``--hash``: first the
    build backend and the runtime dependencies, then the pinned sdist itself."""
    pinned = lock()
    lines = [
        f"{entry['name']}=={entry['version']} "
        + " ".join(f"--hash=sha256:{digest}" for digest in entry["sha256"])
        for entry in (*pinned["build"], *pinned["runtime"])
    ]
    pin = native_build.source_pin()
    return "\n".join(lines) + "\n", f"{sdist} --hash=sha256:{pin.sdist_sha256}\n"


def pip_install(requirements: str) -> list[str]:
    """pip in hash-checking mode: nothing unpinned, no dependency pip would pick itself, and
    no isolated build environment (it would fetch the backend unpinned)."""
    return [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--require-hashes", "--no-deps", "--no-build-isolation", "-r", requirements,
    ]  # fmt: skip


def ensure_installed(progress: TextIO) -> None:
    """Install the pinned bindings into this interpreter's environment unless present.

    Installs the pin-checked cached sdist (downloaded once for the native build), so the
    bindings' Python code is exactly the version whose C API the library exports; its build
    backend and runtime dependencies come hash-pinned from ``llama_bindings_lock.json``
    (numpy and typing-extensions from ``requirements.lock``, which ``bootstrap`` installs).
    """
    if installed():
        return
    pin = native_build.source_pin()
    sdist = native_build.fetch_sdist(pin, progress)
    print(f"bindings: installing {requirement()} without compiling", file=progress, flush=True)
    env = native_build.tool_env()
    env["CMAKE_ARGS"] = "-DLLAMA_BUILD=OFF"
    with tempfile.TemporaryDirectory() as tmp:
        for index, text in enumerate(requirement_files(sdist)):
            requirements = Path(tmp) / f"requirements-{index}.txt"
            requirements.write_text(text)
            result = subprocess.run(
                pip_install(str(requirements)),
                capture_output=True,
                text=True,
                env=env,
                check=False,
                timeout=1800,
            )
            if result.returncode != 0:
                break
    if result.returncode != 0 or not installed():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise Refused.one(
            "bindings.install_failed",
            "$",
            f"pip could not install {requirement()}: {' | '.join(tail)}",
            "check that the package registry is reachable and that its files still match "
            f"the hashes in {LOCK_NAME}",
        )


def library_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``libllama.so`` is: ``$LLAMA_STAGE_BUILD_DIR/lib``, else ``$LLAMA_CPP_LIB_PATH``,
    else ``$CACHE_FAMILY_ORACLE_NATIVE/lib``.

    The run's native build comes first: it is the build the run pinned. Called outside a run,
    the oracle uses the build its launcher was written with, as the stage-server oracle does.
    """
    env = os.environ if environ is None else environ
    if env.get(STAGE_BUILD_ENV):
        where = Path(env[STAGE_BUILD_ENV]) / "lib"
    elif env.get(LIB_PATH_ENV):
        where = Path(env[LIB_PATH_ENV])
    elif env.get(native_build.ORACLE_NATIVE_ENV):
        where = Path(env[native_build.ORACLE_NATIVE_ENV]) / "lib"
    else:
        raise Refused.one(
            "bindings.library_unset",
            "$",
            f"none of {STAGE_BUILD_ENV}, {LIB_PATH_ENV} and {native_build.ORACLE_NATIVE_ENV} "
            "names the native build",
            "run the tool through its launcher (it names its build), or set "
            f"{STAGE_BUILD_ENV} to the native build directory (OUTPUT/native)",
        )
    if not (where / _LIBRARY).is_file():
        raise Refused.one(
            "bindings.library_absent",
            "$",
            f"{where} holds no {_LIBRARY}",
            "point it at the lib/ directory of the native build (`just native-parts`)",
        )
    return where.resolve()


def load(lib_dir: Path) -> Any:
    """The low-level ctypes module ``llama_cpp.llama_cpp`` bound to ``lib_dir/libllama.so``.

    Typed as ``Any``: the bindings are optional and their stubs describe ctypes internals.
    """
    if not installed():
        raise Refused.one(
            "bindings.absent",
            "$",
            f"{requirement()} is not installed in {sys.prefix}",
            "run `just native-parts`, which installs the bindings without compiling",
        )
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    if loaded is None:
        os.environ[LIB_PATH_ENV] = str(lib_dir)
        try:
            loaded = importlib.import_module("llama_cpp.llama_cpp")
        except (OSError, RuntimeError) as error:
            raise Refused.one(
                "bindings.load_failed",
                "$",
                f"the bindings could not load {lib_dir / _LIBRARY}: {error}",
                "rebuild the native parts; the library and the bindings must be one version",
            ) from None
    bound = Path(getattr(loaded, "_base_path", "")).resolve()
    if bound != lib_dir:
        raise Refused.one(
            "bindings.other_library",
            "$",
            f"this process already bound the bindings to {bound}, not {lib_dir}",
            "run one correctness tool per process",
        )
    return loaded
