"""Every fenced code block of README.md and docs/**/*.md is a test (id ``FILE:LINE``), so a renamed
module, flag or key breaks the suite instead of a user's first try (docs/development.md, "The
documentation is tested"):

* ``python``: run with this interpreter in a temporary directory outside the checkout;
* ``bash`` / ``sh``: run with ``bash -euo pipefail`` there; ``console``: its ``$ `` lines, the same way;
* ``toml`` / ``json``: parsed; ``yaml`` / ``yml``: parsed with PyYAML, skipped where it is absent;
* ``text``: output, not run; after the line ``<!-- the output of the block above -->``, what the block
  before it prints: that block's stdout must be this text (``normalized``);
* first line ``# long: <why>``: only syntax-checked (``compile``, ``bash -n``);
* first line ``# file: NAME``: written as NAME into the directory of each later executed block of the
  same page (python compiled, toml and json parsed), not run itself.

Blocks that launch ranks are marked ``distributed``. Relative links between the pages, and their
``#anchors``, must resolve.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)\s*$")
SHELLS = ("bash", "sh", "console")
PARSED = ("toml", "json", "yaml", "yml")
LAUNCHES = re.compile(r"clipcheck (run|matrix|fuzz|catalogue)\b|harness\.check\(|torchrun|rank_pool|"
                      r"world_size\(|RankPool|--replay|python -m pytest|run_matrix")
BLOCK_TIMEOUT_S = 600
SHOWS_OUTPUT = "<!-- the output of the block above -->"


@dataclass(frozen=True)
class Block:
    page: str  # relative to the checkout
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    after: str = ""  # the page's last non-blank line before the opening fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first(self) -> str:
        return self.text.split("\n", 1)[0].strip()

    @property
    def long(self) -> str | None:
        return self.first[len("# long:"):].strip() if self.first.startswith("# long:") else None

    @property
    def file(self) -> str | None:
        return self.first[len("# file:"):].strip() if self.first.startswith("# file:") else None

    @property
    def executed(self) -> bool:
        return self.lang in ("python", *SHELLS) and self.long is None and self.file is None


def page_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    opened: tuple[str, int, str] | None = None
    body: list[str] = []
    after = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        match = FENCE.match(line)
        if opened is None:
            if match:
                opened, body = (match.group(1), number, match.group(2).lower()), []
            elif line.strip():
                after = line.strip()
        elif match and match.group(1) == opened[0] and not match.group(2):
            blocks.append(Block(str(path.relative_to(ROOT)), opened[1], opened[2], "\n".join(body) + "\n", after))
            opened, after = None, ""
        else:
            body.append(line)
    assert opened is None, f"{path.relative_to(ROOT)}:{opened[1]}: a code block is never closed"
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page)]
TESTED = [b for b in BLOCKS if b.lang != "text"]


def _param(block: Block) -> object:
    marks = [pytest.mark.distributed] if block.executed and LAUNCHES.search(block.text) else []
    return pytest.param(block, id=block.id, marks=marks)


def environment() -> dict[str, str]:
    """A user's shell with this checkout's venv first on PATH: no PYTHONPATH (the installed package
    only), none of run_matrix.sh's variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NPROC_LIST", "BACKENDS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["CLIPCHECK_ROOT"] = str(ROOT)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def write_page_files(block: Block, folder: Path) -> None:
    """The ``# file:`` blocks that come before ``block`` on its page, as files in ``folder``."""
    for other in BLOCKS:
        if other.page == block.page and other.line < block.line and other.file:
            target = folder / other.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(other.text)


def check_syntax(block: Block, folder: Path) -> None:
    if block.lang == "python":
        compile(block.text, block.id, "exec")
    elif block.lang in SHELLS:
        script = folder / "block.sh"
        script.write_text(shell_text(block))
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.id}: {proc.stderr}"


def shell_text(block: Block) -> str:
    if block.lang != "console":
        return block.text
    return "\n".join(line[2:] for line in block.text.split("\n") if line.startswith("$ ")) + "\n"


def parse(block: Block) -> None:
    if block.lang == "toml":
        tomllib.loads(block.text)
    elif block.lang == "json":
        json.loads(block.text)
    else:
        yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: the YAML block is not parsed")
        yaml.safe_load(block.text)


def shown_output(block: Block) -> Block | None:
    """The ``text`` block that shows what ``block`` prints: the next block of its page, marked so."""
    later = [b for b in BLOCKS if b.page == block.page and b.line > block.line]
    if later and later[0].lang == "text" and later[0].after == SHOWS_OUTPUT:
        return later[0]
    return None


def normalized(output: str, folder: Path) -> str:
    """What a block printed, less what differs from machine to machine: the folder it ran in and the
    checkout's path (written ``<tmp>``, ``<checkout>``), and blanks at a line's end. Nothing else: the
    rows, numbers, checks and signatures must be the page's, character for character. (The shown
    commands print no timing or replay blob; one that does needs its own rule here.)"""
    for path, name in ((folder.resolve(), "<tmp>"), (folder, "<tmp>"), (ROOT, "<checkout>")):
        output = output.replace(str(path), name)
    return "\n".join(line.rstrip() for line in output.split("\n"))


def run_block(block: Block, folder: Path) -> None:
    write_page_files(block, folder)
    if block.lang == "python":
        script = folder / f"block_{block.line}.py"
        script.write_text(block.text)
        command = [sys.executable, str(script)]
    else:
        script = folder / f"block_{block.line}.sh"
        script.write_text(shell_text(block))
        command = ["bash", "-euo", "pipefail", str(script)]
    proc = subprocess.run(command, cwd=folder, env=environment(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (f"{block.id} exited {proc.returncode}\n--- block ---\n{block.text}"
                                  f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    shown = shown_output(block)
    if shown is not None:
        printed = normalized(proc.stdout, folder)
        assert printed == normalized(shown.text, folder), (
            f"{shown.id} is not what {block.id} prints: make the page's block this output\n{printed}")


@pytest.mark.parametrize("block", [_param(b) for b in TESTED])
def test_block(block: Block, tmp_path: Path) -> None:
    assert not tmp_path.resolve().is_relative_to(ROOT), "blocks run outside the checkout"
    if block.long is not None:
        assert block.long, f"{block.id}: '# long:' needs a reason"
        check_syntax(block, tmp_path)
    elif block.file is not None:
        if block.lang == "python":
            compile(block.text, block.id, "exec")
        elif block.lang in PARSED:
            parse(block)
    elif block.lang in PARSED:
        parse(block)
    elif block.executed:
        run_block(block, tmp_path)
    else:
        pytest.fail(f"{block.id}: a code block in language {block.lang!r}: use python, bash, sh, console, "
                    "toml, json, yaml, or text for output")


def test_the_readmes_sample_failure_is_checked_against_what_its_command_prints():
    """The README's first result is a real one: its sample is marked as the output of the command above
    it, so ``test_block`` runs the command and compares (a marker with no executed block above it, or
    on a block that is not ``text``, would compare nothing)."""
    marked = [b for b in BLOCKS if b.after == SHOWS_OUTPUT]
    shown = {s.id for b in BLOCKS if b.executed and (s := shown_output(b)) is not None}
    assert {b.id for b in marked} == shown, "a block marked as output follows no executed block"
    assert any(b.page == "README.md" and "FAIL" in b.text for b in marked), "the README's sample is not checked"


def test_every_block_says_its_language_and_the_docs_have_blocks():
    unnamed = [b.id for b in BLOCKS if not b.lang]
    assert not unnamed, f"code blocks without a language (write ```text for output): {unnamed}"
    assert sum(b.executed for b in BLOCKS) >= 10


# -- links --------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    found = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_links_between_pages_and_their_anchors_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_no_top_level_framework_readmes_are_left():
    assert not list(ROOT.glob("README-*.md")), "framework notes live in docs/frameworks/"


# -- what the reference pages cite --------------------------------------------------------------------

def test_the_tests_robustness_md_cites_exist():
    """docs/robustness.md names the test that holds each promise (``file.py::test``, ``::test`` for
    another test of the file before it): each must exist in tests/."""
    cited, missing, current = 0, [], None
    text = (ROOT / "docs" / "robustness.md").read_text(encoding="utf-8")
    for file, name in re.findall(r"`(test_\w+\.py)?(?:::(test_\w+))?`", text):
        current = file or current
        if file and not (ROOT / "tests" / file).exists():
            missing.append(file)
        if name:
            cited += 1
            if current is None or f"def {name}(" not in (ROOT / "tests" / current).read_text(encoding="utf-8"):
                missing.append(f"{current}::{name}")
    assert cited >= 15 and not missing, missing


def test_cli_md_lists_every_command_and_exit_status():
    from harness.commands.main import SUBCOMMANDS
    from harness.judge.verdicts import EXIT_STATUSES

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert all(f"`clipcheck {command}" in text for command in SUBCOMMANDS)
    table = text.split("## Exit statuses", 1)[1]
    for status in EXIT_STATUSES:
        assert re.search(rf"^\| \*\*{status}\b", table, re.M), f"exit status {status} is not in docs/cli.md"


def test_the_example_clip_is_the_one_the_docs_show():
    """examples/my_clip.py (run over every control layout by tests/test_distributed.py) is the clip of
    docs/writing-a-target.md, line for line after each one's first line."""
    shown = next(b for b in BLOCKS if b.page == "docs/writing-a-target.md" and b.file == "my_clip.py")
    example = (ROOT / "examples" / "my_clip.py").read_text(encoding="utf-8")
    assert example.split("\n", 1)[1] == shown.text.split("\n", 1)[1]
