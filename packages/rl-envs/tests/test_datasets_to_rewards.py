"""Every task source, end to end: rl-data's rows -> prompt processing -> environment -> reward.

For each source the gold answer (written the way a model would) must earn 1 and a wrong one 0:
a source whose rows do not carry what its environment reads would score every sample 0, which
no other test would notice. The reasoning-gym tasks are the ones the docs and tests use (no
example config names any yet): basic_arithmetic, leg_counting and chain_sum.
"""

import json

import pytest

from rl_data.datasets import ArithmeticConfig, ChatFileConfig, ReasoningGymConfig, load_dataset
from rl_data.processors import ProcessedDataset
from rl_data.templates import ChatTemplate, ChatTemplateConfig
from rl_data.tokenizers import build_tokenizer
from rl_envs.code.env import CodeEnvConfig, CodeEnvironment
from rl_envs.code.sandbox import SandboxLimits
from rl_envs.math_env import MathEnvConfig, MathEnvironment
from rl_envs.reasoning_gym_env import ReasoningGymEnvConfig, ReasoningGymEnvironment

pytestmark = pytest.mark.ray

REASONING_GYM_TASKS = ["basic_arithmetic", "leg_counting", "chain_sum"]
MATH_ROWS = [
    {"problem": "What is half of one?", "ground_truth": r"\frac{1}{2}"},
    {"problem": "What is the square root of 8?", "ground_truth": r"2\sqrt{2}"},
]
CODE_ROWS = [
    {
        "prompt": "Write add(a, b).",
        "tests": [
            {"function": "add", "args": [1, 2], "expected": 3},
            {"function": "add", "args": [-4, 4], "expected": 0},
        ],
        "gold": "def add(a, b):\n    return a + b\n",
        "wrong": "def add(a, b):\n    return a - b\n",
    },
    {
        "prompt": "Read two numbers, print their product.",
        "tests": [{"stdin": "3 4\n", "stdout": "12\n"}, {"stdin": "0 9", "stdout": "0"}],
        "gold": "a, b = map(int, input().split())\nprint(a * b)\n",
        "wrong": "a, b = map(int, input().split())\nprint(a + b)\n",
    },
]


@pytest.fixture(scope="module")
def prompts():
    """Turns rows into what the GRPO loop hands an environment: a prompt log and its info."""
    tokenizer = build_tokenizer(["What is 2 + 2? The answer is 4. add print"] * 20, 300)
    template = ChatTemplate.from_config(ChatTemplateConfig(), tokenizer)

    def process(rows):
        data = ProcessedDataset(rows, tokenizer, template, "prompt")
        return [data[i] for i in range(len(data))]

    return process


def score(env, datums, responses):
    logs = [
        [*d["message_log"], {"role": "assistant", "content": r}]
        for d, r in zip(datums, responses, strict=True)
    ]
    return env.step(logs, [d["extra_env_info"] for d in datums]).rewards.tolist()


def test_arithmetic_and_math_rows_reach_math_verify(ray_session, prompts, tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    math_rows = load_dataset(
        ChatFileConfig(path=str(path), prompt_key="problem", env_info_keys=["ground_truth"])
    )
    arithmetic = prompts(load_dataset(ArithmeticConfig(size=4, seed=1)))
    maths = prompts(math_rows)
    env = MathEnvironment(MathEnvConfig(num_workers=1, num_cpus_per_worker=1))
    try:
        gold = [
            f"So the answer is $\\boxed{{{d['extra_env_info']['ground_truth']}}}$."
            for d in arithmetic
        ]
        wrong = [f"\\boxed{{{int(d['extra_env_info']['ground_truth']) + 1}}}" for d in arithmetic]
        assert score(env, arithmetic, gold) == [1.0] * 4
        assert score(env, arithmetic, wrong) == [0.0] * 4
        assert score(env, maths, [r"\boxed{0.5}", r"The answer is $\sqrt{8}$"]) == [1.0, 1.0]
        assert score(env, maths, [r"\boxed{2}", r"\boxed{8}"]) == [0.0, 0.0]
    finally:
        env.shutdown()


def test_reasoning_gym_rows_reach_their_tasks_scorer(ray_session, prompts):
    env = ReasoningGymEnvironment(ReasoningGymEnvConfig(num_workers=1, num_cpus_per_worker=1))
    try:
        for task in REASONING_GYM_TASKS:
            datums = prompts(load_dataset(ReasoningGymConfig(task=task, size=3, seed=5)))
            answers = [d["extra_env_info"]["ground_truth"] for d in datums]
            gold = [f"Thinking it over. <answer>{a}</answer>" for a in answers]
            # A far-off number: these scorers give partial credit for near misses ("1841" for
            # "184" earns 0.75), which is the task's choice, not a wiring fault.
            wrong = [f"<answer>{-int(a) - 1}</answer>" for a in answers]
            assert score(env, datums, gold) == [1.0] * 3, task
            assert score(env, datums, wrong) == [0.0] * 3, task
    finally:
        env.shutdown()


def test_code_rows_reach_the_sandbox(ray_session, prompts, tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CODE_ROWS))
    datums = prompts(
        load_dataset(ChatFileConfig(path=str(path), prompt_key="prompt", env_info_keys=["tests"]))
    )
    env = CodeEnvironment(
        CodeEnvConfig(
            num_workers=1,
            num_cpus_per_worker=1,
            timeout_s=10,
            sandbox=SandboxLimits(cpu_time_s=1, case_time_s=2, wall_time_s=5),
        )
    )
    try:
        fence = "Here it is:\n```python\n{}```"
        assert score(env, datums, [fence.format(r["gold"]) for r in CODE_ROWS]) == [1.0, 1.0]
        assert score(env, datums, [fence.format(r["wrong"]) for r in CODE_ROWS]) == [0.0, 0.0]
    finally:
        env.shutdown()
