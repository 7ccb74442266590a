"""Input from a file, a blob or a careless command line is refused in one line (exit 2) before any rank
starts, runs no code nobody named, and is never shown raw: blobs, timeouts, matrix files, labels, the
matrix summary, worlds too large for the machine, scripts without a main guard."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest
from hypothesis.errors import NonInteractiveExampleWarning

from harness.commands.main import main
from harness.judge.checks import unjudged_result
from harness.report.html import render_html
from harness.report.summary import compact_summary
from harness.report.junit import junit_xml
from harness.report.reporter import Reporter, case_json
from harness.cases.blob import MAX_ELEMENTS, case_spec, decode, encode, replay_command
from harness.errors import UsageError
from harness.strategies import drawn_cases
from harness_runs import harness_env, harness_process, run_cli

FORGED = "dp=2 replicated\nfuzz  forged  reference  L2 fp32 \x1b[32mPASS\x1b[0m"


def _drawn():
    with warnings.catch_warnings():  # .example() is meant for the REPL; any drawn case will do here
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        return drawn_cases(world_size=2).example()


def _doc(target: str = "reference") -> dict:
    body = encode(_drawn(), target)[4:]
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))


def _blob(doc: dict) -> str:
    return "cc1." + base64.urlsafe_b64encode(zlib.compress(json.dumps(doc).encode())).decode().rstrip("=")


def _in(folder: Path, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return harness_process([sys.executable, "-m", "harness", *args], harness_env(), timeout, cwd=folder)


# -- a blob runs only code the user named ------------------------------------------------------------------
@pytest.mark.parametrize("target", ["evilmod:fn", "this:x"])
def test_a_blob_cannot_import_a_module_nobody_named(tmp_path, target):
    """A blob naming module:function is refused unless --target names it: imported in the launcher and every
    rank, the working directory on the import path, `evilmod:fn` would run ./evilmod.py and `this:x` print
    the Zen of Python."""
    (tmp_path / "evilmod.py").write_text("open('ran', 'w').write('evil')\ndef fn(model, **kw):\n    return 0.0\n")
    proc = _in(tmp_path, ["--replay", _blob(dict(_doc(), target=target))])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert f"pass --target {target}" in proc.stderr
    assert not (tmp_path / "ran").exists() and "Beautiful is better than ugly" not in proc.stdout + proc.stderr


def test_a_blob_target_named_on_the_command_line_runs_and_the_fuzzer_names_it(tmp_path):
    (tmp_path / "named.py").write_text("open('ran', 'w').write('named')\n"
                                       "from harness.reference import clip_grad_norm as clip\n")
    target = "named:clip"
    drawn = _drawn()
    assert replay_command(drawn, target).endswith(f" --target {target}")
    assert " --target " not in replay_command(drawn, "reference")
    proc = _in(tmp_path, ["--replay", encode(drawn, target), "--target", target], timeout=300)
    assert proc.returncode in (0, 1) and "named:clip" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "ran").exists()


# -- a timeout that cannot be one is refused in one line ---------------------------------------------------
@pytest.mark.parametrize("command", [["run", "--nproc", "2"], ["matrix", "--nproc-list", "2"],
                                     ["fuzz", "--target", "reference", "--world", "2"]])
@pytest.mark.parametrize("timeout", ["inf", "1e12"])
def test_a_timeout_that_cannot_be_one_is_one_line(tmp_path, command, timeout):
    """`--timeout inf` / `1e12` (past what the deadlines' types hold: a rank crash in every case of
    run/matrix, an OverflowError traceback from fuzz and torchrun) is one line, exit 2, before any rank
    (torchrun's ranks: test_cli)."""
    extra = {"run": ["--scenario", "dense_dp"], "fuzz": [],
             "matrix": ["--scenario", "dense_dp", "--out", str(tmp_path / "m")]}[command[0]]
    proc = run_cli([*command, *extra, "--timeout", timeout], timeout=240)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert "--timeout must be a positive number of seconds, at most 86400" in proc.stderr
    assert "launch:" not in proc.stdout and "started in" not in proc.stdout


# -- blobs that pass the format but cannot run are refused before any rank --------------------------------
def _param_doc(**changes) -> dict:
    doc = _doc()
    name, shape, placements, present, trainable = doc["params"][0]
    fields = {"name": name, "shape": shape, "placements": placements, "present": present, "trainable": trainable}
    fields.update(changes)
    doc["params"][0] = list(fields.values())
    return doc


@pytest.mark.parametrize("doc, message", [
    (lambda: dict(_doc(), world=3), "needs 2 ranks, but the world has 3"),
    (lambda: dict(_doc(), mesh=[["dp", 4]]), "needs 4 ranks, but the world has 2"),
    (lambda: _param_doc(trainable="no"), "must be true or false"),
    (lambda: _param_doc(shape=[2 ** 20, 2 ** 20], placements={}), f"more than the {MAX_ELEMENTS}"),
    (lambda: _param_doc(shape=[4.5]), "must be an integer, got 4.5"),
    (lambda: _param_doc(shape=["4"]), "must be an integer, got '4'"),
    (lambda: dict(_doc(), label=FORGED), "must be printable text"),
    (lambda: dict(_doc(), target="reference\x1b[2K"), "must be printable text"),
])
def test_a_blob_that_cannot_run_is_refused_before_any_rank(doc, message):
    """A blob that passes the format check but cannot run (a world its mesh does not fit, a trainable flag
    of "no", 2**40 elements, shapes that would be silently coerced from 4.5 or "4"), or whose label could
    forge a line of the report, is refused before any rank starts, not reported as a crash."""
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")):
        decode(_blob(doc()))


def test_an_oversized_blob_is_one_line_from_the_command_line(tmp_path):
    proc = _in(tmp_path, ["--replay", _blob(_param_doc(shape=[2 ** 20, 2 ** 20], placements={}))])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


# -- a matrix file nested too deeply is one line ----------------------------------------------------------
@pytest.mark.parametrize("suffix, text", [(".json", "[" * 100_000 + "]" * 100_000),
                                          (".toml", "scenarios = " + "[" * 100_000 + "]" * 100_000)])
def test_a_deeply_nested_matrix_file_is_one_line(tmp_path, capsys, suffix, text):
    """A deeply nested JSON or TOML matrix file is one line, exit 2, not a RecursionError traceback."""
    path = tmp_path / f"m{suffix}"
    path.write_text(text)
    assert main(["--matrix", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nests too deeply" in err, err


# -- nothing from a file or a blob reaches a report raw --------------------------------------------------
def test_what_a_file_or_a_clip_says_is_escaped_in_every_report():
    """A label with a newline and ANSI escapes cannot print a forged "PASS" line in green: labels, names
    and exception messages are escaped on the console, in JUnit (which must stay valid XML) and in the
    HTML page."""
    drawn = _drawn()
    case = case_spec(dataclasses.replace(drawn, variant=dataclasses.replace(drawn.variant, label=FORGED)),
                     "tests/x.py:clip\x1b[31m")
    result = unjudged_result(case, "crash", "rank 1 raised ValueError: \x1b[32mPASS\x1b[0m\u202e", 2)
    out = io.StringIO()
    reporter = Reporter(out, None, 2, "gloo", False)
    reporter.case(result)
    text = out.getvalue()
    assert "\x1b" not in text and "\u202e" not in text and "\\x1b[32mPASS" in text
    assert text.count("\n") == 2  # the case line and its one failed check: no forged line
    record = case_json(result, 2, "gloo")
    xml = junit_xml([record])
    ET.fromstring(xml)
    assert "\x1b" not in xml and "\\n" in xml
    page = render_html([record])
    assert "\x1b" not in page and "\u202e" not in page


# -- the matrix summary keeps every target apart ----------------------------------------------------------
def test_two_targets_of_one_file_are_two_rows_of_the_summary():
    """Two targets of one file are two rows of the summary: target names are never cut short."""
    cases = [{"type": "case", "target": f"tests/some/long/path/fault_targets.py:{name}", "scenario": "dense_dp",
              "verdict": verdict, "checks": {}} for name, verdict in (("clip_a", "PASS"), ("clip_b", "FAIL"))]
    rows = compact_summary(cases)[1:]
    assert len(rows) == 2 and any(":clip_a" in r for r in rows) and any(":clip_b" in r for r in rows), rows


# -- worlds a machine cannot hold, and scripts without a main guard ----------------------------------------
def test_a_world_larger_than_the_machine_is_one_line():
    """A world larger than the machine can run (`run --nproc 64` on a few cores) is refused in one line."""
    proc = run_cli(["run", "--nproc", "64", "--scenario", "dense_dp"], timeout=240)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "this machine runs at most" in proc.stderr


def test_check_runs_from_a_script_without_a_main_guard(tmp_path):
    """`harness.check` at the top level of a script (no `if __name__ == "__main__":`) runs: the ranks never
    import the script (each would run it again and die, "PoolBroken ... rank 0 died", no reason given)."""
    script = tmp_path / "no_guard.py"
    script.write_text("import harness\n"
                      "report = harness.check('reference', scenarios=['dense_dp'], worlds=[2], dtypes=['fp32'],\n"
                      "                       norm_types=[2], clip_ratios=[0.5], variant='replicated')\n"
                      "print('PASSED' if report.passed else report.describe())\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=harness_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "PASSED", proc.stdout + proc.stderr
