"""The device side of one generation: prefill, draft, accept (HAT §3.4).

A `DeviceSession` is a state machine with no I/O. The device agent (or the
in-process engine) feeds it what the cloud returns:

    session.prefill_chunk(size)                   -> shallow [S, H] to upload
    session.on_prefill_result(deep_last)          -> first token
    draft = session.draft()                        -> shallow [k+1, H] to verify
    session.on_verify_result(draft, deep)          -> accepted tokens + bonus

Invariant: the input-submodel cache and the adapter cache always hold the same
positions, and after every round both are rolled back to `commit_len`, the
number of positions whose tokens are final. The cloud is told the same
`commit_len` with the next verify request, so both sides roll back together.
"""

from __future__ import annotations

import hashlib
import time

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import Checkpoint
from shared.model.split import InputSubmodel, OutputSubmodel
from shared.specdec.sampling import SamplingParams, Verdict, accept, logits_to_probs, sample


class SessionError(ValueError):
    """A request that cannot be served as given (empty prompt, too long, bad ids)."""


@dataclass(frozen=True)
class DraftConfig:
    eta: float = 0.6  # stop drafting when the draft token's probability < eta (HAT eq. 5)
    max_draft: int = 8  # hard cap on draft tokens per round; 0 turns speculation off (U-shape)

    def __post_init__(self):
        if not 0 <= self.eta <= 1:
            raise ValueError(f"eta must be in [0, 1], got {self.eta}")
        if self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {self.max_draft}")


@dataclass
class DeviceModel:
    """What a device holds: input submodel, draft adapter, output submodel."""

    input: InputSubmodel
    adapter: DraftAdapter | None  # None: no speculation (plain U-shape)
    output: OutputSubmodel
    eos_token_id: int | None
    vocab_size: int
    context_length: int

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, split_layers: int, adapter: DraftAdapter | None) -> "DeviceModel":
        return cls(
            input=InputSubmodel(checkpoint, split_layers),
            adapter=adapter,
            output=OutputSubmodel(checkpoint),
            eos_token_id=checkpoint.eos_token_id,
            vocab_size=checkpoint.vocab_size,
            context_length=checkpoint.config.max_position_embeddings,
        )

    @property
    def hidden_size(self) -> int:
        return self.output.lm_head.in_features

    @property
    def device(self) -> torch.device:
        return self.input.device

    @property
    def dtype(self) -> torch.dtype:
        return self.input.dtype

    def to(self, device: torch.device | str) -> "DeviceModel":
        """Move every part to `device`; dtypes stay as the checkpoint was loaded (shared/model/placement.py)."""
        for part in (self.input, self.adapter, self.output):
            if part is not None:
                part.to(device)
        return self

    def compute_states(self, deep: torch.Tensor) -> torch.Tensor:
        """Deep states as the cloud sent them (wire dtype, fp32, CPU) -> this model's device and dtype."""
        return deep.to(device=self.device, dtype=self.dtype)


@dataclass
class Draft:
    commit_len: int  # positions the cloud keeps before appending this draft
    tokens: list[int]  # d_1..d_k
    probs: torch.Tensor | None  # q: [k, V], only when sampling
    shallow: torch.Tensor  # [k+1, H]: shallow states of (pending token, d_1..d_k)
    # What it takes to draft on from d_k (a pre-drafted branch cut short by the cloud's answer):
    can_continue: bool = False  # stopped by a budget or the caller, not by eta / EOS
    last_hidden: torch.Tensor | None = None  # [1, H]: the adapter's state at d_k's position


@dataclass
class Branch:
    """A continuation pre-drafted from one candidate for the last draft position (HAT §3.5)."""

    candidate: int
    input_cache: object
    adapter_cache: object
    last: tuple  # (draft logits at the branch's last drafted position, the adapter state they came from)
    draft: Draft  # commit_len = positions before the candidate; shallow rows = (candidate, e_1..e_j)

    def free(self) -> None:
        self.input_cache.free()
        if self.adapter_cache is not None:
            self.adapter_cache.free()


@dataclass
class DeviceSession:
    model: DeviceModel
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    draft_config: DraftConfig = field(default_factory=DraftConfig)
    max_new_tokens: int = 64

    def __post_init__(self):
        if not self.prompt_ids:
            raise SessionError("the prompt is empty")
        bad = [t for t in self.prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise SessionError(f"prompt ids out of vocabulary (size {self.model.vocab_size}): {bad[:5]}")
        if len(self.prompt_ids) + self.max_new_tokens > self.model.context_length:
            raise SessionError(
                f"prompt ({len(self.prompt_ids)}) + max_new_tokens ({self.max_new_tokens}) "
                f"exceeds the context length {self.model.context_length}"
            )
        if self.max_new_tokens < 1:
            raise SessionError("max_new_tokens must be >= 1")
        self.input_cache = self.model.input.new_cache()
        self.adapter_cache = self.model.adapter.new_cache() if self.model.adapter is not None else None
        # Two streams. `generator` drives the first token and every verification; its draws per round
        # are fixed by the round's draft, so a seed fixes them. Drafting draws from `_draft_rng`,
        # re-seeded per token from (seed, round start, position): pre-drafting, whose amount depends on
        # the cloud's timing, then draws exactly what the session would draw after the correction.
        self.generator = torch.Generator()
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()  # a fresh torch.Generator has a fixed seed: unseeded must not repeat
        self._draft_rng = torch.Generator()
        self.generated: list[int] = []
        self.pending_token: int | None = None  # last emitted token, not yet run through any layer
        self.accept_lengths: list[int] = []  # tokens emitted per verification round
        self.verdicts: list[tuple[int, int]] = []  # (draft tokens, draft tokens accepted) per verification round
        self.draft_seconds: list[tuple[float, int]] = []  # (seconds, device steps) of each draft() call
        # Wall-clock timings the engine records for telemetry (the simulator's latency models):
        self.round_overhead_s: list[float] = []  # per round, outside drafting and the cloud wait
        self.prefill_seconds: list[tuple[float, int]] = []  # (compute + send, tokens) per prompt chunk
        self._ready_draft: Draft | None = None  # an adopted pre-drafted branch, used by the next draft()
        self._last_draft_logits: torch.Tensor | None = None  # draft logits at the last drafted position
        self._last_draft_hidden: torch.Tensor | None = None  # [1, H]: the adapter state they came from
        # [1, H]: the cloud's deep state at the position before the pending token (feature adapters read it)
        self._prev_feature: torch.Tensor | None = None
        self.reused_branches = 0
        self.predraft_chances = 0  # rounds with pre-drafted branches whose last draft token was corrected
        self.full_accepts = 0  # verification rounds that accepted every drafted token (L = k + 1)
        self.degraded = False  # finished on the device alone after losing the cloud (finish_alone)

    # -- state -----------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        if len(self.generated) >= self.max_new_tokens:
            return True
        return bool(self.generated) and self.generated[-1] == self.model.eos_token_id

    @property
    def commit_len(self) -> int:
        return self.input_cache.length

    def _emit(self, tokens: Sequence[int]) -> list[int]:
        emitted = []
        for token in tokens:
            if self.is_finished:
                break
            self.generated.append(token)
            emitted.append(token)
        return emitted

    # -- prefill ---------------------------------------------------------------
    def prefill_chunk(self, size: int) -> tuple[int, torch.Tensor]:
        """Run the next `size` prompt tokens through the input submodel: (start_pos, shallow [S, H])."""
        start = self.commit_len
        if size < 1 or start + size > len(self.prompt_ids):
            raise SessionError(f"chunk of {size} at {start} does not fit a {len(self.prompt_ids)}-token prompt")
        ids = torch.tensor(self.prompt_ids[start : start + size])
        shallow = self.model.input(ids, self.input_cache)  # [S, H]
        if self.adapter_cache is not None:  # keep the draft's cache in step
            # inside the prompt no deep state comes back: a feature adapter reads zeros there
            self._run_adapter(self.adapter_cache, shallow, ids, torch.zeros_like(shallow))
        return start, shallow

    def _run_adapter(self, cache, shallow: torch.Tensor, token_ids: torch.Tensor,
                     prev_features: torch.Tensor | None) -> torch.Tensor:
        """The adapter over rows of (token, shallow state, deep state of the position before)."""
        # shallow: [S, H], token_ids: [S], prev_features: [S, H] -> f_S: [S, H]
        return self.model.adapter(shallow, cache, self._adapter_side(token_ids, prev_features))

    def _adapter_side(self, token_ids: torch.Tensor, prev_features: torch.Tensor | None) -> torch.Tensor | None:
        """What the adapter reads besides the shallow state, for these rows (a batched pass packs them)."""
        # token_ids: [S], prev_features: [S, H] -> [S, H] or None
        side_input = self.model.adapter.spec.side_input
        if side_input == "embedding":
            return self.model.input.embed_tokens(token_ids.to(self.model.device))
        if side_input == "feature":
            return prev_features
        return None

    def on_prefill_result(self, deep_last: torch.Tensor) -> list[int]:
        """Sample the first token from the deep state of the prompt's last position."""
        # deep_last: [1, H]
        deep_last = self.model.compute_states(deep_last)
        logits = self.model.output(deep_last[-1:])[0]  # [V]
        self._prev_feature = deep_last[-1:]
        token = sample(logits_to_probs(logits, self.params), self.generator)
        self.pending_token = token
        return self._emit([token])

    # -- decode ----------------------------------------------------------------
    def _draft_budget(self) -> int:
        if self.model.adapter is None:
            return 0
        remaining = self.max_new_tokens - len(self.generated)
        return max(0, min(self.draft_config.max_draft, remaining - 1))

    def _draft_stream(self, round_start: int, position: int) -> torch.Generator:
        """The generator for the draft token at `position` of the round whose pending token sits at
        `round_start`: fresh for every (round, position), so no draw is ever reused, and the same
        whether the main draft or a pre-drafted branch draws it."""
        if self.params.is_greedy:
            return self.generator  # a one-hot has one outcome; no need to re-seed
        key = f"{self.generator.initial_seed()}:{round_start}:{position}".encode()
        return self._draft_rng.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) >> 1)

    def _run_draft(self, round_start: int, token: int | None, input_cache, adapter_cache, budget: int,
                   should_stop=None, hidden: torch.Tensor | None = None, prev_feature: torch.Tensor | None = None):
        """Autoregressive drafting on the given caches, from `token` (not yet in the caches; its
        position's previous deep state is `prev_feature`) or, to continue a draft, from `hidden`
        (the adapter's state at the caches' last position).

        Returns (tokens, q rows, shallow rows, (logits of the last drafting step, the adapter state
        they came from), the adapter's state at the last row, whether eta / EOS ended it)."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        shallows: list[torch.Tensor] = []
        last_logits = last_hidden = None
        ended = False
        prev = prev_feature if token is not None else hidden
        while True:
            if token is not None:
                ids = torch.tensor([token])
                shallow = self.model.input(ids, input_cache)  # [1, H]
                shallows.append(shallow)
                if adapter_cache is not None:
                    hidden = self._run_adapter(adapter_cache, shallow, ids, prev)  # [1, H]
                    prev = hidden  # drafting ahead, the next position reads the adapter's own prediction
            if ended or len(tokens) >= budget or (should_stop is not None and should_stop()):
                break
            last_logits = self.model.output(hidden)[0]  # [V]
            last_hidden = hidden
            q = logits_to_probs(last_logits, self.params)
            token = sample(q, self._draft_stream(round_start, input_cache.length))
            confidence = torch.softmax(last_logits, -1)[token] if self.params.is_greedy else q[token]
            tokens.append(token)
            probs.append(q)
            ended = float(confidence) < self.draft_config.eta or token == self.model.eos_token_id
        return tokens, probs, shallows, (last_logits, last_hidden), hidden, ended

    def _make_draft(self, commit_len: int, tokens, probs, shallows, last_hidden=None, ended=True) -> Draft:
        return Draft(
            commit_len=commit_len,
            tokens=tokens,
            probs=None if self.params.is_greedy or not probs else torch.stack(probs),
            shallow=torch.cat(shallows),
            can_continue=not ended and last_hidden is not None,
            last_hidden=last_hidden,
        )

    def draft(self) -> Draft:
        """Draft until confidence < eta (eq. 5) or the budget runs out."""
        if self.pending_token is None or self.is_finished:
            raise SessionError("draft() before prefill or after the session finished")
        started = time.perf_counter()
        ready, self._ready_draft = self._ready_draft, None  # pre-drafted during the last verification
        if ready is not None:
            return self._finish_ready_draft(ready, started)
        start = self.commit_len
        tokens, probs, shallows, last, hidden, ended = self._run_draft(
            start, self.pending_token, self.input_cache, self.adapter_cache, self._draft_budget(),
            prev_feature=self._prev_feature)
        self._last_draft_logits, self._last_draft_hidden = last
        self.draft_seconds.append((time.perf_counter() - started, len(shallows)))
        return self._make_draft(start, tokens, probs, shallows, hidden, ended)

    def _finish_ready_draft(self, ready: Draft, started: float) -> Draft:
        """An adopted branch, drafted on to where draft() would have stopped (the cloud's answer may
        have cut it short): the same draft the session makes without parallel drafting."""
        more = self._draft_budget() - len(ready.tokens)
        if not ready.can_continue or more <= 0:
            return ready
        tokens, probs, shallows, last, hidden, ended = self._run_draft(
            ready.commit_len, None, self.input_cache, self.adapter_cache, more, hidden=ready.last_hidden)
        if tokens:
            self._last_draft_logits, self._last_draft_hidden = last
        self.draft_seconds.append((time.perf_counter() - started, len(shallows)))
        earlier_probs = [] if ready.probs is None else list(ready.probs.unbind(0))
        return self._make_draft(ready.commit_len, ready.tokens + tokens, earlier_probs + probs,
                                [ready.shallow] + shallows, hidden, ended)

    # -- parallel drafting (HAT §3.5) -------------------------------------------------
    def predraft(self, draft: Draft, num_candidates: int, steps: int, should_stop=None) -> list[Branch]:
        """While `draft` is being verified, draft `steps` ahead from each of the top candidates
        for its last position (other than the drafted token itself). Runs on forked caches, so
        the session's own caches are untouched until a branch is adopted. `should_stop()` turning
        true (the verification came back) ends pre-drafting early: it may only use idle time."""
        if not draft.tokens or num_candidates < 1 or steps < 0 or self._last_draft_logits is None:
            return []
        started = time.perf_counter()
        k = len(draft.tokens)
        branch_commit = draft.commit_len + k  # positions of (pending, d_1..d_{k-1})
        ranked = torch.topk(self._last_draft_logits, num_candidates + 1).indices.tolist()
        candidates = [c for c in ranked if c != draft.tokens[-1]][:num_candidates]
        remaining_after = self.max_new_tokens - len(self.generated) - k  # tokens left once d_1..d_{k-1}, c are out
        budget = max(0, min(steps, self.draft_config.max_draft, remaining_after - 1))
        branches = []
        for candidate in candidates:
            if should_stop is not None and should_stop():
                break
            input_cache = self.input_cache.fork(branch_commit)
            adapter_cache = self.adapter_cache.fork(branch_commit) if self.adapter_cache is not None else None
            # the candidate replaces d_k, so the state before it is the one d_k was drafted from
            tokens, probs, shallows, last, hidden, ended = self._run_draft(
                branch_commit, candidate, input_cache, adapter_cache, budget, should_stop,
                prev_feature=self._last_draft_hidden)
            branches.append(Branch(candidate, input_cache, adapter_cache, last,
                                   self._make_draft(branch_commit, tokens, probs, shallows, hidden, ended)))
        steps_run = sum(len(b.draft.tokens) + 1 for b in branches)
        self.draft_seconds.append((time.perf_counter() - started, steps_run))
        return branches

    def _adopt(self, branch: Branch) -> None:
        self.input_cache.free()
        self.input_cache = branch.input_cache
        if self.adapter_cache is not None:
            self.adapter_cache.free()
            self.adapter_cache = branch.adapter_cache
        self._last_draft_logits, self._last_draft_hidden = branch.last
        self._ready_draft = branch.draft
        self.reused_branches += 1

    def on_verify_result(self, draft: Draft, deep: torch.Tensor, branches: Sequence[Branch] = ()) -> list[int]:
        """Accept the agreeing prefix plus the target's token; roll both caches back.

        If only the last draft token was wrong and the target's correction is a candidate
        that was pre-drafted (`branches`), adopt that branch: its caches and its draft."""
        # deep: [k+1, H]
        if deep.shape[0] != len(draft.tokens) + 1:
            raise SessionError(f"verify result has {deep.shape[0]} rows, expected {len(draft.tokens) + 1}")
        deep = self.model.compute_states(deep)
        target_logits = self.model.output(deep)  # [k+1, V]
        verdict: Verdict = accept(draft.tokens, draft.probs, target_logits, self.params, self.generator)
        keep = draft.commit_len + 1 + verdict.num_accepted
        self.pending_token = verdict.next_token
        emitted = self._emit(draft.tokens[: verdict.num_accepted] + [verdict.next_token])
        self.accept_lengths.append(len(emitted))
        self.verdicts.append((len(draft.tokens), verdict.num_accepted))
        self.full_accepts += verdict.num_accepted == len(draft.tokens)
        match = None
        if verdict.num_accepted == len(draft.tokens) - 1 and not self.is_finished:
            match = next((b for b in branches if b.candidate == verdict.next_token), None)
            self.predraft_chances += bool(branches)
        for branch in branches:
            if branch is not match:
                branch.free()
        if match is not None:
            self._adopt(match)
            self._fit_ready_draft_to_budget()
        else:
            self.input_cache.truncate(keep)
            if self.adapter_cache is not None:
                self._refresh_adapter(draft, deep, verdict.num_accepted)
        self._prev_feature = deep[verdict.num_accepted : verdict.num_accepted + 1]
        return emitted

    def finish_alone(self, draft: Draft) -> list[int]:
        """The cloud is gone for good (its verification of `draft` never came back): emit the draft and
        go on with the draft model alone to the end. Degraded: these tokens are the adapter's, not the
        target model's."""
        if self.adapter_cache is None or draft.last_hidden is None:
            raise SessionError("no draft model on this device: it cannot finish without the cloud")
        self.degraded = True
        emitted = self._emit(draft.tokens)
        hidden = draft.last_hidden  # [1, H]: the adapter's state at the draft's last position
        while not self.is_finished:
            logits = self.model.output(hidden)[0]  # [V]
            token = sample(logits_to_probs(logits, self.params), self.generator)
            emitted += self._emit([token])
            if self.is_finished:
                break
            ids = torch.tensor([token])
            shallow = self.model.input(ids, self.input_cache)  # [1, H]
            hidden = self._run_adapter(self.adapter_cache, shallow, ids, hidden)
        return emitted

    def _refresh_adapter(self, draft: Draft, deep: torch.Tensor, num_accepted: int) -> None:
        """Roll the adapter back to the kept positions. A feature adapter drafted the accepted tokens
        from its own predicted deep states; now the cloud's are known, so it re-reads those rows
        from the exact ones (the pending token's row already read an exact state)."""
        # deep: [k+1, H]; row i is the position of draft.shallow row i
        if self.model.adapter.spec.side_input != "feature" or num_accepted == 0:
            self.adapter_cache.truncate(draft.commit_len + 1 + num_accepted)
            return
        self.adapter_cache.truncate(draft.commit_len + 1)
        ids = torch.tensor(draft.tokens[:num_accepted])
        self._run_adapter(self.adapter_cache, draft.shallow[1 : 1 + num_accepted], ids, deep[:num_accepted])

    def _fit_ready_draft_to_budget(self) -> None:
        draft = self._ready_draft
        budget = self._draft_budget()
        if len(draft.tokens) > budget:
            draft = Draft(draft.commit_len, draft.tokens[:budget],
                          None if draft.probs is None else draft.probs[:budget], draft.shallow[: budget + 1])
            # can_continue stays False: the draft now fills its budget
            self.input_cache.truncate(draft.commit_len + budget + 1)
            if self.adapter_cache is not None:
                self.adapter_cache.truncate(draft.commit_len + budget + 1)
            self._ready_draft = draft

    def free(self) -> None:
        self.input_cache.free()
        if self.adapter_cache is not None:
            self.adapter_cache.free()


def warm_up_device(model: DeviceModel, prompt_tokens: int = 256) -> None:
    """Run every device-side kernel once (prompt chunk, output head, a draft) on a throwaway
    session, so the first user request does not pay the allocator's and kernels' first-call cost,
    and the timings the device reports from then on describe steady state."""
    size = max(1, min(prompt_tokens, model.context_length - 8))
    ids = [1 + i % (model.vocab_size - 1) for i in range(size)]
    session = DeviceSession(model, ids, draft_config=DraftConfig(eta=0.0, max_draft=2), max_new_tokens=4)
    try:
        session.prefill_chunk(size)
        session.on_prefill_result(torch.zeros(1, model.hidden_size))
        if not session.is_finished:  # the head's pick from a zero state may be end-of-sequence
            session.draft()
    finally:
        session.free()
