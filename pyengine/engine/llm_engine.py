"""The engine: requests in through the input processor, steps through the engine core
(the C++ scheduler plans, the executor runs the model and samples, the scheduler applies
the tokens), outputs through the output processor (whole or deltas, as each request's
SamplingParams.output_kind asks)."""

from __future__ import annotations

from dataclasses import replace

from pyengine import Scheduler
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.engine.input_processor import InputProcessor
from pyengine.engine.output_processor import OutputProcessor
from pyengine.engine.stats import EngineStats
from pyengine.executor import Executor, create_executor
from pyengine.loader.resolve import LoadedModel
from pyengine.lora.registry import AdapterRegistry
from pyengine.lora.request import LoRARequest
from pyengine.outputs import EngineOutput
from pyengine.pooling_params import PoolingParams
from pyengine.sampling_params import RequestOutputKind, SamplingParams
from pyengine.tokenizer import PyengineTokenizer


class LLMEngine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, executor: Executor | None = None
    ) -> None:
        self.config = config
        self.model_config = loaded.config
        self.tokenizer: PyengineTokenizer | None = loaded.tokenizer
        self.executor = executor or create_executor(loaded, config)
        self.input_processor = InputProcessor(loaded.config, config, self.tokenizer)
        self.adapters = AdapterRegistry(config.lora, loaded.config)
        self.core = EngineCore(
            config, self.executor, self.input_processor.grammars, loaded.config.vocab_size
        )
        eos = loaded.config.eos_token_ids
        self.output_processor = OutputProcessor(
            self.tokenizer, eos[0] if eos else None, config.pooler
        )

    @property
    def scheduler(self) -> Scheduler:
        """The first scheduler (the only one without a pipeline)."""
        return self.core.scheduler

    @property
    def schedulers(self) -> list[Scheduler]:
        """One per pipeline step in flight."""
        return self.core.schedulers

    @property
    def requests(self) -> dict[str, object]:
        """The unfinished requests, by id."""
        return dict(self.output_processor.requests)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """Queues a request (with lora_request: through that adapter; with priority:
        before higher values, under scheduling_policy "priority"; with cache_salt: sharing
        prefix-cache blocks only with requests of that salt; with output_kind: its outputs
        are of that kind, whatever `params` says); ValueError naming whatever the engine
        cannot run."""
        self.adapters.check(lora_request)
        request = self.input_processor.process(
            request_id, prompt_token_ids, params, prompt, arrival_time,
            existing=self.output_processor.requests, lora_request=lora_request,
            priority=priority, cache_salt=cache_salt, output_kind=output_kind,
        )  # fmt: skip
        n = request.params.n
        row_ids = [request_id, *(Scheduler.sample_id(request_id, k) for k in range(1, n))]
        self.core.add_request(request, row_ids)
        self.output_processor.add_request(request, row_ids)

    def add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        prompt: str | None = None,
        token_type_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a pooling request (runner "pooling"): its one output, an embedding, a
        classification or a score, comes once its prompt has run; ValueError naming
        whatever the engine cannot run."""
        request = self.input_processor.process_pooling(
            request_id, prompt_token_ids, params, prompt, token_type_ids, arrival_time,
            existing=self.output_processor.requests, priority=priority,
        )  # fmt: skip
        self.core.add_request(request, [request_id])
        self.output_processor.add_request(request, [request_id])

    def abort_request(self, request_id: str) -> None:
        self.core.finish_rows(self.output_processor.abort_request(request_id), "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def step(self) -> list[EngineOutput]:
        """Runs one engine step; returns the outputs of the requests that got tokens in
        it or finished (since the last step, aborts too), each as its params.output_kind
        asks: by default (CUMULATIVE) whole, a copy that later steps leave as it is; a
        DELTA request's output holds what the step added, and a FINAL_ONLY request has
        one output, when it finishes."""
        try:
            out = self.core.step()
        except BaseException:
            # A failed step (bad weights, interrupt) ends its requests, not the engine.
            for request_id in self.core.failed_request_ids:
                self.abort_request(request_id)
            raise
        outputs = self.output_processor.process(out)
        self.core.finish_rows(self.output_processor.take_stopped_rows(), "stop")
        return outputs

    def shutdown(self) -> None:
        """Ends the workers (their processes, where they have their own)."""
        self.executor.shutdown()

    def discard_finished(self) -> None:
        """Drops the outputs of the requests finished since the last step (aborted ones
        whose caller has gone)."""
        self.output_processor.discard_finished()

    def stats(self) -> EngineStats:
        stats = EngineStats.of([s.stats() for s in self.core.schedulers])
        if self.core.speculative is not None:
            spec = self.core.spec_stats
            stats = replace(
                stats, spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                spec_num_accepted_tokens=spec.num_accepted_tokens,
                spec_accepted_per_position=tuple(spec.accepted_per_position),
            )  # fmt: skip
        if self.config.lora is None:
            return stats
        running, waiting = self.core.adapter_states()
        return replace(stats, running_loras=running, waiting_loras=waiting,
                       max_loras=self.config.lora.max_loras)  # fmt: skip
