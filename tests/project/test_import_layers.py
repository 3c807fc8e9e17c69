"""The package's layering, read from the source: no module imports from a layer above its own, and the
modules' top-level imports have no cycle. Layers, bottom up (a layer may import its own and lower ones):

  0  core (pure Python), units, sizing, sampling_params, request_limits (the request validator),
     speculative_config, outputs, inputs, background, gc_tuning,
     log_safety, child_signals, structured_output (grammars and matchers: sampling_params holds its params,
     the worker applies its bitmask, the engine owns its matchers; of kvserve it imports request_limits only)
  1  distributed, ops (kernels)
  2  model
  3  config (the engine configuration, resolved from the model's files)
  4  worker (one device)
  5  executor (starts workers, sends steps)
  6  engine, spec_decode (the step loop and what plugs into it)
  7  entrypoints, bench (CLI, server, LLM class, benchmarks)

Above the executor nothing reaches the worker: the engine and the entrypoints see devices only through
the executor (whose workers may live in other processes).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

LAYERS = {
    "core": 0, "units": 0, "sizing": 0, "sampling_params": 0, "outputs": 0, "inputs": 0, "background": 0,
    "gc_tuning": 0, "log_safety": 0, "child_signals": 0, "speculative_config": 0, "structured_output": 0,
    "request_limits": 0,
    "distributed": 1, "ops": 1,
    "model": 2,
    "config": 3,
    "worker": 4,
    "executor": 5,
    "engine": 6, "spec_decode": 6,
    "entrypoints": 7, "bench": 7,
}
# Known exceptions, each with its reason (to be removed, not added to).
ALLOWED: set[tuple[str, str]] = set()
ROOT = Path(kvserve.__file__).parent


def _modules() -> dict[str, ast.Module]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("kvserve", *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = ast.parse(path.read_text(), str(path))
    return mods


def _imports(tree: ast.AST, top_level_only: bool) -> set[str]:
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvserve") and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from kvserve.x import module`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvserve"))
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_package_has_a_layer():
    packages = {name.split(".")[1] for name in _modules() if name.count(".") >= 1}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))


def test_no_module_imports_from_a_layer_above_its_own():
    mods = _modules()
    bad = []
    for name, tree in mods.items():
        own = _layer(name)
        if own is None or name == "kvserve.entrypoints.cli":  # the package root; the CLI hosts `bench`
            continue
        for target in _imports(tree, top_level_only=False):
            if target not in mods:
                continue  # a name imported from a module, not a module
            layer = _layer(target)
            if layer is not None and layer > own and (name, target) not in ALLOWED:
                bad.append(f"{name} (layer {own}) imports {target} (layer {layer})")
    assert not bad, "\n".join(sorted(bad))


def test_nothing_above_the_executor_imports_the_worker():
    mods = _modules()
    bad = [f"{name} imports {target}" for name, tree in mods.items() if (_layer(name) or 0) > LAYERS["executor"]
           for target in _imports(tree, top_level_only=False) if target.startswith("kvserve.worker")]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles_at_module_level():
    mods = _modules()
    graph = {name: {t for t in _imports(tree, top_level_only=True) if t in mods and t != name}
             for name, tree in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles
