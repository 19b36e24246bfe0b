"""The package's floor plan holds: imports point down the floors that
engine/__init__.py draws (and the rooms engine/http/__init__.py draws),
nothing imports in a circle (Python or C), the rooms stay small unless a
waiver says why, and each package's docstring names its modules."""
import ast
import functools
import pathlib
import re

import engine

ROOT = pathlib.Path(engine.__file__).parent
CSRC = ROOT.parent / "csrc"
MAX_MODULE_LINES = 450  # the aim: a module past it is one idea, and says so below
MAX_C_LINES = 600
MAX_GROUND_MODULES = 12
MIN_MODULE_LINES = 40  # a smaller module is a fragment of an idea, unless it says so below

# modules past MAX_MODULE_LINES: why each is one idea
LONG = {
    "engine/shm/ring.py": "the C ring's binding: a thin wrapper of each call the C exports, "
                          "and nothing else",
    "engine/serving/supervisor.py": "one engine's lifecycle and its monitor's loop, each "
                                    "policy delegated (restarts, reloading, control): what "
                                    "is left is the order of their steps",
    "engine/http/grpc/generated/grpc_service_pb2_grpc.py": "protoc's stub and servicer of "
                                                          "Triton's service, never edited "
                                                          "(engine/http/grpc/regenerate.py)",
}
# modules under MIN_MODULE_LINES (package faces aside): why each stands alone
SHORT = {
    "engine/__main__.py": "`python -m engine`: Python's own entry point",
    "engine/client/shares.py": "the priority shares' rule, one for a single submit and a bulk "
                               "call's chunks",
    "engine/serving/notify.py": "sd_notify, the service manager's protocol: nothing else of "
                                "the supervisor speaks it",
    "engine/batching/aimd.py": "the additive-increase, multiplicative-decrease rule, one "
                               "policy the batch limit can follow, apart from the loop",
    "engine/ray/app.py": "the Ray Serve application a user binds: the package's one public "
                         "call, apart from the replica it deploys",
}


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
    return set(_imported(path)) & set(known)


@functools.cache
def _imported(path: pathlib.Path) -> frozenset:
    """Every dotted name path's code imports (parsed once: several tests ask)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from engine.x import y` runs engine.x (its __init__ for a package), and
            # engine.x.y when that is a module; the root's face runs before any of them
            out.update(f"{node.module}.{a.name}" for a in node.names)
            if node.module != "engine":
                out.add(node.module)
    return frozenset(out)


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


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def _relative(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT.parent))


def test_modules_past_the_aim_say_why_and_c_files_stay_small():
    big = [f"{_relative(p)} ({n} lines)" for p in ROOT.rglob("*.py")
           if (n := _lines(p)) > MAX_MODULE_LINES and _relative(p) not in LONG]
    big += [f"{p} ({n} lines)" for p in CSRC.glob("*.[ch]") if (n := _lines(p)) > MAX_C_LINES]
    assert not big


def test_small_modules_are_package_faces_or_say_why():
    small = [f"{_relative(p)} ({n} lines)" for p in ROOT.rglob("*.py")
             if p.name != "__init__.py" and (n := _lines(p)) < MIN_MODULE_LINES
             and _relative(p) not in SHORT]
    assert not small


def test_every_waiver_names_a_module_it_still_fits():
    stale = [name for name in LONG if not (ROOT.parent / name).exists()
             or _lines(ROOT.parent / name) <= MAX_MODULE_LINES]
    stale += [name for name in SHORT if not (ROOT.parent / name).exists()
              or _lines(ROOT.parent / name) >= MIN_MODULE_LINES]
    assert not stale


def test_every_package_docstring_names_its_modules():
    unnamed = []
    for face in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(face.read_text())) or ""
        parts = [p for p in face.parent.iterdir() if p.name != "__init__.py" and (
            p.suffix == ".py" or (p / "__init__.py").exists())]
        for part in parts:
            name = part.stem if part.suffix == ".py" else part.name
            if name.startswith("_"):
                continue
            # named: `name` (or `name.attr`), a dotted path's part (engine.http.front),
            # or a drawn table's first word
            n = re.escape(name)
            if not re.search(rf"(?<=[`.]){n}(?!\w)|^\s+{n}(?!\w)", doc, re.M):
                unnamed.append(f"{_relative(face)} does not name {name}")
    assert not unnamed, "\n".join(unnamed)


def test_only_the_shm_floor_imports_the_c_binding():
    wrong = [f"{m} imports engine._ringc" for m, path in modules().items()
             if not m.startswith("engine.shm")
             and "engine._ringc" in imports(path, {"engine._ringc"})]
    assert not wrong


def http_rooms() -> dict:
    """{room: rank} as engine/http/__init__.py draws them, top down; the
    unnamed modules directly in engine/http/ are the shared room, below all."""
    import engine.http
    drawn = re.findall(r"^    ([\w.]+)\s{2,}", engine.http.__doc__, re.M)
    assert drawn, "engine/http/__init__.py draws no rooms"
    return {f"engine.http.{room}": len(drawn) - rank for rank, room in enumerate(drawn)}


def _http_room(module: str, rooms: dict) -> str:
    found = [r for r in rooms if module == r or module.startswith(r + ".")]
    return max(found, key=len) if found else "shared"


def test_the_http_fronts_imports_point_down_its_rooms():
    rooms, wrong = http_rooms(), []
    rank = {**rooms, "shared": 0}
    for module, targets in graph().items():
        if not module.startswith("engine.http."):
            continue
        mine = _http_room(module, rooms)
        for target in targets:
            if not target.startswith("engine.http."):
                continue
            theirs = _http_room(target, rooms)
            if rank[theirs] > rank[mine] or (rank[theirs] == rank[mine] and theirs != mine):
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_the_ground_floor_holds_few_modules():
    ground = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(ground) <= MAX_GROUND_MODULES, ground


def test_every_constant_of_the_c_header_is_named_in_codes():
    from engine._ringc import lib

    from engine.shm import codes
    missing = [n for n in dir(lib) if n.startswith("SB_") and getattr(codes, n[3:], None)
               != getattr(lib, n)]
    assert not missing
