"""The ``llama-cpp-python`` bindings on the project's own ``libllama``, installed without compiling.

The bindings come from the same pinned sdist the native build compiles (``llama_cpp_source.json``),
installed with ``CMAKE_ARGS=-DLLAMA_BUILD=OFF`` so pip builds no second copy of llama.cpp
(about 10 s instead of 10 minutes), and they load the shared library of the native build
through ``LLAMA_CPP_LIB_PATH``. Without a library the package fails at import, so nothing
imports it before :func:`load` has set that variable: ``cache-family`` works without them.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from importlib import metadata
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


def ensure_installed(progress: TextIO) -> None:
    """Install the pinned bindings into this interpreter's environment unless present.

    Installs the pin-checked cached sdist (downloaded once for the native build), so the
    bindings' Python code is exactly the version whose C API the library exports.
    """
    if installed():
        return
    pin = native_build.source_pin()
    sdist = native_build.fetch_sdist(pin, progress)
    print(f"bindings: installing {requirement()} without compiling", file=progress, flush=True)
    env = native_build._tool_env()
    env["CMAKE_ARGS"] = "-DLLAMA_BUILD=OFF"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", sdist],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=1800,
    )
    if result.returncode != 0 or not installed():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise Refused.one(
            "bindings.install_failed",
            "$",
            f"pip could not install {requirement()}: {' | '.join(tail)}",
            "check that the package registry is reachable (pip fetches the build backend)",
        )


def library_dir(environ: dict[str, str] | None = None) -> Path:
    """Where ``libllama.so`` is: ``$LLAMA_STAGE_BUILD_DIR/lib``, else ``$LLAMA_CPP_LIB_PATH``.

    The run's native build comes first: it is the build the run pinned.
    """
    env = os.environ if environ is None else environ
    if env.get(STAGE_BUILD_ENV):
        where = Path(env[STAGE_BUILD_ENV]) / "lib"
    elif env.get(LIB_PATH_ENV):
        where = Path(env[LIB_PATH_ENV])
    else:
        raise Refused.one(
            "bindings.library_unset",
            "$",
            f"neither {LIB_PATH_ENV} nor {STAGE_BUILD_ENV} names the native build",
            f"set {STAGE_BUILD_ENV} to the native build directory (OUTPUT/native)",
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
