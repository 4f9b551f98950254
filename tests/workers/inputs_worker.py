"""Run under torchrun (2 ranks): many short runs of a numbered script, each a real job of 2 ranks, for the price of
one launch. Each case is (script, arguments, port): every rank forks a child that keeps torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, ...) but meets its peers on the case's own port, then runs the script's run() as
`python script.py` would. torch and transformers are imported once, here, before any fork.

A child still running after the deadline is killed and reported as a hang. Each rank writes
[[exit code, output], ...] in the order of the cases to OUT_DIR/rankR.json.

  torchrun --nproc_per_node=2 tests/workers/inputs_worker.py CASES.json OUT_DIR
"""

import json
import os
import sys

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from usage_worker import run_forked  # noqa: E402  (the fork, the child's run() and the deadline)

DEADLINE_S = 90


def run_case(script, argv, port):
    # Rank 0 hosts the case's store on its port; with the agent's store, every case would share one.
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
    return run_forked(script, argv, env, DEADLINE_S, f"hang: still running after {DEADLINE_S} s")


def main():
    cases, folder = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    report = [run_case(script, argv, port) for script, argv, port in cases]
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
