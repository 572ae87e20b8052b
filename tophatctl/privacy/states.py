"""The attacker's own training data: hidden states of public text.

The checkpoint is public, so a curious cloud can run the device's half itself
(embeddings + the first m layers, the project's InputSubmodel) on any text it
likes and learn the map from hidden state back to token. These helpers compute
exactly the states a device would send for a token sequence, so attacks are
trained and evaluated on the same kind of tensor the cloud receives.

m = 0 means "the embeddings themselves" (no decoder layer): the baseline at
which nearest-embedding inversion is trivially exact. The product never splits
there (validate_split refuses it), but the attack ladder starts from it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shared.model.checkpoint import Checkpoint
from shared.model.split import InputSubmodel


class StatesError(ValueError):
    """Token ids or a split depth the checkpoint cannot produce hidden states for."""


def _validate(checkpoint: Checkpoint, split_layers: int) -> None:
    if not 0 <= split_layers <= checkpoint.num_layers - 1:
        raise StatesError(
            f"split_layers must be in 0..{checkpoint.num_layers - 1} for a {checkpoint.num_layers}-layer model "
            f"(got {split_layers}); 0 means the embeddings themselves"
        )


def _ids_tensor(checkpoint: Checkpoint, token_ids: Iterable[int]) -> torch.Tensor:
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    # ids: [S]
    if ids.dim() != 1 or ids.numel() == 0:
        raise StatesError("token_ids must be one non-empty sequence of ints")
    if int(ids.min()) < 0 or int(ids.max()) >= checkpoint.vocab_size:
        raise StatesError(f"token ids must be in 0..{checkpoint.vocab_size - 1}")
    return ids


class StateComputer:
    """Layer-m hidden states of one sequence at a time, in the checkpoint's dtype, returned fp32."""

    def __init__(self, checkpoint: Checkpoint, split_layers: int):
        _validate(checkpoint, split_layers)
        self.checkpoint = checkpoint
        self.split_layers = split_layers
        self.embed_tokens = checkpoint.decoder.embed_tokens
        # m = 0 has no layers to run; InputSubmodel (rightly) refuses a split the cloud would not accept.
        self.submodel = InputSubmodel(checkpoint, split_layers) if split_layers > 0 else None

    def __call__(self, token_ids: Iterable[int]) -> torch.Tensor:
        ids = _ids_tensor(self.checkpoint, token_ids)
        if self.submodel is None:
            with torch.inference_mode():
                hidden = self.embed_tokens(ids.to(self.embed_tokens.weight.device))
        else:
            cache = self.submodel.new_cache()  # a fresh session: the states a device sends for this prompt
            try:
                hidden = self.submodel(ids, cache)
            finally:
                cache.free()
        # hidden: [S, H]; clone outside inference mode so attacks can train on it (autograd refuses inference tensors)
        return hidden.detach().to(device="cpu", dtype=torch.float32).clone()


def hidden_states(checkpoint: Checkpoint, token_ids: list[int], split_layers: int) -> torch.Tensor:
    """What the device sends for one sequence at split depth m: [S, H] fp32."""
    return StateComputer(checkpoint, split_layers)(token_ids)


def tokenize(checkpoint: Checkpoint, text: str) -> list[int]:
    if checkpoint.tokenizer is None:
        raise StatesError(f"{checkpoint.path} has no tokenizer; pass token ids instead of text")
    return list(checkpoint.tokenizer(text, add_special_tokens=False)["input_ids"])


def token_sequences(checkpoint: Checkpoint, texts: Iterable[str], seq_len: int, max_tokens: int) -> list[list[int]]:
    """Each text tokenized and cut into pieces of seq_len (a shorter tail is kept if it has >= 2 tokens);
    pieces never straddle two texts, so every sequence is a prompt a user could have sent. Stops at max_tokens."""
    if seq_len < 1 or max_tokens < 1:
        raise StatesError("seq_len and max_tokens must be positive")
    sequences: list[list[int]] = []
    total = 0
    for text in texts:
        ids = tokenize(checkpoint, text)
        for start in range(0, len(ids), seq_len):
            piece = ids[start : start + seq_len][: max_tokens - total]
            if len(piece) < 2:
                continue
            sequences.append(piece)
            total += len(piece)
            if total >= max_tokens:
                return sequences
    return sequences


def dataset(
    checkpoint: Checkpoint, texts: Iterable[str], split_layers: int, seq_len: int, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(states [S, H] fp32, ids [S] long)] for the texts, at most max_tokens tokens in all."""
    compute = StateComputer(checkpoint, split_layers)
    out = []
    for ids in token_sequences(checkpoint, texts, seq_len, max_tokens):
        out.append((compute(ids), torch.tensor(ids, dtype=torch.long)))
    return out
