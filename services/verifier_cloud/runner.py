"""The verifier's model runner: a layer range, the per-session KV it owns, and one `run(batch)`.

The same runner serves the single-process verifier (the whole middle submodel,
optionally with the token model, called from a worker thread) and every
pipeline stage (its own layer range, called in the stage's process). `run` is
the one place where an item is checked against its session's cache, rolled
back (a verify's rejected drafts) and appended by one packed forward pass.

A fault in one item fails that item alone. When a packed pass raises, every
session in it is restored to the length (and sampler state) it had before the
pass — a layer may already have appended its positions — and the pass is
retried in halves until the failing item is alone; it gets an INTERNAL error,
the others their normal results. An exception never leaves `run`.

Sessions may be closed from another thread while a batch runs (the event loop
closes, the worker thread computes): a close during `run` is deferred until
the pass ends, so a cache is never freed under a forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from services.verifier_cloud.token_mode import StreamedChunk, TokenModel, TokenSession
from services.verifier_cloud.work import EngineError, ErrorKind, TokenItem, WorkKind, check_item
from shared.model.cuda_graphs import StaticPasses
from shared.model.kv_cache import SessionKV
from shared.model.split import LayerRange
from shared.model.static_kv import KVSlotsExhausted, StaticKVPool
from shared.specdec.draft_stream import ChunkVerdict, StreamProtocolError, StreamVerifier
from shared.specdec.sampling import SamplingParams
from shared.specdec.verify_layout import VerifyLayout, layout_refusal, roll_back, tree_rows

log = logging.getLogger("services.verifier_cloud.runner")


@contextlib.contextmanager
def no_slot_is_a_budget_error(session_id: int) -> Iterator[None]:
    """A static pool without a free slot refuses the session as a KV budget would (the budgets charge every
    slot whole, so this is the backstop where they were set above the pool)."""
    try:
        yield
    except KVSlotsExhausted as exc:
        raise EngineError(ErrorKind.KV_BUDGET, str(exc), session_id) from None


@dataclass(eq=False)
class RunItem(TokenItem):
    """One session's work in a batch, as the runner sees it (no reply, no wire)."""

    session_id: int
    kind: WorkKind
    position: int  # prefill: start_pos; verify: commit_len
    hidden: torch.Tensor | None  # [S, H] states entering this layer range; None for token items
    token_ids: torch.Tensor | None = None  # [S] int64: token mode (the runner embeds them itself)
    is_last: bool = False  # token items: sample the next token
    draft: StreamedChunk | None = None  # token items of a streamed draft: verify it (token_mode.py)
    layout: VerifyLayout | None = None  # a verify's draft tree, and the rows it keeps of the last one
    # The open it was scheduled for (see SessionCaches.opened_as); None: the session id alone says (a stage
    # gets opens, closes and batches in one ordered stream, so an id there is always the right session).
    opened_as: object | None = None


@dataclass
class ItemResult:
    # Deep states [S, H] for hidden items; for token items the sampled ids [1] when is_last (else None),
    # or the verdict on a streamed draft chunk.
    output: torch.Tensor | ChunkVerdict | None
    error: EngineError | None = None


@dataclass
class SessionCaches:
    """What the runner holds for one session: its KV in this layer range, and token-mode state."""

    middle: SessionKV
    token: TokenSession | None = None  # the lower layers' KV and the sampler (token mode only)
    # Which open of the id these caches are (the scheduler's session record): the in-process engine schedules
    # on the event loop and runs in a thread, so an id may be closed and opened again in between; the new
    # session's caches must not take the old session's item.
    opened_as: object | None = None

    @property
    def length(self) -> int:
        return self.middle.length

    def truncate(self, length: int) -> None:
        self.middle.truncate(length)
        if self.token is not None:
            self.token.lower.truncate(length)

    def mark(self) -> tuple:
        """What `restore` needs to undo one pass: the length, the sampler's state and the draft stream's."""
        if self.token is None:
            return self.length, None, None
        stream = self.token.stream
        return self.length, self.token.generator.get_state(), StreamVerifier(stream.epoch, stream.carried_row)

    def restore(self, mark: tuple) -> None:
        length, generator_state, stream = mark
        # truncate() sets every layer to `length`, also layers a failed pass had appended to.
        self.middle.truncate(length)
        if self.token is not None:
            self.token.lower.truncate(min(length, self.token.lower.length))
            self.token.generator.set_state(generator_state)
            self.token.stream = stream

    def free(self) -> None:
        self.middle.free()
        if self.token is not None:
            self.token.lower.free()


class ModelRunner:
    def __init__(
        self,
        layers: LayerRange,
        context_length: int,
        token_model: TokenModel | None = None,
        pool: StaticKVPool | None = None,
        passes: StaticPasses | None = None,
    ):
        """`pool`: the static KV layout (a slot per session, shared/model/static_kv.py), None: growable caches;
        `passes`: its static-shape passes (CUDA graphs where captured, shared/model/cuda_graphs.py)."""
        if passes is not None and passes.pool is not pool:
            raise ValueError("static passes run on the runner's own static KV pool")
        self.layers = layers
        self.context_length = context_length
        self.token_model = token_model  # only with the whole middle: token items run [0, m) here first
        self.pool, self.passes = pool, passes
        self.sessions: dict[int, SessionCaches] = {}
        self._lock = threading.Lock()  # guards `sessions` and the deferred frees across threads
        self._running = False
        self._free_after_run: list[SessionCaches] = []

    # -- sessions (any thread) ----------------------------------------------------------------
    def open(self, session_id: int, sampling: SamplingParams | None = None, opened_as: object | None = None) -> None:
        """Fresh caches for `session_id` (replacing any it had); `sampling` makes it a token session;
        `opened_as` names this open (only items scheduled for it run on these caches)."""
        token = None
        if sampling is not None:
            if self.token_model is None:
                raise EngineError(ErrorKind.MALFORMED, "token mode needs the token model", session_id)
            # static: the lower layers' cache is preallocated too, so a session's charge is all it holds
            token = self.token_model.open(sampling, self.pool.capacity if self.pool is not None else None)
        with no_slot_is_a_budget_error(session_id):
            middle = self.pool.acquire() if self.pool is not None else self.layers.new_cache()
        self._release(session_id, SessionCaches(middle, token, opened_as))

    def fork(self, session_id: int, parent_id: int, length: int | None = None, opened_as: object | None = None) -> None:
        """Caches for `session_id` that copy the first `length` positions (None: all) of `parent_id`'s: a
        prefix computed once goes on in many sessions. The caller makes sure no pass is running the parent."""
        self.install(session_id, self.fork_copy(session_id, parent_id, length, opened_as))

    def install(self, session_id: int, caches: SessionCaches) -> None:
        """Make `caches` (a `fork_copy`) the session's, replacing any it had."""
        self._release(session_id, caches)

    def fork_copy(
        self, session_id: int, parent_id: int, length: int | None = None, opened_as: object | None = None
    ) -> SessionCaches:
        """`fork`'s copy, not yet installed: any thread (the server copies off its event loop), while the
        caller keeps every pass off the parent."""
        with self._lock:
            parent = self.sessions.get(parent_id)
        if parent is None:
            raise EngineError(ErrorKind.UNKNOWN_SESSION, f"unknown parent session {parent_id}", session_id)
        if parent.token is not None:
            raise EngineError(ErrorKind.MALFORMED, "token-mode sessions are not forked", session_id)
        length = parent.length if length is None else length
        if not 0 <= length <= parent.length:
            raise EngineError(
                ErrorKind.BAD_SHAPE, f"fork of {length} positions; the parent holds {parent.length}", session_id
            )
        with no_slot_is_a_budget_error(session_id):
            return SessionCaches(parent.middle.fork(length), opened_as=opened_as)

    def close(self, session_id: int) -> None:
        self._release(session_id, None)

    def kv_bytes(self) -> int:
        """Bytes allocated to the open sessions' KV (token sessions' lower layers included)."""
        with self._lock:  # a session in `sessions` is never freed, and none leaves it while we sum
            return sum(
                c.middle.nbytes() + (c.token.lower.nbytes() if c.token is not None else 0)
                for c in self.sessions.values()
            )

    def _release(self, session_id: int, replacement: SessionCaches | None) -> None:
        with self._lock:
            old = self.sessions.pop(session_id, None)
            if replacement is not None:
                self.sessions[session_id] = replacement
            if old is not None and self._running:
                self._free_after_run.append(old)
                old = None
        if old is not None:
            old.free()

    def roll_back(self, session_id: int, length: int) -> None:
        """Cut a session back to at most `length` positions (no-op for an unknown or shorter session)."""
        with self._lock:
            caches = self.sessions.get(session_id)
            if caches is not None and caches.length > max(length, 0):
                caches.truncate(max(length, 0))

    def lengths(self) -> dict[int, int]:
        with self._lock:
            return {sid: caches.length for sid, caches in self.sessions.items()}

    # -- one batch (one thread at a time) -------------------------------------------------------
    def run(self, items: Sequence[RunItem]) -> list[ItemResult]:
        """Check, roll back and run every item; one result per item, in order. Never raises."""
        with self._lock:
            self._running = True
            entries = [self.sessions.get(item.session_id) for item in items]
        try:
            results: list[ItemResult | None] = [None] * len(items)
            runnable: dict[int, SessionCaches] = {}  # item index -> its caches, in item order
            for i, (item, caches) in enumerate(zip(items, entries)):
                if (
                    item.draft is not None
                    and caches is not None
                    and caches.token is not None
                    and caches.token.stream.is_stale(item.draft.chunk)
                ):
                    # drafted on a token rejected since: not run, and it must not touch the KV
                    results[i] = ItemResult(ChunkVerdict(caches.token.stream.epoch, 0, stale=True))
                    continue
                error = self._refusal(item, caches)
                if error is not None:
                    results[i] = ItemResult(None, error)
                    continue
                assert caches is not None  # _refusal refuses an unknown session
                if item.kind is WorkKind.VERIFY:
                    if item.layout is not None:  # the last tree's accepted path moves down first
                        roll_back(caches.middle, item.position, item.layout)
                    caches.truncate(item.position)  # roll back rejected draft positions before appending
                runnable[i] = caches
            if runnable:
                self._run_isolated(items, runnable, list(runnable), results)
            done = [result for result in results if result is not None]
            assert len(done) == len(items)  # every item was stale, refused or run
            return done
        finally:
            with self._lock:
                self._running = False
                deferred, self._free_after_run = self._free_after_run, []
            for caches in deferred:
                caches.free()

    def _refusal(self, item: RunItem, caches: SessionCaches | None) -> EngineError | None:
        if caches is None:
            return EngineError(ErrorKind.UNKNOWN_SESSION, f"unknown session {item.session_id}")
        if item.opened_as is not None and caches.opened_as is not item.opened_as:
            return EngineError(
                ErrorKind.UNKNOWN_SESSION, f"session {item.session_id} was closed since this item was scheduled"
            )
        if item.is_token != (caches.token is not None):
            return EngineError(ErrorKind.MALFORMED, "token items need a token session, and only take token items")
        if item.draft is not None:
            assert caches.token is not None  # a draft rides on a token item, matched to a token session above
            try:
                caches.token.stream.check(item.draft.chunk)
            except StreamProtocolError as exc:
                return EngineError(ErrorKind.MALFORMED, str(exc))
        error = check_item(item.kind, item.position, item.num_tokens, caches.length, self.context_length)
        if error is None and item.layout is not None:
            refusal = layout_refusal(item.layout, item.position, item.num_tokens, caches.length)
            if item.is_token or item.kind is not WorkKind.VERIFY:
                refusal = "only a hidden-state verify is laid out as a tree"
            if refusal is not None:
                return EngineError(ErrorKind.BAD_SHAPE, refusal)
        return error

    def _run_isolated(
        self,
        items: Sequence[RunItem],
        entries: Mapping[int, SessionCaches],
        group: list[int],
        results: list[ItemResult | None],
    ) -> None:
        """One packed pass over `group`; if it raises, restore and retry in halves down to the failing item."""
        marks = [entries[i].mark() for i in group]
        try:
            outputs = self._forward([items[i] for i in group], [entries[i] for i in group])
        except Exception as exc:  # noqa: BLE001 - any fault (IndexError, a CUDA error) fails items, never the engine
            for i, mark in zip(group, marks):
                entries[i].restore(mark)
            if len(group) == 1:
                log.error(
                    "session %d: item failed alone: %s: %s",
                    items[group[0]].session_id,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
                results[group[0]] = ItemResult(None, EngineError(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}"))
                return
            log.warning(
                "a packed pass of %d items failed (%s: %s); retrying it in halves without the fault",
                len(group),
                type(exc).__name__,
                exc,
            )
            half = len(group) // 2
            self._run_isolated(items, entries, group[:half], results)
            self._run_isolated(items, entries, group[half:], results)
            return
        for i, output in zip(group, outputs):
            results[i] = ItemResult(output)

    def _forward(
        self, items: Sequence[RunItem], entries: Sequence[SessionCaches]
    ) -> list[torch.Tensor | ChunkVerdict | None]:
        """Token items through embeddings + layers [0, m), then everything through one packed pass of
        this layer range, then token items through the head: deep states on the CPU, or sampled ids [1]."""
        # Received states keep their wire dtype until here: now the layers' device and compute dtype.
        device, dtype = self.layers.device, self.layers.dtype
        assert isinstance(dtype, torch.dtype)  # the checkpoint's dtype (LayerRange.dtype, an untyped nn.Module attr)
        inputs: list[torch.Tensor | None] = []
        for item in items:
            if item.is_token:
                inputs.append(None)
            else:
                assert item.hidden is not None  # a hidden-state item carries its states
                inputs.append(item.hidden.to(device=device, dtype=dtype))
        token_rows = [i for i, item in enumerate(items) if item.is_token]
        token_model = self.token_model
        tokens: dict[int, TokenSession] = {}  # row -> its token session (_refusal matched token items to them)
        if token_rows:
            if token_model is None:  # _refusal keeps token items off a runner without one
                raise RuntimeError("token item without a token model")
            shallow_in: list[tuple[SessionKV, torch.Tensor]] = []
            for i in token_rows:
                token, token_ids = entries[i].token, items[i].token_ids
                assert token is not None and token_ids is not None  # a token item on a token session
                tokens[i] = token
                shallow_in.append((token.lower, token_ids))
            shallow = token_model.shallow(shallow_in)
            for i, states in zip(token_rows, shallow):
                inputs[i] = states  # [S_i, H]
        ready = [x for x in inputs if x is not None]
        assert len(ready) == len(inputs)  # every token row got its shallow states
        trees = [tree_rows(item.position, item.layout) for item in items]
        forward_batch = self.passes.forward_batch if self.passes is not None else self.layers.forward_batch
        deep = forward_batch([(caches.middle, x) for caches, x in zip(entries, ready)], trees if any(trees) else None)
        outputs: list[torch.Tensor | ChunkVerdict | None] = list(deep)
        for i in token_rows:
            assert token_model is not None  # checked above: token rows need it
            draft = items[i].draft
            if draft is not None:
                verdict = token_model.verify_chunk(tokens[i], deep[i], draft)
                outputs[i] = verdict
                if verdict.rejected:  # the rejected draft and everything after it leave the KV now
                    entries[i].truncate(items[i].position + draft.chunk.num_final + verdict.num_accepted)
            else:
                outputs[i] = (
                    torch.tensor([token_model.next_token(tokens[i], deep[i][-1:])]) if items[i].is_last else None
                )
        # Replies go back to the CPU for encoding; on a GPU this copy also waits for the pass to finish,
        # so whoever times run() measures the compute, not the kernel launches.
        return [out.cpu() if isinstance(out, torch.Tensor) else out for out in outputs]
