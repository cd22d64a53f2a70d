"""Qwen3-MoE, Qwen2-MoE and Mixtral GGUF files (llama.cpp's qwen3moe, qwen2moe, and llama
with experts: every expert of a layer in a tensor per part; Qwen2-MoE's q/k/v biases and
gated shared expert too, Mixtral's q/k rows in llama.cpp's rope order)
written in the test by the gguf package from tiny random transformers models, their
experts Q8_0 and Q4_0: the experts multiply from their blocks, token for token as
transformers on the dequantized weights (float32 activations), at one rank and over two
(the blocks of each rank's slices), and with llama.cpp's int8 activations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from helpers.byte_tokenizer import byte_tokens  # noqa: E402
from helpers.hf_reference import hf_greedy  # noqa: E402

from pyengine import LLM, SamplingParams  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, SIZE, LAYERS = 64, 4, 2, 32, 8, 2, 64, 2
EXPERT_TYPES = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0}
VOCAB = 259  # bytes and three specials


SHAPE = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=SIZE,
    num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
    max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0,
    rms_norm_eps=1e-6,
)  # fmt: skip
_QWEN_ONLY = ("intermediate_size", "moe_intermediate_size", "num_experts")
MIXTRAL_SHAPE = {key: value for key, value in SHAPE.items() if key not in _QWEN_ONLY}
CONFIGS = {
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, norm_topk_prob=True),
    # (llama.cpp's llama with experts; its experts feed_forward_length wide)
    "mixtral": lambda: transformers.MixtralConfig(
        **MIXTRAL_SHAPE, intermediate_size=SIZE, num_local_experts=EXPERTS
    ),
    # (llama.cpp's qwen2moe does not renormalise; nor does this config)
    "qwen2moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE, norm_topk_prob=False, shared_expert_intermediate_size=96, qkv_bias=True
    ),
}
# Each architecture's tensors beside the experts: llama.cpp's name, transformers'.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
    "ffn_gate_inp": "mlp.gate.weight",
}  # fmt: skip
ARCH_TENSORS = {
    "mixtral": {},
    "qwen3moe": {
        "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
    },
    "qwen2moe": {
        "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp": "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",  # ([hidden] in the file)
    },
}  # fmt: skip


def write_moe_gguf(path: Path, arch: str) -> torch.nn.Module:
    """The file, and transformers' model on the weights it dequantizes to."""
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    mixtral = arch == "mixtral"
    writer = gguf.GGUFWriter(str(path), "llama" if mixtral else arch)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(96)
    if not mixtral:
        writer.add_expert_feed_forward_length(SIZE)
    for add, value in (
        (writer.add_block_count, LAYERS), (writer.add_context_length, 256),
        (writer.add_embedding_length, HIDDEN),
        (writer.add_feed_forward_length, SIZE if mixtral else 96),
        (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
        (writer.add_key_length, HEAD_DIM), (writer.add_value_length, HEAD_DIM),
        (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_expert_count, EXPERTS), (writer.add_expert_used_count, TOP_K),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_token_list, byte_tokens()), (writer.add_token_types, [1] * 256 + [3] * 3),
        (writer.add_token_merges, []), (writer.add_eos_token_id, 256),
    ):  # fmt: skip
        add(value)
    params = dict(model.named_parameters())

    def tensor(name: str, hf: str) -> None:
        """A float32 tensor: random norms near 1, random matrices."""
        norm = "norm" in hf and "bias" not in hf
        values = (1 if norm else 0) + torch.randn(params[hf].shape) * (0.1 if norm else 0.08)
        stored = values.numpy()
        if "gate_inp_shexp" in name:  # (llama.cpp's [hidden]; transformers' [1, hidden])
            stored = stored.reshape(-1)
        if mixtral and (".attn_q." in name or ".attn_k." in name):  # (llama.cpp's rope order)
            heads = HEADS if ".attn_q." in name else KV_HEADS
            stored = stored.reshape(heads, 2, -1, HIDDEN).swapaxes(1, 2).reshape(stored.shape)
        writer.add_tensor(name, stored)
        with torch.no_grad():
            params[hf].copy_(values)

    tensor("token_embd.weight", "model.embed_tokens.weight")
    tensor("output.weight", "lm_head.weight")
    tensor("output_norm.weight", "model.norm.weight")
    for i in range(LAYERS):
        for name, hf in {**LAYER_TENSORS, **ARCH_TENSORS[arch]}.items():
            suffix = "" if "." in name else ".weight"
            tensor(f"blk.{i}.{name}{suffix}", f"model.layers.{i}.{hf}")
        # transformers holds [gate; up] as one [experts, 2 * size, hidden] tensor
        gate_up = params[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        parts = {"ffn_gate_exps": gate_up[:, :SIZE], "ffn_up_exps": gate_up[:, SIZE:],
                 "ffn_down_exps": params[f"model.layers.{i}.mlp.experts.down_proj"]}  # fmt: skip
        for name, into in parts.items():
            blocks = quantize((torch.randn(into.shape) * 0.08).numpy(), EXPERT_TYPES[name])
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=EXPERT_TYPES[name])
            values = dequantize(blocks, EXPERT_TYPES[name]).reshape(into.shape)
            with torch.no_grad():
                into.copy_(torch.from_numpy(values.copy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    return path, write_moe_gguf(path, request.param)


PROMPTS = [list(range(40, 90)), [5, 6, 7], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def generate(path: Path, **engine: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), max_model_len=256, kv_cache_memory=32 * 2**20, **engine)  # type: ignore[arg-type]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm


def test_the_experts_multiply_from_their_blocks_as_transformers(moe_gguf) -> None:  # type: ignore[no-untyped-def]
    path, model = moe_gguf
    tokens, llm = generate(path, dtype="float32")
    runner = llm.llm_engine.executor.driver_worker.model_runner
    experts = runner.model.layers[0].mlp
    # [gate; up] of Q8_0 and Q4_0 blocks stacked as 8 bits; every expert packed.
    assert experts.weight_form() == "8-bit blocks experts"
    assert experts.method_state.gate_up.dtype == torch.int8
    assert experts.method_state.gate_up.shape[0] == EXPERTS
    assert not hasattr(experts, "gate_up")  # (no float copy of the experts was made)
    assert runner.graphs is not None  # (decode steps recorded)
    assert tokens == [hf_greedy(model, p, 10) for p in PROMPTS]


def test_two_ranks_read_their_slices_of_the_blocks(moe_gguf) -> None:  # type: ignore[no-untyped-def]
    path, _ = moe_gguf
    expected, _ = generate(path, dtype="float32")
    for expert_parallel in (False, True):  # (experts of 64 split into 32s, or 4 each)
        got, llm = generate(path, dtype="float32", tensor_parallel_size=2,
                            enable_expert_parallel=expert_parallel)  # fmt: skip
        llm.llm_engine.shutdown()
        assert got == expected, f"expert parallel: {expert_parallel}"


def test_int8_activations_multiply_the_blocks_as_llama_cpp(moe_gguf) -> None:  # type: ignore[no-untyped-def]
    """Rows quantized to 8 bits per block of 32 (llama.cpp's arithmetic): close to the
    float32 product, not equal to it."""
    path, model = moe_gguf
    tokens, _ = generate(path, dtype="float32", quantized_activations="int8")
    expected = [hf_greedy(model, p, 10) for p in PROMPTS]
    same = sum(
        a == b for t, e in zip(tokens, expected, strict=True) for a, b in zip(t, e, strict=True)
    )
    assert same >= 0.8 * sum(map(len, expected))
    assert all(t[0] == e[0] for t, e in zip(tokens, expected, strict=True))


def test_served_with_constrained_output(moe_gguf) -> None:  # type: ignore[no-untyped-def]
    """`pyengine serve` on the file: a completion constrained by a JSON schema parses and
    fits it; a greedy one is the offline engine's text."""
    from helpers.server import Server, openai_client

    path, _ = moe_gguf
    server = Server(str(path), max_model_len=256, kv_cache_bytes=32 * 2**20)
    try:
        client = openai_client(server)
        # (short answers only: the random model would write digits to the token limit)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}  # fmt: skip
        done = client.completions.create(
            model=str(path), prompt="hello", max_tokens=100, temperature=0,
            extra_body={"structured_outputs": {"json": schema}},
        )  # fmt: skip
        assert done.choices[0].finish_reason == "stop", done.choices[0].text
        assert isinstance(json.loads(done.choices[0].text)["ok"], bool)
        served = client.completions.create(
            model=str(path), prompt=PROMPTS[0], max_tokens=10, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        llm = LLM(str(path), max_model_len=256, kv_cache_memory=32 * 2**20)
        offline = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert served.choices[0].text == offline[0].outputs[0].text
    finally:
        assert server.stop() == 0
