"""Capture layer inputs through llama.cpp (the patched build, RidgeFill off), one document at a time.

The model runs as llama.cpp serves it (quantized weights, its own kernels). For every prompt row the
capture reads the input of each layer from the first split up: the residual stream before the layer's
first norm, through llama_ridgefill_get_layer_input.

Attention-sink rows are left out of every sum (paper §2.4; measured on SmolLM2: with them the fitted maps
score below the identity). The rule, applied per document and per split:
  1. position: the document's first row (BOS, or the first token), always;
  2. special: rows whose token is a control token of the vocabulary (BOS/EOS/chat markers);
  3. outlier: rows whose split-state norm exceeds OUTLIER_FACTOR times the median norm of the document's
     other rows (sinks that sit elsewhere in the text).
Each exclusion is counted by reason.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

OUTLIER_FACTOR = 8.0


@dataclass
class Document:
    doc_id: str      # sha256 of the text
    name: str
    text: str


@dataclass
class CapturedRows:
    """Rows of one document, after exclusions, for one split: x [n, d] and ys[l] [n, d], float32."""
    split: int
    x: np.ndarray
    ys: dict[int, np.ndarray]


@dataclass
class DocCapture:
    n_tokens: int
    splits: dict[int, CapturedRows]
    excluded: dict[int, dict[str, int]] = field(default_factory=dict)  # split -> reason -> rows


TEXT_SUFFIXES = {".txt", ".md", ".py", ".c", ".h", ".js", ".tex", ".rst", ".json", ".html", ".cpp", ".rnw"}


def text_files(paths: list[str | Path]) -> list[Path]:
    """The text files under the given files and folders, in a stable order."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    if not files:
        raise ValueError(f"no text files in {', '.join(map(str, paths))}")
    return files


def iter_documents(paths: list[str | Path]) -> Iterator[Document]:
    """Text files under the given files and folders, in a stable order; unreadable or empty ones raise."""
    for f in text_files(paths):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{f}: unreadable as UTF-8 text ({e})") from e
        if text.strip():
            yield Document(hashlib.sha256(text.encode()).hexdigest(), str(f), text)


def file_hashes(paths: list[str | Path]) -> dict[str, str]:
    return {d.doc_id: d.name for d in iter_documents(paths)}


class Capturer:
    """One llama.cpp context with capture on for the given layers (an int: that layer and all above it)."""

    def __init__(self, model_path: str | Path, layers: int | list[int], *, n_ctx: int = 4096, n_batch: int = 512,
                 n_threads: int | None = None, n_gpu_layers: int = 0, **llama_kwargs):
        from .. import libs
        from ..engine import bindings

        self.bindings = bindings
        self.llama_cpp = libs.use_build("ridgefill")
        self.llm = self.llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                        n_threads=n_threads, n_threads_batch=n_threads, n_gpu_layers=n_gpu_layers,
                                        logits_all=False, verbose=False, **llama_kwargs)
        self.ctx, self.model = self.llm.ctx, self.llm.model
        if not bindings.capture_supported(self.model):
            arch = self.llm.metadata.get("general.architecture", "?")
            raise ValueError(f"architecture '{arch}' is not supported by RidgeFill capture "
                             "(llama, qwen2, qwen3, qwen35, qwen3next, gemma3)")
        self.n_layer = self.llama_cpp.llama_model_n_layer(self.model)
        self.n_embd = self.llm.n_embd()
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self._stream = None  # the side stream of the GPU path's copies, made on first use
        self.layers = list(range(layers, self.n_layer)) if isinstance(layers, int) else sorted(layers)
        for layer in self.layers:
            bindings.capture_layer_input(self.ctx, layer, True)
        vocab = self.llama_cpp.llama_model_get_vocab(self.model)
        self._is_control = lambda t: bool(self.llama_cpp.llama_vocab_is_control(vocab, t))

    def tokenize(self, text: str, max_tokens: int) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=True, special=False)[:max_tokens]

    def run(self, tokens: list[int], device: str | None = None) -> dict:
        """Every captured layer's inputs for a whole token sequence, {layer: [n, d]} float32: numpy arrays, or
        torch tensors on `device` ("cuda"), copied there from llama.cpp's buffers on the device that computed them
        (on a GPU two host crossings per row, not the model, would otherwise set the capture's speed)."""
        self.llm.reset()  # the next eval drops every cached position from 0 on
        n, d = len(tokens), self.n_embd
        # on a GPU the copies run on a side stream: waiting for them before the next decode (which overwrites
        # llama.cpp's rows) then does not wait for the previous document's sums, which overlap this prefill
        stream = self._copy_stream(device)
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            out = ({layer: np.empty((n, d), np.float32) for layer in self.layers} if device is None else
                   {layer: torch.empty((n, d), dtype=torch.float32, device=device) for layer in self.layers})
        if stream:
            for t in out.values():  # read later on the default stream: freed only after those reads
                t.record_stream(torch.cuda.current_stream(device))
        # on a device, llama.cpp keeps the rows where it computed them: no crossing to the host and back
        self.bindings.capture_on_device(self.ctx, device is not None)
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            self.llm.eval(chunk)
            with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                for layer in self.layers:
                    if device is None:
                        out[layer][start:start + len(chunk)] = self.bindings.layer_input_view(
                            self.ctx, layer, len(chunk), d)
                    else:
                        out[layer][start:start + len(chunk)].copy_(
                            self.bindings.layer_input_tensor(self.ctx, layer, len(chunk), d))
            if stream:
                stream.synchronize()
        if stream:
            torch.cuda.current_stream(device).wait_stream(stream)
        return out

    def _copy_stream(self, device: str | None):
        if device is None or torch.device(device).type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def capture(self, tokens: list[int], splits: list[int], stride: int = 1, device: str | None = None) -> DocCapture:
        """The rows that enter the sums, per split; on `device` (torch tensors) or as numpy arrays."""
        inputs = self.run(tokens, device)
        control = np.array([self._is_control(t) for t in tokens])
        out = DocCapture(len(tokens), {})
        for split in splits:
            keep, out.excluded[split] = row_mask(inputs[split], control)
            keep &= (np.arange(len(tokens)) % stride) == 0
            if device is not None:
                keep = torch.from_numpy(keep).to(device)
            out.splits[split] = CapturedRows(split, inputs[split][keep],
                                             {layer: inputs[layer][keep] for layer in self.layers
                                              if layer > split})
        return out

    def close(self) -> None:
        self.llm.close()


def sums_device() -> str | None:
    """Where captured rows go before the sums: the GPU when torch sees one (SplitSums sums there too)."""
    return "cuda" if torch.cuda.is_available() else None


def row_norms(x) -> np.ndarray:
    """Float64 row norms of a numpy array or a torch tensor (computed where the tensor lives)."""
    if isinstance(x, np.ndarray):
        return np.linalg.norm(x.astype(np.float64), axis=1)
    return x.double().norm(dim=1).cpu().numpy()


def row_mask(x_split, control: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
    """Which rows enter the sums, and how many each rule left out (a row counts under its first rule)."""
    n = len(x_split)
    keep = np.ones(n, dtype=bool)
    reasons = {"position": 0, "special": 0, "outlier": 0}
    if n:
        keep[0] = False
        reasons["position"] = 1
    special = control & keep
    reasons["special"] = int(special.sum())
    keep &= ~control
    norms = row_norms(x_split)
    if keep.any():
        median = float(np.median(norms[keep]))
        outlier = keep & (norms > OUTLIER_FACTOR * median)
        reasons["outlier"] = int(outlier.sum())
        keep &= ~outlier
    return keep, reasons
