"""The OpenAI API's request bodies, with vLLM's extra sampling fields. Fields a client may
send that pyengine does not use are accepted and ignored, as OpenAI's own clients send some
by default; those that would change the output are refused with an APIError (errors.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.tool_parsers import NOT_JSON
from pyengine.outputs import PositionLogprobs
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams, is_int

if TYPE_CHECKING:
    from pyengine.entrypoints.openai.tool_calls import ToolChoice


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields completions and chat share."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's API allows null for fields such as n, stream and echo (SDKs that send
        every field do): it means the default, where the field itself cannot be None."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None
            or key not in fields
            or type(None) in get_args(fields[key].annotation)
        }

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: each prompt token's logprob and its top this many (not streamed)
    prompt_logprobs: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (one of them a request)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the request's place in line under --scheduling-policy priority (lower
    # first; the scheduler's int32), and the salt that keeps its prefix-cache blocks to
    # requests of that salt
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    cache_salt: str | None = None
    # The field that gave the constraint (structured_outputs_params): its errors name it.
    _constraint_param: str = PrivateAttr(default="structured_outputs")

    @property
    def constraint_param(self) -> str:
        return self._constraint_param

    def structured_outputs_params(
        self, tool_call: StructuredOutputsParams | None = None
    ) -> StructuredOutputsParams | None:
        """The request's constraint, from whichever field gives it (`tool_call`: a forced
        tool call's); APIError naming the field where it is malformed, or where two fields
        give one."""
        given: list[tuple[str, dict[str, Any] | StructuredOutputsParams]] = []
        if tool_call is not None:
            given.append(("tool_choice", tool_call))
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(
                        "response_format json_schema needs json_schema.schema, a JSON schema "
                        "object", param="response_format",
                    )  # fmt: skip
                given.append(("response_format", {"json": schema}))
            elif kind not in (None, "text"):
                raise APIError(
                    f"response_format type {kind!r} is not one of text, json_object, "
                    "json_schema", param="response_format",
                )  # fmt: skip
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}  # fmt: skip
        for name, key in guided.items():
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise APIError(f"give one structured output constraint, got {names}", param=given[1][0])
        name, fields = given[0]
        self._constraint_param = name
        if isinstance(fields, StructuredOutputsParams):
            return fields
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as error:
            raise APIError(f"{name}: {error}", param=name) from None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        tool_call: StructuredOutputsParams | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        logit_bias = None
        if self.logit_bias:
            try:  # OpenAI's keys are token ids as strings
                logit_bias = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise APIError("logit_bias keys must be token ids", param="logit_bias") from None
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise APIError(
                f"temperature must be in [0, 2], got {self.temperature}", param="temperature"
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )
        if self.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }
        try:
            return SamplingParams(
                n=self.n,
                stop=self.stop,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                stop_token_ids=self.stop_token_ids,
                skip_special_tokens=self.skip_special_tokens
                if skip_special_tokens is None
                else skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias,
                structured_outputs=self.structured_outputs_params(tool_call),
                **{k: v for k, v in optional.items() if v is not None},  # type: ignore[arg-type]
            )
        except ValueError as error:
            # "SamplingParams.max_tokens must be ..." -> the request's field name
            message = str(error).removeprefix("SamplingParams.")
            raise APIError(message, param=message.split(" ", 1)[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: the n best beams of a beam search (entrypoints/beam_search.py), scored by
    # their summed logprobs over their length to the power length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        best_of = self.best_of if self.best_of is not None else self.n
        if not is_int(best_of) or best_of < self.n:
            raise APIError(
                f"best_of must be an integer of at least n ({self.n}), got {best_of!r}",
                param="best_of",
            )
        if self.logprobs is not None and self.logprobs < 0:  # the engine has the upper bound
            raise APIError(f"logprobs must be at least 0, got {self.logprobs}", param="logprobs")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        params = self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)
        if best_of == self.n:
            return params
        # (best_of samples, ranked by their tokens' summed logprobs: those are needed)
        return replace(params, n=best_of, logprobs=params.logprobs or 0)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


# What the chat template is handed from the request's own fields, which its
# chat_template_kwargs may not replace.
TEMPLATE_ARGUMENTS = frozenset({"messages", "chat_template", "add_generation_prompt"})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def to_template(self, index: int = 0) -> dict[str, Any]:
        """As chat templates take it: content as one string, a call's arguments as an
        object (as vLLM hands them: templates write them with tojson)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"message content part of type {part.type!r} is not supported (text only)",
                        param="messages",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None and not (self.role == "assistant" and self.tool_calls):
            raise APIError(  # (as OpenAI: only an assistant's tool calls stand without it)
                f"messages[{index}]: a {self.role} message needs content", param="messages"
            )
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.role == "tool":
            if not self.tool_call_id:
                raise APIError(
                    f"messages[{index}]: a tool message needs the tool_call_id it answers",
                    param="messages",
                )
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            if self.role != "assistant":
                raise APIError(
                    f"messages[{index}]: only assistant messages have tool_calls",
                    param="messages",
                )
            message["tool_calls"] = [
                _template_call(f"messages[{index}].tool_calls[{k}]", call)
                for k, call in enumerate(self.tool_calls)
            ]
        return message


def string_field(value: Any, where: str, param: str) -> str:
    """A request's string at `where` (of field `param`); an APIError naming it otherwise."""
    if not isinstance(value, str):
        raise APIError(f"{where} must be a string", param=param)
    return value


def joined_text(value: Any, where: str, param: str, kinds: tuple[str, ...]) -> str:
    """A string, or text parts (of these types) joined by newlines, as the Responses and
    Messages APIs give a message's content; an APIError naming the part otherwise."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise APIError(f"{where} must be a string or a list of text parts", param=param)
    texts = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise APIError(f"{where}[{k}]: a part of type {kind!r} is not supported here "
                           f"({', '.join(kinds)})", param=param)  # fmt: skip
        texts.append(string_field(part.get("text"), f"{where}[{k}].text", param))
    return "\n".join(texts)


def prompt_logprobs_json(
    token_ids: list[int], positions: list[PositionLogprobs | None] | None
) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: for each prompt token (None for the first), its logprob
    and the top ones', by token id."""
    if positions is None:
        return None
    return [None if position is None else {
        str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token, lp in position.items()
    } for position in positions[: len(token_ids)]]  # fmt: skip


def _template_call(where: str, call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call (OpenAI's: arguments as JSON text) with its arguments as an object."""
    function = call.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, str | dict):
        raise APIError(
            f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments": '
            '...}}', param="messages",
        )  # fmt: skip
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except NOT_JSON as error:
            raise APIError(
                f"{where}.function.arguments is not JSON: {error}", param="messages"
            ) from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    chat_template: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # A thinking model's reasoning bounded (with --reasoning-parser): pyengine's
    # max_thinking_tokens, vLLM's thinking_token_budget, or OpenAI's reasoning_effort
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    max_thinking_tokens: int | None = None
    thinking_token_budget: int | None = None

    def thinking_budget(self) -> tuple[int | None, str]:
        """The most reasoning tokens the request allows (None: no bound), and the field
        that says so: its count, or its effort's (vLLM's budgets: low 1024, medium 2048,
        high 8192; minimal 0)."""
        given = [n for n in ("max_thinking_tokens", "thinking_token_budget")
                 if getattr(self, n) is not None]  # fmt: skip
        if len(given) > 1:
            raise APIError("give one of max_thinking_tokens and thinking_token_budget",
                           param="max_thinking_tokens")  # fmt: skip
        if not given:
            effort = self.reasoning_effort
            return (None if effort is None else EFFORT_BUDGETS[effort]), "reasoning_effort"
        budget = getattr(self, given[0])
        if budget < 0:
            raise APIError(f"{given[0]} must be at least 0, got {budget}", param=given[0])
        return int(budget), given[0]

    def to_sampling_params(self, tools: ToolChoice) -> SamplingParams:
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        taken = sorted(TEMPLATE_ARGUMENTS & self.chat_template_kwargs.keys())
        if taken:
            raise APIError(
                f"chat_template_kwargs may not set {', '.join(taken)}: the request's own "
                "fields give them",
                param="chat_template_kwargs",
            )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            if self.top_logprobs < 0:  # the engine has the upper bound (max_logprobs)
                raise APIError(
                    f"top_logprobs must be at least 0, got {self.top_logprobs}",
                    param="top_logprobs",
                )
        max_tokens = self.max_completion_tokens or self.max_tokens
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            max_tokens = self.max_completion_tokens  # let the check name the problem
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # Parsers find calls by markers that are special tokens in some vocabularies (unless
        # the request says otherwise).
        keep_special = tools.mode == "auto" and "skip_special_tokens" not in self.model_fields_set
        return self.sampling_params(
            max_tokens, logprobs, tool_call=tools.constraint(),
            skip_special_tokens=False if keep_special else None,
        )  # fmt: skip


# reasoning_effort's budgets of reasoning tokens (vLLM's defaults; minimal: none)
EFFORT_BUDGETS = {"minimal": 0, "low": 1024, "medium": 2048, "high": 8192}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
