"""DFlash block drafting against the dflash package (fixture from scripts/make_dflash_reference.py; no torch
here).

`dflash_weights` regenerates the drafters' weights (and `hf_family_weights` the targets') from their seed;
checksums recorded by the script prove they are the ones the package ran. Each case is written as z-lab's
``save_pretrained`` folder (or speculators' conversion of it) and loaded through `drafters.published`. At
the drafter's block size and at twice it: each recorded round's draft logits (the block pass over the
context of the committed tokens) equal the reference within `TOLERANCE`; the engine's greedy rounds emit
the reference's tokens with its per-round acceptance lengths. Speculation gives plain decoding's tokens
(ragged batch, gamma above the block, gamma auto); the sampled law is exact (`test_engine_law`'s
chi-square); refusals are one line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_weights as dw
import hf_family_weights as fw
import published_head_weights as phw
from specdec_jax import engine
from specdec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, block_logits, dflash_shapes, write_context
from specdec_jax.drafters.published import head_kind, load_drafter_folder
from specdec_jax.engine.generation import prepare_request
from specdec_jax.engine.request import GenerateRequest
from specdec_jax.engine.round import decode_round
from specdec_jax.models import LlamaConfig
from specdec_jax.models.llama import layer_params
from specdec_jax.target import FINAL_NORM
from test_engine_law import LAW_ROWS
from test_published_heads import target as published_target

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "dflash.json").read_text())
CASES = [*dw.CASES, *dw.CONVERTED]
TOLERANCE = 1e-4  # absolute, float32 logits of std ~2


@pytest.fixture(scope="module", autouse=True)
def full_precision_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def source(case: str) -> str:
    """The z-lab case whose weights and references ``case`` shares."""
    return dw.CONVERTED.get(case, case)


@functools.cache
def target(name: str):
    """The fixture's target ``name`` (test_published_heads' regenerated target, the same config)."""
    loaded = published_target(name)
    assert fw.checksum(fw.state_dict(FIXTURE["targets"][name]["config"])) == FIXTURE["targets"][name]["weights_sha256"]
    return loaded


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Every case written as its format ships it (config.json + model.safetensors)."""
    root = tmp_path_factory.mktemp("dflash")
    return {case: write(root / case, FIXTURE["cases"][case]["config_json"], source(case)) for case in CASES}


def write(folder: pathlib.Path, config: dict, case: str) -> pathlib.Path:
    """``folder`` with ``config`` as config.json and the weights of z-lab case ``case``."""
    drawn = dw.state_dict(case)
    assert fw.checksum(drawn) == FIXTURE["cases"][case]["weights_sha256"], "regenerated weights differ: rerun script"
    return write_files(folder, config, drawn)


def write_files(folder: pathlib.Path, config: dict, weights: dict) -> pathlib.Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    phw.write_safetensors(folder / "model.safetensors", weights)
    return folder


def loaded(folders, case: str) -> DFlashDrafter:
    return load_drafter_folder(folders[case], "dflash", target(dw.CASES[source(case)]["target"]))


CONTEXT = 64  # slots of the padded sequence round_logits reads (prompt + reference output)


def round_logits(drafter: DFlashDrafter, loaded_target, sequence: list[int], start: int) -> np.ndarray:
    """f32[B-1,V]: the draft logits of the round whose t0 is ``sequence[start]``, the context being the
    target's states of ``sequence[:start]``."""
    assert len(sequence) <= CONTEXT
    model, target_params = loaded_target.model.as_target()
    ids = jnp.asarray([sequence + [0] * (CONTEXT - len(sequence))])
    return np.asarray(_round_logits(drafter.config, drafter.params, model, target_params, ids, start))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _round_logits(cfg, params, model, target_params, ids, start):
    """round_logits of the padded ``ids i32[1,CONTEXT]``, one program per drafter shape (``start`` traced):
    the target's states of every slot are written, those from ``start`` on hidden by the context mask
    (causal attention: the states before ``start`` do not read them)."""
    positions = jnp.arange(CONTEXT)[None]
    _, hidden, _ = model.apply(target_params, ids, model.init_cache(1, CONTEXT), positions,
                               hidden_layers=cfg.feature_layers, compute_logits=False)
    cache = write_context(cfg, params, cfg.layer.init_cache(1, CONTEXT), jnp.moveaxis(hidden, 0, 2), positions)
    block = cfg.block_size
    tokens = jnp.concatenate([ids[:, start, None], jnp.full((1, block - 1), cfg.mask_token, ids.dtype)], axis=1)
    context = jnp.broadcast_to(positions[:, None] < start, (1, block, CONTEXT))
    logits = block_logits(cfg, params, model, target_params, tokens, start + jnp.arange(block)[None], cache, context,
                          jnp.ones((1, block, block), bool))
    return logits[0, 1:]


def with_block(drafter: DFlashDrafter, block: int) -> DFlashDrafter:
    return dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, block_size=block))


@pytest.mark.parametrize("case", CASES)
def test_draft_logits_match_the_reference(folders, case):
    record, spec = FIXTURE["cases"][source(case)], dw.CASES[source(case)]
    drafter = loaded(folders, case)
    expected_layers = tuple(FINAL_NORM if i == phw.TARGETS[spec["target"]]["num_hidden_layers"] - 1 else i
                            for i in dw.layer_ids(source(case)))
    assert drafter.config.feature_layers == expected_layers
    assert (drafter.config.block_size, drafter.config.mask_token) == (spec["block_size"], record["mask_token_id"])
    prompt = FIXTURE["targets"][spec["target"]]["prompt"]
    for block, run in record["blocks"].items():
        sequence, start, worst = prompt + run["output_ids"], len(prompt), 0.0
        for accepted, reference in zip(run["acceptance_lengths"], run["draft_logits"]):
            got = round_logits(with_block(drafter, int(block)), target(spec["target"]), sequence, start)
            worst = max(worst, float(np.abs(got - np.asarray(reference)).max()))
            start += accepted
        print(f"{case} block {block}: max |logits - reference| {worst:.2e}")
        assert worst < TOLERANCE


@pytest.mark.parametrize("case", list(dw.CASES))
def test_greedy_rounds_match_dflash_generate(folders, case):
    """The engine's rounds (gamma B - 1) emit the reference's tokens, as many per round as it does."""
    record, spec = FIXTURE["cases"][case], dw.CASES[case]
    prompt = FIXTURE["targets"][spec["target"]]["prompt"]
    for block, run in record["blocks"].items():
        drafter = with_block(loaded(folders, case), int(block))
        request = GenerateRequest(target(spec["target"]).model, [prompt], drafter, gamma=int(block) - 1,
                                  max_new_tokens=dw.MAX_NEW)
        prepared = prepare_request(request, compile_loop=False)
        state, emitted, one_round = prepared.state, [], jax.jit(functools.partial(decode_round, prepared.spec))
        while bool(jnp.any(~state.done)):
            before = int(state.num_tokens[0])
            state = one_round(prepared.params, state)
            emitted.append(int(state.num_tokens[0]) - before)
        tokens = np.asarray(state.tokens[0, len(prompt): int(state.num_tokens[0])]).tolist()
        assert tokens == run["output_ids"]
        assert emitted[1:] == run["acceptance_lengths"] and emitted[0] == 1  # round 0 emits the prefill's token
    assert max(FIXTURE["cases"]["zlab-qwen3"]["blocks"]["4"]["acceptance_lengths"]) > 1


@pytest.mark.parametrize("case, gamma, block", [("zlab-qwen3", 3, None), ("speculators-llama", "auto", None),
                                               ("zlab-llama", "auto", 3)])
def test_greedy_speculation_equals_plain_decoding(folders, case, gamma, block):
    """A ragged batch, gamma the block's B - 1 drafts or chosen on device among the block's lengths
    (`engine.auto_shapes`), at the trained block or a smaller one (--dflash-block): plain tokens."""
    loaded_target = target(dw.CASES[source(case)]["target"])
    prompt = FIXTURE["targets"][dw.CASES[source(case)]["target"]]["prompt"]
    prompts = [prompt, prompt[:5]]
    drafter = loaded(folders, case) if block is None else loaded(folders, case).with_block(block)
    gammas, _ = engine.auto_shapes(drafter)
    assert gammas[-1] == drafter.config.block_size - 1
    policy = engine.ShapePolicy(gammas, [1.0 + 0.1 * g for g in gammas], [0.0] + [0.1] * (len(gammas) - 1), prior=0.9)
    plain = engine.generate(loaded_target.model, prompts, None, max_new_tokens=14)
    out = engine.generate(loaded_target.model, prompts, drafter, gamma=gamma,
                          policy=policy if gamma == "auto" else None, max_new_tokens=14)
    assert out.tokens == plain.tokens
    assert out.metrics.draft_tokens > 0, out.metrics


def test_a_gamma_or_block_past_the_trained_block_is_refused(folders):
    drafter = loaded(folders, "zlab-qwen3")
    block = drafter.config.block_size
    with pytest.raises(ValueError, match=f"proposes at most {block - 1} drafts a round; gamma = {block}"):
        engine.generate(target(dw.CASES[source("zlab-qwen3")]["target"]).model, [[1, 2, 3]], drafter, gamma=block,
                        max_new_tokens=4)
    for bad in (1, block + 1):
        with pytest.raises(ValueError, match=f"--dflash-block {bad}:"):
            drafter.with_block(bad)


def law_drafter(layers: int = 1) -> DFlashDrafter:
    """A random DFlash drafter (block 4) on test_engine_law's target, reading its layer 0 and final norm."""
    from test_engine_law import CONFIG

    layer = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.hidden_size, intermediate_size=32,
                        num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True, rope_theta=500.0)
    cfg = DFlashConfig(layer, (0, FINAL_NORM), CONFIG.hidden_size, block_size=4, mask_token=5)
    rng = np.random.default_rng(7)
    params = {name: ((1 + 0.2 * rng.standard_normal(shape)) if "norm" in name else
                     rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
              for name, shape in dflash_shapes(cfg).items()}
    return DFlashDrafter(cfg, params)


def test_layer_weights_are_kept_per_layer_and_the_head_reads_only_the_drafted_rows():
    """The drafter holds each stacked layer weight as one array per layer (`split_layers`: XLA CPU runs a
    pass over slices of a stacked weight about twice as slowly), and ``rows`` gives the whole block's
    logits at those rows (a round drafting gamma < B - 1 heads only its gamma rows)."""
    from test_engine_law import target as law_target

    drafter = law_drafter(layers=2)
    cfg, params = drafter.config, drafter.params
    assert all(isinstance(params[name], tuple) and len(params[name]) == 2 for name in layer_params(cfg.layer))
    model, target_params = law_target().as_target()
    rng = np.random.default_rng(3)
    features = jnp.asarray(rng.standard_normal((1, 6, 2, cfg.target_hidden_size)), jnp.float32)
    cache = write_context(cfg, params, cfg.layer.init_cache(1, 8), features, jnp.arange(6)[None])
    tokens = jnp.asarray([[3] + [cfg.mask_token] * 3])
    args = (cfg, params, model, target_params, tokens, 6 + jnp.arange(4)[None], cache,
            jnp.broadcast_to(jnp.arange(8) < 6, (1, 4, 8)), jnp.ones((1, 4, 4), bool))
    np.testing.assert_allclose(block_logits(*args, rows=slice(1, 3)), block_logits(*args)[:, 1:3], atol=1e-5)


@pytest.mark.parametrize("rows", LAW_ROWS)
def test_dflash_sampling_follows_the_target_law(rows):
    """test_engine_law's chi-square over 4 sampled tokens of its rows: q (each block position's
    processed law) keeps stochastic verification exact."""
    from test_engine_law import PROMPT, SAMPLED, SIGNIFICANCE, V, exact_law
    from test_engine_law import target as law_target

    from specdec_jax.audit import chi_square, continuation_codes

    out = engine.generate(law_target(), [PROMPT] * rows, law_drafter(), gamma=3, sampling=SAMPLED, max_new_tokens=4,
                          seed=41, capacity=16)
    codes = continuation_codes(np.asarray(out.tokens), V)
    stat, _, pvalue = chi_square(np.bincount(codes, minlength=V**4), exact_law(law_target(), 4))
    assert pvalue > SIGNIFICANCE, f"chi2 {stat:.1f}, p = {pvalue:.2e}"
    assert out.metrics.accepted_tokens > rows / 10 and out.metrics.draft_tokens > rows, out.metrics


def test_refusals_are_one_line(folders, tmp_path):
    qwen3, llama = target("qwen3"), target("llama")
    config = FIXTURE["cases"]["zlab-qwen3"]["config_json"]
    converted = FIXTURE["cases"]["speculators-llama"]["config_json"]
    dflash = config["dflash_config"]

    def changed(name, **top):
        return write(tmp_path / name, {**config, **top}, "zlab-qwen3")

    cases = [  # (folder, target, message)
        (folders["zlab-qwen3"], llama, "a DFlash drafter for a target of 7 layers; the target has 8"),
        (folders["speculators-llama"], qwen3, "a DFlash drafter for a vocabulary of 160 and hidden size 32; the target "
                                              "has 128"),
        (changed("ids", dflash_config={**dflash, "target_layer_ids": [0, 3, 7]}), qwen3, r"distinct ids in 0\.\.6"),
        (changed("block", block_size=1), qwen3, "block_size must be at least 2"),
        (changed("mask", dflash_config={**dflash, "mask_token_id": 128}), qwen3, "mask_token_id 128 is outside"),
        (changed("nomask", dflash_config={"target_layer_ids": [0, 3, 6]}), qwen3, "no mask_token_id"),
        (changed("v2", architectures=["DFlash2DraftModel"]), qwen3, "DFlash2's proposal rule is not supported"),
        (changed("slide", layer_types=["sliding_attention", "full_attention"]), qwen3, "sliding-window"),
        (changed("causal", is_causal=True), qwen3, "causal or sliding-window draft layers"),
        (write(tmp_path / "anchor", {**converted, "sample_from_anchor": True}, "zlab-llama"), llama,
         "sample_from_anchor"),
    ]
    for folder, loaded_target, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            load_drafter_folder(folder, "dflash", loaded_target)
        assert "\n" not in str(err.value) and str(folder.resolve()) in str(err.value)
    with pytest.raises(ValueError, match="holds a z-lab DFlash head, not a eagle head: use --drafter dflash"):
        load_drafter_folder(folders["zlab-qwen3"], "eagle", qwen3)
    with pytest.raises(ValueError, match="holds a speculators DFlash head, not a eagle head: use --drafter dflash"):
        load_drafter_folder(folders["speculators-llama"], "eagle", llama)
    assert head_kind(folders["zlab-qwen3"]) == ("z-lab DFlash", "dflash")
    assert head_kind(folders["speculators-llama"]) == ("speculators DFlash", "dflash")


def test_the_cli_drafts_with_a_dflash_folder_and_refuses_in_one_line(folders, tmp_path, capsys):
    """--drafter dflash --draft-model FOLDER on a Hugging Face target folder (at its block and at --dflash-block
    2); a drafter for another target, tree settings, a block past the trained one or a gamma past its drafts
    are one line on stderr and exit 2."""
    from tokenizers import Tokenizer, models

    from specdec_jax.cli import main

    config = FIXTURE["targets"]["qwen3"]["config"]
    model_dir = write_files(tmp_path / "qwen3", config, fw.state_dict(config))
    words = models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0")
    Tokenizer(words).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    common = ["generate", "--model", str(model_dir), "--raw", "--prompt", "t5 t9 t7", "--max-new-tokens", "4",
              "--drafter", "dflash", "--draft-model"]
    assert main(common + [str(folders["zlab-qwen3"]), "--gamma", "3"]) == 0
    assert main(common + [str(folders["zlab-qwen3"]), "--gamma", "1", "--dflash-block", "2"]) == 0
    capsys.readouterr()
    for extra, message in (([str(folders["speculators-llama"])], "a DFlash drafter for a vocabulary of 160"),
                           ([str(folders["zlab-qwen3"]), "--tree-depth", "3"], "drafts chains only"),
                           ([str(folders["zlab-qwen3"]), "--dflash-block", "64"], "--dflash-block 64: a block holds"),
                           ([str(folders["zlab-qwen3"]), "--gamma", "9"], "proposes at most 3 drafts a round")):
        assert main(common + extra) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_a_block_near_the_budget_is_cut_as_the_reference_cuts_it(folders):
    """Where the budget leaves room for r < B - 1 drafts, the drafts are the greedy ones of a block of r + 2
    tokens (dflash_generate's ``verify_size``), not of the whole block."""
    from specdec_jax.engine.round import draft_room, draft_step

    drafter = with_block(loaded(folders, "zlab-llama"), 6)
    loaded_target = target("llama")
    prompt = FIXTURE["targets"]["llama"]["prompt"]
    prepared = prepare_request(GenerateRequest(loaded_target.model, [prompt], drafter, gamma=5, max_new_tokens=5),
                               compile_loop=False)
    one_round, drafted = (jax.jit(functools.partial(f, prepared.spec)) for f in (decode_round, draft_step))
    state, cut_differs = one_round(prepared.params, prepared.state), False
    while bool(jnp.any(~state.done)):
        room, n = int(draft_room(prepared.spec, state)[0]), int(state.num_tokens[0])
        drafts = np.asarray(drafted(prepared.params, state).proposal.drafts[0, :room])
        sequence = np.asarray(state.tokens[0, :n]).tolist()
        cut = round_logits(with_block(drafter, min(6, room + 2)), loaded_target, sequence, n - 1)
        whole = round_logits(drafter, loaded_target, sequence, n - 1)
        assert drafts.tolist() == cut.argmax(-1)[:room].tolist()
        cut_differs |= cut.argmax(-1)[:room].tolist() != whole.argmax(-1)[:room].tolist()
        state = one_round(prepared.params, state)
    assert cut_differs
