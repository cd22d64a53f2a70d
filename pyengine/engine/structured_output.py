"""Structured output: a request's constraint (SamplingParams.structured_outputs: a JSON
schema, a regex, choices, a grammar) compiled against the tokenizer's vocabulary, and a
matcher per row that says, before each of its tokens, which tokens may come next (a
bitmask) and follows the tokens the row keeps.

The backend is llguidance (docs/architecture.md says why): its matchers compile a
grammar lazily as they go, in microseconds a token, and roll back.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from typing import Any

import numpy as np

from pyengine.sampling_params import SamplingParams, StructuredOutputsParams
from pyengine.step_values import GrammarMasks, SamplingRow
from pyengine.tokenizer import PyengineTokenizer

# Compiled grammars kept for requests that repeat a constraint (a server's few schemas).
DEFAULT_GRAMMAR_CACHE_BYTES = 64 * 2**20
# What a grammar's start matcher holds once its lexer is built, about: 1 MB measured for a
# JSON schema of 200 string fields and the default model's vocabulary.
MATCHER_BYTES = 2**20


def cached_size(text: str, grammar: str) -> int:
    return len(text) + len(grammar) + MATCHER_BYTES


class GrammarCompiler:
    """Grammars of constraints (cached by their text) and their matchers, over one
    tokenizer; `vocab_size` is the model's (its logits rows), at least the tokenizer's."""

    def __init__(
        self,
        tokenizer: PyengineTokenizer,
        vocab_size: int,
        max_cached_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        # Each grammar with a matcher at its start, which a request's matcher copies (in
        # a microsecond, where making one takes milliseconds); least recently used first,
        # bounded in bytes (cached_size: the texts and the matcher's estimate), as unique
        # large schemas, one a request, would otherwise grow it for ever. (The server
        # compiles in its own thread while the engine thread looks up: under the lock.)
        self._grammars: OrderedDict[tuple[str, str], tuple[str, Any]] = OrderedDict()
        self._cached_bytes = 0
        self.max_cached_bytes = max_cached_bytes
        self._lock = threading.Lock()

    @cached_property
    def _llg(self) -> Any:
        import llguidance  # (only an engine that constrains a request loads it)

        return llguidance

    @cached_property
    def _vocabulary(self) -> Any:
        """The tokenizer as llguidance reads it (made once, a fraction of a second)."""
        return self._llg.LLTokenizer(
            self.tokenizer.tokenizer.to_str(),
            n_vocab=self.vocab_size,
            eos_token=self.tokenizer.eos_token_id,
        )

    def warm_up(self) -> None:
        """Reads the vocabulary for llguidance (done once, at the first grammar else)."""
        _ = self._vocabulary

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The constraint's grammar; ValueError naming the field where it is not valid
        (an unknown schema keyword, a regex that does not parse, a grammar's error)."""
        return self._compiled(params)[0]

    def _compiled(self, params: StructuredOutputsParams) -> tuple[str, Any]:
        """The constraint's grammar and the matcher at its start, compiled once."""
        try:
            kind, text = params.constraint()
        except RecursionError:  # (a schema object nested past json.dumps' depth)
            raise ValueError("structured_outputs.json is nested too deeply") from None
        with self._lock:
            compiled = self._grammars.get((kind, text))
            if compiled is not None:
                self._grammars.move_to_end((kind, text))
                return compiled
        # (kind is the field's name: json_object's constraint is a JSON schema)
        source = self._compact_json(text, kind) if kind == "json" else text
        try:
            grammar = str(self._llg.grammar_from(kind, source))
        except (ValueError, TypeError) as error:
            raise ValueError(f"structured_outputs.{kind} is not valid: {error}") from None
        except RecursionError:
            raise ValueError(f"structured_outputs.{kind} is nested too deeply") from None
        start = self._llg.LLMatcher(self._vocabulary, grammar)  # (its check, too)
        if start.is_error():
            raise ValueError(f"structured_outputs.{kind} is not valid: {start.get_error()}")
        self._remember((kind, text), (grammar, start))
        return grammar, start

    def _remember(self, key: tuple[str, str], compiled: tuple[str, Any]) -> None:
        size = cached_size(key[1], compiled[0])
        if size > self.max_cached_bytes:
            return  # (compiled again when asked again: it would empty the cache)
        with self._lock:
            if key in self._grammars:
                return
            self._grammars[key] = compiled
            self._cached_bytes += size
            while self._cached_bytes > self.max_cached_bytes:
                (_, old_text), (old, _) = self._grammars.popitem(last=False)
                self._cached_bytes -= cached_size(old_text, old)

    @property
    def cached_bytes(self) -> int:
        """What the cache holds: its texts (schemas' and grammars') and, for each, a
        matcher's estimated size."""
        return self._cached_bytes

    @staticmethod
    def _compact_json(schema_text: str, field: str) -> str:
        """The schema, its JSON without free whitespace (unless it says otherwise): a small
        model's greedy answer can otherwise run on in newlines and spaces for ever."""
        try:
            schema = json.loads(schema_text)
            if isinstance(schema, dict):
                schema.setdefault("x-guidance", {"whitespace_flexible": False})
            return json.dumps(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured_outputs.{field} is not valid JSON: {error}") from None
        except RecursionError:
            raise ValueError(f"structured_outputs.{field} is nested too deeply") from None

    def forget_grammars(self) -> None:
        """Empties the cache of compiled grammars (a benchmark's cold compiles)."""
        with self._lock:
            self._grammars.clear()
            self._cached_bytes = 0

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        return Matcher(self._compiled(params)[1].deep_copy(), self.mask_words)

    @cached_property
    def _executor(self) -> Any:
        return self._llg.LLExecutor()

    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)

    def allowed(self, matchers: list[Matcher]) -> np.ndarray:
        """The matchers' bitmasks (Matcher.allowed), int32 [len(matchers), mask_words],
        computed in parallel threads that do not hold the interpreter."""
        masks = np.full((len(matchers), self.mask_words), -1, dtype=np.int32)
        self.fill_allowed(matchers, masks)
        return masks

    def fill_allowed(self, matchers: list[Matcher], masks: np.ndarray) -> None:
        """allowed(), into `masks` (int32 [len(matchers), mask_words], C order)."""
        if matchers:
            self._executor.unsafe_compute_mask_ptr(
                [(m.llg, i) for i, m in enumerate(matchers)], masks.ctypes.data,
                self.mask_words * 4, len(matchers),
            )  # fmt: skip

    def allowed_later(self, matchers: list[Matcher]) -> tuple[np.ndarray, Future[None]]:
        """allowed()'s buffer at once, filled by a thread while the caller goes on (the
        matchers must not move until the future is done)."""
        masks = np.full((len(matchers), self.mask_words), -1, dtype=np.int32)
        return masks, self._mask_thread.submit(self.fill_allowed, matchers, masks)

    @cached_property
    def _mask_thread(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="pyengine-masks")


class Matcher:
    """One row's place in its grammar."""

    def __init__(self, matcher: Any, mask_words: int) -> None:
        self._matcher = matcher
        self.mask_words = mask_words

    @property
    def llg(self) -> Any:
        """The llguidance matcher (GrammarCompiler.allowed computes masks of several)."""
        return self._matcher

    def allowed(self) -> np.ndarray:
        """The tokens that may come next: a bitmask, int32 words (bit t % 32 of word
        t // 32 for token t)."""
        # (llguidance's own mask may hold a word more than the vocabulary needs)
        return np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)[: self.mask_words]

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (the matcher does not move)."""
        return self.allows_all([token]) == 1

    def allows_all(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes (the matcher does not move)."""
        return int(self._matcher.validate_tokens(tokens))

    def follow(self, tokens: list[int]) -> int:
        """Follows `tokens` while the grammar takes them; how many it followed."""
        return int(self._matcher.try_consume_tokens(tokens)) if tokens else 0

    def accept(self, token: int) -> bool:
        """Follows a kept token; False (the matcher unchanged) for one the grammar does
        not allow."""
        # (consume_token would leave the matcher in its error state on a refused token)
        return bool(self._matcher.try_consume_tokens([token]) == 1)

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last num_tokens it followed (drafts masked ahead)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)


class StepGrammar:
    """A step's constrained rows (by their index among its sampled rows) over the core's
    matchers, the engine's side of the step's grammar work. `masked` rows get their
    bitmasks before their draw (start() computes them in a thread while the forward
    runs, where they do not follow drafts); `checked` rows (greedy, or temperature
    alone) are drawn without theirs, and only those whose grammar refuses the token
    drawn get a mask and are drawn again: most constrained rows need no mask.

    A row after drafts 1..j is checked and masked from its matcher after them, taken
    back after; past a draft the grammar refuses, its token is never kept (the row
    before it cannot draw that draft), so it is not checked, and its mask is the row
    before it's. The drafts are values the core gives (set_drafts): a draft model's are
    known only once the step ran."""

    def __init__(
        self,
        compiler: GrammarCompiler,
        matchers: dict[int, Matcher],
        checked: list[int],
        masked: list[int],
        drafts_before: dict[int, int],
    ) -> None:
        self.compiler = compiler
        self.matchers = matchers
        self.checked = checked
        self.masked = masked
        self.drafts_before = drafts_before
        self._drafts: dict[int, list[int]] = {}
        # The masked rows that follow no drafts, their masks and the thread making them.
        self._early: tuple[list[int], np.ndarray, Future[None]] | None = None

    @classmethod
    def of_rows(
        cls, compiler: GrammarCompiler, matchers: dict[int, Matcher], rows: list[SamplingRow]
    ) -> StepGrammar:
        """The step's grammar over `matchers` (by index among the step's sampled `rows`):
        a row whose token is the argmax or a draw from the whole tempered distribution
        is checked after its draw, the others masked before it."""
        checked: list[int] = []
        masked: list[int] = []
        for i in matchers:
            (checked if _draws_without_filters(rows[i].params) else masked).append(i)
        drafts_before = {i: rows[i].num_drafts_before for i in matchers}
        return cls(compiler, matchers, checked, masked, drafts_before)

    @property
    def masks_follow_drafts(self) -> bool:
        """Whether some masked row follows drafts (its mask needs them)."""
        return any(self.drafts_before.get(i) for i in self.masked)

    def start(self) -> None:
        """Starts computing, in a thread, the masks of the masked rows that follow no
        drafts (the matchers must not move until for_sampling); those after drafts wait
        for them."""
        plain = [i for i in self.masked if not self.drafts_before.get(i)]
        if plain:
            masks, done = self.compiler.allowed_later([self.matchers[i] for i in plain])
            self._early = (plain, masks, done)

    def set_drafts(self, drafts: dict[int, list[int]]) -> None:
        """The drafts each row after some follows (by its index; j drafts before it)."""
        self._drafts = drafts

    def for_sampling(self) -> GrammarMasks:
        """The masks sample_tokens takes: the masked rows' (start()'s thread's once it is
        done, then the rest's, now), and which rows are checked."""
        if self._early is None:
            return GrammarMasks(self.masked, self.masks(self.masked), self.checked)
        early, masks, done = self._early
        done.result()  # (before the rows after drafts move their matchers)
        rest = [i for i in self.masked if self.drafts_before.get(i)]
        if rest:
            early, masks = [*early, *rest], np.concatenate([masks, self.masks(rest)])
        return GrammarMasks(early, masks, self.checked)

    def refused(self, token_ids: list[int]) -> list[int]:
        """Of the checked rows, those whose token (one per sampled row of the step) the
        grammar does not allow next."""
        refused = []
        for i in self.checked:
            drafts = self._drafts.get(i, [])
            taken = self.matchers[i].allows_all([*drafts, token_ids[i]])
            if taken == len(drafts):  # (fewer: a draft refused, the row's token unused)
                refused.append(i)
        return refused

    def masks(self, rows: list[int]) -> np.ndarray:
        """The rows' bitmasks (int32 [len(rows), words])."""
        masks = np.empty((len(rows), self.compiler.mask_words), dtype=np.int32)
        plain = [k for k, i in enumerate(rows) if not self.drafts_before.get(i)]
        masks[plain] = self.compiler.allowed([self.matchers[rows[k]] for k in plain])
        for k, i in enumerate(rows):  # (one at a time: rows of a request share a matcher)
            if self.drafts_before.get(i):
                matcher = self.matchers[i]
                followed = matcher.follow(self._drafts[i])
                masks[k] = matcher.allowed()
                matcher.rollback(followed)
        return masks


def _draws_without_filters(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax or a draw from the whole tempered distribution
    (no top-k, top-p or min-p): drawing it unmasked, then again under the mask if the
    grammar refuses it, is then the same as drawing under the mask."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0)
