import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from rl_data.datasets import (
    ArithmeticConfig,
    ChatFileConfig,
    DataConfig,
    PreferenceFileConfig,
    ReasoningGymConfig,
    load_dataset,
    load_splits,
)
from rl_data.errors import DataError
from rl_data.types import STRING_PROMPT_KEY


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat(user: str, assistant: str | None = None, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    return messages


ROWS = [{"messages": chat(f"question {i}", f"answer {i}"), "answer": str(i)} for i in range(5)]


def test_jsonl_chat_format(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    rows = load_dataset(ChatFileConfig(path=str(path), env_info_keys=["answer"], task_name="math"))
    assert len(rows) == 5
    assert rows[3] == {
        "messages": chat("question 3", "answer 3"),
        "extra_env_info": {"answer": "3"},
        "task_name": "math",
    }
    assert rows.origin(3) == (str(path), 4)


def test_parquet_with_column_names(tmp_path):
    path = tmp_path / "train.parquet"
    table = {"q": ["2+2?", "3+3?"], "a": ["4", "6"], "sys": ["Be brief.", "Be brief."]}
    pq.write_table(pa.table(table), path)
    cfg = ChatFileConfig(path=str(path), prompt_key="q", response_key="a", system_key="sys")
    rows = load_dataset(cfg)
    assert [r["messages"] for r in rows] == [
        chat("2+2?", "4", "Be brief."),
        chat("3+3?", "6", "Be brief."),
    ]


def test_parquet_chat_format(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in ROWS]), path)
    rows = load_dataset({"source": "chat_file", "path": str(path)})
    assert [r["messages"] for r in rows] == [r["messages"] for r in ROWS]


def test_hf_dataset_saved_to_disk_and_its_splits(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": f"p{i}", "answer": str(i)} for i in range(4)])
    ds.save_to_disk(tmp_path / "flat")
    rows = load_dataset(
        ChatFileConfig(path=str(tmp_path / "flat"), prompt_key="prompt", env_info_keys=["answer"])
    )
    assert [r["messages"][0]["content"] for r in rows] == ["p0", "p1", "p2", "p3"]
    assert rows[2]["extra_env_info"] == {"answer": "2", STRING_PROMPT_KEY: "p2"}

    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(tmp_path / "dict")
    rows = load_dataset(
        ChatFileConfig(path=str(tmp_path / "dict"), split="test", prompt_key="prompt")
    )
    assert len(rows) == 1
    with pytest.raises(DataError, match=r"has splits \['test', 'train'\]"):
        load_dataset(ChatFileConfig(path=str(tmp_path / "dict"), prompt_key="prompt"))


def test_preference_chosen_rejected(tmp_path):
    path = write_jsonl(
        tmp_path / "pref.jsonl",
        [
            {"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."},
            {"prompt": chat("Say bye"), "chosen": chat("x", "Bye!")[1:], "rejected": "..."},
        ],
    )
    rows = load_dataset(PreferenceFileConfig(path=str(path)))
    assert rows[0] == {
        "prompt": [{"role": "user", "content": "Say hi"}],
        "chosen": [{"role": "assistant", "content": "Hi!"}],
        "rejected": [{"role": "assistant", "content": "No."}],
    }
    assert rows[1]["chosen"] == [{"role": "assistant", "content": "Bye!"}]


def test_preference_ranked_completions(tmp_path):
    record = {
        "prompt": "Best?",
        "ranked": [{"completion": c, "score": s} for c, s in [("b", 2), ("a", 3), ("c", 1)]],
    }
    path = write_jsonl(tmp_path / "ranked.jsonl", [record])
    best_vs_rest = load_dataset(PreferenceFileConfig(path=str(path), completions_key="ranked"))
    pairs = [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in best_vs_rest]
    assert pairs == [("a", "b"), ("a", "c")]
    every = load_dataset(
        PreferenceFileConfig(path=str(path), completions_key="ranked", pairs="all")
    )
    pairs = [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in every]
    assert pairs == [("a", "b"), ("a", "c"), ("b", "c")]
    assert {every.origin(i) for i in range(3)} == {(str(path), 1)}


def test_reasoning_gym_rows_keep_the_ground_truth_and_score():
    cfg = ReasoningGymConfig(task="basic_arithmetic", size=8, seed=3)
    rows = load_dataset(cfg)
    import reasoning_gym  # after rl_data has imported it (quietly)

    again = load_dataset(cfg)
    other = load_dataset(cfg.model_copy(update={"seed": 4}))
    assert len(rows) == 8
    assert [r["messages"] for r in rows] == [r["messages"] for r in again]
    assert [r["messages"] for r in rows] != [r["messages"] for r in other]
    info = rows[0]["extra_env_info"]
    assert info["ground_truth"] == info["entry"]["answer"]
    assert rows[0]["messages"][0]["content"] == info["entry"]["question"]
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    assert score(info["ground_truth"], info["entry"]) == 1.0


def test_reasoning_gym_unknown_task_suggests_names():
    with pytest.raises(ValueError, match="did you mean 'basic_arithmetic'"):
        load_dataset(ReasoningGymConfig(task="basic_arithmetc", size=2))


def test_arithmetic_answers_are_right_and_seeded():
    rows = load_dataset(ArithmeticConfig(size=50, seed=1, max_operand=20))
    for row in rows:
        a, op, b = row["messages"][0]["content"].removeprefix("What is ").split("?")[0].split()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["extra_env_info"]["ground_truth"] == str(expected)
        assert 0 <= int(a) <= 20 and 0 <= int(b) <= 20
    assert [r["messages"] for r in rows] == [
        r["messages"] for r in load_dataset(ArithmeticConfig(size=50, seed=1, max_operand=20))
    ]
    assert [r["messages"] for r in rows] != [
        r["messages"] for r in load_dataset(ArithmeticConfig(size=50, seed=2, max_operand=20))
    ]


def test_held_out_validation_is_seeded_and_disjoint():
    cfg = DataConfig(train=ArithmeticConfig(size=40), validation_fraction=0.25, seed=7)
    splits = load_splits(cfg)
    train_q = [r["messages"][0]["content"] for r in splits["train"]]
    val_q = [r["messages"][0]["content"] for r in splits["validation"]]
    assert (len(train_q), len(val_q)) == (30, 10)
    all_rows = [tuple(o) for o in splits["train"].origins + splits["validation"].origins]
    assert sorted(all_rows) == [("arithmetic", n) for n in range(1, 41)]
    again = load_splits(cfg)
    assert [r["messages"] for r in again["validation"]] == [
        r["messages"] for r in splits["validation"]
    ]
    other = load_splits(cfg.model_copy(update={"seed": 8}))
    assert splits["validation"].origins != other["validation"].origins


def test_data_config_validates_from_plain_yaml_values():
    cfg = DataConfig.model_validate(
        {
            "train": {"source": "arithmetic", "size": 10},
            "validation": {"source": "reasoning_gym", "task": "leg_counting"},
        }
    )
    assert isinstance(cfg.train, ArithmeticConfig) and isinstance(
        cfg.validation, ReasoningGymConfig
    )
    with pytest.raises(ValidationError, match=r"train\.arithmetic\.siz"):
        DataConfig.model_validate({"train": {"source": "arithmetic", "siz": 10}})


# ---- bad input -------------------------------------------------------------------------------


def _lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


GOOD = json.dumps({"messages": chat("hi", "hello")})


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ('{"messages": [', "not valid JSON"),
        (json.dumps({"question": "hi"}), r"no column 'messages', 'prompt' or 'text'"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "role 'robot'"),
        (
            json.dumps({"messages": [{"role": "user", "content": ["x"]}]}),
            "content must be a string, got list",
        ),
        (json.dumps(["not", "an", "object"]), "must be a JSON object"),
    ],
)
def test_bad_row_error_names_file_and_row(tmp_path, bad_line, reason):
    path = _lines(tmp_path / "data.jsonl", [GOOD, GOOD, bad_line, GOOD])
    with pytest.raises(DataError, match=reason) as info:
        load_dataset(ChatFileConfig(path=path))
    assert info.value.source == path and info.value.row == 3
    assert str(info.value).startswith(f"{path}, row 3: ")


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path):
    path = _lines(
        tmp_path / "data.jsonl", [GOOD, "{oops", GOOD, json.dumps({"messages": "hi"}), GOOD]
    )
    rows = load_dataset(ChatFileConfig(path=path, on_bad_row="skip"))
    assert len(rows) == 3
    assert [(s.row, s.source) for s in rows.skipped] == [(2, path), (4, path)]
    assert [o[1] for o in rows.origins] == [1, 3, 5]


def test_missing_column_in_parquet_names_it(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["a"]}), path)
    with pytest.raises(
        DataError, match=r"row 1: missing column 'prompt' \(columns: \['question'\]\)"
    ):
        load_dataset(ChatFileConfig(path=str(path), prompt_key="prompt"))


def test_non_string_column_value(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": 7}])
    with pytest.raises(DataError, match="row 2: column 'prompt' must be a string, got int"):
        load_dataset(ChatFileConfig(path=str(path), prompt_key="prompt"))


def test_empty_and_missing_files(tmp_path):
    empty = _lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match=r"empty\.jsonl: contains no rows"):
        load_dataset(ChatFileConfig(path=empty))
    # a path that names no data is refused by the config, before anything runs
    with pytest.raises(ValidationError, match=r"path\n.*file not found: '.*nope\.jsonl'"):
        ChatFileConfig(path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValidationError, match="cannot tell the format"):
        ChatFileConfig(path=_lines(tmp_path / "data.txt", [GOOD]))
    all_bad = _lines(tmp_path / "bad.jsonl", ["{", "{"])
    with pytest.raises(DataError, match=r"no usable rows \(2 skipped\)"):
        load_dataset(ChatFileConfig(path=all_bad, on_bad_row="skip"))


def test_arithmetic_operand_range_prompt_and_distinct_questions():
    cfg = ArithmeticConfig(
        size=300,
        seed=5,
        min_operand=10,
        max_operand=99,
        operations=["+"],
        prompt="What is {a} + {b}? Answer with just the number.",
        distinct=True,
    )
    rows = load_dataset(cfg)
    questions = [r["messages"][0]["content"] for r in rows]
    assert len(set(questions)) == 300  # no question twice
    for q, row in zip(questions, rows, strict=True):
        assert q.endswith("? Answer with just the number.")
        a, b = (int(x) for x in q.removeprefix("What is ").split("?")[0].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["extra_env_info"]["ground_truth"] == str(a + b)
    # Without `distinct` the same range repeats questions at this size (birthday bound).
    repeated = load_dataset(cfg.model_copy(update={"distinct": False, "size": 2000}))
    assert len({r["messages"][0]["content"] for r in repeated}) < 2000


def test_arithmetic_bad_settings_name_the_key():
    with pytest.raises(ValidationError, match="min_operand"):
        ArithmeticConfig(min_operand=50, max_operand=10)
    with pytest.raises(ValidationError, match=r"arithmetic.prompt"):
        ArithmeticConfig(prompt="What is {x}?")
    with pytest.raises(ValidationError, match=r"arithmetic.prompt"):
        ArithmeticConfig(prompt="What is {a.__class__.__mro__}?")
    with pytest.raises(ValidationError, match="distinct questions"):
        ArithmeticConfig(size=10, min_operand=1, max_operand=2, operations=["+"], distinct=True)
