"""LLM: the offline API (as vLLM's): generate(), chat() and beam_search() over a batch of
prompts; with a pooling model (runner "pooling"), embed(), classify() and score()."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pyengine.engine.engine_args import EngineArgs
from pyengine.engine.input_processor import Prompt
from pyengine.entrypoints.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pyengine.entrypoints.score_pairs import cosine, distinct_texts, score_pairs
from pyengine.lora.request import LoRARequest
from pyengine.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pyengine.pooling_params import PoolingParams
from pyengine.sampling_params import RequestOutputKind, SamplingParams
from pyengine.tokenizer import Message, PyengineTokenizer


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`model` (the default model where None) and any EngineArgs field by name
        (EngineArgs holds every default)."""
        if model is not None:
            engine_args["model"] = model
        self.llm_engine = EngineArgs(**engine_args).create_engine()
        self._ids = itertools.count()

    def get_tokenizer(self) -> PyengineTokenizer:
        if self.llm_engine.tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer (tokenizer=...)")
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids":
        ...}, either with a "cache_salt") to completion, through lora_request's adapter
        (one for all, or one per prompt; None: the base model), with each prompt's
        priority (scheduling_policy "priority": lower first); outputs in input order."""
        batch = _as_batch(prompts)
        params = _params_per_prompt(sampling_params, len(batch))
        loras = _per_prompt(lora_request, len(batch), LoRARequest, "LoRA requests")
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"{len(priority)} priorities for {len(batch)} prompts")
        for lora in dict.fromkeys(loras):  # all checked first
            self.llm_engine.adapters.check(lora)
        encoded = [self.llm_engine.input_processor.encode_prompt(p) for p in batch]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in batch]
        return self._run(encoded, params, use_tqdm, loras, priority, salts)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Each prompt's params.beam_width best sequences (entrypoints/beam_search.py),
        best first; 2 x beam_width logprobs a step, at most the engine's max_logprobs."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"{params!r:.40} is not a BeamSearchParams")
        batch = _as_batch(prompts)
        encoded = [self.llm_engine.input_processor.encode_prompt(p)[1] for p in batch]

        eos = (self.llm_engine.model_config.eos_token_ids or (None,))[0]
        search = BeamSearch(encoded, params, eos)
        while not search.done:
            steps = search.step_prompts()
            outputs = self._run(
                [(None, t) for t in steps], [search.step_params] * len(steps), False
            )
            search.advance([(o.outputs[0].logprobs or [{}])[0] for o in outputs])
        tokenizer = self.llm_engine.tokenizer
        return search.results(tokenizer.decode if tokenizer is not None else lambda ids: "")

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`), normalised unless
        pooling_params says otherwise; outputs in input order."""
        return self.encode(prompts, _with_task(pooling_params, "embed"), use_tqdm)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities (`outputs.probs`), by a classifier model."""
        return self.encode(prompts, _with_task(pooling_params, "classify"), use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """The score (`outputs.score`) of each pair: data_1 against each of data_2 (one
        text), or side by side. A cross-encoder reads each pair at once (the sigmoid of
        its logit); an embedder scores the cosine of the two texts' embeddings."""
        pairs = score_pairs(data_1, data_2)
        pooler = self.llm_engine.config.pooler
        if pooler is not None and pooler.task == "embed":
            params = _with_task(pooling_params, "embed")
            texts = distinct_texts(pairs)  # (each embedded once)
            of = dict(zip(texts, self.encode(texts, params, use_tqdm), strict=True))
            return [
                PoolingRequestOutput(
                    f"{of[a].request_id}-{of[b].request_id}",
                    of[a].prompt_token_ids + of[b].prompt_token_ids,
                    PoolingOutput([cosine(of[a].outputs.data, of[b].outputs.data)]),
                )
                for a, b in pairs
            ]
        processor = self.llm_engine.input_processor
        encoded = [processor.encode_pair(a, b) for a, b in pairs]
        items = [(None, ids, types) for ids, types in encoded]
        return self._pool(items, _with_task(pooling_params, "score"), use_tqdm)

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output (`outputs.data`), as pooling_params asks (its
        task, or the model's: an embedder embeds, a classifier classifies)."""
        batch = _as_batch(prompts)
        processor = self.llm_engine.input_processor
        encoded = [processor.encode_prompt(p) for p in batch]
        items = [(text, ids, None) for text, ids in encoded]
        return self._pool(items, pooling_params or PoolingParams(), use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
            )
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _pool(
        self,
        items: Sequence[tuple[str | None, list[int], list[int] | None]],
        params: PoolingParams,
        use_tqdm: bool,
    ) -> list[PoolingRequestOutput]:
        """Runs pooling requests of (text, token ids, token types) to their outputs."""
        llm_engine = self.llm_engine

        def add(request_id: str, item: tuple[str | None, list[int], list[int] | None]) -> None:
            text, ids, types = item
            llm_engine.add_pooling_request(request_id, ids, params, text, types)

        return self._run_all(items, add, use_tqdm)  # type: ignore[return-value]

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        salts: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        llm_engine = self.llm_engine
        loras = loras or [None] * len(encoded)
        priority = priority or [0] * len(encoded)
        salts = salts or [None] * len(encoded)
        items = list(zip(encoded, params, loras, priority, salts, strict=True))

        def add(request_id: str, item: tuple[Any, ...]) -> None:
            (text, token_ids), p, lora, rank, salt = item
            # One whole output each, once finished: nothing is copied at each step.
            llm_engine.add_request(request_id, token_ids, p, prompt=text,
                                   lora_request=lora, priority=rank, cache_salt=salt,
                                   output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip

        return self._run_all(items, add, use_tqdm)  # type: ignore[return-value]

    def _run_all(
        self, items: Sequence[Any], add: Callable[[str, Any], None], use_tqdm: bool
    ) -> list[EngineOutput]:
        """Adds each item as a request (`add`) and steps the engine until all are
        finished; their outputs in order. Nothing is left queued behind an error."""
        llm_engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in items]
        added: list[str] = []
        try:
            for request_id, item in zip(ids, items, strict=True):
                add(request_id, item)
                added.append(request_id)
            done: dict[str, EngineOutput] = {}
            with _Progress(len(ids), use_tqdm) as progress:
                while llm_engine.has_unfinished_requests():
                    for out in llm_engine.step():
                        done[out.request_id] = out
                        progress.update(out)
            return [done[i] for i in ids]
        except BaseException:
            for request_id in added:  # nothing is left queued behind an error
                llm_engine.abort_request(request_id)
            llm_engine.discard_finished()
            raise


def _with_task(params: PoolingParams | None, task: str) -> PoolingParams:
    """The caller's pooling params (or the defaults) for `task`."""
    if params is not None and params.task not in (None, task):
        raise ValueError(f"pooling_params asks for task {params.task!r}, not {task!r}")
    return replace(params or PoolingParams(), task=task)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    return _per_prompt(params, count, SamplingParams, "sampling params")


def _per_prompt(value: Any, count: int, kind: type, what: str) -> list[Any]:
    """One `kind` (or None) for every prompt, or a list of one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{len(values)} {what} for {count} prompts")
    return values


class _Progress:
    """A tqdm bar of finished requests with the output tokens/s."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.tokens = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)

    def update(self, out: EngineOutput) -> None:
        if self.bar is None:
            return
        if isinstance(out, RequestOutput):
            self.tokens += sum(len(o.token_ids) for o in out.outputs)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.set_postfix_str(f"output {self.tokens / elapsed:.1f} toks/s", refresh=False)
        self.bar.update(1)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
