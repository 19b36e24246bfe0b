"""The package's floor plan holds: imports point down the floors that
engine/__init__.py draws, nothing imports in a circle (Python or C), and the
rooms stay small."""
import ast
import pathlib
import re

import engine

ROOT = pathlib.Path(engine.__file__).parent
CSRC = ROOT.parent / "csrc"
MAX_MODULE_LINES = 450
MAX_C_LINES = 600
MAX_GROUND_MODULES = 12


def modules() -> dict:
    """{dotted name: path} of every module of the package."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: pathlib.Path, known: set) -> set:
    """The package's modules that path imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from engine.x import y` runs engine.x (its __init__ for a package), and
            # engine.x.y when that is a module; the root's face runs before any of them
            names = [f"{node.module}.{a.name}" for a in node.names]
            if node.module != "engine":
                names.append(node.module)
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def floors() -> dict:
    """{package: floor} as the package docstring draws them."""
    table = re.findall(r"^\s+floor (\d)\s+(engine\.\w+)\s", engine.__doc__, re.M)
    assert table, "engine/__init__.py draws no floors"
    return {package: int(floor) for floor, package in table}


def room(module: str, drawn: dict):
    """(floor, room): a drawn sub-package, or the ground floor's modules."""
    if module in ("engine", "engine.__main__"):
        return max(drawn.values()) + 1, "face"
    for package, floor in drawn.items():
        if module == package or module.startswith(package + "."):
            return floor, package
    return min(drawn.values()), "ground"


def graph() -> dict:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_every_import_points_down_the_drawn_floors():
    drawn, wrong = floors(), []
    ground = min(drawn.values())
    for module, targets in graph().items():
        floor, mine = room(module, drawn)
        for target in targets:
            to_floor, theirs = room(target, drawn)
            up = to_floor > floor
            beside = to_floor == floor and mine != theirs and floor != ground \
                and {mine, theirs} != {"ground", "engine.shm"}
            if up or beside:
                wrong.append(f"{module} (floor {floor}) imports {target} (floor {to_floor})")
    assert not wrong, "\n".join(wrong)


def _cycles(edges: dict) -> list:
    """Every strongly connected set of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_python_module_imports_in_a_circle():
    assert _cycles(graph()) == []


def test_no_c_file_includes_in_a_circle():
    edges = {p.name: set(re.findall(r'^#include "([\w.]+)"', p.read_text(), re.M))
             for p in CSRC.glob("*.[ch]")}
    assert _cycles(edges) == []


def test_the_cycle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_never_imports_the_tools():
    runtime = {m: ts for m, ts in graph().items()
               if not m.startswith(("engine.tools", "engine.cli"))}
    wrong = [f"{m} imports {t}" for m, ts in runtime.items() for t in ts
             if t.startswith("engine.tools")]
    assert not wrong


def test_modules_and_c_files_stay_small():
    big = [f"{p} ({n} lines)" for p in ROOT.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    big += [f"{p} ({n} lines)" for p in CSRC.glob("*.[ch]")
            if (n := len(p.read_text().splitlines())) > MAX_C_LINES]
    assert not big


def test_the_ground_floor_holds_few_modules():
    ground = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(ground) <= MAX_GROUND_MODULES, ground


def test_every_constant_of_the_c_header_is_named_in_codes():
    from engine._ringc import lib

    from engine.shm import codes
    missing = [n for n in dir(lib) if n.startswith("SB_") and getattr(codes, n[3:], None)
               != getattr(lib, n)]
    assert not missing
