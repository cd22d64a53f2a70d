"""Beam search (LLM.beam_search) on a tiny random Llama that transformers makes in the
test: the beams and their length-normalised scores are transformers'
generate(num_beams=...)'s, for several prompts at once and two length penalties; a beam
that writes EOS ends there; bad parameters are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_checkpoint

from pyengine import LLM, BeamSearchParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 40))]
ENGINE = dict(max_model_len=128, kv_cache_memory=16 * 2**20, dtype="float32")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("beam-llama")
    return folder, make_checkpoint("llama", folder)


def hf_beams(model: torch.nn.Module, prompt: list[int], width: int, new: int,
             penalty: float) -> list[tuple[list[int], float]]:  # fmt: skip
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0,
            length_penalty=penalty, early_stopping=False, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return [(seq[len(prompt) :].tolist(), float(score))
            for seq, score in zip(out.sequences, out.sequences_scores, strict=True)]  # fmt: skip


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_beams_and_scores_are_transformers(llama, penalty: float) -> None:  # type: ignore[no-untyped-def]
    folder, model = llama
    llm = LLM(str(folder), **ENGINE)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want = hf_beams(model, prompt, 3, 8, penalty)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in want]
        for got, (_, score) in zip(output.sequences, want, strict=True):
            assert got.score == pytest.approx(score, abs=1e-4)


def test_a_beam_that_writes_eos_ends(llama) -> None:  # type: ignore[no-untyped-def]
    folder, _ = llama
    llm = LLM(str(folder), **ENGINE)
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    free = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)
    eos = free[0].sequences[0].tokens[2]  # (the best beam's third token as EOS)
    llm.llm_engine.model_config.eos_token_ids = (eos,)  # type: ignore[misc]
    # (no length penalty: the ended beam, fewer logprobs summed, ranks first)
    params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.0)
    (ended,) = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)
    best = ended.sequences[0]
    assert best.tokens == free[0].sequences[0].tokens[:3] and best.tokens[-1] == eos


@pytest.mark.parametrize("fields", [{"beam_width": 0}, {"max_tokens": 0},
                                    {"length_penalty": "long"}])  # fmt: skip
def test_bad_parameters_are_named(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})  # type: ignore[arg-type]
