"""The engine's layout: a core that names no model, and one adapter per architecture."""
from __future__ import annotations

import re

import pytest

from conftest import ROOT

SRC = ROOT / "vendor" / "llama.cpp" / "src"
CORE = ["llama-ridgefill-engine.cpp", "llama-ridgefill-graph.cpp", "llama-ridgefill-memory.cpp",
        "llama-ridgefill-select.cpp", "llama-ridgefill-maps.cpp", "llama-ridgefill-impl.h"]
# an architecture by its enum or by name, in code or in a comment
MODEL_NAME = re.compile(r"\bLLM_ARCH_[A-Z0-9_]+|(?i:\b(qwen\w*|gemma\w*|mistral\w*|deepseek\w*)\b|\"llama\")")


def patched_tree_file(name: str):
    path = SRC / name
    if not path.exists():
        pytest.skip(f"{path} missing: run `make patch`")
    return path


@pytest.mark.parametrize("name", CORE)
def test_the_engine_core_names_no_model(name):
    text = patched_tree_file(name).read_text()
    found = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in MODEL_NAME.finditer(text)]
    assert not found, f"{name} names a model; that belongs in llama-ridgefill-arch.cpp: {found}"


def test_every_architecture_the_prefill_supports_has_one_adapter():
    text = patched_tree_file("llama-ridgefill-arch.cpp").read_text()
    adapters = re.findall(r"const llama_ridgefill_adapter (\w+)_adapter = \{", text)
    dispatched = re.findall(r"case LLM_ARCH_(\w+): a = &(\w+)_adapter;", text)
    assert adapters == ["llama", "qwen2", "qwen3", "qwen35", "qwen3next", "gemma3"]
    assert sorted(a for _, a in dispatched) == sorted(adapters)
    assert all(arch.lower() == a for arch, a in dispatched)
