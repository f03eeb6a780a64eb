"""Every test (tests/ and lab/tests/) that starts processes forming a torch.distributed group carries the
``launches_processes`` mark, which conftest.py turns into one pytest-xdist group, so that two such tests never race
for accelerate's rendezvous port (29500). Read with ast: nothing is imported or executed.

A test starts such processes when its body, its decorators, its fixtures of the same file, or the module-level
functions and constants they name (followed to any depth) hold one of:

* a launcher command: ``accelerate launch`` (also as adjacent "accelerate", "launch" items), ``-m
  accelerate.commands.launch``, ``torchrun``, ``-m torch.distributed.run`` / ``.launch``, ``deepspeed`` as a
  command's first item or ``deepspeed.launcher.runner``;
* a call of ``torch.multiprocessing.spawn`` / ``mp.spawn`` / ``start_processes``, or of ``init_process_group``
  (a group of the test's own processes);
* the name of one of the repository's shell scripts (scripts/, lab/) that runs a launcher command.

Asserts and docstrings are not read (a launcher command there is an expectation, not a process)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from checkout import ROOT

MARK = "launches_processes"
TEST_DIRS = (ROOT / "tests", ROOT / "lab" / "tests")
SCRIPT_DIRS = (ROOT / "scripts", ROOT / "lab")

LAUNCHER_MODULES = {"accelerate.commands.launch", "torch.distributed.run", "torch.distributed.launch",
                    "deepspeed.launcher.runner", "torchrun"}
LAUNCHER_TEXT = re.compile(r"\baccelerate\s+launch\b|(?<![\w.])torchrun\b|\btorch\.distributed\.(?:run|launch)\b|"
                           r"\baccelerate\.commands\.launch\b|^\s*deepspeed\s")
SPAWNING_CALLS = {"spawn", "start_processes", "init_process_group"}  # torch.multiprocessing / torch.distributed
SPAWN_OWNERS = {"mp", "torch.multiprocessing", "multiprocessing", "dist", "torch.distributed"}

# Files whose launcher commands start no processes that rendezvous, with why.
NO_RENDEZVOUS = {
    "tests/packaging/test_launch_scripts.py": "accelerate there is a stand-in on PATH that prints its arguments",
    "tests/packaging/test_test_marks.py": "its launcher commands are sample sources for the reader's own tests",
}


def launching_scripts() -> set[str]:
    """The names of the repository's shell scripts that run a launcher command (outside comments)."""
    found = set()
    for directory in SCRIPT_DIRS:
        for path in directory.rglob("*.sh"):
            lines = path.read_text(encoding="utf-8").splitlines()
            if any(LAUNCHER_TEXT.search(line) for line in lines if not line.lstrip().startswith("#")):
                found.add(path.name)
    return found


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_mark(node: ast.AST) -> bool:
    """``pytest.mark.launches_processes`` (called or not), or a list/tuple holding it."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_mark(e) for e in node.elts)
    if isinstance(node, ast.Call):
        node = node.func
    return _dotted(node).endswith(f"mark.{MARK}")


@dataclass
class Finding:
    test: str  # path::name
    evidence: str
    marked: bool


class _Module:
    """One test file: its module-level functions and constants, and what each starts (memoised)."""

    def __init__(self, source: str, scripts: set[str]):
        self.tree = ast.parse(source)
        self.scripts = scripts
        self.defs: dict[str, ast.AST] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name) and node.value is not None:
                        self.defs[target.id] = node.value
        self.module_marked = any(
            isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            and _is_mark(node.value) for node in self.tree.body)
        self._memo: dict[str, str | None] = {}

    def _name_evidence(self, name: str) -> str | None:
        if name not in self._memo:
            self._memo[name] = None  # a cycle adds nothing
            node = self.defs.get(name)
            found = self.evidence(node) if node is not None else None
            self._memo[name] = f"{name}: {found}" if found else None
        return self._memo[name]

    def evidence(self, node: ast.AST) -> str | None:
        """What in ``node`` (or in what it names) starts processes that rendezvous, or None."""
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Assert):
                continue  # an expectation, not a process
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
                body = n.body
                if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]  # the docstring
                stack.extend(body)
                if not isinstance(n, ast.ClassDef):
                    stack.extend(n.args.defaults + [d for d in n.args.kw_defaults if d is not None])
                continue
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                if n.value in LAUNCHER_MODULES or LAUNCHER_TEXT.search(n.value):
                    return repr(n.value)
                if n.value.endswith(".sh") and Path(n.value).name in self.scripts:
                    return f"{n.value} (runs a launcher)"
            if isinstance(n, (ast.List, ast.Tuple)):
                items = [e.value if isinstance(e, ast.Constant) else None for e in n.elts]
                if any(a == "accelerate" and b == "launch" for a, b in zip(items, items[1:])):
                    return "'accelerate', 'launch'"
                if items[:1] == ["deepspeed"]:
                    return "'deepspeed' (the launcher)"
            if isinstance(n, ast.Call):
                func = _dotted(n.func)
                owner, _, called = func.rpartition(".")
                if called in SPAWNING_CALLS and (owner in SPAWN_OWNERS or called == "init_process_group"):
                    return f"{func}()"
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in self.defs:
                found = self._name_evidence(n.id)
                if found:
                    return found
            stack.extend(ast.iter_child_nodes(n))
        return None

    def tests(self):
        """(name, function, marked) of each test function, module-level or in a Test class."""
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                yield node.name, node, self.module_marked or any(_is_mark(d) for d in node.decorator_list)
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                class_marked = self.module_marked or any(_is_mark(d) for d in node.decorator_list)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                        yield (f"{node.name}::{item.name}", item,
                               class_marked or any(_is_mark(d) for d in item.decorator_list))

    def test_evidence(self, function: ast.FunctionDef) -> str | None:
        parts = [d for d in function.decorator_list if not _is_mark(d)] + [function]
        parts += [self.defs[a.arg] for a in function.args.args if isinstance(self.defs.get(a.arg), ast.FunctionDef)]
        for part in parts:
            found = self.evidence(part)
            if found:
                return found
        return None


def findings(source: str, label: str, scripts: set[str]) -> list[Finding]:
    module = _Module(source, scripts)
    out = []
    for name, function, marked in module.tests():
        found = module.test_evidence(function)
        if found:
            out.append(Finding(f"{label}::{name}", found, marked))
    return out


def suite_files() -> list[Path]:
    return sorted(p for d in TEST_DIRS for p in d.rglob("test_*.py"))


def test_every_test_that_starts_a_process_group_is_marked():
    scripts = launching_scripts()
    launching, unmarked = [], []
    for path in suite_files():
        label = path.relative_to(ROOT).as_posix()
        if label in NO_RENDEZVOUS:
            continue
        for f in findings(path.read_text(encoding="utf-8"), label, scripts):
            launching.append(f)
            if not f.marked:
                unmarked.append(f"{f.test} ({f.evidence})")
    assert len(launching) >= 10, launching  # the reader still sees the suite's launches
    assert not unmarked, (f"these tests start processes that form a torch.distributed group but lack "
                          f"@pytest.mark.{MARK} (conftest.py keeps such tests on one xdist worker): {unmarked}")


def test_no_rendezvous_files_exist():
    assert all((ROOT / label).is_file() for label in NO_RENDEZVOUS), NO_RENDEZVOUS


def test_the_shipped_launch_scripts_are_recognised():
    assert {"launch_node.sh", "launch_multi_node.sh", "recipe_long_context.sh"} <= launching_scripts()


UNMARKED = '''
import subprocess, sys
import pytest
ACCELERATE = (sys.executable, "-m", "accelerate.commands.launch")
LAUNCHERS = {"ddp": (*ACCELERATE, "--num_processes", "2")}

def _run(cmd):
    return subprocess.run(cmd)

@pytest.fixture
def group():
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500", rank=0, world_size=1)

def test_direct():
    _run(["accelerate", "launch", "x.py"])

def test_through_constants():
    _run([*LAUNCHERS["ddp"], "x.py"])

def test_torchrun():
    _run("torchrun --nproc_per_node 2 x.py".split())

def test_spawn():
    import torch.multiprocessing as mp
    mp.spawn(print, nprocs=2)

def test_fixture(group):
    pass

def test_script():
    _run(["bash", "scripts/launch_node.sh"])

def test_plain():
    """Not accelerate launch: only a docstring says it."""
    _run([sys.executable, "x.py"])
    assert "accelerate launch x.py" in "README"
'''


def test_the_reader_finds_each_way_of_starting_processes():
    found = {f.test.split("::")[1]: f for f in findings(UNMARKED, "t.py", {"launch_node.sh"})}
    assert set(found) == {"test_direct", "test_through_constants", "test_torchrun", "test_spawn", "test_fixture",
                          "test_script"}
    assert not any(f.marked for f in found.values())
    assert "LAUNCHERS" in found["test_through_constants"].evidence


@pytest.mark.parametrize("mark", ["pytestmark = pytest.mark.launches_processes",
                                  "pytestmark = [pytest.mark.slow, pytest.mark.launches_processes]"])
def test_the_reader_sees_module_marks(mark):
    assert all(f.marked for f in findings(UNMARKED + "\n" + mark + "\n", "t.py", {"launch_node.sh"}))


def test_the_reader_sees_function_and_class_marks():
    source = UNMARKED.replace("def test_direct", "@pytest.mark.slow\n@pytest.mark.launches_processes\ndef test_direct")
    source += ("\n@pytest.mark.launches_processes\nclass TestGroup:\n    def test_in_class(self):\n"
               "        _run(['accelerate', 'launch'])\n")
    marked = {f.test.split("::", 1)[1] for f in findings(source, "t.py", set()) if f.marked}
    assert marked == {"test_direct", "TestGroup::test_in_class"}
