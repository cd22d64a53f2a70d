"""YaRN rotary scaling against transformers' own (its inverse frequencies and attention
factor): gpt-oss's (truncate off) and DeepSeek-V3's (mscale and mscale_all_dim)."""

from __future__ import annotations

import pytest
import torch

from pyengine.layers.rotary import RotaryEmbedding

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek_v3"])
def test_yarn_is_transformers(kind: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind == "gpt_oss":
        config = transformers.GptOssConfig(head_dim=64, max_position_embeddings=512)
        head = 64
    else:
        config = transformers.DeepseekV3Config(max_position_embeddings=512, rope_parameters={
            "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "rope_theta": 10000.0,
        })  # fmt: skip
        head = config.qk_rope_head_dim
    parameters = dict(config.rope_parameters)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    positions = torch.arange(512, dtype=torch.float32)[:, None] * inv_freq[None]
    want = torch.cat((positions.cos(), positions.sin()), dim=-1) * factor
    rotary = RotaryEmbedding(head, 512, parameters["rope_theta"], parameters)
    torch.testing.assert_close(rotary.cos_sin_cache, want, rtol=1e-6, atol=1e-7)
    assert factor != 1.0  # (the attention factor is applied, not left out)
