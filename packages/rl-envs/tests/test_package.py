import subprocess
import sys


def test_importing_pulls_in_no_package_to_its_right():
    forbidden = ["rl_models", "rl_algorithms"]
    code = f"import sys, rl_envs; print([m for m in sys.modules if m.split('.')[0] in {forbidden}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
