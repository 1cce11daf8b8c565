"""Choose which libllama a process uses: the upstream build or the patched RidgeFill build.

llama-cpp-python loads its library once, at import, from LLAMA_CPP_LIB_PATH. So the choice is made
before `llama_cpp` is imported and holds for the whole process; comparing builds needs one process each.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from .paths import build_dir

BUILDS = ("upstream", "ridgefill")
ENV_BUILD = "RIDGEFILL_GGUF_BUILD"
LIB_NAME = "libllama.so" if sys.platform.startswith("linux") else "libllama.dylib"


class BuildSelectionError(RuntimeError):
    pass


def lib_dir(build: str | os.PathLike) -> Path:
    """The folder holding libllama for a build name ('upstream', 'ridgefill') or a path."""
    if str(build) in BUILDS:
        return build_dir(str(build)) / "bin"
    path = Path(build)
    return path if path.is_dir() and (path / LIB_NAME).exists() else path / "bin"


def find_binary(build: str, name: str) -> Path:
    path = lib_dir(build) / name
    if not path.exists():
        raise BuildSelectionError(f"{name} of the {build} build not found at {path}: run `make build`")
    return path


def use_build(build: str | os.PathLike | None = None) -> ModuleType:
    """Point llama-cpp-python at a build's libllama and return the `llama_cpp` module.

    build defaults to $RIDGEFILL_GGUF_BUILD, else 'ridgefill'. Refuses to switch a process that already
    loaded another library."""
    build = build or os.environ.get(ENV_BUILD, "ridgefill")
    want = lib_dir(build).resolve()
    if not (want / LIB_NAME).exists():
        raise BuildSelectionError(f"no {LIB_NAME} for build '{build}' in {want}: run `make build`")
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    if loaded is not None:
        have = Path(loaded._base_path).resolve()
        if have != want:
            raise BuildSelectionError(
                f"this process already loaded libllama from {have}; build '{build}' ({want}) needs a new process")
        return sys.modules["llama_cpp"]
    os.environ["LLAMA_CPP_LIB_PATH"] = str(want)
    import llama_cpp  # noqa: PLC0415 - the import must follow the environment variable

    return llama_cpp


def llama_cpp_module() -> ModuleType:
    """The loaded `llama_cpp`, or the default build's when none is loaded yet."""
    return sys.modules["llama_cpp"] if "llama_cpp.llama_cpp" in sys.modules else use_build(None)


def loaded_lib_dir() -> Path | None:
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    return Path(loaded._base_path).resolve() if loaded is not None else None
