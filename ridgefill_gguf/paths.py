"""Where the project's generated folders are: vendored tree, builds, models, caches."""
from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """The checkout this package runs from; RIDGEFILL_GGUF_ROOT overrides it (an installed copy)."""
    env = os.environ.get("RIDGEFILL_GGUF_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").exists() else Path.cwd()


def build_dir(name: str) -> Path:
    return project_root() / "build" / name


def models_dir() -> Path:
    return Path(os.environ.get("RIDGEFILL_GGUF_MODELS", project_root() / "models"))


def cache_dir() -> Path:
    return Path(os.environ.get("RIDGEFILL_GGUF_CACHE", project_root() / ".cache"))


def vendor_dir() -> Path:
    return project_root() / "vendor" / "llama.cpp"
