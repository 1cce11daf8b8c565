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


def write_random_maps(model: str | Path, split: int, out: str | Path, *, outtype: str = "q8_0", seed: int = 0,
                      tail_default: int | None = None, force: bool = False) -> Path:
    """Near-identity maps for every layer after `split` of a model: for timing at real shapes (speed does
    not depend on the maps' values) and for tests."""
    from . import format as fmt
    from .convert import encode

    fp = fmt.model_fingerprint(model)
    if not 1 <= split <= fp.n_layer - 2:
        raise ValueError(f"split {split}: maps need 1 <= split <= n_layer - 2 = {fp.n_layer - 2}")
    layers = list(range(split + 1, fp.n_layer))
    qtype = fmt.WEIGHT_TYPES[outtype]
    meta = fmt.MapsMeta(fp.architecture, split, layers, lam=None, tail_default=tail_default,
                        name="random near-identity maps (timing only)", model_n_layer=fp.n_layer,
                        model_n_embd=fp.n_embd, model_vocab_sha256=fp.vocab_sha256)
    rng = np.random.default_rng(seed)

    def produce(p):
        w = near_identity(rng, fp.n_embd, fp.n_embd)
        b = rng.standard_normal(fp.n_embd, dtype=np.float32) * np.float32(0.01)
        return fmt.LayerMap(p.layer, encode(w, qtype), qtype, fp.n_embd, b)

    plans = [fmt.LayerPlan(layer, fp.n_embd, fp.n_embd, qtype) for layer in layers]
    return fmt.write_maps(out, meta, plans, produce, force=force)


def tiny_model_with_maps(folder: str | Path, arch: str, *, n_layer: int, split: int, prepare=None,
                         model_seed: int = 3, maps_seed: int = 4, n_embd: int | None = None,
                         n_ff: int | None = None, **fields: int) -> tuple[Path, Path]:
    """A tiny random model of `arch` (n_embd wide, n_ff in its FFN and any other ModelShape field given: the tiny
    preset's by default) with random F32 maps for every layer after `split`, for tests and tools; prepare(path, out)
    -> out may rewrite the model first (a hybrid's slow decay)."""
    import dataclasses

    from ..random_gguf import tiny_shape, write_random_model
    from .convert import convert

    folder = Path(folder)
    sizes = {k: v for k, v in (("n_embd", n_embd), ("n_ff", n_ff)) if v} | fields
    shape = dataclasses.replace(tiny_shape(arch), n_layer=n_layer, **sizes)
    model = write_random_model(folder / f"{arch}{'-stock' if prepare else ''}.gguf", shape, seed=model_seed)
    if prepare:
        model = prepare(model, folder / f"{arch}.gguf")
    src = write_float_file(folder / f"{arch}.safetensors", split, list(range(split + 1, n_layer)), shape.n_embd,
                           dtype="f32", seed=maps_seed)
    return model, convert(src, folder / f"{arch}.maps.gguf", model=model, outtype="f32").out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write near-identity maps for a model (timing only)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--split", type=int, required=True)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    print(write_random_maps(a.model, a.split, a.out, outtype=a.outtype, force=a.force))
