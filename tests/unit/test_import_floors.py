"""The rooms of ``proxy/`` and ``loadtests/`` import only downward (DESIGN.md,
"Layout (target)").

A room is a package directly under the tree's root (``proxy/api/``) or a top-level
module (``proxy/config.py``); the root's ``__init__.py`` is a room on the ground
floor. Every ``import`` and ``from ... import`` in the source is read with
:mod:`ast`, at module level and inside functions alike, and:

- every room is on a floor, and every floor's room exists;
- no room imports a room on a higher floor;
- no two rooms import each other, and the rooms have no cycle (rooms on one floor
  may import each other one way);
- the serve path never imports the test bench: ``proxy`` imports ``loadtests`` only
  where :data:`PROXY_BENCH_DOORS` lists, and only inside a function; and the bench
  never imports proxy's command line, which is on top of everything.

A failure names each file and line that imports what it should not.
"""

from __future__ import annotations

import ast
import graphlib
import itertools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROXY_FLOORS: tuple[tuple[str, ...], ...] = (
    ("__init__", "config", "clock", "help_format", "logs", "availability"),  # ground
    ("scheduler",),
    ("engines",),
    ("openai",),
    ("admission", "metrics", "cards"),
    ("replicas",),
    ("api",),
    ("batch",),
    ("server",),  # the composition root: startup and shutdown
    ("process",),  # the proxy as processes: uvicorn and its drain, workers
    ("cli",),  # the command line; only __main__ imports it
    ("__main__",),
)
"""proxy's floors, lowest first."""

LOADTESTS_FLOORS: tuple[tuple[str, ...], ...] = (
    ("__init__", "support"),
    ("engine_io",),
    ("sim",),
    ("probe",),
    ("harness",),
    ("compare", "bench"),
    ("demo",),
    ("cli",),
)
"""loadtests' floors, lowest first (loadtests may import proxy)."""

PROXY_BENCH_DOORS = {("proxy/cli.py", "loadtests.cli")}
"""The only imports of the test bench in proxy: the bench's subcommands (``sim``,
``probe``, ``demo``, ``loadtest``), each inside the function that runs one."""

PROXY_COMMAND_LINE = ("proxy.cli", "proxy.__main__")


@dataclass(frozen=True)
class Import:
    """One imported module, as a file states it."""

    file: str  # relative to the repository, e.g. "proxy/cli.py"
    line: int
    room: str  # the importing file's room
    module: str  # the imported module, absolute: "proxy.api.relay"
    lazy: bool  # inside a function, so it runs only when that function does

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module}" + (" (lazily)" if self.lazy else "")


def module_name(path: Path, root: Path) -> tuple[str, ...]:
    """``proxy/api/relay.py`` -> ("proxy", "api", "relay"); a package's ``__init__``
    -> the package's name."""
    parts = path.relative_to(root).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def room_of(path: Path, root: Path, package: str) -> str:
    """The room of a file under ``root/package``: its package or top-level module."""
    parts = path.relative_to(root / package).with_suffix("").parts
    return parts[0]


def imported_modules(node: ast.Import | ast.ImportFrom, here: tuple[str, ...]) -> list[str]:
    """The modules an import statement in module ``here`` imports, absolute.
    ``from P import a`` counts ``P.a`` as well as ``P`` (``a`` may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = list(here)
    if node.level:  # relative: from the package the module is in
        base = base[: len(base) - node.level]
        module = ".".join([*base, node.module] if node.module else base)
    else:
        module = node.module or ""
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


class ImportWalker(ast.NodeVisitor):
    """Every import statement of one file, with whether it sits in a function."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
        self._depth = 0

    def _inside(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _inside

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._depth > 0))


def imports_of(package: str, root: Path = ROOT) -> list[Import]:
    """Every module imported anywhere under ``root/package``."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        here = module_name(path, root)
        if path.name == "__init__.py":
            here = (*here, "__init__")  # relative imports resolve from the package
        walker = ImportWalker()
        walker.visit(ast.parse(path.read_text(), str(path)))
        for node, lazy in walker.found:
            for module in imported_modules(node, here):
                found.append(
                    Import(
                        file=path.relative_to(root).as_posix(),
                        line=node.lineno,
                        room=room_of(path, root, package),
                        module=module,
                        lazy=lazy,
                    )
                )
    return found


def rooms_in(package: str, root: Path = ROOT) -> set[str]:
    """The rooms under ``root/package``: packages and top-level modules."""
    return {room_of(path, root, package) for path in (root / package).rglob("*.py")}


def target_room(module: str, package: str) -> str | None:
    """The room of ``package`` an imported module is in; None outside ``package``
    (and for the package itself, which names no room)."""
    parts = module.split(".")
    return parts[1] if parts[0] == package and len(parts) > 1 else None


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str


def room_graph(package: str, root: Path = ROOT) -> dict[Edge, list[Import]]:
    """Which room imports which, with every import that says so."""
    edges: dict[Edge, list[Import]] = defaultdict(list)
    for imp in imports_of(package, root):
        there = target_room(imp.module, package)
        if there is not None and there != imp.room:
            edges[Edge(imp.room, there)].append(imp)
    return edges


def floor_numbers(floors: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {room: i for i, rooms in enumerate(floors) for room in rooms}


def one_per_line(found: list[Import]) -> list[Import]:
    """One import per file and line (``from P import a`` yields ``P`` and ``P.a``):
    the longest module named there, the most telling."""
    best: dict[tuple[str, int], Import] = {}
    for imp in found:
        key = (imp.file, imp.line)
        if key not in best or len(imp.module) > len(best[key].module):
            best[key] = imp
    return [best[k] for k in sorted(best)]


def upward_imports(
    package: str, floors: tuple[tuple[str, ...], ...], root: Path = ROOT
) -> list[str]:
    """Each import of a room on a higher floor: "FILE:LINE imports MODULE: A (floor I)
    imports B (floor J) above it". Rooms on no floor are left to
    :func:`test_every_room_is_on_a_floor_and_every_floor_room_exists`."""
    floor = floor_numbers(floors)
    bad = []
    for edge, found in sorted(room_graph(package, root).items(), key=lambda x: str(x[0])):
        placed = edge.importer in floor and edge.imported in floor
        if placed and floor[edge.imported] > floor[edge.importer]:
            for imp in one_per_line(found):
                bad.append(
                    f"{imp}: {edge.importer} (floor {floor[edge.importer]}) imports "
                    f"{edge.imported} (floor {floor[edge.imported]}) above it"
                )
    return bad


def mutual_imports(package: str, root: Path = ROOT) -> list[str]:
    """Each pair of rooms that import each other, with the lines on both sides."""
    graph = room_graph(package, root)
    bad = []
    for edge, found in sorted(graph.items(), key=lambda x: str(x[0])):
        back = graph.get(Edge(edge.imported, edge.importer))
        if back is not None and edge.importer < edge.imported:
            one_way = ", ".join(map(str, one_per_line(found)))
            other_way = ", ".join(map(str, one_per_line(back)))
            bad.append(f"{edge.importer} <-> {edge.imported}: {one_way}; and {other_way}")
    return bad


def cycle(package: str, root: Path = ROOT) -> list[str]:
    """A cycle among the rooms, each step with the line that makes it; [] if none."""
    graph = room_graph(package, root)
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for edge in graph:
        sorter.add(edge.importer, edge.imported)
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        # [a, b, ..., a], each an immediate predecessor of the next: imported by it
        rooms: list[str] = exc.args[1][::-1]
        steps = itertools.pairwise(rooms)
        return [f"{a} -> {b}: {one_per_line(graph[Edge(a, b)])[0]}" for a, b in steps]
    return []


# --- the trees ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("package", "floors"), [("proxy", PROXY_FLOORS), ("loadtests", LOADTESTS_FLOORS)]
)
def test_every_room_is_on_a_floor_and_every_floor_room_exists(
    package: str, floors: tuple[tuple[str, ...], ...]
) -> None:
    placed = set(floor_numbers(floors))
    rooms = rooms_in(package)
    assert rooms - placed == set(), f"rooms of {package}/ on no floor: put them on one"
    assert placed - rooms == set(), f"floors of {package}/ name rooms that are not there"


@pytest.mark.parametrize(
    ("package", "floors"), [("proxy", PROXY_FLOORS), ("loadtests", LOADTESTS_FLOORS)]
)
def test_rooms_import_only_rooms_on_their_floor_or_below(
    package: str, floors: tuple[tuple[str, ...], ...]
) -> None:
    bad = upward_imports(package, floors)
    assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", ["proxy", "loadtests"])
def test_no_two_rooms_import_each_other_and_no_cycle(package: str) -> None:
    mutual = mutual_imports(package)
    assert not mutual, "rooms that import each other:\n" + "\n".join(mutual)
    found = cycle(package)
    assert not found, "a cycle of rooms:\n" + "\n".join(found)


def through_a_door(imp: Import) -> bool:
    return any(
        imp.file == file and (imp.module == door or imp.module.startswith(f"{door}."))
        for file, door in PROXY_BENCH_DOORS
    )


def test_the_serve_path_imports_the_bench_only_in_the_bench_subcommands() -> None:
    bench = one_per_line([i for i in imports_of("proxy") if i.module.split(".")[0] == "loadtests"])
    elsewhere = [str(i) for i in bench if not through_a_door(i)]
    assert not elsewhere, "proxy imports the test bench:\n" + "\n".join(elsewhere)
    eager = [str(i) for i in bench if not i.lazy]
    assert not eager, "proxy imports the test bench at module level:\n" + "\n".join(eager)


def test_the_bench_never_imports_proxys_command_line() -> None:
    bad = [
        str(i)
        for i in one_per_line(imports_of("loadtests"))
        if i.module in PROXY_COMMAND_LINE or i.module.startswith("proxy.cli.")
    ]
    assert not bad, "loadtests imports proxy's command line (nothing does):\n" + "\n".join(bad)


# --- the checks themselves, on a small tree ----------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


FLOORS = (("__init__", "low"), ("mid", "side"), ("top",))


def test_the_checks_find_upward_mutual_cyclic_and_relative_imports(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "def f():\n    from pkg.mid import g\n",  # upward, lazily
            "pkg/mid/__init__.py": "from . import helpers\nfrom ..side import x\n",
            "pkg/mid/helpers.py": "",
            "pkg/side.py": "from pkg import mid\n",  # mid <-> side, same floor
            "pkg/top.py": "import pkg.low\n",
        },
    )
    assert upward_imports("pkg", FLOORS, tmp_path) == [
        "pkg/low.py:2 imports pkg.mid.g (lazily): low (floor 0) imports mid (floor 1) above it"
    ]
    assert mutual_imports("pkg", tmp_path) == [
        "mid <-> side: pkg/mid/__init__.py:2 imports pkg.side.x; and pkg/side.py:1 imports pkg.mid"
    ]
    assert cycle("pkg", tmp_path) == [
        "mid -> side: pkg/mid/__init__.py:2 imports pkg.side.x",
        "side -> mid: pkg/side.py:1 imports pkg.mid",
    ]


def test_a_cycle_of_three_rooms_on_one_floor_is_found(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "import pkg.mid\n",
            "pkg/mid.py": "def f():\n    import pkg.side\n",
            "pkg/side.py": "import pkg.low\n",
            "pkg/top.py": "",
        },
    )
    flat = (("__init__", "low", "mid", "side", "top"),)
    assert upward_imports("pkg", flat, tmp_path) == []
    assert mutual_imports("pkg", tmp_path) == []
    steps = cycle("pkg", tmp_path)
    assert len(steps) == 3 and "pkg/mid.py:2 imports pkg.side (lazily)" in " ".join(steps)


def test_the_checks_pass_a_tree_that_imports_downward(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "import os\n",
            "pkg/mid/__init__.py": "from pkg.low import os\nfrom .inner import y\n",
            "pkg/mid/inner.py": "y = 1\n",
            "pkg/side.py": "from pkg.mid import inner\n",  # same floor, one way
            "pkg/top.py": "from pkg import low, mid, side\n",
        },
    )
    assert upward_imports("pkg", FLOORS, tmp_path) == []
    assert mutual_imports("pkg", tmp_path) == []
    assert cycle("pkg", tmp_path) == []
