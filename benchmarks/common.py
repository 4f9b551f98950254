"""Helpers shared by the benchmarks: import a numbered script, summarise timings, write results.

The benchmarks import the hand-written pieces from the numbered scripts, so what is measured is what is taught.
"""

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from lessons import load as load_script  # noqa: E402,F401  (the benchmarks import it from here)


def flops_per_token(model, seq_len):
    """Training FLOPs a token, as 05's step line counts them for MFU (and the cost model): 6 per parameter, counted
    once (forward and backward), plus attention's scores and sums, 12 L d T."""
    cfg = model.config
    return 6 * sum(p.numel() for p in model.parameters()) + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def quartiles(xs):
    """(p25, median, p75) of a list of timings or ratios, within the data: the default 'exclusive' method
    extrapolates from few samples (from two timings it gave a negative p25)."""
    return tuple(statistics.quantiles(xs, n=4, method="inclusive")) if len(xs) > 1 else (xs[0],) * 3


def human(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024


def write_json(path, report):
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    return plt


def check_writable(path, flag):
    """Fail before any measuring if an output path cannot be written (a benchmark run is minutes of work)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir() or not target.resolve().parent.is_dir():
        raise OSError(f"{flag} {path}: not a file in an existing directory")
    with open(target, "a"):
        pass
