"""GGUF files made in the test with the gguf package: every supported tensor type loads
as the gguf package dequantizes it, and a small Llama with its tokenizer and chat
template in the metadata runs, token for token as transformers on the same weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from helpers.hf_reference import hf_greedy, hf_model_from_weights  # noqa: E402
from helpers.k_quants import quantize_k, quantize_q6_k  # noqa: E402
from helpers.logprobs import same_context_differences  # noqa: E402

from pyengine import _C, LLM, SamplingParams  # noqa: E402
from pyengine.layers.rotary import inverse_frequencies  # noqa: E402
from pyengine.loader.gguf_file import GGUFError, GGUFFile  # noqa: E402
from pyengine.loader.resolve import load_model  # noqa: E402

QUANTIZABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # by the gguf package
# The types with a block form, and their bits a weight in it.
BLOCK_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 8, Q.Q5_1: 8, Q.Q5_K: 8, Q.Q6_K: 8,
              Q.Q8_0: 8, Q.Q2_K: 8, Q.Q3_K: 8}  # fmt: skip
# The tiny Llama's matrices that are not Q8_0 (K-quants need rows of 256: down's only).
OTHER_TYPES = {
    "blk.0.attn_q.weight": Q.Q5_0, "blk.0.attn_output.weight": Q.Q5_1,
    "blk.0.ffn_down.weight": Q.Q4_K, "blk.1.attn_k.weight": Q.Q4_1,
    "blk.1.ffn_up.weight": Q.Q4_0, "blk.1.ffn_down.weight": Q.Q6_K,
}  # fmt: skip
FOUR_BIT_HF = ("layers.0.mlp.down_proj", "layers.1.self_attn.k_proj", "layers.1.mlp.up_proj")
FIVE_BIT_HF = ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj")


def k_quant_blocks(qtype: Q, rows: int, rng: np.random.Generator, d: float = 0.01) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize to them), a row of 256 weights each,
    with sane f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, 256 // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    scale = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin first
        blocks[:, :, 0:2] = scale
        blocks[:, :, 2:4] = scale
    elif qtype == Q.Q2_K:  # d, dmin last
        blocks[:, :, -4:-2] = scale
        blocks[:, :, -2:] = scale
    else:  # Q3_K, Q6_K: d last
        blocks[:, :, -2:] = scale
    return raw


def quantize_any(w: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.Q6_K:
        return quantize_q6_k(w)
    if qtype in (Q.Q4_K, Q.Q5_K):
        return quantize_k(w, 4 if qtype == Q.Q4_K else 5)
    return quantize(w, qtype)


def test_every_tensor_type_loads_as_gguf_dequantizes_it(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    original = rng.standard_normal((4, 256)).astype(np.float32)
    raw_of: dict[str, tuple[np.ndarray, Q]] = {}
    writer.add_tensor("f32", original)
    writer.add_tensor("f16", original.astype(np.float16))
    for qtype in QUANTIZABLE:
        raw = quantize(original, qtype)
        raw_of[qtype.name] = (raw, qtype)
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    for qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        raw = k_quant_blocks(qtype, 4, rng)
        raw_of[qtype.name] = (raw, qtype)
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # and written from weights, by the layout
        raw = quantize_any(original, qtype)
        raw_of[qtype.name + "_written"] = (raw, qtype)
        writer.add_tensor(qtype.name + "_written", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    g = GGUFFile(tmp_path / "t.gguf")
    np.testing.assert_array_equal(g.tensor("f32"), original)
    np.testing.assert_array_equal(g.tensor("f16"), original.astype(np.float16).astype(np.float32))
    for name, (raw, qtype) in raw_of.items():
        loaded = g.tensor(name)
        assert loaded.shape == (4, 256)
        np.testing.assert_array_equal(loaded, dequantize(raw, qtype))
        assert np.isfinite(loaded).all()
        if qtype in QUANTIZABLE or name.endswith("_written"):
            assert np.abs(loaded - original).max() < 0.5  # 4 bits of a unit normal
        if qtype in BLOCK_BITS:
            # The block form that the CPU matmul keeps widens to the same float32, bit
            # for bit, but for the zeros of a negative scale (+0 for -0, which no sum
            # tells apart).
            blocks = g.block_quantized(name)
            assert blocks is not None and blocks.bits == BLOCK_BITS[qtype]
            widened = blocks.dequantize()
            np.testing.assert_array_equal(widened, loaded)
            nonzero = loaded != 0
            np.testing.assert_array_equal(
                widened[nonzero].view(np.uint32), loaded[nonzero].view(np.uint32)
            )
        else:
            assert g.block_quantized(name) is None
    assert g.block_quantized("f32") is None and g.block_quantized("f16") is None


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="empty.gguf is empty"):
        GGUFFile(empty)
    truncated = tmp_path / "y.gguf"
    truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(truncated)


def test_gguf_tensors_that_share_bytes_or_names_are_refused(tmp_path: Path) -> None:
    """As llama.cpp: each tensor's data is its own and aligned, and its name unique
    (otherwise one tensor's weights load as another's)."""

    def two_tensors(edit: str) -> Path:
        path = tmp_path / f"{edit}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tensor("a.weight", np.ones((4, 32), np.float32))
        writer.add_tensor("b.weight", np.full((4, 32), 2.0, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        parts = gguf.GGUFReader(str(path), "r+").tensors[1].field.parts  # b's info, in place
        if edit == "overlap":
            parts[-1][0] = 256  # b's data offset: inside a's 512 bytes
        elif edit == "unaligned":
            parts[-1][0] += 4
        else:
            parts[1][0] = ord("a")  # b.weight -> a.weight
        return path

    for edit, message in (
        ("overlap", "tensors a.weight and b.weight overlap"),
        ("unaligned", "tensor b.weight is not 32-byte aligned"),
        ("renamed", "tensor a.weight is in the file twice"),
    ):
        with pytest.raises(GGUFError, match=message):
            GGUFFile(two_tensors(edit))


def byte_level_vocab() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}" + (
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_llama(path)


def write_tiny_llama(
    path: Path,
    rope_freqs: np.ndarray | None = None,
    rope_scaling_type: str | None = None,
    tied: bool = False,
    other_types: dict[str, Q] = OTHER_TYPES,
) -> dict[str, np.ndarray]:
    """A two-layer Llama GGUF, mostly Q8_0 (the tensors of `other_types` of theirs); its
    weights in Hugging Face's layout. `tied`: no output.weight, the head the embedding's,
    which is Q8_0 then (its 259 rows split unevenly over the ranks of a tensor-parallel
    group). The 2- and 3-bit K-quants (which nothing here quantizes to) are random
    blocks, their weights what they dequantize to."""
    rng = np.random.default_rng(5)
    hidden, heads, kv_heads, head_size, ffn, layers = 128, 4, 2, 32, 256, 2
    tokens = byte_level_vocab() + ["<|eot|>", "<|user|>", "<|assistant|>"]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    if rope_scaling_type is not None:
        writer.add_string("llama.rope.scaling.type", rope_scaling_type)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(256)
    writer.add_chat_template(TEMPLATE)
    hf_layout: dict[str, np.ndarray] = {}

    def add(
        name: str, hf_name: str, w: np.ndarray, quantized: bool, permute_heads: int = 0
    ) -> None:
        hf_layout[hf_name] = w
        stored = permute_for_llama_cpp(w, permute_heads) if permute_heads else w
        if quantized:
            # Mostly Q8_0; some of every other block type, so that fused q/k/v and
            # gate/up mix 4 and 8 bits.
            qtype = other_types.get(name, Q.Q8_0)
            if qtype in (Q.Q2_K, Q.Q3_K):  # (an unpermuted [rows, 256] weight: down's)
                raw = k_quant_blocks(qtype, len(w), rng, d=0.002)
                hf_layout[hf_name] = dequantize(raw, qtype).reshape(w.shape)
                writer.add_tensor(name, raw, raw_dtype=qtype)
                return
            writer.add_tensor(name, quantize_any(stored, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, stored)

    normal = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)  # noqa: E731
    add("token_embd.weight", "model.embed_tokens.weight", normal(vocab, hidden), tied)
    add("output_norm.weight", "model.norm.weight", 1 + normal(hidden), False)
    if not tied:
        add("output.weight", "lm_head.weight", normal(vocab, hidden), True)
    for i in range(layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", 1 + normal(hidden), False)
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + normal(hidden), False)
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", normal(hidden, hidden), True, heads)
        add(
            p + "attn_k.weight",
            h + "self_attn.k_proj.weight",
            normal(kv_heads * head_size, hidden),
            True,
            kv_heads,
        )
        add(
            p + "attn_v.weight",
            h + "self_attn.v_proj.weight",
            normal(kv_heads * head_size, hidden),
            True,
        )
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", normal(hidden, hidden), True)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", normal(ffn, hidden), True)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", normal(ffn, hidden), True)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", normal(hidden, ffn), True)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_layout


def test_gguf_llama_weights_return_to_hugging_face_layout(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    path, hf_layout = tiny_llama
    loaded = load_model(str(path))
    assert loaded.weights is not None and set(loaded.weights) == set(hf_layout)
    for name, w in hf_layout.items():
        # Q8_0 keeps a normal weight to about 1%, 5 bits to about 5%, 4 bits to about
        # 10%; a wrong row order would be far off.
        tolerance = 0.01
        if any(name.endswith(f"{m}.weight") for m in FOUR_BIT_HF + FIVE_BIT_HF):
            tolerance = 0.1 if any(name.endswith(f"{m}.weight") for m in FOUR_BIT_HF) else 0.05
        assert (
            np.abs(loaded.weights[name].numpy() - w).max() < tolerance * np.abs(w).max() + 1e-6
        ), name
    # The matrices' block form (q/k rows back in Hugging Face order too) is the same float32.
    for name, blocks in loaded.block_quantized.items():
        np.testing.assert_array_equal(blocks.dequantize(), loaded.weights[name].numpy(), name)
    assert {name for name, b in loaded.block_quantized.items() if b.bits == 4} == {
        f"model.{m}.weight" for m in FOUR_BIT_HF
    }
    assert len(loaded.block_quantized) == 1 + 7 * 2  # the head and every layer's matrices
    # Placements that do not pack float32 weights (CUDA, 16-bit) load no block form.
    assert load_model(str(path), keep_block_quantized=False).block_quantized == {}


def test_gguf_llama_generates_as_transformers(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_llama
    loaded = load_model(str(path))
    reference = hf_model_from_weights(loaded.config, loaded.weights)
    llm = LLM(str(path), kv_cache_memory=32 * 2**20, dtype="float32")
    # Every step multiplies from the block forms: q/k/v and gate/up fused from 4- and
    # 8-bit parts (8-bit then), down Q4_K in layer 0 (4-bit) and Q6_K in layer 1 (8-bit,
    # a scale per 16 inputs).
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    assert model.layers[1].self_attn.qkv_proj.method_state.packed.dtype == torch.int8
    assert model.layers[1].mlp.gate_up_proj.method_state.packed.dtype == torch.int8
    assert model.layers[0].mlp.down_proj.method_state.packed.dtype == torch.uint8
    assert model.layers[1].mlp.down_proj.method_state.packed.dtype == torch.int8
    assert model.lm_head.method_state.packed is not None
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("héllo, wörld")) == "héllo, wörld"
    prompts = ["hello there", "a longer prompt of some more bytes"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == hf_greedy(reference, out.prompt_token_ids, 10)
    chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0]
    assert chat.prompt == "<|user|>hi\n<|assistant|>"
    assert chat.prompt_token_ids[0] == tokens_id(tokenizer, "<|user|>")


def decode_logprobs(path: Path, **engine: object) -> list[tuple[list[int], list]]:  # type: ignore[type-arg]
    """Greedy tokens and each step's top-5 logprobs of two prompts."""
    llm = LLM(str(path), kv_cache_memory=32 * 2**20, dtype="float32", **engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    try:
        result = llm.generate([[5, 6, 7, 8], list(range(30, 70))], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in result]
    finally:
        llm.llm_engine.shutdown()


def test_gguf_decode_steps_multiply_int8_rows(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """With quantized_activations="int8", a decode step's rows go to the GGUF blocks
    quantized to int8 per block (llama.cpp's arithmetic): each step's logprobs stay within
    what 8-bit activations cost of the float32 product's (the exact mode's), at every step
    whose tokens so far agree, and they are not the float32 product's."""
    path, _ = tiny_llama
    got, ref = decode_logprobs(path, quantized_activations="int8"), decode_logprobs(path)
    differences = same_context_differences(got, ref)
    assert len(differences) >= 20
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.05
    assert max(differences) > 1e-6
    with pytest.raises(ValueError, match="quantized_activations 'int4': expected one of"):
        LLM(str(path), kv_cache_memory=32 * 2**20, dtype="float32", quantized_activations="int4")


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_gguf_decode_is_the_same_in_every_build(tiny_llama, activations: str) -> None:  # type: ignore[no-untyped-def]
    """The AVX2 and portable builds of the block products (the widening, the few-row
    products in registers, the int8 rows) give the AVX-512 build's logprobs bit for bit,
    prefill and decode steps alike."""
    path, _ = tiny_llama
    builds = [isa for isa in ("avx512", "avx2", "generic") if _C.cpu_supports(isa)]
    results = []
    try:
        for isa in builds:
            _C.set_quantized_dense_isa(isa)
            results.append(decode_logprobs(path, quantized_activations=activations))
    finally:
        _C.set_quantized_dense_isa("auto")
    assert all(result == results[0] for result in results[1:])


def test_2_and_3_bit_k_quants_multiply_from_their_blocks(tmp_path: Path) -> None:
    """Q2_K and Q3_K matrices held as 8-bit blocks in groups of 16 (not float panels): the
    tokens of transformers on the same file."""
    path = tmp_path / "low-bits.gguf"
    low = {"blk.0.ffn_down.weight": Q.Q2_K, "blk.1.ffn_down.weight": Q.Q3_K}
    write_tiny_llama(path, other_types={**OTHER_TYPES, **low})
    loaded = load_model(str(path))
    reference = hf_model_from_weights(loaded.config, loaded.weights)
    llm = LLM(str(path), kv_cache_memory=32 * 2**20, dtype="float32")
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    for layer in model.layers:
        blocks = layer.mlp.down_proj.method_state.packed
        assert blocks is not None and blocks.dtype == torch.int8
    prompts = [[5, 6, 7, 8], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, got, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 10)
    llm.llm_engine.shutdown()


def test_a_tied_quantized_gguf_splits_every_way_as_one_rank(tmp_path: Path) -> None:
    """The embedding held only as the head's Q8_0 blocks, looked up there: the tokens of
    transformers, at one rank, and split over tensor-parallel ranks (uneven vocabulary
    shards) and pipeline stages (the last stage's head loads the embedding itself)."""
    path = tmp_path / "tied.gguf"
    write_tiny_llama(path, tied=True)
    loaded = load_model(str(path))
    assert loaded.config.tie_word_embeddings
    reference = hf_model_from_weights(loaded.config, loaded.weights)
    prompts = [[5, 6, 7, 8], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = dict(kv_cache_memory=32 * 2**20, max_model_len=128, dtype="float32")
    llm = LLM(str(path), **engine)
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    assert model.embed_tokens.packed is model.lm_head.method_state.packed
    assert "weight" not in model.embed_tokens._parameters
    expected = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    llm.llm_engine.shutdown()
    assert expected == [hf_greedy(reference, p, 8) for p in prompts]
    for split in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        llm = LLM(str(path), **engine, **split)
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
        llm.llm_engine.shutdown()
        assert got == expected, split


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_gguf_llama3_rope_scaling_comes_from_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp keeps Llama 3.1's rope scaling only as the tensor rope_freqs: a divisor
    of each rotary frequency. The model generates as transformers does with the scaling
    in its config (and not as without it)."""
    base = inverse_frequencies(32, 10000.0, None).double()
    scaled = inverse_frequencies(32, 10000.0, LLAMA3_ROPE).double()
    path = tmp_path / "llama3.gguf"
    write_tiny_llama(path, rope_freqs=(base / scaled).numpy())
    loaded = load_model(str(path))
    assert loaded.weights is not None and "rope_freqs.weight" not in loaded.weights
    scaled_reference, plain_reference = (
        hf_model_from_weights(replace(loaded.config, rope_scaling=rope), loaded.weights)
        for rope in (LLAMA3_ROPE, None)
    )
    llm = LLM(str(path), kv_cache_memory=32 * 2**20, dtype="float32")
    prompt = llm.get_tokenizer().encode("a prompt long enough for the low frequencies to turn")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == hf_greedy(scaled_reference, prompt, 12)
    assert got.outputs[0].token_ids != hf_greedy(plain_reference, prompt, 12)


def test_gguf_rope_freqs_of_the_wrong_size_and_other_scalings_are_refused(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "short.gguf", rope_freqs=np.ones(7))
    with pytest.raises(ValueError, match="rope_freqs has 7 divisors; head size 32 needs 16"):
        LLM(str(tmp_path / "short.gguf"), kv_cache_memory=32 * 2**20, dtype="float32")
    write_tiny_llama(tmp_path / "longrope.gguf", rope_scaling_type="longrope")
    with pytest.raises(GGUFError, match="rope scaling 'longrope' is not supported"):
        load_model(str(tmp_path / "longrope.gguf"))
    # (YaRN is read, DeepSeek's: tests/models/test_deepseek_gguf.py; its factor is needed)
    write_tiny_llama(tmp_path / "yarn.gguf", rope_scaling_type="yarn")
    with pytest.raises(GGUFError, match="metadata 'llama.rope.scaling.factor' is missing"):
        load_model(str(tmp_path / "yarn.gguf"))


def tokens_id(tokenizer, token: str) -> int:  # type: ignore[no-untyped-def]
    return int(tokenizer.tokenizer.token_to_id(token))
