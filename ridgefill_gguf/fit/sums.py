"""Running sums for the ridge fit: one document at a time, exactly what a solve on all rows would see.

Per split S: n, Σx_S, Σy_l, X_SᵀX_S and X_SᵀY_l for every later layer l. Each chunk's products are
computed in float32 and added into float64 sums, so the order of documents does not matter beyond
float64 rounding, and a solve from the sums equals a one-shot solve on the stacked rows.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..select.unigrams import token_counts

SUMS_VERSION = 1


@dataclass
class SplitSums:
    split: int
    layers: list[int]
    d_in: int
    d_out: int
    n: int = 0
    sum_x: np.ndarray = None           # [d_in] float64
    xtx: np.ndarray = None             # [d_in, d_in] float64
    sum_y: dict[int, np.ndarray] = field(default_factory=dict)   # l -> [d_out]
    xty: dict[int, np.ndarray] = field(default_factory=dict)     # l -> [d_in, d_out]

    def __post_init__(self):
        if self.sum_x is None:
            self.sum_x = np.zeros(self.d_in, np.float64)
            self.xtx = np.zeros((self.d_in, self.d_in), np.float64)
        # all layers side by side, so that one product and one add serve them; per-layer views for the rest
        self._gpu = None
        k = len(self.layers)
        self._sum_y_all = np.zeros(k * self.d_out, np.float64)
        self._xty_all = np.zeros((self.d_in, k * self.d_out), np.float64)
        for i, layer in enumerate(self.layers):
            cols = slice(i * self.d_out, (i + 1) * self.d_out)
            if layer in self.sum_y:  # loaded values
                self._sum_y_all[cols], self._xty_all[:, cols] = self.sum_y[layer], self.xty[layer]
            self.sum_y[layer], self.xty[layer] = self._sum_y_all[cols], self._xty_all[:, cols]

    def add(self, x, ys: dict) -> None:
        """Add rows: x [n, d_in] is layer S's input, ys[l] [n, d_out] layer l's input, float32; numpy arrays, or
        torch tensors already on the GPU (the capture's fast path)."""
        on_gpu = isinstance(x, torch.Tensor)
        if not on_gpu:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if not len(x):
            return
        self.n += len(x)
        if on_gpu or torch.cuda.is_available():
            # on a GPU the products are ~100x faster; the float64 sums stay there until flush()
            def gpu(a):
                return a.float() if isinstance(a, torch.Tensor) else torch.from_numpy(
                    np.ascontiguousarray(a, dtype=np.float32)).cuda()

            xt = gpu(x)
            y = torch.cat([gpu(ys[layer]) for layer in self.layers], dim=1)
            if self._gpu is None:
                self._gpu = [torch.zeros(self.xtx.shape, dtype=torch.float64, device=xt.device),
                             torch.zeros(self._xty_all.shape, dtype=torch.float64, device=xt.device),
                             torch.zeros(self._sum_y_all.shape, dtype=torch.float64, device=xt.device),
                             torch.zeros(self.sum_x.shape, dtype=torch.float64, device=xt.device)]
            self._gpu[0].add_(xt.T @ xt)
            self._gpu[1].add_(xt.T @ y)
            self._gpu[2].add_(y.sum(dim=0, dtype=torch.float64))
            self._gpu[3].add_(xt.sum(dim=0, dtype=torch.float64))
            return
        self.sum_x += x.sum(axis=0, dtype=np.float64)
        # float32 products in one call for all layers, widened into the float64 sums in place (torch does
        # the mixed-precision add several times faster than numpy)
        xt = torch.from_numpy(x)
        y = torch.from_numpy(np.concatenate([np.asarray(ys[layer], dtype=np.float32) for layer in self.layers],
                                            axis=1))
        torch.from_numpy(self.xtx).add_(xt.T @ xt)
        torch.from_numpy(self._xty_all).add_(xt.T @ y)
        self._sum_y_all += y.sum(dim=0, dtype=torch.float64).numpy()

    def flush(self) -> "SplitSums":
        """Bring sums kept on the GPU into the float64 arrays (before reading, saving or solving)."""
        if self._gpu is not None:
            self.xtx += self._gpu[0].cpu().numpy()
            self._xty_all += self._gpu[1].cpu().numpy()
            self._sum_y_all += self._gpu[2].cpu().numpy()
            self.sum_x += self._gpu[3].cpu().numpy()
            self._gpu = None
        return self

    @staticmethod
    def bytes_needed(d_in: int, d_out: int, n_layers: int) -> int:
        return 8 * (d_in * d_in + d_in + n_layers * (d_in * d_out + d_out))


@dataclass
class CaptureState:
    """Everything a capture has accumulated, with what it has read so far (for resuming)."""
    model_sha: str
    splits: dict[int, SplitSums]
    done_docs: list[str] = field(default_factory=list)  # sha256 of each finished document
    tokens: int = 0
    excluded_rows: dict[str, dict[str, int]] = field(default_factory=dict)  # split -> reason -> rows
    options: dict = field(default_factory=dict)
    # each token id's count over the calibration documents (rf_token_freq is this plus one); None when the sums
    # were begun by a version that did not count
    token_counts: np.ndarray | None = None

    def count_tokens(self, tokens: list[int], n_vocab: int) -> None:
        if self.token_counts is None and not self.done_docs:
            self.token_counts = np.zeros(n_vocab, dtype=np.int64)
        if self.token_counts is not None:
            self.token_counts += token_counts(tokens, n_vocab)

    def token_freq(self) -> np.ndarray | None:
        """The add-one unigram counts a maps file carries (tensor rf_token_freq)."""
        return None if self.token_counts is None else (self.token_counts + 1).astype(np.float32)

    def save(self, path: Path) -> None:
        """Atomically: an interrupted save leaves the previous checkpoint intact."""
        arrays = {}
        for s, ss in self.splits.items():
            ss.flush()
            arrays[f"{s}/sum_x"], arrays[f"{s}/xtx"] = ss.sum_x, ss.xtx
            for layer in ss.layers:
                arrays[f"{s}/sum_y/{layer}"], arrays[f"{s}/xty/{layer}"] = ss.sum_y[layer], ss.xty[layer]
        header = {"version": SUMS_VERSION, "model_sha": self.model_sha, "done_docs": self.done_docs,
                  "tokens": self.tokens, "excluded_rows": self.excluded_rows, "options": self.options,
                  "splits": {str(s): {"layers": ss.layers, "d_in": ss.d_in, "d_out": ss.d_out, "n": ss.n}
                             for s, ss in self.splits.items()}}
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        if self.token_counts is not None:
            arrays["token_counts"] = self.token_counts
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npz", dir=path.parent)
        os.close(fd)
        try:
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> "CaptureState":
        with np.load(path) as data:
            header = json.loads(bytes(data["header"]).decode())
            if header.get("version") != SUMS_VERSION:
                raise ValueError(f"{path}: sums format {header.get('version')}, this version reads {SUMS_VERSION}")
            splits = {}
            for s_str, info in header["splits"].items():
                s = int(s_str)
                layers = info["layers"]
                ss = SplitSums(s, layers, info["d_in"], info["d_out"], info["n"],
                               data[f"{s}/sum_x"].copy(), data[f"{s}/xtx"].copy(),
                               {layer: data[f"{s}/sum_y/{layer}"] for layer in layers},
                               {layer: data[f"{s}/xty/{layer}"] for layer in layers})
                splits[s] = ss
            counts = data["token_counts"].copy() if "token_counts" in data.files else None
        return cls(header["model_sha"], splits, header["done_docs"], header["tokens"], header["excluded_rows"],
                   header["options"], counts)
