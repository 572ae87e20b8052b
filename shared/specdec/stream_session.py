"""The device side of a streamed draft (draft_stream.py): draft one token at a time, cut chunks,
apply verdicts, roll back on a rejection. No I/O; `stream_engine.py` drives it.

A `StreamSession` is a `DeviceSession` (same model, caches, sampling streams, counters) whose
drafting is not tied to rounds. It keeps the whole token sequence with three marks:

    seq:        prompt + final tokens + speculative drafts
    final_len:  positions < final_len are final (delivered, or the one final token not yet sent)
    sent_len:   positions < sent_len went up in chunks
    advanced:   positions < advanced ran through the input submodel and the adapter (the caches'
                length); seq[advanced] is the last token, not yet run

Token mode sends token ids (any drafted token can go up); hidden mode (hat-async) sends the
shallow states of tokens, so only advanced positions can go up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from shared.specdec.device_session import DeviceSession, SessionError
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk, StreamVerifier
from shared.specdec.sampling import logits_to_probs, sample
from shared.specdec.separate_rejection import correction_token


@dataclass
class DraftedToken:
    token: int
    confidence: float  # what eta is compared with (HAT eq. 5)


# What a line of drafting owns: the sequence, both caches and the per-position tables. The main line is the
# session's own; a branch (parallel drafting, HAT §3.5) is another line forked from it.
_LINE = ("seq", "input_cache", "adapter_cache", "q_of", "q_rows", "shallow_rows", "features", "candidates", "stopped")


@dataclass
class StreamBranch:
    """A continuation pre-drafted from `candidate` in place of the draft at `position` (its correction)."""

    position: int
    candidate: int
    line: dict[str, Any]  # the _LINE fields of the branch

    def free(self) -> None:
        self.line["input_cache"].free()
        self.line["adapter_cache"].free()


MAX_CANDIDATES = 4  # top tokens kept per draft position, for parallel drafting


class StreamSession(DeviceSession):
    """Set `hidden_mode` for hat-async (chunks carry shallow states; the device verifies)."""

    hidden_mode: bool = False

    def _stream_init(self, first_token: int, feature: torch.Tensor) -> None:
        # feature: [1, H], the deep state (exact or the adapter's estimate) of the position before first_token
        if self.model.adapter is None:
            raise SessionError("streamed drafting needs a draft adapter on the device")
        self.seq = list(self.prompt_ids) + [first_token]
        self.final_len = len(self.seq)
        self.sent_len = len(self.prompt_ids)
        self.epoch = 0
        self.q_of: dict[int, float] = {}  # position -> q(x) of the draft there
        self.q_rows: dict[int, torch.Tensor] = {}  # position -> q [V] (sampling: the correction needs it)
        self.shallow_rows: dict[int, torch.Tensor] = {}  # position -> shallow state [1, H] (hidden mode)
        self.features: dict[int, torch.Tensor] = {len(self.prompt_ids) - 1: feature}  # position -> [1, H]
        self.candidates: dict[int, list[int]] = {}  # position -> the draft model's top tokens there
        self.branches: list[StreamBranch] = []
        self.local_verifier = StreamVerifier()  # hidden mode: the device verifies
        self.pending_token = first_token
        self.stopped = False  # EOS drafted: nothing after it may be drafted in this epoch

    def start_token_mode(self, first_token: int) -> list[int]:
        """After `prefill_locally()` and the cloud's first token: begin the stream."""
        self._stream_init(first_token, self._prompt_feature)
        return self._emit([first_token])

    def prefill_locally(self) -> None:
        """Token mode: the draft model's own pass over the prompt (the cloud prefills the target)."""
        ids = torch.tensor(self.prompt_ids)
        shallow = self.model.input(ids, self.input_cache)  # [P, H]
        self._record_prefill(self._run_adapter(self.adapter_cache, shallow, ids, torch.zeros_like(shallow)))

    def _record_prefill(self, hidden: torch.Tensor) -> None:
        # hidden: [P, H], the adapter's states over the prompt (this session's or a batched pass's rows)
        self._prompt_feature = hidden[-1:]

    def start_hidden_mode(self) -> None:
        """hat-async, after the hidden-state prefill and `on_prefill_result` gave the first token."""
        if self.pending_token is None or self._prev_feature is None:
            raise SessionError("start_hidden_mode() before on_prefill_result()")
        self.hidden_mode = True
        self._stream_init(self.pending_token, self._prev_feature)

    # -- marks ----------------------------------------------------------------------------
    @property
    def advanced(self) -> int:
        return self.input_cache.length

    @property
    def speculative(self) -> int:
        """Drafted tokens not yet final."""
        return len(self.seq) - self.final_len

    @property
    def sendable(self) -> int:
        """Positions that could go up now, not yet sent."""
        return (self.advanced if self.hidden_mode else len(self.seq)) - self.sent_len

    def draft_room(self) -> int:
        """Drafts this stream may still add: the remaining tokens less one (a bonus may follow)."""
        if self.stopped:
            return 0
        return max(0, self.max_new_tokens - len(self.generated) - 1 - self.speculative)

    # -- drafting -------------------------------------------------------------------------
    def _advance(self) -> torch.Tensor:
        """Run seq[advanced] through the input submodel and the adapter: the adapter state [1, H]."""
        position, ids = self._next_advance()
        shallow = self.model.input(ids, self.input_cache)  # [1, H]
        hidden = self._run_adapter(self.adapter_cache, shallow, ids, self.features[position - 1])  # [1, H]
        return self._record_advance(position, shallow, hidden)

    def _next_advance(self) -> tuple[int, torch.Tensor]:
        """The position the next advance runs and its token id [1] (a batched pass packs many sessions')."""
        position = self.advanced
        return position, torch.tensor([self.seq[position]])

    def _record_advance(self, position: int, shallow: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # shallow, hidden: [1, H], the input submodel's and the adapter's states at `position`
        if self.hidden_mode:
            self.shallow_rows[position] = shallow
        self.features[position] = hidden
        return hidden

    def draft_step(self) -> DraftedToken:
        """One more draft token on the end of the stream."""
        if self.draft_room() < 1 or self.is_finished:
            raise SessionError("no room to draft")
        started = time.perf_counter()
        hidden = self._advance()
        while self.advanced < len(self.seq):  # token mode after a bonus: the last draft and the bonus both wait
            hidden = self._advance()
        drafted = self._record_draft(self.model.draft_logits(hidden)[0])  # [V]: the draft head, as HAT's rounds draft
        self.draft_seconds.append((time.perf_counter() - started, 1))
        return drafted

    def _record_draft(self, logits: torch.Tensor) -> DraftedToken:
        """Sample the next draft from the draft model's logits [V] after the last token, and keep it."""
        q = logits_to_probs(logits, self.params)
        position = len(self.seq)
        token = sample(q, self._draft_stream(-1 - self.epoch, position))
        confidence = float(torch.softmax(logits, -1)[token] if self.params.is_greedy else q[token])
        self.candidates[position] = torch.topk(logits, MAX_CANDIDATES + 1).indices.tolist()
        self.seq.append(token)
        self.q_of[position] = float(q[token])
        if not self.params.is_greedy:
            self.q_rows[position] = q
        self.stopped = token == self.model.eos_token_id and not self.ignore_eos
        return DraftedToken(token, confidence)

    def advance_to_end(self) -> None:
        """Hidden mode: run the last token too, so the whole stream can go up (its row gives the bonus)."""
        if self.advanced < len(self.seq):
            self._advance()

    # -- chunks ---------------------------------------------------------------------------
    def take_chunk(self, more: bool) -> tuple[DraftChunk, torch.Tensor | None]:
        """Everything sendable as one chunk, and (hidden mode) its shallow states [n, H]."""
        start, end = self.sent_len, self.sent_len + self.sendable
        if end <= start:
            raise SessionError("nothing to send")
        num_final = 1 if start < self.final_len else 0
        q = None
        if not self.params.is_greedy and end > start + num_final:
            q = torch.tensor([self.q_of[p] for p in range(start + num_final, end)], dtype=torch.float32)
        shallow = torch.cat([self.shallow_rows[p] for p in range(start, end)]) if self.hidden_mode else None
        self.sent_len = end
        return DraftChunk(self.epoch, start, tuple(self.seq[start:end]), num_final, q, more), shallow

    def verify_locally(self, chunk: DraftChunk, deep: torch.Tensor) -> ChunkVerdict:
        """Hidden mode: the verdict on a chunk from the deep states the cloud returned for it."""
        # deep: [n, H]
        if self.local_verifier.is_stale(chunk):
            return ChunkVerdict(self.local_verifier.epoch, 0, stale=True)
        if deep.shape[0] != len(chunk.tokens):
            raise SessionError(f"verify result has {deep.shape[0]} rows, expected {len(chunk.tokens)}")
        deep = self.model.compute_states(deep)
        p_rows = logits_to_probs(self.model.output(deep), self.params)  # [n, V]
        verdict = self.local_verifier.verify(
            chunk, p_rows, self.generator, greedy=self.params.is_greedy, downlink="full"
        )
        # the exact deep state before the next token to run: the adapter reads it instead of its estimate
        last = chunk.num_final + verdict.num_accepted - 1 if verdict.rejected else len(chunk.tokens) - 1
        if last >= 0 and not verdict.stale:
            self.features[chunk.start_pos + last] = deep[last : last + 1]
        return verdict

    def apply(self, chunk: DraftChunk, verdict: ChunkVerdict) -> list[int]:
        """Tokens the verdict makes final (delivered now); on a rejection, roll back past it."""
        if verdict.stale or chunk.epoch != self.epoch:
            return []  # drafted on a token that was rejected meanwhile
        first_draft = chunk.start_pos + chunk.num_final
        accepted = list(chunk.drafts[: verdict.num_accepted])
        adopted = False
        self.final_len = first_draft + verdict.num_accepted
        extra: list[int] = []
        if verdict.rejection is not None:  # verdict.rejected
            position = first_draft + verdict.num_accepted
            payload = verdict.rejection
            # greedy: the correction itself came down; sampling: drawn from the residual with this draft's q row
            correction = (
                payload.token
                if payload.kind == "token"
                else correction_token(payload, self.q_rows[position], self.generator)
            )
            if correction is None:
                raise SessionError("a greedy rejection without its correction token")
            self._roll_back(position)
            self.epoch = verdict.epoch
            extra = [correction]
            adopted = self._adopt_branch(position, correction)
        elif verdict.token is not None:
            if len(self.seq) != chunk.end_pos:
                raise SessionError("a bonus token for a stream that went on drafting")
            extra = [verdict.token]
        if extra:
            if not adopted:
                self.seq.append(extra[0])
            self.final_len += 1
            self.pending_token = extra[0]
        self.verdicts.append((chunk.num_drafts, verdict.num_accepted))
        self.full_accepts += verdict.num_accepted == chunk.num_drafts
        emitted = self._emit(accepted + extra)
        self.accept_lengths.append(len(emitted))
        for table in (self.q_of, self.q_rows, self.candidates):
            for p in [p for p in table if p < self.final_len]:
                del table[p]
        for branch in [b for b in self.branches if b.position < self.final_len]:  # decided: no longer a branch
            self.branches.remove(branch)
            branch.free()
        return emitted

    # -- parallel drafting (HAT §3.5) on a stream --------------------------------------------------
    # A stream pre-drafts from its own line, not from a Draft: run_stream calls this one, never DeviceSession's.
    def predraft(self, num_candidates: int, steps: int, should_stop=None) -> int:  # type: ignore[override]
        """While the chunk ending the current run is verified, draft `steps` ahead from each of the draft
        model's top candidates for its last draft (other than that draft): if the verdict rejects exactly
        that draft and corrects it to a candidate, the branch becomes the stream (`apply`). Only idle time:
        `should_stop()` (the verdict came) ends it. Returns the branches drafted."""
        position = len(self.seq) - 1  # the run's last draft, sent; the stream stopped drafting after it
        if (
            self.branches
            or position < self.final_len
            or position not in self.candidates
            or num_candidates < 1
            or self.sent_len != len(self.seq)
        ):
            return 0
        main = {name: getattr(self, name) for name in _LINE}
        candidates = [c for c in self.candidates[position] if c != self.seq[position]][:num_candidates]
        try:
            for candidate in candidates:
                if should_stop is not None and should_stop():
                    break
                line = {
                    **{name: dict(main[name]) if isinstance(main[name], dict) else main[name] for name in _LINE},
                    "seq": main["seq"][:position] + [candidate],
                    "stopped": False,
                    "input_cache": main["input_cache"].fork(position),
                    "adapter_cache": main["adapter_cache"].fork(position),
                }
                for name, value in line.items():
                    setattr(self, name, value)
                for _ in range(steps):
                    if should_stop is not None and should_stop() or self.draft_room() < 1 or self.stopped:
                        break
                    self.draft_step()
                self.branches.append(StreamBranch(position, candidate, {name: getattr(self, name) for name in _LINE}))
        finally:
            for name, value in main.items():
                setattr(self, name, value)
        self.predraft_chances += 1
        return len(self.branches)

    def _adopt_branch(self, position: int, correction: int) -> bool:
        """After a rejection at `position` corrected to `correction`: continue from the matching branch."""
        match = next((b for b in self.branches if b.position == position and b.candidate == correction), None)
        if match is None:
            return False
        self.branches.remove(match)
        self.input_cache.free()
        if self.adapter_cache is not None:
            self.adapter_cache.free()
        for name, value in match.line.items():  # seq: the kept prefix, the correction, the branch's drafts
            setattr(self, name, value)
        self.reused_branches += 1
        return True

    def free_branches(self) -> None:
        for branch in self.branches:
            branch.free()
        self.branches = []

    def free(self) -> None:
        if hasattr(self, "branches"):
            self.free_branches()
        super().free()

    def _roll_back(self, position: int) -> None:
        """Drop everything from `position` on (the rejected draft and all drafted after it)."""
        del self.seq[position:]
        self.sent_len = min(self.sent_len, position)
        if self.advanced > position:
            self.input_cache.truncate(position)
            if self.adapter_cache is not None:
                self.adapter_cache.truncate(position)
        for table in (self.q_of, self.q_rows, self.shallow_rows, self.features, self.candidates):
            for p in [p for p in table if p >= position]:
                del table[p]
        self.stopped = False
