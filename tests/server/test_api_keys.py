"""A key set the operator asked for never comes out empty: an empty --api-key, an
--api-key-file with no key in it (or none at all), or an empty PYENGINE_API_KEY is
refused before the model loads, where each would have left the server open; the
variable's key joins the others."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.server import OUTSIDE_SOURCE_TREE

from pyengine.entrypoints.openai.cli_args import API_KEY_VARIABLE, add_server_arguments, api_keys


def parsed(*argv: str) -> argparse.Namespace:
    return add_server_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_keys_come_from_the_options_the_file_and_the_variable(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("\n  second \n\nthird\n")
    ns = parsed("--api-key", "first", "--api-key-file", str(keys))
    assert api_keys(ns, {}) == ["first", "second", "third"]
    assert api_keys(ns, {API_KEY_VARIABLE: " fourth "}) == ["first", "second", "third", "fourth"]
    assert api_keys(parsed(), {}) == []  # (no key asked for: an open server, as vLLM's)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (("--api-key", ""), {}, "--api-key: a key is empty"),
        (("--api-key", "k", "--api-key", "  "), {}, "--api-key: a key is empty"),
        ((), {API_KEY_VARIABLE: " "}, f"{API_KEY_VARIABLE} is set and empty"),
    ],
)
def test_an_empty_key_is_refused(
    argv: tuple[str, ...], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        api_keys(parsed(*argv), environ)


def test_a_key_file_without_keys_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no key: the server would take every request"):
        api_keys(parsed("--api-key", "k", "--api-key-file", str(empty)), {})
    with pytest.raises(ValueError, match="--api-key-file .*missing: No such file"):
        api_keys(parsed("--api-key-file", str(tmp_path / "missing")), {})


def test_the_server_refuses_to_start_before_loading_the_model(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("")
    run = subprocess.run(
        [sys.executable, "-m", "pyengine.entrypoints.openai.api_server",
         "--model", str(tmp_path / "no-such-model"), "--api-key-file", str(empty)],
        capture_output=True, text=True, timeout=120, cwd=OUTSIDE_SOURCE_TREE,
    )  # fmt: skip
    assert run.returncode != 0
    # (the key file is refused first: the model, which does not exist, was never looked up)
    assert "holds no key" in run.stderr and "no-such-model" not in run.stderr
