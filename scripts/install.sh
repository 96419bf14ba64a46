#!/usr/bin/env bash
# Set up a virtual environment with everything the project, its main job and its tests need.
# Usage: source scripts/install.sh   (creates and activates .venv; idempotent)
set -e
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# torch and torchvision as a matching pair first, so the ranges in pyproject.toml are already satisfied.
python -c "import torch, torchvision" 2>/dev/null || pip install -q torch==2.14.1 torchvision==0.29.1
pip install -q -e ".[train,dev,triton]"
set +e
