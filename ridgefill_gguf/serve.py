"""`ridgefill-gguf serve`: the patched llama-server with RidgeFill maps and sensible defaults.

`Server` is also what the demo and the benchmarks use: start, wait until healthy, ask, stop.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import libs
from .gguf_io import read_gguf

DEFAULT_MAX_CTX = 32768  # the context the server gets unless asked (capped by the model's own)


class ServerError(RuntimeError):
    pass


def model_context(model: str | Path) -> int:
    g = read_gguf(model, skip_arrays=("tokenizer.",))
    arch = g.get("general.architecture")
    return int(g.get(f"{arch}.context_length") or DEFAULT_MAX_CTX)


def model_window(model: str | Path) -> int:
    """The model's sliding window (0: none)."""
    g = read_gguf(model, skip_arrays=("tokenizer.",))
    return int(g.get(f"{g.get('general.architecture')}.attention.sliding_window") or 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(model: str | Path, maps: str | Path | None = None, *, tail: int | None = None,
                placement: str = "resident", fill: str = "ridge", min_prefix: int | None = None,
                select: str | None = None, exact_share: float | None = None, budget: float | None = None,
                n_ctx: int | None = None, host: str = "127.0.0.1", port: int = 8080, threads: int | None = None,
                n_gpu_layers: int | None = None, slots: int = 1, extra: tuple[str, ...] = (),
                swa_full: bool | None = None) -> list[str]:
    """swa_full: the windowed layers' cache keeps every row (--swa-full); by default where maps are given and the
    model has sliding windows, since RidgeFill needs it there."""
    n_ctx = n_ctx or min(model_context(model), DEFAULT_MAX_CTX)
    # one slot by default, which gets the whole context
    args = ["-m", str(model), "-c", str(n_ctx), "-np", str(slots), "--host", host, "--port", str(port)]
    if maps:
        args += ["--ridgefill", str(maps), "--ridgefill-maps", placement, "--ridgefill-fill", fill]
        if tail is not None:
            args += ["--ridgefill-tail", str(tail)]
        if min_prefix is not None:
            args += ["--ridgefill-min-prefix", str(min_prefix)]
        if select:
            args += ["--ridgefill-select", select]
        if exact_share is not None:
            args += ["--ridgefill-exact-share", str(exact_share)]
        if budget is not None:
            args += ["--ridgefill-budget", str(budget)]
    if swa_full is None:
        swa_full = bool(maps) and model_window(model) > 0
    if swa_full and "--swa-full" not in extra:
        args += ["--swa-full"]
    if threads:
        args += ["-t", str(threads)]
    if n_gpu_layers is not None:
        args += ["-ngl", str(n_gpu_layers)]
    return args + list(extra)


class Server:
    """A llama-server process of one build; a context manager."""

    def __init__(self, model: str | Path, maps: str | Path | None = None, *, build: str = "ridgefill",
                 port: int | None = None, log_path: str | Path | None = None, startup_timeout: float = 600,
                 env: dict[str, str] | None = None, research: bool = False, **kwargs):
        # research: the server takes RidgeFill's research controls (other fills, the random and blind selectors)
        if research:
            env = {**(env or {}), "LLAMA_RIDGEFILL_RESEARCH": "1"}
        self.port = port or free_port()
        self.binary = libs.find_binary(build, "llama-server")
        self.args = server_args(model, maps, port=self.port, **kwargs)
        self.host = kwargs.get("host", "127.0.0.1")
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **env} if env else None  # more environment for this server only
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [str(self.binary), *self.args]

    def start(self) -> "Server":
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"llama-server exited with status {self.proc.returncode} while starting"
                                  + (f"; log: {self.log_path}\n{self.log_tail()}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"llama-server did not become healthy within {self.startup_timeout:.0f} s")

    def log_tail(self, n: int | None = 4000) -> str:
        """The last n characters of the server's log (None: all of it)."""
        text = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
        return text if n is None else text[-n:]

    def post(self, path: str, body: dict, timeout: float = 3600) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from e

    def get(self, path: str, timeout: float = 60) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.load(r)

    def complete(self, prompt: str | list[int], n_predict: int = 32, ridgefill: bool | None = None,
                 **extra) -> dict:
        """/completion, greedy, without the prompt cache (so every request prefills its whole prompt)."""
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": False, **extra}
        if ridgefill is not None:
            body["ridgefill"] = ridgefill
        return self.post("/completion", body)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
