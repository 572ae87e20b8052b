"""What the verifier serves, loaded from its settings: the middle layers in this process (P = 1, maybe
with the token-mode ends), or only the config and a plan of stage workers that load their own (P > 1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.verifier_cloud.settings import Settings
from services.verifier_cloud.stage_specs import plan_stages
from services.verifier_cloud.stages import StageSpec
from services.verifier_cloud.token_mode import TokenModel
from shared.model.checkpoint import ModelLoadError, load_checkpoint, read_config
from shared.model.placement import PlacementError, detect_placement
from shared.model.split import MiddleSubmodel, calibrate_layers, warm_up_layers
from shared.privacy.hidden_rotation import apply_secret_rotation
from shared.settings import SettingsError


@dataclass(frozen=True)
class LoadedModel:
    """`VerifierServer`'s constructor arguments: `middle` (P = 1) or `stages` (P > 1), never both."""

    middle: MiddleSubmodel | None
    context_length: int
    hidden_size: int
    stages: list[StageSpec] | None = None
    token_model: TokenModel | None = None
    calibration: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds) of timed passes


def load_model(settings: Settings) -> LoadedModel:
    """Load (P = 1) or plan (P > 1) what `settings` asks for; SettingsError for a placement that cannot be."""
    if settings.stage_workers:  # the workers load the weights; here only the config is needed
        config = read_config(Path(settings.model_dir))
        keys = ("num_hidden_layers", "max_position_embeddings", "hidden_size")
        if not all(isinstance(config.get(k), int) for k in keys):
            raise ModelLoadError(f"{settings.model_dir}/config.json lacks one of {', '.join(keys)}")
        try:
            stages = plan_stages(settings, config["num_hidden_layers"])  # one stage per GPU (placement.py)
        except PlacementError as exc:
            raise SettingsError(f"Settings: {exc}") from exc
        return LoadedModel(None, config["max_position_embeddings"], config["hidden_size"], stages=stages)
    try:
        placement = detect_placement(settings.device, settings.dtype, what="verifier")
    except PlacementError as exc:
        raise SettingsError(f"Settings: {exc}") from exc
    checkpoint = load_checkpoint(
        settings.model_dir, dtype=placement.dtype, with_tokenizer=False, quantize=placement.quantize
    )
    middle = MiddleSubmodel(checkpoint, settings.split_layers)
    if settings.hidden_rotation:  # this process's own copy of the weights: re-parameterised in place
        apply_secret_rotation(middle, settings.hidden_rotation)
    # Without full_model only the middle layers outlive `checkpoint`: no embeddings, no head.
    token_model = TokenModel(checkpoint, settings.split_layers) if settings.full_model else None
    middle.to(placement.device)  # moves only what this process keeps; KV and inputs follow the weights
    if token_model is not None:
        token_model.to(placement.device)
    warm_up_layers(middle, checkpoint.hidden_size)
    return LoadedModel(
        middle,
        checkpoint.config.max_position_embeddings,
        checkpoint.hidden_size,
        token_model=token_model,
        calibration=calibrate_layers(middle, checkpoint.hidden_size),
    )
