"""Build the offline demo model: a byte-level BPE tokenizer and a small Llama.

Everything trains on the CPU from the interpreter's standard library source
(see corpus.py), so no download is ever needed. The result is saved in standard
Hugging Face format and loads through the same code as any Llama checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tophatctl.demo_model.corpus import iter_corpus_files, split_corpus

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class DemoModelConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4  # grouped-query attention: 2 query heads per KV head
    context_length: int = 2048
    # Training: random windows of the token stream.
    seq_len: int = 512
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    max_steps: int = 550
    time_budget_s: float = 40 * 60  # stop early (cosine schedule is set by max_steps)
    stop_after_steps: int | None = None  # stop early at a fixed step (reproduces a budget-stopped run)
    seed: int = 0


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN])
    return tokenizer


def _encode_stream(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def _make_model(cfg: DemoModelConfig, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def evaluate_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy over consecutive windows of a token stream."""
    model.eval()
    losses = []
    num_windows = min(max_windows, (len(stream) - 1) // seq_len)
    for i in range(num_windows):
        window = stream[i * seq_len : (i + 1) * seq_len + 1]
        out = model(input_ids=window[None, :-1], labels=window[None, :-1])
        losses.append(out.loss.item())
    model.train()
    return sum(losses) / len(losses)


def build_demo_model(out_dir: Path, cfg: DemoModelConfig = DemoModelConfig()) -> dict:
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(cfg.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_files, held_out_files = split_corpus(iter_corpus_files())
    log.info("corpus: %d train files, %d held-out files", len(train_files), len(held_out_files))

    bpe = train_tokenizer([f.text for f in train_files], cfg.vocab_size)
    eos_id = bpe.token_to_id(EOS_TOKEN)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    hf_tokenizer.model_max_length = cfg.context_length

    train_stream = _encode_stream(bpe, [f.text for f in train_files], eos_id)
    held_out_stream = _encode_stream(bpe, [f.text for f in held_out_files], eos_id)
    log.info("tokens: %d train, %d held-out", len(train_stream), len(held_out_stream))

    model = _make_model(cfg, eos_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.1, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.learning_rate * (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    generator = torch.Generator().manual_seed(cfg.seed)
    started = time.monotonic()
    model.train()
    progress = tqdm(range(cfg.max_steps), desc="train demo model", unit="step")
    steps_done = 0
    for step in progress:
        starts = torch.randint(0, len(train_stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
        batch = torch.stack([train_stream[s : s + cfg.seq_len] for s in starts.tolist()])  # [B, S]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps_done = step + 1
        progress.set_postfix(loss=f"{loss.item():.3f}")
        if cfg.stop_after_steps is not None and steps_done >= cfg.stop_after_steps:
            break
        if time.monotonic() - started > cfg.time_budget_s:
            log.info("time budget reached after %d steps", steps_done)
            break
    train_seconds = time.monotonic() - started

    # Store fp16 weights (halves the committed size); evaluate what was stored.
    model = model.to(torch.float16).to(torch.float32)
    held_out_loss = evaluate_loss(model, held_out_stream, cfg.seq_len)
    model.to(torch.float16).save_pretrained(out_dir)
    hf_tokenizer.save_pretrained(out_dir)

    report = {
        "held_out_loss": round(held_out_loss, 4),
        "held_out_perplexity": round(math.exp(held_out_loss), 2),
        "train_steps": steps_done,
        "train_seconds": round(train_seconds, 1),
        "train_tokens": len(train_stream),
        "held_out_tokens": len(held_out_stream),
        "config": asdict(cfg),
        "torch": torch.__version__,
    }
    (out_dir / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
