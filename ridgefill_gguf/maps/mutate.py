"""Structured mutations of a maps GGUF, for the loader's fuzz test (tests/test_maps_fuzz.py).

Each is one named change made through gguf-py (GGUFReader in, GGUFWriter out): a key given another type, a key
removed or renamed, a tensor renamed, reshaped (with data of the matching size) or retyped, a value out of range.
Each says what it changed (kind, variant, target) and which words a refusal must hold to name the problem; a change
that leaves a file the format allows (an optional key removed, a map stored as F16) is marked valid."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from .format import KEY_TYPES as TYPED_KEYS
from .format import TOKEN_FREQ, K, ModelFingerprint, bias_name, state_delta_name, weight_name

REQUIRED_KEYS = (K.GENERAL_TYPE, K.ADAPTER_TYPE, K.ARCH, K.FORMAT_VERSION, K.SPLIT, K.LAYERS)
KEY_TYPES = [(VT.STRING, None), (VT.UINT32, None), (VT.INT32, None), (VT.UINT64, None), (VT.UINT8, None),
             (VT.FLOAT32, None), (VT.FLOAT64, None), (VT.BOOL, None), (VT.ARRAY, VT.UINT32), (VT.ARRAY, VT.INT32),
             (VT.ARRAY, VT.UINT64), (VT.ARRAY, VT.STRING)]
MAP_TYPES = (QT.Q8_0, QT.F16, QT.BF16, QT.F32)  # what a map may be stored as
OTHER_TYPES = (QT.F16, QT.BF16, QT.I32, QT.F64, QT.I16, QT.Q8_0)  # not F32: wrong for a bias, an offset or the table
# not Q8_1: gguf-py's block of it is 40 bytes, ggml's 36, so its file would not parse at all
NOT_MAP_TYPES = (QT.I8, QT.I16, QT.I32, QT.I64, QT.F64, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL)


@dataclass(frozen=True)
class Mutation:
    kind: str                  # key-type, key-removed, key-renamed, tensor-renamed, tensor-shape, ...
    variant: str               # which change of that kind, e.g. "optional-key", "extra-dim"
    target: str                # the key or tensor changed
    change: str                # what was done, in words
    names: tuple[str, ...]     # words a refusal must hold (all of them)
    valid: bool = False        # the file is still one the format allows: it must load


@dataclass
class Draft:
    """A maps file's keys (name -> (value, type, item type)) and tensors (name -> (data, type)), in order.
    Tensor data are numpy arrays in numpy order; quantized types as uint8 rows of blocks, as gguf-py has them."""
    keys: dict[str, tuple[Any, VT, VT | None]]
    tensors: dict[str, tuple[np.ndarray, QT]]

    @classmethod
    def read(cls, path: str | Path) -> Draft:
        r = GGUFReader(str(path))
        keys = {f.name: (f.contents(), f.types[0], f.types[-1] if f.types[0] == VT.ARRAY else None)
                for f in r.fields.values() if not f.name.startswith("GGUF.")}
        return cls(keys, {t.name: (np.array(t.data), t.tensor_type) for t in r.tensors})

    def copy(self) -> Draft:
        return Draft(dict(self.keys), dict(self.tensors))

    def write(self, path: str | Path) -> None:
        w = GGUFWriter(str(path), arch="")
        w.kv_data[0].clear()  # the constructor's general.architecture: the draft's own, or none
        for name, (value, vtype, sub) in self.keys.items():
            w.add_key_value(name, value, vtype, sub_type=sub)
        for name, (data, qtype) in self.tensors.items():
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    def rename_key(self, old: str, new: str) -> None:
        self.keys = {new if k == old else k: v for k, v in self.keys.items()}

    def rename_tensor(self, old: str, new: str) -> None:
        self.tensors = {new if k == old else k: v for k, v in self.tensors.items()}

    def floats(self, name: str) -> np.ndarray:
        """A tensor's values as float32, in numpy order."""
        data, qtype = self.tensors[name]
        return data.astype(np.float32) if qtype in (QT.F32, QT.F16) else dequantize(data, qtype)


class Maker:
    """The mutations of one good maps file for one model, drawn with a seeded generator."""

    def __init__(self, draft: Draft, model: ModelFingerprint, rng: np.random.Generator):
        self.good, self.model, self.rng = draft, model, rng
        self.split = int(draft.keys[K.SPLIT][0])
        self.layers = [int(x) for x in draft.keys[K.LAYERS][0]]

    def pick(self, items):
        items = list(items)
        return items[int(self.rng.integers(len(items)))]

    def one(self, kind: str) -> tuple[Mutation, Draft]:
        d = self.good.copy()
        return getattr(self, kind.replace("-", "_"))(d), d

    # --- keys -------------------------------------------------------------------------------------------

    def key_type(self, d: Draft) -> Mutation:
        key = self.pick(d.keys)
        value, vtype, sub = d.keys[key]
        new = self.pick(t for t in KEY_TYPES if t != (vtype, sub))
        d.keys[key] = (retyped(value, *new), *new)
        label = new[0].name if new[1] is None else f"ARRAY of {new[1].name}"
        # a key the loader reads is refused by its type; one it does not read (general.name, ridgefill.fit.*) loads
        typed = key in TYPED_KEYS
        found = f"{new[1].name} items" if vtype == VT.ARRAY and new[0] == VT.ARRAY else new[0].name
        return Mutation("key-type", "required-key" if key in REQUIRED_KEYS else "optional-key", key,
                        f"{key} stored as {label}: {d.keys[key][0]!r}", (f"{key} has type {found}",) if typed else (),
                        valid=not typed)

    def key_removed(self, d: Draft) -> Mutation:
        key = self.pick(d.keys)
        del d.keys[key]
        required = key in REQUIRED_KEYS
        return Mutation("key-removed", "required-key" if required else "optional-key", key, f"{key} removed",
                        (key,), valid=not required)

    def key_renamed(self, d: Draft) -> Mutation:
        key = self.pick(d.keys)
        new = self.pick(n for n in misspellings(key) if n not in d.keys)
        d.rename_key(key, new)
        required = key in REQUIRED_KEYS
        return Mutation("key-renamed", "required-key" if required else "optional-key", key,
                        f"{key} renamed {new}", (key,), valid=not required)

    # --- tensor names -----------------------------------------------------------------------------------

    def tensor_renamed(self, d: Draft) -> Mutation:
        name = self.pick(d.tensors)
        if name.endswith(".rf_state_delta"):
            return self.pick([self.delta_moved, self.delta_unknown, self.delta_alias])(d, name)
        new = self.pick(n for n in misspellings(name) + [renumbered(name, x) for x in range(self.model.n_layer + 3)]
                        if n not in d.tensors)
        d.rename_tensor(name, new)
        return Mutation("tensor-renamed", "map-tensor", name, f"{name} renamed {new!r}", (name, "is missing"))

    def delta_unknown(self, d: Draft, name: str) -> Mutation:
        """The offset is gone and an unknown tensor has come."""
        new = self.pick(misspellings(name))
        d.rename_tensor(name, new)
        return Mutation("tensor-renamed", "delta-to-unknown-name", name, f"{name} renamed {new!r}",
                        (f"tensor {new} is not a maps tensor",))

    def delta_alias(self, d: Draft, name: str) -> Mutation:
        """A name that reads as the same layer's to a number parser: blk.05, blk.+5, blk. 5."""
        layer = layer_of(name)
        new = state_delta_name(layer).replace(f".{layer}.", self.pick([f".0{layer}.", f".+{layer}.", f". {layer}."]))
        d.rename_tensor(name, new)
        return Mutation("tensor-renamed", "delta-to-alias-name", name, f"{name} renamed {new!r}",
                        (f"tensor {new} is not a maps tensor",))

    def delta_moved(self, d: Draft, name: str) -> Mutation:
        layer = self.pick(x for x in range(self.model.n_layer + 3) if state_delta_name(x) not in d.tensors)
        new = state_delta_name(layer)
        d.rename_tensor(name, new)
        late_recurrent = self.split <= layer < self.model.n_layer and layer in self.model.recurrent_layers
        return Mutation("tensor-renamed", "delta-to-another-layer", name, f"{name} renamed {new}",
                        (new, "not a recurrent layer at or after the split"), valid=late_recurrent)

    # --- tensor shapes ----------------------------------------------------------------------------------

    def tensor_shape(self, d: Draft) -> Mutation:
        targets = [n for n in d.tensors if not n.endswith(".rf_state_delta")] + [TOKEN_FREQ]
        targets += [n for n in d.tensors if n.endswith(".rf_state_delta")] * 3  # as often as a map's tensors
        name = self.pick(targets)
        if name == TOKEN_FREQ:
            return self.token_freq_shape(d)
        if name.endswith(".weight"):
            return self.weight_shape(d, name)
        return (self.bias_shape if name.endswith(".bias") else self.delta_shape)(d, name)

    def weight_shape(self, d: Draft, name: str) -> Mutation:
        data, qtype = d.tensors[name]
        d_out, d_in = data.shape[0], row_elements(data, qtype)
        variant = self.pick(["extra-dim", "d_out-off-by-one", "d_in-off-by-one", "trailing-unit-dim"])
        if variant == "extra-dim":
            new = data.reshape(2, d_out // 2, -1) if self.rng.random() < 0.5 else data.reshape(d_out, 2, -1)
            names = (name, "has shape")
        elif variant == "d_out-off-by-one":
            new = np.concatenate([data, data[:1]]) if self.rng.random() < 0.5 else data[:-1]
            names = (f"a map is {new.shape[0]}x{d_in} (d_out x d_in)", bias_name(layer_of(name)))
        elif variant == "d_in-off-by-one":  # a quantized row changes by one block
            step = GGML_QUANT_SIZES[qtype][1] if data.dtype == np.uint8 else 1
            new = np.concatenate([data, data[:, :step]], axis=1) if self.rng.random() < 0.5 else data[:, :-step]
            names = (f"a map is {d_out}x{row_elements(new, qtype)} (d_out x d_in)",)
        else:  # ggml's [d_in, d_out, 1] is [d_in, d_out]
            new = data.reshape(1, *data.shape)
            names = ()
        d.tensors[name] = (np.ascontiguousarray(new), qtype)
        return Mutation("tensor-shape", variant, name, f"{name} {shape_str(data, qtype)} -> {shape_str(new, qtype)}",
                        names, valid=not names)

    def bias_shape(self, d: Draft, name: str) -> Mutation:
        data = d.tensors[name][0]
        variant = self.pick(["off-by-one", "extra-dim", "trailing-unit-dim"])
        if variant == "off-by-one":
            new = np.append(data, data[:1]) if self.rng.random() < 0.5 else data[:-1]
        elif variant == "extra-dim":
            new = data.reshape(2, -1) if self.rng.random() < 0.5 else data.reshape(-1, 2)
        else:
            new = data.reshape(1, -1)
        d.tensors[name] = (np.ascontiguousarray(new), QT.F32)
        names = () if variant == "trailing-unit-dim" else (name, f"expected F32 [{data.shape[0]}]")
        return Mutation("tensor-shape", f"bias-{variant}", name, f"{name} {list(data.shape)} -> {list(new.shape)}",
                        names, valid=not names)

    def delta_shape(self, d: Draft, name: str) -> Mutation:
        data = d.tensors[name][0]
        n = data.size
        if self.rng.random() < 0.5:  # other values count
            k = int(self.rng.integers(1, n))
            new = np.concatenate([data.ravel(), data.ravel()[:k]]) if self.rng.random() < 0.5 else data.ravel()[:-k]
            names = (name, f"is F32 of {new.size} values, expected F32 of {n}")
            variant = "delta-count"
        else:  # the same count in another layout: flat, transposed, or folded
            new = self.pick([data.ravel(), data.T, data.reshape(data.shape[0], -1),
                             data.reshape(-1, data.shape[-1] * 2)])
            names, variant = (name, "shape"), "delta-layout"
        d.tensors[name] = (np.ascontiguousarray(new), QT.F32)
        return Mutation("tensor-shape", variant, name, f"{name} {list(data.shape)} -> {list(new.shape)}", names)

    def token_freq_shape(self, d: Draft) -> Mutation:
        n_vocab = self.model.n_vocab
        variant = self.pick(["right", "off-by-one", "extra-dim"])
        size = n_vocab + self.pick([-1, 1]) if variant == "off-by-one" else n_vocab
        table = np.ones(size, np.float32)
        table = table.reshape(2, -1) if variant == "extra-dim" and size % 2 == 0 else table
        d.tensors[TOKEN_FREQ] = (table, QT.F32)
        names = () if table.shape == (n_vocab,) else (TOKEN_FREQ, f"expected F32 [{n_vocab}]")
        return Mutation("tensor-shape", f"token-freq-{variant}", TOKEN_FREQ,
                        f"{TOKEN_FREQ} added as {list(table.shape)}", names, valid=not names)

    # --- tensor types -----------------------------------------------------------------------------------

    def tensor_type(self, d: Draft) -> Mutation:
        name = self.pick(list(d.tensors) + [TOKEN_FREQ])
        old, values = (QT.F32, np.ones(self.model.n_vocab, np.float32)) if name == TOKEN_FREQ else \
            (d.tensors[name][1], d.floats(name))
        weight = name.endswith(".weight")
        qtype = self.pick([t for t in MAP_TYPES if t != old] + list(NOT_MAP_TYPES) * 2 if weight else
                          [t for t in OTHER_TYPES if t != QT.Q8_0 or values.shape[-1] % 32 == 0])
        same_bytes = qtype == QT.I32 and old == QT.F32 and name in d.tensors
        d.tensors[name] = (d.tensors[name][0].view(np.int32) if same_bytes else encoded(values, qtype, self.rng), qtype)
        if weight:
            names = () if qtype in MAP_TYPES else (name, f"has type {qtype.name}")
        else:  # the frequency table's words name the type as ggml does, in lower case
            names = (name, f"is {qtype.name.lower() if name == TOKEN_FREQ else qtype.name} ", "expected F32")
        role = "token-freq" if name == TOKEN_FREQ else name.rsplit(".", 1)[-1].replace("rf_state_", "")
        return Mutation("tensor-type", f"{role}-{'wrong' if names else 'other-map-type'}", name,
                        f"{name} {old.name} stored as {qtype.name}" + (" (the same bytes)" if same_bytes else ""),
                        names, valid=not names)

    # --- values out of range ----------------------------------------------------------------------------

    def value_range(self, d: Draft) -> Mutation:
        variant = self.pick(["split", "split", "layers", "layers", "layers", "counts", "strings", "tail", "lambda"])
        return getattr(self, f"bad_{variant}")(d)

    def bad_split(self, d: Draft) -> Mutation:
        n_layer, low, high = self.model.n_layer, min(self.layers), max(self.layers)
        choices = [0, n_layer, n_layer + int(self.rng.integers(1, 2**32 - n_layer)), low]
        choices += [int(self.rng.integers(1, self.split))] if self.split > 1 else []  # below it
        choices += [int(self.rng.integers(low + 1, high + 1))] if high > low else []  # past the first map
        split = self.pick(choices)
        d.keys[K.SPLIT] = (split, VT.UINT32, None)
        if not 0 < split < n_layer:
            names = (f"ridgefill.split {split} is outside the model's layers 1..{n_layer - 1}",)
        elif split < self.split:
            names = ("ridgefill.layers leaves out late layers", f"after the split {split}")
        elif split > low:
            names = (f"ridgefill.layers holds layer {low} below the split {split}",)
        else:  # maps for layers S.., as the format allows: only what they were fitted on differs
            names = ()
        return Mutation("value-range", "split", K.SPLIT, f"{K.SPLIT} {self.split} -> {split}", names, valid=not names)

    def bad_layers(self, d: Draft) -> Mutation:
        layers, late = list(self.layers), [x for x in self.layers if x > self.split]
        variant = self.pick(["leave-out", "duplicate", "unsorted", "beyond", "below-split"])  # gguf-py: no empty array
        if variant == "leave-out":
            gone = self.pick(late)
            layers.remove(gone)
            names = (f"ridgefill.layers leaves out late layers [{gone}]",)
        elif variant in ("duplicate", "unsorted"):
            i = int(self.rng.integers(len(layers) - 1))
            layers = layers[:i] + [layers[i]] + layers[i:] if variant == "duplicate" else \
                layers[:i] + [layers[i + 1], layers[i]] + layers[i + 2:]
            names = ("ridgefill.layers is not strictly increasing",)
        elif variant == "beyond":
            extra = self.pick([self.model.n_layer, int(self.rng.integers(self.model.n_layer, 2**32))])
            layers.append(extra)
            names = (f"ridgefill.layers holds layer {extra}, the model has layers", f"{weight_name(extra)} is missing")
        else:
            layers.insert(0, int(self.rng.integers(0, self.split)))
            names = (f"ridgefill.layers holds layer {layers[0]} below the split {self.split}",)
        d.keys[K.LAYERS] = (layers, VT.ARRAY, VT.UINT32)
        return Mutation("value-range", f"layers-{variant}", K.LAYERS, f"{K.LAYERS} {self.layers} -> {layers}", names)

    def bad_counts(self, d: Draft) -> Mutation:
        key = self.pick([K.FORMAT_VERSION, K.MODEL_N_LAYER, K.MODEL_N_EMBD])
        old = int(d.keys[key][0])
        new = self.pick([0, old + 1, old - 1, int(self.rng.integers(0, 2**32))])
        new = new if new != old else old + 1
        d.keys[key] = (new, VT.UINT32, None)
        return Mutation("value-range", "count", key, f"{key} {old} -> {new}", (f"{key} is {new}",))

    def bad_strings(self, d: Draft) -> Mutation:
        key = self.pick([K.GENERAL_TYPE, K.ADAPTER_TYPE, K.ARCH])
        new = self.pick(["", "lora", "model", "llama", "gemma3", d.keys[key][0].upper(), d.keys[key][0] + " "])
        d.keys[key] = (new, VT.STRING, None)
        return Mutation("value-range", "string", key, f"{key} {d.keys[key][0]!r}", (f"{key} is '{new}'",))

    def bad_tail(self, d: Draft) -> Mutation:
        tail = self.pick([2**32 - 1, 2**31, 2**31 + int(self.rng.integers(1, 2**31 - 1)), 2**31 - 1])
        d.keys[K.TAIL] = (tail, VT.UINT32, None)
        fits = tail <= 2**31 - 1  # a tail longer than any prompt: a stock prefill, but a tail
        return Mutation("value-range", "tail", K.TAIL, f"{K.TAIL} {tail} (as int32: {np.uint32(tail).view(np.int32)})",
                        () if fits else (f"{K.TAIL} is {tail}, more than {2**31 - 1}",), valid=fits)

    def bad_lambda(self, d: Draft) -> Mutation:
        lam = self.pick([-1.0, -0.01, float("nan"), float("inf"), float("-inf")])
        d.keys[K.LAMBDA] = (lam, VT.FLOAT32, None)
        return Mutation("value-range", "lambda", K.LAMBDA, f"{K.LAMBDA} {lam}",
                        (f"{K.LAMBDA} is ", "expected a finite value >= 0"))


KINDS = ("key-type", "key-removed", "key-renamed", "tensor-renamed", "tensor-shape", "tensor-type", "value-range")


def structured(path: str | Path, model: ModelFingerprint, rng: np.random.Generator, n: int
               ) -> Iterator[tuple[Mutation, Draft]]:
    """n structured mutations of a good maps file, the kinds in turn: (what was changed, the changed draft)."""
    maker = Maker(Draft.read(path), model, rng)
    for i in range(n):
        yield maker.one(KINDS[i % len(KINDS)])


# --- helpers ------------------------------------------------------------------------------------------


def retyped(value: Any, vtype: VT, sub: VT | None) -> Any:
    """value as the given key type: numbers from strings by length, lists from scalars by wrapping."""
    if vtype == VT.ARRAY:
        items = value if isinstance(value, list) else [value]
        return [retyped(x, sub, None) for x in items]
    if isinstance(value, list):
        value = ",".join(map(str, value)) if vtype == VT.STRING else (value[0] if value else 0)
    if vtype == VT.STRING:
        return str(value)
    number = len(value) if isinstance(value, str) else value
    cast: dict[VT, Callable[[Any], Any]] = {VT.FLOAT32: float, VT.FLOAT64: float, VT.BOOL: bool,
                                            VT.UINT8: lambda x: int(x) & 0xFF}
    return cast.get(vtype, int)(number)


def misspellings(name: str) -> list[str]:
    """Names one slip away from name: case, a lost or doubled letter, another separator, a prefix."""
    cut = name.rfind(".") + 2
    return [name.upper(), name[:-1], name + "s", name[:cut] + name[cut - 1:], name.replace(".", "_", 1),
            name.replace(".", "-"), "x." + name, name + " "]


def renumbered(name: str, layer: int) -> str:
    parts = name.split(".")
    return ".".join([parts[0], str(layer), *parts[2:]]) if parts[0] == "blk" else f"blk.{layer}.{name}"


def layer_of(name: str) -> int:
    return int(name.split(".")[1])


def row_elements(data: np.ndarray, qtype: QT) -> int:
    """ggml's ne[0] of a draft tensor: quantized rows are bytes, others elements."""
    block, size = GGML_QUANT_SIZES[qtype]
    return data.shape[-1] // size * block if data.dtype == np.uint8 else data.shape[-1]


def shape_str(data: np.ndarray, qtype: QT) -> str:
    """ggml's ne of a draft tensor."""
    return str([row_elements(data, qtype), *data.shape[-2::-1]])


def encoded(values: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """values in qtype, in gguf-py's numpy form; types gguf-py cannot quantize get random blocks of the right size."""
    ints = {QT.I8: np.int8, QT.I16: np.int16, QT.I32: np.int32, QT.I64: np.int64}
    if qtype in ints:
        return np.clip(np.round(values * 100), -100, 100).astype(ints[qtype])
    if qtype in (QT.F32, QT.F16, QT.F64):
        return values.astype({QT.F32: np.float32, QT.F16: np.float16, QT.F64: np.float64}[qtype])
    if qtype in (QT.BF16, QT.Q8_0):
        return quantize(values, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = values.reshape(-1, values.shape[-1])
    return rng.integers(0, 256, (rows.shape[0], rows.shape[1] // block * size), dtype=np.uint8)
