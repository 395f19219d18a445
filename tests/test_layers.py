"""The package in three layers, as docs/training.md's table of its modules gives them, held
against its imports (every import of ddpgpt in a module, at its top or in a function): the
ground imports nothing above it; the library imports none of the process around it, so that a
loop of one's own, or Lightning, uses it without them; no cycle, and no chain of imports longer
than LONGEST arrows. The table lists every module."""
import ast
import functools
import glob
import os
import re
import subprocess
import sys

from conftest import ROOT

with open(os.path.join(ROOT, "docs", "training.md")) as f:
    LAYERS = dict(re.findall(r"^\| `(\w+)\.py` \| (ground|library|process) \|", f.read(), re.M))
PROCESS = {m for m, layer in LAYERS.items() if layer == "process"}
LONGEST = 7


def imports(path):
    """The ddpgpt modules that the file at path imports."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpgpt"):
            found |= {a.name for a in node.names} if node.module == "ddpgpt" else \
                {node.module.removeprefix("ddpgpt.")}
        elif isinstance(node, ast.Import):
            found |= {a.name[7:] for a in node.names if a.name.startswith("ddpgpt.")}
    return found


GRAPH = {os.path.basename(p)[:-3]: imports(p) for p in glob.glob(f"{ROOT}/ddpgpt/*.py")
         if not p.endswith("__init__.py")}


def layer(module):
    return ("ground", "library", "process").index(LAYERS[module])


@functools.cache
def longest_chain(module, seen=()):
    """The longest chain of imports from module, as a list of modules; a cycle raises."""
    assert module not in seen, f"a cycle of imports: {' -> '.join((*seen, module))}"
    return max(([module, *longest_chain(m, (*seen, module))] for m in GRAPH[module]), key=len,
               default=[module])


def test_nothing_imports_upward_no_cycle_and_no_long_chain():
    assert LAYERS.keys() == GRAPH.keys(), LAYERS.keys() ^ GRAPH.keys()
    upward = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if layer(d) > layer(m)]
    assert not upward and PROCESS, upward
    chain = max(map(longest_chain, GRAPH), key=len)
    assert len(chain) - 1 <= LONGEST, " -> ".join(chain)


def test_the_library_loads_none_of_the_process_and_lightnings_example_stands_on_it():
    """In a fresh interpreter; and the Lightning example's imports, with all they import."""
    library = ", ".join(f"ddpgpt.{m}" for m in ("data", "model", "parallel", "optim",
                                                 "checkpoint", "evaluation"))
    loaded = subprocess.run([sys.executable, "-c", f"import sys, {library}; print(*sys.modules)"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not {f"ddpgpt.{m}" for m in PROCESS} & set(loaded)
    needed = imports(os.path.join(ROOT, "examples", "lightning_datamodule.py"))
    while (more := set().union(*(GRAPH[m] for m in needed)) - needed):
        needed |= more
    assert needed and not needed & PROCESS, needed & PROCESS
