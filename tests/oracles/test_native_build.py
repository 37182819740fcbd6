"""The native build: refusals before any compile, the pin check, and the installed output.

The refusal tests run everywhere in about a second: they shape PATH and pip's environment so
the builder meets a machine without a compiler, without cmake, without a registry, or with a
registry serving other bytes (a generated stand-in sdist served from a local directory: a
fault injection, never built). The output tests use the real cached build through the
``native_parts`` fixture.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from cache_family.errors import Refused
from cache_family.oracles import native_build
from cache_family.oracles.native_parts import (
    Parts,
    ensure_native,
    free_port,
    producer_matches,
    tools_dir,
)
from cache_family.system.hashing import sha256_file


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("CACHE_FAMILY_CACHE", str(cache))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    return cache


def _path_with(tmp_path: Path, tools: dict[str, str]) -> str:
    """A PATH directory holding only the named tools (links to the real ones)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, real in tools.items():
        (bin_dir / name).symlink_to(real)
    return str(bin_dir)


def test_no_compiler_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", _path_with(tmp_path, {}))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(Refused) as refused:
        native_build.find_toolchain()
    assert refused.value.codes == ["native.no_compiler"]


def test_no_cmake_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc, cxx = _real("cc", "gcc"), _real("c++", "g++")
    monkeypatch.setenv("PATH", _path_with(tmp_path, {"cc": cc, "c++": cxx}))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(Refused) as refused:
        native_build.find_toolchain()
    assert refused.value.codes == ["native.no_cmake"]


def _real(*names: str) -> str:
    import shutil

    for name in names:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(f"this machine has none of {names}; the native build needs a compiler")


def test_unreachable_registry_is_refused(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(Refused) as refused:
        native_build.fetch_sdist(native_build.source_pin(), io.StringIO())
    assert refused.value.codes == ["native.registry_unreachable"]
    assert not list((private_cache / "sdist").glob("*.tar.gz"))


def _stand_in_sdist(directory: Path, pin: native_build.SourcePin) -> Path:
    """An sdist with the pinned name and version but other bytes (it can only be downloaded)."""
    root = f"{pin.sdist_name.removesuffix('.tar.gz')}"
    source = directory / "src" / root
    source.mkdir(parents=True)
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    )
    (source / "backend.py").write_text(
        "import os\n"
        "def prepare_metadata_for_build_wheel(directory, config_settings=None):\n"
        f"    name = '{root}.dist-info'\n"
        "    os.makedirs(os.path.join(directory, name))\n"
        "    with open(os.path.join(directory, name, 'METADATA'), 'w') as out:\n"
        f"        out.write('Metadata-Version: 2.1\\nName: {pin.package}\\n"
        f"Version: {pin.version}\\n')\n"
        "    return name\n"
    )
    links = directory / "links"
    links.mkdir()
    with tarfile.open(links / pin.sdist_name, "w:gz") as archive:
        archive.add(source, arcname=root)
    return links


def test_registry_serving_other_bytes_is_refused_as_pin_mismatch(
    private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pin = native_build.source_pin()
    links = _stand_in_sdist(tmp_path / "registry", pin)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(Refused) as refused:
        native_build.fetch_sdist(pin, io.StringIO())
    assert refused.value.codes == ["native.pin_mismatch"]
    assert pin.sdist_sha256 in str(refused.value)
    assert not (private_cache / "sdist" / pin.sdist_name).exists(), "foreign bytes kept"


def test_a_cached_sdist_matching_the_pin_is_used_without_the_registry(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = private_cache / "sdist"
    store.mkdir(parents=True)
    sdist = store / "tiny-1.0.tar.gz"
    sdist.write_bytes(b"pinned bytes")
    pin = dataclasses.replace(
        native_build.source_pin(),
        sdist_name=sdist.name,
        sdist_sha256=hashlib.sha256(b"pinned bytes").hexdigest(),
    )
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    assert native_build.fetch_sdist(pin, io.StringIO()) == sdist


def test_relative_output_is_refused() -> None:
    with pytest.raises(Refused) as refused:
        native_build.install(Path("relative/out"), io.StringIO())
    assert refused.value.codes == ["native.output_not_absolute"]


def test_cache_key_covers_the_pin_and_every_option() -> None:
    pin = native_build.source_pin()
    options = native_build.build_options()
    key = native_build.cache_key(pin, options)
    assert key == native_build.cache_key(pin, dict(options))
    assert key != native_build.cache_key(pin, {**options, "GGML_NATIVE": "ON"})
    other = dataclasses.replace(pin, sdist_sha256="0" * 64)
    assert key != native_build.cache_key(other, options)
    # The web UI download must stay off: it would reach for a model hub during the build.
    assert options["LLAMA_USE_PREBUILT_UI"] == "OFF"


def test_cached_build_entry_is_none_in_an_empty_cache(private_cache: Path) -> None:
    assert native_build.cached_build_entry() is None


# --- where install may write ------------------------------------------------------------------

OLD_STYLE_LIBS = {
    # An entry built before the soname links were kept: three byte-identical copies.
    "libggml.so": b"ggml library bytes",
    "libggml.so.0": b"ggml library bytes",
    "libggml.so.0.25.3": b"ggml library bytes",
    # A chain whose copies differ is not a chain of links: left alone.
    "libodd.so": b"odd bytes one",
    "libodd.so.1": b"odd bytes two",
    "libllama-server-impl.so": b"a library without a soname chain",
}


@pytest.fixture
def stand_in_cache_entry(private_cache: Path) -> Path:
    """A cache entry for the pinned key that install copies and nothing ever executes.

    Its bytes are stand-ins (fault injection for the install step only); with it present,
    ``install`` never compiles.
    """
    entry = (
        private_cache
        / "llama.cpp"
        / native_build.cache_key(native_build.source_pin(), native_build.build_options())
    )
    (entry / "bin").mkdir(parents=True)
    (entry / "lib").mkdir()
    (entry / "bin" / "llama-server").write_bytes(b"stand-in server bytes, never executed")
    for name, data in OLD_STYLE_LIBS.items():
        (entry / "lib" / name).write_bytes(data)
    (entry / "build-info.json").write_text(json.dumps({"compiler": "stand-in"}))
    return entry


@pytest.fixture
def no_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_cache: Path) -> None:
    """No compiler and an empty build cache: an install that got past its output checks would
    stop at ``native.no_compiler``, so an output refusal proves it came before any build."""
    monkeypatch.setenv("PATH", _path_with(tmp_path, {}))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)


def _snapshot(root: Path) -> dict[str, str]:
    seen = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            seen[str(path)] = "link:" + os.readlink(path)
        elif path.is_file():
            seen[str(path)] = "file:" + path.read_text()
    return seen


def test_install_refuses_a_symlink_at_output_native(no_toolchain: None, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("not the installer's")
    out = tmp_path / "out"
    out.mkdir()
    (out / "native").symlink_to(elsewhere)
    with pytest.raises(Refused) as refused:
        native_build.install(out, io.StringIO())
    assert refused.value.codes == ["native.output_not_ours"]
    assert refused.value.refusals[0].path == "$.output"
    assert (out / "native").is_symlink()
    assert (elsewhere / "precious").read_text() == "not the installer's"


def test_install_refuses_an_output_that_is_a_file(no_toolchain: None, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("a file")
    with pytest.raises(Refused) as refused:
        native_build.install(out, io.StringIO())
    assert refused.value.codes == ["native.output_unusable"]
    assert out.read_text() == "a file"


def test_install_refuses_a_native_directory_no_producer_names(
    no_toolchain: None, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    (out / "native").mkdir(parents=True)
    (out / "native" / "someone-elses").write_text("kept")
    before = _snapshot(out)
    with pytest.raises(Refused) as refused:
        native_build.install(out, io.StringIO())
    assert refused.value.codes == ["native.output_not_ours"]
    assert _snapshot(out) == before


def test_install_refuses_a_producer_json_it_did_not_write(
    no_toolchain: None, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "producer.json").write_text('{"producer": "someone else"}')
    with pytest.raises(Refused) as refused:
        native_build.install(out, io.StringIO())
    assert refused.value.codes == ["native.output_not_ours"]
    assert (out / "producer.json").read_text() == '{"producer": "someone else"}'


def test_install_into_an_impossible_path_is_a_refusal(stand_in_cache_entry: Path) -> None:
    with pytest.raises(Refused) as refused:
        native_build.install(Path("/proc/cache-family-native-test"), io.StringIO())
    assert refused.value.codes == ["native.output_unusable"]
    assert "/proc/cache-family-native-test" in str(refused.value)


def test_install_replaces_its_own_earlier_install_whole(
    stand_in_cache_entry: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    native_build.install(out, io.StringIO())
    (out / "native" / "left-over").write_text("from the earlier install")
    producer = native_build.install(out, io.StringIO())
    assert not (out / "native" / "left-over").exists()
    assert producer["native"] == str(out / "native")
    assert producer_matches(out)


def test_install_from_an_old_entry_links_identical_soname_copies(
    stand_in_cache_entry: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    producer = native_build.install(out, io.StringIO())
    lib = out / "native" / "lib"
    assert os.readlink(lib / "libggml.so") == "libggml.so.0"
    assert os.readlink(lib / "libggml.so.0") == "libggml.so.0.25.3"
    assert not (lib / "libggml.so.0.25.3").is_symlink()
    assert (lib / "libggml.so").read_bytes() == b"ggml library bytes"
    for name in ("libodd.so", "libodd.so.1", "libllama-server-impl.so"):
        assert not (lib / name).is_symlink(), name
        assert (lib / name).read_bytes() == OLD_STYLE_LIBS[name]
    assert sorted(producer["files"]) == [
        "native/bin/llama-server",
        "native/lib/libggml.so.0.25.3",
        "native/lib/libllama-server-impl.so",
        "native/lib/libodd.so",
        "native/lib/libodd.so.1",
    ]
    assert producer_matches(out)
    # The cache entry itself is never rewritten: only the installed copy is.
    assert not (stand_in_cache_entry / "lib" / "libggml.so").is_symlink()


def test_a_redirected_soname_link_no_longer_matches_its_producer(
    stand_in_cache_entry: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    producer = native_build.install(out, io.StringIO())
    assert producer["links"]["native/lib/libggml.so"] == "libggml.so.0"
    assert producer_matches(out)
    link = out / "native" / "lib" / "libggml.so"
    link.unlink()
    link.symlink_to("libodd.so")
    assert not producer_matches(out)


def test_parts_cache_replaces_an_interrupted_install(stand_in_cache_entry: Path) -> None:
    """The parts cache's tools directory is the cache's own: an install cut short before its
    producer record is cleared there (``install`` alone would refuse it) and redone."""
    tools = tools_dir()
    (tools / "native" / "bin").mkdir(parents=True)
    (tools / "native" / "bin" / "llama-server").write_bytes(b"half copied")
    assert ensure_native(io.StringIO(), build=False) == tools
    assert producer_matches(tools)
    assert (tools / "native" / "bin" / "llama-server").read_bytes() != b"half copied"


# --- the real build ---------------------------------------------------------------------------


def test_producer_json_hashes_match_the_installed_files(native_parts: Parts) -> None:
    producer = json.loads(native_parts.producer_json.read_text())
    pin = native_build.source_pin()
    assert producer["source"]["version"] == pin.version
    assert producer["source"]["sdist_sha256"] == pin.sdist_sha256
    assert producer["options"] == native_build.build_options()
    assert producer["compiler"] and producer["compiler"] != "unknown"
    installed = {
        str(p.relative_to(native_parts.tools))
        for p in native_parts.native_build.rglob("*")
        if p.is_file() and not p.is_symlink()
    }
    links = {
        str(p.relative_to(native_parts.tools)): os.readlink(p)
        for p in native_parts.native_build.rglob("*")
        if p.is_symlink()
    }
    assert set(producer["files"]) == installed
    assert producer.get("links", {}) == links
    for relative in links:  # every link resolves to a hashed file inside the tree
        target = (native_parts.tools / relative).resolve()
        assert str(target.relative_to(native_parts.tools.resolve())) in producer["files"]
    assert "native/bin/llama-server" in installed
    assert any(name.startswith("native/lib/libllama") for name in installed)
    for relative, digest in producer["files"].items():
        assert sha256_file(native_parts.tools / relative) == digest, relative
    assert producer_matches(native_parts.tools)


def test_a_modified_file_no_longer_matches_its_producer(
    native_parts: Parts, tmp_path: Path
) -> None:
    out = tmp_path / "tools"
    native_build.install(out, io.StringIO())
    assert producer_matches(out)
    library = next((out / "native" / "lib").glob("libllama*"))
    with library.open("ab") as handle:
        handle.write(b"\0")
    assert not producer_matches(out)


def test_the_build_command_installs_a_runnable_server(native_parts: Parts, tmp_path: Path) -> None:
    """``just skippy-workload-oracles-build OUTPUT`` runs exactly this module."""
    out = tmp_path / "out"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    if "CACHE_FAMILY_CACHE" in os.environ:
        env["CACHE_FAMILY_CACHE"] = os.environ["CACHE_FAMILY_CACHE"]
    done = subprocess.run(
        [sys.executable, "-m", "cache_family.oracles.native_build", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    server = out / "native" / "bin" / "llama-server"
    assert os.access(server, os.X_OK)
    producer = json.loads((out / "producer.json").read_text())
    assert producer["files"]["native/bin/llama-server"] == sha256_file(server)
    version = subprocess.run(
        [str(server), "--version"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
        check=False,
    )
    assert version.returncode == 0, version.stderr
    assert "version" in (version.stdout + version.stderr)


GUIDE_TOOLS = ("skippy", "skippy-correctness", "skippy-package-builder")


def _run_tool(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(path), *args],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )


def test_the_recipe_lays_out_the_guides_tool_paths_pinned_in_producer_json(
    stand_in_cache_entry: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tools"
    just = Path(sys.executable).with_name("just")
    justfile = Path(__file__).resolve().parents[2] / "justfile"
    subprocess.run(
        [str(just), "--justfile", str(justfile), "skippy-workload-oracles-build", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    producer = json.loads((out / "producer.json").read_text())
    assert (out / "native" / "bin" / "llama-server").is_file()
    assert producer_matches(out)
    tools = producer["tools"]
    for name in GUIDE_TOOLS:
        path = out / "cargo" / "debug" / name
        assert path.is_file() and os.access(path, os.X_OK), name
        assert (
            tools[f"cargo/debug/{name}"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        )
    runtime = producer["oracle_runtime"]
    assert runtime["distribution"] == "cache-family-bench"
    assert runtime["package_source_sha256"] == native_build.package_source_sha256()
    assert runtime["interpreter"] == sys.executable
    assert tools["cargo/debug/skippy"]["serving_option"] == {"prefix_reuse": "on"}
    assert tools["cargo/debug/skippy-prefix-reuse-off"]["serving_option"] == {"prefix_reuse": "off"}
    skippy = out / "cargo" / "debug" / "skippy"
    assert f"CACHE_FAMILY_ORACLE_NATIVE={out / 'native'}" in skippy.read_text()
    for args in (["serve", "--help"], ["serve-openai", "--help"]):
        answered = _run_tool(skippy, *args)
        assert answered.returncode == 0 and "--generation-concurrency" in answered.stdout
    answered = _run_tool(out / "cargo" / "debug" / "skippy-package-builder", "--help")
    assert answered.returncode == 0 and "admit-package" in answered.stdout


def test_a_launcher_refuses_package_source_it_was_not_built_for() -> None:
    result = subprocess.run(
        [sys.executable, "-I", "-m", "cache_family.oracles.launch", "0" * 64, "package_builder"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 126
    assert "oracle.source_changed" in result.stderr


def test_an_install_replaces_its_own_tools_and_refuses_a_foreign_cargo_dir(
    stand_in_cache_entry: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    native_build.install(out, io.StringIO(), tools=True)
    (out / "cargo" / "debug" / "left-over").write_text("from the earlier install")
    native_build.install(out, io.StringIO(), tools=True)
    assert not (out / "cargo" / "debug" / "left-over").exists()
    other = tmp_path / "other"
    (other / "cargo").mkdir(parents=True)
    with pytest.raises(Refused) as refused:
        native_build.install(other, io.StringIO(), tools=True)
    assert refused.value.codes == ["native.output_not_ours"]
