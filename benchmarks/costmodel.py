"""A cost model of DDP, ZeRO and FSDP: collective times, step time and memory per rank, from 2 CPU ranks to 1,024 GPUs.

Collectives cost alpha + bytes * beta per message (latency, seconds per byte), plus gamma per byte added:
  point-to-point  alpha + n beta                               (01's send/recv)
  tree broadcast  ceil(log2 N) (alpha + n beta)               (02's binomial tree: one hop per round)
  lesson ring     2(N-1)(alpha + c beta) + (N-1) c gamma       (03's ring_all_reduce; c = n/N, a chunk: each
                  addition waits for its whole chunk, and the next send for the addition)
  pipelined ring  2(N-1)(alpha + c beta) + (N-1)(c/k) gamma    (03's pipelined_ring_all_reduce: k pieces per chunk;
                  a step's pieces are all in flight at once, so their latencies overlap, and piece j is added while
                  piece j+1 is on the wire: only the last piece's addition is exposed, as long as adding is no
                  slower than sending, gamma <= beta; else the sends wait on the adds)
  reduce-scatter  (N-1)(alpha + c beta) + (N-1) c gamma;  all-gather (N-1)(alpha + c beta)
On a GPU the addition runs inside NCCL's copy (gamma = 0) and a named --hardware profile gives the bus bandwidth
(NCCL's busbw) within a node and across nodes, with NCCL's latency: a ring in the node, a tree across nodes.

Step time: forward, then backward with each gradient ready at its time (measured with hooks, or spread over the
layers by FLOPs), buckets launched in order as they fill (05's bucket_layout), one collective at a time,
overlapping backward; then the optimizer. ZeRO-1: all-reduce, step 1/N, all-gather; ZeRO-2: reduce-scatter,
step 1/N, all-gather (07). FSDP (08): all-gather each unit before its forward and before its backward, the next
one issued as this one starts computing (forward prefetch; backward prefetch as PyTorch's BACKWARD_PRE issues
it: the next all-gather before this unit's reduce-scatter), reduce-scatter each unit's gradients after its
backward. HSDP: FSDP within a node, each unit's shard all-reduced across nodes. Gradient accumulation: DDP and
ZeRO-1 communicate once a step (no_sync), ZeRO-2 and FSDP reduce-scatter (FSDP re-gathers) every micro-batch,
HSDP all-reduces across nodes once a step.
Memory per rank: parameters, gradients, optimizer state (sharded as the strategy shards them), buckets (PyTorch
DDP's: a second copy of the gradients unless --gradient-as-bucket-view), FSDP's gathered units, activations (with
none, selective or full activation checkpointing).

  torchrun --nproc_per_node=2 benchmarks/costmodel.py fit --out calibration.json
  python benchmarks/costmodel.py collective all_reduce --bytes 67108864 --ranks 2 --calibration calibration.json --json
  python benchmarks/costmodel.py predict --model llama-7b --gpus 64 --gpus-per-node 8 --hardware h100-ib \\
      --strategy fsdp [--inter-node-gbps 8x50Gb/s --gpu-mem-gib 40 --activation-checkpointing full --grad-accum 4 \\
      --mfu 0.5 | --measured gpu_check.json | --measured-tokens-per-s 150000 --measured-gpus 8] [--json]
  torchrun --nproc_per_node=2 benchmarks/costmodel.py check [--json check.json]   (predictions vs measurements)
  python benchmarks/costmodel.py zero-table       (the ZeRO paper's Table 1, predicted)

`predict`'s compute runs at --mfu (model FLOPs: 6N + 12 L d s a token, as published tables count them) or --hfu
(hardware FLOPs: recomputation included) of the GPU's peak; its activations are Korthikanti et al.'s (2022), in
bf16, with flash attention unless --attention eager (activation_bytes, flops_per_token). docs/costmodel.md: how
to use it, and how far to trust it.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_script, write_json  # noqa: E402

GB, GIB, MIB = 1e9, 2**30, 2**20
_lesson = []  # 03_all_reduce.py, loaded once under torchrun: its setup block and rings (see lesson_module())


def lesson_module():
    """03's module, one copy for all: its run() must catch the UsageError its setup() raises."""
    if not _lesson:
        _lesson.append(load_script("03_all_reduce.py"))
    return _lesson[0]

# --- hardware profiles: each figure with where it comes from ---
# busbw in GB/s (NCCL's bus bandwidth, nccl-tests' definition: what each rank's link moves per second);
# alpha in seconds per step (intra: a ring step over NVLink/PCIe; inter: a tree hop across the network).
# Across nodes a ring's bus bandwidth is what one node's NICs move together, each direction (NCCL runs one ring
# per NIC, each carrying its share): predict's --inter-node-gbps. memory_gib: the card's nominal memory, taken as
# GiB (what the verdict compares the prediction with; keep headroom). Every figure is a default that predict's
# --intra-node-gbps, --inter-node-gbps, --gpu-mem-gib and --peak-tflops replace.
HARDWARE = {
    "h100-nvlink": dict(
        gpus_per_node=8, intra_busbw=450.0, inter_busbw=450.0, alpha_intra=3e-6, alpha_inter=3e-6,
        peak_tflops=989.0, memory_gib=80.0,
        source="H100 SXM5 80GB: NVLink 900 GB/s (450 GB/s each way), BF16 989 TFLOPS dense, 80 GB "
               "(https://www.nvidia.com/en-us/data-center/h100/); one NVSwitch node, nothing across nodes"),
    "h100-ib": dict(
        gpus_per_node=8, intra_busbw=450.0, inter_busbw=400.0, alpha_intra=3e-6, alpha_inter=8e-6,
        peak_tflops=989.0, memory_gib=80.0,
        source="DGX H100: 8x H100 SXM5 (above), 8 single-port ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU: "
               "8 x 50 GB/s = 400 GB/s per node, the ring's bus bandwidth across nodes with one ring per NIC "
               "(https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html)"),
    "a100-ib": dict(
        gpus_per_node=8, intra_busbw=300.0, inter_busbw=200.0, alpha_intra=4e-6, alpha_inter=8e-6,
        peak_tflops=312.0, memory_gib=80.0,
        source="DGX A100: 8x A100 SXM4 80GB, NVLink 600 GB/s (300 each way), BF16 312 TFLOPS dense "
               "(https://www.nvidia.com/en-us/data-center/a100/); 8 ConnectX-6 200 Gb/s HDR InfiniBand = 200 GB/s per "
               "node (https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html)"),
    "v100-16gb": dict(
        gpus_per_node=8, intra_busbw=150.0, inter_busbw=50.0, alpha_intra=5e-6, alpha_inter=8e-6,
        peak_tflops=125.0, memory_gib=16.0,
        source="DGX-1 with V100: 8x Tesla V100 SXM2 16GB, NVLink 2 (300 GB/s a GPU: 6 links of 25 GB/s each way = 150 "
               "each way), FP16 tensor cores 125 TFLOPS (V100 has no bf16: fp16 with loss scaling) "
               "(https://www.nvidia.com/en-us/data-center/v100/, the V100 datasheet); 4 x 100 Gb/s EDR InfiniBand = "
               "50 GB/s per node (the DGX-1 datasheet). Its NVLink is a hybrid cube-mesh, not a switch: NCCL's "
               "rings run below the line rate taken here"),
    "v100-32gb": dict(
        gpus_per_node=16, intra_busbw=150.0, inter_busbw=100.0, alpha_intra=5e-6, alpha_inter=8e-6,
        peak_tflops=125.0, memory_gib=32.0,
        source="DGX-2, the ZeRO paper's nodes: 16x Tesla V100 SXM3 32GB on NVSwitch (NVLink 2, 150 GB/s each way "
               "a GPU to any other), 125 TFLOPS fp16 each (2 PFLOPS a node); 8 x 100 Gb/s EDR InfiniBand = 100 GB/s "
               "per node, the paper's \"800 Gbps internode\" (Rajbhandari et al., SC20, arXiv:1910.02054, Sec. "
               "10.1; https://www.nvidia.com/en-us/data-center/dgx-2/)"),
    "100gbe": dict(
        gpus_per_node=8, intra_busbw=450.0, inter_busbw=12.5, alpha_intra=3e-6, alpha_inter=25e-6,
        peak_tflops=989.0, memory_gib=80.0,
        source="8x H100 SXM5 per node (above), the nodes joined by one 100 Gb/s Ethernet port each: 12.5 GB/s per "
               "node (IEEE 802.3 100GBASE), TCP latency ~25 us a hop"),
}

# --- model shapes, written here so that nothing is downloaded ---
# (gpt2 kind: learned positions, biases, LayerNorm, tied head; llama kind: RMSNorm, SwiGLU, no biases, kv: the
# fraction of heads that are key/value heads.) The MPT shapes are llm-foundry's benchmark configurations, whose
# parameter counts (its benchmarking README's NumParams at 2048 tokens) they give exactly.
MODELS = {
    "gpt2": dict(kind="gpt2", layers=12, d=768, heads=12, vocab=50257, ctx=1024, ff=3072, tied=True),  # 124M
    "gpt2-xl": dict(kind="gpt2", layers=48, d=1600, heads=25, vocab=50257, ctx=1024, ff=6400, tied=True),  # 1.56B
    "mpt-7b": dict(kind="gpt2", layers=32, d=4096, heads=32, vocab=50368, ctx=2048, ff=16384, tied=True),  # 6.66B
    "mpt-13b": dict(kind="gpt2", layers=40, d=5120, heads=40, vocab=50368, ctx=2048, ff=20480, tied=True),  # 12.9B
    "mpt-30b": dict(kind="gpt2", layers=48, d=7168, heads=64, vocab=50368, ctx=2048, ff=28672, tied=True),  # 30.0B
    "llama-7b": dict(kind="llama", layers=32, d=4096, heads=32, vocab=32000, ctx=2048, ff=11008,
                     tied=False),  # 6.74B: LLaMA 7B, and Llama 2 7B's shape (its context is 4096: --seq-len)
    "llama3-8b": dict(kind="llama", layers=32, d=4096, heads=32, kv=0.25, vocab=128256, ctx=8192, ff=14336,
                      tied=False),  # 8.03B
    "llama2-70b": dict(kind="llama", layers=80, d=8192, heads=64, kv=0.125, vocab=32000, ctx=4096, ff=28672,
                       tied=False),  # 69.0B
}


# --- collectives ---
class Link:
    """Fitted costs (alpha, beta, gamma in seconds, seconds per byte) of one set of ranks, or a hardware profile's
    (busbw per level, NCCL's latency). Every collective's time in seconds for n bytes on N ranks."""

    def __init__(self, alpha, beta, gamma=0.0, piece_bytes=1 << 20, profile=None, gpus_per_node=None,
                 overlaps=True, p2p=None):
        self.alpha, self.beta, self.gamma, self.piece = alpha, beta, gamma, piece_bytes
        self.profile, self.g, self.overlaps = profile, gpus_per_node, overlaps
        self.p2p_cost = p2p or (alpha, beta)  # (alpha, beta) of one message alone

    @classmethod
    def from_profile(cls, hw, gpus_per_node=None):
        """hw: a HARDWARE name, or such a dict (predict's, with the user's figures in it)."""
        hw = HARDWARE[hw] if isinstance(hw, str) else hw
        return cls(hw["alpha_intra"], 1 / (hw["intra_busbw"] * GB), profile=hw,
                   gpus_per_node=gpus_per_node or hw["gpus_per_node"])

    @classmethod
    def from_calibration(cls, cal):
        return cls(cal["alpha_s"], cal["beta_s_per_byte"], cal["gamma_s_per_byte"], cal["piece_bytes"],
                   overlaps=cal["overlaps"], p2p=(cal["p2p_alpha_s"], cal["p2p_beta_s_per_byte"]))

    def _beta(self, ranks):
        """Seconds per bus byte: the slowest level the ring crosses."""
        if self.profile and ranks > self.g:
            return 1 / (min(self.profile["intra_busbw"], self.profile["inter_busbw"]) * GB)
        return self.beta

    def _latency(self, ranks, steps_per_rank):
        """The fixed cost of a collective: steps_per_rank ring steps of alpha (fitted), or NCCL's choice on a
        profile: a ring inside each node, a tree (log2 of the nodes) across them."""
        if not self.profile:
            return steps_per_rank * (ranks - 1) * self.alpha
        inside, nodes = min(ranks, self.g), math.ceil(ranks / self.g)
        return steps_per_rank * ((inside - 1) * self.profile["alpha_intra"]
                                 + math.ceil(math.log2(nodes)) * self.profile["alpha_inter"])

    def p2p(self, n, ranks=2):
        return self.p2p_cost[0] + n * self.p2p_cost[1]

    def broadcast(self, n, ranks):
        return math.ceil(math.log2(ranks)) * (self.alpha + n * self._beta(ranks)) if ranks > 1 else 0.0

    def lesson_ring(self, n, ranks):
        c = n / ranks
        return 0.0 if ranks < 2 else self._latency(ranks, 2) + 2 * (ranks - 1) * c * self._beta(ranks) \
            + (ranks - 1) * c * self.gamma

    def all_reduce(self, n, ranks):
        """The pipelined ring (the fastest hand-written one; gloo's and NCCL's all-reduce pipeline too)."""
        if ranks < 2:
            return 0.0
        c, beta = n / ranks, self._beta(ranks)
        k = max(1, math.ceil(c / self.piece))  # pieces per chunk: each one more message
        add = (ranks - 1) * (c * max(0.0, self.gamma - beta) + (c / k) * min(beta, self.gamma))
        return self._latency(ranks, 2) + 2 * (ranks - 1) * c * beta + add

    def reduce_scatter(self, n, ranks):
        c = n / ranks
        return 0.0 if ranks < 2 else self._latency(ranks, 1) + (ranks - 1) * c * (self._beta(ranks) + self.gamma)

    def all_gather(self, n, ranks):
        """n: the gathered (full) size."""
        return 0.0 if ranks < 2 else self._latency(ranks, 1) + (ranks - 1) * n / ranks * self._beta(ranks)

    def across_nodes_all_reduce(self, n, nodes):
        """HSDP's all-reduce of the shards across nodes: each of a node's g ranks all-reduces its n/g bytes with
        its peers (one rank a node), the g all-reduces at once through the node's NICs: 2(nodes-1)/nodes n bytes
        through a node's inter-node bandwidth, NCCL's tree latency."""
        if nodes < 2:
            return 0.0
        return 2 * (math.ceil(math.log2(nodes)) * self.profile["alpha_inter"]
                    + (nodes - 1) / nodes * n / (self.profile["inter_busbw"] * GB))


COLLECTIVES = {"p2p": Link.p2p, "broadcast": Link.broadcast, "lesson_ring": Link.lesson_ring,
               "all_reduce": Link.all_reduce, "reduce_scatter": Link.reduce_scatter, "all_gather": Link.all_gather}


# --- step time: buckets launched in order, one collective at a time, overlapping backward ---
def buckets_of(grad_bytes, cap_bytes, first_cap_bytes=None):
    """Gradients (bytes, in the order backward makes them ready) cut as 05's bucket_layout cuts them: a bucket
    closes once it holds its cap (the first one first_cap_bytes, DDP's 1 MiB, when given). Lists of indices."""
    caps, out, cur, size = ([first_cap_bytes] if first_cap_bytes else []) + [cap_bytes], [], [], 0
    for i, b in enumerate(grad_bytes):
        cur.append(i)
        size += b
        if size >= caps[min(len(out), len(caps) - 1)]:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def overlap(ready, grad_bytes, buckets, cost, overlaps=True):
    """When the last bucket's collective ends, each launched when its last gradient is ready and the previous
    collective has ended (collectives on one communicator run in order). overlaps=False (a CPU with no core to
    spare): every collective's time adds to backward's instead."""
    costs = [cost(sum(grad_bytes[i] for i in b)) for b in buckets]
    if not overlaps:
        return max(ready) + sum(costs)
    end = 0.0
    for b, c in zip(buckets, costs):
        end = max(end, max(ready[i] for i in b)) + c
    return end


def ddp_step(fwd, ready, bwd_end, opt, grad_bytes, cap_bytes, link, ranks, first_cap_bytes=None,
             strategy="ddp", accum=1):
    """(step seconds, exposed communication seconds) of DDP / ZeRO-1 / ZeRO-2 from a measured or modelled
    backward: ready[i] = seconds after backward's start when gradient i is ready, in ready order. accum
    micro-batches a step (gradient accumulation): DDP and ZeRO-1 run the first accum-1 under no_sync, with no
    communication, and all-reduce once, during the last backward; ZeRO-2 keeps only its shard of the gradients, so
    it reduce-scatters every micro-batch's; the optimizer (and ZeRO's all-gather) once a step."""
    buckets = buckets_of(grad_bytes, cap_bytes, first_cap_bytes)
    reduce = link.reduce_scatter if strategy == "zero2" else link.all_reduce
    comm_end = overlap(ready, grad_bytes, buckets, lambda n: reduce(n, ranks), link.overlaps)
    after = max(bwd_end, comm_end)
    gather = 0.0
    if strategy in ("zero1", "zero2"):  # step my shard, then all-gather the parameters, bucket by bucket
        opt = opt / ranks
        gather = sum(link.all_gather(sum(grad_bytes[i] for i in b), ranks) for b in buckets)
    synced = accum if strategy == "zero2" else 1  # micro-batches that communicate
    step = (accum - 1) * (fwd + bwd_end) + (synced - 1) * (after - bwd_end) + fwd + after + opt + gather
    return step, synced * (after - bwd_end) + gather


def fsdp_step(fwd_units, bwd_units, unit_bytes, grad_unit_bytes, opt, link, ranks, accum=1, prefetch=True,
              nodes=1, trace=None):
    """(step seconds, exposed communication) of FSDP (nodes=1) or HSDP (ranks: the shard group, one node; nodes
    replicas). Units in forward order; one queue of the shard group's collectives, run in the order issued:
      forward   unit i+1's all-gather is issued as unit i's forward starts (forward prefetch), so it gathers while
                unit i computes;
      backward  with prefetch (PyTorch's BackwardPrefetch.BACKWARD_PRE, the default) the next unit's all-gather
                is issued as this unit's backward starts, before this unit's reduce-scatter, so both run while
                the next units compute; without it (backward_prefetch=None) the next all-gather waits behind this
                unit's reduce-scatter, and both are exposed;
      HSDP      after its reduce-scatter, each unit's shard is all-reduced across the nodes, on a stream of its own
                (the NICs, not NVLink), on the last micro-batch only (set_requires_all_reduce(False) before the
                others: the shards accumulate locally);
      accum     every micro-batch gathers each unit twice and reduce-scatters its gradients (FSDP keeps only
                shards), the optimizer steps once.
    trace, if a list, receives (kind, unit, start, end) for each computation and collective."""
    ag = [link.all_gather(n, ranks) for n in unit_bytes]
    rs = [link.reduce_scatter(n, ranks) for n in grad_unit_bytes]
    ar = [link.across_nodes_all_reduce(n, nodes) if nodes > 1 else 0.0 for n in grad_unit_bytes]
    note = trace.append if trace is not None else (lambda _: None)
    t = queue = cross = 0.0  # when compute, the shard group's queue and the cross-node stream are free
    n = len(fwd_units)

    def issue(at, kind, unit, cost):
        nonlocal queue
        start = max(queue, at)
        queue = start + cost
        note((kind, unit, start, queue))
        return queue

    micro, seen = 0, None
    while micro < accum:
        # Between the first and the last, every micro-batch starts as the one before did (the same backlog in the
        # queue), so the rest repeat it: skip to the last, which HSDP's all-reduce makes different (a trace is
        # drawn whole)
        if trace is None and 0 < micro < accum - 1:
            if seen is not None and abs((queue - t) - seen[1]) <= 1e-12 * max(t, 1e-9):
                skip = accum - 1 - micro
                t, queue, micro = t + skip * (t - seen[0]), queue + skip * (t - seen[0]), accum - 1
            seen = (t, queue - t)
        gathered = {0: issue(t, "all-gather", 0, ag[0])}
        for i in range(n):
            start = max(t, gathered[i])
            if i + 1 < n:
                gathered[i + 1] = issue(start, "all-gather", i + 1, ag[i + 1])
            t = start + fwd_units[i]
            note(("forward", i, start, t))
        order = list(range(n))[::-1]
        gathered = {order[0]: issue(t, "all-gather", order[0], ag[order[0]])}  # resharded after forward
        for j, i in enumerate(order):
            start = max(t, gathered[i])
            nxt = order[j + 1] if j + 1 < n else None
            if prefetch and nxt is not None:
                gathered[nxt] = issue(start, "all-gather", nxt, ag[nxt])
            t = start + bwd_units[i]
            note(("backward", i, start, t))
            reduced = issue(t, "reduce-scatter", i, rs[i])
            if nodes > 1 and micro == accum - 1:
                begin, cross = max(cross, reduced), max(cross, reduced) + ar[i]
                note(("all-reduce", i, begin, cross))
            if not prefetch and nxt is not None:
                gathered[nxt] = issue(t, "all-gather", nxt, ag[nxt])
        micro += 1
    t = max(t, queue, cross)
    compute = accum * (sum(fwd_units) + sum(bwd_units))
    return t + opt / ranks, t - compute


def best_bucket(fwd, ready, bwd_end, opt, grad_bytes, link, ranks, strategy="ddp", accum=1):
    """(step seconds, exposed, bucket MiB) of the fastest cap from 1/4 MiB to 1 GiB (doublings of 25 MiB): DDP's
    25 MiB unless another is faster by more than 0.5%, then the nearest to 25 MiB of the fastest."""
    best = None
    for cap_mb in sorted([25 * 2.0 ** k for k in range(-6, 6)], key=lambda c: abs(math.log(c / 25))):
        step, exposed = ddp_step(fwd, ready, bwd_end, opt, grad_bytes, cap_mb * MIB, link, ranks, strategy=strategy,
                                 accum=accum)
        if best is None or step < best[0] * 0.995:
            best = (step, exposed, cap_mb)
    return best


# --- memory per rank ---
def memory(strategy, params, ranks, param_bytes=2, grad_bytes=2, state_bytes=12, bucket_bytes=0, unit_params=0,
           activations=0, next_unit_params=None, ddp_buckets=False):
    """Bytes per rank: parameters, gradients, optimizer state (state_bytes a parameter: AdamW's two moments, plus
    fp32 master weights in mixed precision: 12 = 4 + 4 + 4), buckets, FSDP's gathered units (unit_params: the
    largest, next_unit_params: the next largest, gathered beside it; default the same), activations.
    ddp_buckets: PyTorch's DDP (and ZeRO-1, its ZeroRedundancyOptimizer under DDP) keeps its buckets beside the
    gradients, a second copy of them, unless gradient_as_bucket_view=True makes each .grad a view into its bucket
    (05's DDPCore, 07 and the ZeRO paper's table hold none)."""
    shard = math.ceil(params / ranks)
    next_unit_params = unit_params if next_unit_params is None else next_unit_params
    copy = params * grad_bytes if ddp_buckets else 0
    rows = {"ddp": (params * param_bytes, params * grad_bytes, params * state_bytes, copy),
            "zero1": (params * param_bytes, params * grad_bytes, shard * state_bytes, copy),
            # ZeRO-2 keeps the mean of its shard, plus full-size buckets only while they fill and travel (07)
            "zero2": (params * param_bytes, shard * grad_bytes, shard * state_bytes, bucket_bytes),
            # FSDP: shards, plus two gathered units (this one and the prefetched next) and one unit's full gradient
            "fsdp": (shard * param_bytes, shard * grad_bytes, shard * state_bytes,
                     (unit_params + next_unit_params) * param_bytes + unit_params * grad_bytes)}[strategy]
    return dict(zip(("parameters", "gradients", "optimizer_state", "buckets_and_units"), rows),
                activations=activations, total=sum(rows) + activations)


# --- models, for predict ---
CONFIG_TYPES = ("gpt2", "llama", "mistral", "qwen2", "gpt_neox")


def model_shape(name):
    """The shape of --model: a name from MODELS, or a Hugging Face config.json, read by its model_type (GPT-2;
    Llama, Mistral and Qwen2, which share Llama's layer; GPT-NeoX, Pythia's), with each default Hugging Face's
    config class gives a key the file leaves out."""
    if name in MODELS:
        return dict(MODELS[name], name=name)
    try:
        with open(name) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {name}: not one of {', '.join(MODELS)}, nor a readable config.json ({e})") from None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind not in CONFIG_TYPES:
        raise ValueError(f"--model {name}: model_type {kind!r} is not one the cost model reads "
                         f"({', '.join(CONFIG_TYPES)})")
    try:
        if kind == "gpt2":  # learned positions, biases, LayerNorm, the head tied unless the config says not
            return dict(kind="gpt2", layers=cfg["n_layer"], d=cfg["n_embd"], heads=cfg.get("n_head", 12),
                        vocab=cfg["vocab_size"], ctx=cfg.get("n_positions", 1024),
                        ff=cfg.get("n_inner") or 4 * cfg["n_embd"], tied=cfg.get("tie_word_embeddings", True),
                        name=name)
        d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if kind == "gpt_neox":
            # Parallel residual (attention and MLP both read the layer's input) and partial rotary (rotary_pct of
            # each head rotated) change neither the parameters nor the FLOPs: read, kept for the record
            rotary = cfg.get("rotary_pct", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25))
            return dict(kind="gpt_neox", layers=cfg["num_hidden_layers"], d=d, heads=heads, vocab=cfg["vocab_size"],
                        ctx=cfg.get("max_position_embeddings", 2048), ff=cfg.get("intermediate_size") or 4 * d,
                        tied=cfg.get("tie_word_embeddings", False), bias=cfg.get("attention_bias", True),
                        parallel_residual=cfg.get("use_parallel_residual", True), rotary_pct=rotary, name=name)
        kv_heads = cfg.get("num_key_value_heads") or heads
        return dict(kind="llama", layers=cfg["num_hidden_layers"], d=d, heads=heads, kv=kv_heads / heads,
                    head_dim=cfg.get("head_dim") or d // heads, vocab=cfg["vocab_size"],
                    ctx=cfg.get("max_position_embeddings", 2048), ff=cfg["intermediate_size"],
                    tied=cfg.get("tie_word_embeddings", False),
                    # Qwen2 biases q, k and v (not o); Llama's attention_bias biases all four
                    qkv_bias=kind == "qwen2" or cfg.get("attention_bias", False),
                    o_bias=kind != "qwen2" and cfg.get("attention_bias", False),
                    mlp_bias=cfg.get("mlp_bias", False), name=name)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"--model {name}: a {kind} config.json without {e}") from None


def layer_tensors(m):
    """One layer's parameter tensors, in forward order: the norms and biases (small) first, then the matrices."""
    d, ff = m["d"], m["ff"]
    if m["kind"] in ("gpt2", "gpt_neox"):  # fused q/k/v, output, MLP up and down; two LayerNorms (weight, bias)
        bias = 3 * d + d if m.get("bias", True) else 0  # attention's (GPT-NeoX's attention_bias); the MLP's always
        return [4 * d + bias + ff + d, 3 * d * d, d * d, d * ff, ff * d]
    q = m["heads"] * m.get("head_dim", d // m["heads"])
    kv = round(m.get("kv", 1.0) * m["heads"]) * m.get("head_dim", d // m["heads"])
    small = 2 * d + (q + 2 * kv) * m.get("qkv_bias", False) + d * m.get("o_bias", False) \
        + (2 * ff + d) * m.get("mlp_bias", False)  # two RMSNorms, the biases a config asks for
    return [small, d * q, d * kv, d * kv, q * d, d * ff, d * ff, ff * d]


def layer_params(m):
    """(parameters of one transformer layer, of the embeddings, head and final norm)."""
    layer = sum(layer_tensors(m))
    head = m["vocab"] * m["d"] * (1 if m["tied"] else 2)
    outer = {"gpt2": head + m["ctx"] * m["d"] + 2 * m["d"],  # learned positions, final LayerNorm
             "gpt_neox": head + 2 * m["d"], "llama": head + m["d"]}[m["kind"]]
    return int(layer), int(outer)


CHECKPOINTING, ATTENTION, STRATEGIES = ("none", "selective", "full"), ("flash", "eager"), \
    ("ddp", "zero1", "zero2", "fsdp", "hsdp")


def activation_bytes(m, seq, batch, checkpointing="none", attention="flash"):
    """Bytes of activations one micro-batch leaves for backward, 16-bit, no tensor or sequence parallelism
    (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models",
    arXiv:2205.05198, Sec. 4): a layer stores s b h (34 + 5 a s / h) bytes, where 5 a s^2 b are the attention
    scores, their softmax and its dropout mask. Flash attention (PyTorch's scaled_dot_product_attention on A100 and
    H100 in bf16) never stores those, nor does selective recomputation (the paper's: recompute that attention core
    in backward): 34 s b h. Full recomputation keeps each layer's input, 2 s b h, and rebuilds one layer at a time
    in backward. Plus the fp32 logits and their gradient, 8 s b vocab (the head is not checkpointed). 34 counts each
    tensor of a GPT layer once; Hugging Face's eager layers keep more (GPT-2 40, a Llama layer 46:
    benchmarks/README.md), so read it as a lower bound; full checkpointing's 2 s b h is exact."""
    s, b, h, layers = seq, batch, m["d"], m["layers"]
    whole = 34 * s * b * h + (5 * m.get("heads", 1) * s * s * b if attention == "eager" else 0)
    kept = {"none": whole * layers, "selective": 34 * s * b * h * layers,
            "full": 2 * s * b * h * layers + whole}[checkpointing]
    return kept + 8 * s * b * m["vocab"]


def flops_per_token(m, params, seq, checkpointing="none", attention="flash"):
    """(model FLOPs, hardware FLOPs) a token, as published MFU tables count them (PaLM's MFU, Chowdhery et al.
    2022; nanoGPT's estimate_mfu; llm-foundry's benchmarking README): 6 N (N: every parameter) plus attention's
    12 L d s (QK^T and AV: s d multiply-adds each, 4 s d FLOPs a token a layer forward, twice that backward),
    causal masking not discounted. Hardware FLOPs add what recomputation computes again: full, one more forward
    (1/3 of the model FLOPs: 4/3 in all, as llm-foundry's HFU counts it); selective, the attention core's forward,
    4 L d s, with eager attention (flash attention's backward recomputes it anyway, and published HFU leaves that
    out)."""
    attention_flops = 12 * m["layers"] * m["d"] * seq
    model = 6 * params + attention_flops
    again = {"none": 0, "selective": attention_flops / 3 if attention == "eager" else 0, "full": model / 3}
    return model, model + again[checkpointing]


def sent_per_step(strategy, params, gpus, gpus_per_node=8, accum=1, word=2):
    """Bytes each GPU sends a step (a ring sends (n-1)/n of the tensor a pass: an all-reduce two passes, a
    reduce-scatter or all-gather one), bf16 parameters and gradients: what each strategy communicates per
    micro-batch and per step. DDP, ZeRO-1: once a step (no_sync); ZeRO-2: a reduce-scatter every micro-batch, an
    all-gather a step; FSDP: two all-gathers and a reduce-scatter every micro-batch; HSDP: those within the node
    every micro-batch, its 1/g shard all-reduced across the nodes once a step."""
    size = word * params

    def ring(n):
        return (n - 1) / n if n > 1 else 0.0

    shard = min(gpus, gpus_per_node)
    return {"ddp": 2 * ring(gpus) * size, "zero1": 3 * ring(gpus) * size,
            "zero2": (accum + 1) * ring(gpus) * size, "fsdp": accum * 3 * ring(gpus) * size,
            "hsdp": accum * 3 * ring(shard) * size + 2 * ring(gpus // shard) * size / shard}[strategy]


def hardware_figures(hardware, gpu_mem_gib=None, inter_node_gbps=None, intra_node_gbps=None, peak_tflops=None,
                     gpus_per_node=None):
    """A HARDWARE profile with the user's figures in place of its own; "yours" names those replaced."""
    hw = dict(HARDWARE[hardware], profile=hardware)
    yours = []
    for key, value in (("intra_busbw", intra_node_gbps), ("inter_busbw", inter_node_gbps),
                       ("memory_gib", gpu_mem_gib), ("peak_tflops", peak_tflops), ("gpus_per_node", gpus_per_node)):
        if value is not None and value != hw[key]:
            yours.append(key)
        if value is not None:
            hw[key] = type(hw[key])(value)
    hw["yours"] = yours
    hw.pop("source")
    return hw


def describe_hardware(hw):
    """The figures a prediction used, each marked "yours" where the user's replaced the profile's."""
    def mark(key, text):
        return f"{text} (yours)" if key in hw["yours"] else text
    return (f"{hw['profile']}{' with your figures' if hw['yours'] else ''}: "
            + ", ".join([mark("gpus_per_node", f"{hw['gpus_per_node']} GPU{'s' * (hw['gpus_per_node'] != 1)} a node"),
                         mark("intra_busbw", f"{hw['intra_busbw']:g} GB/s a GPU within a node"),
                         mark("inter_busbw", f"{hw['inter_busbw']:g} GB/s a node across nodes"),
                         mark("memory_gib", f"{hw['memory_gib']:g} GiB"),
                         mark("peak_tflops", f"{hw['peak_tflops']:g} TFLOPS peak")]))


def bandwidth(text):
    """A bandwidth flag's value in GB/s: a bare number is GB/s (bytes); with a unit, what the user has: 50GB/s,
    400Gb/s, 400gbps, 400 Gbit/s (bits: / 8), and a count of ports in front: 8x400Gb/s = 400 GB/s. Datasheets quote
    NICs in Gb/s per port, NVLink in GB/s."""
    match = re.fullmatch(r"\s*(?:(\d+)\s*[x*]\s*)?([0-9.]+(?:e[+-]?\d+)?)\s*([A-Za-z/]*)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a bandwidth: {text!r} (GB/s; or 400Gb/s, 8x400Gbps, 50GB/s)")
    ports, value, unit = int(match[1] or 1), float(match[2]), match[3]
    if unit and not re.fullmatch(r"(?i)g(b|bit|bits|byte|bytes)(/s|ps)?", unit):
        raise argparse.ArgumentTypeError(f"{text!r}: unit {unit!r} is not GB/s nor Gb/s (e.g. 50GB/s, 400Gbps)")
    bits = unit[1:2] == "b" or "bit" in unit.lower()  # Gb, gb, Gbit: bits; GB, GByte: bytes
    gb_s = ports * value / (8 if bits else 1)
    if not (gb_s > 0 and math.isfinite(gb_s)):
        raise argparse.ArgumentTypeError(f"must be a positive bandwidth, got {text!r}")
    return gb_s


# What the default (HFU 0.4) predicted for the published runs in tests/test_costmodel.py's PUBLISHED, as a
# fraction of their tokens/s (the test recomputes it): a guess, off by this much on well-tuned runs
DEFAULT_GUESS = (0.51, 1.15)


def read_measurement(path, row=None):
    """A throughput measured on GPUs, from the JSON of benchmarks/gpu_check.sh ({"gpu", "peak_tflops", "rows": [
    {"name", "impl", "world_size", "tokens_per_s", "n_params", "n_layer", "n_embd", "seq_len", "batch_size", ...}]})
    or of benchmarks/ddp_step.py ({"world_size", "device", "parameters", "impls": {name: {"tokens_per_s",
    "tflops", ...}}}). row: a row's name (gpu_check) or impl (ddp_step); default the fastest with DDP in it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--measured {path}: not a readable JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("rows"), list):  # gpu_check
        rows = {r["name"]: r for r in data["rows"]}
        ddp = [n for n, r in rows.items() if r.get("impl") != "none"] or list(rows)
    elif isinstance(data, dict) and isinstance(data.get("impls"), dict):  # ddp_step
        if data.get("device") != "cuda":
            raise ValueError(f"--measured {path}: measured on {data.get('device')}, not a GPU: no MFU to take")
        shape = {k: data.get(k) for k in ("n_layer", "n_embd", "seq_len", "batch_size")}  # the model and batch
        rows = {n: dict(r, **shape, name=n, impl=n, world_size=data["world_size"], n_params=data.get("parameters"),
                        tflops=r.get("tflops")) for n, r in data["impls"].items()}
        ddp = [n for n in rows if n in ("manual", "torch")] or list(rows)
    else:
        raise ValueError(f"--measured {path}: neither gpu_check's JSON (rows) nor ddp_step's (impls)")
    if row is None:
        row = max(ddp, key=lambda n: rows[n]["tokens_per_s"])
    if row not in rows:
        raise ValueError(f"--measured-row {row!r}: not in {path} (rows: {', '.join(rows)})")
    r = rows[row]
    return dict(tokens_per_s=float(r["tokens_per_s"]), gpus=int(r.get("world_size") or 1), name=f"{path} {row!r}",
                n_params=r.get("n_params"), n_layer=r.get("n_layer"), n_embd=r.get("n_embd"),
                seq_len=r.get("seq_len"), batch_size=r.get("batch_size"), tflops=r.get("tflops"),
                peak_tflops=data.get("peak_tflops"), impl=r.get("impl"))


def rate_from_measurement(m, measured, run):
    """(HFU, what it came from): the compute's rate a measured run implies. Of this model (the same parameters):
    the HFU at which this model predicts the measured tokens/s on the measured GPUs (one node), found by bisection,
    so that the communication the model sees there is not counted twice when it scales out. Of another model: that
    run's own MFU, tokens/s x its FLOPs a token / (GPUs x peak), carried over (without recompute: its HFU)."""
    gpus = measured["gpus"]
    per_gpu = measured["tokens_per_s"] / gpus
    layer, outer = layer_params(m)
    params = m["layers"] * layer + outer
    same = (measured.get("n_params") is None or abs(measured["n_params"] / params - 1) < 0.01) \
        and measured.get("n_layer") in (None, m["layers"]) and measured.get("n_embd") in (None, m["d"])
    hw = hardware_figures(run["hardware"], run["gpu_mem_gib"], run["inter_node_gbps"], run["intra_node_gbps"],
                          run["peak_tflops"], run["gpus_per_node"])
    peak = measured.get("peak_tflops") or hw["peak_tflops"]
    if gpus > hw["gpus_per_node"]:
        raise ValueError(f"measured on {gpus} GPUs: more than one node of {hw['gpus_per_node']}; measure on one node")
    if not same:
        if measured.get("tflops"):  # ddp_step counts the FLOPs itself (the whole job's)
            hfu = measured["tflops"] / gpus / peak
        elif measured.get("n_layer") and measured.get("n_embd") and measured.get("seq_len"):
            flops = 6 * measured["n_params"] + 12 * measured["n_layer"] * measured["n_embd"] * measured["seq_len"]
            hfu = per_gpu * flops / (peak * 1e12)
        else:
            raise ValueError(f"--measured {measured['name']}: another model ({measured['n_params']:,} parameters, "
                             f"this one {params:,}) and not its shape (n_layer, n_embd, seq_len): no MFU to take")
        if not 0 < hfu <= 1:
            raise ValueError(f"--measured {measured['name']}: an MFU of {hfu:.3f} at {peak:g} TFLOPS peak")
        return hfu, f"MFU {hfu:.3f} measured ({measured['name']}, {measured['n_params']:,} parameters) and carried over"
    kw = dict(run, seq=measured.get("seq_len") or run["seq"], batch=measured.get("batch_size") or run["batch"])
    if measured.get("impl") is not None:
        kw["strategy"] = "ddp"  # gpu_check's and ddp_step's rows run DDP, or each rank alone ("none")
    alone = 1 if measured.get("impl") == "none" else gpus  # "none": no communication to take out
    kw.update(gpus_per_node=hw["gpus_per_node"], peak_tflops=peak)  # the rate is a fraction of the measured GPU's peak

    def rate(x):
        return predict(m, alone, hfu=x, **kw)["tokens_per_s_per_gpu"]
    lo, hi = 1e-6, 1.0
    if rate(hi) < per_gpu:
        raise ValueError(f"measured {measured['tokens_per_s']:,.0f} tokens/s on {gpus} GPUs: more than this model "
                         f"computes at 100% of {peak:g} TFLOPS (another model, GPU or sequence length?)")
    for _ in range(60):  # the step only shortens as the compute's rate rises: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < per_gpu else (lo, mid)
    return hi, (f"HFU {hi:.3f} from {measured['tokens_per_s']:,.0f} tokens/s measured on {gpus} GPU(s) "
                f"({measured['name']})")


def predict(model, gpus, gpus_per_node=None, hardware="h100-ib", strategy="ddp", batch=4, seq=None, mfu=None,
            bucket_mb=None, hfu=None, activation_checkpointing="none", grad_accum=1, attention="flash",
            gpu_mem_gib=None, inter_node_gbps=None, intra_node_gbps=None, peak_tflops=None, prefetch=True,
            trace=None, bucket_view=False, measured=None, weights="bf16"):
    """The step of one model on gpus GPUs: a dict with the keys `predict --json` prints. batch: sequences per GPU
    per micro-batch; grad_accum micro-batches a step. mfu (model FLOPs) or hfu (hardware FLOPs, recompute
    included): the rate of the compute, as a fraction of the peak; or measured (read_measurement's dict: a run's
    tokens/s, from which the rate is derived); none of them: hfu 0.4, a guess. The hardware: a HARDWARE name, its
    figures replaced by those given (GB/s per node each direction across nodes, per GPU within; gpus_per_node
    default: the profile's). bucket_view: PyTorch DDP's gradient_as_bucket_view=True (no second gradient copy).
    weights: "bf16" (bf16 parameters and gradients, fp32 master weights in the optimizer: 2 + 2 + 12 bytes a
    parameter) or "fp32" (PyTorch's autocast, AMP: fp32 parameters and gradients, communicated in fp32: 4 + 4 + 8).
    prefetch=False: FSDP without backward prefetch; trace: a list for FSDP's timeline (fsdp_step)."""
    m = model_shape(model) if isinstance(model, str) else model
    if sum(x is not None for x in (mfu, hfu, measured)) > 1:
        raise ValueError("--mfu, --hfu and a measured throughput: give one (--mfu counts the model's FLOPs, --hfu "
                         "those recomputed too; a measurement gives the rate itself)")
    hw = hardware_figures(hardware, gpu_mem_gib, inter_node_gbps, intra_node_gbps, peak_tflops, gpus_per_node)
    gpus_per_node = hw["gpus_per_node"]
    if strategy == "hsdp" and gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"hsdp: --gpus {gpus} is not a whole number of nodes of {gpus_per_node}")
    source = "given" if mfu is not None or hfu is not None else "default"
    if measured is not None:
        hfu, source = rate_from_measurement(m, measured, dict(
            hardware=hardware, gpu_mem_gib=gpu_mem_gib, inter_node_gbps=inter_node_gbps,
            intra_node_gbps=intra_node_gbps, peak_tflops=peak_tflops, gpus_per_node=gpus_per_node,
            strategy=strategy, batch=batch, seq=seq, activation_checkpointing=activation_checkpointing,
            grad_accum=grad_accum, attention=attention, bucket_mb=bucket_mb, bucket_view=bucket_view,
            weights=weights))
    seq = seq or m["ctx"]
    word = {"bf16": 2, "fp32": 4}[weights]  # bytes of a parameter and of its gradient
    link = Link.from_profile(hw, gpus_per_node)
    layer, outer = layer_params(m)
    params = m["layers"] * layer + outer
    tokens = batch * seq  # per GPU per micro-batch
    model_flops, hw_flops = flops_per_token(m, params, seq, activation_checkpointing, attention)
    if mfu is None and hfu is None:
        hfu = 0.4
    peak = hw["peak_tflops"] * 1e12
    compute = tokens * (model_flops / (peak * mfu) if mfu is not None else hw_flops / (peak * hfu))
    fwd = compute * model_flops / 3 / hw_flops  # backward: twice the forward, plus what is recomputed
    bwd = compute - fwd
    # The optimizer reads and writes ~16+12 bytes a parameter (fp32 master, moments, bf16 copy) at ~2 TB/s.
    opt = params * 28 / 2e12
    # Backward from the head to the embeddings: each weight's gradient ready when its share of backward (its
    # FLOPs, in proportion to its parameters) is done, as hooks would see it; `word` bytes each.
    tensors = [m["vocab"] * m["d"]] + layer_tensors(m)[::-1] * m["layers"] + [outer - m["vocab"] * m["d"]]
    ready, t, grads = [], 0.0, []
    for n in tensors:
        t += n / params * bwd
        ready.append(t)
        grads.append(word * n)
    acts = activation_bytes(m, seq, batch, activation_checkpointing, attention)
    if strategy in ("fsdp", "hsdp"):
        # HSDP: a shard group per node, replicas across nodes (one node or less: FSDP)
        shard = min(gpus, gpus_per_node) if strategy == "hsdp" else gpus
        units = [outer] + [layer] * m["layers"]  # the root (embeddings, head) first, then each block
        fwd_u = [fwd * u / params for u in units]
        bwd_u = [bwd * u / params for u in units]
        step, exposed = fsdp_step(fwd_u, bwd_u, [word * u for u in units], [word * u for u in units], opt, link, shard,
                                  grad_accum, prefetch, gpus // shard, trace)
        best_mb = None
        big = sorted(units)[-2:] if len(units) > 1 else units * 2
        mem = memory("fsdp", params, shard, word, word, 16 - 2 * word, unit_params=big[-1], next_unit_params=big[0],
                     activations=acts)
    else:
        if bucket_mb:
            step, exposed = ddp_step(fwd, ready, bwd, opt, grads, bucket_mb * MIB, link, gpus, strategy=strategy,
                                     accum=grad_accum)
            best_mb = bucket_mb
        else:
            step, exposed, best_mb = best_bucket(fwd, ready, bwd, opt, grads, link, gpus, strategy, grad_accum)
        mem = memory(strategy, params, gpus, word, word, 16 - 2 * word, bucket_bytes=(best_mb or 25) * MIB,
                     activations=acts, ddp_buckets=not bucket_view)
    per_gpu = tokens * grad_accum / step
    # Scaling efficiency as ddp_step.py measures it: the same per-rank work without communication, over the step
    return dict(step_ms=step * 1e3, tokens_per_s=per_gpu * gpus, tokens_per_s_per_gpu=per_gpu,
                scaling_efficiency=(step - exposed) / step, memory_gib_per_gpu=mem["total"] / GIB,
                fits=mem["total"] <= hw["memory_gib"] * GIB, gpu_mem_gib=hw["memory_gib"], best_bucket_mb=best_mb,
                exposed_comm_ms=exposed * 1e3, params=params, memory_bytes=mem,
                utilization="mfu" if mfu is not None else "hfu",
                mfu=mfu if mfu is not None else hfu * model_flops / hw_flops,
                hfu=hfu if hfu is not None else mfu * hw_flops / model_flops,
                achieved_mfu=per_gpu * model_flops / peak, flops_per_token=model_flops,
                hardware_flops_per_token=hw_flops, activation_checkpointing=activation_checkpointing,
                attention=attention, grad_accum=grad_accum, global_batch_tokens=tokens * grad_accum * gpus,
                sent_gb_per_gpu_per_step=sent_per_step(strategy, params, gpus, gpus_per_node, grad_accum, word) / GB,
                rate_source=source, hardware=hw)


def zero_table(params=7.5e9, degrees=(1, 4, 16, 64, 256, 1024)):
    """The ZeRO paper's Table 1 (Rajbhandari et al., SC20, https://arxiv.org/abs/1910.02054): GB per device for
    7.5B parameters, K = 12, by data-parallel degree; ours from memory(), without activations or buffers."""
    return {n: {s: memory(s, int(params), n)["total"] / GB for s in ("ddp", "zero1", "zero2", "fsdp")}
            for n in degrees}


# --- fitting and checking on the machine at hand (under torchrun) ---
def line_fit(sizes, times):
    """(alpha, beta) of t = alpha + n beta by least squares, each point weighted by 1/t^2 (relative errors), so
    that small messages count as much as large ones; neither below zero."""
    w = [1 / max(t, 1e-9) ** 2 for t in times]
    sw, sx, sy = sum(w), sum(wi * n for wi, n in zip(w, sizes)), sum(wi * t for wi, t in zip(w, times))
    sxx, sxy = sum(wi * n * n for wi, n in zip(w, sizes)), sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    beta = max(1e-15, (sw * sxy - sx * sy) / (sw * sxx - sx * sx))
    return max(0.0, (sy - beta * sx) / sw), beta


FIT_SIZES = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 4 << 20, 64 << 20)  # `check` predicts between


def fit_link(lesson, device, world, iters=8, rows=None):
    """alpha and beta of one ring step from all_reduce.py's own measurement of 03's pipelined ring at FIT_SIZES
    (least squares on t - additions = 2(N-1) alpha + 2(N-1) c beta; the lesson ring allocates its receive
    buffer each call, and page faults make its largest sizes slower per byte), gamma from timing the ring's
    addition of a 1 MiB piece, point-to-point from send_recv.py's ping-pong (ranks 0 and 1). rows:
    all_reduce.py's rows at FIT_SIZES, if measured already. The same numbers on every rank (rank 0's, broadcast)."""
    import torch
    import torch.distributed as dist
    a, b = torch.ones(lesson.PIECE_BYTES // 4), torch.ones(lesson.PIECE_BYTES // 4)
    adds = []
    for _ in range(30):
        t0 = time.perf_counter()
        a.add_(b)
        adds.append(time.perf_counter() - t0)
    gamma = statistics.median(adds) / a.nbytes
    rows = [r for r in rows or measure_rings(lesson, device, FIT_SIZES, iters) if r["bytes"] in FIT_SIZES]
    steps = 2 * (world - 1)
    adds = [Link(0.0, 0.0, gamma, lesson.PIECE_BYTES).all_reduce(r["bytes"], world) for r in rows]  # gamma's part
    alpha, beta = line_fit([steps * r["bytes"] / world for r in rows],
                           [max(1e-9, r["ring_ms"] / 1e3 - add) for r, add in zip(rows, adds)])
    send_recv = load_script("benchmarks/send_recv.py")
    p2p = send_recv.ping_pong(device, [4 ** k for k in range(2, 12)], iters) if lesson.RANK < 2 else []
    p2p_alpha, p2p_beta = line_fit([r["bytes"] for r in p2p], [r["latency_us"] * 1e-6 for r in p2p]) if p2p \
        else (0.0, 0.0)
    fitted = torch.tensor([alpha / steps, beta, gamma, p2p_alpha, p2p_beta], dtype=torch.float64)
    dist.broadcast(fitted, src=0)
    alpha, beta, gamma, p2p_alpha, p2p_beta = fitted.tolist()
    # On a CPU, gloo's threads move and add the bytes: they overlap backward only if a core is left for them
    spare = device.type != "cpu" or (os.cpu_count() or 1) >= 2 * int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return dict(alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=gamma, p2p_alpha_s=p2p_alpha,
                p2p_beta_s_per_byte=p2p_beta, piece_bytes=lesson.PIECE_BYTES, overlaps=spare, fitted_on_ranks=world,
                ring_rows=[dict(bytes=r["bytes"], ms=r["ring_ms"]) for r in rows],
                p2p_rows=p2p if lesson.RANK == 0 else None)


def measure_rings(lesson, device, sizes, iters):
    """all_reduce.py's own measurement: the pipelined ring, the lesson ring and gloo's, side by side, at
    all_reduce.py's sizes (1 KiB times powers of 4) from the smallest to the largest of sizes, kept if in sizes."""
    all_reduce = load_script("benchmarks/all_reduce.py")
    all_reduce.lesson = lesson
    rows = all_reduce.measure(argparse.Namespace(min_bytes=min(sizes), max_bytes=max(sizes), iters=iters),
                              device, lesson.WORLD)
    return [r for r in rows if r["bytes"] in sizes]


def check_ddp(lesson, device, link, caps_mb, rounds, shape):
    """DDPCore's step (05) at each bucket cap against the prediction from the same run's backward, measured on a
    bare model (no DDP) with a hook per gradient. Rounds alternate the bare step and each cap (a slow spell of
    the machine hits all alike); a step counts as long as its slowest rank; medians over rounds."""
    import torch
    import torch.distributed as dist
    m05 = load_script("05_manual_ddp_gpt2.py")
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():  # a GPT-2 of --shape's layers and width, the same weights on every rank (05's model, resized)
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=shape[1], n_layer=shape[0], n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          activation_function="gelu_pytorch_tanh"))
    bare = build()
    wrapped = {}
    for cap in caps_mb:
        model = build()
        wrapped[cap] = m05.DDPCore(model, bucket_cap_mb=cap)
    params = [p for p in bare.parameters() if p.requires_grad]
    stamp = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamp.__setitem__(i, time.perf_counter()))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in [("bare", bare), *wrapped.items()]}
    g = torch.Generator().manual_seed(lesson.RANK)
    x = torch.randint(0, 256, (shape[2], 65), generator=g)

    def step(model, opt, profile=None):
        dist.barrier()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(input_ids=x[:, :-1], use_cache=False).logits.flatten(0, 1),
                                                 x[:, 1:].flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        if profile is not None:
            profile.append((t1 - t0, t2 - t1, t3 - t2, [stamp[i] - t1 for i in range(len(params))]))
        return t3 - t0

    profiles, times = [], {cap: [] for cap in caps_mb}
    for r in range(rounds + 2):  # two warm-up rounds: DDPCore rebuilds its buckets after the first backward
        keys = ["bare", *caps_mb] if r % 2 else [*caps_mb, "bare"][::-1]
        for k in keys:
            if k == "bare":
                step(bare, opts[k], profiles if r >= 2 else None)
            else:
                t = step(wrapped[k], opts[k])
                if r >= 2:
                    times[k].append(t)
    # The slowest rank per round, for the measured steps and the bare profile alike
    t = torch.tensor([times[c] for c in caps_mb] + [[p[0] + p[1] + p[2] for p in profiles]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    measured = {c: statistics.median(t[j].tolist()) for j, c in enumerate(caps_mb)}
    bare_ms = statistics.median(t[-1].tolist())
    # The median bare step, per part; the gradients' ready times of the median-backward round
    prof = sorted(profiles, key=lambda p: p[1])[len(profiles) // 2]
    fwd, bwd, opt = (statistics.median(p[j] for p in profiles) for j in range(3))
    order = sorted(range(len(params)), key=lambda i: prof[3][i])
    ready = [prof[3][i] * bwd / prof[1] for i in order]
    grad_bytes = [params[i].numel() * params[i].element_size() for i in order]
    rows = []
    for cap in caps_mb:
        pred, exposed = ddp_step(fwd, ready, bwd, opt, grad_bytes, cap * MIB, link, lesson.WORLD)
        n_buckets = len(wrapped[cap].buckets)
        rows.append(dict(bucket_cap_mb=cap, buckets=n_buckets, predicted_ms=pred * 1e3,
                         measured_ms=measured[cap] * 1e3, error=pred / measured[cap] - 1,
                         exposed_comm_ms=exposed * 1e3, bare_ms=bare_ms * 1e3))
    return rows, sum(grad_bytes)


def check_memory(lesson, device):
    """Bytes each rank holds at the optimizer step (parameters, gradients, AdamW's state), as 07 and 08 count
    them, against memory() in fp32 (4 + 4 + 8 bytes a parameter)."""
    import torch
    import torch.nn as nn
    m07, m08 = load_script("07_zero.py"), load_script("08_fsdp.py")
    a07 = m07.parse_args(["--steps", "1", "--n-layer", "2", "--n-embd", "128", "--vocab-size", "512",
                          "--seq-len", "32", "--batch-size", "2", "--bucket-cap-mb", "0.25"])
    base = m07.build_model(a07, device)
    n = sum(p.numel() for p in base.parameters())
    rows = []
    for kind, name in ((0, "ddp"), (1, "zero1"), (2, "zero2")):
        held = m07.train(kind, base, a07, device)["held"]
        pred = memory(name, n, lesson.WORLD, 4, 4, 8)
        rows.append((name, held, [pred["parameters"], pred["gradients"], pred["optimizer_state"]]))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    n = sum(p.numel() for p in net.parameters())
    for layer in net:
        m08.fully_shard(layer)
    m08.fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    held = [mib * MIB for mib in m08.held_mib(list(net.parameters()), opt)]
    pred = memory("fsdp", n, lesson.WORLD, 4, 4, 8)
    rows.append(("fsdp", held, [pred["parameters"], pred["gradients"], pred["optimizer_state"]]))
    # PyTorch's DDP: the bytes its gradients and buckets hold after six steps (the buckets rebuilt after the
    # first), with and without gradient_as_bucket_view, against memory()'s gradients and bucket copy. No broadcast
    # at construction (init_sync=False; the replicas are seeded alike): it flattens the parameters into one copy,
    # and when gloo's thread drops that copy last, the free is missing from the profiler's records, so the copy
    # counted as held (1 run in 7: one gradient-sized buffer more, 3x not 2x, 2x not 1x).
    for view in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        n = sum(p.numel() for p in net.parameters())

        def six_steps():
            ddp = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view, bucket_cap_mb=0.25,  # noqa: B023
                                                      init_sync=False)
            for _ in range(6):
                ddp(torch.randn(8, 256)).square().mean().backward()
            return ddp
        pred = memory("ddp", n, lesson.WORLD, 4, 4, 8, ddp_buckets=not view)
        rows.append((f"torch ddp{', bucket view' if view else ''}", [held_bytes(six_steps)],
                     [pred["gradients"], pred["buckets_and_units"]]))
    return [dict(strategy=s, measured_bytes=sum(h), predicted_bytes=sum(p), error=sum(p) / sum(h) - 1,
                 measured_parts=h, predicted_parts=p) for s, h, p in rows]


def held_bytes(fn):
    """Bytes that fn() leaves allocated (allocations minus frees while it runs, what it returns kept alive), from
    the profiler's allocation records: on CPU the resident set is too coarse (benchmarks/ddp_step.py's peak_mb
    reads the same records; private profiler internals: fine in a benchmark, never in a lesson)."""
    import torch
    from torch._C._profiler import _EventType
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = fn()  # noqa: F841 (alive until the records are read)
    total, todo = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag == _EventType.Allocation:  # alloc_size > 0 for an allocation, < 0 for a free
            total += node.extra_fields.alloc_size
    return total


# --- the command line ---
def describe(cal):
    return (f"fitted on {cal['fitted_on_ranks']} ranks: a ring step alpha {cal['alpha_s'] * 1e6:.1f} us + bytes / "
            f"{1 / cal['beta_s_per_byte'] / GB:.2f} GB/s, addition {1 / cal['gamma_s_per_byte'] / GB:.2f} GB/s; "
            f"one message alone {cal['p2p_alpha_s'] * 1e6:.1f} us + bytes / {1 / cal['p2p_beta_s_per_byte'] / GB:.2f} "
            f"GB/s; overlap with compute: {'yes' if cal['overlaps'] else 'no (no core to spare)'}")


def fit_main(args):
    lesson = lesson_module()
    if lesson.WORLD < 2:
        raise lesson.UsageError("fit needs 2+ ranks: torchrun --nproc_per_node=2 benchmarks/costmodel.py fit --out F")
    device = lesson.setup(args)
    cal = fit_link(lesson, device, lesson.WORLD, args.iters)
    lesson.print0(describe(cal))
    if lesson.RANK == 0:
        write_json(args.out, cal)
        lesson.print0(f"wrote {args.out}")
    lesson.print0("OK fitted")


def check_main(args):
    """Fit, then measure in the same run: the rings over sizes, DDPCore's step at two bucket caps, the memory."""
    lesson = lesson_module()
    if lesson.WORLD < 2:
        raise lesson.UsageError("check needs 2+ ranks: torchrun --nproc_per_node=2 benchmarks/costmodel.py check")
    device = lesson.setup(args)
    say, world = lesson.print0, lesson.WORLD
    t0 = time.perf_counter()
    # Measure --blocks times and take the medians: a machine whose load changes by the minute (other jobs on its
    # cores) then weighs on the fitted sizes and the checked ones alike.
    blocks = []
    for _ in range(args.blocks):  # one measurement gives the fit (FIT_SIZES) and the sizes checked
        blocks.append(measure_rings(lesson, device, sorted({*FIT_SIZES, *map(int, args.sizes)}), args.iters))
    # the median over blocks of each size's median, for the fit and the check alike
    rows = [dict(bytes=r["bytes"], **{k: statistics.median(b[j][k] for b in blocks) for k in ("ring_ms",
                                                                                           "lesson_ring_ms")})
            for j, r in enumerate(blocks[0])]
    cal = fit_link(lesson, device, world, args.iters, rows)
    link = Link.from_calibration(cal)
    say(f"{describe(cal)}, from {args.blocks} blocks ({time.perf_counter() - t0:.0f} s)")
    measured = [r for r in rows if r["bytes"] in args.sizes]
    ring_rows = []
    for r in measured:
        for name, f in (("ring", link.all_reduce), ("lesson_ring", link.lesson_ring)):
            pred, ms = f(r["bytes"], world) * 1e3, r[f"{name}_ms"]
            ring_rows.append(dict(impl=name, bytes=r["bytes"], predicted_ms=pred, measured_ms=ms, error=pred / ms - 1))
    say("\n| ring | bytes | predicted ms | measured ms (median) | error |\n|---|---:|---:|---:|---:|")
    for r in ring_rows:
        say(f"| {r['impl']} | {r['bytes']:,} | {r['predicted_ms']:.3f} | {r['measured_ms']:.3f} | {r['error']:+.0%} |")
    ddp_rows, total = check_ddp(lesson, device, link, args.caps, args.rounds, args.shape)
    say(f"\nDDPCore (05), {total / MIB:.2f} MiB of gradients, median of {args.rounds} rounds:\n"
        "| bucket cap MiB | buckets | predicted ms | measured ms | error | exposed comm ms (model) | bare step ms |\n"
        "|---:|---:|---:|---:|---:|---:|---:|")
    for r in ddp_rows:
        say(f"| {r['bucket_cap_mb']} | {r['buckets']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{r['error']:+.0%} | {r['exposed_comm_ms']:.1f} | {r['bare_ms']:.1f} |")
    mem_rows = check_memory(lesson, device)
    say("\nheld at the optimizer step (parameters + gradients + AdamW state; PyTorch's DDP: its gradients and "
        "buckets), fp32:\n| strategy | predicted bytes | measured bytes (07/08; allocated) | error |\n"
        "|---|---:|---:|---:|")
    for r in mem_rows:
        say(f"| {r['strategy']} | {r['predicted_bytes']:,} | {r['measured_bytes']:,} | {r['error']:+.1%} |")
    if lesson.RANK == 0 and args.json:
        write_json(args.json, dict(world_size=world, calibration=cal, rings=ring_rows, ddp=ddp_rows,
                                   memory=mem_rows, seconds=time.perf_counter() - t0))
        say(f"wrote {args.json}")
    say(f"OK checked on {world} ranks in {time.perf_counter() - t0:.0f} s")


def collective_main(args):
    if args.hardware:
        link = Link.from_profile(args.hardware)
    else:
        with open(args.calibration) as f:
            link = Link.from_calibration(json.load(f))
    ms = COLLECTIVES[args.name](link, args.bytes, args.ranks) * 1e3
    print(json.dumps({"ms": ms}) if args.json else f"{args.name} of {args.bytes:,} bytes on {args.ranks} ranks: "
          f"{ms:.3f} ms")


JSON_KEYS = ("step_ms", "tokens_per_s", "tokens_per_s_per_gpu", "scaling_efficiency", "exposed_comm_ms",
             "memory_gib_per_gpu", "gpu_mem_gib", "fits", "best_bucket_mb", "utilization", "mfu", "hfu",
             "achieved_mfu", "flops_per_token", "hardware_flops_per_token", "activation_checkpointing", "attention",
             "grad_accum", "global_batch_tokens", "sent_gb_per_gpu_per_step", "params", "rate_source", "hardware")


def predict_main(args):
    try:
        measured = read_measurement(args.measured, args.measured_row) if args.measured else None
        if args.measured_tokens_per_s:
            measured = dict(tokens_per_s=args.measured_tokens_per_s, gpus=args.measured_gpus,
                            name="--measured-tokens-per-s")
        out = predict(args.model, args.gpus, args.gpus_per_node, args.hardware, args.strategy, args.batch_size,
                      args.seq_len, args.mfu, args.bucket_mb, args.hfu, args.activation_checkpointing,
                      args.grad_accum, args.attention, args.gpu_mem_gib, args.inter_node_gbps, args.intra_node_gbps,
                      args.peak_tflops, bucket_view=args.gradient_as_bucket_view, measured=measured,
                      weights=args.weights)
    except ValueError as e:  # parse() catches these first; a direct caller of predict() gets the exception
        sys.exit(print(f"error: {e}", file=sys.stderr) or 2)
    if args.json:
        print(json.dumps({k: out[k] for k in JSON_KEYS}))
        return
    mem = out["memory_bytes"]
    given = out["utilization"]
    seq = args.seq_len or model_shape(args.model)["ctx"]
    hw = out["hardware"]
    print(f"{args.model} ({out['params'] / 1e9:.2f}B parameters), {args.strategy}, {args.gpus} GPUs "
          f"({hw['gpus_per_node']} per node), {args.batch_size} x {seq} tokens a micro-batch, "
          f"{args.grad_accum} a step, checkpointing {args.activation_checkpointing}:")
    print(f"  hardware {describe_hardware(hw)}")
    print(f"  step {out['step_ms']:.1f} ms, {out['tokens_per_s']:,.0f} tokens/s ({out['tokens_per_s_per_gpu']:,.0f} "
          f"a GPU), scaling efficiency {out['scaling_efficiency']:.2f} (exposed communication "
          f"{out['exposed_comm_ms']:.1f} ms); each GPU sends {out['sent_gb_per_gpu_per_step']:.1f} GB a step")
    print(f"  compute at {given.upper()} {out[given]:.3f} (so {'HFU' if given == 'mfu' else 'MFU'} "
          f"{out['hfu' if given == 'mfu' else 'mfu']:.3f}); {out['flops_per_token'] / 1e9:.2f} GFLOPs a token for the "
          f"model, {out['hardware_flops_per_token'] / 1e9:.2f} computed; MFU of the whole step "
          f"{out['achieved_mfu']:.3f}")
    if out["rate_source"] == "default":
        print(f"  HFU {out['hfu']:.1f} is a guess: on the published runs in benchmarks/README.md it predicted "
              f"{DEFAULT_GUESS[0]:.2f}-{DEFAULT_GUESS[1]:.2f} of their tokens/s; give --mfu, or measure one node "
              "(--measured-tokens-per-s, --measured)")
    elif out["rate_source"] != "given":
        print(f"  the rate: {out['rate_source']}")
    print(f"  memory per GPU {out['memory_gib_per_gpu']:.1f} GiB: " + ", ".join(
        f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in mem.items() if k != "total") +
        f" -> {'fits' if out['fits'] else 'does NOT fit'} in {out['gpu_mem_gib']:g} GiB")
    if out["best_bucket_mb"]:
        print(f"  best bucket size: {out['best_bucket_mb']} MiB")


def zero_table_main(args):
    print("GB per GPU, 7.5B parameters, bf16 + AdamW (K = 12), no activations\n"
          "| GPUs | DDP | ZeRO-1 (P_os) | ZeRO-2 (P_os+g) | ZeRO-3/FSDP (P_os+g+p) |\n|---:|---:|---:|---:|---:|")
    for n, row in zero_table().items():
        print(f"| {n} | " + " | ".join(f"{row[s]:.3g}" for s in ("ddp", "zero1", "zero2", "fsdp")) + " |")


def positive(kind):
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if not (x > 0 and math.isfinite(x)):
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
        return x
    return parse


def fraction(text):
    x = positive(float)(text)
    if x > 1:
        raise argparse.ArgumentTypeError(f"a fraction of the peak, 0 < x <= 1 (0.45 for 45%), got {text!r}")
    return x


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the numbered scripts
        sys.exit(print(f"error: {message}", file=sys.stderr) or 2)


def parse(argv=None):
    p = Parser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    f = sub.add_parser("fit", help="fit alpha, beta, gamma here (under torchrun)")
    f.add_argument("--out", required=True, help="the calibration JSON to write")
    f.add_argument("--iters", type=positive(int), default=8, help="rounds per ring size")
    c = sub.add_parser("collective", help="one collective's predicted time")
    c.add_argument("name", choices=list(COLLECTIVES))
    c.add_argument("--bytes", type=positive(int), required=True)
    c.add_argument("--ranks", type=positive(int), required=True)
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--calibration", help="a JSON that `fit` wrote")
    src.add_argument("--hardware", choices=list(HARDWARE), help="or a named profile")
    c.add_argument("--json", action="store_true")
    q = sub.add_parser("predict", help="step time, tokens/s, scaling and memory at scale")
    q.add_argument("--model", required=True, help=f"{'|'.join(MODELS)} or a Hugging Face config.json")
    q.add_argument("--gpus", type=positive(int), required=True)
    q.add_argument("--gpus-per-node", type=positive(int), default=None, help="default: the profile's")
    q.add_argument("--hardware", choices=list(HARDWARE), default="h100-ib",
                   help="a named profile: the defaults of the figures below")
    q.add_argument("--gpu-mem-gib", type=positive(float), default=None, help="each GPU's memory (profile: 80)")
    q.add_argument("--inter-node-gbps", type=bandwidth, default=None,
                   help="GB/s per node across nodes, each direction: all of a node's NICs; or with a unit, as NICs "
                        "are sold: 8x400Gb/s (= 400), 400Gbps (= 50), 50GB/s")
    q.add_argument("--intra-node-gbps", type=bandwidth, default=None,
                   help="GB/s per GPU within a node, each direction (NVLink: 450 on H100, 300 on A100, 150 on V100)")
    q.add_argument("--peak-tflops", type=positive(float), default=None, help="each GPU's dense bf16 peak")
    q.add_argument("--strategy", choices=list(STRATEGIES), default="ddp",
                   help="hsdp: FSDP within each node, the shards all-reduced across nodes")
    q.add_argument("--batch-size", type=positive(int), default=4, help="sequences per GPU per micro-batch")
    q.add_argument("--grad-accum", type=positive(int), default=1, help="micro-batches per optimizer step")
    q.add_argument("--seq-len", type=positive(int), default=None, help="default: the model's context")
    q.add_argument("--activation-checkpointing", choices=list(CHECKPOINTING), default="none")
    q.add_argument("--attention", choices=list(ATTENTION), default="flash",
                   help="flash: scores never stored (SDPA's kernels); eager: stored unless recomputed")
    u = q.add_mutually_exclusive_group()
    u.add_argument("--mfu", type=fraction, default=None,
                   help="the compute's rate as model FLOPs over peak (recompute not counted), a published MFU")
    u.add_argument("--hfu", type=fraction, default=None,
                   help="... or as hardware FLOPs over peak (recompute counted); none of these: --hfu 0.4, a guess")
    u.add_argument("--measured-tokens-per-s", type=positive(float), default=None,
                   help="... or this run's tokens/s measured on --measured-gpus GPUs of one node: the rate derived")
    u.add_argument("--measured", default=None,
                   help="... or the JSON of benchmarks/gpu_check.sh or benchmarks/ddp_step.py (a GPU run)")
    q.add_argument("--measured-gpus", type=positive(int), default=1, help="the GPUs --measured-tokens-per-s ran on")
    q.add_argument("--measured-row", default=None,
                   help="the row of --measured (gpu_check's name, ddp_step's impl); default the fastest with DDP")
    q.add_argument("--weights", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: bf16 parameters and gradients, fp32 master weights; fp32: PyTorch AMP (autocast), "
                        "fp32 parameters and gradients, all-reduced in fp32")
    q.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="PyTorch DDP's flag: gradients live in the buckets, no second copy of them")
    q.add_argument("--bucket-mb", type=positive(float), default=None, help="DDP/ZeRO buckets; default: the best")
    q.add_argument("--json", action="store_true")
    k = sub.add_parser("check", help="predictions against measurements here (under torchrun)")
    k.add_argument("--sizes", type=positive(int), nargs="+", default=[1 << 20, 16 << 20],
                   help="ring sizes checked (1 KiB x a power of 4), between the fitted ones (1-256 KiB, 4 and 64 MiB)")
    k.add_argument("--iters", type=positive(int), default=5, help="rounds per ring size in each block")
    k.add_argument("--blocks", type=positive(int), default=3, help="measure the rings this many times")
    k.add_argument("--caps", type=positive(float), nargs="+", default=[0.25, 64.0], help="DDPCore bucket caps, MiB")
    k.add_argument("--rounds", type=positive(int), default=15, help="DDPCore rounds")
    k.add_argument("--shape", type=positive(int), nargs=3, default=[4, 256, 4], help="layers, width, batch")
    k.add_argument("--json", default=None)
    sub.add_parser("zero-table", help="the ZeRO paper's Table 1, predicted")
    for s in (f, k):  # the setup block's flags
        s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        s.add_argument("--backend", default=None)
        s.add_argument("--timeout-s", type=positive(float), default=300)
    a = p.parse_args(argv)
    if a.command == "predict":
        try:
            model_shape(a.model)
        except ValueError as e:
            p.error(str(e))
        per_node = a.gpus_per_node or HARDWARE[a.hardware]["gpus_per_node"]
        if a.gpus % per_node and a.gpus > per_node:
            p.error(f"--gpus {a.gpus} is not a multiple of --gpus-per-node {per_node}")
        if a.measured and not os.path.isfile(a.measured):
            p.error(f"--measured {a.measured}: no such file")
        if a.measured_row and not a.measured:
            p.error("--measured-row: a row of --measured, which is not given")
        if a.bucket_mb and a.strategy in ("fsdp", "hsdp"):
            p.error(f"--bucket-mb: {a.strategy} communicates a unit (a layer) at a time, not in buckets")
    if a.command == "collective" and a.calibration and not os.path.isfile(a.calibration):
        p.error(f"--calibration {a.calibration}: no such file (write one with `fit`)")
    return a


def main():
    a = parse()
    if a.command in ("fit", "check"):
        lesson_module().run({"fit": fit_main, "check": check_main}[a.command], lambda: a)
    else:
        {"collective": collective_main, "predict": predict_main, "zero-table": zero_table_main}[a.command](a)


if __name__ == "__main__":
    main()
