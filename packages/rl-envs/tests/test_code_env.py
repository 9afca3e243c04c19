import pytest

from rl_envs.code import sandbox
from rl_envs.code.env import CodeEnvConfig, CodeEnvironment
from rl_envs.code.sandbox import SandboxLimits, SandboxUnavailableError
from rl_envs.verifiers import extract_code

TESTS = [
    {"function": "square", "args": [2], "expected": 4},
    {"function": "square", "args": [-3], "expected": 9},
    {"function": "square", "args": [0], "expected": 0},
]
LIMITS = SandboxLimits(cpu_time_s=1, case_time_s=2, wall_time_s=5)


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "write square"}, {"role": "assistant", "content": response}]


def test_extract_code_takes_the_last_fenced_block():
    text = "First try:\n```python\nx = 1\n```\nBetter:\n```python\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"


def test_config_needs_a_timeout_beyond_the_sandbox_wall_time():
    with pytest.raises(ValueError, match="must exceed"):
        CodeEnvConfig(timeout_s=5, sandbox=SandboxLimits(wall_time_s=10))


def test_without_isolation_the_environment_refuses_at_setup(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.find_isolation.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
            CodeEnvironment(CodeEnvConfig(sandbox=LIMITS, timeout_s=10))
    finally:
        sandbox.find_isolation.cache_clear()


@pytest.mark.ray
def test_rewards_are_fractions_of_tests_passed(ray_session):
    cfg = CodeEnvConfig(num_workers=2, num_cpus_per_worker=1, timeout_s=10, sandbox=LIMITS)
    env = CodeEnvironment(cfg)
    try:
        responses = [
            "```python\ndef square(x):\n    return x * x\n```",  # right
            "```python\ndef square(x):\n    return 2 * x\n```",  # wrong, yet right for 2 and 0
            "```python\ndef square(x) return\n```",  # malformed
            "```python\nwhile True:\n    pass\n```",  # hangs: stopped by the sandbox
            "```python\ndef square(x):\n    return float(x * x)\n```",  # 4.0 is not 4
        ]
        n = len(responses)
        out = env.step([conversation(r) for r in responses], [{"tests": TESTS}] * n)
        assert out.rewards.tolist() == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0])
        assert out.answers[0] == "3/3 tests passed"
        assert all(m["sandbox_isolated"] is True for m in out.metadata)
        stdio = [{"stdin": "3\n", "stdout": "9"}, {"stdin": "-2\n", "stdout": "4\n"}]
        bad = env.step(
            [conversation("print(int(input()) ** 2)")] * 3,
            [{"tests": stdio}, {"tests": []}, {"tests": ["assert square(2) == 4"]}],
        )
        assert bad.rewards.tolist() == [1.0, 0.0, 0.0]
        _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
        assert metrics["accuracy"] == pytest.approx(0.2)
        assert metrics["verifier_errors"] == 2  # no tests; assert-style tests are refused
    finally:
        env.shutdown()
