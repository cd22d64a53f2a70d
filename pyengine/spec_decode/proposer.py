"""The Proposer seam: what one speculative method does, wherever the engine would
otherwise ask which method it runs. The engine chooses a proposer once, at start, from
speculative_config's method (spec_decode/registry.py); nothing else reads the method."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pyengine import Scheduler
    from pyengine.config import ModelConfig
    from pyengine.spec_decode.config import SpeculativeConfig

# A model's config read from its path (no weights): how a proposer whose drafts come
# from another model checks it before the target loads.
ReadModelConfig = Callable[[str], "ModelConfig"]


class Proposer(ABC):
    """A speculative method. Its drafts are either proposed on the engine's side, before
    the scheduler plans a step (propose), or made by a model in the worker, in the very
    step that verifies them (drafts_in_step: the scheduler only reserves their places)."""

    # The method's name in speculative_config.
    name: ClassVar[str]
    # speculative_config keys only this method may set (None elsewhere).
    own_keys: ClassVar[tuple[str, ...]] = ()
    # Whether the worker's draft model makes the drafts, in the step that verifies them.
    drafts_in_step: ClassVar[bool] = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec

    @classmethod
    def check_config(cls, spec: SpeculativeConfig) -> None:
        """Refuses a speculative_config the method cannot run (ValueError)."""
        return None  # (most methods take any)

    def check_engine(self, world_size: int, kv_offload: bool) -> None:
        """Refuses what the method cannot run with (ValueError), before any loading."""
        return None  # (most methods run with anything)

    def draft_token_cost(
        self, target: ModelConfig, max_model_len: int, read_config: ReadModelConfig
    ) -> float:
        """What one draft token costs to make, against a one-token step of the target
        (0: proposing is free beside the step); checks the draft, before the target's
        weights load."""
        return 0.0

    def configure(self, scheduler: Scheduler) -> None:
        """Sets a scheduler up for the method's drafts, once, at start."""
        return None  # (most methods need nothing set up)

    @abstractmethod
    def propose(self, scheduler: Scheduler) -> None:
        """Gives the scheduler's decoding requests their drafts (or their places) for the
        step it plans next."""
