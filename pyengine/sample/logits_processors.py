"""Logits processors: each changes a batch of logits rows in place, in the order the
sampler runs them, before a token is selected. Penalties, OpenAI's logit_bias, the
tokens blocked under min_tokens, vLLM's allowed_token_ids and bad words today; a
grammar's mask of allowed tokens is one more.

A processor looks only at its own rows' parameters, and costs nothing in a batch where
no row asks for it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pyengine.sample.common import column, token_index, token_pairs
from pyengine.sampling_params import GREEDY_BELOW_TEMPERATURE

if TYPE_CHECKING:
    from pyengine.step_values import SamplingRow


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """In place, on float32 logits [rows, vocab] (one row per SamplingRow)."""
        ...


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's semantics, in place on logits [rows, vocab]: repetition over prompt and
    output tokens (divide positive logits, multiply negative ones), frequency and presence
    over output tokens. Only the tokens the rows hold are touched, by index."""
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype

    repeated = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    counted = [
        i
        for i, row in enumerate(rows)
        if (row.params.frequency_penalty or row.params.presence_penalty) and row.output_token_ids
    ]
    outputs = {i: np.asarray(rows[i].output_token_ids, np.int64) for i in {*repeated, *counted}}
    if repeated:
        # A token seen twice is written twice, with the same value: from the logits as
        # they were, gathered before the write.
        seen = [rows[i].prompt_token_ids for i in repeated] + [outputs[i] for i in repeated]
        row, token = token_pairs(seen, vocab)
        row %= len(repeated)  # the outputs' sequences follow the prompts'
        penalty = np.array([rows[i].params.repetition_penalty for i in repeated])[row]
        r, t = torch.from_numpy(np.stack([np.asarray(repeated)[row], token])).to(device)
        factor = torch.from_numpy(penalty).to(device, dtype)
        values = logits[r, t]
        penalized = torch.where(values > 0, values / factor, values * factor)
        # A penalty far from 1 can overflow: +inf would make the row's softmax NaN. The
        # bound stays finite divided by any temperature that is not greedy.
        bound = torch.finfo(dtype).max * GREEDY_BELOW_TEMPERATURE
        logits[r, t] = penalized.clamp_(-bound, bound)
    if counted:
        row, token = token_pairs([outputs[i] for i in counted], vocab)
        pair, count = np.unique(row * vocab + token, return_counts=True)
        row, token = np.divmod(pair, vocab)
        frequency = np.array([rows[i].params.frequency_penalty for i in counted])[row]
        presence = np.array([rows[i].params.presence_penalty for i in counted])[row]
        r, t = torch.from_numpy(np.stack([np.asarray(counted)[row], token])).to(device)
        # Each (row, token) once: a plain subtraction by index.
        logits[r, t] -= torch.from_numpy(frequency * count + presence).to(device, dtype)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each row's logit_bias added to its tokens' logits (ids past the
    vocabulary, which the engine refuses, skipped), in one indexed addition from the
    arrays each request made once."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return
    vocab, device = logits.shape[-1], logits.device
    arrays = [rows[i].bias_arrays() for i in biased]
    j, token = token_pairs([tokens for tokens, _ in arrays], vocab)
    values = np.concatenate([biases for _, biases in arrays])
    if len(token) < len(values):  # (ids past the vocabulary dropped: rare)
        values = np.concatenate([b[(t >= 0) & (t < vocab)] for t, b in arrays])
    row = np.asarray(biased, np.int64)[j]
    index = torch.from_numpy(np.stack([row, token])).to(device)
    addend = torch.from_numpy(values).to(device, logits.dtype)
    logits.index_put_((index[0], index[1]), addend, accumulate=True)


def block_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each row's blocked_token_ids (EOS and stop tokens while under
    min_tokens) at -inf."""
    blocked = [i for i, r in enumerate(rows) if len(r.blocked_token_ids)]
    if not blocked:
        return
    device, vocab = logits.device, logits.shape[-1]
    j, t = token_index([rows[i].blocked_token_ids for i in blocked], vocab, device)
    logits[column(blocked, torch.long, device)[j], t] = float("-inf")


def apply_token_lists(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each row with allowed_token_ids at -inf outside them, and at -inf each
    bad word's last token where the row's tokens end with the rest of the word (a
    one-token word always)."""
    for i, row in enumerate(rows):
        allowed = row.params.allowed_token_ids
        if allowed:
            ids = torch.tensor(allowed, dtype=torch.long, device=logits.device)
            kept = logits[i, ids].clone()
            logits[i].fill_(float("-inf"))
            logits[i, ids] = kept
        words = row.params.bad_words_token_ids
        if not words:
            continue
        output = row.output_token_ids
        banned = [ids[-1] for ids in words if len(ids) == 1 or (
            len(output) >= len(ids) - 1 and list(output[len(output) - len(ids) + 1 :]) == ids[:-1]
        )]  # fmt: skip
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")


def mask_disallowed_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each structured output's row at -inf outside its allowed tokens (its
    bitmask, unpacked on the logits' device; tokens past the mask's are not allowed)."""
    apply_token_bitmasks(logits, [r.allowed_tokens for r in rows])


def apply_token_bitmasks(logits: torch.Tensor, masks: list[np.ndarray | None]) -> None:
    """In place: each row with a bitmask (int32 words, bit t % 32 of word t // 32 for
    token t) at -inf outside it (tokens past the mask's are not allowed)."""
    masked = [i for i, mask in enumerate(masks) if mask is not None]
    if not masked:
        return
    device, vocab = logits.device, logits.shape[-1]
    words = np.stack([masks[i] for i in masked])  # type: ignore[misc]
    # Each byte of the mask looks up its 8 tokens' additions (0 or -inf) in one gather:
    # a few times faster than unpacking the bits and filling by a boolean mask.
    mask_bytes = torch.from_numpy(words.view(np.uint8)).to(device).int()
    bias = torch.nn.functional.embedding(mask_bytes, _byte_bias(device, logits.dtype))
    bias = bias.view(len(masked), -1)[:, :vocab]
    if bias.shape[1] < vocab:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    if len(masked) == len(masks):
        logits.add_(bias)
        return
    index = column(masked, torch.long, device)
    logits[index] = logits[index] + bias


@functools.cache
def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for a mask byte, what each of its 8 tokens' logits gets (bit b of the
    byte, little-endian, is its b-th token): 0 where allowed, -inf where not."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return torch.from_numpy(np.where(bits == 1, 0.0, -np.inf)).to(device=device, dtype=dtype)


# The order vLLM applies them in: penalties see the model's logits, the bias and the
# blocked tokens come after, a grammar's mask last.
DEFAULT_LOGITS_PROCESSORS: tuple[LogitsProcessor, ...] = (
    apply_penalties,
    apply_logit_bias,
    block_tokens,
    apply_token_lists,
    mask_disallowed_tokens,
)
