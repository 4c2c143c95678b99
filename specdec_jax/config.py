"""Run settings: `RunConfig`, a few top-level settings and five groups; users give them flat.

A run is named by its top-level settings (model, dtype, drafter, draft_model,
gamma, seed, mesh) and the groups `sampling` (`SamplingParams`), `inputs` (the
prompts, their batches and budget, the stop ids), `tree` (a token tree's
shape), `drafting` (settings of particular drafters: the table of drafters,
`drafters.table`, says which drafter reads which) and `constraint` (a grammar).

Users give settings flat: YAML keys and CLI flags (dashes for underscores) are
the names of `KEYS`, a group's field each (prefixed in the tree group:
``tree_nodes`` is ``tree.nodes``). `run_config(**flat)` builds a RunConfig,
`RunConfig.to_dict` gives the flat keys back (reports embed it).

Precedence: defaults < YAML file (`--config`) < flags given on the command
line. Unknown keys, values of the wrong type (`specdec_jax.typed`: ``raw:
"false"`` is not true) and bad values are `ValueError`s that name the file (or
"flags") and the key: every check raises a `typed.SettingError` that carries
its keys.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, ClassVar

import yaml

from specdec_jax.drafters.table import PLAIN, drafter_names, drafter_spec, drafters, names_where
from specdec_jax.engine.request import AUTO, LOGPROBS_MODES, MAX_LOGPROBS, MAX_NEW_TOKENS
from specdec_jax.models.llama import DTYPES
from specdec_jax.rng import SEED_LIMIT
from specdec_jax.sampling import SamplingParams
from specdec_jax.sharding import DATA, parse_mesh
from specdec_jax.token_ranking import IDS
from specdec_jax.token_tree import TreeShape, load_choices
from specdec_jax.typed import SettingError, check_types, coerce, hints

TREE_DEFAULTS = {"depth": 4, "topk": 2}  # with a tree; its nodes default to depth * topk
EXAMPLES = {"mesh": "'data=4,model=2'"}  # a valid value, shown when a value has the wrong type
NEEDED = {  # what a drafter that needs a setting asks for (`DrafterSpec.needs`)
    "draft_model": "draft_model (--draft-model NAME_OR_PATH)",
    "datastore": "a datastore (e.g. sharegpt, a .jsonl file or a folder)",
}


def _check(settings, checks, prefix: str = "") -> None:
    """SettingError ``"NAME must be REQUIREMENT, got VALUE"`` for the first (name, ok, requirement) not ok."""
    for name, ok, requirement in checks:
        if not ok:
            raise SettingError(f"{prefix}{name} must be {requirement}, got {getattr(settings, name)!r}", prefix + name)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The prompts, how they are encoded and batched, when a row ends, and what is read out per token."""

    prompt: tuple[str, ...] = ()
    prompts_file: str | None = None
    raw: bool = False  # no chat template
    batch_size: int = 1
    max_new_tokens: int = 128
    ignore_eos: bool = False
    stop_id: tuple[int, ...] = ()  # extra token ids that end a row (kept in the output), beside the model's
    logprobs: int | None = None  # K: each emitted token's log-prob and its K most likely alternatives; None: off
    logprobs_mode: str = "raw"  # raw: the target's log_softmax; processed: the law the run samples from

    def __post_init__(self):
        check_types(self)
        _check(self, (("max_new_tokens", 1 <= self.max_new_tokens < MAX_NEW_TOKENS, "an int in [1, 2**31 - 2**20)"),
                      ("batch_size", self.batch_size >= 1, "an int >= 1"),
                      ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                       f"an int in [0, {MAX_LOGPROBS}]"),
                      ("logprobs_mode", self.logprobs_mode in LOGPROBS_MODES, f"one of {', '.join(LOGPROBS_MODES)}")))
        if not all(i >= 0 for i in self.stop_id):
            raise SettingError(f"stop_id must be token ids (ints >= 0), got {list(self.stop_id)!r}", "stop_id")


@dataclasses.dataclass(frozen=True)
class TreeSettings:
    """A token tree's shape (`specdec_jax.token_tree`); every field None: chains. Flat keys: ``tree_`` + field."""

    PREFIX: ClassVar[str] = "tree_"
    nodes: int | str | None = None  # node count, or "auto": a size chosen per round (engine.shape)
    depth: int | None = None
    topk: int | None = None
    choices: str | None = None  # a static tree file in Medusa's format (JSON list of rank lists)

    def __post_init__(self):
        check_types(self, self.PREFIX)
        for name in ("nodes", "depth", "topk"):
            value = getattr(self, name)
            if name == "nodes" and value == AUTO:
                continue
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SettingError(f"tree_{name} must be an int >= 1{' or auto' * (name == 'nodes')}, got {value!r}",
                                   f"tree_{name}")

    @property
    def given(self) -> tuple[str, ...]:
        """The flat keys of the fields set (none: chains)."""
        return tuple(self.PREFIX + f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)

    def shape(self) -> TreeShape | None:
        """The token tree the fields describe (None: chains); a bad one is a SettingError naming them."""
        if not self.given:
            return None
        try:
            if self.choices is not None:
                return load_choices(self.choices)
            depth, topk = self.depth or TREE_DEFAULTS["depth"], self.topk or TREE_DEFAULTS["topk"]
            nodes = depth * topk if self.nodes in (None, AUTO) else self.nodes  # auto: sizes up to depth x topk
            return TreeShape(nodes=nodes, depth=depth, topk=topk)
        except ValueError as err:
            raise SettingError(str(err), *self.given) from None


@dataclasses.dataclass(frozen=True)
class DrafterSettings:
    """Settings particular drafters read (`drafters.table`: each entry's ``settings``)."""

    draft_vocab: int = 0  # a draft model's logits over N ids (+ stop ids) only; 0: all
    oracle_alpha: float = 0.8
    ngram_max: int = 3
    ngram_min: int = 2  # 1 drafts after any repeated token: more tokens per round, more wrong drafts verified
    datastore: tuple[str, ...] = ()  # sources (specdec_jax.datastore): sharegpt, a .jsonl, a folder, outputs
    dflash_block: int = 0  # a DFlash drafter's block size B (t0 and B - 1 masks); 0: the one it was trained with
    draft_confidence: float = 0.0  # a chain (draft model, EAGLE) ends at a draft it is less sure of (drafters.chain)
    draft_vocab_source: str = IDS  # which N: the first ids, or the most frequent in a text source (token_ranking)

    def __post_init__(self):
        check_types(self)
        _check(self, (("oracle_alpha", 0.0 <= self.oracle_alpha <= 1.0, "in [0, 1]"),
                      ("ngram_min", self.ngram_min >= 1, "an int >= 1"),
                      ("ngram_max", self.ngram_max >= self.ngram_min, "an int >= ngram_min"),
                      ("draft_vocab", self.draft_vocab >= 0, "an int >= 0"),
                      ("draft_confidence", 0.0 <= self.draft_confidence < 1.0, "in [0, 1)"),
                      ("dflash_block", self.dflash_block == 0 or self.dflash_block >= 2, "0 or an int >= 2")))
        if self.draft_vocab_source != IDS and not self.draft_vocab:
            raise SettingError(f"draft_vocab_source {self.draft_vocab_source!r} ranks the ids a reduced draft "
                               "vocabulary keeps: give draft_vocab N too", "draft_vocab_source", "draft_vocab")


@dataclasses.dataclass(frozen=True)
class ConstraintSettings:
    """A grammar every output obeys (docs/constraints.md): one of a regex and a JSON schema file."""

    regex: str | None = None
    json_schema: str | None = None

    def __post_init__(self):
        check_types(self)
        if self.regex is not None and self.json_schema is not None:
            raise SettingError("regex and json_schema exclude each other: a constraint is one of them",
                               "regex", "json_schema")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run is given (module docstring); build it from flat keys with `run_config`."""

    model: str = "smollm2-135m"
    dtype: str = "float32"  # weights, residual stream and KV cache of the models (specdec_jax.models.llama)
    drafter: str = "ngram"  # a name of the table of drafters, or "none" (plain decoding: gamma 0)
    draft_model: str | None = None
    gamma: int | str = "auto"  # drafts per round, or "auto": chosen per round (specdec_jax.engine.shape)
    seed: int = 0
    mesh: str | None = None  # "data=4,model=2" (specdec_jax.sharding); None: every device on data
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    inputs: Inputs = dataclasses.field(default_factory=Inputs)
    tree: TreeSettings = dataclasses.field(default_factory=TreeSettings)
    drafting: DrafterSettings = dataclasses.field(default_factory=DrafterSettings)
    constraint: ConstraintSettings = dataclasses.field(default_factory=ConstraintSettings)

    def __post_init__(self):
        check_types(self)  # types first (specdec_jax.typed): the range checks compare
        names = drafter_names()
        _check(self, (
            ("drafter", self.drafter in names, f"one of {', '.join(names)}"),
            ("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("gamma", self.gamma == AUTO or isinstance(self.gamma, int) and self.gamma >= 0, "an int >= 0 or 'auto'"),
            ("seed", 0 <= self.seed < SEED_LIMIT, "an int in [0, 2**64)"),
        ))
        if self.drafter == PLAIN and self.gamma != 0:
            raise SettingError(f"drafter {PLAIN!r} decodes plainly: gamma must be 0, got {self.gamma!r}", "gamma")
        if self.mesh is not None:
            try:
                data = parse_mesh(self.mesh)[DATA]
            except ValueError as err:
                raise SettingError(str(err), "mesh") from None
            if self.inputs.batch_size % data:
                raise SettingError(f"mesh {self.mesh!r}: the data axis ({data}) does not divide batch_size "
                                   f"{self.inputs.batch_size}", "mesh", "batch_size")
        if self.gamma != 0:  # the drafter runs
            self._check_drafter()
            self._check_tree()

    def _check_drafter(self) -> None:
        """The settings the drafter needs are given; another drafter's settings that are off by default are not."""
        spec = drafter_spec(self.drafter)
        for key in spec.needs:
            if not self.value(key):
                raise SettingError(f"the {self.drafter} drafter needs {NEEDED.get(key, key)}", key, "drafter")
        for key in dict.fromkeys(k for s in drafters() for k in s.settings):
            if key not in spec.settings and self.value(key) and not KEYS[key].default:
                owners = " or ".join(repr(s.name) for s in drafters() if key in s.settings)
                raise SettingError(f"{key} is for drafter {owners}, not {self.drafter!r}", key, "drafter")

    def _check_tree(self) -> None:
        given = self.tree.given
        if not given:
            return
        if not drafter_spec(self.drafter).trees:
            raise SettingError(f"the {self.drafter} drafter drafts chains only; token trees (tree_*) come from "
                               f"{', '.join(names_where(lambda s: s.trees))}", "drafter", *given)
        shape = self.tree.shape()
        if self.gamma not in (AUTO, shape.nodes) or self.tree.nodes == AUTO and self.gamma != AUTO:
            raise SettingError(f"gamma {self.gamma} and a tree of {self.tree.nodes or shape.nodes} nodes exclude "
                               "each other: leave gamma unset with a tree (its node count is the round's width)",
                               "gamma", *given)

    def value(self, key: str) -> Any:
        """The setting of a flat key (`KEYS`): ``value("temperature")`` is ``sampling.temperature``."""
        where = KEYS[key]
        return getattr(getattr(self, where.group) if where.group else self, where.field)

    @property
    def is_tree(self) -> bool:
        return bool(self.tree.given)

    @property
    def tree_shape(self) -> TreeShape | None:
        """The token tree the tree settings describe (None: chains)."""
        return self.tree.shape()

    @property
    def effective_gamma(self) -> int | str:
        """What `generate` gets: an int (0 = plain decoding; a tree's node count) or "auto" (with a
        tree drafter: the tree size chosen per round)."""
        if self.gamma != 0 and self.is_tree:
            return AUTO if self.tree.nodes == AUTO else self.tree_shape.nodes
        return self.gamma

    def to_dict(self) -> dict[str, Any]:
        """The flat keys and their values (lists for tuples; the logit bias a mapping {id: bias}, a ban as
        the string "-inf", which JSON can hold): what `run_config` takes and reports embed."""
        flat = {key: list(v) if isinstance(v := self.value(key), tuple) else v for key in KEYS}
        flat["logit_bias"] = {token: "-inf" if bias == -math.inf else bias for token, bias in self.sampling.logit_bias}
        return flat

    def updated(self, **flat) -> RunConfig:
        """This config with the flat keys ``flat`` changed (`run_config`'s checks)."""
        return run_config(**{**self.to_dict(), **flat})


@dataclasses.dataclass(frozen=True)
class Key:
    """Where a flat key lives in a RunConfig: ``group`` (None: top level), ``field``; its default and annotation."""

    group: str | None
    field: str
    default: Any
    hint: Any


def _keys() -> dict[str, Key]:
    """Flat key -> `Key`: the top-level fields, and each group's fields (a field whose annotation is a dataclass)."""
    keys = {}
    for field in dataclasses.fields(RunConfig):
        group = hints(RunConfig)[field.name]
        if not dataclasses.is_dataclass(group):
            keys[field.name] = Key(None, field.name, field.default, group)
            continue
        for inner in dataclasses.fields(group):
            keys[getattr(group, "PREFIX", "") + inner.name] = Key(field.name, inner.name, inner.default,
                                                                  hints(group)[inner.name])
    return keys


KEYS = _keys()
GROUPS = {key.group: hints(RunConfig)[key.group] for key in KEYS.values() if key.group}


def run_config(**flat) -> RunConfig:
    """RunConfig from flat keys (`KEYS`; the rest keep their defaults): each value checked by type and
    converted (`typed.coerce`), the groups built; drafter "none" runs gamma 0, the gamma recorded."""
    unknown = [key for key in flat if key not in KEYS]
    if unknown:
        raise SettingError(f"unknown key {unknown[0]!r} (known: {', '.join(KEYS)})", unknown[0])
    values = {key: coerce(value, KEYS[key].hint, key, EXAMPLES.get(key)) for key, value in flat.items()}
    if values.get("drafter", KEYS["drafter"].default) == PLAIN:
        values["gamma"] = 0
    top = {KEYS[key].field: value for key, value in values.items() if KEYS[key].group is None}
    groups = {name: {KEYS[key].field: value for key, value in values.items() if KEYS[key].group == name}
              for name in GROUPS}
    for name, fields in groups.items():
        if GROUPS[name] is SamplingParams:  # its checks are each of one field: the field that fails alone is the key
            for key, value in fields.items():
                try:
                    SamplingParams(**{key: value})
                except ValueError as err:
                    raise SettingError(str(err), key) from None
    return RunConfig(**top, **{name: GROUPS[name](**fields) for name, fields in groups.items()})


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
    """Keys and values of a config file, checked against the flat keys."""
    return check_keys(read_yaml(path), str(path))


def check_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data``'s keys as flat keys (`KEYS`; a list for ``prompt`` or ``stop_id`` taken as a tuple);
    a non-mapping or an unknown key is a ValueError naming ``where``."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a mapping of keys to values, got {type(data).__name__} {data!r:.60}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in KEYS:
            raise ValueError(f"{where}: unknown key {key!r} (known: {', '.join(KEYS)})")
        if name in ("prompt", "stop_id"):  # one value, or a list of them
            value = tuple(value) if isinstance(value, list) else (value,)
        out[name] = value
    return out


def resolve(file_values: dict[str, Any], flag_values: dict[str, Any], where: str = "config") -> RunConfig:
    """RunConfig from file values overridden by flags (flags left unset are None and ignored); an error
    names ``where`` (the file), or "flags" when a key it is about was given as a flag."""
    flags = {k: v for k, v in flag_values.items() if v is not None}
    try:
        return run_config(**{**file_values, **flags})
    except ValueError as err:
        raise ValueError(f"{blame(err, flags, where)}: {err}") from None


def blame(err: ValueError, flags: dict[str, Any], where: str) -> str:
    """Where the values an error is about came from: "flags" when one of its keys was a flag given,
    else ``where``. The keys are a `SettingError`'s; a plain ValueError of settings that do not name
    them (`distill.config.TrainConfig`'s range checks) is about the key its message starts with."""
    keys = err.keys if isinstance(err, SettingError) else (str(err).split(" ", 1)[0],)
    return "flags" if set(keys) & flags.keys() else where
