"""Hybrid models from GGUF files written in the test as llama.cpp's conversion writes
them (helpers/hybrid_gguf.py): Mamba-2 (mamba2); Qwen3-Next (qwen3next: its projection
split into q, k and v, and the gate, b and a interleaved by key head, its norms stored
as 1 + w); Qwen3.5 and Qwen3.5-MoE (qwen35, qwen35moe: their value heads reordered in
every tensor that has them, the output projection's columns too); Granite 4
(granitehybrid: its multipliers in the metadata, q and k rows permuted for rope,
experts a tensor a part, head_count_kv 0 on the Mamba-2 layers); Falcon-H1 (falcon-h1:
its multipliers folded into the weights). The config read from the file is the Hugging
Face folder's, and the greedy float32 tokens are transformers' on the weights the Q8_0
blocks hold."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from helpers.byte_tokenizer import EOS, VOCAB  # noqa: E402
from helpers.gguf_writing import (  # noqa: E402
    add_byte_tokenizer,
    assert_transformers_tokens,
    close,
    file_and_folder,
)
from helpers.hybrid import randomize  # noqa: E402
from helpers.hybrid_gguf import TensorWriter  # noqa: E402

from pyengine.models.falcon_h1 import FalconH1FamilyConfig  # noqa: E402
from pyengine.models.qwen3_next import HybridFamilyConfig  # noqa: E402

ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")
SPECIALS = dict(vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=None, pad_token_id=None)


def written(model: torch.nn.Module, root: Path, write) -> tuple[Path, Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    """The model's GGUF file (`write` adds its metadata and tensors) and its folder, both
    of the weights the file's blocks hold."""
    path, folder = root / "model.gguf", root / "hf"
    writer = write(model)
    add_byte_tokenizer(writer)
    close(writer)
    model.eval().save_pretrained(folder)
    return path, folder, model


def write_mamba2(path: Path, model: torch.nn.Module) -> object:
    c = model.config
    writer = gguf.GGUFWriter(str(path), "mamba2")
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 2**20),
        (writer.add_embedding_length, c.hidden_size), (writer.add_feed_forward_length, 0),
        (writer.add_head_count, 0), (writer.add_ssm_conv_kernel, c.conv_kernel),
        (writer.add_ssm_inner_size, c.num_heads * c.head_dim),
        (writer.add_ssm_state_size, c.state_size), (writer.add_ssm_time_step_rank, c.num_heads),
        (writer.add_ssm_group_count, c.n_groups),
        (writer.add_layer_norm_rms_eps, c.layer_norm_epsilon),
    ):  # fmt: skip
        add(value)
    t = TensorWriter(writer, model)
    t.matrix("token_embd.weight", "backbone.embeddings.weight")
    t.param("output_norm.weight", "backbone.norm_f.weight")
    t.matrix("output.weight", "lm_head.weight")
    for i in range(c.num_hidden_layers):
        t.param(f"blk.{i}.attn_norm.weight", f"backbone.layers.{i}.norm.weight")
        t.mamba_layer(i, f"backbone.layers.{i}.mixer", c.n_groups)
    return writer


@pytest.fixture(scope="module")
def mamba2_gguf(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("mamba2-gguf")
    torch.manual_seed(0)
    config = transformers.Mamba2Config(
        **SPECIALS, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, expand=2,
        n_groups=2, state_size=16, conv_kernel=4, chunk_size=8, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return written(model, root, lambda m: write_mamba2(root / "model.gguf", m))


def test_mamba2(mamba2_gguf) -> None:  # type: ignore[no-untyped-def]
    path, folder, model = mamba2_gguf
    llm, got, want = file_and_folder(path, folder, ENGINE)
    assert got.family == want.family and got.max_position_embeddings == 4096
    mixer = llm.llm_engine.executor.driver_worker.model_runner.model.layers[0].mixer
    assert mixer.in_proj.weight_form() == mixer.out_proj.weight_form() == "8-bit blocks"
    assert (got.vocab_size, got.num_layers) == (want.vocab_size, want.num_layers)
    assert got.norm_eps == pytest.approx(want.norm_eps)  # (float32 in the file)
    assert_transformers_tokens(llm, model)


def tiled(x: torch.Tensor, key_heads: int, size: int, dim: int = 0) -> torch.Tensor:
    """Value heads (`size` each) along `dim` in llama.cpp's qwen35 order: each key head's
    first value head, then each one's second..., where transformers groups them by key
    head."""
    shape = list(x.shape)
    heads = shape[dim] // size
    split = [*shape[:dim], key_heads, heads // key_heads, size, *shape[dim + 1 :]]
    return x.reshape(split).transpose(dim, dim + 1).reshape(shape)


def grouped(x: torch.Tensor, key_heads: int, size: int, dim: int = 0) -> torch.Tensor:
    """tiled's inverse."""
    shape = list(x.shape)
    heads = shape[dim] // size
    return tiled(x, heads // key_heads, size, dim) if heads > key_heads else x


QWEN_ARCHS = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


def write_qwen3_hybrid(path: Path, model: torch.nn.Module, variant: str) -> object:
    """Qwen3-Next (in_proj_qkvz split into [q; k; v] and the gate; in_proj_ba as it is) or
    Qwen3.5 (its projections apart, their value heads reordered, and the output
    projection's columns) as llama.cpp's conversion writes them."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), QWEN_ARCHS[variant])
    n_k, n_v = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, hidden = c.linear_key_head_dim, c.linear_value_head_dim, c.hidden_size
    experts = getattr(c, "num_experts", 0)
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 256),
        (writer.add_embedding_length, hidden),
        (writer.add_head_count, c.num_attention_heads),
        (writer.add_head_count_kv, c.num_key_value_heads), (writer.add_key_length, c.head_dim),
        (writer.add_value_length, c.head_dim), (writer.add_rope_freq_base, 10000.0),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_ssm_conv_kernel, c.linear_conv_kernel_dim), (writer.add_ssm_state_size, dk),
        (writer.add_ssm_group_count, n_k), (writer.add_ssm_time_step_rank, n_v),
        (writer.add_ssm_inner_size, dv * n_v), (writer.add_full_attention_interval, 4),
        (writer.add_rope_dimension_count, c.head_dim // 4),
    ):  # fmt: skip
        add(value)
    if getattr(c, "intermediate_size", None):
        writer.add_feed_forward_length(c.intermediate_size)
    if experts:
        for add, value in (
            (writer.add_expert_count, experts),
            (writer.add_expert_used_count, c.num_experts_per_tok),
            (writer.add_expert_feed_forward_length, c.moe_intermediate_size),
            (writer.add_expert_shared_feed_forward_length, c.shared_expert_intermediate_size),
        ):  # fmt: skip
            add(value)
    t, p = TensorWriter(writer, model), dict(model.named_parameters())

    def plus_one(name: str, hf_name: str) -> None:  # (llama.cpp's 1 + w of these norms)
        t.floats(name, p[hf_name] + 1)

    def reordered(name: str, hf_name: str, order, back) -> None:  # type: ignore[no-untyped-def]
        """A matrix stored in llama.cpp's order (`order` of it), in blocks; transformers'
        holds their values in its own (`back`)."""
        stored = order(p[hf_name].detach()).clone()
        t.blocks(name, stored)
        with torch.no_grad():
            p[hf_name].copy_(back(stored))

    t.matrix("token_embd.weight", "model.embed_tokens.weight")
    plus_one("output_norm.weight", "model.norm.weight")
    t.matrix("output.weight", "lm_head.weight")
    keys = 2 * n_k * dk
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        plus_one(f"blk.{i}.attn_norm.weight", f"{pre}.input_layernorm.weight")
        plus_one(f"blk.{i}.post_attention_norm.weight", f"{pre}.post_attention_layernorm.weight")
        attn = f"{pre}.linear_attn"
        if c.layer_types[i] == "full_attention":
            for part, name in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
                t.matrix(f"blk.{i}.attn_{part}.weight", f"{pre}.self_attn.{name}_proj.weight")
            plus_one(f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight")
            plus_one(f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight")
        elif variant == "qwen3_next":  # (in_proj_qkvz, by key head [q, k, v, z])
            qkvz = p[f"{attn}.in_proj_qkvz.weight"].view(n_k, -1, hidden)
            q, k, v, z = qkvz.split([dk, dk, n_v // n_k * dv, n_v // n_k * dv], dim=1)
            flat = [x.reshape(-1, hidden) for x in (q, k, v)]
            qkv, gate = torch.cat(flat).detach().clone(), z.reshape(-1, hidden).clone()
            t.blocks(f"blk.{i}.attn_qkv.weight", qkv)
            t.blocks(f"blk.{i}.attn_gate.weight", gate)
            with torch.no_grad():  # (the blocks' values back in the interleaved rows)
                parts = [x.view(n_k, -1, hidden) for x in qkv.split([n_k * dk, n_k * dk,
                                                                     n_v * dv])]  # fmt: skip
                whole = torch.cat([*parts, gate.view(n_k, -1, hidden)], dim=1)
                p[f"{attn}.in_proj_qkvz.weight"].copy_(whole.reshape(-1, hidden))
            t.matrix(f"blk.{i}.ssm_ba.weight", f"{attn}.in_proj_ba.weight")
        else:  # (Qwen3.5's value heads tiled in every tensor that has them)
            reordered(
                f"blk.{i}.attn_qkv.weight", f"{attn}.in_proj_qkv.weight",
                lambda w: torch.cat([w[:keys], tiled(w[keys:], n_k, dv)]),
                lambda w: torch.cat([w[:keys], grouped(w[keys:], n_k, dv)]),
            )  # fmt: skip
            reordered(f"blk.{i}.attn_gate.weight", f"{attn}.in_proj_z.weight",
                      lambda w: tiled(w, n_k, dv), lambda w: grouped(w, n_k, dv))  # fmt: skip
            for part, name in (("beta", "b"), ("alpha", "a")):
                reordered(f"blk.{i}.ssm_{part}.weight", f"{attn}.in_proj_{name}.weight",
                          lambda w: tiled(w, n_k, 1), lambda w: grouped(w, n_k, 1))  # fmt: skip
            reordered(f"blk.{i}.ssm_out.weight", f"{attn}.out_proj.weight",
                      lambda w: tiled(w, n_k, dv, 1), lambda w: grouped(w, n_k, dv, 1))  # fmt: skip
        if c.layer_types[i] != "full_attention":
            conv = p[f"{attn}.conv1d.weight"].detach().squeeze(1)
            a, dt_bias = -torch.exp(p[f"{attn}.A_log"].detach()), p[f"{attn}.dt_bias"]
            if variant != "qwen3_next":
                conv = torch.cat([conv[:keys], tiled(conv[keys:], n_k, dv)])
                a, dt_bias = tiled(a, n_k, 1), tiled(dt_bias.detach(), n_k, 1)
            t.floats(f"blk.{i}.ssm_conv1d.weight", conv)
            t.floats(f"blk.{i}.ssm_dt.bias", dt_bias)
            t.floats(f"blk.{i}.ssm_a", a)
            t.param(f"blk.{i}.ssm_norm.weight", f"{attn}.norm.weight")
            if variant == "qwen3_next":
                t.matrix(f"blk.{i}.ssm_out.weight", f"{attn}.out_proj.weight")
        if not experts:
            for part in ("gate", "up", "down"):
                t.matrix(f"blk.{i}.ffn_{part}.weight", f"{pre}.mlp.{part}_proj.weight")
            continue
        t.experts(i, f"{pre}.mlp")
        for part in ("gate", "up", "down"):
            t.matrix(
                f"blk.{i}.ffn_{part}_shexp.weight", f"{pre}.mlp.shared_expert.{part}_proj.weight"
            )
        t.floats(f"blk.{i}.ffn_gate_inp_shexp.weight", p[f"{pre}.mlp.shared_expert_gate.weight"][0])
    return writer


QWEN_SHAPE = dict(
    **SPECIALS, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)  # fmt: skip
QWEN_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=64)  # fmt: skip
QWEN_CONFIGS = {
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **QWEN_SHAPE, **QWEN_EXPERTS, intermediate_size=96
    ),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**QWEN_SHAPE, intermediate_size=96),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**QWEN_SHAPE, **QWEN_EXPERTS),
}


@pytest.fixture(scope="module", params=sorted(QWEN_CONFIGS))
def qwen_gguf(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp(f"{request.param}-gguf")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        QWEN_CONFIGS[request.param](), dtype=torch.float32
    )
    randomize(model, one_plus=True)
    write = lambda m: write_qwen3_hybrid(root / "model.gguf", m, request.param)  # noqa: E731
    return (request.param, *written(model, root, write))


def test_qwen3_next_and_qwen3_5(qwen_gguf) -> None:  # type: ignore[no-untyped-def]
    """Qwen3-Next's file has its own layout (q, k and v, and the gate apart; b and a
    interleaved); Qwen3.5's is its folder's, once its value heads are back in order."""
    variant, path, folder, model = qwen_gguf
    llm, got, want = file_and_folder(path, folder, ENGINE)
    family, theirs = got.family_config(HybridFamilyConfig), want.family_config(HybridFamilyConfig)
    if variant == "qwen3_next":
        theirs = replace(theirs, layout="qwen3_next_split")
    assert family == theirs
    assert (got.head_size, got.num_kv_heads) == (want.head_size, want.num_kv_heads)
    assert_transformers_tokens(llm, model)


def rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows as llama.cpp's Llama conversion permutes them (each head's rotary
    halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_granite(path: Path, model: torch.nn.Module, rope: bool) -> object:
    c = model.config
    writer = gguf.GGUFWriter(str(path), "granitehybrid")
    attention = [kind in ("attention", "full_attention") for kind in c.layer_types]
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers),
        (writer.add_context_length, 256 if rope else 2**20),
        (writer.add_embedding_length, c.hidden_size),
        (writer.add_feed_forward_length, c.intermediate_size),
        (writer.add_head_count, c.num_attention_heads),
        (writer.add_head_count_kv, [c.num_key_value_heads if a else 0 for a in attention]),
        (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_vocab_size, c.vocab_size),
        (writer.add_rope_dimension_count, c.hidden_size // c.num_attention_heads),
        (writer.add_attention_scale, c.attention_multiplier),
        (writer.add_embedding_scale, c.embedding_multiplier),
        (writer.add_residual_scale, c.residual_multiplier),
        (writer.add_logit_scale, c.logits_scaling),
        (writer.add_expert_shared_feed_forward_length, c.shared_intermediate_size),
        (writer.add_ssm_conv_kernel, c.mamba_d_conv), (writer.add_ssm_state_size, c.mamba_d_state),
        (writer.add_ssm_group_count, c.mamba_n_groups),
        (writer.add_ssm_inner_size, c.mamba_expand * c.hidden_size),
        (writer.add_ssm_time_step_rank, c.mamba_n_heads), (writer.add_rope_scaling_finetuned, rope),
    ):  # fmt: skip
        add(value)
    if c.num_local_experts:
        writer.add_expert_count(c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    t, p = TensorWriter(writer, model), dict(model.named_parameters())
    t.matrix("token_embd.weight", "model.embed_tokens.weight")
    t.param("output_norm.weight", "model.norm.weight")
    t.matrix("output.weight", "lm_head.weight")
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        t.param(f"blk.{i}.attn_norm.weight", f"{pre}.input_layernorm.weight")
        t.param(f"blk.{i}.ffn_norm.weight", f"{pre}.post_attention_layernorm.weight")
        if attention[i]:
            for part, name in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
                w = p[f"{pre}.self_attn.{name}_proj.weight"]
                if part in ("q", "k"):  # (the blocks' values back in transformers' rows)
                    heads = c.num_attention_heads if part == "q" else c.num_key_value_heads
                    permuted = rope_rows(w.detach(), heads).clone()
                    t.blocks(f"blk.{i}.attn_{part}.weight", permuted)
                    with torch.no_grad():
                        halves = permuted.reshape(heads, -1, 2, c.hidden_size).swapaxes(1, 2)
                        w.copy_(halves.reshape(w.shape))
                else:
                    t.blocks(f"blk.{i}.attn_{part}.weight", w)
        else:
            t.mamba_layer(i, f"{pre}.mamba", c.mamba_n_groups)
        shared = p[f"{pre}.shared_mlp.input_linear.weight"]
        kind = "_shexp" if c.num_local_experts else ""
        size = c.shared_intermediate_size
        t.blocks(f"blk.{i}.ffn_gate{kind}.weight", shared[:size])
        t.blocks(f"blk.{i}.ffn_up{kind}.weight", shared[size:])
        t.matrix(f"blk.{i}.ffn_down{kind}.weight", f"{pre}.shared_mlp.output_linear.weight")
        if c.num_local_experts:
            moe = f"{pre}.block_sparse_moe"
            p[f"{moe}.gate.weight"] = p[f"{moe}.router.weight"]  # (TensorWriter.experts' name)
            t.params = p
            t.experts(i, moe)
    return writer


GRANITE = dict(
    **SPECIALS, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=256,
    layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
    mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
    shared_intermediate_size=64, embedding_multiplier=3.0, residual_multiplier=0.5,
    attention_multiplier=0.25, logits_scaling=2.5, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module", params=["moe_nope", "dense_rope"])
def granite_gguf(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp(f"granite-gguf-{request.param}")
    torch.manual_seed(0)
    rope = request.param == "dense_rope"
    experts = {} if rope else dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    config = transformers.GraniteMoeHybridConfig(
        **GRANITE, **(experts or dict(num_local_experts=0)),
        position_embedding_type="rope" if rope else "nope",
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return written(model, root, lambda m: write_granite(root / "model.gguf", m, rope))


def test_granite(granite_gguf) -> None:  # type: ignore[no-untyped-def]
    path, folder, model = granite_gguf
    llm, got, want = file_and_folder(path, folder, ENGINE)
    assert got.family == want.family
    assert (got.num_kv_heads, got.head_size) == (want.num_kv_heads, want.head_size)
    assert_transformers_tokens(llm, model)


# Powers of two, so that the weights llama.cpp's conversion scales by them (the file's
# blocks) give transformers' model exact weights back (the blocks over the multiplier).
FALCON = dict(
    **SPECIALS, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
    mamba_chunk_size=8, attention_in_multiplier=0.5, attention_out_multiplier=2.0,
    key_multiplier=0.5, ssm_in_multiplier=2.0, ssm_out_multiplier=0.5,
    ssm_multipliers=[0.5, 2.0, 0.25, 4.0, 0.5], mlp_multipliers=[0.5, 2.0],
    embedding_multiplier=2.0, lm_head_multiplier=0.5, tie_word_embeddings=False,
)  # fmt: skip


def write_falcon(path: Path, model: torch.nn.Module) -> object:
    c = model.config
    writer = gguf.GGUFWriter(str(path), "falcon-h1")
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 256),
        (writer.add_embedding_length, c.hidden_size),
        (writer.add_feed_forward_length, c.intermediate_size),
        (writer.add_head_count, c.num_attention_heads),
        (writer.add_head_count_kv, c.num_key_value_heads), (writer.add_key_length, c.head_dim),
        (writer.add_value_length, c.head_dim), (writer.add_rope_freq_base, 10000.0),
        (writer.add_vocab_size, c.vocab_size), (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_ssm_conv_kernel, c.mamba_d_conv), (writer.add_ssm_inner_size, c.mamba_d_ssm),
        (writer.add_ssm_state_size, c.mamba_d_state),
        (writer.add_ssm_time_step_rank, c.mamba_n_heads),
        (writer.add_ssm_group_count, c.mamba_n_groups),
    ):  # fmt: skip
        add(value)
    t, p = TensorWriter(writer, model), dict(model.named_parameters())
    groups = c.mamba_n_groups * c.mamba_d_state
    sections = [c.mamba_d_ssm, c.mamba_d_ssm, groups, groups, c.mamba_n_heads]
    ssm_in = torch.cat([torch.full((n,), m * c.ssm_in_multiplier)
                        for n, m in zip(sections, c.ssm_multipliers, strict=True)])  # fmt: skip

    def folded(name: str, hf_name: str, by: float | torch.Tensor) -> None:
        """The weight times its multiplier in blocks; transformers' back over it."""
        w = p[hf_name]
        factor = by[:, None] if isinstance(by, torch.Tensor) else by
        scaled = (w.detach() * factor).clone()
        t.blocks(name, scaled)
        with torch.no_grad():
            w.copy_(scaled / factor)

    folded("token_embd.weight", "model.embed_tokens.weight", c.embedding_multiplier)
    t.param("output_norm.weight", "model.final_layernorm.weight")
    folded("output.weight", "lm_head.weight", c.lm_head_multiplier)
    attention_in = c.attention_in_multiplier
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        t.param(f"blk.{i}.attn_norm.weight", f"{pre}.input_layernorm.weight")
        t.floats(f"blk.{i}.ffn_norm", p[f"{pre}.pre_ff_layernorm.weight"])  # (no suffix)
        for part, name, by in (
            ("q", "q", attention_in), ("k", "k", attention_in * c.key_multiplier),
            ("v", "v", attention_in), ("output", "o", c.attention_out_multiplier),
        ):  # fmt: skip
            folded(f"blk.{i}.attn_{part}.weight", f"{pre}.self_attn.{name}_proj.weight", by)
        for part, by in (
            ("gate", c.mlp_multipliers[0]),
            ("up", 1.0),
            ("down", c.mlp_multipliers[1]),
        ):
            folded(f"blk.{i}.ffn_{part}.weight", f"{pre}.feed_forward.{part}_proj.weight", by)
        folded(f"blk.{i}.ssm_in.weight", f"{pre}.mamba.in_proj.weight", ssm_in)
        folded(f"blk.{i}.ssm_out.weight", f"{pre}.mamba.out_proj.weight", c.ssm_out_multiplier)
        t.mamba_layer(i, f"{pre}.mamba", c.mamba_n_groups, projections=False)
    return writer


@pytest.fixture(scope="module", params=["norm_after_gate", "no_norm"])
def falcon_gguf(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp(f"falcon-gguf-{request.param}")
    torch.manual_seed(0)
    norm = dict(mamba_rms_norm=request.param == "norm_after_gate", mamba_norm_before_gate=False)
    config = transformers.FalconH1Config(**FALCON, **norm)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return written(model, root, lambda m: write_falcon(root / "model.gguf", m))


def test_falcon_h1(falcon_gguf) -> None:  # type: ignore[no-untyped-def]
    """The multipliers come folded into the weights: each reads as 1."""
    path, folder, model = falcon_gguf
    llm, got, want = file_and_folder(path, folder, ENGINE)
    family = got.family_config(FalconH1FamilyConfig)
    assert family.mamba == want.family_config(FalconH1FamilyConfig).mamba
    assert family.mamba_norm == want.family_config(FalconH1FamilyConfig).mamba_norm
    assert set(dict(family.multipliers).values()) == {1.0}
    assert family.ssm_multipliers == (1.0,) * 5 and family.mlp_multipliers == (1.0, 1.0)
    assert_transformers_tokens(llm, model)
