"""The ranks behind a notebook: N ipyparallel engines, each one process of one torch.distributed group.

The first cell of every notebook here runs

    import ranks
    rc = ranks.start(RANKS)

and from then on a `%%px` cell runs on every rank (its output shown under the cell, tagged [stdout:r] by rank),
`%%px --targets 0` on rank 0 alone. Each engine is a real process, started by ipyparallel, that joins the group
through the numbered scripts' own setup() (the same block in every script: CUDA and NCCL with a GPU per rank,
otherwise the CPU and gloo), with a timeout: a collective that cannot complete ends as an error in its cell after
TIMEOUT_S seconds instead of freezing the notebook. In every rank, `load("05_manual_ddp_gpt2.py")` imports a
numbered script, so a notebook shows the scripts' own code, never a copy.

No rank outlives its notebook: each engine (and ipyparallel's controller) watches the kernel that started it and
exits within a second once that kernel is gone, whether shut down, restarted or killed; and start() first stops
the ranks it started before, so running the first cell again gives a fresh group.
"""

import importlib.util
import os
import runpy
import signal
import socket
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 30  # how long a rank waits in a collective for the others before its cell fails

_cluster = None


def start(n, timeout_s=TIMEOUT_S):
    """Stop the ranks this kernel started before, start `n` new ones, join them into one group. Returns the client."""
    global _cluster
    import ipyparallel as ipp
    from traitlets.config import Config

    stop()
    watched = [sys.executable, str(Path(__file__).resolve()), str(os.getpid())]  # see the end of this file
    config = Config()
    config.LocalControllerLauncher.controller_cmd = [*watched, "ipyparallel.controller"]
    config.LocalEngineLauncher.engine_cmd = [*watched, "ipyparallel.engine"]
    _cluster = ipp.Cluster(n=n, config=config, log_level=40)  # 40: errors only, no start-up chatter
    _cluster.start_cluster_sync()
    rc = _cluster.connect_client_sync()
    rc.wait_for_engines(n, timeout=120, interactive=False)
    rc.activate()  # the %%px magics address these engines
    if ipp._NONINTERACTIVE:  # IPP_NONINTERACTIVE=1 (run.py): outputs in rank order after each cell, no progress bars
        from IPython import get_ipython
        get_ipython().magics_manager.registry["ParallelMagics"].progress_after_seconds = -1
    with socket.socket() as s:  # a free port for the group's rendezvous (rank 0 listens on it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each engine becomes rank r of n, with the environment torchrun would give it, then joins (all at once:
    # init_process_group returns only when every rank has called it).
    joins = [rc[r].apply_async(_join, r, n, port, timeout_s) for r in range(n)]
    said = [j.get(timeout=timeout_s + 60) for j in joins]
    print(said[0])
    print(f"{n} ranks joined one group; %%px cells run on all of them, %%px --targets 0 on rank 0 alone")
    return rc


def stop():
    """Stop the ranks this kernel started (the engines would also exit by themselves with the kernel)."""
    global _cluster
    if _cluster is not None:
        _cluster.stop_cluster_sync()
        _cluster = None


def load(filename):
    """Import a numbered script by its file name (a module name cannot start with a digit)."""
    path = REPO / filename
    spec = importlib.util.spec_from_file_location(path.stem.lstrip("0123456789_"), path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: pickle finds its classes
    spec.loader.exec_module(module)
    return module


def _join(rank, world, port, timeout_s):
    """Runs in engine `rank`: become that rank of the group, and give the notebook's cells their names."""
    import argparse

    import __main__  # the engine's interactive namespace, where %%px cells run

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    sys.path.insert(0, str(REPO / "notebooks"))
    import warnings

    import torch
    # tqdm (imported by transformers) takes an engine for a notebook and asks for widgets: its text bars are fine
    warnings.filterwarnings("ignore", message="IProgress not found")
    torch.set_num_threads(1)  # N ranks on a laptop's cores: one thread each, as torchrun sets it
    block = load("01_send_recv.py")  # the setup block, the same in every script: the device rule is the scripts'
    device = block.setup(argparse.Namespace(device="auto", backend=None, timeout_s=timeout_s))
    __main__.__dict__.update(RANK=rank, WORLD=world, device=device, load=load)
    return f"rank 0 of {world}: device {device}, backend {torch.distributed.get_backend()}, timeout {timeout_s:g} s"


if __name__ == "__main__":
    # python ranks.py KERNEL_PID MODULE [ARGS...]: run ipyparallel's MODULE (an engine or the controller) as
    # `python -m MODULE ARGS` would, and end this process once the kernel that started it is gone.
    # ipyparallel starts each in a session of its own, so its process group holds it and whatever it forked (the
    # controller's schedulers, an engine's nanny): all of them go together.
    kernel, module = int(sys.argv[1]), sys.argv[2]

    def watch():
        while os.getppid() == kernel:  # a dead parent's children are handed to another process
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
