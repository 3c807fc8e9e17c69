"""Where a model's files come from: a local path, else the Hugging Face hub cache, else a download.

The order is vLLM's: a name that exists on disk is a local checkpoint; otherwise it is a hub repo id,
looked up in the local hub cache first (`--download-dir`, else `$HF_HOME/hub`) and downloaded only when
the cache lacks it and `HF_HUB_OFFLINE` is not set. `HF_TOKEN` (or `--hf-token`) authenticates.
A name found nowhere raises one error that lists every place that was tried, and why each failed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# What serving needs from a repo: the config, the weights as safetensors (never pickled .bin files),
# the tokenizer and chat template. GGUF repos are matched by their one .gguf file.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, not only when huggingface_hub was imported."""
    from huggingface_hub import constants

    env = any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or bool(constants.HF_HUB_OFFLINE)


def default_hub_cache() -> Path:
    """The cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~")) and not name.endswith(".gguf")


def resolve_model_files(name: str, *, revision: str | None = None, download_dir: str | None = None,
                        token: str | bool | None = None, what: str = "Model") -> Path:
    """A local path for `name` (directory or .gguf file), fetched into the hub cache if need be."""
    local = Path(name).expanduser()
    if local.exists():
        return _single_gguf_or_dir(local)
    tried = [f"local path {str(local)!r}: does not exist"]
    if not _looks_like_repo_id(name):
        raise ValueError(_not_found(what, name, tried))

    from huggingface_hub import snapshot_download

    cache_dir = Path(download_dir).expanduser() if download_dir else default_hub_cache()
    rev = revision or "main"
    token = token or os.environ.get("HF_TOKEN") or None
    try:
        path = snapshot_download(name, revision=revision, cache_dir=str(cache_dir), token=token,
                                 local_files_only=True, allow_patterns=_ALLOW_PATTERNS + ["*.gguf"])
        return _single_gguf_or_dir(Path(path))
    except Exception as e:  # noqa: BLE001 - every failure is reported with the others below
        tried.append(f"hub cache {str(cache_dir)!r} (repo {name!r}, revision {rev!r}): {_reason(e)}")
    if hub_offline():
        tried.append("download from the Hugging Face hub: skipped, HF_HUB_OFFLINE is set")
        raise ValueError(_not_found(what, name, tried))
    logger.info("Downloading %s (revision %s) from the Hugging Face hub into %s", name, rev, cache_dir)
    try:
        path = snapshot_download(name, revision=revision, cache_dir=str(cache_dir), token=token,
                                 allow_patterns=_ALLOW_PATTERNS)
        return _single_gguf_or_dir(Path(path))
    except Exception as e:  # noqa: BLE001
        hint = "" if token else " (a gated or private repo needs HF_TOKEN or --hf-token)"
        tried.append(f"download from the Hugging Face hub: {_reason(e)}{hint}")
        raise ValueError(_not_found(what, name, tried)) from None


def _single_gguf_or_dir(path: Path) -> Path:
    """A snapshot with no config.json but exactly one .gguf file is that GGUF checkpoint."""
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


def _not_found(what: str, name: str, tried: list[str]) -> str:
    lines = "\n".join(f"  - {t}" for t in tried)
    return (f"{what} {name!r} was not found. Tried, in order:\n{lines}\n"
            f"Pass a local HF model directory or .gguf file, a hub repo id that is in the cache (or reachable "
            f"without HF_HUB_OFFLINE), or leave the model unset for the embedded SmolLM2.")
