"""POST /v1/chat/completions: messages through the chat template, whole or streamed; a
thinking model's reasoning apart from its answer (`reasoning_content`) where the server
has a reasoning parser, the answer alone parsed for tool calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jinja2

from pyengine.engine.async_engine import RequestStream
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    prompt_logprobs_json,
)
from pyengine.entrypoints.openai.reasoning_parsers import ReasoningParser
from pyengine.entrypoints.openai.serving import (
    SSE_DONE,
    EncodedPrompt,
    OpenAIServing,
    PromptResult,
    envelope,
    merge,
    random_id,
    sse,
    usage,
)
from pyengine.entrypoints.openai.tool_calls import ToolCallStream, ToolChoice, finish_reason
from pyengine.entrypoints.openai.tool_parsers import ToolParser
from pyengine.outputs import PositionLogprobs
from pyengine.sampling_params import SamplingParams


def _logprob_entry(token: str, logprob: float, raw: bytes) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(raw)}


@dataclass(frozen=True)
class DeltaPiece:
    """One part of a streamed chat delta, as the APIs over the chat (Messages, Responses)
    take them: reasoning or content text, a tool call's start (its index, id and name),
    or its arguments' text."""

    kind: str  # "reasoning", "content", "call" or "arguments"
    text: str = ""
    call_index: int = 0
    call_id: str = ""
    name: str = ""


def delta_pieces(delta: dict[str, Any]) -> list[DeltaPiece]:
    """A chat chunk's delta in the order its parts come: reasoning, content, then each
    tool call's start (where its first delta names it) and arguments."""
    pieces = []
    if delta.get("reasoning_content"):
        pieces.append(DeltaPiece("reasoning", delta["reasoning_content"]))
    if delta.get("content"):
        pieces.append(DeltaPiece("content", delta["content"]))
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {}
        if call.get("id") is not None:
            pieces.append(DeltaPiece("call", call_index=call.get("index", 0), call_id=call["id"],
                                     name=function.get("name") or ""))  # fmt: skip
        if function.get("arguments"):
            pieces.append(DeltaPiece("arguments", function["arguments"]))
    return pieces


@dataclass(frozen=True)
class ChatRun:
    """A chat completion started in the engine: what its answer is made from."""

    request: ChatCompletionRequest
    tools: ToolChoice
    model: str
    request_id: str
    prompt: EncodedPrompt
    streams: list[RequestStream]


class ChatServing(OpenAIServing):
    # A request's own chat_template is a program the server would run: refused unless the
    # server was started trusting them (vLLM's --trust-request-chat-template).
    trust_request_chat_template = False
    # --enable-auto-tool-choice's parser (--tool-call-parser): None, no "auto" tool choice
    tool_parser: ToolParser | None = None
    # --reasoning-parser's: None, the whole text is the answer
    reasoning_parser: ReasoningParser | None = None
    # --structured-outputs-in-reasoning: a structured output constrains the reasoning too
    constrains_reasoning = False

    async def render(
        self,
        messages: list[ChatMessage],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> EncodedPrompt:
        """The conversation as the model's chat template writes it, and its tokens. In a
        worker thread: a slow template must not hold up the event loop."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                "a request's chat_template runs only on a server started with "
                "--trust-request-chat-template",
                param="chat_template",
            )
        return await asyncio.to_thread(
            self._render, messages, chat_template, add_generation_prompt, kwargs
        )

    def _render(
        self,
        messages: list[ChatMessage],
        chat_template: str | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> EncodedPrompt:
        try:
            text = self.tokenizer.apply_chat_template(
                [m.to_template(i) for i, m in enumerate(messages)],
                chat_template=chat_template or self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except (jinja2.TemplateError, ValueError) as error:
            raise APIError(f"the chat template failed: {error}", param="messages") from None
        return text, self.encode(text, "messages", add_special_tokens=False)

    def logprobs_json(
        self, token_ids: list[int], positions: Sequence[PositionLogprobs], top: int
    ) -> dict[str, Any]:
        content = []
        tokenizer = self.tokenizer
        for token, position in zip(token_ids, positions, strict=True):
            chosen = position[token]
            ranked = sorted(
                ((t, lp) for t, lp in position.items() if lp.rank <= top),
                key=lambda item: item[1].rank,
            )
            entry = _logprob_entry(
                chosen.decoded_token or tokenizer.token_text(token),
                chosen.logprob,
                tokenizer.token_bytes(token),
            )
            entry["top_logprobs"] = [
                _logprob_entry(lp.decoded_token or "", lp.logprob, tokenizer.token_bytes(t))
                for t, lp in ranked
            ]
            content.append(entry)
        return {"content": content}

    async def tool_choice(
        self, request: ChatCompletionRequest, with_grammar: bool = True
    ) -> ToolChoice:
        """The request's tools, checked; a forced call's grammar compiled (an APIError
        naming `tools` where the backend does not take the functions' schemas), unless
        the caller only renders the prompt (`with_grammar` False)."""
        tools = ToolChoice.of(
            request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_parser
        )
        if with_grammar:
            await self.compile_grammar(tools.constraint(), "tools", "the parameters' schema")
        return tools

    async def create(
        self, request: ChatCompletionRequest
    ) -> dict[str, Any] | tuple[AsyncIterator[str], list[RequestStream]]:
        run = await self.start_chat(request)
        if request.stream:
            return self._stream(run), run.streams
        return await self.whole(run)

    async def whole(self, run: ChatRun) -> dict[str, Any]:
        """A started chat's chat.completion object, once its requests end."""
        (result,) = await self.collect([run.prompt], run.streams, run.request.n)
        # (off the event loop: a long answer's logprobs and tool calls take a while)
        return await asyncio.to_thread(
            self._response, run.request, run.tools, run.model, run.request_id, result
        )

    async def prompt_of(self, request: ChatCompletionRequest, tools: ToolChoice) -> EncodedPrompt:
        """The request's conversation (and its tools) through the chat template."""
        template_kwargs = dict(request.chat_template_kwargs)
        if request.reasoning_effort is not None:  # (gpt-oss's template reads it)
            template_kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        if tools.template_tools() is not None:
            template_kwargs.setdefault("tools", tools.template_tools())
        return await self.render(
            request.messages,
            request.chat_template,
            request.add_generation_prompt,
            **template_kwargs,
        )

    def with_reasoning(
        self, params: SamplingParams, request: ChatCompletionRequest, prompt: EncodedPrompt
    ) -> SamplingParams:
        """The params as the reasoning parser needs them: the special tokens its markers
        are kept in the text; and where the prompt leaves the model reasoning, its end of
        thinking for the engine, if a structured output must wait for the answer or the
        reasoning has a budget. A budget needs the parser (which knows the end); a prompt
        that closed the thinking (thinking off) has no budget to keep. (reasoning_effort
        reaches the template, gpt-oss's, whatever the server; without a parser it bounds
        nothing.)"""
        parser = self.reasoning_parser
        budget, field = request.thinking_budget()
        keep = parser is not None and parser.needs_special_tokens
        if keep and "skip_special_tokens" not in request.model_fields_set:
            params = replace(params, skip_special_tokens=False)
        if parser is None:
            if budget is not None and field != "reasoning_effort":
                raise APIError(
                    f"{field}: a thinking budget needs a server started with "
                    "--reasoning-parser", param=field,
                )  # fmt: skip
            return params
        constrained = params.structured_outputs is not None
        if constrained and self.constrains_reasoning:
            if budget is not None:
                raise APIError(
                    f"{field}: a thinking budget and a structured output that constrains "
                    "the reasoning too (--structured-outputs-in-reasoning) do not go "
                    "together", param=field,
                )  # fmt: skip
            return params
        if (budget is None and not constrained) or not parser.thinks_after(prompt[0] or ""):
            return params
        end = self.tokenizer.encode(parser.end, add_special_tokens=False)
        return replace(params, thinking_end_token_ids=end, max_thinking_tokens=budget)

    async def start_chat(self, request: ChatCompletionRequest) -> ChatRun:
        """The request checked, rendered and started in the engine."""
        model = self.check_model(request.model)
        tools = await self.tool_choice(request)
        params = request.to_sampling_params(tools)
        if tools.constraint() is None:
            await self.compile_grammar(params.structured_outputs, request.constraint_param)
        prompt = await self.prompt_of(request, tools)
        params = self.with_reasoning(params, request, prompt)
        request_id = random_id("chatcmpl")
        streams = await self.start(
            [prompt], params, request_id, "messages", self.adapter(request.model),
            request.priority, request.cache_salt,
        )  # fmt: skip
        return ChatRun(request, tools, model, request_id, prompt, streams)

    def _response(
        self,
        request: ChatCompletionRequest,
        tools: ToolChoice,
        model: str,
        request_id: str,
        result: PromptResult,
    ) -> dict[str, Any]:
        choices = []
        for k, c in enumerate(result.choices):
            logprobs = None
            if request.logprobs:
                logprobs = self.logprobs_json(c.token_ids, c.logprobs, request.top_logprobs or 0)
            answer, reasoning = c.text, None
            if self.reasoning_parser is not None:
                reasoned = self.reasoning_parser.split(c.text)
                answer, reasoning = reasoned.content or "", reasoned.reasoning
            parsed = tools.parse(answer, self.tool_parser)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if parsed.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            choices.append(
                {
                    "index": k,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(tools, parsed, c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
        extra = {}
        if request.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(
                result.prompt[1], result.prompt_logprobs
            )
        return envelope(
            request_id, "chat.completion", int(time.time()), model, choices,
            usage=self.usage([result]), **extra,
        )  # fmt: skip

    async def _stream(self, run: ChatRun) -> AsyncIterator[str]:
        async for chunk in self.chunks(run):
            yield sse(chunk)
        yield SSE_DONE

    async def chunks(self, run: ChatRun) -> AsyncIterator[dict[str, Any]]:
        """A started chat's chat.completion.chunk objects (the Responses and Messages
        APIs' streams are made of them too)."""
        request, tools, model, request_id = run.request, run.tools, run.model, run.request_id
        prompt, streams = run.prompt, run.streams
        created = int(time.time())
        answers = [ToolCallStream(tools, self.tool_parser) for _ in range(request.n)]
        parser = self.reasoning_parser
        thoughts = [None if parser is None else parser.stream() for _ in range(request.n)]

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return envelope(request_id, "chat.completion.chunk", created, model, choices, **extra)

        for k in range(request.n):  # the role first, as OpenAI sends it
            yield chunk(
                [
                    {
                        "index": k,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        completion_tokens, cached = 0, 0
        # (the prompt's logprobs, asked for, go out once, beside the first delta)
        prompt_extra: dict[str, Any] | None = None
        async for _, out in merge(streams):
            cached = out.num_cached_tokens
            if request.prompt_logprobs is not None and out.prompt_logprobs is not None:
                prompt_extra = {
                    "prompt_logprobs": prompt_logprobs_json(prompt[1], out.prompt_logprobs)
                }
            for d in out.outputs:
                completion_tokens += len(d.token_ids)
                logprobs = None
                if request.logprobs and d.logprobs is not None:
                    logprobs = self.logprobs_json(
                        d.token_ids, d.logprobs, request.top_logprobs or 0
                    )
                answer, thought = answers[d.index], thoughts[d.index]
                finished = d.finish_reason is not None
                text, reasoning = d.text, None
                if thought is not None:  # (the reasoning first, the answer's part after it)
                    sent = thought.feed(d.text, finished)
                    text, reasoning = sent.content or "", sent.reasoning
                deltas = answer.deltas(text, finished)
                if reasoning is not None:
                    deltas.insert(0, {"reasoning_content": reasoning})
                if not deltas and (logprobs is not None or finished):
                    deltas = [{}]  # (the logprobs, or the finish, still go out)
                reason = answer.finish_reason(d.finish_reason) if finished else None
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    choice = {
                        "index": d.index,
                        "delta": delta,
                        "logprobs": logprobs if k == 0 else None,
                        "finish_reason": reason if last else None,
                        "stop_reason": d.stop_reason if last else None,
                    }
                    yield chunk([choice], **(prompt_extra or {}))
                    prompt_extra = None
        if request.include_usage:
            yield chunk([], usage=usage(len(prompt[1]), completion_tokens, cached))
