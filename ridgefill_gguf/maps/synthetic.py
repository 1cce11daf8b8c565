"""Synthetic maps in the third-party source formats, for tests and the conversion benchmark."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .quant import INT8_GROUP, f32_to_bf16
from .safetensors_io import save


def near_identity(rng: np.random.Generator, d_out: int, d_in: int, noise: float = 0.02) -> np.ndarray:
    """A map like a fitted one: close to the identity, with small dense corrections."""
    w = rng.standard_normal((d_out, d_in), dtype=np.float32) * np.float32(noise)
    k = min(d_out, d_in)
    w[np.arange(k), np.arange(k)] += 1.0
    return w


def write_int8_folder(folder: str | Path, split: int, layers: list[int], d_out: int, d_in: int | None = None,
                      seed: int = 0, config: dict | None = None, scale_exponents: tuple[int, int] = (-8, -4)
                      ) -> Path:
    """int8 codes, one bf16 scale per 128 columns (2**e times a mantissa, e drawn from scale_exponents),
    bf16 bias; plus ridgefill.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d_in = d_in or d_out
    rng = np.random.default_rng(seed)
    for layer in layers:
        codes = rng.integers(-127, 128, size=(d_out, d_in), dtype=np.int8)
        exps = rng.integers(scale_exponents[0], scale_exponents[1] + 1, size=(d_out, d_in // INT8_GROUP))
        scale = (rng.uniform(1.0, 2.0, size=exps.shape) * np.exp2(exps)).astype(np.float32)
        bias = rng.standard_normal(d_out, dtype=np.float32) * np.float32(0.1)
        save(folder / f"proj8.L{layer}.safetensors",
             {f"proj.{layer}.codes": codes, f"proj.{layer}.scale": f32_to_bf16(scale),
              f"proj.{layer}.bias": f32_to_bf16(bias)}, bf16=(f"proj.{layer}.scale", f"proj.{layer}.bias"))
    cfg = {"split": split, "layers": layers, "lambda": 0.03, "tail": 4096, "name": "synthetic maps"}
    cfg.update(config or {})
    (folder / "ridgefill.json").write_text(json.dumps(cfg, indent=1))
    return folder


def write_float_file(path: str | Path, split: int, layers: list[int], d_out: int, d_in: int | None = None,
                     dtype: str = "bf16", seed: int = 0, metadata: dict | None = None) -> Path:
    path = Path(path)
    d_in = d_in or d_out
    rng = np.random.default_rng(seed)
    tensors, bf16 = {}, []
    for layer in layers:
        w = near_identity(rng, d_out, d_in)
        b = rng.standard_normal(d_out, dtype=np.float32) * np.float32(0.1)
        for name, x in ((f"proj.{layer}.weight", w), (f"proj.{layer}.bias", b)):
            if dtype == "bf16":
                tensors[name] = f32_to_bf16(x)
                bf16.append(name)
            else:
                tensors[name] = x.astype({"f16": np.float16, "f32": np.float32}[dtype])
    md = {"split": str(split), "layers": json.dumps(layers), "lambda": "0.01", "tail": "1024"}
    md.update(metadata or {})
    save(path, tensors, md, bf16=tuple(bf16))
    return path
