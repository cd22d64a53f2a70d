"""What the tests that write a model's GGUF file share: the byte-level tokenizer's fields,
matrices in Q8_0 blocks (the model then holding their dequantized values), closing the
file, and the check that the file runs as the Hugging Face folder it came from does:
the same config, and transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from helpers.byte_tokenizer import EOS, byte_tokens
from helpers.hf_reference import hf_greedy


def add_byte_tokenizer(writer: Any) -> None:
    """The byte-level tokenizer (helpers/byte_tokenizer.py) as gpt2's, with its eos."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([1] * 256 + [3] * 3)
    writer.add_token_merges([])
    writer.add_eos_token_id(EOS)


def add_q8_0(writer: Any, name: str, weight: torch.Tensor) -> None:
    """`weight` as Q8_0 blocks, and the weight (a model's parameter, or a view of one)
    replaced by their dequantized values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    blocks = quantize(weight.detach().contiguous().numpy(), GGMLQuantizationType.Q8_0)
    writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.Q8_0)
    values = dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(weight.shape)
    with torch.no_grad():
        weight.copy_(torch.from_numpy(values.copy()))


def close(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def file_and_folder(path: Path, folder: Path, engine: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(an LLM of the file, the file's ModelConfig, the folder's)."""
    from pyengine import LLM

    from_folder = LLM(str(folder), **engine)
    want = from_folder.llm_engine.model_config
    from_folder.llm_engine.shutdown()
    llm = LLM(str(path), **engine)
    return llm, llm.llm_engine.model_config, want


def assert_transformers_tokens(
    llm: Any, model: torch.nn.Module, lengths: tuple[int, ...] = (5, 40, 70), new: int = 12
) -> None:
    """Greedy tokens of random prompts of `lengths` are transformers'; shuts llm down."""
    from pyengine import SamplingParams

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        hf_greedy(model, p, new) for p in prompts
    ]
