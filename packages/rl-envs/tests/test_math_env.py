import pytest
import ray
import torch

from rl_envs.math_env import MathEnvConfig, MathEnvironment
from rl_envs.verifiers import score_math

pytestmark = pytest.mark.ray


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "solve it"}, {"role": "assistant", "content": response}]


class ActorEnv:
    """The environment as a run uses it, a Ray actor, with in-process-looking calls."""

    def __init__(self, cfg: MathEnvConfig) -> None:
        self.actor = MathEnvironment.as_actor(cfg)

    def __getattr__(self, name):
        return lambda *args: ray.get(getattr(self.actor, name).remote(*args))


@pytest.fixture(scope="module")
def env(ray_session):
    e = ActorEnv(MathEnvConfig(num_workers=2, num_cpus_per_worker=1, pass_at_k=[1, 2]))
    yield e
    e.shutdown()
    ray.kill(e.actor)


CASES = [  # (response, ground truth, reward)
    (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),  # LaTeX vs plain
    ("The final answer is 1/2", r"\frac{1}{2}", 1.0),  # plain vs LaTeX
    (r"$\boxed{2\sqrt{2}}$", r"\sqrt{8}", 1.0),  # equal after simplification
    (r"\boxed{3}", "4", 0.0),  # wrong
    ("I am not sure.", "4", 0.0),  # no answer at all
    (r"\boxed{\frac{1}{", "4", 0.0),  # malformed LaTeX
    ("28 + 99 = 127", "127", 1.0),  # the working, then the value
    ("The answer is 12 + 15", "27", 0.0),  # the sum restated, not worked out
]


def test_right_wrong_and_malformed_answers(env):
    logs = [conversation(r) for r, _, _ in CASES]
    out = env.step(logs, [{"ground_truth": g} for _, g, _ in CASES])
    assert out.rewards.tolist() == [r for _, _, r in CASES]
    assert out.rewards.dtype == torch.float32
    assert out.terminateds.all()
    assert out.answers[0] == r"\frac{1}{2}"
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert metrics["accuracy"] == pytest.approx(4 / 8)
    assert metrics["timeouts"] == 0 and metrics["verifier_errors"] == 0


# Where the ground truth is a number, the answer must be one as written. Each case marked
# "rule" is one math-verify alone scores 1.0.
NUMBER_FORM = [  # (response, ground truth, reward)
    ("The answer is 12 + 15", "27", 0.0),  # rule: the sum restated
    (r"So it is $\boxed{12 + 15}$", "27", 0.0),  # rule: the same, through the LaTeX parser
    ("The answer is 12 * 15.", "180", 0.0),  # rule: a product
    (r"\boxed{10^{3}}", "1000", 0.0),  # rule: a power
    ("The answer is 84/4", "21", 0.0),  # rule: a fraction not in lowest terms
    ("28 + 99 = 127", "127", 1.0),  # the working, then the value
    (r"$28 + 99 = 127$", "127", 1.0),  # an equation: its last right side is the answer
    (r"\boxed{x = 5}", "5", 1.0),
    ("The final answer is 3/4", "0.75", 1.0),  # a fraction in lowest terms
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    ("50%", "50", 1.0),  # a percentage
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),  # the ground truth is an expression: no rule
]


@pytest.mark.parametrize(("response", "truth", "reward"), NUMBER_FORM)
def test_an_answer_to_a_number_must_be_written_as_a_number(response, truth, reward):
    assert score_math(response, truth)[0] == reward


def test_missing_ground_truth_column_is_refused_naming_it(env):
    """A row without the answer column used to score 0 every time, silently."""
    with pytest.raises(
        ValueError, match=r"sample 1 of the batch has no 'ground_truth'.*\['answer'\]"
    ):
        env.step([conversation(r"\boxed{1}")] * 2, [{"ground_truth": "1"}, {"answer": "1"}])


def test_empty_ground_truth_is_a_verifier_error_not_a_crash(env):
    out = env.step([conversation(r"\boxed{1}")] * 2, [{"ground_truth": "1"}, {"ground_truth": ""}])
    assert out.rewards.tolist() == [1.0, 0.0]
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert metrics["verifier_errors"] == 1 and metrics["samples"] == 2


def test_pass_at_k_over_samples_of_one_prompt(env):
    responses = [r"\boxed{7}", r"\boxed{6}", r"\boxed{7}", r"\boxed{1}"]
    out = env.step([conversation(r) for r in responses], [{"ground_truth": "7"}] * 4)
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards, "group_ids": [0] * 4})
    assert metrics["pass@1"] == pytest.approx(0.5)
    assert metrics["pass@2"] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)


def test_a_verification_past_its_timeout_costs_a_reward_not_the_step(ray_session):
    env = MathEnvironment(MathEnvConfig(num_workers=1, num_cpus_per_worker=1, timeout_s=0.05))
    try:
        # 0.05 s is far too short for sympy to simplify this: every sample times out.
        hard = r"\boxed{\int_0^1 x^{37} e^{x} \sin(x)\, dx}"
        out = env.step([conversation(hard)] * 2, [{"ground_truth": "1"}] * 2)
        assert out.rewards.tolist() == [0.0, 0.0]
        _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
        assert metrics["timeouts"] == 2
    finally:
        env.shutdown()
