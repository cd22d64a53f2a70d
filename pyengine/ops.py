"""pyengine's kernels as torch operators (``torch.ops.pyengine.*``).

Registered with torch.library, the kernels are visible to ``torch.compile`` (each has a
fake kernel for tracing) and to CUDA graph capture, and one wheel serves any torch
version: tensors cross into ``pyengine._C`` through DLPack, never through libtorch's C++
ABI. They are defined with ``torch.library.Library`` rather than ``custom_op``, whose calls
cost several times more, at several calls per layer per step.
The names below call the CPU kernels directly in eager mode, past torch's dispatcher
(see ``_eager_cpu_direct``); CUDA tensors, tracing and compiling go through the ops.
Importing this module needs torch.

Shapes (see cpp/include/pyengine/attention.h):
    key_cache:   [num_blocks, num_kv_heads, head_size, block_size]   (keys transposed)
    value_cache: [num_blocks, num_kv_heads, block_size, head_size]

Example::

    import torch
    from pyengine import ops

    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                        query_start_loc, head_size**-0.5)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from pyengine import _C

_SCHEMAS = {
    # key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: int64 [num_tokens]
    # k_scale/v_scale: an int8 cache's static per-tensor scales (0: a scale per token)
    "reshape_and_cache": "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
    "Tensor(b!) value_cache, Tensor slot_mapping, float k_scale=0.0, float v_scale=0.0) -> ()",
    # out, query: [num_tokens, num_heads, head_size]; block_tables int32 [num_reqs, max];
    # seq_lens int32 [num_reqs]; query_start_loc int32 [num_reqs + 1]
    "paged_attention": "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
    "Tensor value_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
    "float scale, int sliding_window=0, float logit_soft_cap=0.0, int max_seq_len=0, "
    "int max_query_len=0, Tensor? sinks=None, int attention_chunk=0) -> ()",
    # DeepSeek's latent attention: query [num_tokens, heads, latent_dim], latent_cache
    # [num_blocks, block_size, latent_dim], out [num_tokens, heads, value_dim]
    "mla_attention": "mla_attention(Tensor(a!) out, Tensor query, Tensor latent_cache, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
    "int value_dim) -> ()",
    # Recurrent-state layers (cpp/include/pyengine/recurrent.h): each request's tokens
    # from its state slot (zeros where has_state is 0), the slot written back
    "gated_delta_rule": "gated_delta_rule(Tensor(a!) out, Tensor query, Tensor key, "
    "Tensor value, Tensor g, Tensor beta, Tensor(b!) state, Tensor state_slots, "
    "Tensor has_state, Tensor query_start_loc, float scale, bool normalize) -> ()",
    "causal_conv1d": "causal_conv1d(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, "
    "Tensor(b!) state, Tensor state_slots, Tensor has_state, Tensor query_start_loc, "
    "bool silu) -> ()",
    "ssm_scan": "ssm_scan(Tensor(a!) out, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
    "Tensor? D, Tensor? dt_bias, Tensor(b!) state, Tensor state_slots, Tensor has_state, "
    "Tensor query_start_loc, bool dt_softplus, float dt_min, float dt_max) -> ()",
    # block_mapping: int64 [num_pairs, 2] (src, dst) on the CPU
    "copy_blocks": "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
    "Tensor block_mapping) -> ()",
    "swap_blocks": "swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()",
    # Fused layers (cpp/include/pyengine/layer_ops.h); x, out: [num_tokens, hidden]
    "rms_norm": "rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()",
    "fused_add_rms_norm": "fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, "
    "Tensor weight, float eps) -> ()",
    "rotary_embedding": "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, "
    "Tensor cos_sin_cache, bool is_neox=True) -> ()",
    "silu_and_mul": "silu_and_mul(Tensor(a!) out, Tensor x) -> ()",
    # out = gelu(x[:, :n]) * x[:, n:], tanh approximation (Gemma's GeGLU; the CPU's)
    "gelu_tanh_and_mul": "gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()",
    # out = x * factor (the CPU's)
    "scale": "scale(Tensor(a!) out, Tensor x, float factor) -> ()",
    # out = a + b (the CPU's: the residual stream's last sum)
    "add": "add(Tensor(a!) out, Tensor a, Tensor b) -> ()",
    # out [t, hidden] = weight [vocab, hidden] rows ids (int32/int64 [t]) (the CPU's)
    "embedding": "embedding(Tensor(a!) out, Tensor weight, Tensor ids) -> ()",
    # out [m, n] = x [m, k] @ a panel-packed [k, n] weight (pack_weight, float32; or
    # pack_quantized_weight, uint8/int8/float8_e4m3fn) + bias; int8_activations: a decode
    # step's rows quantized to int8 per block of 32 for a 4-bit/int8 block weight
    "dense": "dense(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int n, "
    "bool int8_activations=False) -> ()",
    # out [m, n] = silu(x @ gate) * (x @ up), gate/up packed by pack_gate_up_weight (or
    # pack_quantized_weight with gate_up)
    "dense_silu_and_mul": "dense_silu_and_mul(Tensor(a!) out, Tensor x, Tensor packed, "
    "int n, bool int8_activations=False) -> ()",
    # out [t, k] = columns ids (int64 [t]) of a packed [k, n] weight: an embedding lookup
    # in a head's packed form
    "packed_columns": "packed_columns(Tensor(a!) out, Tensor packed, Tensor ids, int n) -> ()",
    # out [m, n] = x [m, k] (int8-quantized per row) @ a packed int8 weight * scale + bias
    "int8_dense": "int8_dense(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale, "
    "Tensor? bias, int n) -> ()",
    # ids int32 [t, top_k], weights float32 [t, top_k] = each row's top_k experts by
    # softmax(logits [t, experts]), highest first (renormalised to sum 1 where asked)
    "moe_softmax_topk": "moe_softmax_topk(Tensor(a!) ids, Tensor(b!) weights, Tensor logits, "
    "bool renormalize) -> ()",
    # DeepSeek-V3's routing: sigmoid scores (+ bias [experts]) by groups, the best
    # topk_groups groups' top_k experts, renormalised where asked, times scaling_factor
    "moe_grouped_topk": "moe_grouped_topk(Tensor(a!) ids, Tensor(b!) weights, Tensor logits, "
    "Tensor? bias, int num_groups, int topk_groups, bool renormalize, float scaling_factor) -> ()",
    # Llama 4's: the top_k by logit, weights sigmoid(logit) (applied to the input)
    "moe_sigmoid_topk": "moe_sigmoid_topk(Tensor(a!) ids, Tensor(b!) weights, Tensor logits) -> ()",
    # CUDA: the slots (row r's s-th expert: r * top_k + s) of a rank's experts [first_expert,
    # first_expert + experts) grouped by expert, in blocks of 16 (moe_max_blocks of them)
    "moe_align_blocks": "moe_align_blocks(Tensor(a!) sorted, Tensor(b!) block_experts, "
    "Tensor ids, int first_expert, int experts) -> ()",
    # CUDA: over the aligned blocks, gate_up: out [slots, n] = silu(x @ gate^T) * (x @ up^T)
    # (w [experts, 2n, k], x [t, k]); else out float32 [slots, n] = x @ w[e]^T * weight
    "moe_expert_gemm": "moe_expert_gemm(Tensor(a!) out, Tensor x, Tensor w, Tensor sorted, "
    "Tensor block_experts, Tensor weights, int top_k, bool gate_up, bool on_input=False) -> ()",
    # CUDA: out [t, hidden] = each row's slots of y [slots, hidden] (the rank's experts')
    "moe_combine": "moe_combine(Tensor(a!) out, Tensor y, Tensor ids, int first_expert, "
    "int experts) -> ()",
    # out [t, hidden] = each row's routed experts' weighted sum: gate_up [experts, S1] and
    # down [experts, S2] stacked packed weights (cpp/include/pyengine/moe.h); plus a shared
    # expert's output (times sigmoid(x . shared_gate) where given); expert parallelism: the
    # stacks hold a rank's experts from first_expert of the layer's num_experts; gpt-oss's
    # experts: biases [experts, 2n] and [experts, hidden], its clamped SwiGLU
    "fused_experts": "fused_experts(Tensor(a!) out, Tensor x, Tensor ids, Tensor weights, "
    "Tensor gate_up, Tensor down, int n, bool on_input=False, bool int8_activations=False, "
    "Tensor? shared_gate_up=None, Tensor? shared_down=None, int shared_n=0, "
    "Tensor? shared_gate=None, int first_expert=0, int num_experts=0, "
    "Tensor? gate_up_bias=None, Tensor? down_bias=None, bool clamped_swiglu=False, "
    "float alpha=1.702, float limit=7.0) -> ()",
    # out [t, n] += each row's LoRA delta (cpp/include/pyengine/lora.h): slots int32 [t]
    # (-1: none), a [slots, ranks, k], b [slots, ranks, n], part_columns int64 [parts + 1]
    "lora_add": "lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor slots, "
    "Tensor scale, Tensor part_columns) -> ()",
    # out [t, n] += each row's embedding LoRA delta: a [slots, vocab, ranks] (A
    # transposed), b [slots, ranks, n], looked up by ids [t]
    "lora_embedding_add": "lora_embedding_add(Tensor(a!) out, Tensor ids, Tensor a, Tensor b, "
    "Tensor slots, Tensor scale) -> ()",
    # out = x rounded to fp8 e4m3 per row (scale None: max|row| / 448) or by scale [1]
    "quantize_fp8_rows": "quantize_fp8_rows(Tensor(a!) out, Tensor x, Tensor? scale) -> ()",
    # out [m, n] = x [m, k] (16-bit, CUDA) @ (q * scale + offset)^T + bias, q reordered by
    # pack_block_gemm_weight
    "block_gemm": "block_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale, "
    "Tensor offset, Tensor? bias, int bits, int group) -> ()",
}


def _copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
    stream: int = 0,
) -> None:
    _C.copy_blocks([*key_caches, *value_caches], block_mapping, stream)


_KERNELS: dict[str, Callable[..., None]] = {
    "reshape_and_cache": _C.reshape_and_cache,
    "paged_attention": _C.paged_attention,
    "copy_blocks": _copy_blocks,
    "swap_blocks": _C.swap_blocks,
    "rms_norm": _C.rms_norm,
    "fused_add_rms_norm": _C.fused_add_rms_norm,
    "rotary_embedding": _C.rotary_embedding,
    "silu_and_mul": _C.silu_and_mul,
    "add": _C.add,
    "embedding": _C.embedding,
    "dense": _C.dense,
    "dense_silu_and_mul": _C.dense_silu_and_mul,
    "mla_attention": _C.mla_attention,
    "gated_delta_rule": _C.gated_delta_rule,
    "causal_conv1d": _C.causal_conv1d,
    "ssm_scan": _C.ssm_scan,
    "packed_columns": _C.packed_columns,
    "int8_dense": _C.int8_dense,
    "gelu_tanh_and_mul": _C.gelu_tanh_and_mul,
    "scale": _C.scale,
    "moe_softmax_topk": _C.moe_softmax_topk,
    "moe_grouped_topk": _C.moe_grouped_topk,
    "moe_sigmoid_topk": _C.moe_sigmoid_topk,
    "moe_align_blocks": _C.moe_align_blocks,
    "moe_expert_gemm": _C.moe_expert_gemm,
    "moe_combine": _C.moe_combine,
    "fused_experts": _C.fused_experts,
    "lora_add": _C.lora_add,
    "lora_embedding_add": _C.lora_embedding_add,
    "quantize_fp8_rows": _C.quantize_fp8_rows,
    "block_gemm": _C.block_gemm,
}


# The kernels with a CUDA build (cuda/), which runs where pyengine was built with CUDA.
_CUDA_KERNELS = (
    "reshape_and_cache",
    "paged_attention",
    "mla_attention",
    "gated_delta_rule",
    "causal_conv1d",
    "ssm_scan",
    "copy_blocks",
    "swap_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "block_gemm",
    "lora_add",
    "moe_softmax_topk",
    "moe_align_blocks",
    "moe_expert_gemm",
    "moe_combine",
)


def _on_current_stream(kernel: Callable[..., None]) -> Callable[..., None]:
    """The kernel on torch's current CUDA stream of its tensors' device, so that it is
    ordered with torch's own work and captured into CUDA graphs."""

    def run(*args: object) -> None:
        device = next(t.device for t in _tensors(args) if t.device.type == "cuda")
        kernel(*args, stream=torch.cuda.current_stream(device).cuda_stream)

    return run


def _tensors(args: tuple[object, ...]) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, list):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _register() -> torch.library.Library:
    library = torch.library.Library("pyengine", "DEF")  # type: ignore[no-untyped-call]
    for name, schema in _SCHEMAS.items():
        library.define(schema)  # type: ignore[no-untyped-call]
        library.impl(name, _KERNELS[name], "CPU")  # type: ignore[no-untyped-call]
        if name in _CUDA_KERNELS:
            cuda = _on_current_stream(_KERNELS[name])
            library.impl(name, cuda, "CUDA")  # type: ignore[no-untyped-call]
        # They only write into their arguments: tracing needs nothing computed.
        torch.library.register_fake(f"pyengine::{name}", lambda *args, **kwargs: None, lib=library)
    return library


_LIBRARY = _register()  # the registrations live as long as this object


# Where the CPU kernel calls are being recorded (recording()), if anywhere.
_program: _C.KernelProgram | None = None


@contextmanager
def recording(program: _C.KernelProgram) -> Iterator[None]:
    """Within it, each eager CPU call of the kernels below runs and is appended to
    `program`, its arguments converted once (and its tensors kept alive), for
    program.run() to replay the same calls on the same memory without Python. What the
    code between them computes with torch is not recorded: a caller checks a replay
    against an eager run (see worker/cpu_graphs.py)."""
    global _program
    if _program is not None:
        raise RuntimeError("a KernelProgram is being recorded already")
    _program = program
    try:
        yield
    finally:
        _program = None


def _eager_cpu_direct(name: str) -> Callable[..., None]:
    """torch.ops.pyengine.<name>, except that a call in eager mode whose first argument
    is a CPU tensor goes straight to the CPU kernel that the op would run: torch's
    dispatcher costs microseconds a call, at hundreds of calls a decode step (the same
    logits either way); while recording(), it is also recorded. Tensors on any other
    device keep the op (CUDA: its stream, graph capture; meta: the fake kernel), and so
    do torch.compile's tracing and fake tensors."""
    op = getattr(torch.ops.pyengine, name)
    kernel = _KERNELS[name]
    prepare = getattr(_C, f"prepare_{name}")

    def call(*args: object, **kwargs: object) -> None:
        first = args[0] if args else None
        if type(first) is torch.Tensor and first.is_cpu and not torch.compiler.is_compiling():
            if _program is None:
                kernel(*args, **kwargs)
            else:
                prepared = prepare(*args, **kwargs)
                prepared()
                _program.append(prepared)
        else:
            op(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch.ops.pyengine.{name}; CPU tensors in eager mode call the kernel."
    return call


reshape_and_cache = _eager_cpu_direct("reshape_and_cache")
paged_attention = _eager_cpu_direct("paged_attention")
mla_attention = _eager_cpu_direct("mla_attention")
gated_delta_rule = _eager_cpu_direct("gated_delta_rule")
causal_conv1d = _eager_cpu_direct("causal_conv1d")
ssm_scan = _eager_cpu_direct("ssm_scan")
copy_blocks = torch.ops.pyengine.copy_blocks  # (lists of caches: a call a step at most)
swap_blocks = torch.ops.pyengine.swap_blocks
rms_norm = _eager_cpu_direct("rms_norm")
fused_add_rms_norm = _eager_cpu_direct("fused_add_rms_norm")
rotary_embedding = _eager_cpu_direct("rotary_embedding")
silu_and_mul = _eager_cpu_direct("silu_and_mul")
add = _eager_cpu_direct("add")
gelu_tanh_and_mul = _eager_cpu_direct("gelu_tanh_and_mul")
scale = _eager_cpu_direct("scale")
embedding = _eager_cpu_direct("embedding")
dense = _eager_cpu_direct("dense")
dense_silu_and_mul = _eager_cpu_direct("dense_silu_and_mul")
packed_columns = _eager_cpu_direct("packed_columns")
int8_dense = _eager_cpu_direct("int8_dense")
moe_softmax_topk = _eager_cpu_direct("moe_softmax_topk")
moe_grouped_topk = _eager_cpu_direct("moe_grouped_topk")
moe_sigmoid_topk = _eager_cpu_direct("moe_sigmoid_topk")
fused_experts = _eager_cpu_direct("fused_experts")
lora_add = _eager_cpu_direct("lora_add")
lora_embedding_add = _eager_cpu_direct("lora_embedding_add")
quantize_fp8_rows = _eager_cpu_direct("quantize_fp8_rows")
block_gemm = torch.ops.pyengine.block_gemm  # (CUDA only: on its stream)
moe_align_blocks = torch.ops.pyengine.moe_align_blocks  # (CUDA only, as the two below)
moe_expert_gemm = torch.ops.pyengine.moe_expert_gemm
moe_combine = torch.ops.pyengine.moe_combine
