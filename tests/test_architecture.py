"""The shape ARCHITECTURE.md describes, kept true: the pipeline's folders, the public faces at the
top, no import circle, and a framework registered in one line of scenarios/__init__.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from harness_runs import ROOT

STEPS = {"cases", "targets", "run", "judge", "report", "commands"}
PUBLIC_FACES = {"__init__", "__main__", "api", "auditor", "fuzz", "strategies", "pytest_plugin", "errors", "reference",
                "clipmath"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "scenarios":
        parts = ["harness", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the harness modules it imports, at module level or inside functions alike (imports
    under ``if TYPE_CHECKING`` serve annotations only and are left out)."""
    files = {_module_name(p): p for folder in ("harness", "scenarios") for p in (ROOT / folder).rglob("*.py")
             if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        tree = ast.parse(path.read_text())
        type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                     for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in type_only:  # annotations only: no import at run time
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            found |= {c for c in candidates if c in files and c != name}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle():
    assert cycles(import_graph()) == []


def test_the_judges_modules_share_their_record_types_instead_of_importing_each_other():
    graph = import_graph()
    assert "harness.judge.blame" not in graph["harness.judge.checks"]
    assert "harness.judge.checks" not in graph["harness.judge.blame"]
    assert {"harness.judge.records"} <= graph["harness.judge.checks"] & graph["harness.judge.blame"]


def test_the_cycle_finder_finds_one():  # its positive control
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_is_a_public_face_or_in_the_folder_of_its_step():
    top = {p.stem for p in (ROOT / "harness").glob("*.py")}
    folders = {p.name for p in (ROOT / "harness").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top == PUBLIC_FACES
    assert folders == STEPS


def test_the_steps_depend_downwards_only():
    """cases knows nothing of running, judging or reporting; the judge neither reports nor runs a
    command, and reads the measurements without knowing how they were taken (their types live in
    judge/records, which the runner imports); nothing but commands (and the public faces) imports
    commands. The runner may report: rank 0 writes each record as its case ends."""
    graph = import_graph()
    forbidden = {"cases": {"run", "judge", "report", "commands"}, "judge": {"commands", "report", "run"},
                 "run": {"commands"}, "report": {"commands"}, "targets": {"commands", "report"}}
    bad = []
    for module, deps in graph.items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] not in forbidden:
            continue
        for dep in deps:
            dparts = dep.split(".")
            if len(dparts) >= 3 and dparts[1] in forbidden[parts[1]]:
                bad.append(f"{module} -> {dep}")
    assert bad == []


RUN_ROLES = {"case", "world", "hosts", "guards", "audit"}


def test_run_is_five_folders_by_role():
    run = ROOT / "harness" / "run"
    assert {p.stem for p in run.glob("*.py")} == {"__init__"}
    assert {p.name for p in run.iterdir() if p.is_dir() and p.name != "__pycache__"} == RUN_ROLES


def test_the_run_roles_depend_downwards_only():
    """Hosts feed cases to ranks and the audit runs one on a user's job; a case uses the world's groups
    and the guards; the world (groups, store, devices) and the guards know nothing of cases, hosts or
    audits, so the per-launch caches live with the host (``LaunchState``), not in ``DistWorld``."""
    forbidden = {"world": {"case", "hosts", "audit"}, "guards": {"case", "hosts", "audit"},
                 "case": {"hosts", "audit"}, "audit": {"hosts"}, "hosts": {"audit"}}
    bad = [f"{module} -> {dep}" for module, deps in import_graph().items() for dep in deps
           if module.startswith("harness.run.") and dep.startswith("harness.run.")
           and len(module.split(".")) > 3 and len(dep.split(".")) > 3
           and dep.split(".")[2] in forbidden.get(module.split(".")[2], set())]
    assert bad == []


def private_imports() -> list[str]:
    """``from harness.x import _name``: a module reaching into another's private names."""
    found = []
    for folder in ("harness", "scenarios"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("harness", "scenarios")):
                    found += [f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name}" for alias in node.names
                              if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_anothers_private_names():
    assert private_imports() == []


def test_a_framework_is_one_folder_registered_in_one_line():
    from harness.targets.builtin_scenarios import scenarios_package

    package = scenarios_package()
    for member in package.MEMBERS:
        assert {"SCENARIO", "TARGETS", "FRAMEWORK"} <= set(vars(member)), member.__name__
    folders = {p.name for p in (ROOT / "scenarios").iterdir() if (p / "__init__.py").is_file()}
    assert folders <= {m.__name__.rsplit(".", 1)[1] for m in package.MEMBERS}
    for folder in folders:
        assert (ROOT / "scenarios" / folder / "scenario.py").is_file()
        assert (ROOT / "scenarios" / folder / "adapter.py").is_file()


AXIS_CALL = re.compile(r"""(\.group|\.group_size|\.size|\.has|\.index|\.placement|declared_placement\([^,]+,)\(?\s*["'][a-z_]+["']|mesh\[["'][a-z_]+["']\]""")


def test_mesh_axes_are_named_in_one_place():
    """Code in harness/ and scenarios/ asks for a mesh axis by ``MeshAxis``, never by a bare string
    (``ctx.group("ep")``, ``mesh.size("tp")``, ``ctx.mesh["ep_fsdp"]``); a control line is caught."""
    assert AXIS_CALL.search('ep = ctx.group_size("ep")') and AXIS_CALL.search('m = ctx.mesh["ep_fsdp"]')
    assert not AXIS_CALL.search("ep = ctx.group_size(MeshAxis.EP)")
    bare = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for folder in ("harness", "scenarios") for path in sorted((ROOT / folder).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if AXIS_CALL.search(line) and not line.lstrip().startswith(("#", '"', "*"))]
    assert not bare, bare


def test_every_built_in_scenario_names_its_axes_from_mesh_axis():
    from harness.cases.axes import MeshAxis
    from harness.cases.scenario import ScenarioOptions
    from harness.targets.builtin_scenarios import scenarios_package

    names = set()
    for scenario in scenarios_package().SCENARIOS:
        for world in (1, 2, 4, 8):
            for variant in scenario().variants(world, ScenarioOptions()):
                names |= set(variant.layout.mesh.names)
    assert names and names <= {a.value for a in MeshAxis}, names - {a.value for a in MeshAxis}


def test_the_renamed_spec_package_still_imports_as_the_same_modules():
    """``harness.spec`` became ``harness.cases`` (its ``case`` module ``variant``): old imports in users'
    scenarios keep working, warn, and get the very same module objects (one class identity)."""
    import importlib
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import harness.spec.layout\nexcept DeprecationWarning as w:\n    print('warned:', w)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "warned: harness.spec is now harness.cases" in out.stdout, out.stderr
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old_variant = importlib.import_module("harness.spec.case")
        old_layout = importlib.import_module("harness.spec.layout")
    assert old_variant is importlib.import_module("harness.cases.variant")
    assert old_layout is importlib.import_module("harness.cases.layout")
