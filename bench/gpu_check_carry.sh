#!/usr/bin/env bash
# Prepare what bench/gpu_check.py needs on a GPU machine that has Python 3.12 with its own CUDA
# torch and transformers (and their dependencies) but no package index: the few small wheels our
# packages import besides those, unpacked into .gpu_deps/ (git-ignored) at the lock's versions.
# The machine gets .gpu_deps/ with the working tree (64 MiB at most in all); nothing else of ours
# has to be installed there: the packages' sources go on PYTHONPATH.
#
#   bench/gpu_check_carry.sh          # here, once; prints the carry's size and the command to run
#
# tests/test_gpu_check.py holds this list against what gpu_check.py's imports really load.
set -euo pipefail
cd "$(dirname "$0")/.."

# Imported by rl_distributed/rl_models on gpu_check's path and brought by neither torch nor
# transformers: pydantic (configs), omegaconf and hydra-core (rl_distributed.config), and theirs.
# typing-extensions comes with torch too, but pydantic needs a recent one.
CARRY=(
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    omegaconf antlr4-python3-runtime hydra-core attrs
)

pins=$(uv run --locked python -c '
import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${CARRY[@]}")

rm -rf .gpu_deps
# shellcheck disable=SC2086
uv pip install --quiet --target .gpu_deps --python-version 3.12 \
    --python-platform x86_64-manylinux_2_28 --no-deps $pins

echo "carry: .gpu_deps/ ($(du -sh .gpu_deps | cut -f1)) holds $pins"
echo "on the GPU machine, from the repository root:"
echo "  PYTHONPATH=.gpu_deps:packages/rl-distributed/src:packages/rl-data/src:packages/rl-models/src \\"
echo "      python bench/gpu_check.py"
