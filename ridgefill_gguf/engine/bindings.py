"""ctypes bindings for the llama_ridgefill_* functions, next to llama-cpp-python's own.

They bind to the very library llama-cpp-python loaded, so both see one process-wide libllama.
The upstream build has none of these symbols: `available()` says so instead of failing later.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

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


# name: (restype, argtypes)
_SIGNATURES = {
    "llama_ridgefill_api_version": (ctypes.c_uint32, []),
    "llama_ridgefill_build_info": (ctypes.c_char_p, []),
    "llama_ridgefill_arch_supported": (ctypes.c_bool, [ctypes.c_void_p]),
    "llama_ridgefill_capture_layer_input": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]),
    "llama_ridgefill_get_layer_input": (ctypes.POINTER(ctypes.c_float), [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_maps_load": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]),
    "llama_ridgefill_maps_free": (None, [ctypes.c_void_p]),
    "llama_ridgefill_last_error": (ctypes.c_char_p, []),
    "llama_ridgefill_maps_split": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_maps_n_layers": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_maps_layer": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_maps_tail_default": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_maps_lambda": (ctypes.c_float, [ctypes.c_void_p]),
    "llama_ridgefill_maps_bytes": (ctypes.c_uint64, [ctypes.c_void_p]),
    "llama_ridgefill_maps_warnings": (ctypes.c_char_p, [ctypes.c_void_p]),
}

PLACEMENTS = {"resident": 0, "streamed": 1}


class MapsRefused(ValueError):
    """The engine refused a maps file; the message is the engine's own ("<path>: problem; problem")."""


@dataclass
class LoadedMaps:
    handle: int
    split: int
    layers: list[int]
    tail_default: int | None
    lam: float | None
    bytes: int
    warnings: str

    def free(self) -> None:
        if self.handle:
            _bound().llama_ridgefill_maps_free(self.handle)
            self.handle = 0


def load_maps(model, path, placement: str = "resident") -> LoadedMaps:
    """Load a maps GGUF for a loaded model (llama_model pointer); refused files raise MapsRefused."""
    lib = _bound()
    handle = lib.llama_ridgefill_maps_load(model, str(path).encode(), PLACEMENTS[placement])
    if not handle:
        raise MapsRefused(lib.llama_ridgefill_last_error().decode())
    n = lib.llama_ridgefill_maps_n_layers(handle)
    tail, lam = lib.llama_ridgefill_maps_tail_default(handle), lib.llama_ridgefill_maps_lambda(handle)
    return LoadedMaps(handle, lib.llama_ridgefill_maps_split(handle),
                      [lib.llama_ridgefill_maps_layer(handle, i) for i in range(n)],
                      None if tail < 0 else tail, None if lam < 0 else lam, lib.llama_ridgefill_maps_bytes(handle),
                      lib.llama_ridgefill_maps_warnings(handle).decode())


def _bound() -> ctypes.CDLL:
    lib = _lib()
    if not hasattr(lib, "llama_ridgefill_api_version"):
        raise RidgeFillUnavailable(
            f"the loaded libllama ({libs.loaded_lib_dir()}) has no llama_ridgefill_* API: it is not a RidgeFill build")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise RidgeFillUnavailable(f"libllama lacks {name}: rebuild the RidgeFill build (`make build`)")
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def arch_supported(model) -> bool:
    return bool(_bound().llama_ridgefill_arch_supported(model))


def capture_layer_input(ctx, layer: int, enable: bool = True) -> None:
    """Capture layer `layer`'s input (the residual stream before its first norm) at the next decodes."""
    rc = _bound().llama_ridgefill_capture_layer_input(ctx, layer, enable)
    if rc == -1:
        raise RidgeFillUnavailable("this model's architecture has no layer-input handle for RidgeFill capture")
    if rc == -2:
        raise ValueError(f"layer {layer} is outside the model's layers")


def get_layer_input(ctx, layer: int, n_tokens: int, n_embd: int) -> np.ndarray:
    """A copy of layer `layer`'s inputs for the last decode: float32 [n_tokens, n_embd]."""
    ptr = _bound().llama_ridgefill_get_layer_input(ctx, layer)
    if not ptr:
        raise RuntimeError(f"no captured input for layer {layer}: enable capture, then decode")
    return np.ctypeslib.as_array(ptr, shape=(n_tokens, n_embd)).copy()


def load() -> RidgeFillLib:
    lib = _bound()
    version = lib.llama_ridgefill_api_version()
    if version != API_VERSION:
        raise RidgeFillUnavailable(
            f"libllama reports RidgeFill API {version}, these bindings speak {API_VERSION}: rebuild (`make build`)")
    return RidgeFillLib(api_version=version, build_info=lib.llama_ridgefill_build_info().decode())
