"""The compiled grammars' cache: least recently used first out, bounded in the bytes of
its texts and matchers (unique schemas, one a request, would otherwise grow it for
ever); a request's matcher a copy of its grammar's start; a schema nested too deeply
refused by name."""

from __future__ import annotations

import pytest

from pyengine.engine.structured_output import GrammarCompiler
from pyengine.loader.resolve import DEFAULT_MODEL, load_model
from pyengine.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_model(DEFAULT_MODEL, read_weights=False).tokenizer


def schema(k: int, fields: int = 50) -> StructuredOutputsParams:
    props = {f"f{k}_{j}": {"type": "string"} for j in range(fields)}
    return StructuredOutputsParams(json={"type": "object", "properties": props})


def test_the_cache_keeps_the_recently_used_within_its_bytes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    compiler.grammar(schema(0))
    one = compiler.cached_bytes
    compiler.max_cached_bytes = 3 * one + one // 2  # room for three such grammars
    for k in range(1, 10):
        compiler.grammar(schema(k))
        compiler.grammar(schema(1))  # (used again and again: kept)
    assert compiler.cached_bytes <= compiler.max_cached_bytes
    kept = set(compiler._grammars)
    assert schema(1).constraint() in kept and schema(9).constraint() in kept
    assert schema(2).constraint() not in kept and len(kept) == 3


def test_matchers_are_copies_of_the_start_of_one_compile(tokenizer) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    constraint = schema(0)
    first, second = compiler.matcher(constraint), compiler.matcher(constraint)
    assert first.llg is not second.llg and len(compiler._grammars) == 1
    assert (first.allowed() == second.allowed()).all()
    token = int(next(t for t in range(tokenizer.vocab_size) if first.allows(t)))
    first.llg.consume_token(token)  # (one request's place: the other's is its own)
    assert (second.allowed() == compiler.matcher(constraint).allowed()).all()
    compiler.forget_grammars()
    assert compiler.cached_bytes == 0 and not compiler._grammars


def test_a_schema_nested_too_deeply_is_refused_by_name(tokenizer) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    text = '{"type": "array", "items": ' * 5000 + '{"type": "object"}' + "}" * 5000
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        compiler.grammar(StructuredOutputsParams(json=text))
