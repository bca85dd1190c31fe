"""The folders are layered like the modules: the import graph of ``test_import_graph`` collapsed to
folders (each subpackage of ``ftis_fed`` one node, each top-level module of ``ftis_fed`` its own) has
no cycle; the knobs module is the bottom layer (it imports nothing of the project); the run id lives
in one folder (``trust``); ``config/`` imports nothing of the engine (the engine checks the scheme)."""

from __future__ import annotations

from tests.test_import_graph import import_graph


def folder(mod: str) -> str:
    """``ftis_fed.learn.training`` -> ``ftis_fed.learn``; ``ftis_fed.participant`` stays; ``sims.x`` -> ``sims``."""
    parts = mod.split(".")
    if parts[0] != "ftis_fed":
        return parts[0]
    graph = _GRAPH
    if len(parts) >= 2 and any(m.startswith(f"ftis_fed.{parts[1]}.") for m in graph):
        return f"ftis_fed.{parts[1]}"
    return mod


_GRAPH = import_graph()


def folder_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in _GRAPH.items():
        a = folder(mod)
        out.setdefault(a, set())
        for d in deps:
            b = folder(d)
            if b != a and b != "ftis_fed":
                out[a].add(b)
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_folder_level_cycle():
    assert cycle(folder_graph()) is None, " -> ".join(cycle(folder_graph()) or [])


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_knobs_module_is_the_bottom_layer():
    assert _GRAPH["ftis_fed.knobs"] == set()
    users = {folder(m) for m, deps in _GRAPH.items() if "ftis_fed.knobs" in deps}
    assert {"ftis_fed.learn", "ftis_fed.policies", "ftis_fed.tasks", "ftis_fed.trust"} <= users


def test_config_imports_nothing_of_the_engine_and_tasks_nothing_of_trust():
    graph = folder_graph()
    assert "ftis_fed.engine" not in graph["ftis_fed.config"]
    assert "ftis_fed.trust" not in graph["ftis_fed.tasks"]          # the run id is trust's (run_id.py, signing.py)
    assert "ftis_fed.trust.run_id" in _GRAPH and not any(m.startswith("ftis_fed.tasks.identity") for m in _GRAPH)
