#!/usr/bin/env bash
# Set up a virtual environment with everything the project, its main job and its tests need.
# Usage: source scripts/install.sh   (creates and activates .venv; idempotent)
# Each step stops the script with a non-zero status when it fails (also where `set -e` does not apply, as in
# `source scripts/install.sh && ./reproduce.sh`).
_mita_install() {
    local venv=${VENV:-.venv}
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || return 1
    fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate" || return 1
    # torch and torchvision as a matching pair first, so the ranges in pyproject.toml are already satisfied.
    python -c "import torch, torchvision" 2>/dev/null || pip install -q torch==2.14.1 torchvision==0.29.1 || return 1
    pip install -q -e ".[train,dev,triton]" || return 1
}
if ! _mita_install; then
    echo "scripts/install.sh: installation failed (see the messages above)" >&2
    unset -f _mita_install
    return 1 2>/dev/null || exit 1
fi
unset -f _mita_install
