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
