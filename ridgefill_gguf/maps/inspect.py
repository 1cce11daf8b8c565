"""`ridgefill-gguf inspect`: what a maps GGUF holds, per layer, for people (text) and machines (JSON)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..gguf_io import tensor_f32
from . import format as fmt


def inspect_maps(path: str | Path, stats: bool = True) -> dict:
    g = fmt.read_maps(path)
    meta = fmt.maps_meta(g)
    problems = fmt.check_maps(g)
    layers = []
    for layer in meta.layers:
        w = g.tensors.get(fmt.weight_name(layer))
        if w is None:
            continue
        row = {"layer": layer, "type": w.type.name, "d_in": int(w.ne[0]), "d_out": int(w.ne[1]) if len(w.ne) > 1 else 0,
               "bytes": w.nbytes + (g.tensors[fmt.bias_name(layer)].nbytes if fmt.bias_name(layer) in g.tensors else 0)}
        if stats and problems.ok:
            a, b = tensor_f32(g, fmt.weight_name(layer)), tensor_f32(g, fmt.bias_name(layer))
            row.update(weight_norm=float(np.linalg.norm(a)), weight_max_abs=float(np.abs(a).max()),
                       bias_norm=float(np.linalg.norm(b)),
                       # distance from the identity: how much the map does beyond copying x_S
                       diff_from_identity=float(np.linalg.norm(a - np.eye(*a.shape, dtype=np.float32)))
                       if a.shape[0] == a.shape[1] else None)
        layers.append(row)
    tf = g.tensors.get(fmt.TOKEN_FREQ)
    return {
        "path": str(path),
        "file_bytes": g.file_size,
        "metadata": {k: (v if not isinstance(v, bytes) else v.decode()) for k, v in meta.to_dict().items()},
        "format_version": g.get(fmt.K.FORMAT_VERSION),
        "adapter_type": g.get(fmt.K.ADAPTER_TYPE),
        "n_layers": len(layers),
        "layers": layers,
        "token_freq": {"n_vocab": int(tf.ne[0])} if tf is not None else None,
        "errors": problems.errors,
        "warnings": problems.warnings,
    }


def summary_text(r: dict) -> str:
    m = r["metadata"]
    lines = [f"{r['path']}: RidgeFill maps for {m.get('architecture', '?')}"
             + (f" ({m['name']})" if m.get("name") else ""),
             f"  split {m.get('split')}, {r['n_layers']} mapped layer(s) "
             f"{_ranges(m.get('layers', []))}, {r['file_bytes'] / 2**20:.1f} MiB",
             f"  lambda {m.get('lam', 'not recorded')}, recommended tail {m.get('tail_default', 'not recorded')}"]
    if m.get("model_n_layer"):
        lines.append(f"  fitted for a model with {m['model_n_layer']} layers, n_embd {m.get('model_n_embd')}"
                     + (f", vocab {m['model_vocab_sha256'][:12]}" if m.get("model_vocab_sha256") else ""))
    if m.get("fit_rows"):
        lines.append(f"  fit on {m['fit_rows']} rows" + (f", corpus {m['fit_corpus_sha256'][:12]}"
                                                          if m.get("fit_corpus_sha256") else ""))
    for key in ("license", "author", "doi", "url"):
        if m.get(key):
            lines.append(f"  {key}: {m[key]}")
    if r["token_freq"]:
        lines.append(f"  token frequency table: {r['token_freq']['n_vocab']} entries")
    types = sorted({x["type"] for x in r["layers"]})
    shapes = sorted({(x["d_out"], x["d_in"]) for x in r["layers"]})
    lines.append(f"  weights: {', '.join(types)}; shapes (d_out x d_in): "
                 + ", ".join(f"{a}x{b}" for a, b in shapes))
    if r["layers"] and "weight_norm" in r["layers"][0]:
        lines.append("  layer  type   d_out x d_in     |W|_F    max|w|    |b|   |W-I|_F")
        for x in r["layers"]:
            ident = f"{x['diff_from_identity']:9.3f}" if x.get("diff_from_identity") is not None else "        -"
            lines.append(f"  {x['layer']:5d}  {x['type']:5s} {x['d_out']:6d} x {x['d_in']:<6d} "
                         f"{x['weight_norm']:9.3f} {x['weight_max_abs']:8.4f} {x['bias_norm']:7.3f} {ident}")
    for e in r["errors"]:
        lines.append(f"  ERROR: {e}")
    for w in r["warnings"]:
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "[]"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return "[" + ", ".join(out) + "]"
