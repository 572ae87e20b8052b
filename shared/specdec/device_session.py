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

One concern per file: the config and errors (draft_config.py), the model parts (device_model.py),
the draft and its branches (draft.py), drafting (drafting.py); this file holds the session's state,
prefill and the verdict. The names callers import stay importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.model.adapter import DraftAdapter
from shared.model.kv_cache import SessionKV
from shared.model.tree_rows import TreeRows
from shared.specdec.device_model import DeviceModel
from shared.specdec.draft import Branch, Draft, branch_for, only_last_corrected
from shared.specdec.draft_config import DraftConfig, SessionError
from shared.specdec.sampling import SamplingParams, Verdict, accept, logits_to_probs, sample_logits
from shared.specdec.tree import accept_tree_greedy, accept_tree_sampled, depths
from shared.specdec.tree_drafting import TreeDrafting, TreeRound
from shared.specdec.trial_round import TrialRound

__all__ = ["Branch", "DeviceModel", "DeviceSession", "Draft", "DraftConfig", "SessionError", "warm_up_device"]


@dataclass
class DeviceSession(TreeDrafting):
    """One generation on the device: prefill, draft (Drafting), accept; no I/O."""

    model: DeviceModel
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    draft_config: DraftConfig = field(default_factory=DraftConfig)
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
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
        self.round_rows: list[int] = []  # rows each verification carried (the root plus its drafts)
        self.draft_seconds: list[tuple[float, int]] = []  # (seconds, device steps) of each draft() call
        self.predraft_seconds = 0.0  # of those, parallel drafting's (while a verification is in flight)
        # Wall-clock timings the engine records for telemetry (the simulator's latency models):
        self.round_overhead_s: list[float] = []  # per round, outside drafting and the cloud wait
        self.prefill_seconds: list[tuple[float, int]] = []  # (compute + send, tokens) per prompt chunk
        self._ready_draft: Draft | None = None  # an adopted pre-drafted branch, used by the next draft()
        self._last_draft_logits: torch.Tensor | None = None  # draft logits at the last drafted position
        self._last_draft_hidden: torch.Tensor | None = None  # [1, H]: the adapter state they came from
        # [1, H]: the cloud's deep state at the position before the pending token (feature adapters read it)
        self._prev_feature: torch.Tensor | None = None
        self._tree_round: TreeRound | None = None  # the tree in flight: its frame rows' cache rows
        self._cloud_kept: tuple[int, ...] | None = None  # the last tree's accepted rows, for the next request
        self.reused_branches = 0
        self.predraft_chances = 0  # rounds with pre-drafted branches whose last draft token was corrected
        self.full_accepts = 0  # verification rounds that accepted every drafted token (L = k + 1)
        self.degraded = False  # finished on the device alone after losing the cloud (finish_alone)
        self.ignore_eos = False  # true: only max_new_tokens ends the answer (vLLM's ignore_eos)
        self.trial: TrialRound | None = None  # one round in a shape the draft budget has not measured yet

    # -- state -----------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        if len(self.generated) >= self.max_new_tokens:
            return True
        return not self.ignore_eos and bool(self.generated) and self.generated[-1] == self.model.eos_token_id

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

    def _draft_adapter(self) -> DraftAdapter:
        if self.model.adapter is None:
            raise SessionError("no draft adapter on this device")
        return self.model.adapter

    def _run_adapter(
        self,
        cache: SessionKV | None,
        shallow: torch.Tensor,
        token_ids: torch.Tensor,
        prev_features: torch.Tensor | None,
        tree: TreeRows | None = None,
    ) -> torch.Tensor:
        """The adapter over rows of (token, shallow state, deep state of the position before); `tree`: the
        rows are tree nodes, whose position before is their parent's."""
        # shallow: [S, H], token_ids: [S], prev_features: [S, H] -> f_S: [S, H]
        adapter = self._draft_adapter()
        if cache is None:
            raise SessionError("no draft adapter cache in this session")
        side = self._adapter_side(token_ids, prev_features)
        return adapter(shallow, cache, side) if tree is None else adapter(shallow, cache, side, tree)

    def _adapter_side(self, token_ids: torch.Tensor, prev_features: torch.Tensor | None) -> torch.Tensor | None:
        """What the adapter reads besides the shallow state, for these rows (a batched pass packs them)."""
        # token_ids: [S], prev_features: [S, H] -> [S, H] or None
        side_input = self._draft_adapter().spec.side_input
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
        token = sample_logits(logits, self.params, self.generator)
        self.pending_token = token
        return self._emit([token])

    # -- verify ----------------------------------------------------------------
    def on_verify_result(self, draft: Draft, deep: torch.Tensor, branches: Sequence[Branch] = ()) -> list[int]:
        """Accept the agreeing prefix plus the target's token; roll both caches back.

        If only the last draft token was wrong and the target's correction is a candidate
        that was pre-drafted (`branches`), adopt that branch: its caches and its draft."""
        # deep: [k+1, H]
        if deep.shape[0] != len(draft.tokens) + 1:
            raise SessionError(f"verify result has {deep.shape[0]} rows, expected {len(draft.tokens) + 1}")
        deep = self.model.compute_states(deep)
        if draft.layout is not None and draft.layout.parents is not None:
            return self._on_tree_result(draft, deep)
        target_logits = self.model.output(deep)  # [k+1, V]
        verdict: Verdict = accept(draft.tokens, draft.probs, target_logits, self.params, self.generator)
        keep = draft.commit_len + 1 + verdict.num_accepted
        self.pending_token = verdict.next_token
        emitted = self._emit(draft.tokens[: verdict.num_accepted] + [verdict.next_token])
        self.accept_lengths.append(len(emitted))
        self.verdicts.append((len(draft.tokens), verdict.num_accepted))
        self.round_rows.append(deep.shape[0])
        self._end_trial()
        self.full_accepts += verdict.num_accepted == len(draft.tokens)
        match = None
        if only_last_corrected(len(draft.tokens), verdict.num_accepted) and not self.is_finished:
            match = branch_for(branches, verdict.next_token)
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

    def _end_trial(self) -> None:
        """The trial round got its verdict: note which round it was, and draft in the session's own policy again."""
        trial = self.trial
        if trial is not None and trial.restore is not None:
            trial.index = len(self.accept_lengths) - 1
            self.draft_config, trial.restore = trial.restore, None

    def _on_tree_result(self, draft: Draft, deep: torch.Tensor) -> list[int]:
        """Accept the longest path the target agrees with, plus its token; keep only that path's KV."""
        # deep: [N, H], one row per tree node in the frame's order
        assert draft.layout is not None and draft.layout.parents is not None and self.pending_token is not None
        tokens, parents = [self.pending_token, *draft.tokens], [-1, *draft.layout.parents]
        target_logits = self.model.output(deep)  # [N, V]
        if self.params.is_greedy:
            verdict = accept_tree_greedy(tokens, parents, target_logits)
        else:
            assert draft.probs is not None  # a sampled tree carries q per node
            target = logits_to_probs(target_logits, self.params)
            verdict = accept_tree_sampled(tokens, parents, draft.probs, target, self.generator)
        path = verdict.path
        self.pending_token = verdict.next_token
        emitted = self._emit([tokens[row] for row in path] + [verdict.next_token])
        self.accept_lengths.append(len(emitted))
        self.verdicts.append((max(depths(parents)), len(path)))  # a tree's alpha: levels drafted, levels accepted
        self.round_rows.append(len(tokens))
        self._end_trial()
        self.keep_tree_path(draft, deep, path)
        self._prev_feature = deep[path[-1] if path else 0][None]
        return emitted

    def finish_alone(self, draft: Draft) -> list[int]:
        """The cloud is gone for good (its verification of `draft` never came back): emit the draft and
        go on with the draft model alone to the end. Degraded: these tokens are the adapter's, not the
        target model's."""
        is_tree = draft.layout is not None and draft.layout.parents is not None
        last = None if is_tree else self._last_adapter_state(draft)
        if self.adapter_cache is None or (last is None and not is_tree):
            raise SessionError("no draft model on this device: it cannot finish without the cloud")
        self.degraded = True
        if is_tree:
            emitted, hidden = [], self.degrade_tree(draft)  # a tree is no sequence: draft on from its root
        else:
            assert last is not None  # checked above
            emitted, hidden = self._emit(draft.tokens), last
        while not self.is_finished:
            logits = self.model.output(hidden)[0]  # [V]
            token = sample_logits(logits, self.params, self.generator)
            emitted += self._emit([token])
            if self.is_finished:
                break
            ids = torch.tensor([token])
            shallow = self.model.input(ids, self.input_cache)  # [1, H]
            hidden = self._run_adapter(self.adapter_cache, shallow, ids, hidden)
        return emitted

    def _last_adapter_state(self, draft: Draft) -> torch.Tensor | None:
        """[1, H]: the adapter's state at the chain draft's last position. A draft that stopped left its last
        token's row out of the adapter (`_run_draft`): run it now, from the state its token was drafted from. A
        draft that carries no state and whose caches do not end where that row would go (an adopted branch cut
        to the budget, `_fit_ready_draft_to_budget`) is run again from its first row, as drafting would."""
        cache = self.adapter_cache
        if draft.last_hidden is not None or cache is None:
            return draft.last_hidden
        row_left_out = cache.length == draft.commit_len + len(draft.tokens)  # else it is there, or was cut off
        if draft.tokens and self._last_draft_hidden is not None and row_left_out:
            ids = torch.tensor(draft.tokens[-1:])
            return self._run_adapter(cache, draft.shallow[-1:], ids, self._last_draft_hidden)
        if self._prev_feature is None or self.pending_token is None:
            return None
        # rows (pending, d_1..d_k) from the deep state before the pending token; each drafts from the one before
        cache.truncate(draft.commit_len)
        hidden = self._prev_feature
        for row, token in enumerate([self.pending_token, *draft.tokens]):
            hidden = self._run_adapter(cache, draft.shallow[row : row + 1], torch.tensor([token]), hidden)
        return hidden

    def _refresh_adapter(self, draft: Draft, deep: torch.Tensor, num_accepted: int) -> None:
        """Roll the adapter back to the kept positions. A feature adapter drafted the accepted tokens
        from its own predicted deep states; now the cloud's are known, so it re-reads those rows
        from the exact ones (the pending token's row already read an exact state)."""
        # deep: [k+1, H]; row i is the position of draft.shallow row i
        cache = self.adapter_cache
        assert cache is not None  # the one caller checked
        if not self._recomputes_adapter_path() or num_accepted == 0:
            cache.truncate(draft.commit_len + 1 + num_accepted)
            return
        cache.truncate(draft.commit_len + 1)
        ids = torch.tensor(draft.tokens[:num_accepted])
        self._run_adapter(cache, draft.shallow[1 : 1 + num_accepted], ids, deep[:num_accepted])

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
