"""Run the notebooks top to bottom, headless, and save them with their outputs (what GitHub shows a reader).

  python notebooks/run.py                     every notebook here, on 2 ranks, outputs written back
  python notebooks/run.py 02_ddp.ipynb --ranks 3 --check      one, on 3 ranks, nothing written

A notebook takes its number of ranks from NOTEBOOK_RANKS (its first cell's value otherwise); --ranks sets it. A
cell that fails on any rank stops the run with that cell's error (exit 1). Outputs are cleaned of this machine's
paths before they are saved.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path, ranks, timeout=600):
    """Execute the notebook at `path` on `ranks` ranks; returns the executed notebook (raises on a failed cell)."""
    nb = nbformat.read(path, as_version=4)
    # The kernel's environment (this process's own stays as it was): the ranks for the first cell. Nothing else: a
    # reader's own headless run (nbconvert --execute) saves the same outputs, without progress bars (ranks.py).
    env = dict(os.environ, NOTEBOOK_RANKS=str(ranks))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}})
    client.execute(env=env)
    return nb


def scrub(nb):
    """No machine paths in what is committed: the repository's path becomes `.`, the home directory `~`."""
    repo, home = str(HERE.parent), os.path.expanduser("~")
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            for key in ("text", "evalue"):
                if key in output:
                    output[key] = output[key].replace(repo, ".").replace(home, "~")
            if "traceback" in output:
                output["traceback"] = [t.replace(repo, ".").replace(home, "~") for t in output["traceback"]]
            for kind, value in output.get("data", {}).items():
                if kind.startswith("text/") and isinstance(value, str):
                    output["data"][kind] = value.replace(repo, ".").replace(home, "~")
    return nb


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("notebooks", nargs="*", help="default: every notebook in notebooks/")
    p.add_argument("--ranks", type=int, default=2, help="NOTEBOOK_RANKS for the run")
    p.add_argument("--check", action="store_true", help="run only: write nothing back")
    args = p.parse_args()
    paths = [HERE / n for n in args.notebooks] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        t0 = time.time()
        nb = execute(path, args.ranks)
        if not args.check:
            nbformat.write(scrub(nb), path)
        print(f"{path.name}: ran on {args.ranks} ranks in {time.time() - t0:.0f} s" + ("" if args.check else ", saved"))


if __name__ == "__main__":
    sys.exit(main())
