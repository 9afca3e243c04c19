"""A tool-calling episode end to end, with the real pieces: a row's tools rendered into its
prompt by the ``chatml_tools`` template, a generated ``<tool_call>`` parsed and run by the tool
environment (a Ray actor, the calculator in its worker process), the tool's reply appended, the
final answer scored by a reward function. The conversation that is trained on must be exactly
what the chat template renders for it, token for token, with only the sampled tokens in the
loss. And with the loop's defaults, an episode goes on while another one's tool runs."""

import json
from pathlib import Path

import pytest
import ray
import torch

from rl_algorithms.agent_loop import AgentLoopConfig
from rl_algorithms.rollouts import run_rollouts
from rl_data.messages import tokenize_message_logs
from rl_data.templates import ChatTemplate, ChatTemplateConfig
from rl_data.tokenizers import build_tokenizer, encode_texts
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_envs.tools.env import ToolEnvConfig, ToolEnvironment
from rl_envs.tools.registry import ToolSpec, tool_schema

from .test_agent_loop import RandomTokenGeneration, generated_output

pytestmark = pytest.mark.usefixtures("ray_session")

# Qwen2.5-Instruct's own template (rl-data's test fixture, see its SOURCES.md): it renders
# tools into a system turn of its own, so every later turn must be rendered with them too.
QWEN = Path(__file__).parents[2] / "rl-data/tests/fixtures/chat_templates/qwen2.5-instruct.jinja"
TEMPLATES = {
    "chatml_tools": ChatTemplateConfig(kind="chatml_tools"),
    "qwen2.5": ChatTemplateConfig(kind="jinja", template=QWEN.read_text()),
}

REWARDS = '''
from pathlib import Path


def exact(completions, answer, **kwargs):
    """1 when the final answer is the expected one; the answer "quick" also marks that its
    episode is over (for ``wait_for_quick``)."""
    if "quick" in answer:
        Path(__file__).with_name("quick_done").touch()
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]
'''

# A tool that returns only once the episode whose answer is "quick" has been scored (or gives
# up).
WAITING_TOOL = '''
import time
from pathlib import Path


def wait_for_quick(seconds: float) -> str:
    """Wait until the quick episode is over.

    Args:
        seconds: The most to wait.
    """
    deadline = time.monotonic() + seconds
    while not Path(__file__).with_name("quick_done").exists():
        if time.monotonic() > deadline:
            return "gave up"
        time.sleep(0.01)
    return "released"
'''

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
TURNS = [CALL, "56088"]  # what the model says: a call, then the answer the tool gave it


class ScriptedGeneration(RandomTokenGeneration):
    """Says ``turns[k]`` (then EOS) on each conversation's k-th turn, counted by the assistant
    headers in its input; ``turns`` is the script of the first key of ``scripts`` that the
    conversation's text holds (by default ``TURNS`` for every conversation). Log-probs are
    arbitrary."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]] | None = None):
        super().__init__(tokenizer)
        self.scripts = scripts or {"": TURNS}

    def generate(self, data, greedy=False, *, expected_weight_version=None):
        header = encode_texts(self.tokenizer, ["<|im_start|>assistant\n"])[0]
        prompts, samples = [], []
        for b in range(data.size):
            prompt = data["input_ids"][b, : data["input_lengths"][b]].tolist()
            turn = sum(prompt[i : i + len(header)] == header for i in range(len(prompt))) - 1
            text = self.tokenizer.decode(prompt)
            turns = next(t for key, t in self.scripts.items() if key in text)
            said = encode_texts(self.tokenizer, [turns[turn]])[0] + [self.tokenizer.eos_token_id]
            prompts.append(torch.tensor(prompt))
            samples.append((torch.tensor(said), torch.full((len(said),), -0.5)))
        return generated_output(data, prompts, samples, self.tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def tool_env(tmp_path_factory):
    """The calculator and ``wait_for_quick``, two workers: one actor for the module's tests
    (starting one costs seconds)."""
    root = tmp_path_factory.mktemp("tool_rollout")
    (root / "rewards.py").write_text(REWARDS)
    (root / "tools.py").write_text(WAITING_TOOL)
    config = ToolEnvConfig(
        tools=["calculator", {"function": f"{root}/tools.py:wait_for_quick"}],
        functions=[{"function": f"{root}/rewards.py:exact"}],
        tool_timeout_s=30,
        num_workers=2,
        num_cpus_per_worker=0,
    )
    actor = ToolEnvironment.as_actor(config)
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.mark.parametrize(
    ("template_name", "env_steps"),
    [("chatml_tools", "batched"), ("chatml_tools", "per_episode"), ("qwen2.5", "batched")],
)
def test_a_tool_call_is_run_and_the_trained_conversation_is_the_templates(
    tool_env, template_name, env_steps
):
    tools = [tool_schema(ToolSpec(function="calculator"))]
    texts = [CALL, "56088 123*456 What is calculator expression", json.dumps(tools)] * 20
    tokenizer = build_tokenizer(texts, vocab_size=600)
    template = ChatTemplate.from_config(TEMPLATES[template_name], tokenizer)
    prompt = [{"role": "user", "content": "What is 123 * 456?"}]
    tokenize_message_logs([prompt], tokenizer, template, add_generation_prompt=True, tools=[tools])
    batch = BatchedDataDict(
        message_log=[prompt],
        extra_env_info=[{"answer": "56088", "tools": tools}],
        task_name=["calc"],
    )

    result = run_rollouts(
        ScriptedGeneration(tokenizer),
        batch,
        tokenizer,
        template,
        {"calc": tool_env},
        max_seq_len=1024,
        max_turns=4,
        loop=AgentLoopConfig(env_steps=env_steps),
    )

    log = result.message_logs[0]
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    assert log[2]["content"] == "56088"  # the calculator's answer, from its worker process
    assert result.rewards.tolist() == [1.0] and result.end_reasons == ["terminated"]
    assert int(result.tool_calls[0]) == 1
    # Token for token what the template renders for this conversation with its tools.
    conversation = [{"role": m["role"], "content": m["content"]} for m in log]
    conversation[2]["tool_call_id"] = log[2]["tool_call_id"]
    rendered = template.render(conversation, tools=tools)
    ids = torch.cat([m["token_ids"] for m in log]).tolist()
    assert ids == encode_texts(tokenizer, [rendered])[0]
    # In the loss: the two sampled turns (with their EOS), nothing of the prompt or the tool.
    trained = [
        tokenizer.decode(m["token_ids"][m["token_loss_mask"].bool()].tolist())
        for m in log
        if "token_loss_mask" in m and m["token_loss_mask"].any()
    ]
    assert trained == [CALL + "<|im_end|>", "56088<|im_end|>"]


WAIT = '<tool_call>{"name": "wait_for_quick", "arguments": {"seconds": 20}}</tool_call>'


def test_an_episode_goes_on_while_another_ones_tool_runs(tool_env):
    """The loop's defaults: the slow episode's tool runs until the quick episode has played all
    its turns (two calculator calls, then its answer, scored). Stepped in batches, or one step
    at a time on the actor, or with both tool calls queued on one pool worker, the quick
    episode could not go on and the tool would give up."""
    scripts = {"slow": [WAIT, "slow"], "quick": [CALL, CALL, "quick"]}
    texts = [WAIT, CALL, "slow quick 56088 released gave up"] * 20
    tokenizer = build_tokenizer(texts, vocab_size=600)
    template = ChatTemplate.from_config(TEMPLATES["chatml_tools"], tokenizer)
    prompts = [[{"role": "user", "content": f"{name} one"}] for name in scripts]
    tokenize_message_logs(prompts, tokenizer, template, add_generation_prompt=True)
    batch = BatchedDataDict(
        message_log=prompts,
        extra_env_info=[{"answer": name} for name in scripts],
        task_name=["calc", "calc"],
    )
    result = run_rollouts(
        ScriptedGeneration(tokenizer, scripts),
        batch,
        tokenizer,
        template,
        {"calc": tool_env},
        max_seq_len=1024,
        max_turns=4,
    )
    slow, quick = result.message_logs
    assert slow[2]["role"] == "tool" and slow[2]["content"] == "released"
    assert [m["content"] for m in quick if m["role"] == "tool"] == ["56088", "56088"]
    assert result.turns.tolist() == [2, 3]
    assert result.end_reasons == ["terminated", "terminated"]
    assert result.rewards.tolist() == [1.0, 1.0]
