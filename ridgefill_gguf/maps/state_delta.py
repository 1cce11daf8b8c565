"""The terminal-state correction's offsets (paper §2.3, Appendix H): per late Gated DeltaNet layer and value head, the
mean difference between the recurrent state of an exact prefix and that of a fully filled one, measured every
`every` rows of held-out prompts, and stored beside the maps as blk.N.rf_state_delta (F32, the state's layout:
[n_v_heads, head_v_dim, head_k_dim] in C order, ggml's [head_k_dim, head_v_dim, n_v_heads]).

The measurement runs the layers in NumPy (reference_hybrid), float64: minutes for small models, not meant for 27B
ones, whose offsets would be measured through the engine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from ..gguf_io import copy_tensors, read_gguf, tensor_f32, writer_like
from ..util import write_atomic_with
from .format import DATA_SHA256, DATA_SHA256_PLACEHOLDER, bias_name, seal, state_delta_name, weight_name


def measure_state_deltas(model: str | Path, maps: str | Path, prompts: list[list[int]], every: int = 2048,
                         log: Callable[[str], None] = print) -> tuple[dict[int, np.ndarray], int]:
    """({late recurrent layer: mean exact-minus-filled state}, the number of states averaged per layer). A filled
    row's layer input is its map's prediction from x_S (x_S itself at the split)."""
    from ..reference_hybrid import HybridReference
    from ..reference_hybrid_ridgefill import stock_forward

    ref = HybridReference(model)
    g = read_gguf(maps)
    split = int(g.get("ridgefill.split"))
    layers = [il for il in range(split, ref.hp.n_layer) if ref.hp.recurrent[il]]
    sums = {il: 0.0 for il in layers}
    count = 0
    for i, tokens in enumerate(prompts):
        inputs = stock_forward(ref, tokens)[1]
        x_split = inputs[split]
        marks = list(range(every, len(tokens) + 1, every)) or [len(tokens)]
        for il in layers:
            pred = x_split
            if il > split:
                a, b = tensor_f32(g, weight_name(il)).astype(np.float64), tensor_f32(g, bias_name(il)).astype(np.float64)
                pred = x_split @ a.T + b
            norm = ref.w(f"blk.{il}.attn_norm.weight")
            states = []
            for h in (ref.rms(inputs[il], norm), ref.rms(pred, norm)):
                conv = state = None
                out, start = [], 0
                for end in marks:
                    _, conv, state = ref.gated_deltanet(il, h[start:end], conv, state)
                    out.append(state)
                    start = end
                states.append(out)
            sums[il] = sums[il] + sum(e - f for e, f in zip(*states))
        count += len(marks)
        log(f"state-delta: prompt {i + 1}/{len(prompts)}, {len(tokens)} tokens, {len(marks)} states per layer")
    return {il: (sums[il] / count).astype(np.float32) for il in layers}, count


def write_state_deltas(maps: str | Path, deltas: dict[int, np.ndarray], out: str | Path) -> Path:
    """A copy of the maps GGUF with these offsets (replacing any it had), written atomically."""
    def write(tmp: Path) -> None:
        w, r = writer_like(maps, tmp)
        if DATA_SHA256 not in r.fields:
            w.add_string(DATA_SHA256, DATA_SHA256_PLACEHOLDER)
        copy_tensors(r, w, keep=lambda name: not name.endswith(".rf_state_delta"))  # the offsets are replaced
        for il in sorted(deltas):
            w.add_tensor(state_delta_name(il), np.ascontiguousarray(deltas[il], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        seal(tmp)

    return write_atomic_with(Path(out), write)
