"""``_override_: true`` in a child's mapping replaces the parent's mapping instead of merging
into it, so that a child can give a section of another form; without it, mappings merge. And a
parent named as ``package:path``, a recipe installed with a library."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl_distributed.config import ConfigError, load_config, merge_layers, resolve_config

PARENT = """
data:
  train: {source: chat_file, path: train.jsonl, columns: {messages: conversation}}
  max_seq_length: 64
"""


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_a_marked_mapping_replaces_the_parents(tmp_path: Path) -> None:
    write(tmp_path, "parent.yaml", PARENT)
    child = write(
        tmp_path,
        "child.yaml",
        """
        defaults: parent
        data:
          train: {_override_: true, source: arithmetic, size: 40}
        """,
    )
    resolved = resolve_config(load_config(child))
    assert resolved == {
        "data": {"train": {"source": "arithmetic", "size": 40}, "max_seq_length": 64}
    }


def test_without_the_marker_mappings_merge_as_before(tmp_path: Path) -> None:
    write(tmp_path, "parent.yaml", PARENT)
    child = write(tmp_path, "child.yaml", "defaults: parent\ndata: {train: {path: other.jsonl}}\n")
    train = resolve_config(load_config(child))["data"]["train"]
    assert train == {
        "source": "chat_file",
        "path": "other.jsonl",
        "columns": {"messages": "conversation"},
    }
    # `_override_: false` merges too (and is dropped).
    child.write_text("defaults: parent\ndata: {train: {_override_: false, path: other.jsonl}}\n")
    assert resolve_config(load_config(child))["data"]["train"] == train


def test_the_marker_holds_against_what_the_file_is_merged_onto_later(tmp_path: Path) -> None:
    # The `rl` command merges a --config file (itself a child of its parents) onto the
    # algorithm's default recipe: a replacement in the middle file replaces the recipe's too.
    recipe = OmegaConf.create(PARENT)
    write(tmp_path, "mid.yaml", "data:\n  train: {_override_: true, source: arithmetic}\n")
    top = write(tmp_path, "top.yaml", "defaults: mid\ndata: {train: {size: 8}}\n")
    merged = merge_layers(recipe, load_config(top))
    assert resolve_config(merged)["data"]["train"] == {"source": "arithmetic", "size": 8}


@pytest.mark.parametrize("value", ["yes please", 1, "null"])
def test_a_marker_that_is_not_a_bool_names_the_file_and_key(tmp_path: Path, value) -> None:
    write(tmp_path, "parent.yaml", PARENT)
    child = write(
        tmp_path, "child.yaml", f"defaults: parent\ndata:\n  train: {{_override_: {value}}}\n"
    )
    message = rf"{child}: key 'data\.train\._override_' must be true .* or false .*, got"
    with pytest.raises(ConfigError, match=message):
        load_config(child)


def test_defaults_may_name_a_file_installed_with_a_package(tmp_path: Path, monkeypatch) -> None:
    # A recipe that ships with a library, found wherever the library is installed.
    (tmp_path / "site" / "shipped" / "recipes").mkdir(parents=True)
    write(tmp_path, "site/shipped/__init__.py", "")
    write(tmp_path, "site/shipped/recipes/main.yaml", "origin: shipped\nlr: 0.1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for entry in ("shipped:recipes/main.yaml", "shipped:recipes/main"):
        mine = write(tmp_path, "mine.yaml", f"defaults: {entry}\nlr: 0.2\n")
        assert OmegaConf.to_container(load_config(mine)) == {"origin": "shipped", "lr": 0.2}
    missing = write(tmp_path, "mine.yaml", "defaults: shipped:recipes/nope.yaml\n")
    with pytest.raises(ConfigError, match=r"Parent config not found: .*shipped/recipes/nope\.yaml"):
        load_config(missing)
    unknown = write(tmp_path, "mine.yaml", "defaults: no_such_package_here:recipes/x.yaml\n")
    with pytest.raises(ConfigError, match=r"Parent config not found: .*no_such_package_here:"):
        load_config(unknown)
