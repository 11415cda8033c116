"""The console scripts turn user mistakes into one line on stderr with exit code 2; exit code 1 is kept
for a failed correctness check (``offload-demo`` outside tolerance); bugs keep their traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from offload_passes import demo
from offload_passes.tools import capacity_plan, inspect_dump


def _one_line_error(capsys, prog: str, contains: str) -> None:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"{prog}: error: "), err
    assert contains in lines[0], err
    assert "Traceback" not in err


DEMO_BAD = [
    (["--config", "nope"], "config preset 'nope': unknown"),
    (["--pool-size", "1000"], "option pool_size must be a multiple of 16"),
    (["--next-n", "5"], "--next-n must be in [0, 3]"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--dump-dir", "/proc/offload_passes_nope"], "--dump-dir '/proc/offload_passes_nope' is not a writable directory"),
]


@pytest.mark.parametrize("argv,msg", DEMO_BAD, ids=[a[0] for a, _ in DEMO_BAD])
def test_demo_bad_input_exits_2_with_one_line(argv, msg, capsys):
    assert demo.main(argv + ["--steps", "1"] if "--steps" not in argv else argv) == 2
    _one_line_error(capsys, "offload-demo", msg)


def test_demo_yaml_typo_and_broken_yaml(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model_confg:\n  num_hidden_layers: 2\n")
    assert demo.main(["--config", str(typo), "--steps", "1"]) == 2
    _one_line_error(capsys, "offload-demo", "model_confg")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    assert demo.main(["--config", str(broken), "--steps", "1"]) == 2
    _one_line_error(capsys, "offload-demo", "while parsing a flow sequence")


def test_demo_exit_1_only_for_a_failed_correctness_check(monkeypatch, capsys):
    fake = {"within_tolerance": False}
    monkeypatch.setattr(demo, "run", lambda *a, **k: fake)
    monkeypatch.setattr(demo, "_summary", lambda o: "summary")
    assert demo.main(["--steps", "1"]) == 1
    fake["within_tolerance"] = True
    assert demo.main(["--steps", "1"]) == 0


def test_demo_bug_keeps_its_traceback(monkeypatch):
    """Only user mistakes are shortened: an internal error (not ValueError/OSError) propagates."""
    def boom(*a, **k):
        raise KeyError("internal")

    monkeypatch.setattr(demo, "run", boom)
    with pytest.raises(KeyError, match="internal"):
        demo.main(["--steps", "1"])


PLAN_BAD = [
    (["--hbm-gib", "nan"], "--hbm-gib must be a finite positive number, got nan"),
    (["--hbm-gib", "inf"], "--hbm-gib must be a finite positive number, got inf"),
    (["--host-gib", "-1"], "--host-gib must be a finite positive number, got -1.0"),
    (["--devices", "0"], "--devices must be >= 1, got 0"),
    (["--pool-size", "1000"], "--pool-size must be a positive multiple of 16, got 1000"),
    (["--config", "nope"], "--config 'nope'"),
]


@pytest.mark.parametrize("argv,msg", PLAN_BAD, ids=[" ".join(a) for a, _ in PLAN_BAD])
def test_plan_bad_input_exits_2_with_one_line(argv, msg, capsys):
    assert capacity_plan.main(argv) == 2
    _one_line_error(capsys, "offload-plan", msg)


def test_inspect_unwritable_picture_path_exits_2(tmp_path, capsys):
    from fake_dump import write_fake_dump

    d = write_fake_dump(tmp_path / "dump")
    assert inspect_dump.main([str(d), "--svg", "/proc/offload_passes_nope/x.svg"]) == 2
    _one_line_error(capsys, "offload-inspect", "--svg '/proc/offload_passes_nope/x.svg': folder")
    assert inspect_dump.main([str(tmp_path / "missing")]) == 2
    _one_line_error(capsys, "offload-inspect", "does not exist")


def test_console_script_prints_no_traceback():
    """The installed entry point, in a fresh process: one line, exit 2."""
    exe = Path(sys.executable).with_name("offload-demo")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "offload_passes.demo"]
    r = subprocess.run(cmd + ["--config", "nope", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("offload-demo: error: config preset 'nope'")
