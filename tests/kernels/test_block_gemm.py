"""The CUDA block-quantized GEMM's CPU side and, on a GPU, the kernel itself. The
integers' reorder (pack_block_gemm_weight) puts each value where the kernel's lanes read
it (checked here by undoing it by the documented layout); ops.block_gemm refuses CPU
tensors, naming the op that multiplies blocks there; PYENGINE_CUDA_BLOCK_GEMM=1 keeps a
GGUF's blocks on CUDA. With a GPU: the product against float64 over the weights
dequantized to the 16-bit type, and a GGUF model's tokens the same as with its weights
dequantized at load. (cpp/tests/test_cuda_block_gemm.cpp runs the kernel on the host.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pyengine import _C, LLM, SamplingParams, ops
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.placement import Placement

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _C.built_with_cuda()),
    reason="needs a CUDA GPU and pyengine built with CUDA",
)


def unpack(packed: np.ndarray, n: int, k: int, bits: int) -> np.ndarray:
    """The layout of cuda/block_gemm.cuh undone: tile c, k block b, lane l (g, t), value p
    (mma p // 4, pair p % 4 // 2, element p % 2) -> q[8c + g][32b + 16 (p // 4) + 2t +
    8 (p % 4 // 2) + p % 2]."""
    tiles, blocks = -(-n // 8), k // 32
    if bits == 4:
        words = packed.reshape(tiles, blocks, 32, 4)
        values = np.stack([words & 15, words >> 4], axis=-1).reshape(tiles, blocks, 32, 8)
    else:
        values = packed.view(np.int8).reshape(tiles, blocks, 32, 8)
    q = np.zeros((tiles * 8, k), values.dtype)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for p in range(8):
            column = 16 * (p // 4) + 2 * t + 8 * (p % 4 // 2) + p % 2
            for b in range(blocks):
                q[np.arange(tiles) * 8 + g, 32 * b + column] = values[:, b, lane, p]
    return q[:n]


@pytest.mark.parametrize(("bits", "n", "k"), [(4, 8, 32), (4, 50, 96), (8, 37, 64), (8, 8, 256)])
def test_the_reorder_puts_each_value_where_the_lanes_read_it(bits: int, n: int, k: int) -> None:
    low, high = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (n, k), dtype=torch.uint8 if bits == 4 else torch.int8)
    packed = torch.empty(_C.packed_block_gemm_size(k, n, bits), dtype=torch.uint8)
    assert packed.numel() == -(-n // 8) * 8 * k * bits // 8
    _C.pack_block_gemm_weight(packed, q, bits)
    np.testing.assert_array_equal(unpack(packed.numpy(), n, k, bits), q.numpy())


def test_block_gemm_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        _C.packed_block_gemm_size(32, 8, 5)
    with pytest.raises(ValueError, match="k must be a multiple of 32"):
        _C.packed_block_gemm_size(40, 8, 4)
    with pytest.raises(ValueError, match="4-bit q holds values 0..15, row 2"):
        q = torch.zeros(8, 32, dtype=torch.uint8)
        q[2, 5] = 16
        _C.pack_block_gemm_weight(torch.empty(128, dtype=torch.uint8), q, 4)
    x, out = torch.randn(2, 32).half(), torch.empty(2, 8).half()
    scale = torch.zeros(8, 1)
    with pytest.raises(ValueError, match="runs on CUDA tensors .the CPU multiplies blocks"):
        ops.block_gemm(out, x, torch.empty(128, dtype=torch.uint8), scale, scale, None, 4, 32)


def test_cuda_keeps_gguf_blocks_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda16 = Placement(torch.device("cuda"), torch.bfloat16)
    assert Placement().keeps_gguf_blocks and not cuda16.keeps_gguf_blocks
    monkeypatch.setenv("PYENGINE_CUDA_BLOCK_GEMM", "1")
    assert cuda16.keeps_gguf_blocks
    assert not Placement(torch.device("cuda"), torch.float32).keeps_gguf_blocks


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 50, 96), (7, 64, 256), (100, 300, 512)])
def test_block_gemm_on_the_gpu(
    dtype: torch.dtype, bits: int, group: int, m: int, n: int, k: int
) -> None:
    from pyengine.layers.quantization.cuda_blocks import CudaBlockForm

    low, high = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (n, k), dtype=torch.uint8 if bits == 4 else torch.int8)
    scale = torch.rand(n, k // group) * 0.01 + 1e-3
    offset = -8 * scale if bits == 4 else torch.zeros_like(scale)
    blocks = BlockQuantized(q.numpy(), scale.numpy(), offset.numpy())
    form = CudaBlockForm(blocks, torch.device("cuda"))
    x, bias = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(n, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    ops.block_gemm(out, x, form.packed, form.scale, form.offset, bias, bits, group)
    w = torch.from_numpy(blocks.dequantize()).to(dtype).double().cuda()
    want = x.double() @ w.t() + bias.double()
    tolerance = 2e-3 if dtype == torch.float16 else 1e-2
    assert (out.double() - want).abs().max() <= tolerance * max(1.0, want.abs().max().item())


@needs_cuda
def test_a_gguf_model_on_cuda_blocks_gives_its_dequantized_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from models.test_gguf import write_tiny_llama  # (a GGUF of several block types)

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    prompts = [[5, 6, 7, 8], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("PYENGINE_CUDA_BLOCK_GEMM", flag)
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=128,
                  enforce_eager=True)  # fmt: skip
        model = llm.llm_engine.executor.driver_worker.model_runner.model
        from pyengine.layers.quantization.cuda_blocks import CudaBlockForm

        qkv = model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv.method_state, CudaBlockForm) == (flag == "1")
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in out])
        llm.llm_engine.shutdown()
    assert runs[0] == runs[1]


@needs_cuda
@pytest.mark.parametrize(
    ("method", "bits", "group_size", "desc_act"),
    [("gptq", 4, 32, False), ("gptq", 4, 64, True), ("gptq", 8, 32, False), ("awq", 4, 32, False)],
)
def test_gptq_and_awq_models_on_cuda_blocks_give_their_dequantized_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, bits: int, group_size: int,
    desc_act: bool,
) -> None:  # fmt: skip
    from helpers.quantized_checkpoints import write_quantized
    from helpers.tiny_models import make_checkpoint

    make_checkpoint("llama", tmp_path / "float")
    write_quantized(tmp_path / "float", tmp_path / "q", tmp_path / "ref", method, bits,
                    group_size, desc_act)  # fmt: skip
    prompts = [[5, 6, 7, 8], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("PYENGINE_CUDA_BLOCK_GEMM", flag)
        llm = LLM(str(tmp_path / "q"), device="cuda", dtype="bfloat16", max_model_len=128,
                  enforce_eager=True)  # fmt: skip
        model = llm.llm_engine.executor.driver_worker.model_runner.model
        held = model.layers[0].mlp.down_proj.method_state
        assert (held.cuda is not None) == (flag == "1")
        if held.cuda is not None:  # the blocks are the weight: no integers kept beside them
            assert held.qweight is None
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in out])
        llm.llm_engine.shutdown()
    assert runs[0] == runs[1]
