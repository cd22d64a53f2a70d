"""The pooling runner's engine side: which runner a model gets (EngineArgs.runner), its
PoolerConfig from the checkpoint and the caller's pooler_config, and each request's
pooled numbers finished as its PoolingParams ask (cut, normalised, through a softmax
or sigmoid).

A pooling request runs as a generating one of one token whose prompt is scheduled
whole: its last prompt row is the step's sampled row, the worker pools instead of
sampling, and the token it reports (0) only ends the request."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pyengine.config import POOLING_TYPES, ModelConfig, PoolerConfig
from pyengine.models.registry import model_class
from pyengine.pooling_params import PoolingParams
from pyengine.tokenizer import PyengineTokenizer

RUNNERS = ("auto", "generate", "pooling")
# pooler_config's keys (vLLM's --pooler-config, and its hf_overrides' classifier_from_token)
_OPTIONS = ("pooling_type", "normalize", "classifier_from_token")


def resolve_pooler(
    runner: str,
    options: Mapping[str, object] | None,
    config: ModelConfig,
    source: str,
    tokenizer: PyengineTokenizer | None,
) -> PoolerConfig | None:
    """The PoolerConfig of the pooling runner (None: the generating runner). "auto" is
    the pooling runner for a model that cannot generate (an encoder, a classifier)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    cls = model_class(config.architecture)
    generates = getattr(cls, "has_lm_head", True)
    if runner == "auto":
        runner = "generate" if generates else "pooling"
    if runner == "generate":
        if not generates:
            raise ValueError(
                f"{config.architecture} does not generate (it has no LM head): runner "
                "'pooling' (embed, classify, score)"
            )
        if options:
            raise ValueError("pooler_config is the pooling runner's: runner 'pooling'")
        return None
    if not callable(getattr(cls, "pooled_states", None)):
        raise ValueError(f"runner 'pooling': {config.architecture} has no pooling form")
    options = dict(options or {})
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(
            f"pooler_config: unknown key {sorted(unknown)[0]!r} ({', '.join(_OPTIONS)})"
        )
    pooling = options.get("pooling_type") or _sentence_transformers_pooling(source)
    pooling = str(pooling or getattr(cls, "default_pooling", "last")).lower()
    if pooling not in POOLING_TYPES:
        raise ValueError(
            f"pooler_config: pooling_type {pooling!r} is not one of "
            f"{', '.join(t.upper() for t in POOLING_TYPES)}"
        )
    normalize = options.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    tokens = _classifier_tokens(options.get("classifier_from_token"), tokenizer)
    labels = getattr(config.family, "num_labels", 0)
    if tokens:
        labels = 1 if len(tokens) == 2 else len(tokens)
    return PoolerConfig(
        pooling_type=pooling,
        task="classify" if labels else "embed",
        num_labels=labels,
        classifier_from_tokens=tokens,
        normalize=normalize,
    )


def _sentence_transformers_pooling(source: str) -> str | None:
    """The pooling a sentence-transformers folder names (1_Pooling/config.json)."""
    path = Path(source) / "1_Pooling" / "config.json"
    if not path.is_file():
        return None
    modes = json.loads(path.read_text())
    for key, pooling in (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                         ("pooling_mode_lasttoken", "last")):  # fmt: skip
        if modes.get(key):
            return pooling
    return None


def _classifier_tokens(value: object, tokenizer: PyengineTokenizer | None) -> tuple[int, ...]:
    """classifier_from_token's tokens (each text one token of the vocabulary) as ids."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or len(value) < 2:
        raise ValueError("pooler_config: classifier_from_token must list at least 2 tokens")
    if tokenizer is None:
        raise ValueError("pooler_config: classifier_from_token needs the model's tokenizer")
    ids = []
    for text in value:
        found = tokenizer.encode(str(text), add_special_tokens=False)
        if len(found) != 1:
            raise ValueError(
                f"pooler_config: classifier_from_token {text!r} is {len(found)} tokens, not one"
            )
        ids.append(found[0])
    return tuple(ids)


def task_of(params: PoolingParams, pooler: PoolerConfig) -> str:
    """The request's task (its own, or what the model gives), checked against the model."""
    task = params.task or ("embed" if pooler.task == "embed" else "classify")
    if task == "embed" and pooler.task != "embed":
        raise ValueError("this model classifies (or scores); it does not embed")
    if task in ("classify", "score") and pooler.task != "classify":
        raise ValueError(f"this model embeds; it has no classifier to {task} with")
    if task == "score" and pooler.num_labels != 1:
        raise ValueError(
            f"this classifier has {pooler.num_labels} labels; a score takes a one-label "
            "cross-encoder"
        )
    return task


def finish_pooled(data: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> list[float]:
    """The request's output of its pooled float32 numbers: an embedding cut to its
    dimensions and normalised; a classifier's logits through a softmax (one label: a
    sigmoid), unless the request turns either off."""
    task = task_of(params, pooler)
    values = data.astype(np.float64)
    if task == "embed":
        if params.dimensions is not None:
            values = values[: params.dimensions]
        normalize = pooler.normalize if params.normalize is None else params.normalize
        if normalize:
            values = values / max(float(np.linalg.norm(values)), 1e-12)
        return values.tolist()  # type: ignore[no-any-return]
    if params.activation is False:
        return values.tolist()  # type: ignore[no-any-return]
    if len(values) == 1:
        return (1 / (1 + np.exp(-values))).tolist()  # type: ignore[no-any-return]
    shifted = np.exp(values - values.max())
    return (shifted / shifted.sum()).tolist()  # type: ignore[no-any-return]
