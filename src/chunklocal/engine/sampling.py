"""``SamplingParams``: per-request sampling, with vLLM's field names and defaults.

A ``SamplingParams`` is immutable once built and checked: every bad value raises
ValueError naming the field and the value, before any engine state changes.  It
remembers which fields the caller set (``fields_set``), so that the engine can fill
the others from the checkpoint's ``generation_config.json`` (``LLM(generation_config=
"auto")``, vLLM's meaning) without overriding what the caller asked for.

Semantics (as vLLM's):
- ``temperature`` < 1e-5 is greedy (argmax after penalties); top_k / top_p / min_p
  then change nothing.
- ``top_k`` 0 or -1: off.  ``top_p`` 1: off.  ``min_p`` 0: off.  Order: penalties,
  temperature, min_p, top_k, then top_p on the top-k renormalised distribution.
- ``repetition_penalty`` divides positive and multiplies negative logits of every token
  seen in the prompt or the output; ``presence_penalty`` / ``frequency_penalty``
  subtract once / per occurrence for tokens of the output only.
- ``seed``: a generator of the request's own; with ``n`` > 1, sample ``i`` uses
  ``seed + i``.
- ``stop``: strings ending the text (not part of it unless
  ``include_stop_str_in_output``); ``stop_token_ids``: tokens ending the output
  (kept in ``token_ids``, ``stop_reason`` is the id); EOS ends it unless
  ``ignore_eos``.
- ``max_tokens``: new tokens per sample; None means the room left in max_model_len.
- ``logprobs``: k >= 0 top log-probabilities per token, plus the sampled token's.  They
  are of the model's raw distribution (before penalties and temperature), as vLLM v1
  returns by default (``logprobs_mode="raw_logprobs"``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


#: Default of every field, replaced in __post_init__: tells a field the caller left unset
#: (fields_set) from one set to its default.  Typed Any so that it is every field's default.
_UNSET: Any = _Unset()

#: Field -> default (vLLM's).
DEFAULTS = dict(
    n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, max_tokens=16,
    stop=None, stop_token_ids=None, ignore_eos=False, logprobs=None,
    repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
    include_stop_str_in_output=False, skip_special_tokens=True,
)

#: generation_config.json key -> SamplingParams field (what vLLM takes from it).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}

SAMPLING_EPS = 1e-5  # temperatures below are greedy (vLLM's _SAMPLING_EPS)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)) and math.isfinite(value))


def _bad(name, value, expected):
    return ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class SamplingParams:
    """Sampling of one request (see the module docstring).  Keyword arguments only.

    ``stop`` may also be given as None, a string or a list, and ``stop_token_ids`` as None
    or a list: both are stored as tuples (numbers as Python int / float / bool).
    """

    n: int = _UNSET
    temperature: float = _UNSET
    top_p: float = _UNSET
    top_k: int = _UNSET
    min_p: float = _UNSET
    seed: int | None = _UNSET
    max_tokens: int | None = _UNSET
    stop: tuple[str, ...] = _UNSET
    stop_token_ids: tuple[int, ...] = _UNSET
    ignore_eos: bool = _UNSET
    logprobs: int | None = _UNSET
    repetition_penalty: float = _UNSET
    presence_penalty: float = _UNSET
    frequency_penalty: float = _UNSET
    include_stop_str_in_output: bool = _UNSET
    skip_special_tokens: bool = _UNSET
    _fields_set: frozenset[str] = field(default=frozenset(), init=False, compare=False)

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in DEFAULTS}
        values = {k: (DEFAULTS[k] if v is _UNSET else v) for k, v in given.items()}
        for name, value in _checked(values).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_fields_set",
                           frozenset(k for k, v in given.items() if v is not _UNSET))

    @property
    def fields_set(self) -> frozenset[str]:
        """The fields the caller passed (the others hold defaults)."""
        return self._fields_set

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in DEFAULTS}

    def replace(self, **changes) -> SamplingParams:
        """A copy with ``changes`` (checked); the fields set are the union."""
        unknown = set(changes) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"SamplingParams has no field {sorted(unknown)[0]!r}")
        kept = {k: getattr(self, k) for k in self._fields_set if k not in changes}
        return SamplingParams(**kept, **changes)

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """Fields the caller left unset take ``defaults`` (field -> value); set ones stay."""
        fill = {k: v for k, v in defaults.items() if k not in self._fields_set}
        if not fill:
            return self
        new = self.replace(**fill)
        object.__setattr__(new, "_fields_set", self._fields_set)  # still "unset" by caller
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def plain_greedy(self) -> bool:
        """Greedy without penalties: the argmax of the raw logits (drafts can be verified)."""
        return (self.greedy and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)

    def __repr__(self) -> str:
        normal = _checked(DEFAULTS)
        shown = ", ".join(f"{k}={getattr(self, k)!r}" for k in DEFAULTS
                          if getattr(self, k) != normal[k])
        return f"SamplingParams({shown})"


def _checked(v: dict) -> dict:
    """Validated, normalised field values (lists become tuples; numpy scalars Python)."""
    if not _is_int(v["n"]) or v["n"] < 1:
        raise _bad("n", v["n"], "an integer >= 1")
    if not _is_number(v["temperature"]) or v["temperature"] < 0:
        raise _bad("temperature", v["temperature"], "a finite number >= 0")
    if not _is_number(v["top_p"]) or not 0 < v["top_p"] <= 1:
        raise _bad("top_p", v["top_p"], "a number in (0, 1]")
    if not _is_int(v["top_k"]) or v["top_k"] < -1:
        raise _bad("top_k", v["top_k"], "an integer >= 1, or 0 / -1 (off)")
    if not _is_number(v["min_p"]) or not 0 <= v["min_p"] <= 1:
        raise _bad("min_p", v["min_p"], "a number in [0, 1]")
    if v["seed"] is not None and (not _is_int(v["seed"]) or not 0 <= v["seed"] < 2**63):
        raise _bad("seed", v["seed"], "None or an integer in [0, 2**63)")
    if v["max_tokens"] is not None and (not _is_int(v["max_tokens"]) or v["max_tokens"] < 1):
        raise _bad("max_tokens", v["max_tokens"], "None or an integer >= 1")
    stop = v["stop"]
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _bad("stop", stop, "None, a string or a list of strings")
    if any(s == "" for s in stop):
        raise _bad("stop", v["stop"], "non-empty strings")
    ids = v["stop_token_ids"]
    if ids is None:
        ids = ()
    elif isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids):
        ids = tuple(int(t) for t in ids)
    else:
        raise _bad("stop_token_ids", ids, "None or a list of token ids >= 0")
    if v["logprobs"] is not None and (not _is_int(v["logprobs"]) or v["logprobs"] < 0):
        raise _bad("logprobs", v["logprobs"], "None or an integer >= 0")
    if not _is_number(v["repetition_penalty"]) or v["repetition_penalty"] <= 0:
        raise _bad("repetition_penalty", v["repetition_penalty"], "a finite number > 0")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _is_number(v[name]) or not -2 <= v[name] <= 2:
            raise _bad(name, v[name], "a number in [-2, 2]")
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(v[name], (bool, np.bool_)):
            raise _bad(name, v[name], "True or False")
    out = dict(v, stop=stop, stop_token_ids=ids)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        out[name] = float(v[name])
    for name in ("n", "top_k", "seed", "max_tokens", "logprobs"):
        out[name] = None if v[name] is None else int(v[name])
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        out[name] = bool(v[name])
    return out


def generation_config_defaults(model_dir) -> dict:
    """SamplingParams defaults from ``model_dir/generation_config.json`` (field -> value);
    {} when the file is absent.  A value SamplingParams refuses raises ValueError naming
    the file and the key."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    defaults = {field: config[key] for key, field in GENERATION_CONFIG_FIELDS.items()
                if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return defaults
