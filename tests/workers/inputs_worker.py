"""Run under torchrun (2 ranks): many short runs of a numbered script, each a real job of 2 ranks, for the price of
one launch. Each case is (script, arguments, port): every rank forks a child that keeps torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, ...) but meets its peers on the case's own port, then runs the script's run() as
`python script.py` would. torch and transformers are imported once, here, before any fork.

A child still running after the deadline is killed and reported as a hang. Each rank writes
[[exit code, output], ...] in the order of the cases to OUT_DIR/rankR.json.

  torchrun --nproc_per_node=2 tests/workers/inputs_worker.py CASES.json OUT_DIR
"""

import io
import json
import os
import signal
import sys
import tempfile
import time

# What the scripts import on the way, imported once, before forking: each case then costs its own work only.
import datasets  # noqa: F401
import torch  # noqa: F401
import torchvision.datasets  # noqa: F401
import torchvision.transforms  # noqa: F401
import tqdm  # noqa: F401
from datasets.utils.extract import Extractor  # noqa: F401
from transformers import (  # noqa: F401
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import REPO, load_script  # noqa: E402

DEADLINE_S = 90


def run_case(script, argv, port):
    with tempfile.TemporaryFile(mode="w+") as out:
        pid = os.fork()
        if pid == 0:  # the child: become one rank of the case's job
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            sys.stdout, sys.stderr = io.TextIOWrapper(os.fdopen(1, "wb", 0)), io.TextIOWrapper(os.fdopen(2, "wb", 0))
            # Rank 0 hosts the case's store on its port; with the agent's store, every case would share one.
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
            sys.argv = [str(REPO / script)] + argv
            code = 0
            try:
                module = load_script(script)
                module.run(getattr(module, "main_or_spawn", module.main), module.parse_args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException as e:  # a traceback: what a bad input must never produce
                print(f"Traceback (unhandled {type(e).__name__}: {e})", flush=True)
                code = 1
            os._exit(code)
        deadline = time.time() + DEADLINE_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.time() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = f"hang: still running after {DEADLINE_S} s"
                break
            time.sleep(0.02)
        out.seek(0)
        return code, out.read()


def main():
    cases, folder = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    report = [run_case(script, argv, port) for script, argv, port in cases]
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
