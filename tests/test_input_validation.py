"""Bad input is one line and exit status 2 before any rank starts; planning never silently drops
valid cases; replay blobs are data from someone else; the warm world's store is loopback only."""

from __future__ import annotations

import base64
import json
import warnings
import zlib

import pytest
from hypothesis.errors import NonInteractiveExampleWarning

from harness.errors import ClipcheckError, ClipcheckInputError
from harness.cases.layout import LayoutError
from harness.cases.matrix import MatrixSpec, spec_from_mapping
from harness.plan.planner import plan_cases
from harness.cases.blob import MAX_WORLD, decode, decode_trusted, encode
from harness.errors import UsageError
from harness.strategies import drawn_cases
from harness_runs import run_cli


# -- planning ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [3, 8])
def test_megatron_keeps_its_valid_layouts_where_one_ep_size_is_impossible(world):
    plan = plan_cases(MatrixSpec(scenarios=("megatron_moe_tp",), targets=("reference",)), world, "gloo")
    assert plan.cases, plan.dropped
    assert {c.variant.ep_size for c in plan.cases} >= {1}


@pytest.mark.parametrize("raw, message", [
    ({"scenarios": "dense_dp"}, "scenarios"),
    ({"worlds": "24"}, "worlds"),
    ({"worlds": [2, "4"]}, "worlds"),
    ({"clip_ratios": [0]}, "clip_ratios"),
    ({"dtypes": "bf16"}, "dtypes"),
])
def test_a_matrix_value_of_the_wrong_type_is_an_error_naming_its_key(raw, message):
    with pytest.raises(LayoutError, match=message):
        spec_from_mapping(raw)


def test_a_non_utf8_matrix_file_is_one_line(tmp_path):
    bad = tmp_path / "m.toml"
    bad.write_bytes(b'scenarios = ["dense_dp"]\n# caf\xe9\n')
    proc = run_cli(["--matrix", str(bad)])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "UTF-8" in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [
    ["matrix", "--nproc", "2"],          # once an abbreviation of --nproc-list, passed on to every launch
    ["run", "--npro", "2"],
    ["--scen", "dense_dp"],
    ["fuzz", "--exam", "5"],
])
def test_abbreviated_options_are_refused(argv):
    proc = run_cli(argv)
    assert proc.returncode == 2 and ("unrecognized arguments" in proc.stderr or "required" in proc.stderr), proc.stderr


def test_the_matrix_refuses_an_unwritable_out_folder_before_launching(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_cli(["matrix", "--nproc-list", "1", "--scenario", "dense_dp", "--out", str(blocker / "results")])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


def test_errors_share_one_root():
    assert issubclass(ClipcheckInputError, ClipcheckError) and issubclass(UsageError, ClipcheckError)
    assert issubclass(LayoutError, ClipcheckInputError)


# -- replay blobs --------------------------------------------------------------------------------------------
def _blob(**changes) -> str:
    with warnings.catch_warnings():  # .example() is meant for the REPL; any drawn case will do here
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        drawn = drawn_cases(world_size=2).example()
    doc = json.loads(zlib.decompress(base64.urlsafe_b64decode(_pad(encode(drawn, "reference")[4:]))))
    doc.update(changes)
    return "cc1." + base64.urlsafe_b64encode(zlib.compress(json.dumps(doc).encode())).decode().rstrip("=")


def _pad(body: str) -> str:
    return body + "=" * (-len(body) % 4)


@pytest.mark.parametrize("changes, message", [
    ({"norm": "nan"}, "norm type"),
    ({"max_norm": -1.0}, "max_norm must be a positive finite number"),
    ({"max_norm": "nan"}, "max_norm must be a positive finite number"),
    ({"world": MAX_WORLD + 1}, f"outside 1..{MAX_WORLD}"),
])
def test_a_blob_gets_the_command_lines_validation(changes, message):
    with pytest.raises(UsageError, match=message):
        decode(_blob(**changes))


def test_a_blob_that_inflates_past_the_cap_is_refused():
    huge = zlib.compress(b"[" + b"0," * 2_000_000 + b"0]")
    blob = "cc1." + base64.urlsafe_b64encode(huge).decode().rstrip("=")
    with pytest.raises(UsageError, match="decompresses to more than"):
        decode(blob)


def test_a_blob_naming_a_file_target_needs_it_named_on_the_command_line():
    blob = _blob(target="evil.py:clip")
    with pytest.raises(UsageError, match="--target evil.py:clip"):
        decode_trusted(blob)
    assert decode_trusted(blob, ["evil.py:clip"])[1] == "evil.py:clip"
    assert decode_trusted(_blob(target="reference"))[1] == "reference"
    proc = run_cli(["--replay", blob])
    assert proc.returncode == 2 and "--target evil.py:clip" in proc.stderr and "Traceback" not in proc.stderr


# -- the warm world's store ----------------------------------------------------------------------------------
def _listening_addresses(port: int) -> list[str]:
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


def test_the_warm_world_store_listens_on_loopback_only():
    from harness.run.hosts.pool import RankPool

    with RankPool(2, timeout_s=20) as pool:
        pool.start()
        addresses = _listening_addresses(pool._store.port)
    assert addresses == ["0100007F"], addresses  # 127.0.0.1, and no IPv6 / wildcard listener


def test_a_closed_warm_world_leaves_no_folder_behind():
    """Each pool made a folder for its ranks' stack dumps and never removed it: 148 of them had piled
    up in /tmp on the development machine. Closing removes it; a pool started again makes a new one."""
    import os

    from harness.run.hosts.pool import RankPool

    pool = RankPool(1, timeout_s=20)
    with pool:
        pool.start()
        first = pool._stack_dir
        assert first is not None and os.path.isdir(first)
    assert not os.path.exists(first)
    with pool:
        assert pool.run(os.getpid)[0].ok and pool._stack_dir is not None and os.path.isdir(pool._stack_dir)
    assert pool._stack_dir is None


def test_only_rank_0_probes_the_results_files(tmp_path):
    """Every rank of a launch parses the same --json path, but only rank 0 writes it: ranks that probed it
    at once (forked ranks start together) removed each other's probe file ("planning failed:
    FileNotFoundError" on rank 1)."""
    from harness.commands.run import build_parser, usage_problem

    args = build_parser().parse_args(["--json", str(tmp_path / "missing-folder" / "results.jsonl")])
    assert "no such directory" in (usage_problem(args, "gloo", 2, rank=0) or "")
    assert usage_problem(args, "gloo", 2, rank=1) is None
    fresh = build_parser().parse_args(["--json", str(tmp_path / "results.jsonl")])
    assert usage_problem(fresh, "gloo", 2, rank=0) is None and not (tmp_path / "results.jsonl").exists()
