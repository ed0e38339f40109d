"""The command line itself: --version, help and defaults, counts, unknown models, extras, and safe `compile -o`."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from foldline.errors import FoldlineError
from foldline.tools.cli import COMMANDS, build_parser, main

# The commands whose options this file checks (generate and chat are checked with the runtime's tests).
CHECKED_COMMANDS = ("compile", "verify", "plan", "passes", "bench", "inspect", "cache")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def _tree(folder: Path) -> dict[str, str]:
    """Every file under folder (relative path -> sha256)."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def _fake_bundle(path: Path) -> Path:
    """A directory that says it is a foldline bundle (its manifest's format) and a file of it."""
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format": "foldline-bundle", "format_version": 5}))
    (path / "params.irpa").write_bytes(b"old weights")
    return path


def test_version_is_the_installed_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"foldline {metadata.version('foldline')}\n"


@pytest.mark.parametrize("command", CHECKED_COMMANDS)
def test_every_option_has_help_that_shows_its_default(command):
    parser = _subcommands()[command]
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction) or action.required:
            continue
        assert action.help, f"foldline {command} {action.option_strings[0]} has no help"
        assert "default" in action.help.lower(), f"foldline {command} {action.option_strings[0]}: no default shown"


@pytest.mark.parametrize("argv", [
    ["compile", "llama-tiny", "-o", "x", "--max-context", "0"],
    ["compile", "llama-tiny", "-o", "x", "--batch", "0"],
    ["compile", "llama-tiny", "-o", "x", "--devices", "-1"],
    ["compile", "llama-tiny", "-o", "x", "--group", "0"],
    ["compile", "llama-tiny", "-o", "x", "--chunk", "-16"],
    ["bench", "b", "--rounds", "0"],
    ["bench", "b", "--prompt-len", "0"],
    ["bench", "b", "--new-tokens", "-5"],
    ["plan", "llama-tiny", "--context", "0"],
    ["plan", "llama-tiny", "--batch", "-1"],
    ["verify", "llama-tiny", "--steps", "0"],
])
def test_counts_below_one_are_refused(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}: must be a positive integer, got {int(argv[-1])}" in err


def test_a_count_that_is_no_integer_is_refused(capsys):
    assert main(["bench", "b", "--rounds", "three"]) == 2
    assert "argument --rounds: expected a positive integer, got 'three'" in capsys.readouterr().err


def test_unknown_model_lists_presets_and_shipped_models(tmp_path, capsys):
    from foldline.frontend.arch import PRESETS
    from foldline.frontend.shipped import SHIPPED

    assert main(["compile", "nosuchmodel", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "unknown model 'nosuchmodel'" in err
    for name in [*PRESETS, *SHIPPED]:
        assert name in err
    assert "ripple-65b (plan only)" in err and "llama-tiny (plan only)" not in err
    assert list(tmp_path.iterdir()) == []  # no bundle, no staging directory


def test_a_planning_only_config_is_not_compiled(tmp_path, capsys):
    assert main(["compile", "ripple-65b", "-o", str(tmp_path / "out")]) == 2
    assert "planning-only config" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_passes_lists_every_registered_pass(capsys):
    from foldline.passes.manager import available_passes, default_pipeline

    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name, registered in available_passes().items():
        assert f"{name}  " in out and registered.description in out
    assert f"default pipeline: {' -> '.join(default_pipeline())}" in out


def test_the_parser_imports_no_compiler_or_server_module():
    probe = ("import sys; from foldline.tools.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'rich', 'gguf', 'iree.compiler', 'starlette', 'jinja2') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_command_module_that_is_not_installed_is_left_out(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "later", "no_such_cmd")
    assert "later" not in _subcommands()
    assert "chat" in COMMANDS
    assert main(["--help"]) == 0 and "inspect" in capsys.readouterr().out


@pytest.mark.parametrize("argv,blocked,extra", [
    (["compile", "llama-tiny", "-o", "{tmp}/out"], "torch", "compiler"),
    (["compile", "llama-tiny", "-o", "{tmp}/out"], "rich", "compiler"),
    (["verify", "llama-tiny"], "torch", "compiler"),
    (["plan", "llama-tiny"], "torch", "compiler"),
    (["serve", "{tmp}/bundle"], "starlette", "serve"),
])
def test_a_missing_extra_is_named_in_one_line(tmp_path, monkeypatch, capsys, argv, blocked, extra):
    monkeypatch.setitem(sys.modules, blocked, None)  # as if it were not installed
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"pip install 'foldline[{extra}]'" in err and blocked in err
    assert list(tmp_path.iterdir()) == []


# ---- compile -o: never over other files, never half a bundle --------------------------------------


def test_compile_refuses_a_directory_that_is_not_a_bundle(tmp_path, capsys):
    out = tmp_path / "docs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    for force in ([], ["--force"]):
        assert main(["compile", "llama-tiny", "-o", str(out), *force]) == 2
        assert "is not empty and holds no foldline bundle" in capsys.readouterr().err
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


def test_compile_refuses_a_file_as_output(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["compile", "llama-tiny", "-o", str(tmp_path / "f"), "--force"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "x"


def test_compile_refuses_a_symbolic_link_as_output(tmp_path, capsys):
    target = _fake_bundle(tmp_path / "bundle")
    (tmp_path / "link").symlink_to(target)
    before = _tree(target)
    assert main(["compile", "llama-tiny", "-o", str(tmp_path / "link"), "--force"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert (tmp_path / "link").is_symlink() and _tree(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "link"]


def test_compile_refuses_an_existing_bundle_without_force(tmp_path, capsys):
    old = _fake_bundle(tmp_path / "bundle")
    before = _tree(tmp_path)
    assert main(["compile", "llama-tiny", "-o", str(old)]) == 2
    assert "already holds a bundle; --force replaces it" in capsys.readouterr().err
    assert _tree(tmp_path) == before and [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_a_failed_compile_leaves_the_old_bundle(tmp_path, monkeypatch, capsys):
    """A compile that fails after writing part of its bundle: the old bundle stays whole, no partial file
    and no staging directory remain."""
    from foldline.backends import build

    def fail_halfway(loaded, out_dir, options, progress):
        (Path(out_dir) / "params.irpa").write_bytes(b"half written")
        raise FoldlineError("iree-compile failed")

    monkeypatch.setattr(build, "_compile", fail_halfway)
    old = _fake_bundle(tmp_path / "bundle")
    before = _tree(tmp_path)
    assert main(["compile", "llama-tiny", "--no-cache", "--force", "-o", str(old)]) == 2
    assert "iree-compile failed" in capsys.readouterr().err
    assert _tree(tmp_path) == before and [p.name for p in tmp_path.iterdir()] == ["bundle"]


@pytest.mark.slow
def test_force_replaces_a_bundle_whole(tmp_path, monkeypatch, capsys, bundle_factory):
    """--force swaps the new bundle in: none of the old bundle's files (or others beside them) remain.
    The IREE stages are replaced by copying the session's llama-tiny bundle in (no compile of its own)."""
    import shutil

    from foldline.backends import build
    from foldline.contract.manifest import Manifest

    compiled = bundle_factory("llama-tiny")

    def copy_compiled(loaded, out_dir, options, progress):
        shutil.copytree(compiled, out_dir, dirs_exist_ok=True)
        progress(f"bundle written to {out_dir}")
        return Path(out_dir)

    monkeypatch.setattr(build, "_compile", copy_compiled)
    old = _fake_bundle(tmp_path / "bundle")
    (old / "stray.txt").write_text("left by someone")
    (old / "model.cpu-old.vmfb").write_bytes(b"an old module")
    assert main(["compile", "llama-tiny", "--no-cache", "--force", "-o", str(old)]) == 0
    assert f"bundle written to {old}\n" in capsys.readouterr().err  # the output, not its staging copy
    assert _tree(old) == _tree(compiled)
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]
    Manifest.load(old).verify_params()


def test_serve_defaults_in_the_parser_are_the_servers():
    """The parser spells serve's defaults without importing the serve extra: they must stay the server's."""
    pytest.importorskip("starlette")
    from foldline.server import protocol, served
    from foldline.tools import serve_cmd

    assert serve_cmd.DEFAULT_MAX_STOP == protocol.DEFAULT_MAX_STOP == served.ServeOptions().max_stop
    assert serve_cmd.DEFAULT_CHECKPOINTS == served.DEFAULT_CHECKPOINTS == served.ServeOptions().checkpoints


def test_a_chunk_longer_than_the_context_is_refused_and_an_odd_context_exports(tmp_path, capsys):
    """--chunk beyond --max-context is named in one line (exit 2) and writes nothing; the default chunk
    shrinks to a short context, and an odd one (a KV tile of one slot) still traces decode's position."""
    out = tmp_path / "out"
    assert main(["compile", "llama-tiny", "--max-context", "20", "--chunk", "32", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--chunk 32 is longer than the context (20 tokens)" in err and "Traceback" not in err
    assert not err.startswith("\n") and "\n\n" not in err, "no blank line left by a progress display that never drew"
    assert not out.exists() and list(tmp_path.iterdir()) == []

    from foldline.frontend.export import export_entry_point
    from foldline.frontend.sources import load_model

    model = load_model("llama-tiny", max_context=7).module
    entry = export_entry_point(model, "decode")
    assert entry.program is not None
