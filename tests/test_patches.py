"""The patch series applies onto upstream, fails loudly by name, and round-trips through export."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import ROOT, assert_same_bytes, load_tool

patches = load_tool("patches")
VENDOR = ROOT / "vendor" / "llama.cpp"


def git(repo, *args) -> str:
    # an identity of our own: a fresh machine may have no git user configured
    return subprocess.run(["git", "-C", str(repo), "-c", "commit.gpgsign=false", "-c", "user.name=ridgefill tests",
                           "-c", "user.email=tests@ridgefill-gguf.invalid", *args], check=True, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE).stdout.strip()


@pytest.fixture
def scratch_repo(tmp_path):
    """A throwaway clone of the vendored repository (objects shared, so it is cheap)."""
    if not (VENDOR / ".git").exists():
        pytest.skip("not vendored: run `make vendor`")
    clone = tmp_path / "llama.cpp"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(VENDOR), str(clone)], check=True)
    git(clone, "fetch", "-q", "origin", "refs/tags/upstream:refs/tags/upstream")
    git(clone, "checkout", "-q", "-B", "ridgefill", "upstream")
    return clone


def test_the_series_is_ordered_git_format_patch_files():
    series = patches.series()
    assert series, "patches/ must hold at least one patch"
    for i, patch in enumerate(series, start=1):
        assert patch.name.startswith(f"{i:04d}-"), patch.name
        text = patch.read_text()
        assert text.startswith("From 0000000000000000000000000000000000000000 ")
        assert "\nSubject: [PATCH] " in text and "\ndiff --git " in text


def test_every_patch_applies_onto_upstream():
    if not (VENDOR / ".git").exists():
        pytest.skip("not vendored: run `make vendor`")
    assert patches.check() == len(patches.series())


def test_a_patch_that_no_longer_applies_fails_and_names_the_patch(scratch_repo, tmp_path):
    series_dir = tmp_path / "patches"
    series_dir.mkdir()
    for p in patches.series():
        shutil.copy(p, series_dir)
    broken = patches.series()[0].read_text().replace("+#define LLAMA_RIDGEFILL_API_VERSION 1", "+x", 1)
    broken = broken.replace("+++ b/src/CMakeLists.txt\n@@", "+++ b/src/CMakeLists.txt\n@@", 1)
    # a context line that upstream does not have
    broken = broken.replace(" set(LLAMA_PUBLIC_HEADERS", " set(LLAMA_PUBLIC_HEADERS_THAT_DO_NOT_EXIST", 1)
    (series_dir / "0099-no-longer-applies.patch").write_text(broken)
    with pytest.raises(patches.PatchError, match="patch 0099-no-longer-applies.patch does not apply"):
        patches.apply(scratch_repo, series_dir)
    assert git(scratch_repo, "status", "--porcelain", "--untracked-files=no") == ""


def test_apply_then_export_gives_back_the_same_series(scratch_repo, tmp_path):
    patches.apply(scratch_repo, patches.PATCH_DIR)
    out = tmp_path / "exported"
    assert patches.export(scratch_repo, out) == len(patches.series())
    for ours, theirs in zip(patches.series(), patches.series(out)):
        assert ours.name == theirs.name
        assert_same_bytes(ours.read_bytes(), theirs.read_bytes(), ours.name)


def test_export_writes_a_new_commit_as_the_next_patch(scratch_repo, tmp_path):
    patches.apply(scratch_repo, patches.PATCH_DIR)
    (scratch_repo / "RIDGEFILL-NOTE.md").write_text("a new concern\n")
    git(scratch_repo, "add", "RIDGEFILL-NOTE.md")
    git(scratch_repo, "commit", "-q", "-m", "ridgefill: a note")
    out = tmp_path / "exported"
    n = patches.export(scratch_repo, out)
    assert n == len(patches.series()) + 1
    assert patches.series(out)[-1].name == f"{n:04d}-ridgefill-a-note.patch"


def test_apply_refuses_to_discard_work_that_is_not_exported(scratch_repo, tmp_path):
    patches.apply(scratch_repo, patches.PATCH_DIR)
    (scratch_repo / "RIDGEFILL-NOTE.md").write_text("unsaved\n")
    git(scratch_repo, "add", "RIDGEFILL-NOTE.md")
    git(scratch_repo, "commit", "-q", "-m", "ridgefill: unsaved work")
    with pytest.raises(patches.PatchError, match="not exported"):
        patches.apply(scratch_repo, patches.PATCH_DIR)
    assert patches.apply(scratch_repo, patches.PATCH_DIR, force=True) == len(patches.series())
