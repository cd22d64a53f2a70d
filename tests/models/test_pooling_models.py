"""Pooling models (runner "pooling") against transformers on tiny random checkpoints
made in the test: BERT and XLM-R embeddings by [CLS] and by the mean, their
cross-encoders' scores and a classifier's probabilities (pairs with their token types),
a Qwen3 decoder's last-token embedding and its yes/no reranker score; batches of mixed
lengths give what one prompt at a time gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.tiny_pooling import (
    CLS,
    NO,
    SEP,
    YES,
    make_pooling_checkpoint,
    words,
)

from pyengine import LLM
from pyengine.pooling_params import PoolingParams

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
LENGTHS = (1, 7, 30, 62)  # (with [CLS] and [SEP]: up to 64, the encoders' max_model_len)


def _llm(folder: Path, **kwargs: object) -> LLM:
    return LLM(str(folder), dtype="float32", kv_cache_memory=2**24, **kwargs)


def _word_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[CLS, *rng.integers(6, 96, n).tolist(), SEP] for n in LENGTHS]


def _hidden(model: torch.nn.Module, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    """transformers' final hidden states [tokens, hidden] (a decoder's after its norm)."""
    base = getattr(model, "model", model)
    kwargs = {} if types is None else {"token_type_ids": torch.tensor([types])}
    with torch.inference_mode():
        return base(torch.tensor([ids]), **kwargs).last_hidden_state[0]


def _logits(model: torch.nn.Module, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    kwargs = {} if types is None else {"token_type_ids": torch.tensor([types])}
    with torch.inference_mode():
        return model(torch.tensor([ids]), **kwargs).logits[0]


def _normalized(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


def _close(ours: list[float], theirs: torch.Tensor) -> None:
    error = (torch.tensor(ours, dtype=torch.float64) - theirs.double()).abs().max().item()
    assert error < TOLERANCE, error


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):  # type: ignore[no-untyped-def]
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            made[kind] = folder, make_pooling_checkpoint(kind, folder)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_encoder_embeddings_match_transformers(checkpoints, kind: str, pooling: str) -> None:  # type: ignore[no-untyped-def]
    folder, model = checkpoints(kind)
    llm = _llm(folder, pooler_config={"pooling_type": pooling}, max_num_seqs=3)
    prompts = _word_prompts(1)
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        hidden = _hidden(model, prompt)
        pooled = hidden[0] if pooling == "CLS" else hidden.mean(0)
        _close(out.outputs.embedding, _normalized(pooled))
        assert out.prompt_token_ids == prompt
    # One at a time, the same numbers as in the batch of mixed lengths.
    alone = [llm.embed({"prompt_token_ids": p}, use_tqdm=False)[0] for p in prompts]
    for a, b in zip(alone, outputs, strict=True):
        assert np.abs(np.subtract(a.outputs.embedding, b.outputs.embedding)).max() < 1e-6


def test_an_embedding_cut_to_its_dimensions_and_not_normalized(checkpoints) -> None:  # type: ignore[no-untyped-def]
    folder, model = checkpoints("bert")
    llm = _llm(folder)
    prompt = _word_prompts(2)[2]
    cls = _hidden(model, prompt)[0]
    raw = llm.embed({"prompt_token_ids": prompt}, PoolingParams(normalize=False), use_tqdm=False)
    _close(raw[0].outputs.embedding, cls)
    cut = llm.embed({"prompt_token_ids": prompt}, PoolingParams(dimensions=16), use_tqdm=False)
    _close(cut[0].outputs.embedding, _normalized(cls[:16]))
    with pytest.raises(ValueError, match="dimensions 65 is more than the model's embedding"):
        llm.embed({"prompt_token_ids": prompt}, PoolingParams(dimensions=65), use_tqdm=False)


@pytest.mark.parametrize("kind", ["bert-cross", "xlm-roberta-cross"])
def test_cross_encoder_scores_pairs_as_transformers(checkpoints, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Pairs are read at once, the second text of token type 1 (BERT's): the score is
    the sigmoid of the one logit."""
    folder, model = checkpoints(kind)
    llm = _llm(folder)
    rng = np.random.default_rng(3)
    query = rng.integers(6, 96, 5).tolist()
    documents = [rng.integers(6, 96, n).tolist() for n in (3, 20, 40)]
    outputs = llm.score(words(query), [words(d) for d in documents], use_tqdm=False)
    for document, out in zip(documents, outputs, strict=True):
        ids = [CLS, *query, SEP, *document, SEP]
        types = [0] * (len(query) + 2) + [1] * (len(document) + 1)
        assert out.prompt_token_ids == ids
        theirs = torch.sigmoid(_logits(model, ids, types if "xlm" not in kind else None))
        _close([out.outputs.score], theirs)
    # The types matter: the same ids all of type 0 score otherwise.
    if kind == "bert-cross":
        flat = torch.sigmoid(_logits(model, ids, [0] * len(ids)))
        assert abs(outputs[-1].outputs.score - flat.item()) > 1e-4


def test_classifier_probabilities(checkpoints) -> None:  # type: ignore[no-untyped-def]
    folder, model = checkpoints("bert-classify")
    llm = _llm(folder)
    prompts = _word_prompts(4)
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        _close(out.outputs.probs, torch.softmax(_logits(model, prompt), -1))
    logits = llm.classify(
        {"prompt_token_ids": prompts[0]}, PoolingParams(activation=False), use_tqdm=False
    )
    _close(logits[0].outputs.probs, _logits(model, prompts[0]))
    with pytest.raises(ValueError, match="3 labels; a score takes a one-label"):
        llm.score("w1", "w2", use_tqdm=False)


def test_decoder_last_token_embeddings_and_cosine_scores(checkpoints) -> None:  # type: ignore[no-untyped-def]
    folder, model = checkpoints("qwen3")
    llm = _llm(folder, runner="pooling", max_num_seqs=2)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(6, 96, n).tolist() for n in (1, 9, 70, 128)]  # (128: all of it)
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        _close(out.outputs.embedding, _normalized(_hidden(model, prompt)[-1]))
    # An embedder scores a pair by the cosine of its two embeddings.
    scores = llm.score("w1 w2", ["w1 w2", "w7 w9 w30"], use_tqdm=False)
    a, b, c = (torch.tensor(e.outputs.embedding) for e in llm.embed(
        ["w1 w2", "w1 w2", "w7 w9 w30"], use_tqdm=False))  # fmt: skip
    assert abs(scores[0].outputs.score - 1.0) < 1e-6
    assert abs(scores[1].outputs.score - torch.dot(a, c).item()) < 1e-6
    assert torch.allclose(a, b)


def test_decoder_cross_encoder_scores_its_last_token(checkpoints) -> None:  # type: ignore[no-untyped-def]
    """Qwen3ForSequenceClassification: `score` on the pair's last token, normed."""
    folder, model = checkpoints("qwen3-cross")
    llm = _llm(folder)  # (runner "auto": a classifier pools)
    documents = ["w5", "w6 w7 w8 w9", "w1 " * 30]
    outputs = llm.score("w3 w4", documents, use_tqdm=False)
    for document, out in zip(documents, outputs, strict=True):
        ids = llm.get_tokenizer().encode_pair("w3 w4", document)[0]
        _close([out.outputs.score], torch.sigmoid(_logits(model, ids))[0])
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification does not generate"):
        _llm(folder, runner="generate")


def test_a_base_model_checkpoint_embeds(checkpoints, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Qwen3-Embedding's files: the base model's tensors, without the "model." prefix
    and the LM head, under a causal LM's config."""
    _, model = checkpoints("qwen3")
    model.model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompt = list(range(6, 40))
    out = _llm(tmp_path, runner="pooling").embed({"prompt_token_ids": prompt}, use_tqdm=False)
    _close(out[0].outputs.embedding, _normalized(_hidden(model, prompt)[-1]))


def test_decoder_reranker_by_yes_and_no_logits(checkpoints) -> None:  # type: ignore[no-untyped-def]
    """Qwen3-Reranker's form: the score is softmax(no, yes)'s yes at the pair's last
    token (its LM head's two logits)."""
    folder, model = checkpoints("qwen3")
    llm = _llm(folder, runner="pooling",
               pooler_config={"classifier_from_token": ["no", "yes"]})  # fmt: skip
    outputs = llm.score("w3 w4", ["w5", "w6 w7 w8 w9"], use_tqdm=False)
    for document, out in zip(["w5", "w6 w7 w8 w9"], outputs, strict=True):
        ids = llm.get_tokenizer().encode_pair("w3 w4", document)[0]
        logits = _logits(model, ids)[-1]
        _close([out.outputs.score], torch.softmax(logits[[NO, YES]], -1)[1])


def test_pooling_engines_refuse_what_they_do_not_do(checkpoints) -> None:  # type: ignore[no-untyped-def]
    folder, _ = checkpoints("bert")
    llm = _llm(folder)
    with pytest.raises(ValueError, match="generates no text"):
        llm.generate("w1 w2", use_tqdm=False)
    with pytest.raises(ValueError, match="it has no classifier to classify"):
        llm.classify("w1", use_tqdm=False)
    with pytest.raises(ValueError, match="the prompt has 65 tokens; max_model_len is 64"):
        llm.embed({"prompt_token_ids": [7] * 65}, use_tqdm=False)
    with pytest.raises(ValueError, match="BertModel does not generate"):
        _llm(folder, runner="generate")
    with pytest.raises(ValueError, match="pooling_type 'max' is not one of"):
        _llm(folder, pooler_config={"pooling_type": "max"})
    assert not llm.llm_engine.has_unfinished_requests()
    truncated = llm.embed(
        {"prompt_token_ids": [7] * 65}, PoolingParams(truncate_prompt_tokens=64), use_tqdm=False
    )
    assert len(truncated[0].prompt_token_ids) == 64


def test_a_generating_engine_refuses_pooling_requests(checkpoints) -> None:  # type: ignore[no-untyped-def]
    folder, _ = checkpoints("qwen3")
    llm = _llm(folder)
    with pytest.raises(ValueError, match="need the pooling runner"):
        llm.embed("w1", use_tqdm=False)
    with pytest.raises(ValueError, match="pooler_config is the pooling runner's"):
        _llm(folder, pooler_config={"pooling_type": "MEAN"})
