"""The demo model's draft adapter, distilled on its own code corpus (a model without a chat template;
chat models go through run.py). It lives with adapter training rather than in demo_model/, so the
demo model's package (corpus, builder) and adapter training do not import each other.

Distil HAT's draft adapter Λ from the middle submodel (HAT §3.4, eq. 4):

    loss = SmoothL1(f_L, f_S) + w_ce · CE(softmax(H_L(f_L)), H_L(f_S))

f_L is the middle submodel's output (the LLM's final hidden state before the
norm + head), f_S the adapter's output on the same shallow states. Only Λ's
parameters receive gradients; the LLM is frozen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from shared.model.adapter import ADAPTER_FILENAME, DraftAdapter
from shared.model.checkpoint import Checkpoint, ModelLoadError, load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from tophatctl.adapter_training.distill import distillation_loss
from tophatctl.demo_model.corpus import held_out_prompts, iter_corpus_files, split_corpus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterTrainConfig:
    split_layers: int = 2
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 1e-3
    w_ce: float = 0.1  # HAT's weight of the cross-entropy term
    seed: int = 0
    eval_prompts: int = 12
    eval_new_tokens: int = 48
    eta: float = 0.6


def _training_stream(checkpoint: Checkpoint) -> torch.Tensor:
    if checkpoint.tokenizer is None:
        raise ModelLoadError(f"{checkpoint.path} has no tokenizer; adapter training tokenizes the corpus")
    train_files, _ = split_corpus(iter_corpus_files())
    ids: list[int] = []
    for f in train_files:
        ids.extend(checkpoint.text_tokenizer().encode(f.text, add_special_tokens=False))
    return torch.tensor(ids)


def _targets(checkpoint: Checkpoint, batch: torch.Tensor, split_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shallow states after layer m, and the middle's output f_L (before the final norm)."""
    captured: dict[str, torch.Tensor] = {}
    hook = checkpoint.decoder.norm.register_forward_hook(lambda _m, inputs, _o: captured.update(f_l=inputs[0]))
    try:
        with torch.no_grad():
            out = checkpoint.decoder(input_ids=batch, output_hidden_states=True)
    finally:
        hook.remove()
    return out.hidden_states[split_layers], captured["f_l"]  # each [B, S, H]


def evaluate_accept_length(checkpoint: Checkpoint, adapter: DraftAdapter, cfg: AdapterTrainConfig) -> dict:
    """Mean tokens per verification round (greedy) on held-out prompts at eta."""
    device = DeviceModel.from_checkpoint(checkpoint, cfg.split_layers, adapter)
    cloud = LocalCloud(MiddleSubmodel(checkpoint, cfg.split_layers))
    lengths: list[int] = []
    for index, prompt in enumerate(held_out_prompts(cfg.eval_prompts, seed=cfg.seed + 1)):
        ids = checkpoint.text_tokenizer().encode(prompt, add_special_tokens=False)
        session = DeviceSession(device, ids, draft_config=DraftConfig(eta=cfg.eta), max_new_tokens=cfg.eval_new_tokens)
        lengths += asyncio.run(generate(session, cloud, session_id=index + 1)).accept_lengths
    return {"eta": cfg.eta, "mean_accept_length": round(sum(lengths) / len(lengths), 3), "rounds": len(lengths)}


def train_adapter(model_dir: Path, cfg: AdapterTrainConfig = AdapterTrainConfig(), out: Path | None = None) -> dict:
    checkpoint = load_checkpoint(model_dir)
    torch.manual_seed(cfg.seed)
    adapter = DraftAdapter(checkpoint, cfg.split_layers)
    params = adapter.trainable_parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    stream = _training_stream(checkpoint)
    generator = torch.Generator().manual_seed(cfg.seed)
    started = time.monotonic()
    progress = tqdm(range(cfg.steps), desc="train adapter", unit="step")
    adapter.train()
    for step in progress:
        starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=generator).tolist()
        batch = torch.stack([stream[s : s + cfg.seq_len] for s in starts])  # [B, S]
        shallow, f_teacher = _targets(checkpoint, batch, cfg.split_layers)
        loss = distillation_loss(checkpoint, adapter.forward_training(shallow), f_teacher, cfg.w_ce)
        for group in optimizer.param_groups:
            group["lr"] = cfg.learning_rate * min(1.0, (step + 1) / 20) * (1 - 0.9 * step / cfg.steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        progress.set_postfix(loss=f"{loss.item():.4f}")
    adapter.eval()
    adapter.requires_grad_(False)
    report = {
        "train_seconds": round(time.monotonic() - started, 1),
        "final_loss": round(loss.item(), 4),
        "config": asdict(cfg),
    }
    report["held_out"] = evaluate_accept_length(checkpoint, adapter, cfg)
    random_adapter = DraftAdapter(checkpoint, cfg.split_layers).randomize(cfg.seed)
    report["held_out_untrained_random"] = evaluate_accept_length(checkpoint, random_adapter, cfg)
    out = out or Path(model_dir) / ADAPTER_FILENAME
    adapter.save(out, extra_metadata=report)
    log.info("adapter saved to %s: %s", out, report)
    return report
