"""The library's layout holds: no import cycle, no strategy reaching into another's
private names, no module grown past one concept's size, and every module named in a
string (``python -m``, a pytest plugin, the launcher's frame filter) still there."""
import ast
import importlib.util
import re
from pathlib import Path

import pytest

import distlab
from distlab.runtime import report

LIB = Path(distlab.__file__).resolve().parent
MODULES = {
    ".".join(("distlab", *p.relative_to(LIB).with_suffix("").parts)).removesuffix(".__init__"): p
    for p in sorted(LIB.rglob("*.py")) if "exercises" not in p.parts}
MAX_LINES = 500  # about one concept; a module past it is two


def _imports(name: str, path: Path):
    """(imported module, names) for every import in the module, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            yield base, [alias.name for alias in node.names]


def _graph() -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names in _imports(name, path):
            # `from distlab.pp import schedule` imports the submodule; other names, the package
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            if len(targets) < len(names) or not names:
                targets.append(module)
            graph[name].update(t for t in targets if t in MODULES and t != name)
    return graph


def _cycle(graph) -> list[str]:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_import_graph_has_no_cycle():
    cycle = _cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = _graph()
    graph["distlab.comm"] = graph["distlab.comm"] | {"distlab.launch"}
    graph["distlab.launch"] = graph["distlab.launch"] | {"distlab.comm"}
    assert _cycle(graph)


def test_no_package_imports_another_ones_private_names():
    def owner(module):
        parts = module.split(".")
        return ".".join(parts[:2])

    bad = [f"{name} imports {module}.{n}" for name, path in MODULES.items()
           for module, names in _imports(name, path) if module.startswith("distlab")
           for n in names if n.startswith("_") and owner(module) != owner(name)]
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_outgrows_one_concept(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it by concept"


def _module_strings():
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"distlab(\.\w+)+", node.value):
                yield name, node.value


def test_every_module_named_in_a_string_exists():
    named = list(_module_strings())
    wanted = {"distlab.runtime.worker", "distlab.runtime.forkserver",
              "distlab.grading.sandbox", "distlab.grading.plugin"}
    assert wanted <= {value for _, value in named}, "the -m and -p paths are found"
    missing = [f"{where}: {value}" for where, value in named if not _resolves(value)]
    assert not missing, missing


def _resolves(dotted: str) -> bool:
    """A module, or a module's attribute (``distlab.zero.memory.accounting``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            continue
        if found is not None:
            obj = importlib.import_module(module)
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def test_the_launch_report_filters_frames_of_files_that_exist():
    for part in report.MACHINERY:
        if part.startswith("distlab/"):
            assert (LIB.parent / part).is_file(), f"report.MACHINERY names {part}, which is gone"


def test_an_installed_kit_finds_its_exercise_tests(tmp_path):
    """Built as a wheel and installed elsewhere, the grader finds every exercise's tests
    beside itself, not in a source checkout."""
    import subprocess
    import sys

    root = LIB.parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "wheel"), str(root)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("distlab-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True, timeout=300,
                   capture_output=True)
    probe = ("import distlab.grading.runner as r, sys; "
             "print(r.TESTS); print(sorted(p.name for p in r.TESTS.glob('*.py')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(tmp_path / "site"),
                                           "PATH": "/usr/bin:/bin"}, check=True).stdout
    where, names = out.splitlines()
    assert where.startswith(str(tmp_path / "site")), where
    ours = sorted(p.name for p in (LIB / "grading" / "exercises").glob("*.py"))
    assert names == str(ours)


def test_every_answer_module_imports_first():
    """Each answer module the grader imports in its ranks (``answers.hidden_modules``) imports in a process where no other distlab
    module is loaded: a module that a package re-exports and that imports that package's
    submodules at its top fails here (the package imports it back before it is defined),
    though the graph above, which has no edge from a submodule to its package, passes."""
    import json
    import subprocess
    import sys

    from distlab.grading import answers

    names = sorted(answers.hidden_modules())
    code = ("import importlib, json, sys\nimport torch\nfailed = {}\n"
            f"for name in {names!r}:\n"
            "    for m in [m for m in sys.modules if m.split('.')[0] == 'distlab']:\n"
            "        del sys.modules[m]\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception as e:\n        failed[name] = repr(e)\n"
            "print(json.dumps(failed))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, f"imported first, these fail: {failed}"


def _public_non_answers(module: str, named: set[str]) -> list[str]:
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    found = []
    for node in tree.body:
        names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                 [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)])
        found += [n for n in names if not n.startswith("_") and n not in named]
    return found


def test_answers_live_only_where_the_manifest_says():
    """Every module of the manifest holds only answers (its public names are the
    manifest's; private helpers serve them), and no module outside the manifest defines
    an exercise's name."""
    from distlab.grading import answers

    named: dict[str, set[str]] = {}
    for refs in answers.ANSWERS.values():
        for ref in refs:
            module, name = ref.split(":")
            named.setdefault(module, set()).add(name)
    mixed = {m: _public_non_answers(m, named[m]) for m in answers.hidden_modules()}
    assert not any(mixed.values()), {m: found for m, found in mixed.items() if found}
    exercises = set(answers.ANSWERS)
    for module in MODULES:
        if module in named or not module.startswith("distlab."):
            continue
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & exercises, f"{module} defines {defined & exercises}"


def _later_answers_reached(graph, lab_of: dict[str, str]) -> list[str]:
    """"A (lab a) reaches B (lab b)" for every answer module A whose imports, followed
    through the library, reach an answer module B of a later lab b > a."""
    found = []
    for start, lab in sorted(lab_of.items()):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
                    if lab_of.get(nxt, "") > lab:
                        found.append(f"{start} ({lab}) reaches {nxt} ({lab_of[nxt]})")
    return found


def test_no_answer_needs_a_later_labs_answer():
    """A lab's answers are released to students after its deadline and used by the labs
    after it (docs/design.md, "The student edition"): none of them may import, at any
    depth, the answer of a later lab, which is still absent from those editions."""
    from distlab.grading import edition, labs

    lab_of = edition.withheld(-1, labs.exercises())
    assert not _later_answers_reached(_graph(), lab_of)
    # and the check finds one planted
    planted = {**_graph(), "distlab.zero.fsdp": {"distlab.mesh.grid"}}
    assert _later_answers_reached(planted, lab_of) == [
        "distlab.zero.fsdp (05_zero) reaches distlab.mesh.grid (09_capstone)"]
