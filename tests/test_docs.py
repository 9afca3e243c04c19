"""The docs site: every code block of the quickstart and the guides runs as written, and the
config reference (generated from the typed configs at build time) describes every key.

A page's blocks run in order in one scratch directory (with the repository's ``examples/``
linked in): ``python`` blocks in one interpreter, so later blocks see earlier ones' names, and
``bash`` blocks with ``uv run X`` meaning X from this test's environment. A block is skipped
only when the line before it says so, visibly: ``*Not run by the docs tests: <reason>.*``.
The reward-functions guide's blocks run in rl-algorithms' functional tests, not here.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_ELSEWHERE = {
    # test_grpo_reward_functions.py runs this guide's blocks (a GRPO run among them).
    DOCS / "guides" / "reward-functions.md",
}
PAGES = sorted(
    p for p in [DOCS / "quickstart.md", *(DOCS / "guides").glob("*.md")] if p not in RUN_ELSEWHERE
)
SKIP_MARK = re.compile(r"^\*Not run by the docs tests: (.+)\*$")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```$", re.S | re.M)
RUNNABLE = {"python", "bash"}
# `uv run X` runs X from this environment (the nox session's, or the workspace's .venv).
BASH_PRELUDE = """set -euo pipefail
uv() { if [ "$1" = run ]; then shift; "$@"; else command uv "$@"; fi; }
"""
BLOCK_SECONDS = 240
# Reads blocks (a line "label<TAB>length", then the code) from its own copy of stdin, with
# /dev/null in stdin's place for the blocks and their children, and runs each in one real
# __main__ module, so later blocks see earlier ones' names; after each it prints the marker
# given as argv[1] and "ok" or "failed".
PYTHON_DRIVER = """
import os, sys, traceback, types
blocks = os.fdopen(os.dup(0), encoding="utf-8")
sys.stdin = open(os.devnull)
os.dup2(sys.stdin.fileno(), 0)
main = sys.modules["__main__"] = types.ModuleType("__main__")
marker = sys.argv[1]
for header in iter(blocks.readline, ""):
    label, size = header.rstrip("\\n").split("\\t")
    code = blocks.read(int(size))
    try:
        exec(compile(code, label, "exec"), main.__dict__)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        print(f"\\n{marker} failed", flush=True)
        break
    sys.stderr.flush()
    print(f"\\n{marker} ok", flush=True)
"""


class PythonSession:
    """One interpreter for all of a page's python blocks, given one block at a time as the
    page reads (its bash blocks run in between): each block runs once."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        # Random, so that no block's output can pass for the end of a block.
        self.marker = f"@@docs-block-{uuid.uuid4().hex}@@"
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-c", PYTHON_DRIVER, self.marker],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            encoding="utf-8",
            errors="replace",
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.process.stdout:
                self.lines.put(line)
        finally:
            self.lines.put(None)  # the interpreter is gone

    def run(self, label: str, code: str) -> tuple[bool, str]:
        """Whether the block ran without an error, and what it printed."""
        try:
            self.process.stdin.write(f"{label}\t{len(code)}\n{code}")
            self.process.stdin.flush()
        except BrokenPipeError:
            return False, "(the interpreter had exited)"
        printed: list[str] = []
        deadline = time.monotonic() + BLOCK_SECONDS
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False, "".join(printed) + f"\n(still running after {BLOCK_SECONDS} s)"
            if line is None:
                return False, "".join(printed) + "\n(the interpreter exited)"
            if line.startswith(self.marker):
                return line.strip() == f"{self.marker} ok", "".join(printed)
            printed.append(line)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def code_blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """``(language, code, reason it is not run or None)`` for each fenced block of ``page``."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        paragraphs = [" ".join(p.split()) for p in text[: match.start()].split("\n\n")]
        before = [p for p in paragraphs if p]
        skip = SKIP_MARK.match(before[-1]) if before else None
        out.append((match.group(1), match.group(2), skip.group(1) if skip else None))
    return out


def test_the_block_parser_reads_markers_and_languages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n```bash\necho hi\n```\n\n*Not run by the docs tests: needs\nSlurm.*\n\n"
        '```bash\nsbatch x\n```\n\n```python title="x.py"\nprint(1)\n```\n'
    )
    assert code_blocks(page) == [
        ("bash", "echo hi\n", None),
        ("bash", "sbatch x\n", "needs Slurm."),
        ("python", "print(1)\n", None),
    ]


def test_a_pages_python_session_keeps_names_and_reports_the_block_that_failed(tmp_path):
    """What the page test relies on: later blocks see earlier names, a block's own output
    cannot pass for its end, and an error fails the block that raised it, by its label."""
    session = PythonSession(tmp_path, dict(os.environ))
    try:
        assert session.run("block 1", "x = 41\nprint('@@docs-block-x@@ ok')") == (
            True,
            "@@docs-block-x@@ ok\n\n",
        )
        assert session.run("block 2", "print(x + 1)") == (True, "42\n\n")
        ok, printed = session.run("block 3", "print('before')\nraise ValueError('boom')")
        assert not ok
        assert 'File "block 3", line 2' in printed and "ValueError: boom" in printed
        assert session.run("block 4", "print(1)")[0] is False  # nothing runs after an error
    finally:
        session.close()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_code_block_of_the_page_runs(page, tmp_path):
    blocks = code_blocks(page)
    assert blocks, f"{page} has no code blocks"
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),  # nothing the blocks write lands in the real home
        "NO_COLOR": "1",
    }
    # Models converted once (the main recipe's GGUF) stay shared with the rest of the suite.
    env.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    python = PythonSession(tmp_path, env)
    try:
        for i, (lang, code, skip) in enumerate(blocks):
            where = f"{page.relative_to(ROOT)}, code block {i + 1} ({lang})"
            assert lang in RUNNABLE or lang in ("", "text", "yaml", "json"), f"{where}: language?"
            if skip is not None or lang not in RUNNABLE:
                assert lang not in RUNNABLE or skip.strip(" ."), f"{where}: a skip needs a reason"
                continue
            if lang == "python":
                ok, printed = python.run(where, code)
            else:
                run = subprocess.run(
                    ["bash", "-c", BASH_PRELUDE + code],
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=BLOCK_SECONDS,
                )
                ok, printed = run.returncode == 0, run.stdout[-3000:] + "\n" + run.stderr
            assert ok, f"{where} failed:\n{code}\n{printed[-6000:]}"
    finally:
        python.close()


def test_the_gpu_guides_lora_block_is_a_config_the_gpu_recipe_takes(tmp_path):
    """gpus.md's LoRA recipe block (yaml: the page test does not run it) as a layer over the
    main job's GPU recipe, validated by the real config model as `rl grpo` would."""
    from rl_algorithms import cli

    section = (DOCS / "guides" / "gpus.md").read_text().split("\n## LoRA on one GPU\n")[1]
    section = section.split("\n## ")[0]
    (block,) = re.findall(r"^```yaml\n(.*?)^```$", section, flags=re.S | re.M)
    gpu_recipe = ROOT / "examples" / "configs" / "grpo_arithmetic_gpu.yaml"
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(f"defaults: {gpu_recipe}\n{block}")
    config = cli.build_config(cli.load_algorithm("grpo"), ["--config", str(recipe)])
    lora = config.policy.lora
    assert (lora.enabled, lora.rank, lora.alpha, lora.refit) == (True, 16, 32.0, "auto")
    assert config.generation.backend == "vllm" and config.generation.colocated
    # The run starts its engine able to load the adapters (what the page says it sets).
    plan = config.generation.plan(config.policy.model, True, lora)
    assert plan.config.vllm.max_lora_rank == 16


# -- the README ---------------------------------------------------------------------------------

README = ROOT / "README.md"


def test_the_readme_gives_the_set_up_and_test_commands_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    setup = next(line for line in ci if "uv sync" in line)
    test = next(line for line in ci if "nox" in line)
    blocks = [code for lang, code, _ in code_blocks(README) if lang == "bash"]
    develop = next(code for code in blocks if test in code.splitlines())
    assert setup in develop.splitlines(), f"the README's test block does not set up as CI: {setup}"


def test_the_readmes_reward_function_is_the_guides_which_its_tests_run():
    # packages/rl-algorithms/tests/functional/test_grpo_reward_functions.py runs the guide's.
    guide = DOCS / "guides" / "reward-functions.md"
    for lang in ("python", "yaml"):
        readme_blocks = [code for kind, code, _ in code_blocks(README) if kind == lang]
        guide_blocks = [code for kind, code, _ in code_blocks(guide) if kind == lang]
        assert readme_blocks == guide_blocks, f"the README's {lang} block differs from the guide's"


def test_every_relative_link_of_the_readme_leads_to_a_file():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links to no file of the repository"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')


def test_every_included_file_is_included_by_a_directive_the_site_reads():
    # pymdownx.snippets replaces `--8<-- "path"` with the file; a line that is only close to
    # that form (a formatter's `--8 < --"path"`) is shown as text instead of the file's code.
    extensions = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^  - pymdownx\.snippets\b", extensions, re.M), "snippets is not enabled"
    lines = [line for page in DOCS.rglob("*.md") for line in page.read_text().splitlines()]
    near = [line for line in lines if re.match(r"^-+\s*8\s*<", line)]
    assert near, "no page includes a file"
    bad = [line for line in near if not SNIPPET.match(line)]
    assert not bad, f"include lines the site does not read: {bad}"
    missing = [line for line in near if not (ROOT / SNIPPET.match(line).group(1)).is_file()]
    assert not missing, f"include lines naming missing files: {missing}"


# -- the config reference -----------------------------------------------------------------------


def load_reference():
    spec = importlib.util.spec_from_file_location("config_reference", DOCS / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return load_reference()


def test_the_reference_has_a_page_per_command_of_the_rl_command(reference):
    from rl_algorithms.cli import ALGORITHMS

    pages = reference.pages()
    assert set(pages) == {f"reference/config/{n}.md" for n in ["index", *ALGORITHMS]}
    grpo = pages["reference/config/grpo.md"]
    # a nested key, its type, the recipe's default and the comment above it in the source
    assert (
        "| `grpo.async_grpo.max_trajectory_age_steps` | `int` | `1` | A sample's age is the "
        "trainer's step minus" in grpo
    )
    # a key of one form of a union, and an environment kind's own config
    assert "| `data.train.columns`<br>*(source: chat_file)* | `dict[str, str]` | `{}` |" in grpo
    assert "### `kind: sliding_puzzle`" in grpo
    # a key of one backend's config, labelled with it
    assert "| `generation.vllm.max_model_len`<br>*(backend: vllm)* | `int` | `1024` |" in grpo


def test_every_key_of_every_command_has_a_description(reference):
    missing = [
        f"rl {command}: {k.key} {k.variant}".strip()
        for command in reference.commands()
        for k in reference.command_keys(command)
        if not k.description
    ]
    missing += [
        f"env kind {kind}: {k.key}"
        for kind, keys in reference.environment_keys().items()
        for k in keys
        if not k.description
    ]
    assert not missing, (
        "config keys without a description: add a `# comment` above the field in its class (or "
        "Field(description=...)):\n  " + "\n  ".join(sorted(set(missing)))
    )


def test_descriptions_are_read_from_comments_above_and_beside_fields():
    from pydantic import Field

    from rl_distributed.config import ConfigModel, field_description

    class Parent(ConfigModel):
        # Two lines
        # of comment.
        a: int = 1
        b: int = Field(2, ge=0)  # beside it
        c: int = Field(3, description="given   explicitly")

    class Child(Parent):
        a: int = 5  # the parent's comment is kept when the child's redeclaration has none

        d: str = "x"

    assert field_description(Parent, "a") == "Two lines of comment."
    assert field_description(Parent, "b") == "beside it"
    assert field_description(Parent, "c") == "given explicitly"
    assert field_description(Child, "a").startswith("the parent's comment is kept")
    assert field_description(Child, "d") == ""
