"""The protected rules' token frequency table (tensor rf_token_freq of a maps GGUF): add-one unigram counts of the
calibration text, one per token id, as the model's tokenizer splits it."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..maps import format as fmt
from ..maps.merge import _RAW_DTYPE


def add_one_counts(token_lists: Iterable[list[int]], n_vocab: int) -> np.ndarray:
    counts = np.ones(n_vocab, dtype=np.float64)
    for tokens in token_lists:
        ids = np.asarray(tokens, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < n_vocab)]
        counts += np.bincount(ids, minlength=n_vocab)
    return counts.astype(np.float32)


def count_documents(tokenize: Callable[[str], list[int]], texts: Iterable[str], n_vocab: int) -> np.ndarray:
    return add_one_counts((tokenize(t) for t in texts), n_vocab)


def with_token_freq(maps_path: str | Path, token_freq: np.ndarray, out: str | Path | None = None) -> Path:
    """Write the maps file again with the table (in place when out is None; through a temporary file)."""
    maps_path = Path(maps_path)
    g = fmt.read_maps(maps_path)
    problems = fmt.check_maps(g)
    if not problems.ok:
        raise ValueError(f"{maps_path}: " + "; ".join(problems.errors))
    meta = fmt.maps_meta(g)
    plans = []
    for layer in meta.layers:
        w = g.tensors[fmt.weight_name(layer)]
        plans.append(fmt.LayerPlan(layer, int(w.ne[0]), int(w.ne[1]), w.type))

    def produce(plan: fmt.LayerPlan) -> fmt.LayerMap:
        raw = np.asarray(g.raw(fmt.weight_name(plan.layer))).view(_RAW_DTYPE[plan.weight_type])
        bias = np.asarray(g.raw(fmt.bias_name(plan.layer))).view(np.float32)
        return fmt.LayerMap(plan.layer, raw.reshape(plan.d_out, -1).copy(), plan.weight_type, plan.d_in, bias.copy())

    target = Path(out) if out else maps_path
    return fmt.write_maps(target, meta, plans, produce, token_freq=np.asarray(token_freq, dtype=np.float32),
                          force=True)


def read_token_freq(maps_path: str | Path) -> np.ndarray | None:
    g = fmt.read_maps(maps_path)
    if fmt.TOKEN_FREQ not in g.tensors:
        return None
    return np.asarray(g.raw(fmt.TOKEN_FREQ)).view(np.float32).copy()
