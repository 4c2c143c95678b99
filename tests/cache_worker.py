"""One process of `tests/test_shared_cache.py`: makes cache entries in `$SPECDEC_CACHE` and prints a
digest of each as a JSON line.

    python tests/cache_worker.py FOLDER KIND [KIND ...]

FOLDER holds the inputs the test wrote (``model.gguf``, ``texts/``). Once imported, the process
touches ``FOLDER/ready-<pid>`` and waits for ``FOLDER/go`` before its first entry, so that processes
started together ask for each entry at once.
Every entry a process publishes is appended to ``FOLDER/published`` ("pid name"), so the test can
count the builds. ``SLOW_PUBLISH=1`` makes a build wait (60 s) before publishing, with its partial
complete: the moment a SIGKILL does the most harm.

Kinds: ``fetch`` (a file assembled from wheels; pip replaced by `test_reliability`'s fake),
``convert`` (the GGUF converted), ``datastore`` (the folder indexed), ``grammar`` (tables of a
regex), ``calibration`` (the shape policy's costs; the measurement replaced by a 2-second stand-in
whose numbers name the process that measured) and ``compile`` (a program in JAX's persistent
compilation cache, through `compile_cache.atomic_puts`, which does not publish through
`specdec_jax.cache`: it is not counted in ``published``).
"""

import hashlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import compile_cache  # noqa: E402

if __name__ == "__main__":
    compile_cache.configure()

import jax  # noqa: E402  (after the settings above)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from specdec_jax import cache  # noqa: E402

REGEX = r"(yes|no), [a-z]{2,5}\."


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def fetch(folder: pathlib.Path) -> str:
    from test_loading import SPLIT
    from test_reliability import _install_fake_pip

    from specdec_jax.models import fetch as fetching

    _install_fake_pip(pytest.MonkeyPatch())
    path = fetching.fetched_file(SPLIT, cache.cache_dir() / "split" / SPLIT.name, progress=False)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def convert(folder: pathlib.Path) -> str:
    from specdec_jax.models import load_model

    params = load_model(str(folder / "model.gguf")).model.params()
    return digest(*(np.asarray(params[k]) for k in sorted(params)))


def datastore(folder: pathlib.Path) -> str:
    from specdec_jax.datastore import load_datastore
    from specdec_jax.models import ByteTokenizer

    store = load_datastore([str(folder / "texts")], ByteTokenizer(), progress=False)
    return digest(store.tokens, store.suffixes)


def grammar(folder: pathlib.Path) -> str:
    from specdec_jax.constraints import Constraint, compile_constraint
    from specdec_jax.models import ByteTokenizer

    t = compile_constraint(Constraint(regex=REGEX), ByteTokenizer())
    return digest(t.token_class, t.next_state, t.accepting, np.array(t.initial))


def calibration(folder: pathlib.Path) -> str:
    import engine_helpers as H

    from specdec_jax.engine import calibration as calibrating

    def stand_in(target, drafter, batch, capacity, gammas, tree=False):
        time.sleep(2)
        pid = float(os.getpid())
        return {"T1": pid, "verify_s": [pid] * len(gammas), "draft_s": [0.0] * len(gammas), "gammas": list(gammas)}

    calibrating.measure_costs = stand_in
    costs = calibrating.calibrated_costs(H.target(), H.ngram(), 1, 64, gammas=(0, 1))
    return str(int(costs["T1"]))


def compile(folder: pathlib.Path) -> str:  # noqa: A001 - the kind's name
    x = jnp.arange(1024, dtype=jnp.float32)
    return digest(np.asarray(jax.jit(lambda v: jnp.cumsum(jnp.sin(v) * 3.0 + v[::-1]))(x)))


def main(folder: pathlib.Path, kinds: list[str]) -> None:
    compile_cache.atomic_puts()
    published = cache.publish

    def logged(tmp, path):
        if os.environ.get("SLOW_PUBLISH"):
            print(f"publishing {path.name} in 60 s", flush=True)
            time.sleep(60)
        published(tmp, path)
        with open(folder / "published", "a") as log:
            log.write(f"{os.getpid()} {path.name}\n")

    cache.publish = logged
    (folder / f"ready-{os.getpid()}").touch()
    while not (folder / "go").exists():
        time.sleep(0.01)
    print(json.dumps({kind: globals()[kind](folder) for kind in kinds}), flush=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2:])
