"""Run each case of a table as one process of a would-be job, and report what it did, as JSON.

A case is (script, arguments, as, extra environment). `as` is "0" or "1": that rank of a 2-rank job, with
torchrun's environment; "rank0of1": a 1-rank torchrun job; "alone": plain `python script.py` (a group of one, for
inputs only the model or the data reveal). Each case runs in a forked child (torch and transformers are imported
once, here) and exits as the script makes it exit. Bad input must be caught before any process group starts: a
rank of a 2-rank job that gets as far as init_process_group would wait for a peer that never comes, so a child
still running after 30 seconds is killed and the case reported as such.

  python tests/workers/usage_worker.py CASES.json OUT.json
"""

import io
import json
import os
import signal
import sys
import tempfile
import time

import torch  # noqa: F401  (imported once, before forking)
from transformers import AutoModelForCausalLM, GPT2LMHeadModel  # noqa: F401  (the slowest import of all)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import REPO, load_script  # noqa: E402


def run_case(script, argv, rank, env):
    """Exit status and combined output of script's run() with argv, as `rank` says."""
    env = dict(env)
    if rank in ("0", "1", "rank0of1"):
        number, world = ("0", "1") if rank == "rank0of1" else (rank, "2")
        env.update(RANK=number, LOCAL_RANK=number, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="9")  # port 9: nothing listens there
    return run_forked(script, argv, env, 30, "timeout: the bad input was not caught before the process group started")


def run_forked(script, argv, env, deadline_s, late):
    """(exit status, combined output) of script's run() with argv, in a forked child with `env` added to its
    environment, as `python script.py` would run; a child still running after deadline_s is killed: (late, ...)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        pid = os.fork()
        if pid == 0:  # the child: become the script's process
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            sys.stdout, sys.stderr = io.TextIOWrapper(os.fdopen(1, "wb", 0)), io.TextIOWrapper(os.fdopen(2, "wb", 0))
            os.environ.update(env)
            sys.argv = [str(REPO / script)] + argv
            code = 0
            try:
                module = load_script(script)
                run = module.run if hasattr(module, "run") else module.lesson.run  # benchmarks use a lesson's
                run(getattr(module, "main_or_spawn", module.main), module.parse_args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException as e:  # a traceback: what a bad input must never produce
                print(f"Traceback (unhandled {type(e).__name__}: {e})", flush=True)
                code = 1
            os._exit(code)
        deadline = time.time() + deadline_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.time() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = late
                break
            time.sleep(0.02)
        out.seek(0)
        return code, out.read()


def main():
    cases, result = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    report = [run_case(script, argv, rank, env) for script, argv, rank, env in cases]
    with open(result, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
