"""Import a numbered script by its file name, for the code around the lessons.

A module's name cannot start with a digit, so `import 05_manual_ddp_gpt2` fails. The tests,
benchmarks, notebooks, exercises and ddp_dropin.py all load the scripts with load() instead. Each
script gets one module name: 05_manual_ddp_gpt2.py becomes manual_ddp_gpt2. It is registered in
sys.modules, as an import would do. So pickle finds its classes, and DDPCore exists once.
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent


def module_name(filename: str) -> str:
    """The name a script is imported under: its stem, less the leading number."""
    return Path(filename).stem.lstrip("0123456789_")


def load(filename: str, fresh: bool = False) -> ModuleType:
    """Import `filename` once per process, and return it. The path is relative to the repository,
    or absolute.

    A script reads RANK and WORLD_SIZE when it is imported. Pass fresh=True to run it again, for
    example after a test has changed those variables. The new module replaces the old one."""
    path = Path(filename) if Path(filename).is_absolute() else REPO / filename
    name = module_name(filename)
    known = sys.modules.get(name)
    if known is not None and not fresh:
        if Path(getattr(known, "__file__", "")).resolve() == path.resolve():
            return known
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:  # a script that fails to import leaves sys.modules as it was
        if known is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = known
        raise
    return module
