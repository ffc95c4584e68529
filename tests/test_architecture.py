"""The router's house rules, read off its source (docs/ARCHITECTURE.md): no module imports
one that imports it back, type-only imports included (a lower module that names a higher
one's object declares what it reads as a Protocol), and the request record is frozen (a
stage adds its output by making the next record, never by writing another's)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from narwhal.router.request import Request, Standing

ROUTER = Path(__file__).resolve().parent.parent / "python" / "narwhal" / "router"


def modules() -> dict[str, Path]:
    out = {}
    for p in ROUTER.rglob("*.py"):
        parts = p.relative_to(ROUTER.parent.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each router module's imports of other router modules, wherever they sit (under
    `TYPE_CHECKING` or inside a function included)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    graph[m] |= {full} if full in mods else ({base} if base in mods else set())
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in mods}
        graph[m].discard(m)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_router_module_imports_one_that_imports_it_back() -> None:
    graph = imports(modules())
    assert len(graph) > 50 and graph["narwhal.router.app"]  # the walk sees the router
    found = cycle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_check_finds_a_circle_where_there_is_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_request_record_is_written_once() -> None:
    for record in (Request, Standing):
        params = record.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen, record
    req = Request("/v1/chat/completions", {}, False, False, False, 1)
    try:
        req.max_tokens = 5  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        return
    raise AssertionError("a stage wrote the record after intake")


# The router's floors, bottom up (docs/ARCHITECTURE.md, "Floors"): a module reads the floors
# below it and its own; a module that reads a higher floor is the exception, counted.
FLOORS: dict[int, tuple[str, ...]] = {
    # records and settings: what every stage reads, and nothing of the router's state
    0: (
        "request",
        "endings",
        "decisions",
        "config",
        "config_schema",
        "urls",
        "connection",
        "fleet.rules",
        "relay.errors",
        "peering.wire",
    ),
    # the fleet and its seats: engines, processes, leases and the admission queue, tenants'
    # books, leadership, what is measured and traced
    1: (
        "engines",
        "supervisor",
        "affinity",
        "upstream",
        "lease",
        "admission",
        "models",
        "metrics",
        "tracing",
        "tenants",
        "ha.leadership",
        "ha.maintenance",
        "fleet.spec",
        "fleet.membership",
        "fleet.dns_source",
        "fleet.etcd_source",
    ),
    # judgement: projections, ledgers and the policies that decide
    2: ("predict", "speeds", "policies"),
    # the stages a request passes, and the relay
    3: ("pipeline", "relay", "profiling", "warming", "peering"),
    # the wiring: the app, its programs and the fleet's assembly
    4: (
        "app",
        "cli",
        "status",
        "admin",
        "config_doc",
        "fleet.wiring",
        "fleet.reload",
        "fleet.admin",
        "ha.profiles",
        "ha.tenant_windows",
    ),
}
UPWARD_AT_MOST = 6


def floor(module: str) -> int:
    """A router module's floor: the longest prefix named in FLOORS (a package's own
    `__init__` holds only its rule, and sits on floor 0)."""
    name = module.removeprefix("narwhal.router").removeprefix(".")
    best, at = -1, 0
    for f, prefixes in FLOORS.items():
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, at = len(p), f
    if best < 0 and name not in (
        "",
        "fleet",
        "ha",
        "peering",
        "pipeline",
        "policies",
        "relay",
        "tenants",
    ):
        raise AssertionError(f"{module} has no floor (tests/test_architecture.py FLOORS)")
    return at


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, n) for m, ns in graph.items() for n in ns if floor(n) > floor(m))


def test_imports_run_down_the_floors_with_few_exceptions() -> None:
    graph = imports(modules())
    up = upward(graph)
    assert len(up) <= UPWARD_AT_MOST, "imports to a higher floor: " + ", ".join(
        f"{a} -> {b}" for a, b in up
    )


def test_the_floor_check_counts_an_upward_import() -> None:
    graph = imports(modules())
    graph["narwhal.router.request"] = {"narwhal.router.pipeline.flow"}
    assert ("narwhal.router.request", "narwhal.router.pipeline.flow") in upward(graph)


def test_every_way_a_request_ends_is_a_row_of_one_table() -> None:
    """The outcome and its refusal label are written in `router/endings.py` alone: every
    stage that says how a request ended names a row (`End.X`, or hands on one it was
    given), never a string, and never looks one up by its strings (which fails at run
    time on a pair the table lacks)."""
    named = 0
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "ended" or len(node.args) != 1:  # not a ledger's `ended`
                continue
            arg = node.args[0]
            rows = [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]
            for row in rows:
                is_row = (isinstance(row, ast.Attribute) and _is_end(row.value)) or (
                    isinstance(row, ast.Name) and not _is_end(row)
                )
                assert is_row, f"{m}:{node.lineno} says how a request ended without a row of End"
                named += 1
    assert named > 15  # the walk sees the raise sites


def _is_end(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "End"


def test_every_bench_program_imports() -> None:
    """The bench's programs run rarely, by hand: one that still named a router piece after
    it moved (`bench.trace_cost` and the request's `Ending`) would fail only when wanted."""
    import importlib

    root = ROUTER.parent.parent.parent
    names = [
        ".".join(p.relative_to(root).with_suffix("").parts)
        for p in sorted((root / "bench").rglob("*.py"))
        if p.name != "__init__.py"
    ]
    assert len(names) > 20  # the walk sees the bench
    for name in names:
        importlib.import_module(name)
