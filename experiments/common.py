"""What the experiment scripts share.

- where results go (`RESULTS`) and how they are written: `save` (JSON + markdown table + PNG),
  `write_json`, `markdown_table`, `pyplot`, `category_bars` (one bar group per Spec-Bench category);
- Spec-Bench prompt sets, read from `$SPEC_BENCH` at run time and written to a temporary JSONL
  (never into the repository): `spec_bench_subset` (the first questions of every category) and
  `recipe_questions` + `prompts_file` (the recipes' training or held-out split, optionally only
  some categories or prompts of at most so many tokens);
- `gguf_tokenizer`: a registry model's tokenizer from its GGUF metadata alone;
- the drafters the recipes leave in the cache (`HEAD_CONFIGS`, `run_folder`, `standalone_draft`,
  `cached_draft_model`), so that `--draft-model` can be left out.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import tempfile

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs" / "train"  # found from any working directory

HEAD_CONFIGS = {"eagle": str(CONFIGS / "smollm2-eagle.yaml"), "medusa": str(CONFIGS / "smollm2-medusa.yaml"),
                "eagle3": str(CONFIGS / "smollm2-eagle3.yaml"), "dflash": str(CONFIGS / "smollm2-dflash.yaml")}
DRAFT_CONFIG = str(CONFIGS / "smollm2-draft.yaml")
STANDALONE_DRAFT = "drafts/smollm2-recipe"  # where experiments/train_draft_recipe.py trains its draft
OPEN_ENDED = ("writing", "roleplay", "qa")  # the categories where prompt lookup finds least to copy


# ---------------------------------------------------------------- writing results


def markdown_table(header: list[str], rows: list[list]) -> str:
    cell = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]) + "\n"


def write_json(path: pathlib.Path, payload, indent: int = 1) -> None:
    path.write_text(json.dumps(payload, indent=indent, default=str))


def save(out: pathlib.Path, payload: dict, table: str, figure=None, png: str = "plot.png",
         data: str = "results.json") -> None:
    """Writes out/<data> (JSON), out/table.md and (if given) the matplotlib figure as out/<png>; prints the
    table."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / data, payload)
    (out / "table.md").write_text(table)
    if figure is not None:
        figure.tight_layout()
        figure.savefig(out / png, dpi=120)
        pyplot().close(figure)
    print(table, end="" if table.endswith("\n") else "\n")
    print(f"wrote {out}")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def category_bars(ax, categories: list[str], series: dict[str, list[float]], ylabel: str = "",
                  title: str = "", one_line: bool = False) -> None:
    """One bar group per category, one bar per series (label -> a value per category; NaN for none);
    a line at 1.0 when `one_line` (speedups)."""
    import numpy as np

    x = np.arange(len(categories))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + (i - len(series) / 2 + 0.5) * width, values, width, label=label)
    if one_line:
        ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, categories, rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8, ncol=min(len(series), 4))


# ---------------------------------------------------------------- Spec-Bench prompt sets


def first_per_category(questions: list[dict], per_category: int | None = None,
                       categories: list[str] | None = None, keep=None) -> list[dict]:
    """The first `per_category` (None: all) questions of each category, in file order, among those of
    `categories` (None: all) that `keep` (None: every question) accepts."""
    seen: dict[str, int] = {}
    chosen = []
    for q in questions:
        cat = q["category"]
        if categories is not None and cat not in categories or keep is not None and not keep(q):
            continue
        if per_category is None or seen.get(cat, 0) < per_category:
            seen[cat] = seen.get(cat, 0) + 1
            chosen.append(q)
    return chosen


@contextlib.contextmanager
def prompts_file(questions: list[dict]):
    """Path of a temporary JSONL of the questions' first turns (Spec-Bench's own fields), removed on exit."""
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "prompts.jsonl"
        path.write_text("\n".join(json.dumps({"question_id": q["question_id"], "category": q["category"],
                                              "turns": q["turns"][:1]}) for q in questions))
        yield path


@contextlib.contextmanager
def spec_bench_subset(per_category: int, categories: list[str] | None = None):
    """Path of a temporary JSONL with the first `per_category` Spec-Bench questions of each category
    (all of Spec-Bench, not only the held-out split)."""
    from specdec_jax.data import spec_bench_questions

    with prompts_file(first_per_category(spec_bench_questions(), per_category, categories)) as path:
        yield path


def recipe_questions(split: str = "heldout", per_category: int | None = None, categories: list[str] | None = None,
                     max_prompt_tokens: int | None = None, tokenizer=None, config: str = HEAD_CONFIGS["eagle"]
                     ) -> list[dict]:
    """Spec-Bench questions of the recipes' training or held-out split (`heldout_per_category` of
    `config`: the 5 highest question ids of each category are held out, never trained on), the first
    `per_category` of each of `categories`, optionally only those whose first turn in the chat template
    has at most `max_prompt_tokens` tokens (counted with `tokenizer`, default SmolLM2-135M's)."""
    from specdec_jax.data import spec_bench_questions
    from specdec_jax.distill.config import train_config
    from specdec_jax.distill.data import split_questions

    tc = train_config(config)
    train, held = split_questions(spec_bench_questions(tc.prompts_file), tc.heldout_per_category)
    keep = None
    if max_prompt_tokens:
        from specdec_jax.runner import encode

        if tokenizer is None:
            from specdec_jax.models import load_model

            tokenizer = load_model(tc.target).tokenizer
        keep = lambda q: len(encode(tokenizer, q["turns"][0], False)) <= max_prompt_tokens  # noqa: E731
    chosen = first_per_category(train if split == "train" else held, per_category, categories, keep)
    if max_prompt_tokens:
        print(f"{len(chosen)} prompts of at most {max_prompt_tokens} tokens", flush=True)
    return chosen


def prompt_record(question: dict) -> dict:
    """A question as the runner's prompt record: {"id", "category", "prompt"} (its first turn)."""
    return {"id": question["question_id"], "category": question["category"], "prompt": question["turns"][0]}


# ---------------------------------------------------------------- drafters the recipes leave in the cache


def run_folder(kind: str) -> pathlib.Path:
    """The cache folder `experiments/eagle_recipe.py` trains head `kind` (eagle, medusa, eagle3, dflash) in."""
    from specdec_jax.cache import cache_dir

    return cache_dir() / "heads" / pathlib.Path(HEAD_CONFIGS[kind]).stem


def standalone_draft() -> pathlib.Path | None:
    """The standalone draft `experiments/train_draft_recipe.py` left in the cache, or None."""
    from specdec_jax.cache import cache_dir

    draft = cache_dir() / STANDALONE_DRAFT / "draft"
    return draft if (draft / "specdec_model.json").is_file() else None


def cached_draft_model(drafter: str) -> str | None:
    """The `--draft-model` of `drafter` the recipes left in the cache (None for the n-gram and oracle
    drafters); exits with the command to run when it is missing."""
    if drafter in HEAD_CONFIGS:
        head = run_folder(drafter) / "head"
        if not head.is_dir():
            raise SystemExit(f"no {drafter} head in {head}: `python experiments/eagle_recipe.py` trains one")
        return str(head)
    if drafter == "draft-model":
        draft = standalone_draft()
        if draft is None:
            raise SystemExit("no standalone draft in the cache: `python experiments/train_draft_recipe.py` trains one")
        return str(draft)
    return None


def gguf_tokenizer(model: str):
    """The tokenizer of registry model ``model`` (a GGUF one) from the GGUF metadata alone: the file is
    fetched if needed, no weights are converted or loaded."""
    from gguf import GGUFReader

    from specdec_jax.models.fetch import model_gguf
    from specdec_jax.models.tokenizer import BPETokenizer

    reader = GGUFReader(model_gguf(model))
    return BPETokenizer.from_gguf_metadata({name: field.contents() for name, field in reader.fields.items()
                                            if name.startswith("tokenizer.")})


def draft_matches(draft_name: str, rows, draft_vocab: int = 0, vocab_source: str = "ids") -> list[list[bool]]:
    """Per row (id, category, prompt, output): whether the draft model ``draft_name``'s greedy token equals each
    output token, given the output before it (one teacher-forced pass): under greedy verification, which drafts
    of a chain the target accepts. ``draft_vocab``: the draft's logits over that many ids, those ``vocab_source``
    ranks first, and its stop ids only (`--draft-vocab`, `--draft-vocab-source`; 0: all)."""
    return [matches for matches, _ in draft_guesses(draft_name, rows, draft_vocab, vocab_source)]


def draft_guesses(draft_name: str, rows, draft_vocab: int = 0,
                  vocab_source: str = "ids") -> list[tuple[list[bool], list[float]]]:
    """Per row, `draft_matches`'s matches and the draft's confidence at each output position: the probability
    its law (softmax of its logits) gives its greedy token."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specdec_jax.models import load_model
    from specdec_jax.models.llama import forward
    from specdec_jax.token_ranking import ranked_ids

    draft = load_model(draft_name)
    if draft_vocab:
        draft = draft.with_output_vocab(draft_vocab, ranked_ids(vocab_source, draft.tokenizer, draft.config.vocab_size))
    ids = draft.model.params().get("vocab_map")
    width = max(len(p) + len(o) for _, _, p, o in rows)

    @jax.jit
    def step(params, tokens):  # i32[1,T] -> (greedy ids, their probabilities), f32[1,T] each
        logits = forward(draft.config, params, tokens, draft.config.init_cache(1, width))[0]
        return jnp.argmax(logits, -1), jnp.max(jax.nn.softmax(logits, -1), -1)

    guesses = []
    for _, _, prompt, output in rows:
        seq = np.zeros((1, width), np.int32)
        seq[0, : len(prompt) + len(output)] = prompt + output  # causal: the padding after is never seen
        guess, confidence = (np.asarray(x)[0] for x in step(draft.model.params(), jnp.asarray(seq)))
        guess = guess if ids is None else np.asarray(ids)[guess]
        at = len(prompt) - 1
        guesses.append(([bool(guess[at + i] == t) for i, t in enumerate(output)],
                        [float(c) for c in confidence[at : at + len(output)]]))
    return guesses
