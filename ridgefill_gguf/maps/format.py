"""The maps GGUF: the contract between the Python tools and the engine (docs/maps-format.md).

One file per (model, split). Keys and tensors follow llama.cpp's adapter conventions:
  blk.{l}.rf_map.weight  Q8_0 | F16 | BF16 | F32, ggml shape [d_in, d_out]: mul_mat(A, x_S) -> [d_out, n]
  blk.{l}.rf_map.bias    F32 [d_out]
  rf_token_freq          F32 [n_vocab] (optional)
`check_maps` holds the checks the engine applies when it loads a file, with the words it uses.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType, GGUFWriter

from ..gguf_io import GGUFFile, read_gguf, tensor_nbytes

FORMAT_VERSION = 1
ADAPTER_TYPE = "ridgefill"
WEIGHT_TYPES = {"q8_0": QT.Q8_0, "f16": QT.F16, "bf16": QT.BF16, "f32": QT.F32}


class K:
    """Metadata keys (DESIGN §2)."""
    GENERAL_TYPE = "general.type"
    ADAPTER_TYPE = "adapter.type"
    ARCH = "general.architecture"
    NAME, LICENSE, AUTHOR, DOI, URL = "general.name", "general.license", "general.author", "general.doi", "general.url"
    FORMAT_VERSION = "ridgefill.format_version"
    SPLIT = "ridgefill.split"
    LAYERS = "ridgefill.layers"
    LAMBDA = "ridgefill.lambda"
    TAIL = "ridgefill.tail_default"
    FIT_ROWS = "ridgefill.fit.rows"
    FIT_CORPUS = "ridgefill.fit.corpus_sha256"
    MODEL_N_LAYER = "ridgefill.model.n_layer"
    MODEL_N_EMBD = "ridgefill.model.n_embd"
    MODEL_VOCAB = "ridgefill.model.vocab_sha256"


def weight_name(layer: int) -> str:
    return f"blk.{layer}.rf_map.weight"


def bias_name(layer: int) -> str:
    return f"blk.{layer}.rf_map.bias"


TOKEN_FREQ = "rf_token_freq"
# sha256 over every tensor's bytes in the header's tensor order: a change that keeps every value finite cannot be
# told from a fitted value, so the file carries this. Written as a placeholder, then sealed in place (seal).
DATA_SHA256 = "ridgefill.tensor_data_sha256"
DATA_SHA256_PLACEHOLDER = "0" * 64


def state_delta_name(layer: int) -> str:
    """The terminal-state correction's offset of a late recurrent layer: F32, shaped as the layer's state."""
    return f"blk.{layer}.rf_state_delta"


@dataclass
class MapsMeta:
    architecture: str
    split: int
    layers: list[int]
    lam: float | None = None
    tail_default: int | None = None
    name: str | None = None
    license: str | None = None
    author: str | None = None
    doi: str | None = None
    url: str | None = None
    fit_rows: int | None = None
    fit_corpus_sha256: str | None = None
    model_n_layer: int | None = None
    model_n_embd: int | None = None
    model_vocab_sha256: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# the model side: what a maps file is checked against


@dataclass
class ModelFingerprint:
    architecture: str
    n_layer: int
    n_embd: int
    vocab_sha256: str | None = None
    n_vocab: int | None = None
    path: str | None = None
    recurrent_layers: tuple[int, ...] = ()  # Gated DeltaNet layers (qwen35)
    n_embd_s: int | None = None             # their recurrent state's size


def vocab_sha256(tokens: Iterable[bytes]) -> str:
    """sha256 over the vocabulary: each token's UTF-8 bytes followed by a NUL, in id order."""
    h = hashlib.sha256()
    for tok in tokens:
        h.update(tok)
        h.update(b"\0")
    return h.hexdigest()


def model_fingerprint(model_path: str | Path) -> ModelFingerprint:
    """Architecture, depth, width and vocabulary hash of a model GGUF."""
    g = read_gguf(model_path)
    arch = g.get("general.architecture")
    if not arch:
        raise ValueError(f"{model_path}: no general.architecture: not a model GGUF")
    n_layer, n_embd = g.get(f"{arch}.block_count"), g.get(f"{arch}.embedding_length")
    if n_layer is None or n_embd is None:
        raise ValueError(f"{model_path}: no {arch}.block_count or {arch}.embedding_length")
    tokens = g.fields.get("tokenizer.ggml.tokens")
    vocab = vocab_sha256(tokens[1]) if tokens else None
    recurrent, n_embd_s = (), None
    if arch in ("qwen35", "qwen3next"):
        interval = int(g.get(f"{arch}.full_attention_interval", 4))
        recurrent = tuple(il for il in range(int(n_layer)) if (il + 1) % interval != 0)
        state = int(g.get(f"{arch}.ssm.state_size"))
        n_embd_s = state * state * int(g.get(f"{arch}.ssm.time_step_rank"))
    return ModelFingerprint(arch, int(n_layer), int(n_embd), vocab, len(tokens[1]) if tokens else None,
                            str(model_path), recurrent, n_embd_s)


# ---------------------------------------------------------------------------------------------
# writing


@dataclass
class LayerMap:
    """One late layer's map, ready to write: encoded weight bytes (or array) and a float32 bias."""
    layer: int
    weight: np.ndarray      # Q8_0: uint8 [d_out, d_in/32*34]; F16/BF16: uint16/float16 [d_out, d_in]; F32
    weight_type: QT
    d_in: int
    bias: np.ndarray        # float32 [d_out]

    @property
    def d_out(self) -> int:
        return int(self.bias.shape[0])


@dataclass
class LayerPlan:
    """What a layer's tensors will look like, known before any data is produced (for the header)."""
    layer: int
    d_in: int
    d_out: int
    weight_type: QT


def _raw_dtype_array(weight: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.BF16:
        return np.ascontiguousarray(weight, dtype=np.uint16)
    if qtype == QT.F16:
        return np.ascontiguousarray(weight, dtype=np.float16)
    if qtype == QT.F32:
        return np.ascontiguousarray(weight, dtype=np.float32)
    return np.ascontiguousarray(weight, dtype=np.uint8)


def write_maps(out: str | Path, meta: MapsMeta, plans: list[LayerPlan],
               produce: Callable[[LayerPlan], LayerMap], *, token_freq: np.ndarray | None = None,
               force: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """Write a maps GGUF, one layer in memory at a time, through a temporary file renamed at the end.

    `plans` fixes the header; `produce(plan)` makes each layer's data when its turn comes."""
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to overwrite it")
    if [p.layer for p in plans] != list(meta.layers):
        raise ValueError("the layer plans do not follow ridgefill.layers")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = GGUFWriter(tmp, meta.architecture, use_temp_file=False)
        _add_meta(w, meta)
        w.add_string(DATA_SHA256, DATA_SHA256_PLACEHOLDER)
        for p in plans:
            w.add_tensor_info(weight_name(p.layer), _byte_shape(p), _info_dtype(p.weight_type),
                              tensor_nbytes((p.d_in, p.d_out), p.weight_type), raw_dtype=p.weight_type)
            w.add_tensor_info(bias_name(p.layer), (p.d_out,), np.dtype(np.float32), 4 * p.d_out, raw_dtype=QT.F32)
        if token_freq is not None:
            w.add_tensor_info(TOKEN_FREQ, token_freq.shape, np.dtype(np.float32), token_freq.nbytes, raw_dtype=QT.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, p in enumerate(plans, start=1):
            lm = produce(p)
            if (lm.layer, lm.d_in, lm.d_out, lm.weight_type) != (p.layer, p.d_in, p.d_out, p.weight_type):
                raise ValueError(f"layer {p.layer}: produced {lm.d_out}x{lm.d_in} {lm.weight_type.name}, "
                                 f"planned {p.d_out}x{p.d_in} {p.weight_type.name}")
            w.write_tensor_data(_raw_dtype_array(lm.weight, lm.weight_type))
            w.write_tensor_data(np.ascontiguousarray(lm.bias, dtype=np.float32))
            if progress:
                progress(f"layer {p.layer} ({i}/{len(plans)})")
        if token_freq is not None:
            w.write_tensor_data(np.ascontiguousarray(token_freq, dtype=np.float32))
        w.close()
        seal(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def tensor_data_sha256(g: GGUFFile) -> str:
    """sha256 over every tensor's bytes, in the header's tensor order (padding left out)."""
    h = hashlib.sha256()
    with open(g.path, "rb") as f:
        for info in g.tensors.values():
            f.seek(info.offset)
            left = info.nbytes
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    raise ValueError(f"{g.path}: tensor {info.name} runs past the end of the file")
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()


def seal(path: str | Path) -> str:
    """Write the file's tensor-data checksum over its DATA_SHA256 placeholder, in place; returns it."""
    g = read_gguf(path)
    offset = g.value_offsets.get(DATA_SHA256)
    if offset is None or len(g.fields[DATA_SHA256][1]) != len(DATA_SHA256_PLACEHOLDER):
        raise ValueError(f"{path}: no {DATA_SHA256} placeholder to seal")
    digest = tensor_data_sha256(g)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(digest.encode())
    return digest


def check_checksum(g: GGUFFile) -> list[str]:
    """The tensor data against the checksum the file carries (none: a file written before it existed)."""
    want = typed(g, DATA_SHA256)
    if want is None:  # of another type: check_maps names it
        return []
    try:
        got = tensor_data_sha256(g)
    except ValueError as e:
        return [str(e)]
    if got != want:
        return [f"the tensor data do not match {DATA_SHA256} ({got[:12]}... against {want[:12]}...): the file "
                "changed after it was written"]
    return []


def _info_dtype(qtype: QT) -> np.dtype:
    return {QT.F32: np.dtype(np.float32), QT.F16: np.dtype(np.float16)}.get(qtype, np.dtype(np.uint8))


def _byte_shape(p: LayerPlan) -> tuple[int, ...]:
    """The numpy shape gguf-py expects for add_tensor_info (it turns byte shapes back into ggml shapes)."""
    if p.weight_type == QT.Q8_0:
        return (p.d_out, p.d_in // 32 * 34)
    if p.weight_type == QT.BF16:
        return (p.d_out, p.d_in * 2)
    return (p.d_out, p.d_in)


def _add_meta(w: GGUFWriter, m: MapsMeta) -> None:
    w.add_string(K.GENERAL_TYPE, "adapter")
    w.add_string(K.ADAPTER_TYPE, ADAPTER_TYPE)
    for key, value in ((K.NAME, m.name), (K.LICENSE, m.license), (K.AUTHOR, m.author), (K.DOI, m.doi),
                       (K.URL, m.url), (K.FIT_CORPUS, m.fit_corpus_sha256), (K.MODEL_VOCAB, m.model_vocab_sha256)):
        if value:
            w.add_string(key, value)
    w.add_uint32(K.FORMAT_VERSION, FORMAT_VERSION)
    w.add_uint32(K.SPLIT, m.split)
    w.add_key_value(K.LAYERS, [int(x) for x in m.layers], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    if m.lam is not None:
        w.add_float32(K.LAMBDA, float(m.lam))
    if m.tail_default is not None:
        w.add_uint32(K.TAIL, int(m.tail_default))
    if m.fit_rows is not None:
        w.add_uint64(K.FIT_ROWS, int(m.fit_rows))
    if m.model_n_layer is not None:
        w.add_uint32(K.MODEL_N_LAYER, int(m.model_n_layer))
    if m.model_n_embd is not None:
        w.add_uint32(K.MODEL_N_EMBD, int(m.model_n_embd))


# ---------------------------------------------------------------------------------------------
# reading and checking


@dataclass
class Problems:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def read_maps(path: str | Path) -> GGUFFile:
    return read_gguf(path)


# every key the engine reads, with its type (and an array's item type): one of another type is refused by name
KEY_TYPES = {
    K.GENERAL_TYPE: (GGUFValueType.STRING, None), K.ADAPTER_TYPE: (GGUFValueType.STRING, None),
    K.ARCH: (GGUFValueType.STRING, None), K.FORMAT_VERSION: (GGUFValueType.UINT32, None),
    K.SPLIT: (GGUFValueType.UINT32, None), K.LAYERS: (GGUFValueType.ARRAY, GGUFValueType.UINT32),
    K.LAMBDA: (GGUFValueType.FLOAT32, None), K.TAIL: (GGUFValueType.UINT32, None),
    K.MODEL_N_LAYER: (GGUFValueType.UINT32, None), K.MODEL_N_EMBD: (GGUFValueType.UINT32, None),
    K.MODEL_VOCAB: (GGUFValueType.STRING, None), DATA_SHA256: (GGUFValueType.STRING, None),
}


def _of_own_type(g: GGUFFile, key: str) -> bool:
    """Whether a key of KEY_TYPES that the file holds has its own type (and an array its own item type)."""
    want, items = KEY_TYPES[key]
    vt, _, sub = g.fields[key]
    return vt == want and (items is None or sub == items)


def key_type_errors(g: GGUFFile) -> dict[str, str]:
    """The keys present with another type than their own, each with the engine's sentence."""
    wrong = {}
    for key, (want, items) in KEY_TYPES.items():
        if key not in g.fields or _of_own_type(g, key):
            continue
        vt, _, sub = g.fields[key]
        if vt != want:
            expected = f"an ARRAY of {items.name}" if items else want.name
            wrong[key] = f"{key} has type {vt.name}, expected {expected}"
        else:
            wrong[key] = f"{key} has type {sub.name if sub is not None else '?'} items, expected {items.name}"
    return wrong


def typed(g: GGUFFile, key: str, default=None):
    """A key's value where it has its own type, else default (key_type_errors names it)."""
    if key in KEY_TYPES and key in g.fields and not _of_own_type(g, key):
        return default
    return g.get(key, default)


def maps_meta(g: GGUFFile) -> MapsMeta:
    return MapsMeta(
        architecture=typed(g, K.ARCH, ""), split=typed(g, K.SPLIT, -1), layers=list(typed(g, K.LAYERS, []) or []),
        lam=_f32_value(typed(g, K.LAMBDA)), tail_default=typed(g, K.TAIL), name=g.get(K.NAME),
        license=g.get(K.LICENSE), author=g.get(K.AUTHOR), doi=g.get(K.DOI), url=g.get(K.URL),
        fit_rows=g.get(K.FIT_ROWS), fit_corpus_sha256=g.get(K.FIT_CORPUS), model_n_layer=typed(g, K.MODEL_N_LAYER),
        model_n_embd=typed(g, K.MODEL_N_EMBD), model_vocab_sha256=typed(g, K.MODEL_VOCAB))


def key_value_errors(meta: MapsMeta) -> list[str]:
    """Values of their key's type without a meaning: a ridge setting below 0 or not finite, a tail beyond int32."""
    errors = []
    if meta.lam is not None and not (np.isfinite(meta.lam) and meta.lam >= 0):
        errors.append(f"ridgefill.lambda is {meta.lam:f}, expected a finite value >= 0")
    if meta.tail_default is not None and meta.tail_default > 2**31 - 1:
        errors.append(f"ridgefill.tail_default is {meta.tail_default}, more than {2**31 - 1}")
    return errors


def state_delta_layers(g: GGUFFile) -> list[int]:
    """The layers of the file's terminal-state offsets, by their exact names (blk.05 is not layer 5's)."""
    out = []
    for name in g.tensors:
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] == "rf_state_delta" and parts[1].isdigit() \
                and name == state_delta_name(int(parts[1])):
            out.append(int(parts[1]))
    return sorted(out)


def check_maps(g: GGUFFile, model: ModelFingerprint | None = None) -> Problems:
    """The loader's checks. Errors refuse the file (the engine keeps serving stock); warnings do not."""
    p = Problems()
    err = p.errors.append
    wrong = key_type_errors(g)
    p.errors += wrong.values()
    if g.get(K.GENERAL_TYPE) != "adapter" and K.GENERAL_TYPE not in wrong:
        err(f"general.type is '{g.get(K.GENERAL_TYPE)}', expected 'adapter'")
    if g.get(K.ADAPTER_TYPE) != ADAPTER_TYPE:
        if K.ADAPTER_TYPE not in wrong:
            err(f"adapter.type is '{g.get(K.ADAPTER_TYPE)}', expected '{ADAPTER_TYPE}'")
        return p  # not a maps file at all: the rest would only repeat that
    version = typed(g, K.FORMAT_VERSION)
    if version != FORMAT_VERSION and K.FORMAT_VERSION not in wrong:
        err(f"ridgefill.format_version is {version}, this build reads {FORMAT_VERSION}")
    meta = maps_meta(g)
    p.errors += key_value_errors(meta)
    split, layers = meta.split, meta.layers
    if (split is None or split < 0) and K.SPLIT not in wrong:
        err("ridgefill.split is missing")
    if not layers and K.LAYERS not in wrong:
        err("ridgefill.layers is missing or empty")
    elif layers != sorted(set(layers)):
        err(f"ridgefill.layers is not strictly increasing: {layers}")
    if split is not None and split >= 0 and layers and min(layers) < split:
        err(f"ridgefill.layers holds layer {min(layers)} below the split {split}: maps are for layers at or above it")
    widths: dict[tuple[int, int], list] = {}  # (d_in, d_out): [first map's name, count]
    for layer in layers:
        w, b = g.tensors.get(weight_name(layer)), g.tensors.get(bias_name(layer))
        if w is None:
            err(f"tensor {weight_name(layer)} is missing")
            continue
        if w.type not in WEIGHT_TYPES.values():
            err(f"tensor {w.name} has type {w.type.name}, expected one of Q8_0, F16, BF16, F32")
        if len(w.ne) != 2:
            err(f"tensor {w.name} has shape {list(w.ne)}, expected [d_in, d_out]")
            continue
        d_in, d_out = w.ne
        widths.setdefault((d_in, d_out), [w.name, 0])[1] += 1
        if b is None:
            err(f"tensor {bias_name(layer)} is missing")
        elif b.type != QT.F32 or b.ne != (d_out,):
            err(f"tensor {b.name} is {b.type.name} {list(b.ne)}, expected F32 [{d_out}]")
    deltas = state_delta_layers(g)
    for layer in deltas:
        t = g.tensors[state_delta_name(layer)]
        if model is not None and (split is None or layer < split or layer not in model.recurrent_layers):
            err(f"tensor {t.name} is for layer {layer}, which is not a recurrent layer at or after the split")
        elif t.type != QT.F32 or (model is not None and t.n_elements != model.n_embd_s):
            err(f"tensor {t.name} is {t.type.name} of {t.n_elements} values, expected F32 of "
                f"{model.n_embd_s if model is not None else '?'} (the layer's state)")
    known = {TOKEN_FREQ} | {state_delta_name(x) for x in deltas} | {f(x) for x in layers for f in (weight_name, bias_name)}
    for name in [n for n in g.tensors if n not in known]:  # a misspelt offset would otherwise be lost unannounced
        err(f"tensor {name} is not a maps tensor (a listed layer's blk.N.rf_map.weight or .bias, "
            "blk.N.rf_state_delta or rf_token_freq)")
    if model is None:
        return p
    if meta.architecture != model.architecture:
        err(f"general.architecture is '{meta.architecture}', the model is '{model.architecture}'")
    if meta.model_n_embd is not None and meta.model_n_embd != model.n_embd:
        err(f"ridgefill.model.n_embd is {meta.model_n_embd}, the model has {model.n_embd}")
    if meta.model_n_layer is not None and meta.model_n_layer != model.n_layer:
        err(f"ridgefill.model.n_layer is {meta.model_n_layer}, the model has {model.n_layer}")
    if split is not None and not 0 < split < model.n_layer:
        err(f"ridgefill.split {split} is outside the model's layers 1..{model.n_layer - 1}")
    if layers and max(layers) >= model.n_layer:
        err(f"ridgefill.layers holds layer {max(layers)}, the model has layers 0..{model.n_layer - 1}")
    if split is not None and 0 < split < model.n_layer:
        missing = sorted(set(range(split + 1, model.n_layer)) - set(layers))
        if missing:  # the engine would otherwise fill such a layer with x_S unannounced
            err(f"ridgefill.layers leaves out late layers {missing}: every layer after the split {split} needs a map")
    for (d_in, d_out), (first, count) in sorted(widths.items()):
        if d_in != model.n_embd or d_out != model.n_embd:
            more = f" and {count - 1} more" if count > 1 else ""
            err(f"a map is {d_out}x{d_in} (d_out x d_in), the model's residual stream is {model.n_embd} wide "
                f"(tensor {first}{more})")
    tf = g.tensors.get(TOKEN_FREQ)
    if tf is not None and (tf.type != QT.F32 or (model.n_vocab is not None and tf.ne != (model.n_vocab,))):
        err(f"tensor {TOKEN_FREQ} is {tf.type.name.lower()} {list(tf.ne)}, expected F32 [{model.n_vocab}], "
            "the model's vocabulary")
    if meta.model_vocab_sha256 and model.vocab_sha256 and meta.model_vocab_sha256 != model.vocab_sha256:
        p.warnings.append("ridgefill.model.vocab_sha256 differs from the model's vocabulary: "
                          "the maps were fitted on another tokenizer")
    return p


def _first_non_finite(info, raw: np.ndarray) -> tuple[int, str] | None:
    """(element, "NaN" or "Inf") of a tensor's first non-finite value; a Q8_0 block's scale stands for its
    first element (its int8 codes are always finite)."""
    if info.type == QT.Q8_0:
        values, per = raw.reshape(-1, 34)[:, :2].copy().view(np.float16).ravel(), 32
    elif info.type == QT.BF16:
        bits = raw.view(np.uint16)
        bad = np.flatnonzero((bits & 0x7F80) == 0x7F80)
        if not bad.size:
            return None
        return int(bad[0]), "NaN" if bits[bad[0]] & 0x7F else "Inf"
    else:
        values, per = raw.view(np.float16 if info.type == QT.F16 else np.float32), 1
    bad = np.flatnonzero(~np.isfinite(values))
    if not bad.size:
        return None
    return int(bad[0]) * per, "NaN" if np.isnan(values[bad[0]]) else "Inf"


def check_values(g: GGUFFile) -> list[str]:
    """The loader's value check: a NaN or Inf in a map, a bias or the frequency table refuses the file (one such
    value would make every RidgeFill answer NaN). Reads every tensor's bytes."""
    errors = []
    read = [n for layer in maps_meta(g).layers for n in (weight_name(layer), bias_name(layer))] + [TOKEN_FREQ]
    for name in read:  # what the engine reads, in its order
        info = g.tensors.get(name)
        if info is None or info.type not in (QT.Q8_0, QT.F16, QT.BF16, QT.F32):
            continue  # check_maps names a missing tensor or a wrong type
        found = _first_non_finite(info, np.asarray(g.raw(name)))
        if found:
            errors.append(f"tensor {name} holds a non-finite value ({found[1]}) at element {found[0]}")
    return errors


def _f32_value(x: float | None) -> float | None:
    """An f32 key as the decimal it was written from (0.01, not 0.009999999776)."""
    return None if x is None else float(f"{x:.7g}")
