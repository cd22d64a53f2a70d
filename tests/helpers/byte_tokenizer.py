"""A byte-level tokenizer for tiny random models: a token for each of the 256 bytes (GPT-2's
printable stand-ins), then three specials, so that any text, JSON included, is written
in their 259 tokens; as GGUF's token list or as a Hugging Face folder's tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|eot|>", "<|user|>", "<|assistant|>"]
VOCAB = 256 + len(SPECIALS)
EOS = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, then the specials."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    extra, tokens = 0, []
    for b in range(256):
        tokens.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return tokens + SPECIALS


def write_byte_tokenizer(folder: Path) -> None:
    """tokenizer.json (byte-level BPE without merges) and tokenizer_config.json (the eos
    token and a chat template) into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(byte_tokens())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": SPECIALS[0], "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
