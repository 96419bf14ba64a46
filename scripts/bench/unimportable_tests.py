"""Print ``--ignore=<path>`` for each test module that cannot be imported here (missing optional packages).

python scripts/bench/unimportable_tests.py tests
"""

from __future__ import annotations

import importlib.util
import os
import sys


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "tests"
    root = os.path.abspath(os.path.join(folder, ".."))
    sys.path[:0] = [os.path.abspath(folder), root]
    out = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        path = os.path.join(folder, name)
        try:
            spec = importlib.util.spec_from_file_location(name[:-3], path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as e:  # noqa: BLE001 (any import failure leaves the module out, with its reason)
            print(f"{path}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            out.append(f"--ignore={path}")
    print(" ".join(out))


if __name__ == "__main__":
    main()
