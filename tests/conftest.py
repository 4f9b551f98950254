import importlib.util
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # so tests can `import launch`


def load_script(filename):
    """Import a numbered script (its name starts with a digit, so plain `import` cannot)."""
    path = TESTS.parent / filename
    spec = importlib.util.spec_from_file_location(path.stem.lstrip("0123456789_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def script():
    return load_script
