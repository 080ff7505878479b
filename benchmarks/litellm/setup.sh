#!/usr/bin/env bash
# Install the LiteLLM proxy (the Python incumbent in the benchmark) into its own venv.
#
# Why a separate venv: LiteLLM is a peer we measure, never a dependency of this project,
# and it is kept out of CI. 1.108.7 is the newest release that resolves on these machines.
# Takes about two minutes. Idempotent: re-running on an existing venv only re-checks pins.
#
#   benchmarks/litellm/setup.sh            # venv at $LITELLM_VENV (default below)
set -euo pipefail
VENV="${LITELLM_VENV:-/tmp/llm-latency-proxy-bench/venv-litellm}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "litellm[proxy]==1.108.7" prometheus-client
LITELLM_TELEMETRY=False LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "import litellm.proxy.proxy_server" || { echo "LiteLLM proxy import failed" >&2; exit 1; }
echo "LiteLLM installed in $VENV"
