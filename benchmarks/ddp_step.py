"""Benchmark: one GPT-2 training step through 05's DDP (--impl manual: DDPCore), the naive tutorial DDP, PyTorch's
DDP, and no DDP.

  torchrun --nproc_per_node=2 benchmarks/ddp_step.py --json ddp.json --plot ddp.png
  torchrun --nproc_per_node=2 benchmarks/ddp_step.py --model-size 124m --compile     (where communication matters)

The same weights, data and AdamW go through each implementation; `none` is each rank alone, so its step time over
an implementation's is that implementation's scaling efficiency (the same work per rank, plus communication).
The implementations alternate in a balanced order (a Williams square: each runs first, and follows each other
one, equally often); each step counts as long as its slowest rank; ratios are taken within each round of four,
then the median over rounds is reported with its p25-p75. Peak memory is the allocator's: CUDA's statistics on a
GPU; on CPU the most tensor bytes alive at once, from the profiler's allocation records. See benchmarks/README.md.
"""

import copy
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_writable, flops_per_token, load_script, pyplot, quartiles, write_json  # noqa: E402

lesson = load_script("05_manual_ddp_gpt2.py")  # its setup block and everything measured here
IMPLS = ["manual", "naive", "torch", "none"]  # none: each rank alone (no communication), the baseline
SIZES = {"small": None, "124m": dict(vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12, n_head=12)}


def build(args, device):
    """05's default model (--model-size small), or a GPT-2 124M-shaped one from a config, random weights."""
    if args.model_size == "small":
        return lesson.build_model(args)[1]
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(GPT2Config(**SIZES[args.model_size], activation_function="gelu_pytorch_tanh",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def peak_mb(fn, device):
    """Peak memory (MiB) that fn() adds: the most bytes its tensors held at any one time."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    # On CPU the resident set swings by +-10 MiB between identical runs (glibc keeps freed memory). The profiler
    # records every allocation and free with the running total of bytes: its highest point is the exact peak.
    # (Private profiler internals: fine in a benchmark, never in a lesson.)
    from torch._C._profiler import _EventType
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep the profiler's start/stop notes out of the output
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag == _EventType.Allocation:  # alloc_size > 0 for an allocation, < 0 for a free
            events.append((node.start_time_ns, node.extra_fields.total_allocated, node.extra_fields.alloc_size))
    if not events:
        return 0.0
    events.sort()
    start = events[0][1] - events[0][2]  # the running total just before fn's first allocation
    return (max(total for _, total, _ in events) - start) / 2**20


class Runner:
    """The model, optimizer and step of one implementation."""

    def __init__(self, impl, base, args, device):
        self.impl, self.args, self.device = impl, args, device
        self.model, self.loss = copy.deepcopy(base), lesson.cross_entropy
        if args.compile:  # as 05's --compile: each block, and the loss, a region of its own
            lesson.compile_blocks(self.model)
            self.loss = torch.compile(self.loss)
        self.wrapped = self.model if impl == "none" else lesson.wrap(self.model, impl, device, args.bucket_cap_mb)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(self, batch, probe=False):
        lesson.next_token_loss(self.wrapped, batch, self.args, self.loss).backward()
        if self.impl == "naive":
            lesson.average_gradients(self.model, dist.get_world_size())
        if probe:  # what this implementation holds at the optimizer step
            self.held_mb = self.grad_buffers_mb()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def grad_buffers_mb(self):
        """MiB of gradients plus communication buckets alive when the optimizer steps (distinct storages)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        live = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
        live.update({b.flat.untyped_storage().data_ptr(): b.flat.untyped_storage().nbytes()
                     for b in getattr(self.wrapped, "buckets", [])})
        held = sum(live.values())
        if isinstance(self.wrapped, nn.parallel.DistributedDataParallel):  # its buckets live in C++: ask it
            held += sum(int(b) for b in str(self.wrapped._get_ddp_logging_data()["bucket_sizes"]).split(",") if b)
        return held / 2**20


def measure(args, device, world):
    base = build(args, device).to(device)
    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(args.seed + dist.get_rank())
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g).to(device) for _ in range(4)]
    runs = {impl: Runner(impl, base, args, device) for impl in IMPLS}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times = {impl: [] for impl in IMPLS}
    for i in range(args.warmup + args.steps):
        for impl in [IMPLS[(j + i) % 4] for j in (0, 1, 3, 2)]:  # a Williams square: A B D C, B C A D, ...
            sync()
            dist.barrier(device_ids=[device.index] if dist.get_backend() == "nccl" else None)
            t0 = time.perf_counter()
            runs[impl].step(batches[i % len(batches)])
            sync()
            if i >= args.warmup:
                times[impl].append(time.perf_counter() - t0)
    buckets = [b.flat.numel() * b.flat.element_size() / 2**20 for b in runs["manual"].wrapped.buckets]
    del runs
    # Then memory, one implementation at a time: what wrapping, the optimizer and two steps add to the bare model,
    # and the gradient + bucket bytes alive at the optimizer step. The first measurement also pays one-time
    # costs (thread pools, caches): 'none' runs once before, discarded.
    peak, held = {}, {}
    for k, impl in enumerate(["none"] + IMPLS):
        def two_steps():
            run = Runner(impl, base, args, device)  # noqa: B023 (called right here, in this iteration)
            for b in batches[:2]:
                run.step(b, probe=True)
            held[impl] = run.held_mb  # noqa: B023
        mb = peak_mb(two_steps, device)
        if k:
            peak[impl] = mb
        dist.barrier(device_ids=[device.index] if dist.get_backend() == "nccl" else None)
    t = torch.tensor([times[i] for i in IMPLS], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    t = dict(zip(IMPLS, t.tolist()))
    tokens = args.batch_size * args.seq_len * world
    flops = flops_per_token(base, args.seq_len) * tokens
    reduce_bytes = sum(p.numel() for p in base.parameters()) * 4  # float32 gradients
    res = {}
    for impl in IMPLS:
        q1, med, q3 = quartiles(t[impl])
        r1, ratio, r3 = quartiles([a / b for a, b in zip(t[impl], t["torch"])])
        res[impl] = {"step_ms": med * 1e3, "step_ms_p25": q1 * 1e3, "step_ms_p75": q3 * 1e3,
                     "ratio_to_torch": ratio, "ratio_to_torch_p25": r1, "ratio_to_torch_p75": r3,
                     "scaling_efficiency": quartiles([a / b for a, b in zip(t["none"], t[impl])])[1],
                     "tokens_per_s": tokens / med, "tflops": flops / med / 1e12,
                     "allreduce_mb_per_step": 0.0 if impl == "none" or world == 1 else reduce_bytes / 2**20,
                     "peak_mem_mb": peak[impl], "grad_buffers_mb": held[impl]}
    return base, buckets, res


def report(args, device, world, base, buckets, res):
    say = lesson.print0
    n_params = sum(p.numel() for p in base.parameters())
    say(f"\nDDP step, {world} ranks, {dist.get_backend()}, {device.type}, {n_params / 1e6:.2f}M parameters, batch "
        f"{args.batch_size}x{args.seq_len} per rank, precision {args.precision}, compile={args.compile}, "
        f"buckets of {' + '.join(f'{b:.2f}' for b in buckets)} MiB, "
        f"torch {torch.__version__}; median of {args.steps} interleaved steps (max over ranks)")
    say("| impl | step ms (p25-p75) | vs torch DDP (p25-p75) | scaling efficiency | tokens/s | all-reduced MiB/step "
        "| peak memory MiB | grads + buckets MiB |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|")
    for impl, r in res.items():
        say(f"| {impl:<6} | {r['step_ms']:7.1f} ({r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f}) | "
            f"{r['ratio_to_torch']:5.2f} ({r['ratio_to_torch_p25']:.2f}-{r['ratio_to_torch_p75']:.2f}) | "
            f"{r['scaling_efficiency']:5.2f} | {r['tokens_per_s']:9,.0f} | {r['allreduce_mb_per_step']:7.2f} | "
            f"{r['peak_mem_mb']:7.1f} | {r['grad_buffers_mb']:6.2f} |")
    if lesson.RANK != 0:
        return
    if args.json:
        write_json(args.json, {"world_size": world, "backend": dist.get_backend(), "device": device.type,
                               "torch": torch.__version__, "parameters": n_params, "model_size": args.model_size,
                               "n_layer": base.config.num_hidden_layers, "n_embd": base.config.hidden_size,
                               "seq_len": args.seq_len, "batch_size": args.batch_size,
                               "precision": args.precision, "compile": args.compile,
                               "bucket_cap_mb": args.bucket_cap_mb, "buckets_mb": buckets, "impls": res})
        say(f"wrote {args.json}")
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        med = [res[i]["step_ms"] for i in IMPLS]
        err = [[m - res[i]["step_ms_p25"] for m, i in zip(med, IMPLS)],
               [res[i]["step_ms_p75"] - m for m, i in zip(med, IMPLS)]]
        ax.bar(IMPLS, med, yerr=err, capsize=4, color=["tab:green", "tab:red", "tab:blue", "tab:gray"])
        ax.set(ylabel="step time (ms), median and p25-p75", title=f"GPT-2 step, {world} ranks, {dist.get_backend()}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        say(f"wrote {args.plot}")


def main(args):
    device = lesson.setup(args)
    if args.precision == "auto":
        args.precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    import transformers
    transformers.logging.set_verbosity_error()
    world = dist.get_world_size()
    base, buckets, res = measure(args, device, world)
    report(args, device, world, base, buckets, res)
    lesson.print0(f"OK benchmark: manual/torch = {res['manual']['ratio_to_torch']:.2f}, "
                  f"naive/torch = {res['naive']['ratio_to_torch']:.2f}")


def parse_args():
    p = lesson.Parser(__doc__)
    p.add_argument("--model-size", choices=list(SIZES), default="small",
                   help="small: 05's default model (4 blocks of 128); 124m: GPT-2 124M's shape")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket size (default: 25, the first 1)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation first")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG of the step times to this file")
    own, rest = p.parse_known_args()
    if own.steps < 1 or own.warmup < 0 or (own.bucket_cap_mb is not None and not own.bucket_cap_mb > 0):
        p.error("--steps must be >= 1, --warmup >= 0 and --bucket-cap-mb > 0")
    for path, flag in ((own.json, "--json"), (own.plot, "--plot")):
        try:
            check_writable(path, flag)
        except OSError as e:
            p.error(str(e))
    # The batch, precision and --compile flags are 05's own.
    args = lesson.parse_args(rest + ["--device", own.device, "--timeout-s", str(own.timeout_s)]
                             + (["--backend", own.backend] if own.backend else []))
    for name in ("model_size", "bucket_cap_mb", "steps", "warmup", "json", "plot"):
        setattr(args, name, getattr(own, name))
    return args


if __name__ == "__main__":
    lesson.run(main, parse_args)
