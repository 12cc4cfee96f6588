"""The codebase's layering rules, checked on the source (no imports executed).

- no import circles among the project's modules (any import, at the top or inside a function);
- imports inside functions only of optional dependencies (the GPU stack, plotting, evaluation, data extras),
  so a reader finds every module's dependencies at its top;
- parallelism is applied from outside the model: `mhl_jax.parallel` depends on the MoE core, never on
  `mhl_jax.model`, and the model never on `mhl_jax.parallel`; `mhl_jax.infer` and `mhl_jax.runtime` (what train and
  infer share) do not depend on `mhl_jax.train`;
- no A/B switches (module-level True/False) and no work-log dates in library code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("mhl_jax", "kernels")
# Optional dependencies (extras) and the modules that import them at their top: imported where they are used.
OPTIONAL = ("triton", "jax_triton", "torch", "tensorboardX", "matplotlib", "lm_eval", "datasets", "tiktoken",
            "safetensors", "kernels", "mhl_jax.moe.gpu", "mhl_jax.model.flash_attention", "mhl_jax.model.cross_entropy",
            "mhl_jax.harness",
            "pydoc_data", "absl", "tokenizers")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    out["train"] = ROOT / "train.py"
    return out


MODULES = _modules()


def _imported(node: ast.AST, module: str) -> list[str]:
    """The project modules (or other top-level names) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against the importing package
            base = module.split(".")[: -node.level]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        # `from pkg import sub` may name a submodule
        return [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
    return []


def _imports(module: str, top_level: bool) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    body = tree.body if top_level else [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                                     ast.AsyncFunctionDef))]
    nodes = []
    if top_level:
        for n in body:  # top-level statements, including those under `if TYPE_CHECKING` / try
            nodes.extend(m for m in ast.walk(n) if isinstance(m, (ast.Import, ast.ImportFrom))
                         and not _inside_function(n, m))
    else:
        for f in body:
            nodes.extend(m for m in ast.walk(f) if isinstance(m, (ast.Import, ast.ImportFrom)))
    for n in nodes:
        found.update(_imported(n, module))
    return found


def _inside_function(top: ast.AST, node: ast.AST) -> bool:
    if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return any(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in ast.walk(m)
                   for m in ast.walk(top))
    return False


def _project(names: set[str]) -> set[str]:
    """Project modules among imported names (a name that is a package's attribute maps to the package)."""
    out = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


# every import, at the top or inside a function: a circle held apart by a function-level import is still a circle
GRAPH = {m: _project(_imports(m, top_level=True) | _imports(m, top_level=False)) - {m} for m in MODULES}


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_circles():
    # parent packages' __init__ files are imported on the way but import nothing here
    circles = sorted(m for m in MODULES if m in _reach(m))
    assert not circles, f"modules on an import circle: {circles}"


def test_function_level_imports_are_optional_dependencies():
    bad = {}
    for m in MODULES:
        names = {n for n in _imports(m, top_level=False) if not n.startswith(OPTIONAL)}
        if names:
            bad[m] = sorted(names)
    assert not bad, f"imports inside functions of non-optional modules (move them to the top): {bad}"


@pytest.mark.parametrize("module,forbidden", [
    ("mhl_jax.parallel", "mhl_jax.model"),
    ("mhl_jax.model", "mhl_jax.parallel"),
    ("mhl_jax.moe", "mhl_jax.model"),
    ("mhl_jax.infer", "mhl_jax.train"),
    ("mhl_jax.runtime", "mhl_jax.train"),
])
def test_layering(module, forbidden):
    starts = [m for m in MODULES if m == module or m.startswith(module + ".")]
    reached = {(s, r) for s in starts for r in _reach(s) if r == forbidden or r.startswith(forbidden + ".")}
    assert not reached, f"{module} must not depend on {forbidden}: {sorted(reached)}"


SWITCH = re.compile(r"^[A-Z][A-Z0-9_]+\s*(:\s*bool\s*)?=\s*(True|False)\s*(#.*)?$")
WORK_LOG = re.compile(r"20\d\d-[01]\d-[0-3]\d|[Ss]ession \d|NOTES\.md|DESIGN\.md|METHOD\.md")


def test_no_switches_or_work_log_in_library():
    switches, log = [], []
    for m, path in MODULES.items():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if SWITCH.match(line):
                switches.append(f"{m}:{i}: {line.strip()}")
            if WORK_LOG.search(line):
                log.append(f"{m}:{i}: {line.strip()[:80]}")
    assert not switches, "module-level True/False switches (a decision made is code):\n" + "\n".join(switches)
    assert not log, "dates, session numbers or outside citations in library code:\n" + "\n".join(log)
