"""Run settings: one frozen dataclass whose fields are the CLI flags (underscores for dashes).

Precedence: dataclass defaults < YAML file (`--config`) < flags given on the
command line. Unknown keys and bad values are `ValueError`s that name the file
and the key.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import yaml

from specdec_jax.engine.batching import AUTO
from specdec_jax.engine.calibration import AUTO_GAMMAS
from specdec_jax.sampling import SamplingParams
from specdec_jax.sharding import DATA, parse_mesh

DRAFTERS = ("none", "ngram", "draft-model", "oracle", "eagle", "medusa")
NEEDS_DRAFT_MODEL = ("draft-model", "eagle", "medusa")  # --draft-model: a draft model, or a trained head folder


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str = "smollm2-135m"
    drafter: str = "ngram"
    draft_model: str | None = None
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
    ngram_min: int = 2  # min 1 drafts on any repeated token; 2 won on Spec-Bench (experiments/README.md)
    mesh: str | None = None  # "data=4,model=2" (specdec_jax.sharding); None: every device on data

    def __post_init__(self):
        checks = (
            ("drafter", self.drafter in DRAFTERS, f"one of {', '.join(DRAFTERS)}"),
            ("gamma", self.gamma == AUTO or isinstance(self.gamma, int) and not isinstance(self.gamma, bool)
             and self.gamma >= 0, "an int >= 0 or 'auto'"),
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "an int >= 1"),
            ("batch_size", isinstance(self.batch_size, int) and self.batch_size >= 1, "an int >= 1"),
            ("oracle_alpha", 0.0 <= self.oracle_alpha <= 1.0, "in [0, 1]"),
            ("ngram_min", isinstance(self.ngram_min, int) and self.ngram_min >= 1, "an int >= 1"),
            ("ngram_max", isinstance(self.ngram_max, int) and self.ngram_max >= self.ngram_min, "an int >= ngram_min"),
        )
        for name, ok, requirement in checks:
            if not ok:
                raise ValueError(f"{name} must be {requirement}, got {getattr(self, name)!r}")
        if self.drafter in NEEDS_DRAFT_MODEL and not self.draft_model:
            raise ValueError(f"drafter {self.drafter!r} needs draft_model (--draft-model NAME_OR_PATH)")
        if not all(isinstance(p, str) for p in self.prompt):
            raise ValueError(f"prompt must be a list of strings, got {self.prompt!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_id):
            raise ValueError(f"stop_id must be token ids (ints >= 0), got {list(self.stop_id)!r}")
        sampling_params(self)
        if self.mesh is not None:
            if not isinstance(self.mesh, str):
                raise ValueError(f"mesh must be a string like 'data=4,model=2', got {self.mesh!r}")
            data = parse_mesh(self.mesh)[DATA]
            if self.batch_size % data:
                raise ValueError(f"mesh {self.mesh!r}: the data axis ({data}) does not divide batch_size "
                                 f"{self.batch_size}")
        if self.drafter == "none":  # plain decoding: record the gamma that really runs
            object.__setattr__(self, "gamma", 0)

    @property
    def effective_gamma(self) -> int | str:
        """What `generate` gets: an int (0 = plain decoding) or "auto"."""
        return self.gamma

    @property
    def widest_gamma(self) -> int:
        """The most drafts a round can verify (sizes the KV capacity)."""
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


def read_yaml(path: str | pathlib.Path, kind: str = "config") -> dict[str, Any]:
    """The mapping in a YAML file; a missing file, bad YAML or a non-mapping is a ValueError naming the file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{kind} file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {kind} file must be a mapping of keys to values")
    return data


def load_yaml(path: str | pathlib.Path) -> dict[str, Any]:
    """Keys and values of a config file, checked against RunConfig's fields."""
    return check_keys(read_yaml(path), str(path))


def check_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ValueError(f"{where}: unknown key {key!r} (known: {', '.join(FIELDS)})")
        if name == "prompt":  # one string is one prompt, a list is several
            value = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value
        elif name == "stop_id":  # one id or a list of ids
            value = tuple(value) if isinstance(value, list) else (value,)
        out[name] = value
    return out


def resolve(file_values: dict[str, Any], flag_values: dict[str, Any], where: str = "config") -> RunConfig:
    """RunConfig from file values overridden by flags (flags left unset are None and ignored)."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    try:
        return RunConfig(**merged)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from None
