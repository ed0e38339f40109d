"""Time one function of an ONNX bundle in ONNX Runtime alone, and where its time goes per operator.

    .venv/bin/python scripts/onnx_step_profile.py BUNDLE [--function decode] [--position 200]
        [--steps 100] [--threads 2] [--profile]

The graph runs over zeroed state at a fixed position, its in-place caches bound
as the runtime binds them (runtime/onnx_device.py), so the figure is the graph's
own cost without foldline's Python around it. --profile adds ONNX Runtime's
per-node profile: time and node count per step for each operator type (the
profile's own overhead inflates the times; compare them with each other).
docs/onnx.md quotes its figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import numpy as np
import onnxruntime as ort

from foldline.contract.entry_points import INPLACE_STATE_KEY, NEXT_SUFFIX
from foldline.contract.manifest import Manifest

NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
         "tensor(int32)": np.int32, "tensor(int8)": np.int8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--function", default="decode")
    parser.add_argument("--position", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    manifest = Manifest.load(args.bundle)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.log_severity_level = 3
    options.enable_profiling = args.profile
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "profile")
    graph = manifest.root / manifest.modules["onnxruntime"].parts[args.function].file
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    inplace = set(filter(None, session.get_modelmeta().custom_metadata_map.get(INPLACE_STATE_KEY, "").split(",")))

    binding = session.io_binding()
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in spec.shape]
        if spec.name == "pos_shape":
            shape = [0, args.position]
        array = np.zeros(shape, NUMPY[spec.type])
        if spec.name in ("pos", "start_pos"):
            array[...] = args.position
        if spec.name in inplace:
            value = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(spec.name, value)
            binding.bind_ortvalue_output(spec.name + NEXT_SUFFIX, value)
        else:
            binding.bind_cpu_input(spec.name, array)
    for spec in session.get_outputs():
        if spec.name.removesuffix(NEXT_SUFFIX) not in inplace:
            binding.bind_output(spec.name)

    for _ in range(5):
        session.run_with_iobinding(binding)
    started = time.perf_counter()
    for _ in range(args.steps):
        session.run_with_iobinding(binding)
    print(f"{graph.name}: {1000 * (time.perf_counter() - started) / args.steps:.2f} ms per call "
          f"(position {args.position}, {args.threads} threads, {args.steps} calls)")
    if not args.profile:
        return
    events = json.load(open(session.end_profiling()))
    calls = args.steps + 5
    time_of, count_of = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            time_of[op] += event["dur"]
            count_of[op] += 1
    print(f"{sum(count_of.values()) / calls:.0f} nodes per call, {sum(time_of.values()) / calls / 1000:.2f} ms "
          "in them (profiled)")
    for op, micros in time_of.most_common(20):
        print(f"  {op:34s} {micros / calls / 1000:7.3f} ms  {count_of[op] / calls:6.0f} nodes")


if __name__ == "__main__":
    main()
