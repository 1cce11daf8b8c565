"""Dump the logits one build gives for a set of prompts, in a process of its own.

A process can load only one libllama (see libs.py), so comparing builds runs this module once per
build: `python -m ridgefill_gguf.logits --build upstream --spec SPEC.json -o OUT.npz`.
Each case records the prompt's logits (all rows) and those of a few greedy decode steps.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Case:
    """One way of running the model: batch geometry and attention kernel."""
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = False

    @property
    def name(self) -> str:
        return f"b{self.n_batch}-ub{self.n_ubatch}-fa{'on' if self.flash_attn else 'off'}"


@dataclass
class DumpSpec:
    model: str
    prompts: list[str]
    cases: list[Case] = field(default_factory=lambda: [Case()])
    n_ctx: int = 2048
    n_threads: int = 2
    decode_steps: int = 4
    n_gpu_layers: int = 0  # -1: every layer on the GPU (CUDA builds)
    maps: str | None = None  # RidgeFill builds: load these maps and attach them (RidgeFill stays off)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DumpSpec":
        raw = json.loads(text)
        raw["cases"] = [Case(**c) for c in raw["cases"]]
        return cls(**raw)


def dump(build: str, spec: DumpSpec) -> dict[str, np.ndarray]:
    """Run every (case, prompt) on `build` in this process; keys are 'case/prompt-index/phase'."""
    from . import libs

    llama_cpp = libs.use_build(build)
    out: dict[str, np.ndarray] = {}
    for case in spec.cases:
        llm = llama_cpp.Llama(model_path=spec.model, n_ctx=spec.n_ctx, n_batch=case.n_batch,
                              n_ubatch=case.n_ubatch, n_threads=spec.n_threads, n_threads_batch=spec.n_threads,
                              flash_attn=case.flash_attn, n_gpu_layers=spec.n_gpu_layers,
                              logits_all=True, seed=0, verbose=False)
        maps = None
        if spec.maps and build != "upstream":
            from .engine import bindings
            maps = bindings.load_maps(llm.model, spec.maps)
            bindings.attach(llm.ctx, maps)
        for i, prompt in enumerate(spec.prompts):
            llm.reset()
            tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
            if len(tokens) + spec.decode_steps > spec.n_ctx:
                raise ValueError(f"prompt {i} has {len(tokens)} tokens; n_ctx is {spec.n_ctx}")
            llm.eval(tokens)
            out[f"{case.name}/{i}/prompt"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
            steps = []
            for _ in range(spec.decode_steps):  # single-token ubatches take the decode path
                nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                llm.eval([nxt])
                steps.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
            out[f"{case.name}/{i}/decode"] = np.stack(steps) if steps else np.zeros((0,), np.float32)
            out[f"{case.name}/{i}/tokens"] = np.array(tokens, dtype=np.int32)
        if maps:
            bindings.attach(llm.ctx, None)
            maps.free()
        llm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True, help="upstream, ridgefill, or a folder with libllama")
    ap.add_argument("--spec", type=Path, required=True, help="DumpSpec as JSON")
    ap.add_argument("-o", "--out", type=Path, required=True, help="where to write the .npz")
    args = ap.parse_args(argv)
    arrays = dump(args.build, DumpSpec.from_json(args.spec.read_text()))
    tmp = args.out.with_name(args.out.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
