#!/usr/bin/env bash
# Create the CPU PyTorch virtual environment that benches/pytorch/train_gpt.py runs in.
#
#   bash benches/pytorch/setup.sh        # prints the venv's python on the last line
#
# Where: ${WILDFIRE_TORCH_VENV:-$HOME/.cache/wildfire-torch-venv}. Idempotent: a venv that already
# imports torch is reused. torch comes from PyTorch's CPU wheel index when that host is reachable,
# else from PyPI (whose Linux wheel also pulls the CUDA libraries: larger, slower to install, same
# CPU kernels). numpy for the data, tiktoken optionally (train_gpt.py reads Wildfire's GPT-2 token
# cache first; tiktoken needs to download its BPE table, which may not be reachable).
set -euo pipefail

VENV="${WILDFIRE_TORCH_VENV:-$HOME/.cache/wildfire-torch-venv}"
PY="$VENV/bin/python"

if [[ -x "$PY" ]] && "$PY" -c 'import torch, numpy' 2>/dev/null; then
    echo "reusing $VENV (torch $("$PY" -c 'import torch; print(torch.__version__)'))" >&2
    echo "$PY"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
if ! "$PY" -m pip install --timeout 15 --retries 1 torch --index-url https://download.pytorch.org/whl/cpu; then
    echo "download.pytorch.org unreachable: installing torch from PyPI (pulls CUDA libraries)" >&2
    "$PY" -m pip install torch
fi
"$PY" -m pip install numpy
"$PY" -m pip install tiktoken || echo "tiktoken not installed (optional)" >&2

"$PY" -c 'import torch; print("torch", torch.__version__, "threads", torch.get_num_threads())' >&2
echo "$PY"
