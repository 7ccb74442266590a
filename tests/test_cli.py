"""Bad input gets one clear line and exit status 2 before any process group exists; --list works.

The world size comes from the environment, as under torchrun, so an invalid combination is caught
without launching anything."""

import pytest

from harness.commands.main import main
from harness_runs import run_cli


def test_list_shows_scenarios_and_targets():
    proc = run_cli(["--list"])
    assert proc.returncode == 0
    for name in ("xorl_ep_lora", "deepspeed_autoep", "dense_dp", "reference", "torch-dtensor", "xorl-style"):
        assert name in proc.stdout


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--scenario", "xorl_ep_lora", "--ep-size", "3"], "4", "ep_size 3 does not divide the world size 4"),
        (["--scenario", "xorl_ep_lora", "--ep-size", "3"], "6", "8 experts are not divisible by ep_size 3"),
        (["--target", "nope"], "1", "unknown target 'nope'"),
        (["--target", "no_such_module:fn"], "1", "cannot import module 'no_such_module'"),
        (["--target", "tests/missing.py:fn"], "1", "no such file 'tests/missing.py'"),
        (["--scenario", "nope"], "1", "unknown scenario 'nope'"),
        (["--scenario", "dense_dp", "--ep-size", "2"], "2", "--ep-size does not apply to dense_dp"),
        (["--dtype", "fp8"], "1", "unknown dtype 'fp8'"),
        (["--variant", "zzz"], "1", "variant 'zzz' leaves no layout of"),
        (["--backend", "nccl"], "1", "backend nccl needs CUDA"),
        (["--timeout", "0"], "1", "--timeout must be a positive number of seconds"),
        (["--timeout", "inf"], "1", "--timeout must be a positive number of seconds, at most 86400"),
        (["--timeout", "1e12"], "1", "--timeout must be a positive number of seconds, at most 86400"),
        (["--json", "/nonexistent-dir/out.jsonl"], "1", "--json /nonexistent-dir/out.jsonl:"),
        (["--junit", "/proc/junit.xml"], "1", "--junit /proc/junit.xml:"),
    ],
)
def test_bad_input_is_one_clear_line(args, world, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("args, suggestion", [
    (["--target", "referenc"], "unknown target 'referenc': did you mean 'reference'?"),
    (["--target", "reference,xorl-styel"], "unknown target 'xorl-styel': did you mean 'xorl-style'?"),
    (["--scenario", "dense_pd"], "unknown scenario 'dense_pd': did you mean 'dense_dp'?"),
])
def test_a_mistyped_name_gets_the_closest_registered_one_before_any_rank_starts(args, suggestion):
    proc = run_cli(["run", "--nproc", "2", *args])
    assert proc.returncode == 2 and suggestion in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_name_close_to_nothing_gets_no_guess(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(["--target", "nope"]) == 2
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--norm-type", "0"], "norm type must be positive"),
        (["--max-norm", "0"], "--max-norm: must be a positive finite number"),
        (["--max-norm", "nan"], "--max-norm: must be a positive finite number"),
        (["--clip-ratio", "-1"], "--clip-ratio: must be a positive finite number"),
    ],
)
def test_bad_numbers_are_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_only_rank_zero_speaks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["--target", "nope"]) == 2
    assert capsys.readouterr().err == ""


def test_bad_input_in_a_real_process_has_no_traceback():
    proc = run_cli(["--scenario", "xorl_ep_lora", "--ep-size", "3"], {"WORLD_SIZE": "4", "RANK": "0"})
    assert proc.returncode == 2
    assert proc.stderr == (
        "clipcheck: error: no valid cases at world size 4: xorl_ep_lora: ep_size 3 does not divide the world size 4\n")


def test_single_process_run_without_a_launcher():
    proc = run_cli(["--scenario", "dense_dp", "--target", "reference", "--variant", "replicated"])
    assert proc.returncode == 0, proc.stderr
    # 2 dtypes x 2 norm types x 2 bounds (below and above the true norm) by default
    assert "summary: 8 cases, 8 passed" in proc.stdout


def test_help_lists_the_commands_and_the_exit_statuses_and_version_says_what_runs():
    from harness.commands.main import SUBCOMMANDS
    from harness.judge.verdicts import EXIT_STATUSES

    shown = run_cli(["--help"])
    assert shown.returncode == 0
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in shown.stdout, name
    for status, meaning in EXIT_STATUSES.items():
        assert f"  {status}  {meaning}" in shown.stdout
    version = run_cli(["--version"])
    assert version.returncode == 0 and version.stdout.startswith("clipcheck ") and "torch 2." in version.stdout


@pytest.mark.parametrize("command", ["run", "matrix", "fuzz", "compat", "catalogue"])
def test_every_command_has_its_help_and_refuses_a_missing_file_in_one_line(command):
    helped = run_cli([command, "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: clipcheck {command}"), helped.stderr
    if command == "compat":
        missing = run_cli(["compat", "no-such-results.jsonl"])
        assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr

