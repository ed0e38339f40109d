"""Bad input to the runtime gets a clear error naming the problem."""

from __future__ import annotations

import shutil

import pytest

from foldline.runtime import BundleError, ContextFullError, Model


@pytest.mark.slow
def test_runtime_input_errors(bundle_factory):
    model = Model.load(bundle_factory("llama-tiny"))
    session = model.session()
    with pytest.raises(ValueError, match=f"token id {model.vocab_size} is out of range"):
        session.prefill([1, model.vocab_size])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        session.decode(-1)
    assert session.position == 0, "a rejected call changes nothing"
    with pytest.raises(ContextFullError, match="context full"):
        session.prefill([1] * (model.max_context + 1))
    session.prefill([1] * model.max_context)
    with pytest.raises(ContextFullError):
        session.decode(1)


@pytest.mark.slow
def test_bundle_missing_file(bundle_factory, tmp_path):
    src = bundle_factory("llama-tiny")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "params.irpa").unlink()
    with pytest.raises(BundleError, match="missing params.irpa"):
        Model.load(broken)
    with pytest.raises(BundleError, match="does not exist"):
        Model.load(tmp_path / "nothing-here")
