"""Speculative decoding: proposals of tokens to follow a request's, verified by the target
model in one step (docs/speculative.md)."""

from pyengine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
