"""`tophat privacy`: what a curious cloud recovers from the hidden states it is sent, per split depth m,
attack and defence, and what each defence costs.

For each m the harness runs the product's own path: a real verifier (`VerifierServer.from_settings`, the
middle layers [m, n)) on a loopback WebSocket with its capture on (TOPHAT_VERIFIER_CAPTURE_PATH: every
hidden-state frame it accepts), a device session per held-out prompt (embeddings + m layers, the draft
adapter where one was trained for this m, else plain U-shape), greedy. The capture is exactly what the
cloud received; the device side keeps the tokens behind every row (prompt positions, and each verify
frame's pending token + drafts), which is the ground truth the attacks are scored against.

The attacker trains on public text it runs through the public checkpoint itself (the corpus's train split;
the prompts come from its held-out files), with the budgets the results report. Defences (at the m with a
trained adapter, HAT's split): `rotation` (a secret orthogonal basis, exact: shared/privacy/hidden_rotation.py),
attacked three ways (an inverter for the public basis as is; a cloud that solves the rotation from its
re-parameterised weights; a cloud that trains on rotated states of text it sends through a device itself),
and `noise:S` (Gaussian noise of S x each row's RMS on the uplink: the output is then the noisy split
model's), attacked by an inverter trained on equally noised states.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

ATTACKS = ("nearest", "linear", "mlp", "context")
ROTATION_SECRET = "tophat-privacy-harness"  # the harness's own deployment secret (any secret behaves alike)


@dataclass
class PrivacyConfig:
    model_dir: Path
    splits: Sequence[int] = (1, 2, 3, 4, 6)
    attacks: Sequence[str] = ATTACKS
    defences: Sequence[str] = ("none", "rotation", "noise:0.1", "noise:0.3")
    defence_split: int = 2  # defences are measured where the draft adapter was trained (HAT's m)
    train_tokens: int = 30_000
    eval_prompts: int = 16
    prompt_tokens: int = 96
    max_new_tokens: int = 16
    steps: int = 800  # the learned attacks' optimiser steps
    seed: int = 0


@dataclass
class Captured:
    """One run's evaluation data: (states [S, H] fp32, ids [S]) as the cloud received them, and its costs."""

    prompts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    drafts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # one verify frame each
    ttft_s: list[float] = field(default_factory=list)
    tbt_s: list[float] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)  # the answer equals the unsplit model's greedy one


# -- the run that produces what the cloud sees -------------------------------------------------------------


def _has_adapter(model_dir: Path, split_layers: int) -> bool:
    from safetensors import safe_open

    path = model_dir / "draft_adapter.safetensors"
    if not path.is_file():
        return False
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("split_layers") == str(split_layers)


async def capture_run(
    checkpoint,
    split_layers: int,
    prompts: list[list[int]],
    expected: list[list[int]],
    max_new_tokens: int,
    rotation: str = "",
    noise: float = 0.0,
) -> Captured:
    """Serve `prompts` through a capturing verifier at split m; pair every captured row with its token."""
    from services.device_agent.cloud_client import WebSocketCloud
    from services.verifier_cloud.server import VerifierServer
    from services.verifier_cloud.settings import Settings
    from shared.capture import read_capture
    from shared.model.checkpoint import split_fingerprint
    from shared.privacy.hidden_rotation import rotated_fingerprint
    from shared.privacy.uplink_hardening import NoisyUplink, with_rotation
    from shared.runtime import build_device_model
    from shared.specdec.decode_loop import generate
    from shared.specdec.device_session import DeviceSession, DraftConfig

    speculative = _has_adapter(checkpoint.path, split_layers)
    device_model = build_device_model(checkpoint, split_layers, None, speculative=speculative)
    with tempfile.TemporaryDirectory(prefix="tophat-privacy-") as tmp:
        capture_path = Path(tmp) / "capture.bin"
        settings = Settings(
            port=0,
            split_layers=split_layers,
            model_dir=str(checkpoint.path),
            capture_path=str(capture_path),
            hidden_rotation=rotation,
        )
        server = await asyncio.to_thread(VerifierServer.from_settings, settings)
        stop, started = asyncio.Event(), asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(server.serve_forever(stop, started))
        port = await asyncio.wait_for(started, 120)
        fingerprint = split_fingerprint(checkpoint.path, split_layers)
        if rotation:
            fingerprint = rotated_fingerprint(fingerprint, rotation)
        wire = WebSocketCloud(
            f"ws://127.0.0.1:{port}/ws",
            checkpoint.hidden_size,
            request_timeout_s=300,
            split_layers=split_layers,
            fingerprint=fingerprint,
        )
        cloud = with_rotation(wire, rotation, checkpoint.hidden_size)
        if noise > 0:
            cloud = NoisyUplink(cloud, noise, torch.Generator().manual_seed(1))
        out = Captured()
        verify_tokens: dict[int, list[list[int]]] = {}
        try:
            for index, (ids, reference) in enumerate(zip(prompts, expected)):
                session_id = index + 1
                session = DeviceSession(
                    device_model,
                    ids,
                    draft_config=DraftConfig(0.6, 8 if speculative else 0),
                    max_new_tokens=max_new_tokens,
                )
                verify_tokens[session_id] = rows = list[list[int]]()
                _log_verify_rows(session, rows)
                result = await generate(session, cloud, session_id, chunk_size=32)
                out.ttft_s.append(result.ttft_s)
                out.tbt_s.append(result.tbt_s)
                out.accept_lengths += result.accept_lengths
                out.exact.append(result.token_ids == reference)
        finally:
            await wire.close_connection()
            stop.set()
            await asyncio.wait_for(serving, 60)
        frames = read_capture(capture_path)
    _pair(frames, prompts, verify_tokens, out)
    return out


def _log_verify_rows(session, rows: list[list[int]]) -> None:
    """Record, for each draft the session sends, the tokens behind its rows: the pending token and the drafts."""
    draft = session.draft

    def logged():
        pending = session.pending_token
        made = draft()
        rows.append([pending, *made.tokens])
        return made

    session.draft = logged


def _pair(frames, prompts: list[list[int]], verify_tokens: dict[int, list[list[int]]], out: Captured) -> None:
    prefill: dict[int, list[torch.Tensor]] = {}
    verifies: dict[int, int] = {}
    for frame in frames:
        rows = frame.rows.float()  # [S, H] as the wire carried it
        if frame.kind == "prefill":
            prefill.setdefault(frame.session_id, []).append(rows)
        else:
            index = verifies.get(frame.session_id, 0)
            verifies[frame.session_id] = index + 1
            tokens = verify_tokens[frame.session_id][index]
            if len(tokens) != rows.shape[0]:
                raise RuntimeError(
                    f"session {frame.session_id}: verify frame {index} has {rows.shape[0]} rows for "
                    f"{len(tokens)} tokens"
                )
            out.drafts.append((rows, torch.tensor(tokens)))
    for session_id, chunks in sorted(prefill.items()):
        ids = prompts[session_id - 1]
        states = torch.cat(chunks)
        if states.shape[0] != len(ids):
            raise RuntimeError(f"session {session_id}: {states.shape[0]} prefill rows for a {len(ids)}-token prompt")
        out.prompts.append((states, torch.tensor(ids)))


# -- attacks and defences ---------------------------------------------------------------------------------


def make_attack(name: str, checkpoint):
    from tophatctl.privacy.attacks import ContextInverter, LinearInverter, MLPInverter, NearestEmbedding

    table = checkpoint.decoder.embed_tokens.weight.detach().float()
    return {"nearest": NearestEmbedding, "linear": LinearInverter, "mlp": MLPInverter, "context": ContextInverter}[
        name
    ](table)


def _noised(examples, sigma: float, seed: int):
    """The attacker's own states with the device's uplink noise (the product's NoisyUplink, seeded here)."""
    from shared.privacy.uplink_hardening import NoisyUplink

    uplink = NoisyUplink(None, sigma, torch.Generator().manual_seed(seed))
    return [(uplink.noisy(states), ids) for states, ids in examples]


def _transformed(examples, matrix: torch.Tensor):
    return [(states @ matrix, ids) for states, ids in examples]


def fit_attacks(checkpoint, cfg: PrivacyConfig, train, budget) -> dict[str, tuple[Any, dict]]:
    """Every attack fitted on `train` (what this attacker can compute or observe), with the budget it spent."""
    fitted = {}
    for name in cfg.attacks:
        attack = make_attack(name, checkpoint)
        fitted[name] = (attack, attack.fit(train, budget))
    return fitted


def attack_rows(
    fitted: dict[str, tuple[Any, dict]], split_layers: int, captured: Captured, defence: str, attacker: str
) -> list[dict[str, Any]]:
    """Score each fitted attack on what the cloud captured: prompt rows and verify-frame rows apart."""
    from tophatctl.privacy.attacks import recovery

    rows = []
    for name, (attack, spent) in fitted.items():
        row = {"m": split_layers, "attack": name, "defence": defence, "attacker": attacker}
        prompt = recovery(attack, captured.prompts)
        row.update(top1=prompt["top1"], top5=prompt["top5"], tokens=prompt["tokens"])
        if captured.drafts:
            drafted = recovery(attack, captured.drafts)
            row.update(draft_top1=drafted["top1"], draft_top5=drafted["top5"], draft_tokens=drafted["tokens"])
        row["train"] = spent
        log.info("m=%d %s/%s %s: top1 %.3f top5 %.3f", split_layers, defence, attacker, name, row["top1"], row["top5"])
        rows.append(row)
    return rows


def cost_row(split_layers: int, defence: str, captured: Captured) -> dict[str, Any]:
    return {
        "m": split_layers,
        "defence": defence,
        "mean_accept_length": statistics.fmean(captured.accept_lengths) if captured.accept_lengths else None,
        "mean_ttft_ms": statistics.fmean(captured.ttft_s) * 1e3,
        "mean_tbt_ms": statistics.fmean(captured.tbt_s) * 1e3,
        "answers_exact": sum(captured.exact) / len(captured.exact),
    }


def run_privacy(cfg: PrivacyConfig) -> dict[str, Any]:
    from shared.model.checkpoint import load_checkpoint
    from shared.model.split import MiddleSubmodel
    from shared.privacy.hidden_rotation import apply_secret_rotation, secret_rotation
    from shared.specdec.reference import generate_full
    from tophatctl.demo_model.corpus import iter_corpus_files, split_corpus
    from tophatctl.privacy.attacks import TrainBudget
    from tophatctl.privacy.rotation_attack import recover_rotation, rotation_error
    from tophatctl.privacy.states import dataset, token_sequences

    started = time.perf_counter()
    checkpoint = load_checkpoint(cfg.model_dir, dtype=torch.float32)
    train_files, held_out_files = split_corpus(iter_corpus_files())
    prompts = token_sequences(
        checkpoint, [f.text for f in held_out_files], cfg.prompt_tokens, cfg.eval_prompts * cfg.prompt_tokens
    )[: cfg.eval_prompts]
    expected = [generate_full(checkpoint, p, cfg.max_new_tokens).token_ids for p in prompts]
    budget = TrainBudget(steps=cfg.steps, max_tokens=cfg.train_tokens, seed=cfg.seed)
    results: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    notes: dict[str, Any] = {}
    for m in cfg.splits:
        train = dataset(checkpoint, [f.text for f in train_files], m, cfg.prompt_tokens, cfg.train_tokens)
        plain = asyncio.run(capture_run(checkpoint, m, prompts, expected, cfg.max_new_tokens))
        costs.append(cost_row(m, "none", plain))
        wants_public = "none" in cfg.defences or (m == cfg.defence_split and "rotation" in cfg.defences)
        # trained on the public checkpoint's states (only where a row uses them)
        public = fit_attacks(checkpoint, cfg, train, budget) if wants_public else {}
        if "none" in cfg.defences:
            results += attack_rows(public, m, plain, "none", "public")
        if m != cfg.defence_split:
            continue
        if "rotation" in cfg.defences:
            rotated = asyncio.run(
                capture_run(checkpoint, m, prompts, expected, cfg.max_new_tokens, rotation=ROTATION_SECRET)
            )
            costs.append(cost_row(m, "rotation", rotated))
            q = secret_rotation(ROTATION_SECRET, checkpoint.hidden_size, torch.float32)
            # The cloud's own copy of its re-parameterised layers, against the public checkpoint's.
            held = MiddleSubmodel(load_checkpoint(cfg.model_dir, with_tokenizer=False), m)
            apply_secret_rotation(held, ROTATION_SECRET)
            q_hat = recover_rotation(MiddleSubmodel(checkpoint, m), held).float()
            notes["rotation_recovery_error"] = rotation_error(q_hat, q)
            results += attack_rows(public, m, rotated, "rotation", "public")
            unrotated = Captured(_transformed(rotated.prompts, q_hat), _transformed(rotated.drafts, q_hat))
            results += attack_rows(public, m, unrotated, "rotation", "knows-weights")
            # states x Q^T of text the cloud chose, seen on the wire when it sends that text through a device
            provoked = fit_attacks(checkpoint, cfg, _transformed(train, q.T), budget)
            results += attack_rows(provoked, m, rotated, "rotation", "provoked")
        for defence in (d for d in cfg.defences if d.startswith("noise:")):
            sigma = float(defence.split(":", 1)[1])
            noisy = asyncio.run(capture_run(checkpoint, m, prompts, expected, cfg.max_new_tokens, noise=sigma))
            costs.append(cost_row(m, defence, noisy))
            knowing = fit_attacks(checkpoint, cfg, _noised(train, sigma, cfg.seed), budget)
            results += attack_rows(knowing, m, noisy, defence, "knows-noise")
    return {
        "config": {
            **{k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
            "model_dir": str(cfg.model_dir),
            "train_tokens_used": cfg.train_tokens,
        },
        "results": results,
        "costs": costs,
        "notes": notes,
        "wall_s": time.perf_counter() - started,
    }
