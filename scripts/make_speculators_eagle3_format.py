"""Records what speculators writes for an EAGLE-3 head: the config.json keys (top level, the
speculators_config and the transformer_layer_config) and the weight names, shapes and dtypes of
model.safetensors, for a head of the tiny-random target's sizes (vocabulary 258, width 128, 4 layers),
into tests/fixtures/speculators_eagle3_format.json (checked by tests/test_eagle3_training.py).

Run with speculators 0.9.0 and torch (not a dependency of this project):
    python scripts/make_speculators_eagle3_format.py [--check FOLDER]
--check FOLDER [--target NAME]: loads a folder this project saved with speculators' `from_pretrained`,
compares its weights with the file's and, given the target, speculators' draft logits with this project's
(a check that speculators reads it, not a test).
"""

import argparse
import json
import pathlib
import tempfile

from safetensors import safe_open

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "speculators_eagle3_format.json"


def build(draft_vocab: int, aux_ids: list[int]):
    import torch
    from transformers import AutoConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = AutoConfig.for_model("llama", vocab_size=258, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=aux_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path="tiny-random", architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.nan_to_num(p))
    return model


def record(draft_vocab: int, aux_ids: list[int]) -> dict:
    model = build(draft_vocab, aux_ids)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        config = json.loads((pathlib.Path(folder) / "config.json").read_text())
        with safe_open(str(pathlib.Path(folder) / "model.safetensors"), "np") as f:
            weights = {name: [list(f.get_tensor(name).shape), str(f.get_tensor(name).dtype)] for name in f.keys()}
    return {"config_keys": sorted(config), "speculators_config_keys": sorted(config["speculators_config"]),
            "layer_config_keys": sorted(config["transformer_layer_config"]), "config": config, "weights": weights}


def check(folder: str, target: str | None) -> None:
    """Loads ``folder`` with speculators' `from_pretrained` (the verifier's own weights, which speculators
    reads from the verifier's checkpoint for training, skipped) and compares every weight to the file."""
    import numpy as np
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    Eagle3DraftModel.load_verifier_weights = lambda self: None
    Eagle3DraftModel.from_pretrained = classmethod(lambda cls, *a, **k: SpeculatorModel.from_pretrained.__func__(
        cls, *a, **k))
    cfg = Eagle3SpeculatorConfig.from_pretrained(folder)
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(folder, config=cfg)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    with safe_open(str(pathlib.Path(folder) / "model.safetensors"), "np") as f:
        differ = [name for name in f.keys() if not np.array_equal(f.get_tensor(name), state[name])]
    print(f"{type(model).__name__}: {len(state)} weights loaded; differing from the file: {differ or 'none'}")
    if target:
        compare_logits(model, folder, target)


def compare_logits(model, folder: str, target_name: str) -> None:
    """Prints the largest difference between speculators' first-step draft logits and this project's
    (`drafters.published` loading the same folder) on random features and tokens."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from specdec_jax.drafters.eagle3 import head_logits, head_pass, project
    from specdec_jax.drafters.published import load_drafter_folder
    from specdec_jax.models import load_model
    from specdec_jax.models.llama import LlamaTarget

    target = load_model(target_name)
    drafter = load_drafter_folder(folder, "eagle", target)
    cfg, m, h = drafter.config, len(drafter.config.feature_layers), target.config.hidden_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.layer.vocab_size, (1, 9))
    features = rng.standard_normal((1, 9, m * h)).astype(np.float32)
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out[0].detach().numpy()))
    with torch.no_grad():
        model(hidden_states=torch.tensor(features), input_ids=torch.tensor(tokens),
              document_ids=torch.zeros((1, 9), dtype=torch.long), ttt_steps=1)
    params = {**drafter.params, "target": {"embed": target.model.arrays()["embed"]}}
    x = project(cfg, params, jnp.asarray(features.reshape(1, 9, m, h)))
    out, _ = head_pass(cfg, params, LlamaTarget(target.config), params["target"], jnp.asarray(tokens, jnp.int32), x,
                       cfg.layer.init_cache(1, 9), jnp.arange(9)[None])
    ours = np.asarray(head_logits(cfg, params, out)[0])[0]
    print(f"draft logits: largest |speculators - ours| = {np.abs(captured[0] - ours).max():.3g}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check")
    parser.add_argument("--target", help="with --check: the target (a name `load_model` takes) to compare logits on")
    args = parser.parse_args()
    if args.check:
        check(args.check, args.target)
    else:
        FIXTURE.write_text(json.dumps({"reduced": record(128, [1, 2, 3]), "full": record(258, [1, 2, 3])}, indent=1))
        print(f"wrote {FIXTURE}")
