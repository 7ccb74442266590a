"""The product as pip installs it: the wheel carries every harness module, the scenarios as
``harness.scenarios`` and the package data, declares what the runtime imports, and the harness never
takes its built-in scenarios from the user's working directory.

The wheel is built from a copy of the sources in a temporary folder (no network, no build isolation),
so the build never writes ``build/`` or egg-info into the checkout. Installing it into a fresh venv
and running it there is ``.ci/installed-product``'s job (too slow for a unit test).
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.run.world.torch_compat import torch_release
from harness.targets.registry import builtin_scenarios
from harness_runs import ROOT

SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "harness", "scenarios")
DECOY = 'raise ImportError("decoy: the scenarios/ folder of the working directory was imported")\n'


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("clipcheck-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def _metadata(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_wheel_carries_every_module_the_scenarios_and_the_package_data(wheel):
    names = set(wheel.namelist())
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "harness").rglob("*.py")
                if "__pycache__" not in p.parts}
    expected |= {f"harness/scenarios/{p.relative_to(ROOT / 'scenarios').as_posix()}"
                 for p in (ROOT / "scenarios").rglob("*.py") if "__pycache__" not in p.parts}
    expected |= {"harness/default_matrix.toml", "harness/py.typed", "harness/scenarios/__init__.py",
                 "harness/scenarios/deepspeed/adapter.py"}
    expected |= _REPORT_FILES
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert not [n for n in names if n.startswith("scenarios/")], "a top-level scenarios package would shadow"


_REPORT_FILES = {"harness/report/templates/report.html.j2", "harness/report/assets/report.css",
                 "harness/report/assets/report.js"}
"""report.html's template, style and script: package data, read with importlib.resources."""


def test_wheel_carries_the_pages_template_and_assets_as_they_are(wheel):
    """Every file of report/templates and report/assets, byte for byte: a page rendered from an
    installed clipcheck is the page the tests render from the checkout."""
    folders = [ROOT / "harness" / "report" / name for name in ("templates", "assets")]
    files = {p.relative_to(ROOT).as_posix(): p for folder in folders for p in folder.iterdir() if p.is_file()}
    assert set(files) == _REPORT_FILES
    for name, path in files.items():
        assert wheel.read(name) == path.read_bytes(), name


def test_wheel_declares_what_the_runtime_imports(wheel):
    meta = email.parser.Parser().parsestr(_metadata(wheel, "METADATA"))
    runtime = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    names = {r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower() for r in runtime}
    assert "numpy" not in names
    assert "hypothesis" in names
    assert "jinja2" in names  # report.html's template
    (torch,) = [r.replace(" ", "") for r in runtime if r.lower().startswith("torch")]
    # exactly the releases the suite ran on: CI's and .ci/torch-versions' (docs/torch-versions.md)
    assert set(torch.removeprefix("torch").split(",")) == set(_ran_torch_range()), torch


def _ci_torch() -> str:
    """The torch release CI's venv is built with (.ci/make-venv's default TORCH_SPEC, the CPU build)."""
    match = re.search(r"TORCH_SPEC:-torch==([0-9.]+)\}", (ROOT / ".ci" / "make-venv").read_text())
    assert match, "no ${TORCH_SPEC:-torch==X} default in .ci/make-venv"
    return match.group(1)


def _torch_versions_defaults() -> list[str]:
    """.ci/torch-versions' default versions: the releases besides CI's that the suite is run on."""
    script = (ROOT / ".ci" / "torch-versions").read_text()
    match = re.search(r"^DEFAULT_VERSIONS=\(([^)]*)\)$", script, re.MULTILINE)
    assert match, "no DEFAULT_VERSIONS=(...) line in .ci/torch-versions"
    return match.group(1).split()


def _ran_torch_range() -> tuple[str, str]:
    """The range of exactly the releases the suite ran on: the oldest minor release run to the newest."""
    ran = sorted(torch_release(v) for v in [_ci_torch(), *_torch_versions_defaults()])
    (major, low), (top_major, high) = ran[0], ran[-1]
    assert major == top_major == 2, ran
    return f">={major}.{low}", f"<{major}.{high + 1}"


def test_docs_and_readme_give_the_figures_of_each_release_run_and_the_range():
    doc = (ROOT / "docs" / "torch-versions.md").read_text()
    for version in [_ci_torch(), *_torch_versions_defaults()]:
        assert f"torch {version}" in doc, f"docs/torch-versions.md has no figures for torch {version}"
    declared = "torch" + ",".join(_ran_torch_range())
    assert f"`{declared}`" in doc
    readme = (ROOT / "README.md").read_text()
    assert f"`{declared}`" in readme and "docs/torch-versions.md" in readme


def test_wheel_says_its_license_and_what_it_is(wheel):
    meta = email.parser.Parser().parsestr(_metadata(wheel, "METADATA"))
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist())
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and "Framework :: Pytest" in classifiers
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_wheel_has_the_console_script_and_the_pytest_plugin(wheel):
    entry_points = _metadata(wheel, "entry_points.txt")
    assert "clipcheck = harness.commands.main:main_entry" in entry_points
    assert "[pytest11]" in entry_points and "harness.pytest_plugin" in entry_points


def test_a_scenarios_folder_in_the_working_directory_does_not_shadow_the_builtins(tmp_path: Path):
    # python -m puts the cwd first on sys.path: a top-level `import scenarios` would find the decoy
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "__init__.py").write_text(DECOY)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "harness", "--list"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert set(builtin_scenarios()) <= listed, proc.stdout
    assert "decoy" not in proc.stdout + proc.stderr


def test_a_frameworks_pin_lives_in_its_folder_and_the_extras_repeat_it_exactly():
    """scenarios/<framework>/framework.py holds the recipe CI installs; an extra in pyproject.toml
    naming the same distribution must pin the same version (pyproject cannot import it). Not every
    framework has an extra: one whose own requirements would replace torch (ColossalAI 0.5.0 pins
    torch<=2.5.1) installs only through its ``--no-deps`` recipe."""
    import tomllib

    from harness.targets.builtin_scenarios import scenarios_package

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    requirements = [r for reqs in extras.values() for r in reqs]
    frameworks = scenarios_package().FRAMEWORKS
    assert {f.name for f in frameworks} >= {"deepspeed", "torchtitan", "megatron-core", "xorl"}
    for framework in frameworks:
        pins = [w for line in framework.recipe for w in line.split() if w.startswith(f"{framework.distribution}==")]
        if framework.distribution is None:
            assert not framework.recipe  # not on the package index: nothing CI could install
            continue
        assert len(pins) == 1, (framework.name, framework.recipe)
        named = [r for r in requirements if r.split("==")[0] == framework.distribution]
        assert all(r == pins[0] for r in named), (framework.name, pins, named)
    assert {r.split("==")[0] for r in requirements} >= {"deepspeed", "torchtitan", "megatron-core", "accelerate"}
