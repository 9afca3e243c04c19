import subprocess
import sys
from importlib.metadata import version

import rl_models


def test_installed_version_is_the_package_version():
    assert rl_models.__version__ == version("rl-models")


def test_importing_pulls_in_no_package_to_its_right():
    forbidden = ["rl_envs", "rl_algorithms"]
    code = (
        f"import sys, rl_models; print([m for m in sys.modules if m.split('.')[0] in {forbidden}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
