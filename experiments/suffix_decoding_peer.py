"""SuffixDecoding (arctic-inference) replayed on our greedy outputs: its tokens per round, the peer of
`--drafter retrieval --datastore outputs`.

Makes the peer column of experiments/README.md "What do the model's own outputs add as a datastore?".

Reads `--outputs` (outputs.json of `experiments/retrieval.py --outputs-pass`: the prompt and output
token ids of pass 1 and pass 2) and replays pass 2 through `SuffixDecodingCache` as arctic-inference's
own simulator does: each round it speculates from the prompt and the response so far, the drafts that
match the recorded output are accepted, one more token is emitted. Greedy outputs do not depend on the
drafter, so its tokens per round compare with ours on the same tokens. Two caches:

- "prompt only": no global tree (max_cached_requests 0), the peer of prompt lookup;
- "with outputs": pass 1's responses are in the global tree first, and each pass 2 response joins it
  when its request ends (as our outputs datastore does between calls).

Each as a chain of at most 4 drafts (use_tree_spec off) and a tree of at most 16 nodes, with its
defaults (max_spec_factor 1, min_token_prob 0.1) and with max_spec_factor 4 (a short match may
propose as far as ours does).

arctic-inference is not a dependency: this script fetches its source (`pip download --no-deps
arctic-inference==0.3.0`, never installed) and nanobind, and builds only the suffix tree (C++, cmake,
ninja) into $SPECDEC_CACHE/peers/, once (about 30 s).

    python experiments/suffix_decoding_peer.py --outputs experiments/results/retrieval/outputs/outputs.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

from common import write_json

from specdec_jax import cache
from specdec_jax.cache import cache_dir

ARCTIC = "arctic-inference==0.3.0"
NANOBIND = "nanobind==2.9.2"
SETTINGS = {  # name -> (max_spec_tokens, use_tree_spec, max_spec_factor)
    "chain 4": (4, False, 1.0), "chain 4, factor 4": (4, False, 4.0),
    "tree 16": (16, True, 1.0), "tree 16, factor 4": (16, True, 4.0),
}


def suffix_decoding():
    """arctic_inference.suffix_decoding, built into the cache on first use."""
    home = cache_dir() / "peers" / ARCTIC.replace("==", "-")
    cache.entry(home, "arctic-inference's suffix decoding",
                lambda found: found if list(found.glob("arctic_inference/suffix_decoding/_C*.so")) else None, _build)
    sys.path.insert(0, str(home))
    return importlib.import_module("arctic_inference.suffix_decoding")


def _build(home: pathlib.Path) -> None:
    """Builds the package into ``home`` (a partial that `cache.entry` publishes)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for spec in (ARCTIC, NANOBIND):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), spec], check=True)
        with tarfile.open(next(tmp.glob("arctic_inference-*.tar.gz"))) as archive:
            archive.extractall(tmp, filter="data")
        source = next(tmp.glob("arctic_inference-*/"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp / "nb"),
                        str(next(tmp.glob("nanobind-*.whl")))], check=True)
        env = {**__import__("os").environ, "PYTHONPATH": str(tmp / "nb")}
        cmake_dir = subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"], env=env, check=True,
                                   capture_output=True, text=True).stdout.strip()
        build = tmp / "build"
        subprocess.run(["cmake", "-G", "Ninja", "-S", str(source / "csrc" / "suffix_decoding"), "-B", str(build),
                        f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_DIR={cmake_dir}"], env=env, check=True,
                       capture_output=True)
        subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)
        package = home / "arctic_inference" / "suffix_decoding"
        package.mkdir(parents=True, exist_ok=True)
        (home / "arctic_inference" / "__init__.py").write_text("")
        for name in ("__init__.py", "cache.py"):
            shutil.copy(source / "arctic_inference" / "suffix_decoding" / name, package / name)
        shutil.copy(next(build.glob("_C*.so")), package)
        print(f"built arctic-inference's suffix decoding into {home.parent}", flush=True)


def replay(cache, rows: list[dict], setting: tuple[int, bool, float], first_id: int = 0) -> tuple[int, int]:
    """(emitted tokens, rounds) of SuffixDecoding over ``rows`` (prompt and recorded output token ids)."""
    spec, tree, factor = setting
    emitted = rounds = 0
    for i, row in enumerate(rows, first_id):
        truth = row["tokens"]
        cache.start_request(i, np.asarray(row["prompt_tokens"], np.int32))
        response: list[int] = []
        while len(response) < len(truth):
            draft = cache.speculate(i, np.asarray(row["prompt_tokens"] + response, np.int32), max_spec_tokens=spec,
                                    max_spec_factor=factor, use_tree_spec=tree)
            node, accepted = -1, []
            for token in truth[len(response):]:  # the longest path of the draft tree the output follows
                child = [c for c, p in enumerate(draft.parents) if p == node and draft.token_ids[c] == token]
                if not child:
                    break
                accepted.append(token)
                node = child[0]
            new = accepted + truth[len(response) + len(accepted):][:1]  # and one more token, if any is left
            response += new
            cache.add_active_response(i, new)
            emitted, rounds = emitted + len(new), rounds + 1
        cache.stop_request(i)
    return emitted, rounds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=pathlib.Path, required=True, help="outputs.json of retrieval.py --outputs-pass")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="default: beside --outputs")
    args = parser.parse_args(argv)
    out = args.out or args.outputs.parent
    passes = json.loads(args.outputs.read_text())
    module = suffix_decoding()
    results = {}
    for name, setting in SETTINGS.items():
        alone = replay(module.SuffixDecodingCache(max_cached_requests=0), passes["pass 2"], setting)
        cache = module.SuffixDecodingCache()
        replay(cache, passes["pass 1"], setting)
        with_outputs = replay(cache, passes["pass 2"], setting, first_id=len(passes["pass 1"]))
        results[name] = {"prompt only": alone[0] / alone[1], "with outputs": with_outputs[0] / with_outputs[1]}
    write_json(out / "suffix_decoding_peer.json", {"package": ARCTIC, "results": results})
    lines = [f"SuffixDecoding ({ARCTIC}) replayed on the {len(passes['pass 2'])} pass 2 outputs: tokens per round", "",
             "| setting | prompt only | with outputs |", "|---|---|---|"]
    lines += [f"| {name} | {r['prompt only']:.2f} | {r['with outputs']:.2f} |" for name, r in results.items()]
    (out / "suffix_decoding_peer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
