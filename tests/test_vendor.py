"""The vendored llama.cpp is the pinned one, and vendoring fails cleanly."""
from __future__ import annotations

import subprocess

import pytest

from conftest import ROOT, load_tool

vendor = load_tool("vendor")


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, text=True,
                          stdout=subprocess.PIPE).stdout.strip()


def test_the_pin_names_the_sdist_by_sha256_and_the_tree_by_git_hash():
    pin = vendor.read_pin()
    assert pin["version"] == "0.3.36"
    assert pin["sha256"] == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert len(pin["tree"]) == 40 and pin["tree"] != "PENDING"


def test_the_vendored_tree_matches_its_pin():
    repo = ROOT / "vendor" / "llama.cpp"
    if not (repo / ".git").exists():
        pytest.skip("not vendored: run `make vendor`")
    assert git(repo, "rev-parse", "upstream^{tree}") == vendor.read_pin()["tree"]


def test_the_upstream_worktree_is_pristine():
    tree = ROOT / "vendor" / "llama.cpp-upstream"
    if not tree.exists():
        pytest.skip("not vendored: run `make vendor`")
    assert git(tree, "rev-parse", "HEAD") == git(tree, "rev-parse", "upstream")
    assert git(tree, "status", "--porcelain", "--untracked-files=no") == ""


def test_a_wrong_sdist_hash_stops_with_advice_and_leaves_no_tree(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / vendor.read_pin()["sdist"]).write_bytes(b"not the sdist")
    with pytest.raises(vendor.VendorError, match="sha256 mismatch") as err:
        vendor.vendor(root=tmp_path, cache=cache)
    assert "delete it and run `make vendor` again" in str(err.value)
    assert not (tmp_path / "vendor" / "llama.cpp").exists()
    assert not list(tmp_path.glob("vendor/.llama.cpp.*"))


def test_a_failed_download_stops_with_advice_and_leaves_no_tree(tmp_path, monkeypatch):
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(vendor.VendorError, match="could not download") as err:
        vendor.vendor(root=tmp_path, cache=tmp_path / "cache")
    assert "What to do" in str(err.value)
    assert not (tmp_path / "vendor" / "llama.cpp").exists()


def test_a_vendor_folder_that_is_not_the_pinned_tree_is_refused(tmp_path):
    (tmp_path / "vendor" / "llama.cpp").mkdir(parents=True)
    with pytest.raises(vendor.VendorError, match="not the pinned vendored tree"):
        vendor.vendor(root=tmp_path, cache=tmp_path / "cache")
