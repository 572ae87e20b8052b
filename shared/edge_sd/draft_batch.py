"""Edge SD's draft server: one batched forward pass per draft position over many users' streams.

The SBS drafts for every task of a batch at once (Edge SD §II-B, token mode): at each draft position the
sessions still drafting are packed into one pass of the draft model (embeddings + first m layers + draft
adapter, then norm + head), each session's rows attending to its own caches only
(`LayerRange.forward_packed`, `DraftAdapter.forward_packed`). Everything else — which token runs next,
the features, sampling the draft from its own per-position stream, q, EOS — is the session's own
bookkeeping (`StreamSession._next_advance / _record_advance / _record_draft / _record_prefill`), so a
batched draft is the same draft `draft_step()` would make, session by session.

After a verdict that accepted everything with a bonus, the last draft and the bonus both wait to run.
The feature adapter reads the state of the position before, so those two positions cannot share a pass:
the pass before the draft is split into one sub-pass per waiting position.

The session's `draft_seconds` is not touched here; the caller times the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.specdec.device_session import SessionError
from shared.specdec.draft_stream import DraftChunk
from shared.specdec.stream_session import StreamSession


def _model_of(sessions: Sequence[StreamSession]):
    model = sessions[0].model
    if any(s.model is not model for s in sessions):
        raise SessionError("a batched draft pass needs every session on the same draft model")
    if model.adapter is None:
        raise SessionError("batched drafting needs a draft adapter")
    return model


def _packed_pass(
    sessions: Sequence[StreamSession], ids: Sequence[torch.Tensor], prev_features: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Input submodel + adapter over each session's new rows, packed: [(shallow [n_i, H], hidden [n_i, H])]."""
    # ids[i]: [n_i]; prev_features[i]: [n_i, H], the deep state of the position before each row
    model = _model_of(sessions)
    lengths = [t.shape[0] for t in ids]
    packed_ids = torch.cat(list(ids))  # [T]
    embedded = model.input.embed_tokens(packed_ids.to(model.input.embed_tokens.weight.device))  # [T, H]
    shallow = model.input.forward_packed(embedded, [s.input_cache for s in sessions], lengths)  # [T, H]
    sides = [s._adapter_side(t, f) for s, t, f in zip(sessions, ids, prev_features)]
    # one draft model (checked above), so one side input for all: every entry is None or none is
    present = [s for s in sides if s is not None]
    side = None if sides[0] is None else torch.cat(present)  # [T, H]
    hidden = model.adapter.forward_packed(shallow, [s.adapter_cache for s in sessions], lengths, side)  # [T, H]
    return list(zip(shallow.split(lengths), hidden.split(lengths)))


def prefill_batch(sessions: Sequence[StreamSession]) -> None:
    """Each session's prefill_locally(), as ONE packed pass over all prompts (input layers + adapter)."""
    if not sessions:
        return
    ids = [torch.tensor(s.prompt_ids) for s in sessions]
    device = sessions[0].model.device
    # inside the prompt no deep state exists yet: a feature adapter reads zeros there (as prefill_locally)
    zeros = [torch.zeros(len(s.prompt_ids), s.model.hidden_size, dtype=s.model.dtype, device=device) for s in sessions]
    for session, (_, hidden) in zip(sessions, _packed_pass(sessions, ids, zeros)):
        session._record_prefill(hidden)


def _advance_batch(sessions: Sequence[StreamSession]) -> list[torch.Tensor]:
    """Run every waiting token of each session, one position per packed sub-pass: the adapter state [1, H]
    at each session's last token."""
    last: dict[int, torch.Tensor] = {}
    while waiting := [i for i, s in enumerate(sessions) if s.advanced < len(s.seq)]:
        group = [sessions[i] for i in waiting]
        steps = [s._next_advance() for s in group]  # (position, ids [1])
        rows = _packed_pass(group, [ids for _, ids in steps], [s.features[p - 1] for s, (p, _) in zip(group, steps)])
        for i, session, (position, _), (shallow, hidden) in zip(waiting, group, steps, rows):
            last[i] = session._record_advance(position, shallow, hidden)
    return [last[i] for i in range(len(sessions))]


def draft_counts(sessions: Sequence[StreamSession], spec_len: int) -> list[int]:
    """Drafts each session makes in `draft_batch` (fewer when one drafts EOS first)."""
    return [0 if s.is_finished else min(spec_len, s.draft_room()) for s in sessions]


def draft_pass_sizes(sessions: Sequence[StreamSession], spec_len: int) -> list[int]:
    """The batch size b of each draft position's packed pass `draft_batch` will run (call it before):
    the sessions still drafting there. An EOS drafted early makes a later pass smaller; the extra
    sub-pass of sessions whose last draft and bonus both wait is not counted (it is the same position's)."""
    counts = draft_counts(sessions, spec_len)
    return [sum(c > k for c in counts) for k in range(max(counts, default=0))]


def draft_batch(sessions: Sequence[StreamSession], spec_len: int) -> list[DraftChunk]:
    """For each session draft min(spec_len, draft_room()) tokens (stopping at EOS), one packed pass per
    draft position over the sessions still drafting, then take each session's chunk (more=False). A
    session with no room sends just its pending final token. The chunks, in session order."""
    if spec_len < 0:
        raise ValueError(f"spec_len must be >= 0, got {spec_len}")
    if any(s.hidden_mode for s in sessions):
        raise SessionError("batched drafting is token mode only")
    counts = draft_counts(sessions, spec_len)
    drafted = [0] * len(sessions)
    while active := [i for i, s in enumerate(sessions) if drafted[i] < counts[i] and not s.stopped]:
        group = [sessions[i] for i in active]
        hidden = torch.cat(_advance_batch(group))  # [B, H]
        logits = group[0].model.output(hidden)  # [B, V]
        for i, session, row in zip(active, group, logits):
            session._record_draft(row)
            drafted[i] += 1
    return [s.take_chunk(more=False)[0] for s in sessions]
