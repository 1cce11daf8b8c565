"""Small shared helpers."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file so that readers see the old or the new content, never a half-written one."""
    write_atomic_with(path, lambda tmp: tmp.write_bytes(data.encode() if isinstance(data, str) else data))


def write_atomic_with(path: Path, write) -> Path:
    """Have write(tmp) write a file beside path, then put it in place: readers see the old file or the new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """Save a matplotlib figure atomically (a PNG beside its temporary name until done) and close it."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 - plotting is optional

    path = Path(path)
    # a name of its own per writer: shards that finish together each write the summary
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi, format="png")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hardware() -> dict:
    """What a benchmark ran on: CPU, cores, memory, host, Python, and the GPU where there is one."""
    import platform
    import subprocess

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    out = {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_kib / 2**20, 1), "host": platform.node(),
           "python": platform.python_version()}
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        if gpu:
            lines = gpu.splitlines()
            # several GPUs: one line (markdown headers print it)
            out["gpu"] = (f"{len(lines)} x {lines[0]}" if len(set(lines)) == 1 else "; ".join(lines)) \
                if len(lines) > 1 else gpu
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out
