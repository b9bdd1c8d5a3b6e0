"""The layering rule of docs/ARCHITECTURE.md, checked on the source: no import cycle, dependencies point down.

Read with ``ast``, nothing is imported. Cycles are looked for among module-level imports (an import inside a
function is how a lazy factory picks the one implementation it needs); the direction rule counts imports inside
functions too, so a lower package cannot reach up by importing late.
"""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO_ROOT

PACKAGES = ("nixl_backends", "dualpath_connector", "dualpath_router", "s3agg_gateway_ext", "dualpath_bench", "dualpath_dev")
SHIPPED = PACKAGES[:-1]
# The only part of the connector the services may import: the contract (no vLLM import).
CONTRACT = "dualpath_connector.protocol"
# The simulator also plans reads with the connector's own rule (no vLLM import either).
READ_PLAN = "dualpath_connector.load.plan"
# The router also speaks the engines' side channel (release_hold): its framing and signing, no vLLM import.
SIDE_CHANNEL = ("dualpath_connector.pd.side_channel", "dualpath_connector.pd.cluster_auth")


def _module_graph(nested: bool = False) -> dict[str, set[str]]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):  # subpackages too
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if nested else tree.body:
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _module_graph()


@pytest.fixture(scope="module")
def nested_graph() -> dict[str, set[str]]:
    return _module_graph(nested=True)


def test_the_graph_sees_every_package(graph):
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    assert CONTRACT in graph["dualpath_router.app"]  # negative control: edges are found


def test_no_import_cycle(graph):
    assert _cycles(graph) == []
    # Negative control: the check finds a cycle when there is one.
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def _violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The edges ``(module, dependency)`` that break the layering rule."""
    violations = []
    for module, deps in graph.items():
        top = module.split(".")[0]
        for dep in deps:
            dep_top = dep.split(".")[0]
            if top == "nixl_backends" and dep_top != "nixl_backends":
                violations.append((module, dep))  # the storage layer imports nothing else of ours
            simulator = module.startswith("dualpath_bench.simulate.")
            router = top == "dualpath_router"
            if top in ("dualpath_router", "s3agg_gateway_ext", "dualpath_bench") and dep_top == "dualpath_connector" \
                    and dep != CONTRACT and not (simulator and dep == READ_PLAN) \
                    and not (router and dep in SIDE_CHANNEL):  # fmt: skip
                violations.append((module, dep))  # services see the connector's contract only
            if top in SHIPPED and dep_top == "dualpath_dev":
                violations.append((module, dep))  # dev scaffolding is not installed
            if top != "dualpath_router" and dep_top == "dualpath_router" \
                    and not module.startswith("dualpath_bench.simulate."):  # fmt: skip
                # The simulator is the one outside user: it drives the router's own policy code.
                violations.append((module, dep))
    return violations


def test_dependencies_point_down(graph, nested_graph):
    assert _violations(nested_graph) == []
    # Negative control: imports inside functions are edges of this graph, not of the module-level one.
    assert any(deps - graph[module] for module, deps in nested_graph.items())


@pytest.mark.parametrize(
    "module, dep",
    [
        ("nixl_backends.store", "dualpath_connector.protocol"),
        ("dualpath_router.app", "dualpath_connector.worker.worker"),
        ("s3agg_gateway_ext.app", "dualpath_connector.pd.side_channel"),
        ("s3agg_gateway_ext.app", "dualpath_connector.config"),
        ("dualpath_bench.replay", "dualpath_connector.scheduler.scheduler"),
        ("dualpath_bench.replay", READ_PLAN),
        ("dualpath_bench.simulate.cluster", "dualpath_connector.config"),
        ("dualpath_connector.worker.worker", "dualpath_dev.engines"),
        ("dualpath_bench.cli", "dualpath_dev.cluster"),
        ("dualpath_dev.engines", "dualpath_router.credentials"),
    ],
)
def test_each_rule_finds_its_violation(module, dep):
    """Negative control: an edge against each rule is reported, and the allowed ones beside it are not."""
    allowed = {"dualpath_router.app": {CONTRACT}, "dualpath_dev.engines": {"dualpath_connector.protocol"},
               "dualpath_bench.simulate.experiments": {READ_PLAN}}
    assert _violations({**allowed, module: {dep}}) == [(module, dep)]
