"""Engine options as the C API takes them: EngineArgs fields by name, each value a string
as the command line writes it, read by the field's type."""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from pyengine.engine.engine_args import EngineArgs

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


def engine_args(model: str | None, options: Mapping[str, str]) -> EngineArgs:
    """EngineArgs of `model` (the default model where None) and the options; ValueError
    naming an option that EngineArgs does not have, or a value its type cannot take."""
    hints = typing.get_type_hints(EngineArgs)
    values: dict[str, Any] = {}
    for name, text in options.items():
        if name == "model":
            raise ValueError("the model is the engine's model parameter, not an option")
        if name not in hints:
            close = difflib.get_close_matches(name, list(hints), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown engine option {name!r}{hint}")
        values[name] = _read(name, text, hints[name])
    if model is not None:
        values["model"] = model
    return EngineArgs(**values)


def _read(name: str, text: str, hint: Any) -> Any:
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    word = text.strip().lower()
    if type(None) in kinds and word in _NONE:
        return None
    kind = next(k for k in kinds if k is not type(None))
    if kind is bool:
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(f"engine option {name!r} is true or false, got {text!r}")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"engine option {name!r} is {what}, got {text!r}") from None
    if kind is str:
        return text
    try:  # a mapping (speculative_config, pooler_config): a JSON object
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"engine option {name!r} is a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"engine option {name!r} is a JSON object, got {text!r}")
    return value
