"""`ridgefill-gguf convert`: third-party maps (int8 folders, float safetensors) to the maps GGUF.

Sources:
- int8 folder: ridgefill.json ({split, layers, lambda?, tail?, name?, license?, authors?, doi?,
  architecture?}) and per layer l a proj8.L{l}.safetensors with proj.{l}.codes (int8 [d_out, d_in]),
  proj.{l}.scale (bf16 [d_out, d_in/128]) and proj.{l}.bias (bf16 [d_out]);
- float file: one safetensors with proj.{l}.weight ([d_out, d_in], bf16/f16/f32) and proj.{l}.bias,
  and split, layers (lambda, tail, ...) in its __metadata__.
Every problem is reported with the file, the tensor and what is wrong; nothing is left behind.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from . import format as fmt
from .quant import (F16_MAX, INT8_GROUP, QK8_0, Q8RangeError, bf16_to_f32, f32_to_bf16, int8_groups_to_q8_0,
                    quantize_q8_0)
from .safetensors_io import SafetensorsError, SafetensorsFile

FLOAT_WEIGHT_DTYPES = ("BF16", "F16", "F32")


class ConvertError(ValueError):
    pass


@dataclass
class ConvertReport:
    source: str
    source_kind: str
    out: str
    outtype: str
    layers: list[int]
    d_in: int
    d_out: int
    bytes: int
    seconds: float
    blocks: int = 0
    requantized_blocks: int = 0
    warnings: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# sources: each knows its layers' shapes up front (for the header) and yields float or int8 data


class Int8Folder:
    kind = "int8 folder"

    def __init__(self, folder: Path):
        self.folder = folder
        cfg_path = folder / "ridgefill.json"
        if not cfg_path.exists():
            raise ConvertError(f"{folder}: no ridgefill.json: not an int8 maps folder")
        try:
            self.config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ConvertError(f"{cfg_path}: not valid JSON: {e}") from e
        for key in ("split", "layers"):
            if key not in self.config:
                raise ConvertError(f"{cfg_path}: '{key}' is missing")
        self.split, self.layers = _split_and_layers(self.config["split"], self.config["layers"], cfg_path)
        self.files: dict[int, SafetensorsFile] = {}
        self.shapes: dict[int, tuple[int, int]] = {}
        for layer in self.layers:
            path = folder / f"proj8.L{layer}.safetensors"
            if not path.exists():
                raise ConvertError(f"{cfg_path} lists layer {layer} but {path} is missing")
            st = _open(path)
            codes, scale, bias = (f"proj.{layer}.codes", f"proj.{layer}.scale", f"proj.{layer}.bias")
            for name, dtype in ((codes, "I8"), (scale, "BF16"), (bias, "BF16")):
                if name not in st:
                    raise ConvertError(f"{path}: tensor '{name}' is missing")
                if st.entries[name].dtype != dtype:
                    raise ConvertError(f"{path}: tensor '{name}' is {st.entries[name].dtype}, expected {dtype}")
            shape = st.entries[codes].shape
            if len(shape) != 2:
                raise ConvertError(f"{path}: tensor '{codes}' has shape {list(shape)}, expected [d_out, d_in]")
            d_out, d_in = shape
            if d_in % INT8_GROUP:
                raise ConvertError(f"{path}: tensor '{codes}' has d_in {d_in}, not a multiple of {INT8_GROUP} "
                                   "(one scale per 128 weights)")
            if st.entries[scale].shape != (d_out, d_in // INT8_GROUP):
                raise ConvertError(f"{path}: tensor '{scale}' has shape {list(st.entries[scale].shape)}, "
                                   f"expected [{d_out}, {d_in // INT8_GROUP}]")
            if st.entries[bias].shape != (d_out,):
                raise ConvertError(f"{path}: tensor '{bias}' has shape {list(st.entries[bias].shape)}, "
                                   f"expected [{d_out}]")
            self.files[layer], self.shapes[layer] = st, (d_out, d_in)

    def where(self, layer: int) -> str:
        return f"{self.files[layer].path}: tensor 'proj.{layer}.codes'"

    def meta_fields(self) -> dict:
        c = self.config
        authors = c.get("authors")
        return {"lam": c.get("lambda"), "tail_default": c.get("tail"), "name": c.get("name"),
                "license": c.get("license"), "doi": c.get("doi"), "url": c.get("url"),
                "author": ", ".join(authors) if isinstance(authors, list) else authors,
                "architecture": c.get("architecture")}

    def int8(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        st = self.files[layer]
        codes, scale, bias = (st.get(f"proj.{layer}.{k}") for k in ("codes", "scale", "bias"))
        _finite(bf16_to_f32(scale), st.path, f"proj.{layer}.scale")
        bias32 = bf16_to_f32(bias)
        _finite(bias32, st.path, f"proj.{layer}.bias")
        return codes, scale, bias32

    def float32(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        codes, scale, bias = self.int8(layer)
        d_out, d_in = codes.shape
        w = codes.reshape(d_out, d_in // INT8_GROUP, INT8_GROUP).astype(np.float32) * bf16_to_f32(scale)[..., None]
        return w.reshape(d_out, d_in), bias


class FloatFile:
    kind = "float safetensors"

    def __init__(self, path: Path):
        self.st = _open(path)
        md = self.st.metadata
        for key in ("split", "layers"):
            if key not in md:
                raise ConvertError(f"{path}: __metadata__ has no '{key}'")
        self.split, self.layers = _split_and_layers(md["split"], md["layers"], path)
        self.shapes = {}
        for layer in self.layers:
            wn, bn = f"proj.{layer}.weight", f"proj.{layer}.bias"
            for name in (wn, bn):
                if name not in self.st:
                    raise ConvertError(f"{path}: tensor '{name}' is missing (ridgefill layer {layer})")
                if self.st.entries[name].dtype not in FLOAT_WEIGHT_DTYPES:
                    raise ConvertError(f"{path}: tensor '{name}' is {self.st.entries[name].dtype}, "
                                       f"expected one of {', '.join(FLOAT_WEIGHT_DTYPES)}")
            shape = self.st.entries[wn].shape
            if len(shape) != 2:
                raise ConvertError(f"{path}: tensor '{wn}' has shape {list(shape)}, expected [d_out, d_in]")
            if self.st.entries[bn].shape != (shape[0],):
                raise ConvertError(f"{path}: tensor '{bn}' has shape {list(self.st.entries[bn].shape)}, "
                                   f"expected [{shape[0]}]")
            self.shapes[layer] = shape

    def where(self, layer: int) -> str:
        return f"{self.st.path}: tensor 'proj.{layer}.weight'"

    def meta_fields(self) -> dict:
        md = self.st.metadata
        num = lambda k, t: t(md[k]) if k in md else None  # noqa: E731
        return {"lam": num("lambda", float), "tail_default": num("tail", int), "name": md.get("name"),
                "license": md.get("license"), "doi": md.get("doi"), "url": md.get("url"),
                "author": md.get("authors") or md.get("author"), "architecture": md.get("architecture")}

    def float32(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        w, b = (self._f32(f"proj.{layer}.{k}") for k in ("weight", "bias"))
        return w, b

    def _f32(self, name: str) -> np.ndarray:
        raw = self.st.get(name)
        x = bf16_to_f32(raw) if self.st.entries[name].dtype == "BF16" else np.asarray(raw, dtype=np.float32)
        _finite(x, self.st.path, name)
        return x


def _open(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(path)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from e


def _finite(x: np.ndarray, path: Path, name: str) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ConvertError(f"{path}: tensor '{name}' has {int(bad.sum())} NaN/Inf value(s), first at {list(idx)}")


def _split_and_layers(split, layers, where: Path) -> tuple[int, list[int]]:
    try:
        split = int(split)
        if isinstance(layers, str):
            layers = json.loads(layers) if layers.strip().startswith("[") else layers.split(",")
        layers = [int(x) for x in layers]
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: 'split' must be an integer and 'layers' a list of integers ({e})") from e
    if not layers:
        raise ConvertError(f"{where}: 'layers' is empty")
    if layers != sorted(set(layers)):
        raise ConvertError(f"{where}: 'layers' is not strictly increasing: {layers}")
    if split < 1:
        raise ConvertError(f"{where}: split {split} must be at least 1")
    if min(layers) < split:
        raise ConvertError(f"{where}: layer {min(layers)} is below the split {split}: maps are for layers at or "
                           "above the split")
    return split, layers


def open_source(src: Path) -> Int8Folder | FloatFile:
    if src.is_dir():
        return Int8Folder(src)
    if src.is_file():
        return FloatFile(src)
    raise ConvertError(f"{src}: no such file or folder")


# ---------------------------------------------------------------------------------------------


def convert(src: str | Path, out: str | Path, *, model: str | Path | None = None, outtype: str = "q8_0",
            arch: str | None = None, force: bool = False,
            progress: Callable[[str], None] | None = None) -> ConvertReport:
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if outtype not in fmt.WEIGHT_TYPES:
        raise ConvertError(f"--outtype {outtype}: expected one of {', '.join(fmt.WEIGHT_TYPES)}")
    if out.exists() and not force:
        raise ConvertError(f"{out} exists: pass --force to overwrite it")
    source = open_source(src)
    qtype = fmt.WEIGHT_TYPES[outtype]
    fields = source.meta_fields()
    fingerprint = None
    if model is not None:
        try:
            fingerprint = fmt.model_fingerprint(model)
        except (OSError, ValueError) as e:
            raise ConvertError(f"--model: {e}") from e
    architecture = (fingerprint.architecture if fingerprint else None) or arch or fields.pop("architecture", None)
    fields.pop("architecture", None)
    if not architecture:
        raise ConvertError("the model's architecture is unknown: pass --model MODEL.gguf (recommended: it also "
                           "checks the maps against the model) or --arch")
    if fingerprint and arch and arch != fingerprint.architecture:
        raise ConvertError(f"--arch {arch} contradicts the model's architecture {fingerprint.architecture}")
    d_outs = {s[0] for s in source.shapes.values()}
    d_ins = {s[1] for s in source.shapes.values()}
    if qtype == QT.Q8_0:
        for layer, (_, d_in) in source.shapes.items():
            if d_in % QK8_0:
                raise ConvertError(f"{source.where(layer)}: d_in {d_in} is not a multiple of {QK8_0}: Q8_0 needs "
                                   "whole blocks (use --outtype f16)")
    meta = fmt.MapsMeta(architecture=architecture, split=source.split, layers=source.layers, **fields)
    if fingerprint:
        meta.model_n_layer, meta.model_n_embd = fingerprint.n_layer, fingerprint.n_embd
        meta.model_vocab_sha256 = fingerprint.vocab_sha256
        problems = _early_model_checks(source, fingerprint)
        if problems:
            raise ConvertError(f"the maps do not fit {model}:\n  " + "\n  ".join(problems))
    plans = [fmt.LayerPlan(layer, source.shapes[layer][1], source.shapes[layer][0], qtype) for layer in source.layers]
    counts = {"blocks": 0, "requantized": 0}

    def produce(plan: fmt.LayerPlan) -> fmt.LayerMap:
        try:
            if isinstance(source, Int8Folder) and qtype == QT.Q8_0:
                codes, scale, bias = source.int8(plan.layer)
                weight, n_requant = int8_groups_to_q8_0(codes, scale)
                counts["blocks"] += codes.size // QK8_0
                counts["requantized"] += n_requant
            else:
                w, bias = source.float32(plan.layer)
                weight = encode(w, qtype)
        except (Q8RangeError, SafetensorsError) as e:
            raise ConvertError(f"{source.where(plan.layer)}: {e}") from e
        return fmt.LayerMap(plan.layer, weight, qtype, plan.d_in, bias)

    fmt.write_maps(out, meta, plans, produce, force=force, progress=progress)
    written = fmt.read_maps(out)
    problems = fmt.check_maps(written, fingerprint)
    problems.errors += fmt.check_values(written)
    if not problems.ok:  # a converter that writes what the engine refuses would be a bug: say so, keep nothing
        out.unlink()
        raise ConvertError("internal error, the written file fails its own checks:\n  " + "\n  ".join(problems.errors))
    return ConvertReport(
        source=str(src), source_kind=source.kind, out=str(out), outtype=outtype, layers=source.layers,
        d_in=max(d_ins), d_out=max(d_outs), bytes=out.stat().st_size, seconds=time.perf_counter() - t0,
        blocks=counts["blocks"], requantized_blocks=counts["requantized"], warnings=problems.warnings)


def encode(w: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype in (QT.Q8_0, QT.F16) and np.abs(w).max() / (127 if qtype == QT.Q8_0 else 1) > F16_MAX:
        raise Q8RangeError(f"max |w| {float(np.abs(w).max()):g} is too large for {qtype.name} "
                           "(use --outtype bf16 or f32)")
    if qtype == QT.Q8_0:
        return quantize_q8_0(w)
    if qtype == QT.F16:
        return w.astype(np.float16)
    if qtype == QT.BF16:
        return f32_to_bf16(w)
    return np.ascontiguousarray(w, dtype=np.float32)


def _early_model_checks(source, fp: fmt.ModelFingerprint) -> list[str]:
    problems = []
    if not source.split < fp.n_layer:
        problems.append(f"split {source.split} is outside the model's layers 1..{fp.n_layer - 1}")
    if max(source.layers) >= fp.n_layer:
        problems.append(f"layer {max(source.layers)} does not exist: the model has layers 0..{fp.n_layer - 1}")
    for layer, (d_out, d_in) in source.shapes.items():
        if d_in != fp.n_embd or d_out != fp.n_embd:
            problems.append(f"{source.where(layer)}: the map is {d_out}x{d_in} (d_out x d_in), the model's "
                            f"residual stream is {fp.n_embd} wide")
            break
    return problems
