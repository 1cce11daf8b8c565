#!/usr/bin/env python3
"""Apply the patch series onto the pristine vendored tree, export edits back, or check that it applies.

The vendored tree (vendor/llama.cpp) is a git repository: tag `upstream` is the pristine tree, branch
`ridgefill` is upstream plus one commit per patch in patches/. Edit the tree, commit on `ridgefill`
(one concern per commit), then `make export-patches` rewrites patches/ from those commits.

  patches.py apply  [--force]   reset `ridgefill` to `upstream` and `git am` every patch, in order
  patches.py export             write `upstream..ridgefill` into patches/ (git format-patch)
  patches.py check              apply the series in a throwaway worktree; touches nothing else
  patches.py ensure             apply when the series changed since the last apply, unless that would
                                discard unexported work (then build that work as it is, with a warning)
  patches.py pristine           fail unless vendor/llama.cpp-upstream is exactly the `upstream` tag
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
VENDOR = ROOT / "vendor" / "llama.cpp"
UPSTREAM_TREE = ROOT / "vendor" / "llama.cpp-upstream"
UPSTREAM_TAG = "upstream"
BRANCH = "ridgefill"
APPLIED_TAG = "ridgefill-applied"  # where the branch stood after the last apply/export
# git am records these; fixed values keep commit ids stable across machines
GIT_ENV = {"GIT_COMMITTER_NAME": "ridgefill-gguf", "GIT_COMMITTER_EMAIL": "patches@ridgefill-gguf.invalid"}


class PatchError(Exception):
    pass


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", "-C", str(repo), "-c", "commit.gpgsign=false", *args],
                          env=dict(os.environ, **GIT_ENV), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise PatchError(f"git {' '.join(args)} failed in {repo}:\n{proc.stderr.strip()}")
    return proc


def series(patch_dir: Path = PATCH_DIR) -> list[Path]:
    return sorted(patch_dir.glob("*.patch"))


def series_digest(patch_dir: Path = PATCH_DIR) -> str:
    h = hashlib.sha256()
    for patch in series(patch_dir):
        h.update(patch.name.encode() + b"\0" + patch.read_bytes())
    return h.hexdigest()


def _digest_file(repo: Path) -> Path:
    return repo / ".git" / "ridgefill-series.sha256"


def require_vendored(repo: Path) -> None:
    if not (repo / ".git").exists() or git(repo, "rev-parse", "-q", "--verify", UPSTREAM_TAG, check=False).returncode:
        raise PatchError(f"{repo} is not a vendored tree with an `{UPSTREAM_TAG}` tag: run `make vendor` first")


def am_series(repo: Path, patches: list[Path]) -> None:
    """git am each patch in turn, so that a failure names the patch that does not apply."""
    for i, patch in enumerate(patches):
        proc = git(repo, "am", "--keep-cr", "--committer-date-is-author-date", str(patch), check=False)
        if proc.returncode != 0:
            git(repo, "am", "--abort", check=False)
            raise PatchError(
                f"patch {patch.name} does not apply (after {i} of {len(patches)} patches applied cleanly).\n"
                f"{(proc.stdout + proc.stderr).strip()}\n"
                f"What to do: `make patch` stops here; fix the patch in {repo} and export again, or rebase it.")


def unexported_work(repo: Path) -> str | None:
    """Why applying now would lose work in the tree, or None."""
    if git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        return "the tree has uncommitted changes"
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    applied = git(repo, "rev-parse", "-q", "--verify", APPLIED_TAG, check=False).stdout.strip()
    upstream = git(repo, "rev-parse", UPSTREAM_TAG).stdout.strip()
    if head not in (applied, upstream):
        return f"branch `{BRANCH}` has commits that are not exported to patches/"
    return None


def apply(repo: Path = VENDOR, patch_dir: Path = PATCH_DIR, force: bool = False) -> int:
    require_vendored(repo)
    reason = unexported_work(repo)
    if reason and not force:
        raise PatchError(f"{reason}: run `make export-patches` first, or `make patch FORCE=1` to discard it")
    git(repo, "am", "--abort", check=False)
    git(repo, "checkout", "-q", "-f", "-B", BRANCH, UPSTREAM_TAG)
    patches = series(patch_dir)
    am_series(repo, patches)
    git(repo, "tag", "-f", APPLIED_TAG)
    _digest_file(repo).write_text(series_digest(patch_dir))
    print(f"patches: applied {len(patches)} patch(es) onto `{UPSTREAM_TAG}`; `{BRANCH}` is at "
          f"{git(repo, 'rev-parse', '--short', 'HEAD').stdout.strip()}")
    return len(patches)


def export(repo: Path = VENDOR, patch_dir: Path = PATCH_DIR) -> int:
    require_vendored(repo)
    if git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise PatchError("the tree has uncommitted changes: commit them on `ridgefill` (one concern per commit) first")
    if git(repo, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip() != BRANCH:
        raise PatchError(f"{repo} is not on branch `{BRANCH}`")
    patch_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=patch_dir.parent) as tmp:
        git(repo, "format-patch", "-q", "--no-numbered", "--zero-commit", "--no-signature", "--full-index",
            "-o", tmp, f"{UPSTREAM_TAG}..{BRANCH}")
        fresh = sorted(Path(tmp).glob("*.patch"))
        for old in series(patch_dir):
            old.unlink()
        for patch in fresh:
            shutil.move(str(patch), patch_dir / patch.name)
    git(repo, "tag", "-f", APPLIED_TAG)
    _digest_file(repo).write_text(series_digest(patch_dir))
    print(f"patches: exported {len(fresh)} patch(es) to {patch_dir}")
    return len(fresh)


def ensure(repo: Path = VENDOR, patch_dir: Path = PATCH_DIR) -> None:
    require_vendored(repo)
    recorded = _digest_file(repo).read_text().strip() if _digest_file(repo).exists() else None
    reason = unexported_work(repo)
    if reason:
        print(f"patches: warning: {reason}; building the tree as it is (`make export-patches` saves it)")
    elif recorded != series_digest(patch_dir):
        apply(repo, patch_dir)
    else:
        print("patches: the series is applied")


def pristine(tree: Path = UPSTREAM_TREE) -> None:
    if not (tree / ".git").exists():
        raise PatchError(f"{tree} is missing: run `make vendor`")
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if head != git(tree, "rev-parse", UPSTREAM_TAG).stdout.strip():
        raise PatchError(f"{tree} is not at the `{UPSTREAM_TAG}` tag: the upstream build must be pristine")
    if git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise PatchError(f"{tree} has edits: the upstream build must be pristine (`git -C {tree} checkout -f .`)")


def check(repo: Path = VENDOR, patch_dir: Path = PATCH_DIR) -> int:
    require_vendored(repo)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "tree"
        git(repo, "worktree", "add", "-q", "--detach", str(work), UPSTREAM_TAG)
        try:
            patches = series(patch_dir)
            am_series(work, patches)
        finally:
            git(repo, "worktree", "remove", "--force", str(work), check=False)
            git(repo, "worktree", "prune", check=False)
    print(f"patches: all {len(patches)} patch(es) apply onto `{UPSTREAM_TAG}`")
    return len(patches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["apply", "export", "check", "ensure", "pristine"])
    ap.add_argument("--force", action="store_true", help="apply: discard unexported work in the tree")
    ap.add_argument("--repo", type=Path, default=VENDOR)
    ap.add_argument("--patches", type=Path, default=PATCH_DIR)
    args = ap.parse_args()
    try:
        if args.action == "apply":
            apply(args.repo, args.patches, args.force)
        elif args.action == "export":
            export(args.repo, args.patches)
        elif args.action == "check":
            check(args.repo, args.patches)
        elif args.action == "ensure":
            ensure(args.repo, args.patches)
        else:
            pristine()
    except PatchError as e:
        print(f"patches: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
