"""What the distributed tests share: a tiny dummy-weights Llama folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.tiny_models import TINY_LLAMA


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """TINY_LLAMA's config.json alone: run with load_format="dummy"."""
    folder: Path = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)
