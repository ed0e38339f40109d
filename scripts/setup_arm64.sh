#!/usr/bin/env bash
# An aarch64 userland in .arm64/ that runs foldline's runtime under qemu-user on
# an x86-64 Debian machine: Debian's arm64 Python (unpacked, not installed), the
# aarch64 wheels of numpy, ml_dtypes and iree-base-runtime at the versions the
# venv holds, and qemu-aarch64. tests/kernels/test_aarch64.py runs aarch64 bundles with it.
# Needs root and apt (Debian); idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT=.arm64
PY=.venv/bin/python
APT=(apt-get -qq -o Acquire::Retries=3)

if ! command -v qemu-aarch64 >/dev/null 2>&1; then
  "${APT[@]}" update
  DEBIAN_FRONTEND=noninteractive "${APT[@]}" install -y --no-install-recommends qemu-user >/dev/null
fi

if [ ! -x "$ROOT/sysroot/usr/bin/python3.11" ]; then
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    dpkg --add-architecture arm64
  fi
  "${APT[@]}" update
  rm -rf "$ROOT/debs" "$ROOT/sysroot.tmp" && mkdir -p "$ROOT/debs" "$ROOT/sysroot.tmp"
  # python3.11 and the libraries its interpreter and standard library load
  (cd "$ROOT/debs" && "${APT[@]}" download \
    python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 libc6:arm64 \
    libgcc-s1:arm64 libstdc++6:arm64 zlib1g:arm64 libexpat1:arm64 libssl3:arm64 libffi8:arm64 \
    libbz2-1.0:arm64 liblzma5:arm64 libcrypt1:arm64 libuuid1:arm64 libsqlite3-0:arm64 2>/dev/null)
  for deb in "$ROOT"/debs/*.deb; do dpkg-deb -x "$deb" "$ROOT/sysroot.tmp"; done
  rm -rf "$ROOT/debs" "$ROOT/sysroot" && mv "$ROOT/sysroot.tmp" "$ROOT/sysroot"
fi

want() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
SPEC=("numpy==$(want numpy)" "ml_dtypes==$(want ml_dtypes)" "iree-base-runtime==$(want iree-base-runtime)")
if [ "$(cat "$ROOT/site.txt" 2>/dev/null)" != "${SPEC[*]}" ]; then
  rm -rf "$ROOT/site"
  "$PY" -m pip install -q --retries 10 --timeout 60 --no-deps --target "$ROOT/site" \
    --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp --only-binary=:all: "${SPEC[@]}"
  echo "${SPEC[*]}" > "$ROOT/site.txt"
fi

qemu-aarch64 -L "$ROOT/sysroot" "$ROOT/sysroot/usr/bin/python3.11" -c \
  "import sys; sys.path.insert(0, '$ROOT/site'); import numpy, iree.runtime; print('aarch64 runtime under qemu: numpy', numpy.__version__)"
