"""ctypes bindings for the llama_ridgefill_* functions, next to llama-cpp-python's own.

They bind to the very library llama-cpp-python loaded, so both see one process-wide libllama.
The upstream build has none of these symbols: `available()` says so instead of failing later.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .. import libs

# the API version these bindings were written for; a library that reports another one is refused
API_VERSION = 1


class RidgeFillUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class RidgeFillLib:
    api_version: int
    build_info: str


def _lib() -> ctypes.CDLL:
    return libs.llama_cpp_module().llama_cpp._lib


def available() -> bool:
    return hasattr(_lib(), "llama_ridgefill_api_version")


def load() -> RidgeFillLib:
    lib = _lib()
    if not hasattr(lib, "llama_ridgefill_api_version"):
        raise RidgeFillUnavailable(
            f"the loaded libllama ({libs.loaded_lib_dir()}) has no llama_ridgefill_* API: it is not a RidgeFill build")
    lib.llama_ridgefill_api_version.restype = ctypes.c_uint32
    lib.llama_ridgefill_api_version.argtypes = []
    lib.llama_ridgefill_build_info.restype = ctypes.c_char_p
    lib.llama_ridgefill_build_info.argtypes = []
    version = lib.llama_ridgefill_api_version()
    if version != API_VERSION:
        raise RidgeFillUnavailable(
            f"libllama reports RidgeFill API {version}, these bindings speak {API_VERSION}: rebuild (`make build`)")
    return RidgeFillLib(api_version=version, build_info=lib.llama_ridgefill_build_info().decode())
