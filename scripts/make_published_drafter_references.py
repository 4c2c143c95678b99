"""Write tiny published-format drafters and their reference outputs (run by hand; CI needs no torch).

The reference packages pin transformers 5.15 (dflash) and <= 5.19 (speculators), and speculators'
torchaudio dependency pulls CUDA torch wheels, so run this in a virtual environment of its own::

    python -m venv --system-site-packages /tmp/refvenv
    /tmp/refvenv/bin/pip install --no-deps speculators==0.9.0 dflash==0.1.0 medusa-llm==0.1
    /tmp/refvenv/bin/pip install "torch==2.13.0" "transformers==5.15.0" "huggingface-hub<2" "tokenizers<0.23.1" \
        httpx loguru openai "datasets<=5.1.0" aiohttp "tqdm==4.70.0" hs-connectors==0.9.0
    /tmp/refvenv/bin/python scripts/make_published_drafter_references.py OUT

Every model is random (float32 unless a case says otherwise), built and run with the reference
packages' own classes on CPU in float64. ``OUT`` (replaced) gets:

- ``targets/<name>/``: transformers ``save_pretrained`` (config.json, model.safetensors) and a word-level
  ``tokenizer.json``: ``llama`` (8 layers) and ``qwen3`` (7 layers, tied embeddings, qk-norm);
- one folder per drafter case (`CASES`), in its package's own format: ``eagle3-*`` speculators
  (config.json + model.safetensors), ``eagle3-original-*`` SafeAILab (config.json + pytorch_model.bin),
  ``medusa-*`` (config.json + medusa_lm_head.pt), ``dflash-*`` z-lab (config.json + model.safetensors)
  and ``dflash-speculators-*`` (speculators' converter applied to the z-lab folder);
- ``references.npz``: arrays named ``<case>/<what>``; ``references.json``: versions, prompts, and per case
  its target, files, layer ids and the scalar results (token lists, acceptance lengths).

What each case records is in the docstring of its ``make_*`` function. Layer ids are recorded as each
format writes them, next to ``hidden_state_index``: the index into transformers' ``hidden_states``
(entry k is the input of decoder layer k, entry L the final-norm output) that the package reads.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import pathlib
import shutil

import numpy as np

SEED = 0
PROMPT_LEN = 12
CHAIN = 4  # EAGLE-3 drafts per chain
TARGETS = {  # name -> (model_type, config kwargs)
    "llama": ("llama", dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=256)),
    "qwen3": ("qwen3", dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=256)),
}
CASES = {  # case -> (maker, target, options)
    "eagle3-llama": ("eagle3", "llama", dict(draft_vocab=96, layer_ids=[1, 3, 6], rope_theta=50000.0)),
    "eagle3-qwen3-bf16": ("eagle3", "qwen3", dict(draft_vocab=128, layer_ids=[2, 4, 5], norm_before_residual=True,
                                                  fc_norm=True, norm_output=True, dtype="bfloat16")),
    "eagle3-original-llama": ("eagle3_original", "llama", dict(draft_vocab=64)),
    "medusa-llama": ("medusa", "llama", dict(heads=4)),
    "dflash-qwen3": ("dflash", "qwen3", dict(layers=2, layer_ids=[0, 2, 5], block_size=4, echo=True)),
    "dflash-llama": ("dflash", "llama", dict(layers=1, layer_ids=None, block_size=3)),
}


def torch_modules():
    import torch
    import transformers
    return torch, transformers


def randomize(module, gen, skip=()) -> None:
    """Every floating parameter of ``module`` not under a ``skip`` prefix: norms 1 + 0.2 N(0, 1),
    biases 0.2 N(0, 1), embeddings N(0, 1), other matrices N(0, 1 / fan_in) (lm heads N(0, 4 / H):
    logits of std about 2, a clear argmax)."""
    torch, _ = torch_modules()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(name.startswith(s) for s in skip) or not p.dtype.is_floating_point:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.ndim == 1:
                p.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * (2.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[-1]))


def write_tokenizer(folder: pathlib.Path, vocab_size: int) -> None:
    """A word-level tokenizer of ids ``t0 .. t{V-1}`` (bos t1, eos t2): enough for loaders that want one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
              "unk_token": "t0", "model_max_length": 256}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def make_target(out: pathlib.Path, name: str, gen):
    """(model float64 eval, folder): the random target saved (float32) under ``out/targets/name``."""
    torch, transformers = torch_modules()
    model_type, kwargs = TARGETS[name]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, gen, skip=("lm_head",) if config.tie_word_embeddings else ())
    folder = out / "targets" / name
    model.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    return model.to(torch.float64).eval(), folder


def target_pass(target, ids: list[int]):
    """(logits f64[S,V], hidden states: transformers' tuple, entry k = input of layer k, entry L final-normed)."""
    torch, _ = torch_modules()
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states


def greedy(target, ids: list[int], count: int) -> list[int]:
    """The target's ``count`` greedy tokens after ``ids`` (full recomputation, no cache)."""
    ids = list(ids)
    for _ in range(count):
        ids.append(int(target_pass(target, ids)[0][-1].argmax()))
    return ids[-count:]


def vocab_maps(vocab: int, draft_vocab: int, gen):
    """(d2t i64[Vd] offsets, t2d bool[V]) of a random draft vocabulary, by speculators' own builder."""
    torch, _ = torch_modules()
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    counts = torch.randint(1, 1000, (vocab,), generator=gen)
    return build_vocab_mappings_from_distribution({i: int(c) for i, c in enumerate(counts)}, draft_vocab, vocab)


def eagle3_model(target, options: dict, layer_ids: list[int], gen):
    """speculators' ``Eagle3DraftModel`` for ``target`` (its family's first layer, one layer), random
    weights, lm_head = the target's rows at t2d plus noise, the target's embedding (float64)."""
    torch, transformers = torch_modules()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    tc = target.config
    model_type, kwargs = TARGETS[options["target"]]
    kwargs = {k: v for k, v in kwargs.items() if k != "rope_theta"}
    rope = {"rope_type": "default", "rope_theta": options.get("rope_theta", tc.rope_parameters["rope_theta"])}
    layer = transformers.AutoConfig.for_model(model_type, **{**kwargs, "num_hidden_layers": 1, "intermediate_size": 48,
                                                             "tie_word_embeddings": False, "rope_parameters": rope})
    layer._attn_implementation = "eager"
    spec = SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy",
                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=CHAIN)],
                             verifier=VerifierConfig(name_or_path=f"targets/{options['target']}",
                                                     architectures=tc.architectures or []))
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=options["draft_vocab"],
        eagle_aux_hidden_state_layer_ids=layer_ids, norm_before_residual=options.get("norm_before_residual", False), fc_norm=options.get("fc_norm", False),
        norm_output=options.get("norm_output", False), speculators_config=spec)
    model = Eagle3DraftModel(config)
    randomize(model, gen, skip=("embed_tokens", "lm_head", "verifier"))
    d2t, t2d = vocab_maps(tc.vocab_size, options["draft_vocab"], gen)
    model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        rows = target.get_output_embeddings().weight[t2d]
        model.lm_head.weight.copy_(rows + 0.5 * torch.randn(rows.shape, generator=gen, dtype=rows.dtype) * rows.std())
        if options.get("dtype") == "bfloat16":  # saved so: the references use the rounded weights (not buffers:
            for p in model.parameters():     # a bfloat16 round trip of the module would round RoPE's inv_freq)
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


def eagle3_references(model, target, prompt: list[int], layer_ids: list[int]) -> tuple[dict, dict]:
    """EAGLE-3 on ``prompt`` + t0 (the target's greedy next token), by the package's own forward.

    Input j pairs token j + 1 with the target features g_j = concat(hidden_states[k] for k in layer_ids)
    (transformers' hidden_states: entry k is the input of decoder layer k). Records ``features f32[P,3H]``,
    ``first_logits f32[P,Vd]`` (step 0 at every input: the logits of token j + 2 over the draft vocab),
    and the greedy chain from the last input: ``chain_logits f32[CHAIN,Vd]``, each draft (a target id,
    ``d + d2t[d]``) fed back with the head's own output state (the training-time-test forward with the
    drafts appended teacher-forced, which is exactly the inference chain of the last input)."""
    torch, _ = torch_modules()
    t0 = greedy(target, prompt, 1)[0]
    _, hidden = target_pass(target, prompt)
    features = torch.cat([hidden[k][0] for k in layer_ids], dim=-1)  # f64[P,3H]
    model = model.to(torch.float64).eval()
    captured = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out[0].detach()))
    drafts, chain = [], []
    with torch.no_grad():
        for step in range(CHAIN):
            ids = torch.tensor([prompt[1:] + [t0] + drafts])
            feats = torch.cat([features, features.new_zeros(len(drafts), features.shape[1])])[None]
            captured.clear()
            model(hidden_states=feats, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=step + 1)
            chain.append(captured[step][len(prompt) - 1])
            best = int(chain[-1].argmax())
            drafts.append(best + int(model.d2t[best]) if model.d2t is not None else best)
    hook.remove()
    first = captured[0][: len(prompt)]
    arrays = {"features": features, "first_logits": first, "chain_logits": torch.stack(chain)}
    info = {"t0": t0, "chain_drafts": drafts, "first_argmax_target_ids":
            [int(i) + (int(model.d2t[i]) if model.d2t is not None else 0) for i in first.argmax(-1)]}
    return arrays, info


def reload_check(folder: pathlib.Path, out: pathlib.Path, target, prompt, layer_ids, arrays) -> None:
    """Loads ``folder`` back with ``SpeculatorModel.from_pretrained`` (verifier path relative to ``out``)
    and asserts it reproduces ``arrays``: the saved files are complete."""
    from safetensors import safe_open
    from speculators import SpeculatorModel, SpeculatorModelConfig
    with contextlib.chdir(out):
        config = SpeculatorModelConfig.from_pretrained(str(folder))
        config.transformer_layer_config._attn_implementation = "eager"
        again = SpeculatorModel.from_pretrained(str(folder), config=config)
        with safe_open(folder / "model.safetensors", "pt") as saved:
            if "embed_tokens.weight" not in saved.keys():  # from_pretrained leaves it uninitialized
                again._load_verifier_weights(overwrite_embed_tokens=True)
    got, _ = eagle3_references(again, target, prompt, layer_ids)
    for key, value in arrays.items():
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(value), rtol=1e-6, atol=1e-6, err_msg=key)


def make_eagle3(out, case, target, folder, prompt, options, gen):
    """speculators format: ``Eagle3DraftModel.save_pretrained`` (config.json + model.safetensors)."""
    layer_ids = options["layer_ids"]
    model = eagle3_model(target, options, layer_ids, gen)
    dtype = getattr(torch_modules()[0], options.get("dtype", "float32"))
    copy.deepcopy(model).to(dtype).save_pretrained(out / case)
    arrays, info = eagle3_references(model, target, prompt, layer_ids)
    reload_check(out / case, out, target, prompt, layer_ids, arrays)
    return arrays, {**info, "layer_ids": layer_ids, "hidden_state_index": layer_ids}


def safeailab_config(model, draft_vocab: int) -> dict:
    """The config.json of a SafeAILab EAGLE-3 head (EConfig, a flat Llama config; head_dim = H / heads)."""
    layer = model.config.transformer_layer_config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
            "num_attention_heads": layer.num_attention_heads, "num_key_value_heads": layer.num_key_value_heads,
            "num_hidden_layers": 1, "max_position_embeddings": layer.max_position_embeddings,
            "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_parameters["rope_theta"],
            "vocab_size": layer.vocab_size, "draft_vocab_size": draft_vocab, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
            "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True}


def make_eagle3_original(out, case, target, folder, prompt, options, gen):
    """SafeAILab layout: config.json (``LlamaForCausalLMEagle3``) + pytorch_model.bin with ``midlayer.*``,
    no embedding; the target layers are SafeAILab's fixed [2, L // 2, L - 3] (inputs of those layers).
    Checked by speculators' own converter: converting the folder back reproduces the references."""
    torch, _ = torch_modules()
    n = target.config.num_hidden_layers
    layer_ids = [2, n // 2, n - 3]
    model = eagle3_model(target, {**options, "rope_theta": 10000.0}, layer_ids, gen)
    arrays, info = eagle3_references(model, target, prompt, layer_ids)
    keep = ("fc.", "norm.", "lm_head.", "d2t", "t2d", "layers.0.")
    state = {k.replace("layers.0.", "midlayer."): v.float() if v.is_floating_point() else v
             for k, v in model.state_dict().items() if k.startswith(keep)}
    (out / case).mkdir(parents=True)
    torch.save(state, out / case / "pytorch_model.bin")
    (out / case / "config.json").write_text(json.dumps(safeailab_config(model, options["draft_vocab"]), indent=1))
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    converted = out / "tmp-converted"
    Eagle3Converter().convert(out / case, converted, str(folder.resolve()), validate=False)
    with contextlib.chdir(out):
        reload_check(converted, out, target, prompt, layer_ids, arrays)
    shutil.rmtree(converted)
    return arrays, {**info, "layer_ids": None, "hidden_state_index": layer_ids}


def make_medusa(out, case, target, folder, prompt, options, gen):
    """medusa-llm 0.1 ``MedusaModel`` (K heads, one ResBlock each, own full-vocabulary lm_head = the
    target's plus noise): ``medusa_lm_head.pt`` (``medusa_head.state_dict()``) + config.json
    (``MedusaConfig``). Records ``logits f32[K,P,V]``: head k at position t predicts token t + 2 + k,
    from the target's final-norm state at t."""
    torch, _ = torch_modules()
    from medusa.model.medusa_model import MedusaConfig, MedusaModel
    with contextlib.chdir(out):
        model = MedusaModel(target, medusa_num_heads=options["heads"], medusa_num_layers=1,
                            base_model_name_or_path=f"targets/{options['target']}")
    randomize(model.medusa_head, gen)
    with torch.no_grad():
        for head in model.medusa_head:
            base = target.lm_head.weight
            head[-1].weight.copy_(base + 0.5 * base.std() * torch.randn(base.shape, generator=gen, dtype=base.dtype))
    (out / case).mkdir(parents=True)
    MedusaConfig(medusa_num_heads=options["heads"], medusa_num_layers=1,
                 base_model_name_or_path=f"targets/{options['target']}").save_pretrained(out / case)
    torch.save({k: v.float() for k, v in model.medusa_head.state_dict().items()}, out / case / "medusa_lm_head.pt")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]))[:, 0]  # f64[K,P,V]
    return {"logits": logits}, {"heads": options["heads"], "argmax_last": logits[:, -1].argmax(-1).tolist()}


def dflash_model(target, options, mask_token: int, gen):
    """dflash 0.1.0 ``DFlashDraftModel`` (Qwen3 layers) for ``target``: its hidden size, ``mask_token``,
    ``dflash_config.target_layer_ids`` = ``options["layer_ids"]`` (None: ``build_target_layer_ids``)."""
    torch, transformers = torch_modules()
    from dflash.model import DFlashDraftModel
    tc = target.config
    dflash = {"mask_token_id": mask_token}
    if options["layer_ids"] is not None:
        dflash["target_layer_ids"] = options["layer_ids"]
    config = transformers.Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=48,
        num_hidden_layers=options["layers"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=tc.rope_parameters["rope_theta"], rms_norm_eps=1e-6, max_position_embeddings=256,
        tie_word_embeddings=False, num_target_layers=tc.num_hidden_layers, block_size=options["block_size"],
        dflash_config=dflash, architectures=["DFlashDraftModel"])
    model = DFlashDraftModel(config)
    randomize(model, gen)
    if options.get("echo"):  # weak layers: a mask position's output stays near the mask token's embedding
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.o_proj.weight.mul_(0.1)
                layer.mlp.down_proj.weight.mul_(0.1)
    return model


def dflash_run(model, target, prompt, block_size: int, max_new: int) -> dict:
    """Greedy ``dflash_generate`` (no stop tokens) with its stats and every round's draft logits
    (``compute_logits``' output, ``[rounds, block_size - 1, V]``: the first 8 rounds of full blocks)."""
    torch, _ = torch_modules()
    import time

    import dflash.model as dm
    dm._cuda_time = time.perf_counter  # return_stats times with torch.cuda.synchronize: CPU has none
    rounds = []
    original = type(model).compute_logits

    def capture(self, hidden, head):
        logits = original(self, hidden, head)
        rounds.append(logits[0].detach())
        return logits

    type(model).compute_logits = capture
    try:
        stats = dm.dflash_generate(model, target, torch.tensor([prompt]), max_new, None, block_size=block_size,
                                   return_stats=True)
    finally:
        type(model).compute_logits = original
    full = [r for r in rounds if r.shape[0] == block_size - 1][:8]
    return {"output_ids": stats.output_ids[0, len(prompt):].tolist(), "acceptance_lengths": stats.acceptance_lengths,
            "draft_logits": torch.stack(full)}


def make_dflash(out, case, target, folder, prompt, options, gen):
    """z-lab format (``save_pretrained``: config.json with ``block_size``, ``num_target_layers``,
    ``dflash_config``; no embedding or LM head, the target's are used) plus ``dflash-speculators-*``
    (speculators' ``DFlashConverter`` of it). Records greedy ``dflash_generate`` at the draft's block size
    and at 2x it: generated ids, per-round acceptance lengths (tokens emitted per round) and each round's
    draft logits; checks the output equals the target's own greedy decoding. With ``echo`` the mask token
    is the target's most frequent greedy token and the draft's layers are weak, so with the tied LM head
    the drafts often match and rounds accept several tokens (else the mask token is V - 1)."""
    torch, _ = torch_modules()
    max_new = 24
    expected = greedy(target, prompt, max_new)
    mask = max(set(expected), key=expected.count) if options.get("echo") else target.config.vocab_size - 1
    model = dflash_model(target, options, mask, gen)
    model.save_pretrained(out / case)
    model = model.to(torch.float64).eval()
    arrays, info = {}, {"target_layer_ids": model.target_layer_ids, "mask_token_id": model.mask_token_id,
                        "hidden_state_index": [i + 1 for i in model.target_layer_ids], "expected": expected}
    for block in (model.block_size, 2 * model.block_size):
        run = dflash_run(model, target, prompt, block, max_new)
        assert run["output_ids"] == expected, (case, block, run["output_ids"], expected)
        arrays[f"block{block}/draft_logits"] = run.pop("draft_logits")
        info[f"block{block}"] = run
    assert not options.get("echo") or max(info[f"block{model.block_size}"]["acceptance_lengths"]) > 1, case
    from speculators.convert.dflash.converter import DFlashConverter
    implicit = None if options["layer_ids"] else [i + 1 for i in model.target_layer_ids]  # converter's default
    converted = out / case.replace("dflash", "dflash-speculators")
    DFlashConverter().convert(out / case, converted, str(folder.resolve()), validate=False,
                              aux_hidden_state_layer_ids=implicit)
    config = json.loads((converted / "config.json").read_text())  # the verifier as the EAGLE-3 folders name it
    config["speculators_config"]["verifier"]["name_or_path"] = f"targets/{options['target']}"
    (converted / "config.json").write_text(json.dumps(config, indent=2))
    return arrays, info


def main() -> None:
    torch, transformers = torch_modules()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="output folder (replaced)")
    args = parser.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED)
    targets, prompts = {}, {}
    for name in TARGETS:
        targets[name] = make_target(out, name, gen)
        vocab = targets[name][0].config.vocab_size
        prompts[name] = torch.randint(3, vocab - 1, (PROMPT_LEN,), generator=gen).tolist()
    makers = {"eagle3": make_eagle3, "eagle3_original": make_eagle3_original, "medusa": make_medusa,
              "dflash": make_dflash}
    arrays, cases = {}, {}
    for case, (kind, target_name, options) in CASES.items():
        target, folder = targets[target_name]
        made, info = makers[kind](out, case, target, folder, prompts[target_name], {**options, "target": target_name},
                                  gen)
        arrays.update({f"{case}/{k}": np.asarray(v.float() if hasattr(v, "float") else v, np.float32)
                       for k, v in made.items()})
        cases[case] = {"kind": kind, "target": target_name, "options": options, "info": info,
                       "files": sorted(p.name for p in (out / case).iterdir())}
    np.savez_compressed(out / "references.npz", **arrays)
    from importlib.metadata import version
    versions = {name: version(name) for name in ("torch", "transformers", "speculators", "dflash", "medusa-llm")}
    (out / "references.json").write_text(json.dumps(
        {"versions": versions, "seed": SEED, "prompts": prompts, "chain": CHAIN, "cases": cases}, indent=1))
    print(f"wrote {out}: {len(cases)} cases, {os.path.getsize(out / 'references.npz')} bytes of arrays")


if __name__ == "__main__":
    main()
