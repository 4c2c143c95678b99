"""Run settings: one frozen dataclass whose fields are the CLI flags (underscores for dashes).

Precedence: dataclass defaults < YAML file (`--config`) < flags given on the
command line. Unknown keys, values of the wrong type (`specdec_jax.typed`:
``raw: "false"`` is not true) and bad values are `ValueError`s that name the
file and the key.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import yaml

from specdec_jax.engine.batching import AUTO, MAX_NEW_TOKENS
from specdec_jax.engine.shape import AUTO_GAMMAS
from specdec_jax.models.llama import DTYPES
from specdec_jax.rng import SEED_LIMIT
from specdec_jax.sampling import SamplingParams
from specdec_jax.sharding import DATA, parse_mesh
from specdec_jax.tree import TreeShape, load_choices
from specdec_jax.typed import check_fields

DRAFTERS = ("none", "ngram", "retrieval", "draft-model", "oracle", "eagle", "medusa")
NEEDS_DRAFT_MODEL = ("draft-model", "eagle", "medusa")  # --draft-model: a draft model, or a trained head folder
TREE_DRAFTERS = ("ngram", "retrieval", "draft-model", "eagle", "medusa")  # --tree-*: the drafters that propose token trees
TREE_FIELDS = ("tree_nodes", "tree_depth", "tree_topk")  # ints; with tree_choices, the tree's shape
TREE_DEFAULTS = {"tree_depth": 4, "tree_topk": 2}  # tree_nodes defaults to depth * topk


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str = "smollm2-135m"
    drafter: str = "ngram"
    draft_model: str | None = None
    dtype: str = "float32"  # weights, residual stream and KV cache of the models (specdec_jax.models.llama)
    draft_vocab: int = 0  # draft-model drafter: logits over the draft's first N ids (+ stop ids) only; 0: all
    gamma: int | str = "auto"  # drafts per round, or "auto": chosen per round (specdec_jax.engine.shape)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # transformers' (CTRL): prompt and generated tokens
    presence_penalty: float = 0.0  # vLLM/OpenAI: generated tokens only
    frequency_penalty: float = 0.0
    max_new_tokens: int = 128
    seed: int = 0
    batch_size: int = 1
    prompt: tuple[str, ...] = ()
    prompts_file: str | None = None
    raw: bool = False
    ignore_eos: bool = False
    stop_id: tuple[int, ...] = ()  # extra token ids that end a row (kept in the output), beside the model's
    oracle_alpha: float = 0.8
    ngram_max: int = 3
    ngram_min: int = 2  # 1 drafts after any repeated token: more tokens per round, more wrong drafts verified
    datastore: tuple[str, ...] = ()  # retrieval drafter: sources (specdec_jax.datastore): sharegpt, a .jsonl, a folder
    mesh: str | None = None  # "data=4,model=2" (specdec_jax.sharding); None: every device on data
    tree_nodes: int | str | None = None  # a token tree of this many nodes (specdec_jax.tree), "auto" (a size
    # chosen per round, engine.shape); None: a chain
    tree_depth: int | None = None
    tree_topk: int | None = None
    tree_choices: str | None = None  # a static tree file in Medusa's format (JSON list of rank lists)
    regex: str | None = None  # every output matches this regex (docs/constraints.md)
    json_schema: str | None = None  # every output is JSON valid against the schema in this file

    def __post_init__(self):
        check_fields(self, {"mesh": "'data=4,model=2'"})  # types first (specdec_jax.typed): raw "false" is not true
        checks = (
            ("drafter", self.drafter in DRAFTERS, f"one of {', '.join(DRAFTERS)}"),
            ("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("gamma", self.gamma == AUTO or isinstance(self.gamma, int) and self.gamma >= 0, "an int >= 0 or 'auto'"),
            ("max_new_tokens", 1 <= self.max_new_tokens < MAX_NEW_TOKENS, "an int in [1, 2**31 - 2**20)"),
            ("seed", 0 <= self.seed < SEED_LIMIT, "an int in [0, 2**64)"),
            ("batch_size", self.batch_size >= 1, "an int >= 1"),
            ("oracle_alpha", 0.0 <= self.oracle_alpha <= 1.0, "in [0, 1]"),
            ("ngram_min", self.ngram_min >= 1, "an int >= 1"),
            ("ngram_max", self.ngram_max >= self.ngram_min, "an int >= ngram_min"),
        )
        for name, ok, requirement in checks:
            if not ok:
                raise ValueError(f"{name} must be {requirement}, got {getattr(self, name)!r}")
        if (self.drafter == "retrieval") != bool(self.datastore) and self.gamma != 0:
            raise ValueError("the retrieval drafter needs a datastore (e.g. sharegpt, a .jsonl file or a folder)"
                             if self.drafter == "retrieval" else
                             f"datastore is for drafter 'retrieval', not {self.drafter!r}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be an int >= 0, got {self.draft_vocab!r}")
        if self.draft_vocab and self.drafter != "draft-model":
            raise ValueError(f"draft_vocab reduces a draft model's output vocabulary: it needs drafter 'draft-model', "
                             f"not {self.drafter!r}")
        if self.drafter in NEEDS_DRAFT_MODEL and not self.draft_model:
            raise ValueError(f"drafter {self.drafter!r} needs draft_model (--draft-model NAME_OR_PATH)")
        if not all(i >= 0 for i in self.stop_id):
            raise ValueError(f"stop_id must be token ids (ints >= 0), got {list(self.stop_id)!r}")
        sampling_params(self)
        if self.mesh is not None:
            data = parse_mesh(self.mesh)[DATA]
            if self.batch_size % data:
                raise ValueError(f"mesh {self.mesh!r}: the data axis ({data}) does not divide batch_size "
                                 f"{self.batch_size}")
        if self.regex is not None and self.json_schema is not None:
            raise ValueError("regex and json_schema exclude each other: a constraint is one of them")
        if self.drafter == "none":  # plain decoding: record the gamma that really runs
            object.__setattr__(self, "gamma", 0)
        self._check_tree()

    def _check_tree(self) -> None:
        for name in TREE_FIELDS:
            value = getattr(self, name)
            if name == "tree_nodes" and value == AUTO:
                continue
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1{' or auto' * (name == 'tree_nodes')}, got {value!r}")
        if not self.is_tree or self.gamma == 0:
            return
        if self.drafter not in TREE_DRAFTERS:
            raise ValueError(f"the {self.drafter} drafter drafts chains only; token trees (tree_*) come from "
                             f"{', '.join(TREE_DRAFTERS)}")
        if self.tree_choices is not None and self.drafter != "medusa":
            raise ValueError("tree_choices (a static tree) is for --drafter medusa")
        shape = self.tree_shape
        if self.gamma not in (AUTO, shape.nodes) or self.tree_nodes == AUTO and self.gamma != AUTO:
            raise ValueError(f"gamma {self.gamma} and a tree of {self.tree_nodes or shape.nodes} nodes exclude each "
                             f"other: leave gamma unset with a tree (its node count is the round's width)")

    @property
    def is_tree(self) -> bool:
        return self.tree_choices is not None or any(getattr(self, name) is not None for name in TREE_FIELDS)

    @property
    def tree_shape(self) -> TreeShape | None:
        """The token tree the tree_* fields describe (None: chains)."""
        if not self.is_tree:
            return None
        if self.tree_choices is not None:
            return load_choices(self.tree_choices)
        depth = self.tree_depth or TREE_DEFAULTS["tree_depth"]
        topk = self.tree_topk or TREE_DEFAULTS["tree_topk"]
        nodes = depth * topk if self.tree_nodes in (None, AUTO) else self.tree_nodes  # auto: sizes up to depth x topk
        return TreeShape(nodes=nodes, depth=depth, topk=topk)

    @property
    def effective_gamma(self) -> int | str:
        """What `generate` gets: an int (0 = plain decoding; a tree's node count) or "auto" (with a
        tree drafter: the tree size chosen per round)."""
        if self.gamma != 0 and self.is_tree:
            return AUTO if self.tree_nodes == AUTO else self.tree_shape.nodes
        return self.gamma

    @property
    def widest_gamma(self) -> int:
        """The most drafts (tree nodes) a round can verify (sizes the KV capacity)."""
        if self.gamma != 0 and self.is_tree:
            return self.tree_shape.nodes
        return max(AUTO_GAMMAS) if self.gamma == AUTO else self.gamma

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["prompt"], d["stop_id"] = list(self.prompt), list(self.stop_id)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def sampling_params(cfg: RunConfig) -> SamplingParams:
    """The config's sampling fields (temperature ... frequency_penalty) as SamplingParams; a bad
    value is a ValueError naming the field."""
    return SamplingParams(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(SamplingParams)})


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML file gives one key twice."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, except that a key given twice in one mapping is an error: plain YAML keeps
    the last value silently. Keys brought in by a merge (``<<: *base``) may be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in lines:
                        where = f"line {line}" if lines[key] == line else f"lines {lines[key]} and {line}"
                        raise DuplicateKeyError(f"key {key!r} is given twice ({where}): keep one")
                    lines[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
        return super().construct_mapping(node, deep)


def read_yaml(path: str | pathlib.Path, kind: str = "config") -> dict[str, Any]:
    """The mapping in a YAML file (`UniqueKeyLoader`: every YAML file the package reads goes through
    here); a missing file, bad YAML, a key given twice or a non-mapping is a ValueError naming the file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{kind} file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeyLoader) or {}
    except DuplicateKeyError as err:
        raise ValueError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {kind} file must be a mapping of keys to values")
    return data


def load_yaml(path: str | pathlib.Path) -> dict[str, Any]:
    """Keys and values of a config file, checked against RunConfig's fields."""
    return check_keys(read_yaml(path), str(path))


def check_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data``'s keys as RunConfig field names (a list for ``prompt`` or ``stop_id`` taken as a tuple);
    a non-mapping or an unknown key is a ValueError naming ``where``."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a mapping of keys to values, got {type(data).__name__} {data!r:.60}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ValueError(f"{where}: unknown key {key!r} (known: {', '.join(FIELDS)})")
        if name in ("prompt", "stop_id"):  # one value, or a list of them
            value = tuple(value) if isinstance(value, list) else (value,)
        out[name] = value
    return out


def resolve(file_values: dict[str, Any], flag_values: dict[str, Any], where: str = "config") -> RunConfig:
    """RunConfig from file values overridden by flags (flags left unset are None and ignored); an error
    names ``where`` (the file), or "flags" when the key it is about was given as a flag."""
    flags = {k: v for k, v in flag_values.items() if v is not None}
    try:
        return RunConfig(**{**file_values, **flags})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{blame(err, flags, where)}: {err}") from None


def blame(err: Exception, flags: dict[str, Any], where: str) -> str:
    """Where the value an error is about came from: "flags" when the key it starts with was a flag
    given, else ``where``."""
    return "flags" if str(err).split(" ", 1)[0] in flags else where
