"""The tag-based built-in reward functions, one case per rule, and their use by name."""

from rl_envs.reward_functions import load_reward_function
from rl_envs.tag_rewards import answer_exact, answer_is_integer, think_answer_format

GOOD = "<think>6 times 7</think>\n<answer> 42 </answer>"


def test_the_answer_is_read_from_the_last_answer_tag_and_compared_as_text():
    completions = [
        GOOD,
        "<answer>41</answer>",
        "42",
        "<answer>42.0</answer>",
        "<answer>x</answer> <answer>42",
    ]
    assert answer_exact([""] * 5, completions, ["42"] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]
    chat = [[{"role": "assistant", "content": GOOD}]]  # TRL's conversational form
    assert answer_exact([""], chat, [" 42"]) == [1.0]


def test_an_integer_answer_is_digits_only():
    completions = [GOOD, "<answer>-3</answer>", "<answer>4.5</answer>", "<answer></answer>"]
    assert answer_is_integer([""] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
    # Digits outside ASCII (str.isdigit takes each of these) are no integer int() would read.
    others = [
        "<answer>2\u00b2</answer>",
        "<answer>\u0664\u0662</answer>",
        "<answer>\u2460</answer>",
    ]
    assert answer_is_integer([""] * 3, others) == [0.0, 0.0, 0.0]


def test_the_format_is_one_think_block_a_newline_and_one_answer_block():
    completions = [
        GOOD,
        GOOD + "\n",  # a final newline is allowed
        "<think>a</think><answer>1</answer>",  # no newline between the blocks
        "<think>a</think>\n<answer>1</answer> and more",  # text after the answer
        "<think>a</think>\n<answer>1</answer>\n<answer>2</answer>",  # two answers
        "<answer>1</answer>",  # no think block
        "<think>multi\nline</think>\n<answer>1</answer>",
    ]
    assert think_answer_format([""] * 7, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_each_is_a_built_in_by_name():
    for name, fn in [
        ("answer_exact", answer_exact),
        ("answer_is_integer", answer_is_integer),
        ("think_answer_format", think_answer_format),
    ]:
        assert load_reward_function(name) is fn
