"""One writer per piece of a request's state, read from the source: a Request's status and step counters
are assigned only by the scheduler (core/scheduler.py), and the count of outputs sent to the workers only
where the step message is built (core/sched_output.py, called by the scheduler)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent
WRITERS = {
    "status": {"core/scheduler.py"},
    "num_computed_tokens": {"core/scheduler.py"},
    "num_pending_outputs": {"core/scheduler.py"},
    "num_spec_in_flight": {"core/scheduler.py"},
    "spec_token_ids": {"core/scheduler.py"},
    "num_output_tokens_sent": {"core/sched_output.py"},
}


def _assigned_attributes(tree: ast.AST):
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                # `self.x = ...` sets an object's own field (a Request's defaults, or another class's).
                if isinstance(sub, ast.Attribute) and not (isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    yield sub.attr, node.lineno


def test_request_state_has_one_writer():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for attr, line in _assigned_attributes(ast.parse(path.read_text())):
            if attr in WRITERS and rel not in WRITERS[attr]:
                bad.append(f"{rel}:{line} assigns .{attr}")
    assert not bad, "\n".join(bad)
