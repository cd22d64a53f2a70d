"""Tiny random pooling checkpoints made by transformers in the test: BERT and XLM-R
encoders (embedders and cross-encoders) and a Qwen3 decoder (an embedder by its last
token, or a reranker by its "no" and "yes" logits), each with a word-level tokenizer
whose pairs are [CLS] a [SEP] b [SEP], the second text's tokens of type 1."""

from __future__ import annotations

import json
from pathlib import Path

import torch

try:
    import transformers
except ImportError:  # the tests skip on their own importorskip
    transformers = None

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "no", "yes"]
WORDS = [f"w{i}" for i in range(90)]
VOCAB = len(SPECIALS) + len(WORDS)  # 96
CLS, SEP = 2, 3
NO, YES = 4, 5

_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128}  # fmt: skip


def _configs() -> dict[str, object]:
    bert = {**_SHAPE, "vocab_size": VOCAB, "max_position_embeddings": 64}
    # (RoBERTa's positions start at padding_idx + 1: 64 tokens need 66 rows)
    roberta = {
        **_SHAPE,
        "vocab_size": VOCAB,
        "max_position_embeddings": 66,
        "pad_token_id": 1,
        "type_vocab_size": 1,
    }  # (as XLM-R's: one token type)
    qwen = {**_SHAPE, "vocab_size": VOCAB, "max_position_embeddings": 128,
            "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
    return {
        "bert": (transformers.BertModel, transformers.BertConfig(**bert)),
        "bert-cross": (
            transformers.BertForSequenceClassification,
            transformers.BertConfig(**bert, num_labels=1),
        ),  # fmt: skip
        "bert-classify": (
            transformers.BertForSequenceClassification,
            transformers.BertConfig(**bert, num_labels=3),
        ),  # fmt: skip
        "xlm-roberta": (transformers.XLMRobertaModel, transformers.XLMRobertaConfig(**roberta)),
        "xlm-roberta-cross": (
            transformers.XLMRobertaForSequenceClassification,
            transformers.XLMRobertaConfig(**roberta, num_labels=1),
        ),  # fmt: skip
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**qwen)),
        "qwen3-cross": (
            transformers.Qwen3ForSequenceClassification,
            transformers.Qwen3Config(**qwen, num_labels=1, pad_token_id=0),
        ),  # fmt: skip
    }


KINDS = ("bert", "bert-cross", "bert-classify", "xlm-roberta", "xlm-roberta-cross", "qwen3",
         "qwen3-cross")  # fmt: skip


def make_pooling_checkpoint(kind: str, folder: Path) -> torch.nn.Module:
    """A random float32 checkpoint (norms and biases random too) and its tokenizer, saved
    to folder; the transformers model."""
    torch.manual_seed(0)
    cls, config = _configs()[kind]
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name.lower() and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    write_word_tokenizer(folder)
    return model


def write_word_tokenizer(folder: Path) -> None:
    """A word-level tokenizer.json: words w0..w89 split at spaces, BERT's pair template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)],
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[SEP]"}))


def words(ids: list[int]) -> str:
    """The text of word ids (each in [6, 96))."""
    return " ".join(f"w{i - len(SPECIALS)}" for i in ids)
