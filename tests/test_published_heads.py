"""Published drafter heads against their reference packages, through this project's loader (fixture from
scripts/make_published_head_reference.py; no torch here).

The weights are not stored: `published_head_weights` regenerates them (and `hf_family_weights` the
targets') from their seed, checksums recorded by the script prove they are the ones speculators and
medusa-llm ran, and `write_folder` writes each case in its published format (speculators safetensors in
float32 or bfloat16, SafeAILab ``midlayer.*``, Medusa-1 heads) with the config.json the package wrote.
`drafters.published` loads the folder; the head's draft logits over the prompt (the first draft) and
along the greedy chain fed its own outputs (later drafts) must equal the reference within `TOLERANCE`.
The cases cover a Llama and a Qwen3 target (qk-norm), draft vocabularies smaller than the target's and
the full one, explicit and default layer ids, every variant flag, two draft layers, the head's own RoPE
(llama3 scaling included), bfloat16 weights and a head wider than its target. Speculative decoding with
the loaded heads gives plain decoding's tokens (chains, dynamic trees, gamma auto); the sampled law is
exact (`test_engine_law`'s chi-square); refusals are one line.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_family_weights as fw
import published_head_weights as phw
from specdec_jax import engine
from specdec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, eagle3_shapes, head_logits, head_pass, project
from specdec_jax.drafters.medusa import medusa_logits
from specdec_jax.drafters.published import head_kind, load_drafter_folder, read_torch_file
from specdec_jax.models import Llama, LlamaConfig
from specdec_jax.models.loaded import LoadedModel
from specdec_jax.models.loading import hf_arrays, hf_config
from specdec_jax.models.tokenizer import ByteTokenizer
from specdec_jax.token_tree import TreeShape

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "published_heads.json").read_text())
EAGLE3 = [case for case, spec in phw.CASES.items() if spec["format"] != "medusa"]
TOLERANCE = 1e-4  # absolute, float32 logits of std ~2


@pytest.fixture(scope="module", autouse=True)
def full_precision_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@functools.cache
def target(name: str) -> LoadedModel:
    """The fixture's target ``name`` from its recorded config and regenerated weights."""
    record = FIXTURE["targets"][name]
    weights = fw.state_dict(record["config"])
    assert fw.checksum(weights) == record["weights_sha256"], "regenerated target weights differ: rerun the script"
    config = hf_config(record["config"], name)
    return LoadedModel(Llama.from_arrays(config, hf_arrays(config, weights)), config, ByteTokenizer())


@functools.cache
def head_weights(case: str) -> dict[str, np.ndarray]:
    weights = phw.head_state_dict(case, fw.state_dict(FIXTURE["targets"][phw.CASES[case]["target"]]["config"]))
    assert fw.checksum(weights) == FIXTURE["cases"][case]["weights_sha256"], "regenerated head weights differ"
    return weights


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Every case written in its published format."""
    root = tmp_path_factory.mktemp("published")
    return {case: phw.write_folder(case, FIXTURE["cases"][case]["config_json"], head_weights(case), root / case)
            for case in phw.CASES}


def loaded(folders, case: str):
    spec = phw.CASES[case]
    return load_drafter_folder(folders[case], "medusa" if spec["format"] == "medusa" else "eagle",
                               target(spec["target"]))


def features(loaded_target: LoadedModel, prompt: list[int], layers) -> jax.Array:
    """f32[1,P,m,Ht]: the target's hidden states ``layers`` at every prompt token."""
    model, params = loaded_target.model.as_target()
    return _features(model, params, jnp.asarray([prompt]), tuple(layers))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _features(model, params, ids, layers):
    _, hidden, _ = model.apply(params, ids, model.init_cache(1, 16), jnp.arange(ids.shape[1])[None],
                               hidden_layers=layers, compute_logits=False)
    return jnp.moveaxis(hidden, 0, 2)


# The head's pieces compiled once per head shape (run op by op they compiled each operation apart).
jit_head_pass = jax.jit(head_pass, static_argnums=(0, 2))
jit_head_logits = jax.jit(head_logits, static_argnums=0)
jit_project = jax.jit(project, static_argnums=0)


def draft_logits(drafter: Eagle3Drafter, loaded_target: LoadedModel, prompt: list[int], t0: int, steps: int):
    """``(first f32[P,Vo], chain f32[steps,Vo], greedy drafts)``: the head over the prompt (input j: token
    j + 1, or t0, with the target's states of token j), then fed its greedy drafts and its own outputs."""
    cfg, params = drafter.config, drafter.params
    model, target_params = loaded_target.model.as_target()
    size = len(prompt)
    h, cache = jit_head_pass(cfg, params, model, target_params, jnp.asarray([prompt[1:] + [t0]]),
                             jit_project(cfg, params, features(loaded_target, prompt, cfg.feature_layers)),
                             cfg.layer.init_cache(1, 16), jnp.arange(size)[None])
    first, fed = jit_head_logits(cfg, params, h[0])
    chain, drafts, fed = [first[-1]], [], fed[-1:]
    vocab_map = params.get("vocab_map", np.arange(first.shape[-1]))
    for step in range(steps - 1):
        drafts.append(int(vocab_map[int(jnp.argmax(chain[-1]))]))
        h, cache = jit_head_pass(cfg, params, model, target_params, jnp.asarray([[drafts[-1]]]), fed[None],
                                 cache.with_lengths(jnp.asarray([size + step])), jnp.asarray([[size + step]]))
        logits, fed = jit_head_logits(cfg, params, h[0])
        chain.append(logits[0])
    drafts.append(int(vocab_map[int(jnp.argmax(chain[-1]))]))
    return np.asarray(first), np.asarray(jnp.stack(chain)), drafts


def test_fixture_covers_the_variants():
    specs = [phw.CASES[case] for case in EAGLE3]
    assert {s["target"] for s in specs} == {"llama", "qwen3"} and {s["format"] for s in specs} == {
        "speculators", "safeailab"}
    flags = {flag for s in specs for flag, on in s.get("flags", {}).items() if on}
    assert flags == {"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"}
    assert any(s["draft_vocab"] is None for s in specs) and any(s.get("layer_ids") is None for s in specs)
    assert any(s["layer"]["hidden_size"] != phw.TARGETS[s["target"]]["hidden_size"] for s in specs)
    assert any(s["layer"].get("num_hidden_layers", 1) > 1 for s in specs)


@pytest.mark.parametrize("case", EAGLE3)
def test_eagle3_draft_logits_match_the_reference(folders, case):
    record, spec = FIXTURE["cases"][case], phw.CASES[case]
    drafter = loaded(folders, case)
    weights = head_weights(case)
    if "d2t" in weights:  # target id = draft id + d2t[draft id]
        np.testing.assert_array_equal(drafter.params["vocab_map"], np.arange(len(weights["d2t"])) + weights["d2t"])
    assert drafter.config.feature_layers == tuple(k - 1 for k in phw.layer_ids(case))
    assert drafter.config.own_embedding == (spec["embed"] == "own")
    first, chain, drafts = draft_logits(drafter, target(spec["target"]), FIXTURE["targets"][spec["target"]]["prompt"],
                                        record["t0"], FIXTURE["chain"])
    first_diff = float(np.abs(first - np.asarray(record["first_logits"])).max())
    chain_diff = float(np.abs(chain - np.asarray(record["chain_logits"])).max())
    print(f"{case}: max |logits - reference| first {first_diff:.2e}, chain {chain_diff:.2e}")
    assert first_diff < TOLERANCE and chain_diff < TOLERANCE
    assert drafts == record["chain_drafts"]


def test_medusa1_logits_match_the_reference(folders):
    record, spec = FIXTURE["cases"]["medusa-llama"], phw.CASES["medusa-llama"]
    drafter = loaded(folders, "medusa-llama")
    loaded_target = target(spec["target"])
    model, params = loaded_target.model.as_target()
    final = features(loaded_target, FIXTURE["targets"][spec["target"]]["prompt"], (-1,))[0, -3:, 0]
    logits = np.asarray(medusa_logits(drafter.config, drafter.params, model, params, final))
    diff = float(np.abs(logits - np.asarray(record["logits"])).max())
    print(f"medusa-llama: max |logits - reference| {diff:.2e}")
    assert diff < TOLERANCE


def test_a_variant_off_is_far_off(folders):
    """Power: the qwen3 case without norm_output (or with the residual not normed) moves the chain."""
    spec, record = phw.CASES["speculators-qwen3-bf16"], FIXTURE["cases"]["speculators-qwen3-bf16"]
    drafter = loaded(folders, "speculators-qwen3-bf16")
    for flag in ("norm_output", "norm_before_residual"):
        changed = dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, **{flag: False}))
        _, chain, _ = draft_logits(changed, target("qwen3"), FIXTURE["targets"]["qwen3"]["prompt"], record["t0"], 2)
        assert np.abs(chain - np.asarray(record["chain_logits"][:2])).max() > 100 * TOLERANCE, flag
    assert spec["flags"]["norm_output"]


# gamma "auto" under fixed policies (as test_engine_law's), so the shapes change between rounds
AUTO_CHAIN = engine.ShapePolicy((0, 1, 3), (1.0, 1.2, 1.5), (0.0, 0.1, 0.3), prior=0.9)
AUTO_TREE = engine.ShapePolicy((0, 2, 6), (1.0, 1.02, 2.0), (0.0, 0.1, 0.1), prior=0.9, tree=True)


def proposing(drafter, token: int):
    """The drafter with a zero LM head and draft id 0 mapped to ``token``: every first choice is ``token``
    (these random targets' greedy outputs repeat a token, so drafts are accepted). Only weights change:
    the same compiled program runs."""
    ids = np.asarray(drafter.params["vocab_map"]).copy()
    if token in ids:
        ids[np.flatnonzero(ids == token)[0]] = ids[0]
    ids[0] = token
    params = dict(drafter.params, lm_head=np.zeros_like(drafter.params["lm_head"]), vocab_map=ids)
    return dataclasses.replace(drafter, params=params)


@pytest.mark.parametrize("case, shape", [
    ("speculators-qwen3-bf16", 3), ("speculators-llama", TreeShape(nodes=6, depth=3, topk=2)),
    ("safeailab-wide-qwen3", "auto"),
    pytest.param("safeailab-llama", TreeShape(nodes=6, depth=3, topk=2), marks=pytest.mark.slow),
    pytest.param("medusa-llama", "auto", marks=pytest.mark.slow)])
def test_greedy_speculation_equals_plain_decoding(folders, case, shape):
    """The loaded head, and the head made to propose the target's repeated token (drafts accepted), give
    plain decoding's tokens."""
    spec = phw.CASES[case]
    loaded_target = target(spec["target"])
    prompts = [FIXTURE["targets"][spec["target"]]["prompt"], FIXTURE["targets"][spec["target"]]["prompt"][:5]]
    drafter = loaded(folders, case)
    plain = np.asarray(engine.generate(loaded_target.model, prompts, None, max_new_tokens=12).tokens)
    if isinstance(shape, TreeShape):
        drafter, gamma, policy = dataclasses.replace(drafter, tree=shape), None, None
    else:
        gamma, policy = shape, AUTO_CHAIN if shape == "auto" else None
    repeated = int(np.bincount(plain.ravel()).argmax())
    for which in (drafter, proposing(drafter, repeated)):
        out = engine.generate(loaded_target.model, prompts, which, gamma=gamma, policy=policy, max_new_tokens=12)
        assert np.asarray(out.tokens).tolist() == plain.tolist()
        assert out.metrics.draft_tokens > 0, out.metrics
    assert out.metrics.accepted_tokens > 4, out.metrics


def test_tree_nodes_auto_keeps_plain_tokens(folders):
    drafter = dataclasses.replace(loaded(folders, "speculators-qwen3-bf16"), tree=TreeShape(nodes=6, depth=3, topk=2))
    prompts = [FIXTURE["targets"]["qwen3"]["prompt"]]
    plain = engine.generate(target("qwen3").model, prompts, None, max_new_tokens=10)
    out = engine.generate(target("qwen3").model, prompts, drafter, gamma="auto", policy=AUTO_TREE, max_new_tokens=10)
    assert np.asarray(out.tokens).tolist() == np.asarray(plain.tokens).tolist()


def test_torch_files_are_read_without_torch(tmp_path):
    """A torch.save file the script wrote (strides, offsets, shared storage, bfloat16, int64, bool, a
    Parameter); anything but tensors is refused (a pickle can run code)."""
    sample = tmp_path / "sample.pt"
    sample.write_bytes(base64.b64decode(FIXTURE["torch_sample"]))
    got = read_torch_file(sample)
    expected = {"strided": np.arange(6, dtype=np.float32).reshape(2, 3).T, "offset": np.arange(3, 7, dtype=np.float32),
                "whole": np.arange(10, dtype=np.float32), "bf16": np.array([1.5, -2.0, 0.25], np.float32),
                "long": np.array([[1, -2]]), "mask": np.array([True, False, True]),
                "param": np.full(2, 0.5, np.float32)}
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
    import pickle
    import zipfile
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as archive:
        archive.writestr("evil/data.pkl", pickle.dumps(print))
        archive.writestr("evil/byteorder", "little")
    (tmp_path / "legacy.pt").write_bytes(b"\x80\x02 not a zip archive")
    for bad in (tmp_path / "evil.pt", tmp_path / "legacy.pt"):
        with pytest.raises(ValueError, match="convert it to safetensors"):
            read_torch_file(bad)


def rewrite(folders, case: str, tmp_path, config=None, drop=(), **weights) -> pathlib.Path:
    """A copy of the case's folder with ``config`` (a dict merged into config.json) and weights changed."""
    changed = {k: v for k, v in {**head_weights(case), **weights}.items() if k not in drop}
    merged = {**FIXTURE["cases"][case]["config_json"], **(config or {})}
    return phw.write_folder(case, merged, changed, tmp_path / case)


def test_refusals_are_one_line(folders, tmp_path):
    llama = target("llama")
    d2t = head_weights("speculators-llama")["d2t"]
    cases = [  # (folder, target, message)
        (folders["speculators-llama"], target("qwen3"), "a head for a vocabulary of 160; the target has 128"),
        (folders["safeailab-llama"], target("qwen3"), "a head for a vocabulary of 160"),
        (rewrite(folders, "speculators-llama", tmp_path / "a", d2t=d2t + 200), llama,
         "d2t .* a head for another target"),
        (rewrite(folders, "speculators-llama", tmp_path / "b", drop=("norm.weight",)), llama,
         "missing weight norm.weight"),
        (rewrite(folders, "speculators-llama", tmp_path / "c", {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}), llama,
         r"0, the embeddings, is not supported"),
        (rewrite(folders, "speculators-llama", tmp_path / "d", {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}), llama,
         "the target has 8 layers"),
        (rewrite(folders, "speculators-llama", tmp_path / "e", {"speculators_model_type": "mtp"}), llama,
         "speculators_model_type 'mtp' is not supported"),
        (rewrite(folders, "speculators-llama", tmp_path / "f", {"transformer_layer_config": dict(
            FIXTURE["cases"]["speculators-llama"]["config_json"]["transformer_layer_config"], hidden_act="gelu")}),
         llama, "hidden_act = 'gelu' is not supported"),
        (rewrite(folders, "medusa-llama", tmp_path / "g", {"medusa_num_layers": 2}), llama,
         "medusa_num_layers 2 is not supported"),
        (folders["medusa-llama"].parent / "nowhere", llama, "is not a drafter head folder"),
    ]
    for folder, loaded_target, message in cases:
        kind = "medusa" if "medusa" in str(folder) else "eagle"
        with pytest.raises(ValueError, match=message) as err:
            load_drafter_folder(folder, kind, loaded_target)
        assert "\n" not in str(err.value) and str(folder.resolve()) in str(err.value)
    with pytest.raises(ValueError, match="holds a Medusa-1 head, not a eagle head: use --drafter medusa"):
        load_drafter_folder(folders["medusa-llama"], "eagle", llama)
    assert head_kind(folders["speculators-llama"]) == ("speculators EAGLE-3", "eagle")
    assert head_kind(folders["safeailab-llama"]) == ("SafeAILab EAGLE-3", "eagle")
    assert head_kind(folders["medusa-llama"]) == ("Medusa-1", "medusa") and head_kind(tmp_path) is None


def test_the_cli_loads_a_published_head_and_refuses_another_targets(folders, tmp_path, capsys):
    """--drafter eagle --draft-model FOLDER on a Hugging Face target folder; a head for another target,
    or a head given to the wrong drafter, is one line on stderr and exit 2."""
    from tokenizers import Tokenizer, models

    from specdec_jax.cli import main

    record = FIXTURE["targets"]["qwen3"]
    model_dir = tmp_path / "qwen3"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(record["config"]))
    phw.write_safetensors(model_dir / "model.safetensors", fw.state_dict(record["config"]))
    words = models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0")
    Tokenizer(words).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    common = ["generate", "--model", str(model_dir), "--raw", "--prompt", "t5 t9 t7", "--max-new-tokens", "4"]
    assert main(common + ["--drafter", "eagle", "--draft-model", str(folders["speculators-qwen3-bf16"]),
                          "--gamma", "2"]) == 0
    capsys.readouterr()
    for drafter, case, message in (("eagle", "speculators-llama", "a head for a vocabulary of 160"),
                                   ("medusa", "speculators-qwen3-bf16", "use --drafter eagle"),
                                   ("draft-model", "medusa-llama", "holds a Medusa-1 head, not a draft model")):
        assert main(common + ["--drafter", drafter, "--draft-model", str(folders[case])]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def random_eagle3(cfg: Eagle3Config, seed: int) -> dict:
    """Random weights of ``cfg`` (norms 1 + 0.2 N, matrices N(0, 1 / fan_in), the head N(0, 4 / H))."""
    rng = np.random.default_rng(seed)

    def draw(name, shape):
        if isinstance(shape, dict):
            return {k: draw(k, s) for k, s in shape.items()}
        if name == "vocab_map":
            return np.asarray(REDUCED, np.int32)
        if "norm" in name:
            return (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        scale = (2.0 if name == "lm_head" else 1.0) / np.sqrt(shape[-1])
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return {name: draw(name, shape) for name, shape in eagle3_shapes(cfg).items()}


REDUCED = [0, 2, 3, 5]  # the draft vocabulary of the law test's head: q is zero on tokens 1 and 4


def law_head(tree: TreeShape | None = None) -> Eagle3Drafter:
    """An EAGLE-3 head (qk-norm, two layers, norm_output, norm_before_residual, a reduced vocabulary) on
    test_engine_law's target, reading its layer 0 and final-norm state."""
    from test_engine_law import CONFIG

    layer = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=8, qk_norm=True, rope_theta=500.0)
    cfg = Eagle3Config(layer, (0, -1), CONFIG.hidden_size, len(REDUCED), own_embedding=True, norm_output=True,
                       norm_before_residual=True)
    return Eagle3Drafter(cfg, random_eagle3(cfg, 5), tree=tree)


@pytest.mark.slow  # suite time: the head's rounds are EAGLE's (test_engine_law, eagle-g3), its logits the reference's
@pytest.mark.parametrize("tree", [None, TreeShape(nodes=6, depth=3, topk=2)],
                         ids=["chain-g3", "dynamic-tree"])
def test_eagle3_sampling_follows_the_target_law(tree):
    """test_engine_law's chi-square over 4 sampled tokens of 65,536 rows: q (the head's law mapped to
    target ids through vocab_map) keeps stochastic verification exact."""
    from test_engine_law import N, PROMPT, SAMPLED, SIGNIFICANCE, V, exact_law
    from test_engine_law import target as law_target

    from specdec_jax.audit import chi_square, continuation_codes

    out = engine.generate(law_target(), [PROMPT] * N, law_head(tree), gamma=None if tree else 3, sampling=SAMPLED,
                          max_new_tokens=4, seed=31, capacity=16)
    codes = continuation_codes(np.asarray(out.tokens), V)
    stat, _, pvalue = chi_square(np.bincount(codes, minlength=V**4), exact_law(law_target(), 4))
    assert pvalue > SIGNIFICANCE, f"chi2 {stat:.1f}, p = {pvalue:.2e}"
    assert out.metrics.accepted_tokens > N / 10 and out.metrics.draft_tokens > N, out.metrics
    digits = np.stack([codes // V**3 % V, codes // V**2 % V, codes // V % V, codes % V])
    assert np.isin(digits, [1, 4]).any(axis=0).mean() > 0.01  # tokens q cannot propose came at the target's rate
