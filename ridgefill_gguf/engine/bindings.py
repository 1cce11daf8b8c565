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
API_VERSION = 7


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
    "llama_ridgefill_capture_on_device": (None, [ctypes.c_void_p, ctypes.c_bool]),
    "llama_ridgefill_get_layer_input_device": (ctypes.c_void_p,
                                               [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_bool)]),
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
    "llama_ridgefill_attach": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p]),
    "llama_ridgefill_set_tail": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_set_fill": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int]),
    "llama_ridgefill_set_exact_rows": (ctypes.c_int32,
                                       [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ridgefill_set_exact_random": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32]),
    "llama_ridgefill_set_chunk": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_set_min_prefix": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_set_probe": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    "llama_ridgefill_set_probe_share": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_float]),
    "llama_ridgefill_set_selector_blind": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_bool]),
    "llama_ridgefill_set_whole_numbers": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_bool]),
    "llama_ridgefill_set_probe_budget": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_float]),
    "llama_ridgefill_set_random_budget": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_float, ctypes.c_uint32]),
    "llama_ridgefill_set_protected": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_float]),
    "llama_ridgefill_select_rows": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
                                                     ctypes.c_int32, ctypes.c_int32, ctypes.c_int,
                                                     ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ridgefill_maps_has_unigrams": (ctypes.c_bool, [ctypes.c_void_p]),
    "llama_ridgefill_set_rescale": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool, ctypes.c_bool]),
    "llama_ridgefill_set_attention_rows": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_float,
                                                             ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ridgefill_prefill": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                                 ctypes.c_int32, ctypes.c_int32]),
}

PLACEMENTS = {"resident": 0, "streamed": 1}
# llama_ridgefill_select_rows's rules
RULES = {"protected": 0, "protected-half": 1, "digits": 2, "lexical": 3}
# the production arms, then the two checks of the correctness ladder
FILLS = {"ridge": 0, "identity": 1, "none": 2, "plumb": 3, "oracle": 4}


class Stats(ctypes.Structure):
    """struct llama_ridgefill_stats"""
    _fields_ = [("applied", ctypes.c_int32), ("split", ctypes.c_int32), ("n_rows", ctypes.c_int32),
                ("n_filled", ctypes.c_int32), ("n_exact", ctypes.c_int32), ("n_special", ctypes.c_int32),
                ("n_tail", ctypes.c_int32), ("t_early_ms", ctypes.c_double), ("t_fill_ms", ctypes.c_double),
                ("t_exact_ms", ctypes.c_double), ("t_total_ms", ctypes.c_double), ("n_probe", ctypes.c_int32),
                ("n_probe_exact", ctypes.c_int32), ("t_probe_ms", ctypes.c_double), ("n_attention", ctypes.c_int32),
                ("n_budget", ctypes.c_int32), ("n_budget_protected", ctypes.c_int32),
                ("n_budget_digits", ctypes.c_int32), ("n_budget_attention", ctypes.c_int32),
                ("n_lexical", ctypes.c_int32), ("n_protected", ctypes.c_int32), ("n_random", ctypes.c_int32),
                ("device_mask", ctypes.c_int32), ("n_whole_numbers", ctypes.c_int32)]

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, _ in self._fields_}


_SIGNATURES["llama_ridgefill_get_stats"] = (None, [ctypes.c_void_p, ctypes.POINTER(Stats)])
_SIGNATURES["llama_ridgefill_set_logits_rows"] = (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32])
_SIGNATURES["llama_ridgefill_get_logits"] = (ctypes.POINTER(ctypes.c_float),
                                             [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)])
_SIGNATURES["llama_ridgefill_get_exact_rows"] = (ctypes.POINTER(ctypes.c_int32),
                                                 [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)])


class PrefillError(RuntimeError):
    pass


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
    has_unigrams: bool = False

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
                      lib.llama_ridgefill_maps_warnings(handle).decode(),
                      bool(lib.llama_ridgefill_maps_has_unigrams(handle)))


def attach(ctx, maps: LoadedMaps | None) -> None:
    """Attach loaded maps to a context (None detaches); the maps must stay loaded while attached."""
    lib = _prefill_lib()
    if lib.llama_ridgefill_attach(ctx, maps.handle if maps else None) != 0:
        raise RidgeFillUnavailable(lib.llama_ridgefill_last_error().decode())


def configure(ctx, *, tail: int | None = None, fill: str | None = None, exact_rows: list[int] | None = None,
              exact_random: tuple[int, int] | None = None, chunk: int | None = None,
              min_prefix: int | None = None, logits_rows: int | None = None,
              probe: tuple[int, int] | None = None, attention: tuple | None = None,
              blind: bool | None = None, rescale: tuple[int, bool, bool] | None = None,
              probe_budget: tuple[int, float] | None = None, random_budget: tuple[float, int] | None = None,
              protected: float | None = None, whole_numbers: bool | None = None) -> None:
    """Set prefill parameters on a context with maps attached; None leaves a parameter as it is."""
    lib = _prefill_lib()
    calls = []
    if tail is not None:
        calls.append(("tail", lib.llama_ridgefill_set_tail(ctx, tail)))
    if fill is not None:
        if fill not in FILLS:
            raise ValueError(f"fill must be one of {', '.join(FILLS)}, not {fill!r}")
        calls.append(("fill", lib.llama_ridgefill_set_fill(ctx, FILLS[fill])))
    if exact_rows is not None:
        arr = (ctypes.c_int32 * len(exact_rows))(*exact_rows)
        calls.append(("exact_rows", lib.llama_ridgefill_set_exact_rows(ctx, arr, len(exact_rows))))
    if exact_random is not None:
        calls.append(("exact_random", lib.llama_ridgefill_set_exact_random(ctx, *exact_random)))
    if chunk is not None:
        calls.append(("chunk", lib.llama_ridgefill_set_chunk(ctx, chunk)))
    if min_prefix is not None:
        calls.append(("min_prefix", lib.llama_ridgefill_set_min_prefix(ctx, min_prefix)))
    if logits_rows is not None:
        calls.append(("logits_rows", lib.llama_ridgefill_set_logits_rows(ctx, logits_rows)))
    if probe is not None:  # (rows that run the probe, prefix rows it makes exact)
        calls.append(("probe", lib.llama_ridgefill_set_probe(ctx, *probe)))
    if probe_budget is not None:  # (rows that run the probe, budget factor): E from the base rules
        calls.append(("probe_budget", lib.llama_ridgefill_set_probe_budget(ctx, *probe_budget)))
    if random_budget is not None:  # (budget factor, seed): E random rows, the budget's control
        calls.append(("random_budget", lib.llama_ridgefill_set_random_budget(ctx, *random_budget)))
    if protected is not None:  # the rarest share of the protected-class tokens
        calls.append(("protected", lib.llama_ridgefill_set_protected(ctx, protected)))
    if rescale is not None:  # (tail rows that measure, values, keys)
        calls.append(("rescale", lib.llama_ridgefill_set_rescale(ctx, *rescale)))
    if whole_numbers is not None:  # with the budget: a number the probe kept in part runs exactly whole
        calls.append(("whole_numbers", lib.llama_ridgefill_set_whole_numbers(ctx, whole_numbers)))
    if blind is not None:  # the question-blind control: the selectors' queries end before the tail
        calls.append(("blind", lib.llama_ridgefill_set_selector_blind(ctx, blind)))
    if attention is not None:  # (query rows, share of the prefix[, layers]): the attention selector
        n_query, share, *rest = attention
        layers = list(rest[0]) if rest and rest[0] is not None else None
        arr = (ctypes.c_int32 * len(layers))(*layers) if layers else None
        calls.append(("attention", lib.llama_ridgefill_set_attention_rows(ctx, n_query, share, arr,
                                                                           len(layers) if layers else 0)))
    for name, rc in calls:
        if rc != 0:
            err = lib.llama_ridgefill_last_error().decode()
            raise ValueError(f"RidgeFill parameter {name} refused" + (f": {err}" if err else ""))


def prefill(ctx, tokens: list[int], *, seq: int = 0, n_following: int = 0) -> bool:
    """Prefill tokens into sequence seq with RidgeFill. True when RidgeFill ran; False when the request did not
    qualify and nothing was done (decode the tokens the stock way). Raises PrefillError on failure."""
    lib = _prefill_lib()
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    rc = lib.llama_ridgefill_prefill(ctx, seq, arr, len(tokens), n_following)
    if rc < 0:
        raise PrefillError(lib.llama_ridgefill_last_error().decode())
    return rc == 0


def select_rows(model, maps: LoadedMaps | None, tokens: list[int], n_prefix: int, rule: str) -> list[int]:
    """The prefix rows one rule selects (llama_ridgefill_select_rows), ascending."""
    lib = _prefill_lib()
    arr = (ctypes.c_int32 * max(len(tokens), 1))(*tokens)
    out = (ctypes.c_int32 * max(n_prefix, 1))()
    n = lib.llama_ridgefill_select_rows(model, maps.handle if maps else None, arr, len(tokens), n_prefix, RULES[rule],
                                        out, n_prefix)
    if n < 0:
        raise ValueError(lib.llama_ridgefill_last_error().decode())
    return list(out[:n])


def stats(ctx) -> dict:
    out = Stats()
    _prefill_lib().llama_ridgefill_get_stats(ctx, ctypes.byref(out))
    return out.as_dict()


def logits(ctx, n_vocab: int) -> np.ndarray:
    """The last prefill's own logits (llama_ridgefill_set_logits_rows): float32 [n_rows, n_vocab]."""
    n = ctypes.c_int32(0)
    ptr = _prefill_lib().llama_ridgefill_get_logits(ctx, ctypes.byref(n))
    if not ptr or n.value == 0:
        return np.zeros((0, n_vocab), np.float32)
    return np.ctypeslib.as_array(ptr, shape=(n.value, n_vocab)).copy()


def exact_rows(ctx) -> list[int]:
    """The last prefill's exact prefix rows (special, listed, random and the probe's), ascending."""
    n = ctypes.c_int32(0)
    ptr = _prefill_lib().llama_ridgefill_get_exact_rows(ctx, ctypes.byref(n))
    return [int(ptr[i]) for i in range(n.value)] if ptr else []


def not_applied_reason() -> str:
    return _bound().llama_ridgefill_last_error().decode()


def _bound() -> ctypes.CDLL:
    lib = _lib()
    if not hasattr(lib, "llama_ridgefill_api_version"):
        raise RidgeFillUnavailable(
            f"the loaded libllama ({libs.loaded_lib_dir()}) has no llama_ridgefill_* API: it is not a RidgeFill build")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:  # an older build lacks the newer functions: _fn() names the one that is needed
            fn.restype, fn.argtypes = restype, argtypes
    return lib


def _prefill_lib() -> ctypes.CDLL:
    _fn("llama_ridgefill_prefill")
    return _bound()


def _fn(name: str):
    fn = getattr(_bound(), name, None)
    if fn is None:
        raise RidgeFillUnavailable(f"libllama lacks {name}: rebuild the RidgeFill build (`make build`)")
    return fn


def arch_supported(model) -> bool:
    return bool(_bound().llama_ridgefill_arch_supported(model))


def capture_layer_input(ctx, layer: int, enable: bool = True) -> None:
    """Capture layer `layer`'s input (the residual stream before its first norm) at the next decodes."""
    rc = _bound().llama_ridgefill_capture_layer_input(ctx, layer, enable)
    if rc == -1:
        raise RidgeFillUnavailable("this model's architecture has no layer-input handle for RidgeFill capture")
    if rc == -2:
        raise ValueError(f"layer {layer} is outside the model's layers")


def layer_input_view(ctx, layer: int, n_tokens: int, n_embd: int) -> np.ndarray:
    """Layer `layer`'s inputs for the last decode, float32 [n_tokens, n_embd], as a view of llama.cpp's output
    buffer (pinned host memory on a GPU): valid until the next decode."""
    ptr = _bound().llama_ridgefill_get_layer_input(ctx, layer)
    if not ptr:
        raise RuntimeError(f"no captured input for layer {layer}: enable capture, then decode")
    return np.ctypeslib.as_array(ptr, shape=(n_tokens, n_embd))


def capture_on_device(ctx, enable: bool = True) -> None:
    """Keep captured layer inputs on the device that computes each layer (read them with layer_input_tensor)."""
    _bound().llama_ridgefill_capture_on_device(ctx, enable)


class _CudaArray:
    """A CUDA device pointer shown to torch through __cuda_array_interface__ (no copy)."""

    def __init__(self, ptr: int, shape: tuple[int, int]):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


def layer_input_tensor(ctx, layer: int, n_tokens: int, n_embd: int):
    """With capture on the device: layer `layer`'s inputs for the last decode as a torch tensor [n_tokens, n_embd]
    over llama.cpp's own buffer (a CUDA tensor, or a CPU one for CPU layers); valid until the next decode."""
    import torch  # noqa: PLC0415 - only the fit needs torch

    on_host = ctypes.c_bool(False)
    ptr = _bound().llama_ridgefill_get_layer_input_device(ctx, layer, ctypes.byref(on_host))
    if not ptr:
        raise RuntimeError(f"no captured input for layer {layer} on the device: enable capture on the device, "
                           "then decode")
    if on_host.value:
        array = (ctypes.c_float * (n_tokens * n_embd)).from_address(ptr)
        return torch.from_numpy(np.ctypeslib.as_array(array).reshape(n_tokens, n_embd))
    return torch.as_tensor(_CudaArray(ptr, (n_tokens, n_embd)), device="cuda")


def get_layer_input(ctx, layer: int, n_tokens: int, n_embd: int) -> np.ndarray:
    """A copy of layer `layer`'s inputs for the last decode: float32 [n_tokens, n_embd]."""
    return layer_input_view(ctx, layer, n_tokens, n_embd).copy()


def load() -> RidgeFillLib:
    lib = _bound()
    version = lib.llama_ridgefill_api_version()
    if version != API_VERSION:
        raise RidgeFillUnavailable(
            f"libllama reports RidgeFill API {version}, these bindings speak {API_VERSION}: rebuild (`make build`)")
    return RidgeFillLib(api_version=version, build_info=lib.llama_ridgefill_build_info().decode())
