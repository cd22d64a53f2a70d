"""The `pyengine` command: serve the OpenAI API, or generate and chat at a terminal.

pyengine serve [MODEL] [--port 8000 ...]
pyengine generate "prompt" [--model MODEL] [--max-tokens 256] [--raw] [ENGINE OPTIONS]
pyengine chat [--model MODEL] [--system "..."] [--reasoning-parser qwen3] [ENGINE OPTIONS]

generate and chat take every engine option serve takes (tensor parallelism,
quantization, KV cache dtype, speculative decoding, LoRA...); with --reasoning-parser a
thinking model's reasoning goes to stderr, its answer to stdout (and alone into the
chat's history).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Iterator

from pyengine.engine.llm_engine import LLMEngine
from pyengine.entrypoints.openai.api_server import serve
from pyengine.entrypoints.openai.cli_args import (
    add_engine_arguments,
    add_server_arguments,
    engine_args,
)
from pyengine.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    reasoning_parser,
)
from pyengine.loader.resolve import DEFAULT_MODEL
from pyengine.outputs import RequestOutput
from pyengine.sampling_params import RequestOutputKind, SamplingParams
from pyengine.tokenizer import Message


def stream_text(
    llm_engine: LLMEngine, token_ids: list[int], params: SamplingParams
) -> Iterator[str]:
    """The text of one request as it is generated (the engine runs nothing else)."""
    request_id = uuid.uuid4().hex
    llm_engine.add_request(request_id, token_ids, params, output_kind=RequestOutputKind.DELTA)
    finished = False
    try:
        while not finished:
            for out in llm_engine.step():
                if out.request_id == request_id and isinstance(out, RequestOutput):
                    finished = out.finished
                    yield "".join(o.text for o in out.outputs)
    finally:
        if not finished:  # Ctrl-C, or the caller stopped reading
            llm_engine.abort_request(request_id)
            llm_engine.discard_finished()


def _add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="a thinking model's format: its reasoning to stderr, apart from the answer",
    )  # fmt: skip
    add_engine_arguments(parser)
    # (a terminal's conversation: a model's whole context is more KV than it needs)
    parser.set_defaults(max_model_len=4096)


def _llm_engine(ns: argparse.Namespace) -> LLMEngine:
    print(f"loading {ns.model} ...", file=sys.stderr, flush=True)
    return engine_args(ns).create_engine()


def _params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens)


def _parser(ns: argparse.Namespace) -> ReasoningParser | None:
    return None if ns.reasoning_parser is None else reasoning_parser(ns.reasoning_parser)


def _prompt_ids(llm_engine: LLMEngine, messages: list[Message]) -> list[int]:
    tokenizer = llm_engine.tokenizer
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, False)


def _print_stream(pieces: Iterator[str], parser: ReasoningParser | None = None) -> str:
    """Prints the answer as it comes (its reasoning to stderr, with a parser); returns
    the answer."""
    text = ""
    thought = None if parser is None else parser.stream()
    for piece in pieces:
        answer = piece
        if thought is not None:
            sent = thought.feed(piece, False)
            if sent.reasoning:
                print(sent.reasoning, end="", file=sys.stderr, flush=True)
            answer = sent.content or ""
        text += answer
        print(answer, end="", flush=True)
    if thought is not None:  # (what was held back)
        rest = thought.feed("", True)
        print(rest.reasoning or "", end="", file=sys.stderr)
        text += rest.content or ""
        print(rest.content or "", end="")
    print()
    return text


def generate(ns: argparse.Namespace) -> None:
    llm_engine = _llm_engine(ns)
    tokenizer = llm_engine.tokenizer
    if ns.raw or tokenizer is None or tokenizer.chat_template is None:
        if tokenizer is None:
            raise SystemExit("this model has no tokenizer")
        ids = tokenizer.encode(ns.prompt)
    else:
        system = [{"role": "system", "content": ns.system}] if ns.system else []
        ids = _prompt_ids(llm_engine, [*system, {"role": "user", "content": ns.prompt}])
    _print_stream(stream_text(llm_engine, ids, _params(ns)), _parser(ns))


def chat(ns: argparse.Namespace) -> None:
    llm_engine = _llm_engine(ns)
    messages: list[Message] = [{"role": "system", "content": ns.system}] if ns.system else []
    print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            ids = _prompt_ids(llm_engine, messages)
            reply = _print_stream(stream_text(llm_engine, ids, _params(ns)), _parser(ns))
        except KeyboardInterrupt:  # stops this reply, not the chat
            print()
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pyengine", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve_parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    add_server_arguments(serve_parser)
    generate_parser = commands.add_parser("generate", help="one prompt, streamed to the terminal")
    generate_parser.add_argument("prompt")
    generate_parser.add_argument(
        "--raw", action="store_true", help="the prompt as is, without the chat template"
    )
    _add_generation_arguments(generate_parser)
    chat_parser = commands.add_parser("chat", help="an interactive chat at the terminal")
    _add_generation_arguments(chat_parser)
    ns = parser.parse_args(argv)
    try:
        {"serve": serve, "generate": generate, "chat": chat}[ns.command](ns)
    except KeyboardInterrupt:
        sys.exit(130)
    except ValueError as error:
        sys.exit(f"pyengine {ns.command}: {error}")


if __name__ == "__main__":
    main()
