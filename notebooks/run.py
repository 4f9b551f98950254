"""Run the notebooks top to bottom, headless, and save them with their outputs for GitHub.

  python notebooks/run.py                                 every notebook, on 2 ranks, saved
  python notebooks/run.py 02_ddp.ipynb --ranks 3 --check  one notebook, on 3 ranks, not saved

--ranks sets NOTEBOOK_RANKS, which each notebook's first cell reads. A cell that fails on any rank
stops the run with that cell's error (exit 1). The outputs are cleaned of this machine's paths
before they are saved.
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
    """Execute the notebook at `path` on `ranks` ranks, and return it. A failed cell raises."""
    nb = nbformat.read(path, as_version=4)
    # The kernel gets the number of ranks, and nothing else. So a reader's own headless run
    # (jupyter execute) makes the same outputs.
    env = dict(os.environ, NOTEBOOK_RANKS=str(ranks))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(HERE)}})
    client.execute(env=env)
    return nb


def scrub(nb):
    """Keep machine paths out of git: the repository's path becomes `.`, the home directory `~`."""
    repo, home = str(HERE.parent), os.path.expanduser("~")
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            for key in ("text", "evalue"):
                if key in output:
                    output[key] = output[key].replace(repo, ".").replace(home, "~")
            if "traceback" in output:
                output["traceback"] = [t.replace(repo, ".").replace(home, "~")
                                       for t in output["traceback"]]
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
        saved = "" if args.check else ", saved"
        print(f"{path.name}: ran on {args.ranks} ranks in {time.time() - t0:.0f} s{saved}")


if __name__ == "__main__":
    sys.exit(main())
