"""State of the vendored llama.cpp tree (read-only; tools/vendor.py and tools/patches.py change it)."""
from __future__ import annotations

import subprocess

from .paths import project_root, vendor_dir


def _git(*args: str) -> str | None:
    proc = subprocess.run(["git", "-C", str(vendor_dir()), *args], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return proc.stdout.strip() if proc.returncode == 0 else None


def pinned_tree() -> str | None:
    pin = project_root() / "tools" / "upstream.pin"
    if not pin.exists():
        return None
    for line in pin.read_text().splitlines():
        if line.startswith("tree="):
            return line.split("=", 1)[1].strip()
    return None


def vendor_status() -> str:
    if not (vendor_dir() / ".git").exists():
        return "absent (make vendor)"
    tree = _git("rev-parse", "upstream^{tree}")
    if tree is None:
        return "present but without an `upstream` tag (make clean-vendor vendor)"
    pin = "matches the pin" if tree == pinned_tree() else f"tree {tree} does NOT match the pin"
    n_patches = _git("rev-list", "--count", "upstream..HEAD")
    dirty = " + uncommitted edits" if _git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{vendor_dir()} ({pin}; {n_patches} commit(s) on top of upstream{dirty})"
