#!/usr/bin/env bash
# The 1P1D stack on one machine: S3 (SeaweedFS), one prefill engine and one decode engine (vLLM on
# CPU, the tiny test Llama with its tokenizer, configs/pe.json and configs/de.json) and dualpath-router
# in front. A streaming chat through the official openai client (examples/chat_client.py; random
# weights, so the text is gibberish), then two agents replay a multi-turn session. Prints per turn
# the read side and hit tokens (and the agents' times), and per side the bytes read from the store.
# Extra arguments go to the driver (--chat-turns, --turns, --agents, ...).
# The driver makes a random API key and cluster key per run and hands them to the engines and the
# router in their environment (VLLM_API_KEY, DUALPATH_CLUSTER_KEY, DUALPATH_ENGINE_API_KEY).
#
# Everything is started by the Python driver, which stops it by the PIDs it holds; the trap makes
# Ctrl-C or a kill of this script reach the driver, so nothing is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# The driver uses the checkout's dev scaffolding (dualpath_dev/), which is not installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" examples/disagg_demo.py "$@" &
driver=$!
trap 'kill -TERM "$driver" 2>/dev/null || true; wait "$driver" 2>/dev/null || true' INT TERM EXIT
wait "$driver"
