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
API_VERSION = 24


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
    "llama_ridgefill_capture_supported": (ctypes.c_bool, [ctypes.c_void_p]),
    "llama_ridgefill_capture_layer_input": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]),
    "llama_ridgefill_get_layer_input": (ctypes.POINTER(ctypes.c_float), [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_capture_on_device": (None, [ctypes.c_void_p, ctypes.c_bool]),
    "llama_ridgefill_get_layer_input_device": (ctypes.c_void_p,
                                               [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_bool)]),
    "llama_ridgefill_maps_load": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]),
    "llama_ridgefill_maps_free": (None, [ctypes.c_void_p]),
    "llama_ridgefill_budget_default": (ctypes.c_float, [ctypes.c_void_p]),
    "llama_ridgefill_last_error": (ctypes.c_char_p, []),
    "llama_ridgefill_maps_split": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_maps_n_layers": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_maps_layer": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_maps_tail_default": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_maps_lambda": (ctypes.c_float, [ctypes.c_void_p]),
    "llama_ridgefill_maps_bytes": (ctypes.c_uint64, [ctypes.c_void_p]),
    "llama_ridgefill_maps_warnings": (ctypes.c_char_p, [ctypes.c_void_p]),
    "llama_ridgefill_attach": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p]),
    "llama_ridgefill_select_rows": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
                                                     ctypes.c_int32, ctypes.c_int32, ctypes.c_int,
                                                     ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ridgefill_maps_has_unigrams": (ctypes.c_bool, [ctypes.c_void_p]),
    "llama_ridgefill_prefill": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                                 ctypes.c_int32, ctypes.c_int32]),
    "llama_ridgefill_held_rows": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                   ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ridgefill_prefill_resume": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                                        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]),
    "llama_ridgefill_forget_held": (None, [ctypes.c_void_p]),
    "llama_ridgefill_keep_held": (ctypes.c_bool, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]),
    "llama_ridgefill_prefill_step": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_prefill_cancel": (None, [ctypes.c_void_p]),
    "llama_ridgefill_prefill_active": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_ridgefill_prefill_progress": (ctypes.c_char_p, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
                                                           ctypes.POINTER(ctypes.c_int32)]),
    "llama_ridgefill_buffer_bytes": (ctypes.c_uint64, [ctypes.c_void_p]),
}
# llama_ridgefill_prefill_step's answers besides failure
STEP_DONE, STEP_YIELD, STEP_HOLD = 0, 1, 2

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
                ("device_mask", ctypes.c_int32), ("n_whole_numbers", ctypes.c_int32),
                ("n_state_corrected", ctypes.c_int32),
                ("n_masks_made", ctypes.c_int32), ("t_recurrent_ms", ctypes.c_double),
                ("n_fill_skipped", ctypes.c_int32), ("n_late_devices", ctypes.c_int32),
                ("n_bytes_moved", ctypes.c_int64), ("n_kept_exact", ctypes.c_int32)]

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, _ in self._fields_}


_SIGNATURES["llama_ridgefill_get_stats"] = (None, [ctypes.c_void_p, ctypes.POINTER(Stats)])
_SIGNATURES["llama_ridgefill_get_logits"] = (ctypes.POINTER(ctypes.c_float),
                                             [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)])
_SIGNATURES["llama_ridgefill_get_exact_rows"] = (ctypes.POINTER(ctypes.c_int32),
                                                 [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)])
_SIGNATURES["llama_ridgefill_get_added_rows"] = (ctypes.POINTER(ctypes.c_int32),
                                                [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int32)])
ADDED_BY = {"lexical": 0, "whole_numbers": 1}  # enum llama_ridgefill_added_by


class Params(ctypes.Structure):
    """struct llama_ridgefill_params"""
    _fields_ = [("n_tail", ctypes.c_int32), ("min_prefix", ctypes.c_int32), ("chunk", ctypes.c_int32),
                ("probe_rows", ctypes.c_int32), ("probe_budget", ctypes.c_float), ("probe_share", ctypes.c_float),
                ("attention_share", ctypes.c_float), ("protected_share", ctypes.c_float),
                ("whole_numbers", ctypes.c_bool), ("rescale_rows", ctypes.c_int32), ("rescale_values", ctypes.c_bool),
                ("rescale_keys", ctypes.c_bool), ("logits_rows", ctypes.c_int32), ("state_correction", ctypes.c_bool),
                ("recurrent_chunk", ctypes.c_int32), ("state_update", ctypes.c_int), ("keep_held_exact", ctypes.c_bool)]


# enum llama_ridgefill_state_update: a hybrid's carry updates its states in upstream's fused op, its chunked graph,
# or the fused op asked for its blocked form (the default; CUDA's kernel, 128-wide heads; elsewhere the fused op)
STATE_UPDATES = {"fused": 0, "chunked": 1, "blocked": 2}


_SIGNATURES["llama_ridgefill_default_params"] = (Params, [])
_SIGNATURES["llama_ridgefill_set_params"] = (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(Params)])
_SIGNATURES["llama_ridgefill_get_params"] = (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(Params)])
_SIGNATURES["llama_ridgefill_params_select"] = (ctypes.c_int32, [ctypes.POINTER(Params), ctypes.c_char_p, ctypes.c_float,
                                                                 ctypes.c_float, ctypes.c_int32])
# the research controls (llama-ridgefill-research.h): the ladder's and the eval's instruments
_SIGNATURES.update({
    "llama_ridgefill_research_set_fill": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int]),
    "llama_ridgefill_research_set_exact_rows": (ctypes.c_int32,
                                                [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ridgefill_research_set_exact_random": (ctypes.c_int32,
                                                  [ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.c_uint32]),
    "llama_ridgefill_research_set_random_budget": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_float, ctypes.c_uint32]),
    "llama_ridgefill_research_set_probe_count": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_ridgefill_research_set_attention_rows": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32,
                                                                     ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ridgefill_research_set_blind": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_bool]),
})


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
        raise MapsRefused(lib.llama_ridgefill_last_error().decode(errors="replace"))
    n = lib.llama_ridgefill_maps_n_layers(handle)
    tail, lam = lib.llama_ridgefill_maps_tail_default(handle), lib.llama_ridgefill_maps_lambda(handle)
    return LoadedMaps(handle, lib.llama_ridgefill_maps_split(handle),
                      [lib.llama_ridgefill_maps_layer(handle, i) for i in range(n)],
                      None if tail < 0 else tail, None if lam < 0 else lam, lib.llama_ridgefill_maps_bytes(handle),
                      lib.llama_ridgefill_maps_warnings(handle).decode(),
                      bool(lib.llama_ridgefill_maps_has_unigrams(handle)))


def budget_default(model) -> float:
    """The budget factor llama-server defaults to for a loaded model (llama_model pointer): 2 where some layer
    attends in a sliding window, else 1.5."""
    return round(float(_fn("llama_ridgefill_budget_default")(model)), 6)


def attach(ctx, maps: LoadedMaps | None) -> None:
    """Attach loaded maps to a context (None detaches); the maps must stay loaded while attached."""
    lib = _prefill_lib()
    if lib.llama_ridgefill_attach(ctx, maps.handle if maps else None) != 0:
        raise RidgeFillUnavailable(lib.llama_ridgefill_last_error().decode(errors="replace"))
    _configs.pop(_ctx_key(ctx), None)  # a fresh attachment starts from the defaults


# configure's keywords, in the order it applies them; probe and probe_budget replace each other
CONFIG_KEYS = ("tail", "fill", "exact_rows", "exact_random", "chunk", "min_prefix", "logits_rows", "probe",
               "probe_budget", "random_budget", "protected", "rescale", "whole_numbers", "blind", "attention",
               "state_correction", "recurrent_chunk", "state_update", "keep_held_exact")
_REPLACES = {"probe": "probe_budget", "probe_budget": "probe"}
# what configure has been given per context (by address): each call sets the whole configuration again, since
# llama_ridgefill_set_params turns the research controls off
_configs: dict[int, dict] = {}


def _ctx_key(ctx) -> int:
    return ctypes.cast(ctx, ctypes.c_void_p).value or 0


def configure(ctx, **kw) -> None:
    """Set prefill parameters on a context with maps attached; a keyword left out (or None) keeps the value it was
    given before. tail, chunk, recurrent_chunk, min_prefix, logits_rows, whole_numbers, keep_held_exact (a resumed
    prefill keeps the held rows that ran exactly before exact): as named; state_update
    (blocked, fused or chunked: a hybrid's carry, STATE_UPDATES); probe_budget (rows, factor), protected (share),
    rescale (rows, values, keys) and attention (query rows, share[, layers]) set the production parameters; fill,
    exact_rows, exact_random (n, seed), probe (rows, fixed count), random_budget (factor, seed) and blind are
    research controls."""
    unknown = sorted(set(kw) - set(CONFIG_KEYS))
    if unknown:
        raise TypeError(f"configure() got unknown parameters: {', '.join(unknown)}")
    if kw.get("fill") is not None and kw["fill"] not in FILLS:
        raise ValueError(f"fill must be one of {', '.join(FILLS)}, not {kw['fill']!r}")
    config = dict(_configs.get(_ctx_key(ctx), {}))
    for key in CONFIG_KEYS:
        if kw.get(key) is not None:
            config.pop(_REPLACES.get(key, ""), None)
            config[key] = kw[key]
    _apply(ctx, config)
    _configs[_ctx_key(ctx)] = config


def _apply(ctx, c: dict) -> None:
    lib = _prefill_lib()
    p = lib.llama_ridgefill_default_params()
    for key, field in (("tail", "n_tail"), ("chunk", "chunk"), ("min_prefix", "min_prefix"),
                       ("logits_rows", "logits_rows"), ("whole_numbers", "whole_numbers"),
                       ("protected", "protected_share"), ("state_correction", "state_correction"),
                       ("recurrent_chunk", "recurrent_chunk"), ("keep_held_exact", "keep_held_exact")):
        if key in c:
            setattr(p, field, c[key])
    if "state_update" in c:
        p.state_update = STATE_UPDATES[c["state_update"]]
    if "probe" in c:
        p.probe_rows = c["probe"][0]
    if "probe_budget" in c:
        p.probe_rows, p.probe_budget = c["probe_budget"]
    if "rescale" in c:
        p.rescale_rows, p.rescale_values, p.rescale_keys = c["rescale"]
    if "attention" in c:
        p.attention_share = c["attention"][1]
    calls = [("params", lib.llama_ridgefill_set_params(ctx, ctypes.byref(p)))]
    if "fill" in c:
        calls.append(("fill", lib.llama_ridgefill_research_set_fill(ctx, FILLS[c["fill"]])))
    if "exact_rows" in c:
        rows = c["exact_rows"]
        calls.append(("exact_rows", lib.llama_ridgefill_research_set_exact_rows(
            ctx, (ctypes.c_int32 * len(rows))(*rows), len(rows))))
    if "exact_random" in c:
        n_rows, seed = c["exact_random"]
        calls.append(("exact_random", lib.llama_ridgefill_research_set_exact_random(ctx, n_rows, 0.0, seed)))
    if "probe" in c:
        calls.append(("probe", lib.llama_ridgefill_research_set_probe_count(ctx, c["probe"][1])))
    if "random_budget" in c:
        calls.append(("random_budget", lib.llama_ridgefill_research_set_random_budget(ctx, *c["random_budget"])))
    if "blind" in c:
        calls.append(("blind", lib.llama_ridgefill_research_set_blind(ctx, c["blind"])))
    if "attention" in c:
        n_query, _, *rest = c["attention"]
        layers = list(rest[0]) if rest and rest[0] is not None else None
        arr = (ctypes.c_int32 * len(layers))(*layers) if layers else None
        calls.append(("attention", lib.llama_ridgefill_research_set_attention_rows(ctx, n_query, arr,
                                                                                    len(layers) if layers else 0)))
    for name, rc in calls:
        if rc != 0:
            err = lib.llama_ridgefill_last_error().decode(errors="replace")
            raise ValueError(f"RidgeFill parameter {name} refused" + (f": {err}" if err else ""))


def params(ctx) -> dict:
    """The production parameters the context holds (llama_ridgefill_get_params)."""
    p = Params()
    if _prefill_lib().llama_ridgefill_get_params(ctx, ctypes.byref(p)) != 0:
        raise RidgeFillUnavailable(not_applied_reason())
    return {name: getattr(p, name) for name, _ in Params._fields_}


def prefill(ctx, tokens: list[int], *, seq: int = 0, n_following: int = 0) -> bool:
    """Prefill tokens into sequence seq with RidgeFill. True when RidgeFill ran; False when the request did not
    qualify and nothing was done (decode the tokens the stock way). Raises PrefillError on failure."""
    lib = _prefill_lib()
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    rc = lib.llama_ridgefill_prefill(ctx, seq, arr, len(tokens), n_following)
    if rc < 0:
        raise PrefillError(lib.llama_ridgefill_last_error().decode(errors="replace"))
    return rc == 0


def held_rows(ctx, tokens: list[int], pos: int, *, seq: int = 0) -> int:
    """How many leading rows of tokens, at positions from pos, a resumed prefill can take from the last sweep one."""
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    return int(_prefill_lib().llama_ridgefill_held_rows(ctx, seq, pos, arr, len(tokens)))


def keep_held(ctx, pos: int, n_held: int, *, seq: int = 0) -> bool:
    """Remove the sequence's rows from pos + n_held on, keeping the held rows before them (on a hybrid, with the
    states they left below the split); False where it cannot, with the rows from pos on removed (a hybrid's all)."""
    return bool(_prefill_lib().llama_ridgefill_keep_held(ctx, seq, pos, n_held))


def forget_held(ctx) -> None:
    """Drop the held split state: call it before loading a sequence's state (llama_state_seq_set_data)."""
    _prefill_lib().llama_ridgefill_forget_held(ctx)


def prefill_resumed(ctx, tokens: list[int], n_held: int, *, seq: int = 0, n_following: int = 0) -> bool:
    """prefill() of tokens whose first n_held rows (fewer than all) are the sequence's last cached ones, taking their
    split state from the last sweep one (held_rows says how many may). False when it did not qualify: the rows from
    the first held one were removed, so the caller prefills the stock way from there. Raises PrefillError on failure
    (the rows from the first held one were removed too)."""
    steps = prefill_steps(ctx, tokens, seq=seq, n_following=n_following, n_held=n_held)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def prefill_steps(ctx, tokens: list[int], *, seq: int = 0, n_following: int = 0, n_held: int = 0):
    """The same prefill in steps (resumed over n_held held rows: llama_ridgefill_prefill_resume, which with none
    is llama_ridgefill_prefill_begin): yields after each step whether other sequences may decode on the context
    before the next (True) or not (False: HOLD, which the engine no longer answers). Returns False at once when the
    request did not qualify (nothing was done), True when done; raises PrefillError on failure. Closing the
    generator early cancels it."""
    lib = _prefill_lib()
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    rc = lib.llama_ridgefill_prefill_resume(ctx, seq, arr, len(tokens), n_following, n_held)
    if rc < 0:
        raise PrefillError(lib.llama_ridgefill_last_error().decode(errors="replace"))
    if rc == 1:
        return False
    try:
        while True:
            rc = lib.llama_ridgefill_prefill_step(ctx)
            if rc < 0:
                raise PrefillError(lib.llama_ridgefill_last_error().decode(errors="replace"))
            if rc == STEP_DONE:
                return True
            yield rc == STEP_YIELD
    finally:
        lib.llama_ridgefill_prefill_cancel(ctx)  # a no-op once done


def prefill_between(ctx, tokens: list[int], between, *, seq: int = 0, n_following: int = 0) -> list[bool]:
    """The prefill in steps, calling between(may_decode) after each one (where a server runs its other slots);
    the steps' answers. Raises RuntimeError when the request did not qualify."""
    gen, yields = prefill_steps(ctx, tokens, seq=seq, n_following=n_following), []
    while True:
        try:
            may = next(gen)
        except StopIteration as stop:
            if stop.value is not True:
                raise RuntimeError("RidgeFill did not apply") from None
            return yields
        yields.append(bool(may))
        between(yields[-1])


def prefill_active(ctx) -> int:
    """The sequence of the prefill in flight on ctx, -1 when there is none."""
    return _prefill_lib().llama_ridgefill_prefill_active(ctx)


def prefill_progress(ctx) -> tuple[str, int, int] | None:
    """How far the prefill in flight on ctx has come: (stage, done, total), None when there is none."""
    done, total = ctypes.c_int32(0), ctypes.c_int32(0)
    stage = _prefill_lib().llama_ridgefill_prefill_progress(ctx, ctypes.byref(done), ctypes.byref(total))
    return None if stage is None else (stage.decode(), done.value, total.value)


def buffer_bytes(ctx) -> int:
    """Bytes of RidgeFill's own buffers ctx holds now (the maps not counted)."""
    return _prefill_lib().llama_ridgefill_buffer_bytes(ctx)


def select_rows(model, maps: LoadedMaps | None, tokens: list[int], n_prefix: int, rule: str) -> list[int]:
    """The prefix rows one rule selects (llama_ridgefill_select_rows), ascending."""
    lib = _prefill_lib()
    arr = (ctypes.c_int32 * max(len(tokens), 1))(*tokens)
    out = (ctypes.c_int32 * max(n_prefix, 1))()
    n = lib.llama_ridgefill_select_rows(model, maps.handle if maps else None, arr, len(tokens), n_prefix, RULES[rule],
                                        out, n_prefix)
    if n < 0:
        raise ValueError(lib.llama_ridgefill_last_error().decode(errors="replace"))
    return list(out[:n])


def stats(ctx) -> dict:
    out = Stats()
    _prefill_lib().llama_ridgefill_get_stats(ctx, ctypes.byref(out))
    return out.as_dict()


def logits(ctx, n_vocab: int) -> np.ndarray:
    """The last prefill's own logits (the logits_rows parameter): float32 [n_rows, n_vocab]."""
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


def added_rows(ctx, rule: str) -> list[int]:
    """Of the last prefill's exact prefix rows, those a rule added beside the selector's ranking (lexical,
    whole_numbers), ascending."""
    n = ctypes.c_int32(0)
    ptr = _prefill_lib().llama_ridgefill_get_added_rows(ctx, ADDED_BY[rule], ctypes.byref(n))
    return [int(ptr[i]) for i in range(n.value)] if ptr else []


def not_applied_reason() -> str:
    return _bound().llama_ridgefill_last_error().decode(errors="replace")


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


def capture_supported(model) -> bool:
    return bool(_bound().llama_ridgefill_capture_supported(model))


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
