"""The package's layer order, checked on every import of every module of ``etc_agent``.

A module may import modules of its own layer and of lower layers, never of a higher one, and no two
modules may import each other at import time (a cycle). Imports inside functions count for the layer
order (they are how a lower layer ends up calling a higher one); imports under ``if TYPE_CHECKING:``
do not (they never run). Strings handed to ``lazy_exports`` or ``importlib.import_module`` are
imports too.

``LAYERS`` below is the contract. A new top-level package of ``etc_agent`` fails
:func:`test_every_package_has_a_layer` until it is placed in the table.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

# Lowest first. A module belongs to the longest entry its dotted name starts with.
LAYERS: dict[str, int] = {
    "etc_agent.utils": 0,  # small shared pieces, nothing else of the package
    "etc_agent.layout": 1,  # where every byte lives for a parallel configuration; pure
    "etc_agent.planner": 2,  # old layout + new layout -> MigrationPlan; pure
    "etc_agent.sim": 3,  # the real planner on model specs, priced under a cost model
    "etc_agent.migrate": 3,  # executes a plan inside live workers (torch.distributed)
    "etc_agent.integrations": 4,  # Megatron adapter the worker calls: migrate and below only
    "etc_agent.data": 4,  # sample order, data position, shares, token dataset, loader; below the worker
    "etc_agent.rendezvous": 5,  # membership store (etcd, embedded), torchrun handler
    "etc_agent.protocol": 5,  # the generation protocol's messages and phases, below agent and worker
    "etc_agent.agent": 6,  # the agent: leader, generations, worker processes
    "etc_agent.worker": 7,  # the worker API (job.start, job.steps) inside training processes
    "etc_agent.cli": 8,  # etcrun, etc-agent
    "etc_agent.examples": 9,  # example training scripts
}
# etc_agent/__init__.py (the public lazy API) may import anything. Importing it gives the worker API
# (etc_agent.init, Job, ...), so an import of the package root counts as an import of this layer.
ROOT = "etc_agent"
ROOT_EXPORTS = "etc_agent.worker"

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "etc_agent"


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # the imported module, as written (resolved to absolute)
    local: bool  # inside a function body: runs when called, not when the module is imported


def module_name(path: Path, root: Path = REPO) -> tuple[str, bool]:
    """Dotted name of a file of the package, and whether it is a package ``__init__``."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import of ``etc_agent`` modules in ``source`` (the text of ``module``), absolute."""
    tree = ast.parse(source, module)
    package = module if is_package else module.rpartition(".")[0]
    # Module-level dicts of strings, for lazy_exports(__name__, _EXPORTS).
    string_dicts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    string_dicts[target.id] = node.value
    found: list[Import] = []

    def add(line: int, target: str, local: bool) -> None:
        if target == ROOT or target.startswith(ROOT + "."):
            found.append(Import(module, line, target, local))

    def strings(node: ast.expr) -> list[str]:
        if isinstance(node, ast.Name) and node.id in string_dicts:
            node = string_dicts[node.id]
        if isinstance(node, ast.Dict):
            return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        return []

    def visit(node: ast.AST, local: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, local)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name, local)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                # from X import Y: the module X.Y where there is one (resolve() decides), else X.
                add(node.lineno, prefix if alias.name == "*" else f"{prefix}.{alias.name}", local)
        elif isinstance(node, ast.Call) and _call_name(node.func) in ("lazy_exports", "import_module"):
            args = node.args[1:] if _call_name(node.func) == "lazy_exports" else node.args[:1]
            for arg in args:
                for text in strings(arg):
                    add(node.lineno, text, True)
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    for node in tree.body:
        visit(node, False)
    return found


def resolve(target: str, modules: set[str]) -> str:
    """The module an import names: ``X.Y`` where that module exists, else the longest existing prefix."""
    name = target
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or target


def layer_of(module: str) -> str | None:
    """The entry of ``LAYERS`` ``module`` belongs to; ``None`` where it has none."""
    if module == ROOT:
        return ROOT_EXPORTS
    best = None
    for key in LAYERS:
        if (module == key or module.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return best


def _describe(key: str | None) -> str:
    return f"layer {LAYERS[key]} {key}" if key is not None else "no layer"


def layer_violations(imports: list[Import], modules: set[str]) -> list[str]:
    """``module:line -> imported (layers)`` for every import of a higher layer or of an unplaced module."""
    problems = []
    seen = set()
    for imp in imports:
        target = resolve(imp.target, modules)
        if imp.module == ROOT or (imp.module, imp.line, target) in seen:
            continue
        seen.add((imp.module, imp.line, target))
        source_key, target_key = layer_of(imp.module), layer_of(target)
        where = "function-local" if imp.local else "module-level"
        if source_key is None or target_key is None:
            unplaced = imp.module if source_key is None else target
            problems.append(
                f"{imp.module}:{imp.line} -> {target}: {unplaced} has no layer; place its package in LAYERS"
            )
        elif LAYERS[target_key] > LAYERS[source_key]:
            problems.append(
                f"{imp.module}:{imp.line} -> {target} ({where}): {_describe(source_key)} imports "
                f"{_describe(target_key)}"
            )
    return problems


def import_graph(imports: list[Import], modules: set[str], include_local: bool) -> dict[str, dict[str, int]]:
    """``graph[a][b]``: the first line where module ``a`` imports module ``b``."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for imp in imports:
        if imp.local and not include_local:
            continue
        target = resolve(imp.target, modules)
        if target in modules and target != imp.module:
            graph[imp.module].setdefault(target, imp.line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return sorted(found)


def describe_cycle(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    edges = [f"{a}:{line} -> {b}" for a in component for b, line in sorted(graph[a].items()) if b in members]
    return "cycle between " + ", ".join(component) + ": " + "; ".join(edges)


def package_sources(package: Path = PACKAGE, root: Path = REPO) -> dict[str, tuple[str, bool]]:
    """Every module of the package: dotted name -> (source, is a package ``__init__``)."""
    sources = {}
    for path in sorted(package.rglob("*.py")):
        name, is_package = module_name(path, root)
        sources[name] = (path.read_text(), is_package)
    return sources


def all_imports(sources: dict[str, tuple[str, bool]]) -> list[Import]:
    return [imp for name, (text, is_package) in sources.items() for imp in imports_of(name, text, is_package)]


# The package as it is.


def _package_imports() -> tuple[list[Import], set[str]]:
    sources = package_sources()
    return all_imports(sources), set(sources)


def test_every_package_has_a_layer():
    modules = set(package_sources())
    unplaced = sorted(m for m in modules if m != ROOT and layer_of(m) is None)
    assert unplaced == [], f"modules outside every layer; place their package in LAYERS of {__file__}: {unplaced}"
    stale = sorted(key for key in LAYERS if key not in modules)
    assert stale == [], f"LAYERS names packages that no longer exist; remove them: {stale}"


def test_no_module_imports_a_higher_layer():
    imports, modules = _package_imports()
    problems = layer_violations(imports, modules)
    assert problems == [], "imports against the layer order (tests/test_layers.py LAYERS):\n" + "\n".join(problems)


def test_the_worker_imports_nothing_of_the_agent():
    """The two sides of the generation protocol share only what lies below both (``etc_agent.protocol``
    and lower): a worker process never loads the agent's code, function-local imports included."""
    imports, _ = _package_imports()
    found = [
        f"{imp.module}:{imp.line} -> {imp.target}"
        for imp in imports
        if imp.module.startswith("etc_agent.worker") and imp.target.startswith("etc_agent.agent")
    ]
    assert found == [], "the worker imports the agent:\n" + "\n".join(found)


def test_no_import_cycle_at_import_time():
    imports, modules = _package_imports()
    graph = import_graph(imports, modules, include_local=False)
    found = [describe_cycle(c, graph) for c in cycles(graph)]
    assert found == [], "module-level import cycles:\n" + "\n".join(found)


def test_no_import_cycle_between_packages_through_function_local_imports():
    """Function-local imports inside one package may go both ways; between packages they may not."""
    imports, modules = _package_imports()
    graph = import_graph(imports, modules, include_local=True)
    packages: dict[str, dict[str, int]] = {}
    for a, targets in graph.items():
        pa = layer_of(a) or a
        for b, line in targets.items():
            pb = layer_of(b) or b
            if pa != pb and a != ROOT:
                packages.setdefault(pa, {}).setdefault(pb, line)
    for p in list(packages.values()):
        for b in p:
            packages.setdefault(b, {})
    found = [" <-> ".join(c) for c in cycles(packages)]
    assert found == [], "packages that import each other (function-local imports included):\n" + "\n".join(found)


def test_no_import_cycle_even_through_function_local_imports():
    """Between any two modules, function-local imports included: one of them would be a room too many."""
    imports, modules = _package_imports()
    graph = import_graph(imports, modules, include_local=True)
    found = [describe_cycle(c, graph) for c in cycles(graph)]
    assert found == [], "import cycles (function-local imports included):\n" + "\n".join(found)


# Room sizes: a module or function past these has more than one job.

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
SIZED_PACKAGES = ("agent", "worker", "rendezvous", "planner", "migrate")
"""Packages whose functions are held to ``MAX_FUNCTION_LINES``."""


def long_functions(module: str, source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``module:line name (n lines)`` for every function of ``source`` longer than ``limit`` lines,
    counted from ``def`` (decorators excluded) to its last line, docstring included."""
    found = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{module}:{node.lineno} {node.name} ({length} lines)")
    return found


def _outside_examples(name: str) -> bool:
    return not name.startswith(f"{ROOT}.examples")


def test_no_module_is_over_500_lines():
    found = [
        f"{name} ({len(text.splitlines())} lines)"
        for name, (text, _) in package_sources().items()
        if _outside_examples(name) and len(text.splitlines()) > MAX_MODULE_LINES
    ]
    assert found == [], f"modules over {MAX_MODULE_LINES} lines; split them by job:\n" + "\n".join(found)


def test_no_function_of_the_core_is_over_60_lines():
    found = [
        problem
        for name, (text, _) in package_sources().items()
        if name.split(".")[1:2] and name.split(".")[1] in SIZED_PACKAGES
        for problem in long_functions(name, text)
    ]
    assert found == [], f"functions over {MAX_FUNCTION_LINES} lines; give their parts names:\n" + "\n".join(found)


def test_the_size_checker_counts_from_def_to_the_last_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    source = f"@decorator\ndef fits():\n{body}\n\ndef too_long():\n{body}    x = 1\n"
    assert long_functions("m", source) == ["m:64 too_long (61 lines)"]


# The checker itself.


def _check(sources: dict[str, str]) -> list[str]:
    parsed = {name: (text, False) for name, text in sources.items()}
    modules = set(parsed) | set(LAYERS)
    return layer_violations(all_imports(parsed), modules)


def test_the_checker_catches_an_upward_import():
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from etc_agent.utils import jsonline\n"
        "if TYPE_CHECKING:\n"
        "    from etc_agent.worker.job import Job\n"
        "def f():\n"
        "    from ..worker import job\n"
        "    import etc_agent.cli\n"
    )
    problems = _check({"etc_agent.layout.fake": source, "etc_agent.worker.job": ""})
    assert problems == [
        "etc_agent.layout.fake:7 -> etc_agent.worker.job (function-local): layer 1 etc_agent.layout imports "
        "layer 7 etc_agent.worker",
        "etc_agent.layout.fake:8 -> etc_agent.cli (function-local): layer 1 etc_agent.layout imports "
        "layer 8 etc_agent.cli",
    ]


def test_the_checker_resolves_relative_imports_and_lazy_exports():
    init = (
        "from etc_agent.utils.lazy import lazy_exports\n"
        '_E = {"x": "etc_agent.agent.agent"}\n'
        "__getattr__ = lazy_exports(__name__, _E)\n"
    )
    imports = imports_of("etc_agent.planner", init, is_package=True)
    assert [(i.target, i.local) for i in imports] == [
        ("etc_agent.utils.lazy.lazy_exports", False),
        ("etc_agent.agent.agent", True),
    ]
    imports = imports_of("etc_agent.planner.core", "from . import plan\nfrom .. import layout\nfrom .x import y\n")
    assert [i.target for i in imports] == ["etc_agent.planner.plan", "etc_agent.layout", "etc_agent.planner.x.y"]
    assert resolve("etc_agent.planner.x.y", {"etc_agent.planner.x", "etc_agent.planner"}) == "etc_agent.planner.x"


def test_the_checker_asks_to_place_an_unknown_package():
    problems = _check({"etc_agent.k9": "from etc_agent.layout import boxes\n"})
    assert problems == ["etc_agent.k9:1 -> etc_agent.layout: etc_agent.k9 has no layer; place its package in LAYERS"]
    assert _check({"etc_agent.layout.fake": "import etc_agent\n"})[0].endswith("imports layer 7 etc_agent.worker")


def test_the_checker_finds_a_cycle():
    sources = {
        "etc_agent.a": ("import etc_agent.b\n", False),
        "etc_agent.b": ("def f():\n    import etc_agent.a\n", False),
    }
    imports = all_imports(sources)
    assert cycles(import_graph(imports, set(sources), include_local=False)) == []
    graph = import_graph(imports, set(sources), include_local=True)
    assert [describe_cycle(c, graph) for c in cycles(graph)] == [
        "cycle between etc_agent.a, etc_agent.b: etc_agent.a:1 -> etc_agent.b; etc_agent.b:2 -> etc_agent.a"
    ]


@pytest.mark.parametrize("guard", ["TYPE_CHECKING", "typing.TYPE_CHECKING"])
def test_type_checking_imports_are_allowed(guard):
    source = f"import typing\nfrom typing import TYPE_CHECKING\nif {guard}:\n    from etc_agent.cli import main\n"
    assert _check({"etc_agent.layout.fake": source}) == []
