import os

import pytest

from rl_models import model_files
from rl_models.modeling.config import ModelConfig


def test_a_missing_gguf_file_is_named(tmp_path):
    cfg = ModelConfig(path=str(tmp_path), gguf_file="nope.gguf")
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        model_files.materialize(cfg)


def test_models_without_gguf_are_left_alone():
    cfg = ModelConfig(hf_config={"model_type": "llama"})
    assert model_files.materialize(cfg) is cfg


def test_the_cache_is_keyed_by_the_file_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(model_files.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    first = model_files.converted_dir(gguf)
    assert first.parent == tmp_path / "cache"
    os.utime(gguf, ns=(1, 1))  # the file changed: a new conversion, never a stale one
    second = model_files.converted_dir(gguf)
    assert second != first
    # A finished conversion (its config.json) is reused without converting again.
    second.mkdir(parents=True)
    (second / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(model_files, "convert_gguf", lambda *a: calls.append(a))
    cfg = model_files.materialize(ModelConfig(path=str(tmp_path), gguf_file="m.gguf"))
    assert (cfg.path, cfg.gguf_file, calls) == (str(second), None, [])
    # An absolute gguf_file needs no path.
    cfg = model_files.materialize(ModelConfig(gguf_file=str(gguf)))
    assert cfg.path == str(second)


def test_an_interrupted_conversion_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    monkeypatch.setenv(model_files.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not a gguf file")

    def save_then_fail(self, directory, *args, **kwargs):
        (directory / "config.json").write_text("{}")  # half-written, then the process dies
        raise KeyboardInterrupt

    import transformers

    model = type("M", (), {"save_pretrained": save_then_fail, "config": object()})()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    with pytest.raises(KeyboardInterrupt):
        model_files.materialize(ModelConfig(gguf_file=str(gguf)))
    assert not model_files.converted_dir(gguf).exists()
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary directory is gone too
