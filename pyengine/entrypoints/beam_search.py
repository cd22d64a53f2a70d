"""Beam search (vLLM's `LLM.beam_search` and `BeamSearchParams`): each step runs every
live beam of every prompt for one token with its top 2 x beam_width logprobs, in one
batch; each prompt keeps the beam_width most likely extensions of its beams (by their
summed logprobs), and a beam that writes EOS is done. The beams' shared prefixes come
from the prefix cache (their blocks shared, copied on write), so that a step costs the
new tokens, not the beams' whole sequences. At the end, each prompt's finished and live
beams are ranked by their summed logprobs over their length to the power
length_penalty (transformers' score)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pyengine.outputs import PositionLogprobs
from pyengine.sampling_params import SamplingParams, is_int, is_real


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            ("beam_width", is_int(self.beam_width) and self.beam_width >= 1, "an integer >= 1"),
            ("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("length_penalty", is_real(self.length_penalty), "a number"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(
                    f"BeamSearchParams.{name} must be {expected}, got {getattr(self, name)!r}"
                )


@dataclass
class BeamSearchSequence:
    """A beam: its generated tokens, their summed logprob, its text once done."""

    tokens: list[int]
    cum_logprob: float = 0.0
    finished: bool = False
    text: str | None = None
    score: float = field(default=0.0)


@dataclass
class BeamSearchOutput:
    """A prompt's best beam_width sequences, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The search as steps its caller runs: `step_prompts` (every live beam's tokens,
    each prompt's in turn) run with `step_params`, their outputs to `advance`, until
    `done`; then `results`. LLM.beam_search drives it with the offline engine, the
    server's completions (use_beam_search) with the async one."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams,
                 eos_token_id: int | None) -> None:  # fmt: skip
        self.prompts, self.params, self.eos = list(prompts), params, eos_token_id
        width = params.beam_width
        self.step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width,
                                          ignore_eos=True)  # fmt: skip
        self.beams = [[BeamSearchSequence([])] for _ in self.prompts]
        self.ended: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.beams)

    def step_prompts(self) -> list[list[int]]:
        return [[*self.prompts[p], *b.tokens] for p, group in enumerate(self.beams)
                for b in group]  # fmt: skip

    def advance(self, positions: Sequence[PositionLogprobs]) -> None:
        """The step's logprobs of each live beam's next token, in step_prompts' order:
        each prompt keeps its beam_width most likely extensions, those that wrote EOS
        ended."""
        live = [(p, b) for p, group in enumerate(self.beams) for b in group]
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (p, beam), position in zip(live, positions, strict=True):
            for token, logprob in position.items():
                ends = token == self.eos and not self.params.ignore_eos
                candidates[p].append(BeamSearchSequence(
                    [*beam.tokens, token], beam.cum_logprob + logprob.logprob, ends,
                ))  # fmt: skip
        for p, found in enumerate(candidates):
            found.sort(key=lambda b: b.cum_logprob, reverse=True)
            kept = found[: self.params.beam_width]
            self.ended[p] += [b for b in kept if b.finished]
            self.beams[p] = [b for b in kept if not b.finished]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width beams, ended or not, by their summed logprobs
        over their length (EOS not counted) to the power length_penalty."""
        results = []
        for p in range(len(self.prompts)):
            ranked = [*self.ended[p], *self.beams[p]]
            for beam in ranked:
                length = len(beam.tokens) - (1 if beam.finished else 0) or 1
                beam.score = beam.cum_logprob / length**self.params.length_penalty
                beam.text = decode(beam.tokens)
            ranked.sort(key=lambda b: b.score, reverse=True)
            results.append(BeamSearchOutput(ranked[: self.params.beam_width]))
        return results
