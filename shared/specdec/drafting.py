"""The drafting half of a device session: autoregressive drafting until confidence drops below eta
(HAT eq. 5), and parallel drafting (§3.5), which pre-drafts branches on forked caches while a draft
is being verified.

`Drafting` is a mixin of `DeviceSession` (shared/specdec/device_session.py), split off so each file
holds one concern. It has no state of its own: it reads and advances the session's model, caches,
sampling params, draft config and generators, and runs the adapter through the session's
`_run_adapter`.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING

import torch

from shared.specdec.draft import Branch, Draft
from shared.specdec.draft_config import DraftConfig, SessionError
from shared.specdec.sampling import SamplingParams, logits_to_probs, sample, sample_logits
from shared.specdec.verify_layout import VerifyLayout

if TYPE_CHECKING:
    from shared.model.kv_cache import SessionKV
    from shared.model.tree_rows import TreeRows
    from shared.specdec.device_model import DeviceModel
    from shared.specdec.trial_round import TrialRound


class Drafting:
    """Draft, continue an adopted branch's draft, pre-draft branches, adopt one (DeviceSession's)."""

    # The host's state this mixin reads and advances (DeviceSession sets all of it): declarations only.
    trial: TrialRound | None
    model: DeviceModel
    params: SamplingParams
    draft_config: DraftConfig
    max_new_tokens: int
    generated: list[int]
    pending_token: int | None
    generator: torch.Generator
    _draft_rng: torch.Generator
    input_cache: SessionKV
    adapter_cache: SessionKV | None
    draft_seconds: list[tuple[float, int]]
    predraft_seconds: float
    reused_branches: int
    _ready_draft: Draft | None
    _last_draft_logits: torch.Tensor | None
    _last_draft_hidden: torch.Tensor | None
    _prev_feature: torch.Tensor | None
    _cloud_kept: tuple[int, ...] | None

    if TYPE_CHECKING:  # the host's, likewise

        @property
        def is_finished(self) -> bool: ...

        @property
        def commit_len(self) -> int: ...

        def _run_adapter(
            self,
            cache: SessionKV | None,
            shallow: torch.Tensor,
            token_ids: torch.Tensor,
            prev_features: torch.Tensor | None,
            tree: TreeRows | None = None,
        ) -> torch.Tensor: ...

        def draft_tree(self) -> Draft: ...

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

    def _run_draft(
        self,
        round_start: int,
        token: int | None,
        input_cache,
        adapter_cache,
        budget: int,
        should_stop=None,
        hidden: torch.Tensor | None = None,
        prev_feature: torch.Tensor | None = None,
    ):
        """Autoregressive drafting on the given caches, from `token` (not yet in the caches; its
        position's previous deep state is `prev_feature`) or, to continue a draft, from `hidden`
        (the adapter's state at the caches' last position).

        Returns (tokens, q rows (none when greedy), shallow rows, (logits of the last drafting step, the adapter state
        they came from), the adapter's state at the last row, whether eta / EOS ended it)."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        shallows: list[torch.Tensor] = []
        last_logits = last_hidden = None
        ended = False
        prev = prev_feature if token is not None else hidden
        recomputed = self._recomputes_adapter_path()
        while True:
            if token is not None:
                ids = torch.tensor([token])
                shallow = self.model.input(ids, input_cache)  # [1, H]
                shallows.append(shallow)
                if adapter_cache is not None and ended and recomputed:
                    # the last token of a draft that stopped: nothing drafts from its adapter row, and the verdict
                    # re-reads the accepted rows from the cloud's deep states, so that row is left to a degraded
                    # finish, the one reader (finish_alone)
                    hidden = None
                elif adapter_cache is not None:
                    hidden = self._run_adapter(adapter_cache, shallow, ids, prev)  # [1, H]
                    prev = hidden  # drafting ahead, the next position reads the adapter's own prediction
            if ended or len(tokens) >= budget or (should_stop is not None and should_stop()):
                break
            assert hidden is not None  # the pending token's row, or the adapter state a continued draft starts from
            last_logits = self.model.draft_logits(hidden)[0]  # [V]: the draft head (a truncated vocabulary)
            last_hidden = hidden
            if self.params.is_greedy:  # no q to keep: a greedy draft carries none (_make_draft)
                token = sample_logits(last_logits, self.params, None)
                confidence = torch.softmax(last_logits, -1)[token]
            else:
                q = logits_to_probs(last_logits, self.params)
                token = sample(q, self._draft_stream(round_start, input_cache.length))
                confidence = q[token]
                probs.append(q)
            tokens.append(token)
            ended = float(confidence) < self.draft_config.eta or token == self.model.eos_token_id
        return tokens, probs, shallows, (last_logits, last_hidden), hidden, ended

    def _recomputes_adapter_path(self) -> bool:
        """Whether the adapter reads the cloud's deep states (a feature adapter): after a verdict it runs the
        accepted rows again from the exact states, so the rows it drafted from its own predictions are dropped."""
        adapter = self.model.adapter
        return adapter is not None and adapter.spec.side_input == "feature"

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
        """Draft until confidence < eta (eq. 5) or the budget runs out; a tree when configured for one. A
        pending trial (`self.trial`) drafts this round in its shape instead; the verdict restores the policy."""
        if self.pending_token is None or self.is_finished:
            raise SessionError("draft() before prefill or after the session finished")
        trial = self.trial
        if trial is None or trial.running or trial.done or self._ready_draft is not None:
            return self._draft_round()
        trial.restore, self.draft_config = self.draft_config, trial.config
        made = self._draft_round()
        trial.draft_s = self.draft_seconds[-1][0] if self.draft_seconds else 0.0
        return made

    def _draft_round(self) -> Draft:
        if self.draft_config.uses_tree and self.model.adapter is not None and self._ready_draft is None:
            return self.draft_tree()
        started = time.perf_counter()
        ready, self._ready_draft = self._ready_draft, None  # pre-drafted during the last verification
        if ready is not None:
            return self._finish_ready_draft(ready, started)
        start = self.commit_len
        tokens, probs, shallows, last, hidden, ended = self._run_draft(
            start,
            self.pending_token,
            self.input_cache,
            self.adapter_cache,
            self._draft_budget(),
            prev_feature=self._prev_feature,
        )
        self._last_draft_logits, self._last_draft_hidden = last
        self.draft_seconds.append((time.perf_counter() - started, len(shallows)))
        draft = self._make_draft(start, tokens, probs, shallows, hidden, ended)
        kept = self._take_kept()  # the last round was a tree: the cloud moves its accepted path down first
        if kept is not None:
            draft.layout = VerifyLayout(None, kept)
        return draft

    def _take_kept(self) -> tuple[int, ...] | None:
        kept, self._cloud_kept = self._cloud_kept, None
        return kept

    def _finish_ready_draft(self, ready: Draft, started: float) -> Draft:
        """An adopted branch, drafted on to where draft() would have stopped (the cloud's answer may
        have cut it short): the same draft the session makes without parallel drafting."""
        more = self._draft_budget() - len(ready.tokens)
        if not ready.can_continue or more <= 0:
            return ready
        tokens, probs, shallows, last, hidden, ended = self._run_draft(
            ready.commit_len, None, self.input_cache, self.adapter_cache, more, hidden=ready.last_hidden
        )
        if tokens:
            self._last_draft_logits, self._last_draft_hidden = last
        self.draft_seconds.append((time.perf_counter() - started, len(shallows)))
        earlier_probs = [] if ready.probs is None else list(ready.probs.unbind(0))
        return self._make_draft(
            ready.commit_len, ready.tokens + tokens, earlier_probs + probs, [ready.shallow] + shallows, hidden, ended
        )

    # -- parallel drafting (HAT §3.5) -------------------------------------------------
    def predraft(self, draft: Draft, num_candidates: int, steps: int, should_stop=None) -> list[Branch]:
        """While `draft` is being verified, draft `steps` ahead from each of the top candidates
        for its last position (other than the drafted token itself). Runs on forked caches, so
        the session's own caches are untouched until a branch is adopted. `should_stop()` turning
        true (the verification came back) ends pre-drafting early: it may only use idle time."""
        if not draft.tokens or num_candidates < 1 or steps < 0 or self._last_draft_logits is None:
            return []
        if draft.layout is not None and draft.layout.parents is not None:
            return []  # a tree already drafts the alternatives pre-drafting would
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
                branch_commit,
                candidate,
                input_cache,
                adapter_cache,
                budget,
                should_stop,
                prev_feature=self._last_draft_hidden,
            )
            branches.append(
                Branch(
                    candidate,
                    input_cache,
                    adapter_cache,
                    last,
                    self._make_draft(branch_commit, tokens, probs, shallows, hidden, ended),
                )
            )
        steps_run = sum(len(b.draft.tokens) + 1 for b in branches)
        self.draft_seconds.append((time.perf_counter() - started, steps_run))
        self.predraft_seconds += time.perf_counter() - started  # off the round's path: the draft budget leaves it out
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

    def _fit_ready_draft_to_budget(self) -> None:
        draft = self._ready_draft
        assert draft is not None  # the one caller has just adopted a branch, which set it
        budget = self._draft_budget()
        if len(draft.tokens) > budget:
            draft = Draft(
                draft.commit_len,
                draft.tokens[:budget],
                None if draft.probs is None else draft.probs[:budget],
                draft.shallow[: budget + 1],
            )
            # can_continue stays False: the draft now fills its budget
            self.input_cache.truncate(draft.commit_len + budget + 1)
            if self.adapter_cache is not None:
                self.adapter_cache.truncate(draft.commit_len + budget + 1)
            self._ready_draft = draft
