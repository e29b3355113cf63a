#!/usr/bin/env bash
# The whole CI job: a fresh venv, the install the README documents, then every gate.
# `.ci/run` calls this; run it locally the same way: `bash ci/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="$(mktemp -d)/venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "== install (fresh venv at $venv)"
pip install -q torch==2.13.0          # first: a bare range could pull a multi-GB CUDA build
pip install -q -e '.[hf,dev]'
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

echo "== mypy --strict hyperrecipe"
mypy --strict hyperrecipe

if [ -f hyperrecipe/lint/cli.py ]; then
  echo "== hyperrecipe lint (the forward-installation gate)"
  hyperrecipe lint
fi

echo "== README example: compile a shipped recipe"
hyperrecipe compile recipes/llama.yaml --model hf:llama \
  --model-config recipes/models/tiny-llama.json --mesh tp=2 -o "$(dirname "$venv")/plan.json"

echo "== tests (the README's test command)"
python -m pytest -q
