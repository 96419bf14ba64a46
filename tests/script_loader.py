"""Import the data-preparation and benchmark scripts (scripts/prepare_data/*.py, scripts/bench/*.py; not packages).

Loading a script twice under one module name breaks pickling of its functions for multiprocessing (the pickled
reference must be the object registered in sys.modules), so every test module goes through this cache.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_prepare_script(name: str) -> ModuleType:
    """The module of scripts/prepare_data/<name>.py, registered as ``prepare_<name>``."""
    module_name = f"prepare_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "scripts" / "prepare_data" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def fresh_bench_script(monkeypatch, name: str) -> ModuleType:
    """scripts/bench/<name>.py imported anew under its own name, with scripts/bench on sys.path for the test (the
    benchmark scripts import their sibling ``common`` that way); ``monkeypatch`` undoes the path change."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def load_bench_script(name: str) -> ModuleType:
    """scripts/bench/<name>.py imported once per process under its own name, with scripts/bench on sys.path (for a
    script that must exist once, such as bench_figf.py, whose fused MLP registers the custom op
    ``mita::residual_mlp`` reading that module's MLP_CONFIG)."""
    bench = str(ROOT / "scripts" / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)
