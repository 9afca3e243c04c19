"""NeMo RL's datasets and environments, as our files and ``env`` entries.

NeMo names its datasets (``OpenMathInstruct-2``, ``squad``, ``HelpSteer3``) and downloads them
from the Hugging Face hub. Here nothing is downloaded: a named dataset is looked for on local
disk (``$RL_DATASETS_DIR``, a list of directories, default ``./datasets``) as a JSONL or Parquet
file or a directory written by ``datasets``' ``save_to_disk``, under its NeMo name or its hub
id. Before the run its rows are converted once, the way NeMo's dataset class and processor
shape them (prompt template, system prompt, answer column), into our chat or preference JSONL
in ``$RL_DATA_CACHE`` (default ``~/.cache/rl/nemo_datasets``), which the translated recipe
names. The sliding-puzzle recipe reads no dataset: its games are generated from the
environment's ``game_config``, as NeMo's example script does.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_algorithms.nemo_compat.core import Context

# Bump when the way rows are converted changes: files converted before are then written again.
CONVERTER_VERSION = 3
DATASETS_DIR_ENV = "RL_DATASETS_DIR"
CACHE_ENV = "RL_DATA_CACHE"

# NeMo name -> (hub id, row shape, the split NeMo's loader reads; None: the entry's own,
# train or validation). A shape is the published column layout (COLUMNS) and how NeMo's
# loader turns a row into a problem and its answer, or into a preference pair.
KNOWN_DATASETS: dict[str, tuple[str, str, str | None]] = {
    "OpenMathInstruct-2": ("nvidia/OpenMathInstruct-2", "math", "train_1M"),
    "DeepScaler": ("agentica-org/DeepScaleR-Preview-Dataset", "problem_answer", "train"),
    "DAPOMath17K": ("BytedTsinghua-SIA/DAPO-Math-17k", "dapo", "train"),
    "DAPOMathAIME2024": ("BytedTsinghua-SIA/AIME-2024", "dapo", "train"),
    "AIME2024": ("HuggingFaceH4/aime_2024", "problem_answer", "train"),
    # NeMo concatenates the AIME2025-I and AIME2025-II configs' test splits: one file here.
    "AIME2025": ("opencompass/AIME2025", "question_answer", "test"),
    "MATH-500": ("HuggingFaceH4/MATH-500", "problem_answer", "test"),
    "gsm8k": ("openai/gsm8k", "gsm8k", "train"),
    "GSM8K": ("openai/gsm8k", "gsm8k", "train"),
    "squad": ("rajpurkar/squad", "squad", None),
    "HelpSteer3": ("nvidia/HelpSteer3", "helpsteer3", None),
    "tulu3": ("allenai/llama-3.1-tulu-3-8b-preference-mixture", "tulu3", "train"),
    "Tulu3Preference": ("allenai/llama-3.1-tulu-3-8b-preference-mixture", "tulu3", "train"),
    "ResponseDataset": ("", "response", None),
}
# The columns each shape reads (a row without one fails, naming the file and these).
COLUMNS = {
    "math": ("problem", "expected_answer"),
    "response": ("input", "output"),
    "problem_answer": ("problem", "answer"),
    "question_answer": ("question", "answer"),
    "gsm8k": ("question", "answer"),  # the answer after its "####"
    "dapo": ("prompt", "reward_model"),  # prompt[0].content, reward_model.ground_truth
    "squad": ("context", "question", "answers"),
    "helpsteer3": ("context", "response1", "response2", "overall_preference"),
    "tulu3": ("chosen", "rejected"),  # two conversations differing in the last turn
}
PREFERENCE_SHAPES = ("helpsteer3", "tulu3")
# NeMo datasets of features we lack, and what reading them would have done.
UNSUPPORTED_DATASETS = {
    "arrow_text": "would distil off-policy on raw pretraining text (NeMo's arrow_text)",
}
# Keys of a NeMo dataset entry (data.train, data.validation, data.default) and what uses them.
ENTRY_KEYS = {
    "dataset_name",
    "split",
    "data_path",
    "input_key",
    "output_key",
    "prompt_file",
    "system_prompt_file",
    "processor",
    "env_name",
    "split_validation_size",
    "seed",
    "repeat",
}
PROCESSORS = {
    "math_hf_data_processor": "prompt",
    "math_data_processor": "prompt",
    "sft_processor": "sft",
}


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "rl" / "nemo_datasets"))


def dataset_dirs() -> list[Path]:
    raw = os.environ.get(DATASETS_DIR_ENV, "datasets")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p]


# -- converted datasets --------------------------------------------------------------------------


@dataclass
class DatasetJob:
    """One NeMo dataset entry: where its rows are, how to shape them, where ours go."""

    where: str  # "data.train" or "data.validation"
    name: str
    split: str | None
    shape: str  # a KNOWN_DATASETS shape
    kind: str  # "prompt" (RL prompts + ground truth), "sft" or "preference"
    data_path: str | None = None
    input_key: str | None = None
    output_key: str | None = None
    prompt_file: str | None = None
    system_prompt_file: str | None = None
    recipe_dir: str | None = None
    repeat: int = 1  # NeMo's data.<split>.repeat: every row this many times (AIME's pass@k)
    out: str = ""

    def candidates(self) -> list[tuple[Path, str | None]]:
        """(path, split to select) pairs to try, in order. With a split, only files of that
        split or a ``datasets`` DatasetDict directory holding it: a file without splits would
        give train and validation the same rows."""
        if self.data_path:
            return [(Path(self.data_path).expanduser(), self.split)]
        hub = KNOWN_DATASETS.get(self.name, ("", "", None))[0]
        stems = [s for s in dict.fromkeys([self.name, hub, hub.rpartition("/")[2]]) if s]
        out: list[tuple[Path, str | None]] = []
        for d in dataset_dirs():
            for stem in stems:
                if self.split:
                    out += [
                        (d / stem / f"{self.split}.{ext}", None) for ext in ("jsonl", "parquet")
                    ]
                    out += [(d / stem, self.split)]
                else:
                    out += [(d / stem, None)]
                    out += [(d / f"{stem}.{ext}", None) for ext in ("jsonl", "parquet")]
        return out

    def locate(self) -> tuple[Path, str | None]:
        tried = self.candidates()
        for path, split in tried:
            if split is not None and path.is_dir() and not self.data_path:
                if split in _dataset_dict_splits(path):
                    return path, split
            elif path.exists():
                return path, split
        looked = "\n    ".join(
            str(p.resolve())
            + (f" (a DatasetDict with split {s!r})" if s and p.suffix == "" else "")
            for p, s in tried
        )
        raise FileNotFoundError(
            f"{self.where}: NeMo dataset {self.name!r} (split {self.split!r}) is not on local "
            f"disk; looked for:\n    {looked}\nSave it there (JSONL or Parquet per split, or "
            f"`datasets` save_to_disk of a DatasetDict), or set ${DATASETS_DIR_ENV} to the "
            "directory holding it. A single file without splits is not read for a split."
        )

    def write(self, config: Any) -> None:
        from rl_data.datasets.base import read_records

        source, split = self.locate()
        template = self._read_text(self.prompt_file)
        system = self._read_text(self.system_prompt_file)
        stat = source.stat()
        # The prompt files' text is part of the rows: a changed prompt is a new conversion.
        prompts = hashlib.sha256(json.dumps([template, system]).encode()).hexdigest()[:16]
        stamp = (
            f"v{CONVERTER_VERSION}:{source.resolve()}:{split}:{stat.st_size}:"
            f"{stat.st_mtime_ns}:{prompts}"
        )
        out = Path(self.out)
        done = out.with_suffix(".source")
        if out.is_file() and done.is_file() and done.read_text() == stamp:
            return
        rows = []
        columns = list(self.columns())
        for n, record in read_records(source, "auto", split):
            if isinstance(record, Exception):  # a line that is not JSON
                raise ValueError(f"{self.where}: {source} row {n}: {record}")
            missing = [c for c in columns if c not in record]
            if missing:
                raise ValueError(
                    f"{self.where}: {source} row {n} lacks column(s) {missing}: NeMo's "
                    f"{self.name!r} rows have the columns {columns} (the row has {sorted(record)})"
                )
            try:
                rows += [self._row(record, template, system)] * self.repeat
            except (KeyError, IndexError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"{self.where}: {source} row {n} does not have the shape of NeMo's "
                    f"{self.name!r} rows, columns {columns} ({type(e).__name__}: {e})"
                ) from None
        _write_jsonl(out, (r for r in rows if r is not None))
        done.write_text(stamp)

    def _read_text(self, name: str | None) -> str | None:
        if not name:
            return None
        tries = [Path(name).expanduser()]
        if self.recipe_dir and not tries[0].is_absolute():
            base = Path(self.recipe_dir)
            tries += [parent / name for parent in (base, *base.parents)]
        for path in tries:
            if path.is_file():
                return path.read_text(encoding="utf-8")
        looked = ", ".join(str(p) for p in tries)
        raise FileNotFoundError(f"{self.where}: prompt file {name!r} not found (looked: {looked})")

    def columns(self) -> tuple[str, ...]:
        if self.shape in ("math", "response"):
            defaults = COLUMNS[self.shape]
            return (self.input_key or defaults[0], self.output_key or defaults[1])
        return COLUMNS[self.shape]

    def _row(self, record: dict[str, Any], template: str | None, system: str | None) -> Any:
        if self.shape == "helpsteer3":
            score = record["overall_preference"]
            if score == 0:
                return None  # no preference: NeMo keeps a chosen == rejected pair; we drop it
            better, worse = ("response1", "response2") if score < 0 else ("response2", "response1")
            context = record["context"]
            return {"prompt": context, "chosen": record[better], "rejected": record[worse]}
        if self.shape == "tulu3":
            chosen, rejected = record["chosen"], record["rejected"]
            if chosen[:-1] != rejected[:-1] or chosen[-1]["role"] != "assistant":
                raise TypeError("chosen and rejected must share all turns but the last")
            return {
                "prompt": chosen[:-1],
                "chosen": chosen[-1]["content"],
                "rejected": rejected[-1]["content"],
            }
        if self.shape == "squad":
            system, question, answer = (
                record["context"],
                record["question"],
                record["answers"]["text"][0],
            )
        elif self.shape == "dapo":
            question = record["prompt"][0]["content"]
            answer = record["reward_model"]["ground_truth"]
        else:
            question_column, answer_column = self.columns()
            question, answer = record[question_column], record[answer_column]
            if self.shape == "gsm8k":
                answer = answer.split("####")[1].strip()
        answer = str(answer)  # AIME's answers are integers in some releases
        user = template.format(question) if template else question
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        if self.kind == "sft":
            return {"messages": [*messages, {"role": "assistant", "content": answer}]}
        return {"messages": messages, "ground_truth": answer}


# -- generated sliding-puzzle games --------------------------------------------------------------


@dataclass
class PuzzleJob:
    """NeMo's sliding-puzzle example draws each game's size in [2, size] and its shuffle
    moves in [1, shuffle_moves] (made odd); the same here, seeded, written as prompts."""

    where: str
    size: int
    shuffle_moves: int
    env_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    count_from: str = "train"  # "train": prompts x steps; "validation": max_val_samples
    out: str = ""

    def count(self, config: Any) -> int:
        g = config.grpo
        if self.count_from == "validation":
            return g.max_val_samples
        return g.num_prompts_per_step * g.max_num_steps

    def write(self, config: Any) -> None:
        from rl_envs.sliding_puzzle import SlidingPuzzleConfig, first_prompt, new_game

        n = self.count(config)
        out, done = Path(self.out), Path(self.out).with_suffix(".source")
        if out.is_file() and done.is_file() and done.read_text() == str(n):
            return
        env_cfg = SlidingPuzzleConfig.model_validate(self.env_config)
        rng = random.Random(self.seed)

        def games() -> Iterator[dict[str, Any]]:
            for _ in range(n):
                shuffle = rng.randint(1, self.shuffle_moves)
                shuffle += shuffle % 2 == 0
                size = rng.randint(2, self.size)
                state = new_game(size, shuffle, seed=rng.randrange(2**31))
                yield {"prompt": first_prompt(state, env_cfg), **state}

        _write_jsonl(out, games())
        done.write_text(str(n))


def _dataset_dict_splits(path: Path) -> list[str]:
    """The splits of a ``datasets`` save_to_disk DatasetDict directory (none for others)."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return []
    return list(json.loads(index.read_text()).get("splits", []))


def _write_jsonl(path: Path, rows: Iterator[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)  # never a half-written file under the final name


def _cache_file(*parts: Any) -> str:
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:12]
    return str(cache_root() / f"{parts[0]}-{digest}.jsonl")


# -- the translation groups ----------------------------------------------------------------------


def _puzzle_task(ctx: Context) -> str | None:
    env = ctx.get("env") or {}
    return next(
        (
            t
            for t, s in env.items()
            if isinstance(s, dict) and "game_config" in (s.get("cfg") or {})
        ),
        None,
    )


def data_group(ctx: Context, prefix: str) -> None:
    """``data.train`` / ``data.validation`` / ``data.default`` -> our ``data.train`` and
    ``data.validation`` (files written before the run, see :meth:`Translation.prepare`)."""
    entries = ("data.train", "data.validation", "data.default")
    task = _puzzle_task(ctx) if ctx.algorithm == "grpo" else None
    if task is not None:
        reason = (
            f"the sliding-puzzle recipe generates its games from env.{task}.cfg.game_config; "
            "NeMo's script never reads data.train/validation/default"
        )
        for entry in entries:
            for key, value in ctx.leaves(entry):
                ctx.ignore(key, value, reason)
        return
    default = ctx.get("data.default") or {}
    for key, value in ctx.leaves("data.default"):
        if key.rsplit(".", 1)[1] not in ENTRY_KEYS:
            ctx.refuse(key, value, "a dataset option with no counterpart here")
        else:
            ctx.record(key, value, "data.train/validation", "defaults of each dataset entry")
    for split in ("train", "validation"):
        entry = ctx.get(f"data.{split}")
        if entry is None:
            if ctx.has(f"data.{split}"):
                ctx.put(f"data.{split}", None, f"data.{split}")
            continue
        if isinstance(entry, list):
            ctx.refuse(f"data.{split}", entry, "would mix several datasets; here one per split")
            continue
        spec = {**default, **entry}
        unknown = [k for k in entry if k not in ENTRY_KEYS]
        lacking = UNSUPPORTED_DATASETS.get(spec.get("dataset_name") or "")
        for key, value in ctx.leaves(f"data.{split}"):
            field_name = key.rsplit(".", 1)[1]
            if field_name in unknown:
                ctx.refuse(key, value, lacking or "a dataset option with no counterpart here")
            elif field_name == "split_validation_size" and split == "train":
                ctx.put(key, value, "data.validation_fraction")
            elif field_name == "seed" and split == "train":
                ctx.put(key, value, "data.seed")
            else:
                ctx.record(key, value, f"data.{split}", "converted to our JSONL before the run")
        _dataset_entry(ctx, split, spec)


def _dataset_entry(ctx: Context, split: str, spec: dict[str, Any]) -> None:
    where = f"data.{split}"
    name = spec.get("dataset_name") or ("ResponseDataset" if spec.get("data_path") else None)
    if name in UNSUPPORTED_DATASETS:
        ctx.refuse(where, name, UNSUPPORTED_DATASETS[name])
        return
    if name not in KNOWN_DATASETS:
        known = ", ".join(k for k in KNOWN_DATASETS if k != "ResponseDataset")
        ctx.refuse(
            where,
            name,
            f"dataset {name!r} has no known row format here (known: {known}, "
            "or data_path to a local file); write it as our chat JSONL instead",
        )
        return
    _, shape, default_split = KNOWN_DATASETS[name]
    if shape in PREFERENCE_SHAPES:
        kind = "preference"
    else:
        default_processor = "sft_processor" if ctx.algorithm == "sft" else "math_hf_data_processor"
        processor = spec.get("processor") or default_processor
        if processor not in PROCESSORS:
            ctx.refuse(
                f"{where}.processor",
                processor,
                f"processor {processor!r} is not offered here (known: {', '.join(PROCESSORS)})",
            )
            return
        kind = PROCESSORS[processor]
    source = ctx.source
    job = DatasetJob(
        where=where,
        name=name,
        split=spec.get("split") or default_split or split,  # NeMo's loaders' defaults
        shape=shape,
        kind=kind,
        data_path=spec.get("data_path"),
        input_key=spec.get("input_key"),
        output_key=spec.get("output_key"),
        prompt_file=spec.get("prompt_file"),
        system_prompt_file=spec.get("system_prompt_file"),
        recipe_dir=str(Path(source).resolve().parent) if source else None,
        repeat=int(spec.get("repeat") or 1),
    )
    job.out = _cache_file(
        name,
        CONVERTER_VERSION,
        job.split,
        shape,
        kind,
        job.data_path,
        job.input_key,
        job.output_key,
        job.prompt_file,
        job.system_prompt_file,
        job.repeat,
    )
    ours: dict[str, Any]
    if kind == "preference":
        ours = {"source": "preference_file", "path": job.out}
    else:
        ours = {"source": "chat_file", "path": job.out}
        if kind == "prompt":
            ours |= {"env_info_keys": ["ground_truth"], "task_name": spec.get("env_name", "math")}
    ctx.set_ours(where, ours)
    ctx.result.data_jobs.append(job)


def _puzzle_env(ctx: Context, task: str, cfg: dict[str, Any], leaves: list) -> None:
    game = cfg["game_config"]
    env_config: dict[str, Any] = {}
    for key, value in leaves:
        if key.endswith(".max_moves"):
            # NeMo: one move per turn, at most max_moves. Here a turn may hold several moves,
            # and the episode ends after max_turns turns.
            env_config["max_turns"] = value
            ctx.record(key, value, f"env.{task}.config.max_turns", "moves per episode -> turns")
        elif key.rsplit(".", 1)[1] in ("size", "shuffle_moves"):
            ctx.record(key, value, "data.train/validation", "generated games")
        else:
            ctx.refuse(key, value, "a sliding-puzzle option with no counterpart here")
    ctx.set_ours(f"env.{task}", {"kind": "sliding_puzzle", "config": env_config})
    seed = int(ctx.get("grpo.seed", 42))
    for split, count_from, offset in (("train", "train", 0), ("validation", "validation", 1)):
        job = PuzzleJob(
            where=f"data.{split}",
            size=int(game.get("size", 3)),
            shuffle_moves=int(game.get("shuffle_moves", 10)),
            env_config=env_config,
            seed=seed + offset,
            count_from=count_from,
        )
        job.out = _cache_file(
            "sliding_puzzle", split, job.size, job.shuffle_moves, env_config, job.seed
        )
        ctx.result.data_jobs.append(job)
        ctx.set_ours(
            f"data.{split}",
            {
                "source": "chat_file",
                "path": job.out,
                "prompt_key": "prompt",
                "env_info_keys": ["board", "turn"],
                "task_name": task,
            },
        )
    # NeMo's games stop generation at the closing action tag, one action per turn.
    ctx.set_ours("generation.sampling.stop_strings", ["</action>"])


# -- models --------------------------------------------------------------------------------------


def resolve_hub_paths(config: Any) -> None:
    """Every model a translated recipe names by hub id (``policy.model``, ``tokenizer``,
    ``generation.model``, the critic's and teacher's models, a reward-model environment's
    ``model_path``) becomes its local snapshot directory, before any worker starts."""
    from rl_models.model_files import resolve_model_path

    generation = getattr(config, "generation", None)
    teacher = getattr(config, "teacher", None)
    models = [
        getattr(config.policy, "model", None),
        getattr(config, "tokenizer", None),
        getattr(generation, "model", None),
        getattr(getattr(config, "critic", None), "model", None),
        getattr(teacher, "model", None),
        getattr(teacher, "tokenizer", None),
    ]
    for holder in models:
        if holder is not None and holder.path and getattr(holder, "gguf_file", None) is None:
            holder.path = resolve_model_path(holder.path)
    if isinstance(getattr(generation, "tokenizer", None), str):  # GRPO's copy of tokenizer.path
        generation.tokenizer = resolve_model_path(generation.tokenizer)
    for spec in (getattr(config, "env", None) or {}).values():
        if getattr(spec, "kind", None) == "reward_model" and "model_path" in spec.config:
            spec.config["model_path"] = resolve_model_path(spec.config["model_path"])
