import pytest
import torch

from rl_data.datasets import ArithmeticConfig, RowDataset, load_dataset
from rl_data.errors import DataError
from rl_data.processors import PROCESSORS, ProcessedDataset, get_processor


def chat_rows(*conversations, task_name=None, env=None):
    rows = [{"messages": c, "extra_env_info": env, "task_name": task_name} for c in conversations]
    return RowDataset(rows, [("mem.jsonl", n) for n in range(1, len(rows) + 1)])


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def ids_of(datum):
    return torch.cat([m["token_ids"] for m in datum["message_log"]]).tolist()


def test_sft_sample_tokens_match_the_chat_template(tokenizer, template):
    data = ProcessedDataset(chat_rows([U("What is 2 + 2?"), A("4")]), tokenizer, template, "sft")
    datum = data[0]
    expected = tokenizer.apply_chat_template(
        [U("What is 2 + 2?"), A("4")], tokenize=True, return_dict=False
    )
    assert ids_of(datum) == list(expected)
    assert datum["length"] == len(expected)
    assert datum["loss_multiplier"] == 1.0 and datum["idx"] == 0


def test_prompt_processor_applies_task_spec_and_generation_prompt(tokenizer, template):
    spec = {
        "task_name": "math",
        "system_prompt": "Think first.",
        "prompt_template": "Solve: {prompt}",
    }
    rows = chat_rows([U("2 + 2"), A("4")], env={"ground_truth": "4"})
    datum = ProcessedDataset(rows, tokenizer, template, "prompt", task_spec=spec)[0]
    expected_text = template.render(
        [{"role": "system", "content": "Think first."}, U("Solve: 2 + 2")],
        add_generation_prompt=True,
    )
    assert tokenizer.decode(ids_of(datum)) == expected_text
    assert [m["role"] for m in datum["message_log"]] == ["system", "user"]  # the answer is cut off
    assert datum["extra_env_info"] == {"ground_truth": "4"}
    assert datum["task_name"] == "math"


def test_preference_processor_shares_the_prompt(tokenizer, template):
    rows = RowDataset(
        [{"prompt": [U("Say hi")], "chosen": [A("Hi!")], "rejected": [A("No.")]}], [("p", 1)]
    )
    datum = ProcessedDataset(rows, tokenizer, template, "preference")[0]
    chosen, rejected = datum["message_log_chosen"], datum["message_log_rejected"]
    assert torch.equal(chosen[0]["token_ids"], rejected[0]["token_ids"])
    assert tokenizer.decode(chosen[1]["token_ids"]) == "Hi!<|im_end|>\n"
    assert datum["length_chosen"] == sum(len(m["token_ids"]) for m in chosen)


def test_over_long_samples_keep_their_place_out_of_the_loss(tokenizer, template):
    long = [U("word " * 200), A("ok")]
    rows = chat_rows([U("hi"), A("hello")], long, [U("bye"), A("bye")])
    data = ProcessedDataset(rows, tokenizer, template, "sft", max_seq_length=32)
    batch = data.__getitems__([0, 1, 2])
    assert [d["idx"] for d in batch] == [0, 1, 2]
    assert [d["loss_multiplier"] for d in batch] == [1.0, 0.0, 1.0]
    assert batch[1]["length"] == 32 == len(ids_of(batch[1]))


def test_batched_and_single_access_agree(tokenizer, template):
    rows = load_dataset(ArithmeticConfig(size=6, seed=0))
    data = ProcessedDataset(rows, tokenizer, template, "prompt")
    batch = data.__getitems__([4, 1, 2])
    for datum, i in zip(batch, [4, 1, 2], strict=True):
        assert ids_of(datum) == ids_of(data[i]) and datum["idx"] == i


def test_processor_by_import_path_and_unknown_names():
    assert get_processor("rl_data.processors:sft_processor") is PROCESSORS["sft"]
    assert get_processor("rl_data.processors.prompt_processor") is PROCESSORS["prompt"]
    with pytest.raises(ValueError, match="unknown processor 'sfft'"):
        get_processor("sfft")
    with pytest.raises(ValueError, match="cannot import processor"):
        get_processor("rl_data.processors:nothing_here")


def test_processor_errors_name_the_row(tokenizer, template):
    rows = chat_rows([U("hi"), A("hello")], [U("no answer here")])
    data = ProcessedDataset(rows, tokenizer, template, "sft")
    with pytest.raises(
        DataError, match=r"mem\.jsonl, row 2: processor failed: .*at least one assistant"
    ):
        data.__getitems__([0, 1])
    pref = ProcessedDataset(rows, tokenizer, template, "preference")
    with pytest.raises(DataError, match="row 1: processor failed: missing key 'prompt'"):
        pref[0]
