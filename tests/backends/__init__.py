"""Tests of backends/: targets, lowering, the compile cache, IREE and ONNX bundles against eager."""
