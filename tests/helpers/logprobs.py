"""Comparisons of two runs' greedy outputs by their logprobs."""

from __future__ import annotations


def same_context_differences(got: list, ref: list) -> list[float]:  # type: ignore[type-arg]
    """|logprob - the reference's| of its top 5, at each step whose tokens so far agree."""
    differences = []
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, ref, strict=True):
        for i, (step, ref_step) in enumerate(zip(logprobs, ref_logprobs, strict=True)):
            if tokens[:i] != ref_tokens[:i]:
                break
            differences += [
                abs(step[t].logprob - e.logprob) for t, e in ref_step.items() if t in step
            ]
    return differences
