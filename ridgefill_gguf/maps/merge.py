"""Join maps GGUFs of one (model, split) whose layer groups were fitted in separate passes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from . import format as fmt

_RAW_DTYPE = {QT.Q8_0: np.uint8, QT.F16: np.float16, QT.BF16: np.uint16, QT.F32: np.float32}
# what must agree between the parts
_SAME = ("architecture", "split", "lam", "model_n_layer", "model_n_embd", "model_vocab_sha256")


class MergeError(ValueError):
    pass


def merge(parts: list[str | Path], out: str | Path, force: bool = False,
          token_freq: np.ndarray | None = None) -> Path:
    """token_freq: a token frequency table to write instead of the parts' own (one part: add a table)."""
    files = [fmt.read_maps(p) for p in parts]
    metas = [fmt.maps_meta(g) for g in files]
    for p, g in zip(parts, files):
        problems = fmt.check_maps(g)
        if not problems.ok:
            raise MergeError(f"{p}: " + "; ".join(problems.errors))
    for key in _SAME:
        values = {getattr(m, key) for m in metas}
        if len(values) > 1:
            raise MergeError(f"the parts disagree on {key}: {sorted(map(str, values))}"
                             + (" (fit every group with the same single --lambdas value)" if key == "lam" else ""))
    owner: dict[int, int] = {}
    for i, m in enumerate(metas):
        for layer in m.layers:
            if layer in owner:
                raise MergeError(f"layer {layer} is in both {parts[owner[layer]]} and {parts[i]}")
            owner[layer] = i
    layers = sorted(owner)
    meta = fmt.MapsMeta(**{**metas[0].__dict__, "layers": layers,
                           "fit_rows": min((m.fit_rows for m in metas if m.fit_rows), default=None)})
    plans = []
    for layer in layers:
        w = files[owner[layer]].tensors[fmt.weight_name(layer)]
        plans.append(fmt.LayerPlan(layer, int(w.ne[0]), int(w.ne[1]), w.type))

    def produce(plan: fmt.LayerPlan) -> fmt.LayerMap:
        g = files[owner[plan.layer]]
        raw = np.asarray(g.raw(fmt.weight_name(plan.layer))).view(_RAW_DTYPE[plan.weight_type])
        bias = np.asarray(g.raw(fmt.bias_name(plan.layer))).view(np.float32)
        return fmt.LayerMap(plan.layer, raw.reshape(plan.d_out, -1), plan.weight_type, plan.d_in, bias)

    # the token frequency table belongs to the calibration text, which every part read
    tables = [np.asarray(g.raw(fmt.TOKEN_FREQ)).view(np.float32) if fmt.TOKEN_FREQ in g.tensors else None
              for g in files]
    if token_freq is None:
        # kept when every part has the same table, dropped when one has none, refused when two differ
        present = [t for t in tables if t is not None]
        if any(not np.array_equal(t, present[0]) for t in present):
            raise MergeError(f"the parts disagree on {fmt.TOKEN_FREQ} (fitted on different calibration text?)")
        token_freq = present[0] if present and len(present) == len(tables) else None
    # the terminal-state offsets of the parts' layers (a hybrid's), added after the maps
    deltas = {int(name.split(".")[1]): np.asarray(g.raw(name)).view(np.float32).copy()
              for g in files for name in g.tensors if name.endswith(".rf_state_delta")}
    path = fmt.write_maps(out, meta, plans, produce, token_freq=token_freq, force=force)
    if deltas:
        from .state_delta import write_state_deltas

        path = write_state_deltas(path, deltas, path)
    return path
