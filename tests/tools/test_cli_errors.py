"""The console scripts turn user mistakes into one line on stderr with exit code 2; exit code 1 is kept
for a failed correctness check (``offload-demo`` outside tolerance); bugs keep their traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_passes.apps import demo
from offload_passes.tools import capacity_plan, inspect_dump


def _one_line_error(capsys, prog: str, contains: str) -> None:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"{prog}: error: "), err
    assert contains in lines[0], err
    assert "Traceback" not in err


NCPU = os.cpu_count() or 1
DEMO_BAD = [
    # an unknown name lists the presets of the model it was given to
    (["--config", "nope"], "--config 'nope': no such preset and not a yaml path (--model glm presets: glm-5.2-78l, "
                           "glm-5.2-78l-w8a8, small, tiny, tiny-w8a8; a path ends in .yaml or .yml)"),
    (["--model", "hf", "--config", "nope"], "--config 'nope': no such preset and not a yaml path (--model hf "
                                            "presets: hf-axk2, hf-deepseek-v32, "),
    (["--pool-size", "1000"], "option pool_size must be a multiple of 16"),
    (["--next-n", "5"], "--next-n must be in [0, 3]"),
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--steps", "nan"], "--steps must be an integer >= 1, got 'nan'"),
    (["--dump-dir", "/proc/offload_passes_nope"], "--dump-dir '/proc/offload_passes_nope' is not a writable directory"),
    # torch's thread pool segfaulted on 100000 threads: range-checked against os.cpu_count()
    (["--threads", "100000"], f"--threads must be in [0, {NCPU}] (0 = torch default; at most "
                              f"os.cpu_count() = {NCPU}), got 100000"),
    (["--threads", str(NCPU + 1)], f"--threads must be in [0, {NCPU}]"),
    (["--threads", "-1"], "got -1"),
    # a recipe-form preset given to the HF model was a TypeError traceback from HfRunner
    (["--model", "hf", "--config", "tiny"], "--config 'tiny' is a recipe-form preset (--model glm); --model hf "
                                            "takes ['hf-axk2', 'hf-deepseek-v32', 'hf-deepseek-v4', 'hf-doge', 'hf-dots3-note', "
                                            "'hf-glm5-attn', 'hf-glm5-next', 'hf-hy-v4', 'hf-hy-v4-vl', 'hf-kolibri1-1', "
                                            "'hf-minimax-m3', 'hf-mistral-large4', 'hf-qwen4-exp', 'hf-tiny'] or an HF yaml"),
    (["--model", "hf", "--config", "tiny-w8a8"], "--config 'tiny-w8a8' is a recipe-form preset"),
    (["--config", "hf-tiny"], "--config 'hf-tiny' is a Hugging Face preset: use it with --model hf"),
    # argparse's own errors are one line too (no usage block)
    (["--threads", "many"], "--threads must be an integer, got 'many'"),
    (["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
]


@pytest.mark.parametrize("argv,msg", DEMO_BAD, ids=[" ".join(a) for a, _ in DEMO_BAD])
def test_demo_bad_input_exits_2_with_one_line(argv, msg, capsys):
    try:
        rc = demo.main(argv + ["--steps", "1"] if "--steps" not in argv else argv)
    except SystemExit as e:  # argparse's errors exit from parse_args
        rc = e.code
    assert rc == 2
    _one_line_error(capsys, "offload-demo", msg)


def test_demo_hf_yaml_with_recipe_runner_keys_exits_2(tmp_path, capsys):
    """A recipe-form yaml (runner keys the HF runner does not have) given to --model hf: named, not a
    TypeError from deep inside the model builder."""
    y = tmp_path / "recipe.yaml"
    y.write_text("model_config:\n  num_hidden_layers: 2\nrunner_config:\n  next_n: 1\n  pa_block_size: 16\n")
    assert demo.main(["--model", "hf", "--config", str(y), "--steps", "1"]) == 2
    _one_line_error(capsys, "offload-demo", f"--config {str(y)!r} is not an HF config: runner_config keys "
                                            "['next_n', 'pa_block_size'] are unknown to --model hf")


DEMO_PATHS = [  # (flag, what the path is, the message)
    ("--record-trace", "dir", "--record-trace {p!r} is a directory; give a file path"),  # failed after the run
    ("--record-trace", "missing", "--record-trace {p!r}: folder {parent!r} does not exist"),
    ("--dump-dir", "file", "--dump-dir {p!r} is not a writable directory"),
]


@pytest.mark.parametrize("flag,kind,msg", DEMO_PATHS, ids=[f"{f}-{k}" for f, k, _ in DEMO_PATHS])
def test_demo_bad_output_path_is_rejected_before_running(flag, kind, msg, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "run", lambda *a, **k: pytest.fail("the demo ran"))
    target = {"dir": tmp_path, "missing": tmp_path / "no" / "t.npz", "file": tmp_path / "a_file"}[kind]
    if kind == "file":
        target.write_text("")
    assert demo.main([flag, str(target), "--steps", "1"]) == 2
    _one_line_error(capsys, "offload-demo", msg.format(p=str(target), parent=str(target.parent)))


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
    (["--hbm-gib", "nan"], "--hbm-gib must be a finite number in (0, 4096] (GiB of HBM per device), got nan"),
    (["--hbm-gib", "inf"], "--hbm-gib must be a finite number in (0, 4096] (GiB of HBM per device), got inf"),
    (["--host-gib", "-1"], "--host-gib must be a finite number in (0, 65536] (GiB of host memory per device), "
                           "got -1.0"),
    (["--devices", "0"], "--devices must be an integer >= 1, got 0"),
    (["--context", "nan"], "--context must be an integer >= 1, got 'nan'"),
    (["--pool-size", "1000"], "--pool-size must be a multiple of 16 (dsa_plan / dsa_install limits), got 1000"),
    (["--pool-size", "32768"], "--pool-size must be in (0, 16384] (dsa_plan / dsa_install limits), got 32768"),
    (["--config", "nope"], "--config 'nope'"),
]


@pytest.mark.parametrize("argv,msg", PLAN_BAD, ids=[" ".join(a) for a, _ in PLAN_BAD])
def test_plan_bad_input_exits_2_with_one_line(argv, msg, capsys):
    assert capacity_plan.main(argv) == 2
    _one_line_error(capsys, "offload-capacity", msg)


def test_plan_alias_adds_one_note_before_the_same_error(capsys):
    """``offload-plan`` (the deprecated alias): a note naming offload-capacity, then the same one-line error."""
    assert capacity_plan.main_alias(["--devices", "0"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == ["offload-plan: note: this command is offload-capacity; the name offload-plan is deprecated "
                     "and will be removed in the next release",
                     "offload-capacity: error: --devices must be an integer >= 1, got 0"]


def test_inspect_unwritable_picture_path_exits_2(tmp_path, capsys):
    from fake_dump import write_fake_dump

    d = write_fake_dump(tmp_path / "dump")
    assert inspect_dump.main([str(d), "--svg", "/proc/offload_passes_nope/x.svg"]) == 2
    _one_line_error(capsys, "offload-inspect", "--svg '/proc/offload_passes_nope/x.svg': folder")
    assert inspect_dump.main([str(tmp_path / "missing")]) == 2
    _one_line_error(capsys, "offload-inspect", "does not exist")


def _parse_error(capsys, parse, argv, prog: str, contains: str) -> None:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    _one_line_error(capsys, prog, contains)


ATLAS_BAD = [
    (["--tol", "nan"], "--tol must be a finite number > 0, got nan"),  # nan passed `tol <= 0` and failed every case
    (["--tol", "inf"], "--tol must be a finite number > 0, got inf"),
    (["--tol", "-1"], "--tol must be > 0, got -1.0"),
    (["--report", "/nonexistent_offload_passes/r.json"],
     "--report '/nonexistent_offload_passes/r.json': folder '/nonexistent_offload_passes' does not exist"),
    (["--modes", "eager"], "--modes: unknown value(s) ['eager']"),  # usage block gone: one line
]


@pytest.mark.parametrize("argv,msg", ATLAS_BAD, ids=[" ".join(a) for a, _ in ATLAS_BAD])
def test_atlas_check_bad_input_exits_2_with_one_line(argv, msg, capsys):
    from offload_passes.tools import atlas_check

    _parse_error(capsys, atlas_check.parse_args, argv, "offload-atlas-check", msg)


def test_atlas_check_report_onto_a_directory_is_rejected_before_the_run(tmp_path, monkeypatch, capsys):
    """Without the check the whole run happened first, then writing the report raised IsADirectoryError."""
    from offload_passes.tools import atlas_check

    monkeypatch.setattr(atlas_check, "environment", lambda: pytest.fail("the check ran"))
    with pytest.raises(SystemExit) as e:
        atlas_check.main(["--models", "tiny", "--report", str(tmp_path)])
    assert e.value.code == 2
    _one_line_error(capsys, "offload-atlas-check", f"--report {str(tmp_path)!r} is a directory; give a file path")


@pytest.mark.parametrize("width", ["10", "0", "62", "4097", "1000000000"])
def test_inspect_width_out_of_range_exits_2(width, tmp_path, capsys):
    from fake_dump import write_fake_dump

    d = write_fake_dump(tmp_path / "dump")
    assert inspect_dump.main([str(d), "--layer", "1", "--width", width]) == 2
    _one_line_error(capsys, "offload-inspect", f"--width must be in [63, 4096] (two columns of at least 30 "
                                               f"characters), got {width}")
    for ok in (63, 4096):  # the limits themselves are accepted: the two columns fill the width
        assert inspect_dump.main([str(d), "--layer", "1", "--width", str(ok)]) == 0
        rule = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("---"))
        assert len(rule) == 2 * ((ok - 3) // 2) + 3


def test_inspect_picture_path_onto_a_directory_exits_2(tmp_path, capsys):
    from fake_dump import write_fake_dump

    d = write_fake_dump(tmp_path / "dump")
    assert inspect_dump.main([str(d), "--dot", str(tmp_path)]) == 2
    _one_line_error(capsys, "offload-inspect", f"--dot {str(tmp_path)!r} is a directory; give a file path")


def test_console_script_prints_no_traceback():
    """The installed entry point, in a fresh process: one line, exit 2."""
    exe = Path(sys.executable).with_name("offload-demo")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "offload_passes.apps.demo"]
    r = subprocess.run(cmd + ["--config", "nope", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("offload-demo: error: --config 'nope': no such preset")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


CONFIG_PATHS = [  # (what the --config path is, what follows "--config '<path>'" in the message)
    ("empty", " is empty: a config holds model_config / runner_config at top level"),  # was the 78-layer default
    ("comment", " is empty: a config holds model_config / runner_config at top level"),
    ("braces", " is empty: a config holds model_config / runner_config at top level"),
    ("keyless", " has none of the keys model_config / runner_config (got ['other'])"),
    ("list", ": the top level must be a mapping with model_config / runner_config, got a list"),
    ("dir", " is a directory; give a file"),
    ("fifo", " is not a regular file (a FIFO, a socket or a device); give a file"),  # reading it hung
    ("missing", ": no such file"),
]


def _config_path(kind: str, tmp_path: Path) -> Path:
    text = {"empty": "", "comment": "# nothing\n", "braces": "{}\n", "keyless": "other: 1\n", "list": "[1, 2]\n"}
    if kind in text:
        (tmp_path / "c.yaml").write_text(text[kind])
        return tmp_path / "c.yaml"
    return {"dir": tmp_path, "fifo": _fifo(tmp_path / "fifo.yaml"), "missing": tmp_path / "nope.yaml"}[kind]


@pytest.mark.parametrize("kind,msg", CONFIG_PATHS, ids=[k for k, _ in CONFIG_PATHS])
@pytest.mark.parametrize("extra", [[], ["--serve"], ["--model", "hf"]], ids=["glm", "serve", "hf"])
def test_demo_config_that_is_no_config_exits_2_before_building(kind, msg, extra, tmp_path, monkeypatch, capsys):
    from offload_passes import models

    monkeypatch.setattr(models, "build", lambda *a, **k: pytest.fail("a model was built"))
    path = _config_path(kind, tmp_path)
    assert demo.main(extra + ["--config", str(path), "--steps", "1"]) == 2
    _one_line_error(capsys, "offload-demo", f"--config {str(path)!r}{msg}")


@pytest.mark.parametrize("kind,msg", [("empty", " is empty: give HF glm_moe_dsa keys"),
                                      ("dir", " is a directory; give a file"),
                                      ("fifo", " is not a regular file"), ("missing", ": no such file")])
def test_capacity_config_that_is_no_config_exits_2(kind, msg, tmp_path, capsys):
    path = _config_path(kind, tmp_path)
    assert capacity_plan.main(["--config", str(path)]) == 2
    _one_line_error(capsys, "offload-capacity", f"--config {str(path)!r}{msg}")


def test_trace_outputs_that_cannot_be_written_name_their_flag(tmp_path, monkeypatch, capsys):
    """--save-trace (offload-sim) and --record-trace (offload-demo): a directory or a missing folder is refused
    before the run; a write that fails anyway names the flag (it was a bare [Errno ...])."""
    from offload_passes.trace import cli

    for target, msg in ((tmp_path, "is a directory; give a file path"), (tmp_path / "no" / "t.npz", "folder")):
        with pytest.raises(SystemExit) as e:
            cli.main(["synth", "--save-trace", str(target)])
        assert e.value.code == 2
        _one_line_error(capsys, "offload-sim", f"--save-trace {str(target)!r}")

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli, "save_trace", denied)
    assert cli.main(["synth:steps=4", "--pool-sizes", "64", "--save-trace", str(tmp_path / "t.npz")]) == 2
    _one_line_error(capsys, "offload-sim", f"--save-trace {str(tmp_path / 't.npz')!r}: Permission denied")
    import offload_passes.trace.format as fmt

    monkeypatch.setattr(fmt, "save_trace", denied)

    class _Rec:
        def trace_for(self, state, config):
            return None

    with pytest.raises(demo.UsageError, match=r"--record-trace '/x/t.npz': Permission denied"):
        demo._save_trace(_Rec(), object(), "tiny", "/x/t.npz")


INT_FLAGS = [  # (tool, argv, message): the one integer parser (offload_passes/_cli.py::parse_ints)
    ("offload-demo", ["--serve", "--buckets", "2,x"], "--buckets must be comma-separated integers in [1, 4], got '2,x'"),
    ("offload-demo", ["--serve", "--buckets", "0,4"], "--buckets must be comma-separated integers in [1, 4], got '0,4'"),
    ("offload-demo", ["--pool-size", "1e4"], "--pool-size must be an integer, got '1e4'"),
    ("offload-capacity", ["--what-if", "--pools", "8192,nan"], "--pools must be comma-separated integers >= 1, got "
                                                                "'8192,nan'"),
    ("offload-capacity", ["--what-if", "--batches", "64,,128"], "--batches must be comma-separated integers >= 1"),
    ("offload-capacity", ["--batch", "1.5"], "--batch must be an integer in [1, 65536], got '1.5'"),
    ("offload-capacity", ["--next-n", "-1"], "--next-n must be an integer >= 0, got -1"),
    ("offload-inspect", ["d", "--layer", "x"], "--layer must be an integer >= 0, got 'x'"),
]


@pytest.mark.parametrize("prog,argv,msg", INT_FLAGS, ids=[" ".join(a) for _, a, _ in INT_FLAGS])
def test_integer_flags_are_one_line_naming_the_flag_and_the_limit(prog, argv, msg, capsys):
    main = {"offload-demo": demo.main, "offload-capacity": capacity_plan.main, "offload-inspect": inspect_dump.main}
    try:
        rc = main[prog](argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    _one_line_error(capsys, "offload-capacity --what-if" if "--what-if" in argv else prog, msg)
