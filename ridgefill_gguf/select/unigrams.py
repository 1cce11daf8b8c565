"""The protected rules' token frequency table (tensor rf_token_freq of a maps GGUF): add-one unigram counts of the
calibration text, one per token id, as the model's tokenizer splits it."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..maps import format as fmt
from ..maps.merge import MergeError, merge


def token_counts(tokens: list[int], n_vocab: int) -> np.ndarray:
    """How often each token id occurs (ids outside the vocabulary are not counted)."""
    ids = np.asarray(tokens, dtype=np.int64)
    return np.bincount(ids[(ids >= 0) & (ids < n_vocab)], minlength=n_vocab)


def add_one_counts(token_lists: Iterable[list[int]], n_vocab: int) -> np.ndarray:
    counts = np.ones(n_vocab, dtype=np.int64)
    for tokens in token_lists:
        counts += token_counts(tokens, n_vocab)
    return counts.astype(np.float32)


def count_documents(tokenize: Callable[[str], list[int]], texts: Iterable[str], n_vocab: int) -> np.ndarray:
    return add_one_counts((tokenize(t) for t in texts), n_vocab)


def with_token_freq(maps_path: str | Path, token_freq: np.ndarray, out: str | Path | None = None) -> Path:
    """Write the maps file again with the table (in place when out is None; through a temporary file)."""
    try:
        return merge([maps_path], out or maps_path, force=True, token_freq=np.asarray(token_freq, np.float32))
    except MergeError as e:
        raise ValueError(str(e)) from e


def read_token_freq(maps_path: str | Path) -> np.ndarray | None:
    g = fmt.read_maps(maps_path)
    if fmt.TOKEN_FREQ not in g.tensors:
        return None
    return np.asarray(g.raw(fmt.TOKEN_FREQ)).view(np.float32).copy()
