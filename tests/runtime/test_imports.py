"""The runtime is what an edge app ships: it must never import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_runtime_import_does_not_pull_torch():
    code = "import sys, foldline.runtime as r; r.Sampler(); assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_runtime_generate_does_not_pull_torch(bundle_factory):
    bundle = bundle_factory("llama-tiny")
    code = (
        "import sys\n"
        "from foldline.runtime import Model\n"
        f"m = Model.load({str(bundle)!r})\n"
        "ids = list(m.session().generate_ids([1, 2, 3], 5))\n"
        "assert len(ids) == 5\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sampler_greedy_and_seeded():
    import numpy as np

    from foldline.runtime import Sampler

    logits = np.array([0.1, 3.0, 2.9, -1.0])
    assert Sampler()(logits) == 1
    a = [Sampler(temperature=1.0, top_k=3, seed=7)(logits) for _ in range(5)]
    b = [Sampler(temperature=1.0, top_k=3, seed=7)(logits) for _ in range(5)]
    assert a == b
    draws = {Sampler(temperature=1.0, top_k=2, seed=s)(logits) for s in range(50)}
    assert draws == {1, 2}, "top-k 2 keeps exactly the two best ids"
    draws = {Sampler(temperature=1.0, top_p=0.01, seed=s)(logits) for s in range(20)}
    assert draws == {1}, "a tiny top-p keeps only the best id"
    with pytest.raises(ValueError):
        Sampler(temperature=-1)
