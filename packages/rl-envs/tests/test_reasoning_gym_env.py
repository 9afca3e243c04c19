import pytest
import reasoning_gym

from rl_envs.reasoning_gym_env import ReasoningGymEnvConfig, ReasoningGymEnvironment

pytestmark = pytest.mark.ray


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "question"}, {"role": "assistant", "content": response}]


def test_scored_by_the_tasks_own_scorer_from_entry_or_name_and_seed(ray_session):
    env = ReasoningGymEnvironment(ReasoningGymEnvConfig(num_workers=2, num_cpus_per_worker=1))
    try:
        legs = reasoning_gym.create_dataset("leg_counting", seed=3, size=5)[2]
        arith = reasoning_gym.create_dataset("basic_arithmetic", seed=7, size=10)[4]
        rebuilt = {"dataset": "basic_arithmetic", "seed": 7, "size": 10, "index": 4}
        cases = [
            (f"<answer>{legs['answer']}</answer>", {"entry": legs}, 1.0),  # right, from the entry
            (f"<answer>{int(legs['answer']) + 1}</answer>", {"entry": legs}, 0.0),  # wrong
            (f"{legs['answer']}", {"entry": legs}, 0.0),  # malformed: no answer tag
            (f"work... <answer>{arith['answer']}</answer>", rebuilt, 1.0),  # right, rebuilt
            ("<answer>banana</answer>", rebuilt, 0.0),  # wrong, rebuilt
            ("<answer>1</answer>", {"dataset": "basic_arithmetic"}, 0.0),  # no way to rebuild
            (
                "<answer>1</answer>",
                {"dataset": "no_such_task", "seed": 1, "size": 1, "index": 0},
                0.0,
            ),
        ]
        out = env.step([conversation(r) for r, _, _ in cases], [m for _, m, _ in cases])
        assert out.rewards.tolist() == [r for _, _, r in cases]
        assert out.answers[0] == legs["answer"]
        _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
        assert metrics["verifier_errors"] == 2
    finally:
        env.shutdown()
