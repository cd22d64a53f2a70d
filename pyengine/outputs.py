"""What generate() returns and the engine's steps hand out (vLLM's RequestOutput /
CompletionOutput). What an output holds is what its request's params.output_kind asked
for: all so far, or (RequestOutputKind.DELTA) what one step added."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# Per position: token id -> its logprob (the chosen token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample's output: all of it so far, or in a delta what the step added (its new
    text, tokens and logprobs; cumulative_logprob is always the running total)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    # One position per token (the engine's: a FlatLogprobs, which reads as this list)
    logprobs: Sequence[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding, over the request's samples: draft tokens its steps verified,
    # and of them those accepted (vLLM's spec_decode_* counts, per request).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Set as the request finishes, for /metrics (a delta holds only its step's tokens):
    # each sample's finish reason and number of output tokens.
    finish_reasons: list[str] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A request's output: its samples' (in a delta, those with something new), and the
    prompt's logprobs (in a delta, only in the request's first)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0  # of num_cached_tokens, those the KV host tier held


@dataclass
class PoolingOutput:
    """What a pooling model made of one prompt: an embedding, a classifier's
    probabilities (or logits, without activation), or a score. `embedding`, `probs`
    and `score` read it as vLLM's EmbeddingOutput, ClassificationOutput and
    ScoringOutput do."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def probs(self) -> list[float]:
        return self.data

    @property
    def score(self) -> float:
        return self.data[0]


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output, once its prompt has run (what LLM.embed,
    LLM.classify and LLM.score return)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    prompt: str | None = None


# What an engine step hands out for a request: a generating request's output, or a
# pooling request's.
EngineOutput = RequestOutput | PoolingRequestOutput
