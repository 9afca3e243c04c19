"""TRL's dataset formats, shards, saved datasets, renames and lazy reading of file sources."""

import json
import pickle
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError

from rl_data.datasets import (
    ChatFileConfig,
    DataConfig,
    PreferenceFileConfig,
    load_dataset,
    load_splits,
    require_env_info,
)
from rl_data.errors import DataError
from rl_data.processors import ProcessedDataset
from rl_data.types import STRING_PROMPT_KEY, TOOLS_KEY


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def S(text):
    return {"role": "system", "content": text}


# -- TRL's formats, as they are ---------------------------------------------------------------


def test_trl_language_modeling_formats(tmp_path):
    path = write_jsonl(
        tmp_path / "lm.jsonl",
        [{"text": "The sky is blue."}, {"messages": [U("Hi"), A("Hello")]}],
    )
    rows = load_dataset(ChatFileConfig(path=path))
    assert rows[0] == {
        "messages": [A("The sky is blue.")],
        "extra_env_info": None,
        "task_name": None,
        "raw_text": True,
    }
    assert rows[1]["messages"] == [U("Hi"), A("Hello")] and "raw_text" not in rows[1]


def test_trl_text_row_tokenises_without_chat_template(tmp_path, tokenizer, template):
    path = write_jsonl(tmp_path / "lm.jsonl", [{"text": "The quick brown fox."}])
    rows = load_dataset(ChatFileConfig(path=path))
    rows.task_spec = {"system_prompt": "ignored for plain text"}
    datum = ProcessedDataset(rows, tokenizer, template, "sft")[0]
    ids = torch.cat([m["token_ids"] for m in datum["message_log"]]).tolist()
    expected = tokenizer("The quick brown fox.", add_special_tokens=False)["input_ids"]
    assert ids == [*expected, tokenizer.eos_token_id]
    with pytest.raises(DataError, match="plain text for SFT"):
        ProcessedDataset(rows, tokenizer, template, "prompt")[0]


def test_trl_prompt_only_and_prompt_completion_formats(tmp_path):
    path = write_jsonl(
        tmp_path / "pc.jsonl",
        [
            {"prompt": "2+2?"},  # standard prompt-only
            {"prompt": [S("Be brief."), U("2+2?")]},  # conversational prompt-only
            {"prompt": "2+2?", "completion": "4"},  # standard prompt-completion
            {"prompt": [U("2+2?")], "completion": [A("4")], "ground_truth": "4"},
        ],
    )
    rows = load_dataset(ChatFileConfig(path=path))
    assert [r["messages"] for r in rows] == [
        [U("2+2?")],
        [S("Be brief."), U("2+2?")],
        [U("2+2?"), A("4")],
        [U("2+2?"), A("4")],
    ]
    # every column the messages were not read from reaches the environment
    assert rows[3]["extra_env_info"] == {"ground_truth": "4"}
    # a prompt that is a string is kept as it is, for reward functions (TRL's standard format)
    assert rows[0]["extra_env_info"] == {STRING_PROMPT_KEY: "2+2?"}
    assert rows[1]["extra_env_info"] is None


def test_trl_preference_explicit_and_implicit_prompt(tmp_path):
    path = write_jsonl(
        tmp_path / "pref.jsonl",
        [
            {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
            {"chosen": "The sky is blue.", "rejected": "The sky is green."},
            {
                "chosen": [U("What color is the sky?"), A("Blue.")],
                "rejected": [U("What color is the sky?"), A("Green.")],
            },
            {"prompt": [U("Sky?")], "chosen": [A("Blue.")], "rejected": [A("Green.")]},
        ],
    )
    rows = load_dataset(PreferenceFileConfig(path=path))
    assert rows[0] == {
        "prompt": [U("The sky is")],
        "chosen": [A(" blue.")],
        "rejected": [A(" green.")],
    }
    assert rows[1] == rows[0]  # the implicit prompt is cut at a word boundary
    assert rows[2] == {
        "prompt": [U("What color is the sky?")],
        "chosen": [A("Blue.")],
        "rejected": [A("Green.")],
    }
    assert rows[3]["prompt"] == [U("Sky?")]


def test_implicit_prompt_that_shares_nothing_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": [A("a")], "rejected": [A("b")]}])
    with pytest.raises(DataError, match=r"p\.jsonl, row 1: no prompt column 'prompt'"):
        load_dataset(PreferenceFileConfig(path=path))


def test_tool_calls_are_kept_and_rendered(tmp_path, tokenizer):
    from rl_data.templates import ChatTemplate

    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [
        U("1+2?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        A("3"),
    ]
    rows = load_dataset(
        ChatFileConfig(path=write_jsonl(tmp_path / "t.jsonl", [{"messages": messages}]))
    )
    kept = rows[0]["messages"]
    assert kept[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert kept[2]["tool_call_id"] == "c1"

    source = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
        "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}\n{% endfor %}"
    )
    template = ChatTemplate(source)
    data = ProcessedDataset(rows, tokenizer, template, "sft")[0]
    text = tokenizer.decode(torch.cat([m["token_ids"] for m in data["message_log"]]).tolist())
    assert 'CALL add{"a": 1, "b": 2}' in text
    assert text == template.render(kept)


def test_tool_calls_of_the_wrong_shape_are_refused(tmp_path):
    bad = [U("x"), {"role": "assistant", "content": "", "tool_calls": "add(1, 2)"}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": bad}])
    with pytest.raises(DataError, match=r"row 1: messages\[1\] tool_calls must be a list of dicts"):
        load_dataset(ChatFileConfig(path=path))


ADD_TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}},
}


def test_a_tools_column_is_checked_and_travels_in_extra_env_info(tmp_path):
    rows = [
        {"prompt": "1+2?", "tools": [ADD_TOOL], "answer": "3"},
        {"prompt": "2+2?", "answer": "4"},  # a row offered no tools
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    data = load_dataset(ChatFileConfig(path=path, columns={"answer": "ground_truth"}))
    assert data[0]["extra_env_info"] == {
        "ground_truth": "3",
        STRING_PROMPT_KEY: "1+2?",
        TOOLS_KEY: [ADD_TOOL],
    }
    assert TOOLS_KEY not in data[1]["extra_env_info"]
    # the rows' tools are kept even when env_info_keys leaves the column out
    picked = load_dataset(ChatFileConfig(path=path, env_info_keys=["answer"]))
    assert picked[0]["extra_env_info"] == {
        "answer": "3",
        STRING_PROMPT_KEY: "1+2?",
        TOOLS_KEY: [ADD_TOOL],
    }


def test_bad_tools_name_the_file_and_row(tmp_path):
    rows = [{"prompt": "a", "tools": [ADD_TOOL]}, {"prompt": "b", "tools": [{"name": "add"}]}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(
        DataError, match=r't\.jsonl, row 2: tools\[0\] must be \{"type": "function"'
    ):
        load_dataset(ChatFileConfig(path=path))


def test_parquet_rows_keep_tools_and_calls_as_json_strings(tmp_path):
    # Arrow would give every tool schema the union of all tools' keys: JSON strings keep them
    # whole; arguments too (OpenAI's format)
    call = {
        "type": "function",
        "id": "c1",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    messages = [
        U("1+2?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        A("3"),
    ]
    table = pa.Table.from_pylist(
        [
            {"messages": messages, "tools": json.dumps([ADD_TOOL])},
            {"messages": [U("hi"), A("hello")], "tools": None},
        ]
    )
    pq.write_table(table, tmp_path / "t.parquet")
    data = load_dataset(ChatFileConfig(path=str(tmp_path / "t.parquet")))
    assert data[0]["extra_env_info"] == {TOOLS_KEY: [ADD_TOOL]}
    assert data[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert data[0]["messages"][2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert data[1]["extra_env_info"] is None


# -- shards, saved datasets, renames --------------------------------------------------------


def parquet_shards(folder: Path, sizes: list[int]) -> list[Path]:
    folder.mkdir()
    paths, k = [], 0
    for s, n in enumerate(sizes):
        rows = [{"prompt": f"question {k + i}", "answer": str(k + i)} for i in range(n)]
        k += n
        path = folder / f"train-{s:05d}-of-{len(sizes):05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(path)
    return paths


def test_sharded_parquet_folder_and_glob_with_origins(tmp_path):
    paths = parquet_shards(tmp_path / "shards", [3, 2, 4])
    cache = str(tmp_path / "cache")
    for path in (tmp_path / "shards", tmp_path / "shards" / "train-*.parquet"):
        rows = load_dataset(ChatFileConfig(path=str(path), cache_dir=cache))
        assert len(rows) == 9
        assert [r["messages"][0]["content"] for r in rows] == [f"question {i}" for i in range(9)]
        assert rows.origin(4) == (str(paths[1]), 2)  # second shard's second row
        assert rows.origin(8) == (str(paths[2]), 4)


def test_sharded_jsonl_glob_names_file_and_line_of_a_bad_row(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": "p0"}, {"prompt": "p1"}])
    bad = tmp_path / "d" / "b.jsonl"
    bad.write_text('{"prompt": "p2"}\n\n{"prompt": 3}\n')
    with pytest.raises(DataError, match=r"b\.jsonl, row 3: column 'prompt' must be a string"):
        load_dataset(ChatFileConfig(path=str(tmp_path / "d" / "*.jsonl"), prompt_key="prompt"))
    rows = load_dataset(
        ChatFileConfig(path=str(tmp_path / "d"), prompt_key="prompt", on_bad_row="skip")
    )
    assert [r["messages"][0]["content"] for r in rows] == ["p0", "p1", "p2"]
    assert [(s.source, s.row) for s in rows.skipped] == [(str(bad), 3)]


def test_mixed_shard_formats_and_empty_globs_are_refused(tmp_path):
    parquet_shards(tmp_path / "mix", [1])
    write_jsonl(tmp_path / "mix" / "x.jsonl", [{"text": "t"}])
    with pytest.raises(ValidationError, match="more than one format"):
        ChatFileConfig(path=str(tmp_path / "mix"))
    with pytest.raises(ValidationError, match="no file matches"):
        ChatFileConfig(path=str(tmp_path / "*.parquet"))


def test_save_to_disk_dataset_is_memory_mapped(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": f"p{i}", "answer": str(i)} for i in range(6)])
    ds.save_to_disk(tmp_path / "saved")
    rows = load_dataset(ChatFileConfig(path=str(tmp_path / "saved")))
    assert [r["messages"][0]["content"] for r in rows] == [f"p{i}" for i in range(6)]
    arrow = rows.records.sources[0].data
    assert isinstance(arrow.data, datasets.table.MemoryMappedTable)
    assert rows.origin(5) == (str(tmp_path / "saved"), 6)


def test_rename_map_feeds_the_reward_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2?", "answer": "4"}])
    cfg = ChatFileConfig(path=path, columns={"question": "prompt", "answer": "ground_truth"})
    row = load_dataset(cfg)[0]
    assert row["messages"] == [U("2+2?")]
    assert row["extra_env_info"] == {"ground_truth": "4", STRING_PROMPT_KEY: "2+2?"}
    with pytest.raises(DataError, match=r"row 1: column 'solution' of the rename map"):
        load_dataset(ChatFileConfig(path=path, columns={"solution": "ground_truth"}))
    with pytest.raises(ValidationError, match="renames several columns to"):
        ChatFileConfig(path=path, columns={"question": "x", "answer": "x"})


def test_missing_reward_column_fails_at_setup_naming_column_and_row(tmp_path):
    """The silent-zero case: an answer column not named ground_truth."""
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "1+1?", "ground_truth": "2"}, {"prompt": "2+2?", "answer": "4"}],
    )
    rows = load_dataset(ChatFileConfig(path=path, task_name="math"))
    with pytest.raises(
        DataError, match=r"d\.jsonl, row 2: no column 'ground_truth', .*'math'.*\['answer'\]"
    ):
        require_env_info(rows, {"math": ["ground_truth"]})
    require_env_info(rows, {"other_task": ["ground_truth"]})  # other tasks' needs do not apply
    require_env_info(rows.select([0]), {"math": ["ground_truth"]})


# -- lazy reading ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_rows_are_read_lazily_not_held_in_memory(tmp_path, fmt):
    n, text = 3000, "x" * 2000  # 6 MB of text
    records = [{"prompt": f"{i} {text}", "ground_truth": str(i)} for i in range(n)]
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "big.jsonl", records)
    else:
        path = str(tmp_path / "big.parquet")
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=500)
    del records
    cfg = ChatFileConfig(path=path, cache_dir=str(tmp_path / "cache"))
    import datasets  # noqa: F401 - imported first: its import is not what is measured

    before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        rows = load_dataset(cfg)  # reads and checks every row once
        assert rows[n - 1]["extra_env_info"]["ground_truth"] == str(n - 1)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    arrow_held = pa.total_allocated_bytes() - before
    assert len(rows) == n
    # 6 MB of rows: what stays is an index (a few hundred kB); at no point was half of it
    # in memory (the check reads a batch of rows at a time); no Arrow buffers are kept
    assert retained + arrow_held < 500_000, (retained, arrow_held)
    assert peak < 2_500_000, peak
    assert "rows" not in vars(rows)  # no list of rows behind it
    # what a Ray actor gets: the index and where to read, not the rows
    assert len(pickle.dumps(rows)) < 200_000
    assert pickle.loads(pickle.dumps(rows))[7] == rows[7]


def test_select_and_held_out_splits_stay_lazy(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    splits = load_splits(DataConfig(train=ChatFileConfig(path=path), validation_fraction=0.2))
    assert len(splits["train"]) == 8 and len(splits["validation"]) == 2
    seen = [r["messages"][0]["content"] for s in splits.values() for r in s]
    assert sorted(seen) == sorted(f"p{i}" for i in range(10))
    assert {type(s).__name__ for s in splits.values()} == {"FileRows"}


# -- system prompt and prompt template ---------------------------------------------------------


def test_data_system_prompt_and_prompt_template_reach_the_prompts(tmp_path, tokenizer, template):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2 + 2", "ground_truth": "4"}])
    cfg = DataConfig(
        train=ChatFileConfig(path=path),
        system_prompt="Answer in <answer> tags.",
        prompt_template="Solve: {prompt}",
    )
    rows = load_splits(cfg)["train"]
    datum = ProcessedDataset(rows, tokenizer, template, "prompt")[0]
    assert [(m["role"], m["content"]) for m in datum["message_log"]] == [
        ("system", "Answer in <answer> tags."),
        ("user", "Solve: 2 + 2"),
    ]


@pytest.mark.parametrize("bad", ["no field", "{question}", "{prompt.__class__}", "{0}{1}"])
def test_prompt_template_must_fill_in_the_prompt_only(tmp_path, bad):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    with pytest.raises(
        ValidationError, match=r"prompt_template\n.*must contain \{\} or \{prompt\}"
    ):
        DataConfig(train=ChatFileConfig(path=path), prompt_template=bad)


def test_missing_data_file_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValidationError, match=r"train\.chat_file\.path\n.*file not found"):
        DataConfig.model_validate({"train": {"source": "chat_file", "path": "nope.jsonl"}})


def test_sampled_rows_reads_only_the_first_records_of_each_format(tmp_path):
    from rl_data.datasets import sampled_rows

    rows = [{"prompt": f"q{i}", "ground_truth": str(i)} for i in range(5)]
    (tmp_path / "jsonl").mkdir()
    write_jsonl(tmp_path / "jsonl" / "a.jsonl", rows[:2])
    write_jsonl(tmp_path / "jsonl" / "b.jsonl", [*rows[2:], "not an object"])
    (tmp_path / "parquet").mkdir()
    for name, part in (("a", rows[:2]), ("b", rows[2:])):
        pq.write_table(pa.Table.from_pylist(part), tmp_path / "parquet" / f"{name}.parquet")
    for folder in ("jsonl", "parquet"):
        source = {"source": "chat_file", "path": str(tmp_path / folder)}
        with sampled_rows(3):
            sample = load_dataset(source)
        assert [r["extra_env_info"]["ground_truth"] for r in sample] == ["0", "1", "2"]
        assert sample.origin(2) == (str(tmp_path / folder / f"b.{folder}"), 1)
    with pytest.raises(DataError, match="row 4: a row must be a JSON object"):
        load_dataset({"source": "chat_file", "path": str(tmp_path / "jsonl")})
