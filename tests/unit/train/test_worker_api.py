"""No dead fan-out: every TrainingWorker method is driven by the controller, every controller phase by a caller.

`offload`/`onload` sat on both classes with no caller (and no test that memory moves) until issue 17 removed them;
this keeps an unused, untested worker path from coming back unnoticed.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from rlpipe.train.controller import TrainingController
from rlpipe.train.worker import TrainingWorker

REPO = Path(__file__).resolve().parents[3]
TEST_ONLY = {"weights_digest"}  # the resume/parity tests compare runs with it
NOT_FANNED_OUT = {"shutdown"}  # the controller ends workers with ray.kill; a worker's process group dies with it


def _public_methods(cls: type) -> set[str]:
    return {n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def _names_used(path: Path, strings: bool = True) -> set[str]:
    """Attribute names and (with `strings`) string constants of a module: `_all("fit")` names the method `fit`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def test_every_worker_method_is_called_by_the_controller():
    used = _names_used(REPO / "rlpipe/train/controller.py")
    assert _public_methods(TrainingWorker) - used - NOT_FANNED_OUT == set()


def test_every_controller_method_has_a_caller():
    used = _names_used(REPO / "rlpipe/train/controller.py", strings=False)  # its own helpers (`self.shard`)
    for path in [*(REPO / "rlpipe").rglob("*.py"), *(REPO / "tasks").glob("*.py"), *(REPO / "bench").rglob("*.py")]:
        if path.name != "controller.py":
            used |= _names_used(path)
    assert _public_methods(TrainingController) - used - TEST_ONLY == set()
