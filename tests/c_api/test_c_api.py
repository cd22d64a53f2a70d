"""The C API (pyengine/pyengine_c.h, libpyengine) from C and C++ programs built as an
embedder builds them: against the installed package's files (not the build tree), in a
fresh folder, by CMake (find_package(pyengine)) and by pkg-config. Their greedy tokens
are LLM.generate's; checks.c covers errors, aborts, shutdown and what is left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.smollm2 import default_llm

from pyengine import SamplingParams
from pyengine.capi import files

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "cpp" / "examples"
STRICT_C = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _need(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")


def _run(
    args: list[str | Path],
    stdin: str = "",
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYENGINE_")}
    done = subprocess.run(
        [str(a) for a in args], input=stdin, capture_output=True, text=True, timeout=600,
        env={**environment, **(env or {})}, cwd=cwd,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(f"{args[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def _pkg_config(*args: str) -> list[str]:
    env = {**os.environ, "PKG_CONFIG_PATH": str(files.pkgconfig_dir())}
    out = subprocess.run(["pkg-config", *args, "pyengine"], capture_output=True, text=True,
                         env=env, check=True).stdout  # fmt: skip
    return out.split()


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    return default_llm(dtype="float32")


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The examples, built by CMake against the installed package."""
    _need("cmake", "c++", "cc")
    build = tmp_path_factory.mktemp("examples")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", EXAMPLES, "-B", build, *generator, f"-Dpyengine_DIR={files.cmake_dir()}",
          "-DCMAKE_BUILD_TYPE=Release"])  # fmt: skip
    _run(["cmake", "--build", build])
    return build


@pytest.fixture(scope="module")
def pkg_config_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stream_completion.c and checks.c, built by pkg-config's flags, as strict C99."""
    _need("pkg-config", "cc")
    build = tmp_path_factory.mktemp("pkg_config")
    flags = _pkg_config("--cflags", "--libs")
    for source in (EXAMPLES / "stream_completion.c", Path(__file__).parent / "checks.c"):
        _run(["cc", *STRICT_C, source, *flags, "-o", build / source.stem])
    return build


def _ids(line: str) -> list[int]:
    return [int(t) for t in line.split()]


def test_the_header_is_c99(tmp_path: Path) -> None:
    _need("cc")
    source = tmp_path / "header.c"
    source.write_text(
        "#include <pyengine/pyengine_c.h>\n"
        "int main(void) { return pyengine_abi_version() == PYENGINE_ABI_VERSION ? 0 : 1; }\n"
    )
    _run(["cc", *STRICT_C, source, files.compiler_flags(), *files.linker_flags().split(),
          "-o", tmp_path / "header"])  # fmt: skip
    _run([tmp_path / "header"])  # (loads libpyengine; starts no interpreter)


def test_the_library_exports_only_its_api() -> None:
    _need("nm")
    out = _run(["nm", "-D", "--defined-only", files.library()]).stdout
    symbols = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "pyengine_submit" in symbols
    assert [s for s in symbols if not s.startswith("pyengine_")] == []


def test_python_m_pyengine_says_where_the_files_are(tmp_path: Path) -> None:
    # (from another folder: in the repository's root, -m would find the source tree)
    python_m = [sys.executable, "-m", "pyengine"]
    flags = _run([*python_m, "--includes", "--libs"], cwd=tmp_path).stdout.split()
    assert flags[0] == f"-I{files.include_dir()}"
    assert (files.include_dir() / "pyengine" / "pyengine_c.h").is_file()
    assert (files.include_dir() / "pyengine" / "pyengine.hpp").is_file()
    cmakedir = Path(_run([*python_m, "--cmakedir"], cwd=tmp_path).stdout.strip())
    assert (cmakedir / "pyengineConfig.cmake").is_file()
    assert files.library().is_file()


def test_the_c_programs_greedy_tokens_are_generates(pkg_config_build: Path, llm) -> None:  # type: ignore[no-untyped-def]
    out = _run([pkg_config_build / "stream_completion", "--ids", "--max-tokens", "24",
                "--option", "dtype=float32", *PROMPTS]).stdout  # fmt: skip
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [_ids(line) for line in out.splitlines()] == [o.outputs[0].token_ids for o in expected]


def test_the_c_program_streams_text(cmake_build: Path, llm) -> None:  # type: ignore[no-untyped-def]
    out = _run([cmake_build / "stream_completion", "--max-tokens", "24", "--option",
                "dtype=float32", PROMPTS[0]]).stdout  # fmt: skip
    expected = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)[0]  # fmt: skip
    assert out == expected.outputs[0].text + "\n"


@pytest.mark.parametrize("stream", [False, True], ids=["wait", "callbacks"])
def test_eight_threads_get_each_requests_own_tokens(cmake_build: Path, llm, stream: bool) -> None:  # type: ignore[no-untyped-def]
    prompts = [f"Question {i}: name {i % 7 + 2} {['cities', 'rivers', 'poets'][i % 3]}."
               for i in range(64)]  # fmt: skip
    args = [cmake_build / "batch_threads", "--threads", "8", "--ids", "--ignore-eos",
            "--max-tokens", "12", "--option", "dtype=float32"]  # fmt: skip
    done = _run([*args, *(["--stream"] if stream else [])], stdin="\n".join(prompts) + "\n")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert [_ids(line) for line in done.stdout.splitlines()] == [
        o.outputs[0].token_ids for o in expected
    ]
    assert '"requests": 64, "output_tokens": 768' in done.stderr


def test_the_cpp_chat_replies_as_llm_chat(cmake_build: Path, llm) -> None:  # type: ignore[no-untyped-def]
    turns = ["Hi, who are you?", "What can you do?"]
    out = _run([cmake_build / "chat", "--max-tokens", "20", "--option", "dtype=float32"],
               stdin="\n".join(turns) + "\n\n").stdout  # fmt: skip
    replies = [r.strip() for r in out.split("> ")[1:3]]
    messages: list[dict[str, str]] = []
    for turn, reply in zip(turns, replies, strict=True):
        messages.append({"role": "user", "content": turn})
        expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20),
                            use_tqdm=False)[0].outputs[0].text  # fmt: skip
        assert reply == expected.strip()
        messages.append({"role": "assistant", "content": reply})


def _checks(build: Path, *args: str) -> None:
    done = _run([build / "checks", *args], check=False)
    failed = [line for line in done.stdout.splitlines() if not line.startswith("ok ")]
    assert done.returncode == 0 and not failed, done.stdout + done.stderr


def test_bad_input_gives_error_codes_and_messages(pkg_config_build: Path) -> None:
    _checks(pkg_config_build, "errors")


def test_requests_abort_and_the_engine_shuts_down_clean(pkg_config_build: Path, llm) -> None:  # type: ignore[no-untyped-def]
    # (abort frees the KV blocks; a closed engine says so; no thread or worker is left)
    _checks(pkg_config_build, "engine", "dtype=float32")


@pytest.mark.slow
def test_worker_processes_end_with_the_engine(pkg_config_build: Path, llm) -> None:  # type: ignore[no-untyped-def]
    # (the `mp` executor's workers are spawned from the embedded interpreter: they must
    # run the environment's python, and be gone after the shutdown)
    _checks(pkg_config_build, "engine", "dtype=float32", "distributed_executor_backend=mp")


def test_embeddings_are_llm_embeds(pkg_config_build: Path, tmp_path: Path) -> None:
    from helpers.tiny_pooling import make_pooling_checkpoint

    from pyengine import LLM

    make_pooling_checkpoint("bert", tmp_path)
    texts = ["w1 w2 w3", "w7 w8 w9 w10 w11"]
    done = _run([pkg_config_build / "checks", "embed", tmp_path, *texts])
    rows = [[float(x) for x in line.split()[1:]] for line in done.stdout.splitlines()
            if line.startswith("row")]  # fmt: skip
    reference = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**24, runner="pooling")
    expected = [o.outputs.embedding for o in reference.embed(texts, use_tqdm=False)]
    assert len(rows) == 2
    for row, want in zip(rows, expected, strict=True):
        assert row == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_a_missing_environment_is_an_error(pkg_config_build: Path) -> None:
    done = _run([pkg_config_build / "stream_completion", "x"],
                env={"PYENGINE_PYTHON": "/no/such/python"}, check=False)  # fmt: skip
    assert done.returncode == 1
    assert "PYENGINE_ERROR_ENVIRONMENT" in done.stderr and "/no/such/python" in done.stderr


def test_an_environment_without_pyengine_is_an_error(pkg_config_build: Path,
                                                      tmp_path: Path) -> None:  # fmt: skip
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "bare"],
                   check=True)  # fmt: skip
    done = _run([pkg_config_build / "stream_completion", "x"],
                env={"PYENGINE_PYTHON": str(tmp_path / "bare" / "bin" / "python")},
                check=False)  # fmt: skip
    assert done.returncode == 1
    assert "PYENGINE_ERROR_ENVIRONMENT" in done.stderr
    assert "No module named 'pyengine'" in done.stderr


def _sampling_reference(llm, adapter: Path) -> dict[str, list]:  # type: ignore[no-untyped-def]
    """What checks.c's sampling requests give through LLM.generate, in one batch too."""
    from pyengine import LoRARequest, StructuredOutputsParams

    tokenizer = llm.get_tokenizer()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    france = "The capital of France is"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def greedy(**fields: object) -> SamplingParams:
        return SamplingParams(**{"temperature": 0, "max_tokens": 8, **fields})  # type: ignore[arg-type]

    requests = {
        "logprobs": (france, greedy(logprobs=3)),
        "stop": ("Count from one to ten: one, two, three,", greedy(max_tokens=40,
                                                                    stop=[" seven"])),
        "seeded": (france, greedy(temperature=1.0, seed=1234)),
        "n2": (france, greedy(temperature=0.8, seed=7, n=2)),
        "json": ("A JSON object with an integer field a:", greedy(
            max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))),
        "regex": ("Call 555-", greedy(
            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[0-9]{4}"))),
        "chat": ({"prompt": chat, "prompt_token_ids": tokenizer.encode(chat, False)}, greedy()),
        "extra": (france, greedy(bad_words=[" Paris"], min_tokens=4)),
        "lora": (france, greedy()),
    }  # fmt: skip
    loras = [LoRARequest("adapter", 1, str(adapter)) if name == "lora" else None
             for name in requests]  # fmt: skip
    outputs = llm.generate([p for p, _ in requests.values()], [s for _, s in requests.values()],
                           use_tqdm=False, lora_request=loras)  # fmt: skip
    return dict(zip(requests, (o.outputs for o in outputs), strict=True))


@pytest.mark.slow
def test_every_sampling_parameter_reaches_the_engine(pkg_config_build: Path, llm,
                                                     tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    from helpers.lora import write_random_adapter

    from pyengine import LLM

    write_random_adapter(llm.llm_engine.model_config, tmp_path / "adapter", seed=3)
    options = ["dtype=float32", "enable_lora=true", "max_lora_rank=8", "max_loras=1"]
    done = _run([pkg_config_build / "checks", "sampling", tmp_path / "adapter", *options])
    assert "FAIL" not in done.stdout, done.stdout
    got: dict[tuple[str, str], list[str]] = {}
    for line in done.stdout.splitlines():
        kind, name, *rest = line.split(" ")
        if kind in ("logprobs", "top"):  # (a line an event: appended)
            got.setdefault((kind, name), []).extend(rest)
        else:
            got[(kind, f"{name}/{rest.pop(0)}")] = rest
    reference = LLM(dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=1)
    expected = _sampling_reference(reference, tmp_path / "adapter")
    reasons = {"stop": 1, "length": 2}
    for name, samples in expected.items():
        for sample in samples:
            key = f"{name}/{sample.index}"
            assert _ids(" ".join(got[("tokens", key)])) == sample.token_ids, key
            assert int(got[("finish", key)][0]) == reasons[sample.finish_reason], key
            assert bytes.fromhex(got[("text", key)][0]).decode() == sample.text, key
    assert expected["stop"][0].finish_reason == "stop"  # (the stop string ended it)
    assert expected["lora"][0].token_ids != expected["logprobs"][0].token_ids
    positions = expected["logprobs"][0].logprobs
    chosen = [float(x) for x in got[("logprobs", "logprobs")]]
    assert len(chosen) == len(positions)
    top = [float(x) for x in got[("top", "logprobs")]]
    for i, (token, position) in enumerate(zip(expected["logprobs"][0].token_ids, positions,
                                              strict=True)):  # fmt: skip
        assert chosen[i] == pytest.approx(position[token].logprob, abs=1e-5)
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:3]
        for j, (other, logprob) in enumerate(ranked):
            assert int(top[6 * i + 2 * j]) == other
            assert top[6 * i + 2 * j + 1] == pytest.approx(logprob.logprob, abs=1e-5)


def test_an_engine_left_open_ends_with_the_process(pkg_config_build: Path, llm) -> None:  # type: ignore[no-untyped-def]
    # (requests running, one with a callback; `mp` workers, which must not outlive it)
    start = time.monotonic()
    done = _run([pkg_config_build / "checks", "exit", "distributed_executor_backend=mp"],
                check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok exit_no_worker_left" in done.stdout, done.stdout
    assert time.monotonic() - start < 120
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr
