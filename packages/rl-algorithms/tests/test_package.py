import subprocess
import sys
from importlib.metadata import version

import rl_algorithms


def test_installed_version_is_the_package_version():
    assert rl_algorithms.__version__ == version("rl-algorithms")


def test_importing_pulls_in_no_package_to_its_right():
    forbidden = []
    code = f"import sys, rl_algorithms; print([m for m in sys.modules if m.split('.')[0] in {forbidden}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
