import pytest

from rl_envs.code.env import CodeEnvConfig, CodeEnvironment
from rl_envs.code.sandbox import SandboxLimits
from rl_envs.verifiers import extract_code

pytestmark = pytest.mark.ray

TESTS = ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 0"]


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "write square"}, {"role": "assistant", "content": response}]


def test_extract_code_takes_the_last_fenced_block():
    text = "First try:\n```python\nx = 1\n```\nBetter:\n```python\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"


def test_config_needs_a_timeout_beyond_the_sandbox_wall_time():
    with pytest.raises(ValueError, match="must exceed"):
        CodeEnvConfig(timeout_s=5, sandbox=SandboxLimits(wall_time_s=10))


def test_rewards_are_fractions_of_tests_passed(ray_session):
    cfg = CodeEnvConfig(
        num_workers=2,
        num_cpus_per_worker=1,
        timeout_s=10,
        sandbox=SandboxLimits(cpu_time_s=1, wall_time_s=3),
    )
    env = CodeEnvironment(cfg)
    try:
        responses = [
            "```python\ndef square(x):\n    return x * x\n```",  # right
            "```python\ndef square(x):\n    return 2 * x\n```",  # wrong, yet right for 2 and 0
            "```python\ndef square(x) return\n```",  # malformed
            "```python\nwhile True:\n    pass\n```",  # hangs: stopped by the sandbox
        ]
        out = env.step([conversation(r) for r in responses], [{"tests": TESTS}] * 4)
        assert out.rewards.tolist() == pytest.approx([1.0, 2 / 3, 0.0, 0.0])
        assert out.answers[0] == "3/3 tests passed"
        bad = env.step([conversation("x")], [{"tests": []}])
        assert bad.rewards.tolist() == [0.0]
        _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
        assert metrics["accuracy"] == pytest.approx(0.25)
        assert metrics["verifier_errors"] == 1  # the sample without tests
    finally:
        env.shutdown()
