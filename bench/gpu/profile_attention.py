"""A target for Nsight Compute: one decode attention call (64 requests of 4k tokens) and
one prefill (a 4k-token prompt), bfloat16, 32 query / 8 KV heads, head 128, each after a
warm-up, e.g.

    ncu --clock-control none -k regex:flash_attention_kernel --launch-skip 1 \\
        --launch-count 1 --section SpeedOfLight python3 -m bench.gpu.profile_attention
"""

from __future__ import annotations

import sys

import torch

from .kernels import decode_seconds, prefill_seconds

if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "both"
    if part in ("decode", "both"):
        decode_seconds(64, 4096, 32, 8, 128, 16, torch.bfloat16, repeats=1)
    if part in ("prefill", "both"):
        prefill_seconds(4096, 32, 8, 128, 16, torch.bfloat16, repeats=1)
