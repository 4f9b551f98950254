"""Benchmark: what 05's --compile gains by compiling the head and the loss as regions of their own, beside each block.

  python benchmarks/compile_regions.py                      (CPU, inductor: a C++ compiler; about 2 minutes)
  python benchmarks/compile_regions.py --precision bf16 --json regions.json

One process, no DDP: the regions are the question, not the communication. A GPT-2 with GPT-2's vocabulary (50,257
columns in its head, where the loss's time goes) but small blocks, random weights and tokens. Four ways, each on
its own copy of the same weights, timed forward + backward in a balanced interleaved order (round k starts with
way k mod 4), on one thread, timed in that thread's CPU time: on a shared machine, time spent waiting for a core
is not counted (wall time is, and swung 3x between identical steps here). Reported: the best and the median step
over rounds; the speed ratios are of the medians:
  eager            no compile
  blocks           each block compiled on its own (05's --compile before issue #51)
  blocks + head + loss   ... and the head and the loss (05's --compile now): the loss's float32 cast fuses into
                   its kernels
  whole            the model and the loss under one torch.compile: the ceiling, but with DDP it would hand over
                   every gradient only when its whole backward is done (no overlap)
Losses are checked to agree (float tolerance) before anything is timed. See benchmarks/README.md.
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_script, write_json  # noqa: E402

lesson = load_script("05_manual_ddp_gpt2.py")
WAYS = ["eager", "blocks", "blocks + head + loss", "whole"]


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=args.seq_len, n_embd=args.n_embd,
                                      n_layer=args.n_layer, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, activation_function="gelu_pytorch_tanh"))


def way(base, name, args):
    """A step function (forward and backward of the next-token loss) compiled as `name` says."""
    model = copy.deepcopy(base)
    loss = lesson.cross_entropy
    if name == "blocks":
        for block in model.transformer.h:
            block.compile()
    if name == "blocks + head + loss":  # as 05's --compile does it
        lesson.compile_blocks(model)
        loss = torch.compile(loss)

    def step(batch):
        value = lesson.next_token_loss(model, batch, args, loss)
        value.backward()
        model.zero_grad(set_to_none=True)
        return value.detach()
    return torch.compile(step) if name == "whole" else step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast, as on a GPU")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (each way once per round)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if min(args.batch_size, args.seq_len, args.n_layer, args.n_embd, args.rounds) < 1 or args.n_embd % 4:
        p.error("sizes and --rounds must be >= 1, --n-embd a multiple of 4")
    torch.set_num_threads(1)  # the work stays on this thread, whose CPU time is what is measured
    import transformers
    transformers.logging.set_verbosity_error()
    base = build(args)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (args.batch_size, args.seq_len + 1), generator=g) for _ in range(4)]
    steps = {name: way(base, name, args) for name in WAYS}
    t0 = time.perf_counter()
    first = {name: step(batches[0]).item() for name, step in steps.items()}  # compiles; and the losses agree
    print(f"compiled in {time.perf_counter() - t0:.0f} s; first losses {first}", flush=True)
    tol = 1e-4 if args.precision == "fp32" else 2e-2
    assert all(abs(v - first["eager"]) <= tol * abs(first["eager"]) for v in first.values()), first
    times = {name: [] for name in WAYS}
    for r in range(1 + args.rounds):  # round 0 warms up each way once more
        for k in range(len(WAYS)):
            name = WAYS[(r + k) % len(WAYS)]
            t = time.thread_time()
            steps[name](batches[r % len(batches)])
            if r:
                times[name].append(time.thread_time() - t)
    tokens = args.batch_size * args.seq_len
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = {name: {"best_ms": min(ts) * 1e3, "median_ms": med[name] * 1e3, "tokens_per_s": tokens / med[name],
                   "vs_blocks": med["blocks"] / med[name]} for name, ts in times.items()}
    n_params = sum(p.numel() for p in base.parameters())
    print(f"\nforward + backward, 1 process, 1 CPU thread (its CPU time), {n_params / 1e6:.1f}M parameters "
          f"(vocab 50,257, {args.n_layer} blocks of {args.n_embd}), batch {args.batch_size}x{args.seq_len}, "
          f"{args.precision}, torch {torch.__version__}; {args.rounds} interleaved rounds")
    print("| way | best ms | median ms | tokens/s | speed vs blocks |\n|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['best_ms']:.1f} | {r['median_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['vs_blocks']:.2f}x |")
    if args.json:
        write_json(args.json, {"torch": torch.__version__, "precision": args.precision, "parameters": n_params,
                               "batch": [args.batch_size, args.seq_len], "rows": rows})
    print(f"OK blocks + head + loss is {rows['blocks + head + loss']['vs_blocks']:.2f}x the speed of blocks alone")


if __name__ == "__main__":
    main()
