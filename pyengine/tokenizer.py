"""Tokenizers (Hugging Face `tokenizers`) from a model folder or a GGUF file's metadata,
with the chat template rendered by jinja2 as transformers does."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

Message = dict[str, Any]

# Pre-tokenizer split patterns of llama.cpp's BPE pre-tokenizer types.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


class PyengineTokenizer:
    """encode / decode / chat template over a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_id: int | None,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_unicode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A text pair's ids with the tokenizer's special tokens around and between them,
        and each token's type (1 in the second text, for tokenizers that say so)."""
        _check_unicode(first)
        _check_unicode(second)
        encoding = self.tokenizer.encode(first, second, add_special_tokens=True)
        return list(encoding.ids), list(encoding.type_ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, whole: a token that holds part of a character
        (one of an emoji's) decodes to U+FFFD, but its bytes join up with its neighbours'
        (OpenAI's logprobs "bytes")."""
        piece = self.tokenizer.id_to_token(token_id) or ""
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # SentencePiece's byte fallback
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker

    @functools.cached_property
    def _byte_level(self) -> bool:
        return "ByteLevel" in type(self.tokenizer.decoder).__name__ or "ByteLevel" in str(
            self.tokenizer.decoder
        )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """More characters than any token covers (twice the longest token's string: a
        byte-level token's string has a character a byte), so that a text longer than n
        times this has more than n tokens, known without tokenizing it."""
        return 2 * max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(token_id) or "")

    def apply_chat_template(
        self,
        messages: list[Message],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "this model's tokenizer has no chat template; pass chat_template=... to chat()"
            )
        messages = [_template_message(i, message) for i, message in enumerate(messages)]
        reserved = sorted(extra.keys() & {"messages", "add_generation_prompt", "bos_token",
                                          "eos_token"})  # fmt: skip
        if reserved:
            raise ValueError(f"chat template variables {reserved} are set by the engine")
        return _render(
            template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token(self.bos_token_id),
            eos_token=self._token(self.eos_token_id),
            **extra,
        )


def _check_unicode(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # half of a UTF-16 pair, as a cut JavaScript string has
            raise ValueError("the text is not valid Unicode (an unpaired surrogate)") from None


def _template_message(i: int, message: Any) -> Message:
    """A message as chat templates take it: content one string (OpenAI's text parts
    joined, None as empty)."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"messages[{i}] must be a dict with a 'role' (and 'content')")
    content = message.get("content")
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(f"messages[{i}]: only text content parts are supported")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ValueError(f"messages[{i}]: content must be a string or a list of text parts")
    return {**message, "content": content}


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's characters for the 256 bytes (GPT-2's table), reversed: printable
    bytes stand for themselves, the others for 256 and up, in order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = (b for b in range(256) if b not in printable)
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(extra)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()


def _render(template: str, **variables: Any) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(**variables)
    except TemplateError as error:
        raise ValueError(f"the chat template failed: {error}") from error
    except Exception as error:  # a template is a program: whatever it does wrong
        raise ValueError(f"the chat template failed: {type(error).__name__}: {error}") from error


def tokenizer_from_folder(folder: Path) -> PyengineTokenizer:
    """tokenizer.json (+ tokenizer_config.json for the chat template and special tokens)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
    with _named_errors(folder):
        return _tokenizer_from_folder(folder, path)


def tokenizer_from_gguf(fields: dict[str, Any], source: str) -> PyengineTokenizer:
    """A byte-level BPE tokenizer from GGUF metadata (tokenizer.ggml.*)."""
    with _named_errors(source):
        return _tokenizer_from_gguf(fields, source)


@contextmanager
def _named_errors(source: str | Path) -> Iterator[None]:
    """A tokenizer's files are input like any other: whatever in them breaks loading is a
    ValueError that names where it came from."""
    try:
        yield
    except Exception as error:  # tokenizers raises plain Exceptions for bad files
        if isinstance(error, ValueError) and str(source) in str(error):
            raise  # named already
        raise ValueError(f"{source}: the tokenizer: {type(error).__name__}: {error}") from error


def _tokenizer_from_folder(folder: Path, path: Path) -> PyengineTokenizer:
    tokenizer = Tokenizer.from_file(str(path))
    config: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{folder / 'tokenizer_config.json'} must hold an object")
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def token_id(key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else tokenizer.token_to_id(token)

    return PyengineTokenizer(tokenizer, token_id("eos_token"), token_id("bos_token"), template)


def _tokenizer_from_gguf(fields: dict[str, Any], source: str) -> PyengineTokenizer:
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE, "
            "'gpt2', is); pass tokenizer=<a Hugging Face folder> instead"
        )
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    pre = fields.get("tokenizer.ggml.pre", "gpt2")
    if pre in ("llama-bpe", "llama3", "qwen2", "deepseek-llm"):
        pattern = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:  # gpt2, smollm and the like
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type")
    special = [] if types is None else [i for i, t in enumerate(types) if int(t) in (3, 4)]
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in special]
    )
    bos = fields.get("tokenizer.ggml.bos_token_id")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    if bos is not None and bool(fields.get("tokenizer.ggml.add_bos_token", False)):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return PyengineTokenizer(
        tokenizer,
        None if eos is None else int(eos),
        None if bos is None else int(bos),
        fields.get("tokenizer.chat_template"),
    )
