"""A cost model of DDP, ZeRO and FSDP: collective times, step time and memory per rank, from 2 CPU ranks to 1,024 GPUs.

It predicts what the runs here cannot show: many GPUs, a large model, a slower network. It has three parts.

Collectives. A message costs alpha + bytes x beta (a latency and seconds per byte), and adding costs gamma a byte.
Fitted on this machine (`fit`), the formulas are those of the lessons' own code:
  point-to-point  alpha + n beta                               (01's send/recv)
  tree broadcast  ceil(log2 N) (alpha + n beta)                (02's binomial tree: one hop per round)
  lesson ring     2(N-1)(alpha + c beta) + (N-1) c gamma       (03's ring_all_reduce; c = n/N, a chunk)
  pipelined ring  2(N-1)(alpha + c beta) + (N-1)(c/k) gamma    (03's pipelined ring, k pieces a chunk: only the
                  last piece's addition shows, as long as adding is no slower than sending)
  reduce-scatter  (N-1)(alpha + c beta) + (N-1) c gamma;  all-gather (N-1)(alpha + c beta)
On GPUs a Hardware profile gives each figure, and NCCL's own tuning model gives the time (nccl_ring_latency).
A ring's latency grows with the ranks it crosses. NCCL picks a tree across nodes when the tree is faster. On an
Ethernet fabric the bandwidth a node gets falls past two nodes (Hardware.inter_at).

The step. Forward, then backward with each gradient ready at its time. Buckets launch in order as they fill (05's
bucket_layout), one collective at a time, during backward; then the optimizer. ZeRO-1 all-reduces, steps 1/N and
all-gathers; ZeRO-2 reduce-scatters instead (07). FSDP (08) all-gathers each unit before its forward and its
backward, and reduce-scatters its gradients after (PyTorch's prefetch order). HSDP is FSDP inside a node, with each
unit's shard all-reduced across nodes.

Memory per rank. Parameters, gradients and optimizer state, sharded as the strategy shards them; the reduce
buckets (PyTorch DDP's second copy of the gradients, ZeRO's bucket); FSDP's gathered units; the activations.

  torchrun --nproc_per_node=2 benchmarks/costmodel.py fit --out calibration.json
  python benchmarks/costmodel.py collective all_reduce --bytes 67108864 --ranks 2 --calibration calibration.json
  python benchmarks/costmodel.py predict --model llama-7b --gpus 64 --hardware h100-ib --strategy fsdp
  python benchmarks/costmodel.py forecast --model gpt2-xl --hardware 100gbe --step-ms 1:120 2:810
  torchrun --nproc_per_node=2 benchmarks/costmodel.py check      (predictions against measurements here)
  python benchmarks/costmodel.py zero-table                      (the ZeRO paper's Table 1, predicted)

benchmarks/costmodel_fit.py holds the fitting: to this machine (fit, check) and to your own runs (forecast).
docs/costmodel.md says how to use it, and how far to trust it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GB, GIB, MIB = 1e9, 2**30, 2**20
CHECKPOINTING, ATTENTION = ("none", "selective", "full"), ("flash", "eager")
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
PRECISIONS = ("bf16", "bf16-pure", "amp", "fp32")
OPTIMIZERS = ("adamw", "sgd-momentum", "sgd", "none")
CONFIG_TYPES = ("gpt2", "llama", "mistral", "qwen2", "gpt_neox")


# --- the hardware: each figure with where it comes from ---
@dataclass(frozen=True)
class Hardware:
    """One kind of node. Bandwidths are NCCL's bus bandwidth (nccl-tests' busbw) in GB/s, each direction: intra_busbw
    is one GPU's within a node, inter_busbw one node's across nodes (all its NICs together, since NCCL runs a ring
    per NIC). alpha_intra and alpha_inter are one hop's latency in seconds, NCCL's figures for the Simple protocol:
    a ring hop over NVLink (3.4 us) and over the network (14 us). hbm_tbps is the memory bandwidth the optimizer
    step is bound by. ring_plateau is NCCL's factor on a multi-node ring's latency (1.4; 1.9 before Ampere).
    falloff: past two nodes, the fabric gives a node at most inter_line x (2 / nodes) ** falloff, and a node never
    gets more than inter_busbw (inter_at). inter_line is the line rate; 0 means inter_busbw itself."""
    name: str
    gpus_per_node: int
    intra_busbw: float
    inter_busbw: float
    alpha_intra: float
    alpha_inter: float
    peak_tflops: float
    memory_gib: float
    hbm_tbps: float
    ring_plateau: float = 1.4
    falloff: float = 0.0
    inter_line: float = 0.0
    source: str = field(default="", repr=False, compare=False)
    yours: tuple[str, ...] = ()  # the figures the user gave in place of the profile's
    fitted: tuple[str, ...] = ()  # the figures fitted from the user's measurements

    @classmethod
    def named(cls, name: str, **figures: float | None) -> Hardware:
        """A profile from HARDWARE, with the user's figures (those not None) in place of its own."""
        if name not in HARDWARE:
            raise ValueError(f"--hardware {name}: not one of {', '.join(HARDWARE)}")
        return HARDWARE[name].with_figures(**figures)

    def with_figures(self, *, mark: str = "yours", **figures: float | None) -> Hardware:
        """This profile with some figures replaced; mark says whose: "yours" (given) or "fitted" (measured)."""
        changed = {k: type(getattr(self, k))(v) for k, v in figures.items() if v is not None}
        for key, value in changed.items():
            if not ((value >= 0 if key == "falloff" else value > 0) and math.isfinite(value)):
                raise ValueError(f"{key} = {value}: must be a positive number")
        new = [k for k, v in changed.items() if v != getattr(self, k)]
        marks = {"yours": self.yours, "fitted": self.fitted}
        marks[mark] = tuple(dict.fromkeys((*marks[mark], *new)))
        return dataclasses.replace(self, **changed, **marks)

    def inter_at(self, nodes: int) -> float:
        """GB/s a node between nodes when a collective spans this many nodes: inter_busbw up to two nodes; past
        them no more than the fabric's share, inter_line x (2 / nodes) ** falloff. Two limits in a row: what a
        node's stack moves (measured on two nodes), and what the fabric gives each node as more share it."""
        if nodes <= 2 or not self.falloff:
            return self.inter_busbw
        return min(self.inter_busbw, (self.inter_line or self.inter_busbw) * (2 / nodes) ** self.falloff)


# Past two nodes an Ethernet fabric gives each node less: all_reduce_perf's bus bandwidth on 8 x 100 Gb/s RoCE a
# node, 1-8 GB (NVIDIA/nccl-tests issue 169), was about 100, 70, 58, 58 and 40 GB/s on 2, 3, 4, 5 and 6 nodes. A
# line through them in log space, (2 / nodes) ** k from the line rate: k = 0.75 (within 14% of each point)
FALLOFF = 0.75
HARDWARE = {h.name: h for h in (
    Hardware("h100-nvlink", 8, 450.0, 450.0, 3.4e-6, 14e-6, 989.0, 80.0, 3.35,
             source="H100 SXM5 80GB: NVLink 900 GB/s (450 each way), BF16 989 TFLOPS dense, HBM3 3.35 TB/s "
                    "(https://www.nvidia.com/en-us/data-center/h100/); one NVSwitch node, nothing across nodes"),
    Hardware("h100-ib", 8, 450.0, 400.0, 3.4e-6, 14e-6, 989.0, 80.0, 3.35,
             source="DGX H100: 8x H100 SXM5 (above), 8 single-port ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU: "
                    "8 x 50 GB/s = 400 GB/s a node (https://docs.nvidia.com/dgx/dgxh100-user-guide/"
                    "introduction-to-dgxh100.html)"),
    Hardware("a100-ib", 8, 300.0, 200.0, 3.4e-6, 14e-6, 312.0, 80.0, 2.039,
             source="DGX A100: 8x A100 SXM4 80GB, NVLink 600 GB/s (300 each way), BF16 312 TFLOPS dense, HBM2e "
                    "2,039 GB/s (https://www.nvidia.com/en-us/data-center/a100/); 8 ConnectX-6 200 Gb/s HDR "
                    "InfiniBand = 200 GB/s a node (https://docs.nvidia.com/dgx/dgxa100-user-guide/"
                    "introduction-to-dgxa100.html)"),
    Hardware("v100-16gb", 8, 150.0, 50.0, 3.4e-6, 14e-6, 125.0, 16.0, 0.9, ring_plateau=1.9,
             source="DGX-1 with V100: 8x Tesla V100 SXM2 16GB, NVLink 2 (6 links of 25 GB/s each way = 150), FP16 "
                    "tensor cores 125 TFLOPS (V100 has no bf16), HBM2 900 GB/s (the V100 datasheet); 4 x 100 Gb/s "
                    "EDR InfiniBand = 50 GB/s a node (the DGX-1 datasheet). Its NVLink is a hybrid cube-mesh, so "
                    "NCCL's rings run below the line rate taken here"),
    Hardware("v100-32gb", 16, 150.0, 100.0, 3.4e-6, 14e-6, 125.0, 32.0, 0.9, ring_plateau=1.9,
             source="DGX-2, the ZeRO paper's nodes: 16x Tesla V100 SXM3 32GB on NVSwitch (150 GB/s each way a GPU), "
                    "125 TFLOPS fp16, HBM2 900 GB/s; 8 x 100 Gb/s EDR InfiniBand = 100 GB/s a node, the paper's "
                    "\"800 Gbps internode\" (Rajbhandari et al., SC20, arXiv:1910.02054, Sec. 10.1)"),
    Hardware("100gbe", 8, 450.0, 12.5, 3.4e-6, 25e-6, 989.0, 80.0, 3.35, falloff=FALLOFF,
             source="8x H100 SXM5 a node (above), the nodes joined by one 100 Gb/s Ethernet port each: 12.5 GB/s a "
                    "node (IEEE 802.3 100GBASE); 25 us a hop, an assumption for TCP (NCCL's own model says 14 us); "
                    "past two nodes the fabric's share a node falls as (2 / nodes) ** 0.75, fitted to an Ethernet "
                    "fabric's all-reduce on 2 to 6 nodes (NVIDIA/nccl-tests issue 169)"),
)}


# --- model shapes, written here so that nothing is downloaded ---
@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape. kind: "gpt2" (learned positions, biases, LayerNorm, head tied unless
    said), "llama" (RMSNorm, SwiGLU, no biases unless said), "gpt_neox" (Pythia: LayerNorm, biases, 4d MLP). kv:
    the fraction of heads that are key/value heads. ctx: the context; None when a config does not say."""
    kind: str
    layers: int
    d: int
    heads: int
    vocab: int
    ff: int
    ctx: int | None = None
    tied: bool = True
    kv: float = 1.0
    head_dim: int | None = None
    bias: bool = True  # gpt_neox's attention_bias (its MLP always has biases)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    name: str = ""

    def __post_init__(self):
        if self.kind not in ("gpt2", "llama", "gpt_neox"):
            raise ValueError(f"kind {self.kind!r}: not gpt2, llama or gpt_neox")
        for key in ("layers", "d", "heads", "vocab", "ff", "ctx", "head_dim"):
            value = getattr(self, key)
            if value is None and key in ("ctx", "head_dim"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} is {value!r}, not a whole number above 0")
        if self.head_dim is None and self.d % self.heads:
            raise ValueError(f"{self.heads} heads do not divide a width of {self.d}")
        if not 0 < self.kv <= 1:
            raise ValueError(f"{self.kv * self.heads:g} key/value heads for {self.heads} heads")

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d // self.heads


MODELS = {s.name: s for s in (
    Shape("gpt2", 12, 768, 12, 50257, 3072, ctx=1024, name="gpt2"),  # 124M
    Shape("gpt2", 48, 1600, 25, 50257, 6400, ctx=1024, name="gpt2-xl"),  # 1.56B
    # llm-foundry's MPT benchmark shapes: their parameter counts are its benchmarking README's NumParams
    Shape("gpt2", 32, 4096, 32, 50368, 16384, ctx=2048, name="mpt-7b"),  # 6.66B
    Shape("gpt2", 40, 5120, 40, 50368, 20480, ctx=2048, name="mpt-13b"),  # 12.9B
    Shape("gpt2", 48, 7168, 64, 50368, 28672, ctx=2048, name="mpt-30b"),  # 30.0B
    Shape("llama", 32, 4096, 32, 32000, 11008, ctx=2048, tied=False, name="llama-7b"),  # 6.74B; Llama 2 7B's shape
    Shape("llama", 32, 4096, 32, 128256, 14336, ctx=8192, tied=False, kv=0.25, name="llama3-8b"),  # 8.03B
    Shape("llama", 80, 8192, 64, 32000, 28672, ctx=4096, tied=False, kv=0.125, name="llama2-70b"),  # 69.0B
)}


def model_shape(name: str) -> Shape:
    """The shape of --model: a name from MODELS, or a Hugging Face config.json read by its model_type (GPT-2;
    Llama, Mistral and Qwen2, which share Llama's layer; GPT-NeoX, Pythia's). A key the file leaves out takes the
    default Hugging Face's config class gives it, except the context, which stays unknown."""
    if name in MODELS:
        return MODELS[name]
    try:
        with open(name) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {name}: not one of {', '.join(MODELS)}, nor a readable config.json ({e})") from None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind not in CONFIG_TYPES:
        raise ValueError(f"--model {name}: model_type {kind!r} is not one the cost model reads "
                         f"({', '.join(CONFIG_TYPES)})")

    def count(key, default=None):
        value = cfg.get(key, default)
        if value is None:
            raise ValueError(f"--model {name}: the {kind} config.json has no {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--model {name}: {key} is {value!r}, not a whole number above 0")
        return value

    try:
        if kind == "gpt2":  # GPT2Config's defaults for what the file leaves out
            d = count("n_embd")
            return Shape("gpt2", count("n_layer"), d, count("n_head", 12), count("vocab_size"),
                         cfg.get("n_inner") and count("n_inner") or 4 * d, ctx=count("n_positions", 1024),
                         tied=cfg.get("tie_word_embeddings", True), name=name)
        d, heads = count("hidden_size"), count("num_attention_heads")
        ctx = cfg.get("max_position_embeddings") and count("max_position_embeddings")
        if kind == "gpt_neox":  # parallel residual and partial rotary change neither parameters nor FLOPs
            return Shape("gpt_neox", count("num_hidden_layers"), d, heads, count("vocab_size"),
                         cfg.get("intermediate_size") and count("intermediate_size") or 4 * d, ctx=ctx,
                         tied=cfg.get("tie_word_embeddings", False), bias=cfg.get("attention_bias", True), name=name)
        kv = count("num_key_value_heads", heads)
        return Shape("llama", count("num_hidden_layers"), d, heads, count("vocab_size"), count("intermediate_size"),
                     ctx=ctx, tied=cfg.get("tie_word_embeddings", False), kv=kv / heads,
                     head_dim=cfg.get("head_dim") and count("head_dim"),
                     # Qwen2 biases q, k and v (not o); Llama's attention_bias biases all four
                     qkv_bias=kind == "qwen2" or cfg.get("attention_bias", False),
                     o_bias=kind != "qwen2" and cfg.get("attention_bias", False),
                     mlp_bias=cfg.get("mlp_bias", False), name=name)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("--model") else f"--model {name}: {e}") from None


def layer_tensors(m: Shape) -> list[int]:
    """One layer's parameter tensors, in forward order: the norms and biases (small) first, then the matrices."""
    d, ff = m.d, m.ff
    if m.kind in ("gpt2", "gpt_neox"):  # fused q/k/v, output, MLP up and down; two LayerNorms (weight, bias)
        bias = 3 * d + d if m.bias else 0  # attention's (GPT-NeoX's attention_bias); the MLP's always
        return [4 * d + bias + ff + d, 3 * d * d, d * d, d * ff, ff * d]
    q = m.heads * m.head_width
    kv = round(m.kv * m.heads) * m.head_width
    small = 2 * d + (q + 2 * kv) * m.qkv_bias + d * m.o_bias + (2 * ff + d) * m.mlp_bias  # two RMSNorms, biases
    return [small, d * q, d * kv, d * kv, q * d, d * ff, d * ff, ff * d]


def layer_params(m: Shape) -> tuple[int, int]:
    """(parameters of one transformer layer, of the embeddings, head and final norm)."""
    head = m.vocab * m.d * (1 if m.tied else 2)
    outer = {"gpt2": head + (m.ctx or 0) * m.d + 2 * m.d,  # learned positions, final LayerNorm
             "gpt_neox": head + 2 * m.d, "llama": head + m.d}[m.kind]
    return int(sum(layer_tensors(m))), int(outer)


# --- collectives ---
NCCL_RING_BASE = 8.4e-6  # NCCL's baseLat for a ring, Simple protocol (src/graph/tuning.cc)
NCCL_TREE_HOP_INTRA = 28e-6  # hwLat[NVLink][Tree][Simple]; across nodes NCCL takes 28 us, twice the ring's 14
NCCL_NET_OVERHEAD = 3e-6  # getNetOverhead(): 1 us a step on Intel CPUs, x3 for Simple, once a ring leaves a node
# NCCL's correction of the tree's bandwidth for medium sizes (Simple protocol), by log2(bytes / 64)
NCCL_TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)


def nccl_ring_latency(ranks: int, per_node: int, passes: int, hw: Hardware) -> float:
    """A ring's latency in seconds as NCCL's tuning model (src/graph/tuning.cc, 2.19) counts it, Simple protocol.
    passes: 2 for an all-reduce, 1 for a reduce-scatter or an all-gather. Each of the passes x (ranks-1) steps is a
    hop: 2 x nodes of them cross the network for an all-reduce (nodes-1 for one pass). So the latency grows with
    every rank added, not only with the nodes."""
    nodes = math.ceil(ranks / per_node)
    steps = passes * (ranks - 1)
    if nodes == 1:
        return NCCL_RING_BASE + steps * hw.alpha_intra
    inter = min(steps, 2 * nodes if passes == 2 else nodes - 1)
    intra = max(hw.alpha_intra, NCCL_NET_OVERHEAD)
    latency = NCCL_RING_BASE + (steps - inter) * intra + inter * hw.alpha_inter
    return latency * (hw.ring_plateau if passes == 2 else 1.0)  # NCCL's "plateau effect of ring"


def nccl_all_reduce(n: float, ranks: int, per_node: int, busbw: float, hw: Hardware) -> tuple[float, str]:
    """(seconds, "ring" or "tree"): an all-reduce of n bytes as NCCL would run it. Inside one node, a ring. Across
    nodes, the faster of a ring and a double binary tree by NCCL's model. The tree's latency grows with log2 of the
    nodes, but it moves bytes at 0.92 x half the bus bandwidth, less at medium sizes. busbw in bytes a second."""
    ring = nccl_ring_latency(ranks, per_node, 2, hw) + 2 * (ranks - 1) / ranks * n / busbw
    nodes = math.ceil(ranks / per_node)
    if nodes == 1:
        return ring, "ring"
    latency = 2 * ((min(ranks, per_node) - 1) * NCCL_TREE_HOP_INTRA + int(math.log2(nodes)) * 2 * hw.alpha_inter)
    size = int(math.log2(max(n, 64) / 64))
    correction = NCCL_TREE_CORRECTION[size] if size < len(NCCL_TREE_CORRECTION) else 1.0
    tree = latency + n / (0.92 * busbw * 0.5 * correction)
    return (tree, "tree") if tree < ring else (ring, "ring")


class Link:
    """Every collective's time in seconds for n bytes on N ranks. Either fitted here (alpha, beta, gamma of one ring
    step, from `fit`), with the lessons' formulas; or a Hardware profile, with NCCL's model."""

    def __init__(self, alpha: float, beta: float, gamma: float = 0.0, piece_bytes: int = 1 << 20,
                 hardware: Hardware | None = None, overlaps: bool = True, p2p: tuple[float, float] | None = None):
        self.alpha, self.beta, self.gamma, self.piece = alpha, beta, gamma, piece_bytes
        self.hw, self.overlaps = hardware, overlaps
        self.p2p_cost = p2p or (alpha, beta)  # (alpha, beta) of one message alone

    @classmethod
    def from_hardware(cls, hw: Hardware | str) -> Link:
        hw = HARDWARE[hw] if isinstance(hw, str) else hw
        return cls(hw.alpha_intra, 1 / (hw.intra_busbw * GB), hardware=hw)

    @classmethod
    def from_calibration(cls, cal: dict) -> Link:
        return cls(cal["alpha_s"], cal["beta_s_per_byte"], cal["gamma_s_per_byte"], cal["piece_bytes"],
                   overlaps=cal["overlaps"], p2p=(cal["p2p_alpha_s"], cal["p2p_beta_s_per_byte"]))

    def _busbw(self, ranks):
        """Bytes a second through the slowest level the ring crosses."""
        hw = self.hw
        if ranks <= hw.gpus_per_node:
            return hw.intra_busbw * GB
        return min(hw.intra_busbw, hw.inter_at(math.ceil(ranks / hw.gpus_per_node))) * GB

    def _hop(self, ranks):
        return self.hw.alpha_inter if ranks > self.hw.gpus_per_node else self.hw.alpha_intra

    def p2p(self, n, ranks=2):
        """One message. On a profile, it crosses the network when the ranks span nodes (an upper bound: one pair
        may get one NIC, not all of a node's)."""
        if self.hw:
            return self._hop(ranks) + n / self._busbw(ranks)
        return self.p2p_cost[0] + n * self.p2p_cost[1]

    def broadcast(self, n, ranks):
        if ranks < 2:
            return 0.0
        if self.hw:  # NCCL pipelines a broadcast down a ring: every rank is one hop, the bytes go through once
            return NCCL_RING_BASE + ranks * self._hop(ranks) + n / self._busbw(ranks)
        return math.ceil(math.log2(ranks)) * (self.alpha + n * self.beta)

    def lesson_ring(self, n, ranks):
        if ranks < 2:
            return 0.0
        c = n / ranks
        if self.hw:
            latency = nccl_ring_latency(ranks, self.hw.gpus_per_node, 2, self.hw)
            return latency + 2 * (ranks - 1) * c / self._busbw(ranks)
        return 2 * (ranks - 1) * (self.alpha + c * self.beta) + (ranks - 1) * c * self.gamma

    def all_reduce(self, n, ranks):
        """NCCL's choice on a profile; the pipelined ring (the fastest hand-written one) when fitted here."""
        if ranks < 2:
            return 0.0
        if self.hw:
            return nccl_all_reduce(n, ranks, self.hw.gpus_per_node, self._busbw(ranks), self.hw)[0]
        c = n / ranks
        k = max(1, math.ceil(c / self.piece))  # pieces per chunk: each one more message
        add = (ranks - 1) * (c * max(0.0, self.gamma - self.beta) + (c / k) * min(self.beta, self.gamma))
        return 2 * (ranks - 1) * (self.alpha + c * self.beta) + add

    def reduce_scatter(self, n, ranks):
        if ranks < 2:
            return 0.0
        if self.hw:
            return nccl_ring_latency(ranks, self.hw.gpus_per_node, 1, self.hw) + (ranks - 1) / ranks * n \
                / self._busbw(ranks)
        c = n / ranks
        return (ranks - 1) * (self.alpha + c * (self.beta + self.gamma))

    def all_gather(self, n, ranks):
        """n: the gathered (full) size."""
        if ranks < 2:
            return 0.0
        if self.hw:
            return nccl_ring_latency(ranks, self.hw.gpus_per_node, 1, self.hw) + (ranks - 1) / ranks * n \
                / self._busbw(ranks)
        return (ranks - 1) * (self.alpha + n / ranks * self.beta)

    def across_nodes_all_reduce(self, n, nodes):
        """HSDP's all-reduce of a unit's shards across nodes. Each of a node's g ranks all-reduces its n/g bytes with
        its peers, one rank a node. The g all-reduces run at once through the node's NICs, so each gets 1/g of them."""
        if nodes < 2:
            return 0.0
        g = self.hw.gpus_per_node
        return nccl_all_reduce(n / g, nodes, 1, self.hw.inter_at(nodes) * GB / g, self.hw)[0]


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
             strategy="ddp", accum=1, param_bytes=None):
    """(step seconds, exposed communication seconds) of DDP / ZeRO-1 / ZeRO-2 from a measured or modelled
    backward: ready[i] = seconds after backward's start when gradient i is ready, in ready order. accum
    micro-batches a step: DDP and ZeRO-1 run the first accum-1 under no_sync and all-reduce once, during the last
    backward; ZeRO-2 keeps only its shard of the gradients, so it reduce-scatters every micro-batch's. The optimizer
    (and ZeRO's all-gather of the parameters, param_bytes each; default the gradients' size) runs once a step."""
    buckets = buckets_of(grad_bytes, cap_bytes, first_cap_bytes)
    reduce = link.reduce_scatter if strategy == "zero2" else link.all_reduce
    comm_end = overlap(ready, grad_bytes, buckets, lambda n: reduce(n, ranks), link.overlaps)
    after = max(bwd_end, comm_end)
    gather = 0.0
    if strategy in ("zero1", "zero2"):  # step my shard, then all-gather the parameters, bucket by bucket
        opt = opt / ranks
        params = param_bytes or grad_bytes
        gather = sum(link.all_gather(sum(params[i] for i in b), ranks) for b in buckets)
    synced = accum if strategy == "zero2" else 1  # micro-batches that communicate
    step = (accum - 1) * (fwd + bwd_end) + (synced - 1) * (after - bwd_end) + fwd + after + opt + gather
    return step, synced * (after - bwd_end) + gather


def fsdp_step(fwd_units, bwd_units, unit_bytes, grad_unit_bytes, opt, link, ranks, accum=1, prefetch=True,
              nodes=1, trace=None):
    """(step seconds, exposed communication) of FSDP (nodes=1) or HSDP (ranks: the shard group, one node; nodes
    replicas). Units in forward order; one queue of the shard group's collectives, run in the order issued:
      forward   unit i+1's all-gather is issued as unit i's forward starts (forward prefetch);
      backward  with prefetch (PyTorch's BackwardPrefetch.BACKWARD_PRE, the default) the next unit's all-gather
                is issued as this unit's backward starts, before this unit's reduce-scatter, so both run while
                the next units compute; without it (backward_prefetch=None) the next all-gather waits behind this
                unit's reduce-scatter, and both are exposed;
      HSDP      after its reduce-scatter, each unit's shard is all-reduced across the nodes, on a stream of its own,
                on the last micro-batch only (set_requires_all_reduce(False) before the others);
      accum     every micro-batch gathers each unit twice and reduce-scatters its gradients, the optimizer steps once.
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
        # queue), so the rest repeat it: skip to the last, which HSDP's all-reduce makes different
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


BUCKET_CAPS_MB = tuple(25 * 2.0 ** k for k in range(-6, 6))  # 0.39 MiB to 800 MiB, doublings of DDP's 25 MiB


def best_bucket(fwd, ready, bwd_end, opt, grad_bytes, link, ranks, strategy="ddp", accum=1, param_bytes=None):
    """(step seconds, exposed, bucket MiB) of the fastest cap in BUCKET_CAPS_MB, 0.39 MiB to 800 MiB: DDP's 25 MiB
    unless another is faster by more than 0.5%, then the nearest to 25 MiB of the fastest."""
    best = None
    for cap_mb in sorted(BUCKET_CAPS_MB, key=lambda c: abs(math.log(c / 25))):
        step, exposed = ddp_step(fwd, ready, bwd_end, opt, grad_bytes, cap_mb * MIB, link, ranks, strategy=strategy,
                                 accum=accum, param_bytes=param_bytes)
        if best is None or step < best[0] * 0.995:
            best = (step, exposed, cap_mb)
    return best


# --- memory per rank ---
def memory(strategy: str, params: int, ranks: int, *, param_bytes: float = 2, grad_bytes: float = 2,
           state_bytes: float = 12, bucket_bytes: float = 0, unit_params: int = 0,
           next_unit_params: int | None = None, activations: float = 0, ddp_buckets: bool = False) -> dict[str, float]:
    """Bytes per rank: parameters, gradients, optimizer state (state_bytes a parameter: AdamW's two moments, plus
    fp32 master weights in mixed precision: 12 = 4 + 4 + 4), buckets, FSDP's gathered units (unit_params: the
    largest, next_unit_params: the next largest, gathered beside it; default the same), activations.
    ddp_buckets: PyTorch's DDP (and ZeRO-1, its ZeroRedundancyOptimizer under DDP) keeps its buckets beside the
    gradients, a second copy of them, unless gradient_as_bucket_view=True makes each .grad a view into its bucket
    (05's DDPCore, 07 and the ZeRO paper's table hold none). bucket_bytes: ZeRO-2's bucket, full-size while it
    fills and travels (07's; DeepSpeed's reduce_bucket_size)."""
    shard = math.ceil(params / ranks)
    next_unit_params = unit_params if next_unit_params is None else next_unit_params
    copy = params * grad_bytes if ddp_buckets else 0
    rows = {"ddp": (params * param_bytes, params * grad_bytes, params * state_bytes, copy),
            "zero1": (params * param_bytes, params * grad_bytes, shard * state_bytes, copy),
            "zero2": (params * param_bytes, shard * grad_bytes, shard * state_bytes, bucket_bytes),
            # FSDP: shards, plus two gathered units (this one and the prefetched next) and one unit's full gradient
            "fsdp": (shard * param_bytes, shard * grad_bytes, shard * state_bytes,
                     (unit_params + next_unit_params) * param_bytes + unit_params * grad_bytes)}[strategy]
    return dict(zip(("parameters", "gradients", "optimizer_state", "buckets_and_units"), rows),
                activations=activations, total=sum(rows) + activations)


def optimizer_bytes(optimizer: str, precision: str, grad_word: int) -> tuple[int, int]:
    """(bytes a parameter the optimizer keeps, bytes it reads and writes a parameter a step). AdamW keeps two
    moments, SGD with momentum one, plain SGD none. With bf16 weights each also keeps fp32 master weights; in
    bf16-pure (a model cast to bf16, a plain optimizer) there is no master and the moments are bf16 too. A step reads
    the gradient, reads and writes the weights and each moment, and writes the 16-bit copy if there is one: 28 bytes
    for AdamW in bf16 (2 + 8 + 16 + 2), 12 for plain SGD."""
    moments = {"adamw": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}[optimizer]
    if optimizer == "none":
        return 0, 0
    state = 2 if precision == "bf16-pure" else 4  # a moment's bytes, and the weights' the step updates
    master = 4 if precision == "bf16" else 0  # fp32 master weights beside 16-bit ones
    copy = 2 if precision == "bf16" else 0  # the 16-bit weights written back from the master
    return state * moments + master, grad_word + 2 * state + 2 * state * moments + copy


def activation_bytes(m: Shape, seq: int, batch: int, checkpointing: str = "none", attention: str = "flash",
                     word: int = 2, logits_word: int = 4, dropout: bool = True) -> float:
    """Bytes of activations one micro-batch leaves for backward, no tensor or sequence parallelism (Korthikanti et
    al., 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, Sec. 4). In 16-bit
    a layer stores s b h (34 + 5 a s / h) bytes, where 5 a s^2 b are the attention scores, their softmax and its
    dropout mask. Flash attention never stores those, nor does selective recomputation: 34 s b h. Full
    recomputation keeps each layer's input, 2 s b h, and rebuilds one layer at a time in backward. Plus the logits
    and their gradient, 2 x logits_word s b vocab: fp32 (4) when the loss upcasts them, as Hugging Face, torchtitan
    and autocast do; 2 when it runs on 16-bit logits. word=4 (pure fp32 training) doubles the layers' share.
    Without dropout no masks are kept: 32 s b h, and 2 a s^2 b for the scores (the paper lists each mask).
    Hugging Face's eager layers keep more (GPT-2 40, a Llama layer 46), so read it as a lower bound."""
    s, b, h, layers = seq, batch, m.d, m.layers
    per_token = 34 if dropout else 32  # the masks after attention's output and after the MLP, 1 byte each
    whole = per_token * s * b * h + ((5 if dropout else 2) * m.heads * s * s * b if attention == "eager" else 0)
    kept = {"none": whole * layers, "selective": per_token * s * b * h * layers,
            "full": 2 * s * b * h * layers + whole}[checkpointing]
    return kept * word / 2 + 2 * logits_word * s * b * m.vocab


def flops_per_token(m: Shape, params: int, seq: int, checkpointing: str = "none",
                    attention: str = "flash") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) a token, as published MFU tables count them (PaLM's MFU; nanoGPT's
    estimate_mfu; llm-foundry's benchmarking README): 6 N (N: every parameter) plus attention's 12 L d s, causal
    masking not discounted. Hardware FLOPs add what recomputation computes again: full, one more forward (4/3 in
    all, as llm-foundry's HFU counts it); selective with eager attention, the attention core's forward, 4 L d s."""
    attention_flops = 12 * m.layers * m.d * seq
    model = 6 * params + attention_flops
    again = {"none": 0, "selective": attention_flops / 3 if attention == "eager" else 0, "full": model / 3}
    return model, model + again[checkpointing]


def sent_per_step(strategy, params, gpus, gpus_per_node=8, accum=1, word=2, grad_word=None):
    """Bytes each GPU sends a step. A ring sends (n-1)/n of the tensor a pass: an all-reduce two passes, a
    reduce-scatter or all-gather one. DDP, ZeRO-1: once a step (no_sync); ZeRO-2: a reduce-scatter every
    micro-batch, an all-gather a step; FSDP: two all-gathers and a reduce-scatter every micro-batch; HSDP: those
    within the node every micro-batch, its 1/g shard all-reduced across the nodes once a step."""
    p, g = word * params, (grad_word or word) * params

    def ring(n):
        return (n - 1) / n if n > 1 else 0.0

    shard = min(gpus, gpus_per_node)
    return {"ddp": 2 * ring(gpus) * g, "zero1": ring(gpus) * (2 * g + p),
            "zero2": ring(gpus) * (accum * g + p), "fsdp": accum * ring(gpus) * (2 * p + g),
            "hsdp": accum * ring(shard) * (2 * p + g) + 2 * ring(gpus // shard) * g / shard}[strategy]


# --- the run ---
@dataclass(frozen=True)
class Run:
    """One training job. model: a Shape, or a name from MODELS or a config.json path. batch: sequences per GPU per
    micro-batch, grad_accum micro-batches a step. precision: "bf16" (bf16 weights and gradients, fp32 master
    weights), "bf16-pure" (everything bf16, no master weights), "amp" (fp32 weights and gradients under autocast,
    16-bit activations) or "fp32" (pure fp32, activations too). grad_dtype: "param" (gradients as the weights) or
    "fp32" (fp32 gradients beside 16-bit weights, as Megatron and DeepSpeed keep them; DDP's buckets are then fp32
    too). optimizer: adamw, sgd-momentum, sgd, none. bucket_mb: DDP/ZeRO's bucket cap (None: the fastest);
    bucket_view: PyTorch DDP's gradient_as_bucket_view. prefetch: FSDP's backward prefetch (BACKWARD_PRE) on.
    logits: "fp32" when the loss upcasts the logits, "bf16" when it runs on 16-bit ones (pure-bf16 code, such as
    llm-foundry's PURE mode). dropout: False when every dropout probability is 0, as in most LLM pretraining, so
    no masks are kept. mfu or hfu: the compute's rate, a fraction of the peak (neither: HFU 0.4, a guess).
    fixed_ms: time a micro-batch costs whatever its size (kernel launches, the data loader)."""
    model: Shape | str
    gpus: int
    strategy: str = "ddp"
    batch: int = 4
    seq: int | None = None
    grad_accum: int = 1
    activation_checkpointing: str = "none"
    attention: str = "flash"
    precision: str = "bf16"
    grad_dtype: str = "param"
    optimizer: str = "adamw"
    bucket_mb: float | None = None
    bucket_view: bool = False
    prefetch: bool = True
    logits: str = "fp32"
    dropout: bool = True
    mfu: float | None = None
    hfu: float | None = None
    fixed_ms: float = 0.0

    def __post_init__(self):
        if isinstance(self.model, str):
            object.__setattr__(self, "model", model_shape(self.model))
        for key, allowed in (("strategy", STRATEGIES), ("activation_checkpointing", CHECKPOINTING),
                             ("attention", ATTENTION), ("precision", PRECISIONS), ("grad_dtype", ("param", "fp32")),
                             ("logits", ("fp32", "bf16")),
                             ("optimizer", OPTIMIZERS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} {getattr(self, key)!r}: not one of {', '.join(allowed)}")
        for key in ("gpus", "batch", "grad_accum"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} is {getattr(self, key)!r}, not a whole number above 0")
        if self.mfu is not None and self.hfu is not None:
            raise ValueError("--mfu and --hfu: give one (--mfu counts the model's FLOPs, --hfu those recomputed too)")
        for key in ("mfu", "hfu"):
            if getattr(self, key) is not None and not 0 < getattr(self, key) <= 1:
                raise ValueError(f"--{key} {getattr(self, key)}: a fraction of the peak, above 0 and at most 1")
        if self.seq is None and self.model.ctx is None:
            raise ValueError(f"{self.model.name}: the config has no max_position_embeddings, so give --seq-len")
        if self.fixed_ms < 0:
            raise ValueError(f"a fixed cost of {self.fixed_ms} ms a micro-batch: it cannot be negative")

    @property
    def seq_len(self) -> int:
        return self.seq or self.model.ctx

    @property
    def words(self) -> tuple[int, int]:
        """(bytes of a parameter, bytes of a gradient) as held and communicated."""
        param = 2 if self.precision.startswith("bf16") else 4
        return param, 4 if self.grad_dtype == "fp32" else param


@dataclass(frozen=True)
class Measurement:
    """A throughput measured on GPUs (read_measurement), from which predict derives the compute's rate."""
    tokens_per_s: float
    gpus: int = 1
    name: str = "a measurement"
    n_params: int | None = None
    n_layer: int | None = None
    n_embd: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    tflops: float | None = None
    peak_tflops: float | None = None
    impl: str | None = None


# What the default (HFU 0.4) predicted for the published runs in tests/test_costmodel.py's PUBLISHED, as a
# fraction of their tokens/s (the test recomputes it): a guess, off by this much on well-tuned runs
DEFAULT_GUESS = (0.51, 1.15)
LARGEST = dict(gpus=1_000_000, gpus_per_node=72, peak_tflops=20_000, memory_gib=2_048, inter_busbw=3_200,
               global_batch_tokens=1e9)


def warnings_for(run: Run, hw: Hardware) -> list[str]:
    """One line for each input past anything built: the prediction is arithmetic then, not a forecast."""
    out = []
    if run.gpus > LARGEST["gpus"]:
        out.append(f"{run.gpus:,} GPUs: no cluster is that large (the largest hold a few hundred thousand), so the "
                   "numbers below are arithmetic, not a forecast")
    if hw.gpus_per_node > LARGEST["gpus_per_node"]:
        out.append(f"{hw.gpus_per_node:,} GPUs a node: no NVLink domain is that large (GB200 NVL72 joins 72)")
    if hw.peak_tflops > LARGEST["peak_tflops"]:
        out.append(f"{hw.peak_tflops:,g} TFLOPS a GPU: about ten times any GPU sold (B200: 2,250 dense bf16)")
    if hw.memory_gib > LARGEST["memory_gib"]:
        out.append(f"{hw.memory_gib:,g} GiB a GPU: no GPU holds that much (B300: 288 GB)")
    if hw.inter_busbw > LARGEST["inter_busbw"]:
        out.append(f"{hw.inter_busbw:,g} GB/s a node between nodes: more than 8 NICs of 3.2 Tb/s, which no node has")
    tokens = run.batch * run.seq_len * run.grad_accum * run.gpus
    if tokens > LARGEST["global_batch_tokens"]:
        out.append(f"{tokens:,.0f} tokens a step: published runs use a few million (Llama 3 405B: 16 million)")
    if run.model.kind == "gpt2" and run.seq and run.model.ctx and run.seq > run.model.ctx:
        out.append(f"--seq-len {run.seq}: longer than {run.model.name}'s {run.model.ctx} learned positions")
    return out


def read_measurement(path: str, row: str | None = None) -> Measurement:
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
            raise ValueError(f"--measured {path}: measured on {data.get('device')}, not a GPU, so no MFU to take")
        shape = {k: data.get(k) for k in ("n_layer", "n_embd", "seq_len", "batch_size")}  # the model and batch
        rows = {n: dict(r, **shape, name=n, impl=n, world_size=data["world_size"], n_params=data.get("parameters"),
                        tflops=r.get("tflops")) for n, r in data["impls"].items()}
        ddp = [n for n in rows if n in ("manual", "torch")] or list(rows)
    else:
        raise ValueError(f"--measured {path}: neither gpu_check's JSON (rows) nor ddp_step's (impls)")
    if row is None:
        row = max(ddp, key=lambda n: rows[n]["tokens_per_s"])
    if row not in rows:
        raise ValueError(f"--measured-row {row!r}: not in {path} (its rows are {', '.join(rows)})")
    r = rows[row]
    return Measurement(float(r["tokens_per_s"]), int(r.get("world_size") or 1), f"{path} {row!r}", r.get("n_params"),
                       r.get("n_layer"), r.get("n_embd"), r.get("seq_len"), r.get("batch_size"), r.get("tflops"),
                       data.get("peak_tflops"), r.get("impl"))


def rate_from_measurement(run: Run, hw: Hardware, measured: Measurement) -> tuple[float, str]:
    """(HFU, what it came from): the compute's rate a measured run implies. Of this model (the same parameters):
    the HFU at which this model predicts the measured tokens/s on the measured GPUs (one node), found by bisection,
    so that the communication the model sees there is not counted twice when it scales out. Of another model: that
    run's own MFU, tokens/s x its FLOPs a token / (GPUs x peak), carried over."""
    m, gpus = run.model, measured.gpus
    per_gpu = measured.tokens_per_s / gpus
    layer, outer = layer_params(m)
    params = m.layers * layer + outer
    same = (measured.n_params is None or abs(measured.n_params / params - 1) < 0.01) \
        and measured.n_layer in (None, m.layers) and measured.n_embd in (None, m.d)
    peak = measured.peak_tflops or hw.peak_tflops
    if gpus > hw.gpus_per_node:
        raise ValueError(f"measured on {gpus} GPUs, more than one node of {hw.gpus_per_node}: measure on one node")
    if not same:
        if measured.tflops:  # ddp_step counts the FLOPs itself (the whole job's)
            hfu = measured.tflops / gpus / peak
        elif measured.n_layer and measured.n_embd and measured.seq_len:
            flops = 6 * measured.n_params + 12 * measured.n_layer * measured.n_embd * measured.seq_len
            hfu = per_gpu * flops / (peak * 1e12)
        else:
            raise ValueError(f"--measured {measured.name}: another model ({measured.n_params:,} parameters, this one "
                             f"{params:,}) without its shape (n_layer, n_embd, seq_len), so no MFU to take")
        if not 0 < hfu <= 1:
            raise ValueError(f"--measured {measured.name}: an MFU of {hfu:.3f} at {peak:g} TFLOPS peak")
        return hfu, f"MFU {hfu:.3f} measured ({measured.name}, {measured.n_params:,} parameters) and carried over"
    base = dataclasses.replace(run, seq=measured.seq_len or run.seq, batch=measured.batch_size or run.batch,
                               mfu=None, hfu=None)
    if measured.impl is not None:
        base = dataclasses.replace(base, strategy="ddp")  # gpu_check's and ddp_step's rows run DDP, or "none"
    alone = 1 if measured.impl == "none" else gpus  # "none": each rank alone, nothing to take out
    at_peak = dataclasses.replace(hw, peak_tflops=peak)  # the rate is a fraction of the measured GPU's peak
    hfu = solve_hfu(dataclasses.replace(base, gpus=alone), at_peak, per_gpu)
    return hfu, f"HFU {hfu:.3f} from {measured.tokens_per_s:,.0f} tokens/s measured on {gpus} GPU(s) ({measured.name})"


def solve_hfu(run: Run, hw: Hardware, tokens_per_s_per_gpu: float) -> float:
    """The HFU at which `run` predicts this many tokens/s a GPU, by bisection (the step only shortens as the rate
    rises). An error if even 100% of the peak is slower."""
    def rate(x):
        return predict(dataclasses.replace(run, mfu=None, hfu=x), hw)["tokens_per_s_per_gpu"]
    lo, hi = 1e-6, 1.0
    if rate(hi) < tokens_per_s_per_gpu:
        raise ValueError(f"measured {tokens_per_s_per_gpu:,.0f} tokens/s a GPU: more than this model computes at "
                         f"100% of {hw.peak_tflops:g} TFLOPS (another model, GPU or sequence length?)")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < tokens_per_s_per_gpu else (lo, mid)
    return hi


def predict(run: Run, hw: Hardware | str = "h100-ib", measured: Measurement | None = None,
            trace: list | None = None) -> dict:
    """The step of one run on one kind of hardware: a dict with the keys `predict --json` prints, plus the memory's
    parts (memory_bytes). measured: a run's throughput, from which the compute's rate is derived (then run.mfu and
    run.hfu must be None). trace: a list for FSDP's timeline (fsdp_step)."""
    hw = Hardware.named(hw) if isinstance(hw, str) else hw
    m, gpus, per_node = run.model, run.gpus, hw.gpus_per_node
    if run.strategy == "hsdp" and gpus > per_node and gpus % per_node:
        raise ValueError(f"hsdp: --gpus {gpus} is not a whole number of nodes of {per_node}")
    source = "given" if run.mfu is not None or run.hfu is not None else "default"
    if measured is not None:
        if source == "given":
            raise ValueError("--mfu or --hfu, and a measured throughput: give one (a measurement gives the rate)")
        hfu, source = rate_from_measurement(run, hw, measured)
        run = dataclasses.replace(run, hfu=hfu)
    mfu, hfu = run.mfu, run.hfu
    if mfu is None and hfu is None:
        hfu = 0.4
    seq, (word, grad_word) = run.seq_len, run.words
    link = Link.from_hardware(hw)
    layer, outer = layer_params(m)
    params = m.layers * layer + outer
    tokens = run.batch * seq  # per GPU per micro-batch
    model_flops, hw_flops = flops_per_token(m, params, seq, run.activation_checkpointing, run.attention)
    peak = hw.peak_tflops * 1e12
    flops_time = tokens * (model_flops / (peak * mfu) if mfu is not None else hw_flops / (peak * hfu))
    compute = flops_time + run.fixed_ms / 1e3  # a micro-batch's fixed cost runs as the kernels do
    fwd = compute * model_flops / 3 / hw_flops  # backward: twice the forward, plus what is recomputed
    bwd = compute - fwd
    state_bytes, moved = optimizer_bytes(run.optimizer, run.precision, grad_word)
    opt = params * moved / (hw.hbm_tbps * 1e12)  # the optimizer step is bound by memory bandwidth
    # Backward from the head to the embeddings: each weight's gradient ready when its share of backward (its
    # FLOPs, in proportion to its parameters) is done, as hooks would see it
    tensors = [m.vocab * m.d] + layer_tensors(m)[::-1] * m.layers + [outer - m.vocab * m.d]
    ready, t, grads = [], 0.0, []
    for n in tensors:
        t += n / params * bwd
        ready.append(t)
        grads.append(grad_word * n)
    acts = activation_bytes(m, seq, run.batch, run.activation_checkpointing, run.attention,
                            4 if run.precision == "fp32" else 2, 4 if run.logits == "fp32" else 2, run.dropout)
    if run.strategy in ("fsdp", "hsdp"):
        shard = min(gpus, per_node) if run.strategy == "hsdp" else gpus  # HSDP: a shard group per node
        units = [outer] + [layer] * m.layers  # the root (embeddings, head) first, then each block
        step, exposed = fsdp_step([fwd * u / params for u in units], [bwd * u / params for u in units],
                                  [word * u for u in units], [grad_word * u for u in units], opt, link, shard,
                                  run.grad_accum, run.prefetch, gpus // shard, trace)
        best_mb = None
        big = sorted(units)[-2:] if len(units) > 1 else units * 2
        mem = memory("fsdp", params, shard, param_bytes=word, grad_bytes=grad_word, state_bytes=state_bytes,
                     unit_params=big[-1], next_unit_params=big[0], activations=acts)
    else:
        kw = dict(strategy=run.strategy, accum=run.grad_accum, param_bytes=[word * n for n in tensors])
        if run.bucket_mb:
            step, exposed = ddp_step(fwd, ready, bwd, opt, grads, run.bucket_mb * MIB, link, gpus, **kw)
            best_mb = run.bucket_mb
        else:
            step, exposed, best_mb = best_bucket(fwd, ready, bwd, opt, grads, link, gpus, **kw)
        mem = memory(run.strategy, params, gpus, param_bytes=word, grad_bytes=grad_word, state_bytes=state_bytes,
                     bucket_bytes=best_mb * MIB, activations=acts,
                     ddp_buckets=not run.bucket_view)
    per_gpu = tokens * run.grad_accum / step
    # Scaling efficiency as ddp_step.py measures it: the same per-rank work without communication, over the step
    return dict(step_ms=step * 1e3, tokens_per_s=per_gpu * gpus, tokens_per_s_per_gpu=per_gpu,
                scaling_efficiency=(step - exposed) / step, memory_gib_per_gpu=mem["total"] / GIB,
                fits=mem["total"] <= hw.memory_gib * GIB, gpu_mem_gib=hw.memory_gib, best_bucket_mb=best_mb,
                exposed_comm_ms=exposed * 1e3, params=params, memory_bytes=mem,
                utilization="mfu" if mfu is not None else "hfu",
                mfu=mfu if mfu is not None else hfu * model_flops / hw_flops,
                hfu=hfu if hfu is not None else mfu * hw_flops / model_flops,
                achieved_mfu=per_gpu * model_flops / peak, flops_per_token=model_flops,
                hardware_flops_per_token=hw_flops, activation_checkpointing=run.activation_checkpointing,
                attention=run.attention, grad_accum=run.grad_accum, global_batch_tokens=tokens * run.grad_accum * gpus,
                sent_gb_per_gpu_per_step=sent_per_step(run.strategy, params, gpus, per_node, run.grad_accum, word,
                                                       grad_word) / GB,
                optimizer_ms=opt / optimizer_shards(run.strategy, gpus, per_node) * 1e3,
                rate_source=source, hardware=hardware_json(hw), warnings=warnings_for(run, hw))


def optimizer_shards(strategy: str, gpus: int, per_node: int) -> int:
    """How many ranks share the optimizer's work: none under DDP, all of them under ZeRO and FSDP, a node's under
    HSDP."""
    return {"ddp": 1, "hsdp": min(gpus, per_node)}.get(strategy, gpus)


def hardware_json(hw: Hardware) -> dict:
    return {k: v for k, v in dataclasses.asdict(hw).items() if k != "source"} | {
        "yours": list(hw.yours), "fitted": list(hw.fitted)}


def zero_table(params=7.5e9, degrees=(1, 4, 16, 64, 256, 1024)):
    """The ZeRO paper's Table 1 (Rajbhandari et al., SC20, https://arxiv.org/abs/1910.02054): GB per device for
    7.5B parameters, K = 12, by data-parallel degree; ours from memory(), without activations or buffers."""
    return {n: {s: memory(s, int(params), n)["total"] / GB for s in ("ddp", "zero1", "zero2", "fsdp")}
            for n in degrees}


def describe_hardware(hw: Hardware) -> str:
    """The figures a prediction used: each the user's ("yours"), fitted from measurements, or the profile's."""
    def mark(key, text):
        return f"{text} (yours)" if key in hw.yours else f"{text} (fitted)" if key in hw.fitted else text
    return (f"hardware {hw.name}{' with your figures' if hw.yours else ''}, "
            + ", ".join([mark("gpus_per_node", f"{hw.gpus_per_node} GPU{'s' * (hw.gpus_per_node != 1)} a node"),
                         mark("intra_busbw", f"{hw.intra_busbw:g} GB/s a GPU inside a node"),
                         mark("inter_busbw", f"{hw.inter_busbw:g} GB/s a node between nodes"
                              + (f" (past 2 nodes at most {hw.inter_line or hw.inter_busbw:g} x (2 / nodes) ** "
                                 f"{hw.falloff:g})" if hw.falloff else "")),
                         mark("memory_gib", f"{hw.memory_gib:g} GiB"),
                         mark("peak_tflops", f"{hw.peak_tflops:g} TFLOPS peak")]))


def line_rate_note(hw: Hardware) -> str:
    """Said whenever a prediction crosses nodes on a bandwidth nobody measured."""
    return (f"The {hw.inter_busbw:g} GB/s between nodes is the line rate, not a measurement. Real runs often get a "
            "fraction of it. Measure two nodes and run `forecast`.")


def bandwidth(text: str) -> float:
    """A bandwidth flag's value in GB/s: a bare number is GB/s (bytes); with a unit, what the user has: 50GB/s,
    400Gb/s, 400gbps, 400 Gbit/s (bits: / 8), and a count of ports in front: 8x400Gb/s = 400 GB/s. Datasheets quote
    NICs in Gb/s per port, NVLink in GB/s."""
    match = re.fullmatch(r"\s*(?:(\d+)\s*[x*]\s*)?([0-9.]+(?:e[+-]?\d+)?)\s*([A-Za-z/]*)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a bandwidth: {text!r} (GB/s; or 400Gb/s, 8x400Gbps, 50GB/s)")
    ports, value, unit = int(match[1] or 1), float(match[2]), match[3]
    if unit and not re.fullmatch(r"(?i)g(b|bit|bits|byte|bytes)(/s|ps)?", unit):
        raise argparse.ArgumentTypeError(f"{text!r}: the unit {unit!r} is neither GB/s nor Gb/s (50GB/s, 400Gbps)")
    bits = unit[1:2] == "b" or "bit" in unit.lower()  # Gb, gb, Gbit: bits; GB, GByte: bytes
    gb_s = ports * value / (8 if bits else 1)
    if not (gb_s > 0 and math.isfinite(gb_s)):
        raise argparse.ArgumentTypeError(f"must be a positive bandwidth, got {text!r}")
    return gb_s


# --- the command line ---
def collective_main(args):
    if args.hardware:
        link = Link.from_hardware(args.hardware)
    else:
        with open(args.calibration) as f:
            link = Link.from_calibration(json.load(f))
    ms = COLLECTIVES[args.name](link, args.bytes, args.ranks) * 1e3
    print(json.dumps({"ms": ms}) if args.json else f"{args.name} of {args.bytes:,} bytes on {args.ranks} ranks: "
          f"{ms:.3f} ms")


JSON_KEYS = ("step_ms", "tokens_per_s", "tokens_per_s_per_gpu", "scaling_efficiency", "exposed_comm_ms",
             "memory_gib_per_gpu", "gpu_mem_gib", "fits", "best_bucket_mb", "utilization", "mfu", "hfu",
             "achieved_mfu", "flops_per_token", "hardware_flops_per_token", "activation_checkpointing", "attention",
             "grad_accum", "global_batch_tokens", "sent_gb_per_gpu_per_step", "optimizer_ms", "params",
             "rate_source", "hardware", "warnings")


def run_from_args(args, gpus=None) -> tuple[Run, Hardware]:
    """The Run and the Hardware that predict's and forecast's flags describe."""
    latency = args.inter_node_latency_us
    hw = Hardware.named(args.hardware, gpus_per_node=args.gpus_per_node, intra_busbw=args.intra_node_gbps,
                        inter_busbw=args.inter_node_gbps, memory_gib=args.gpu_mem_gib, peak_tflops=args.peak_tflops,
                        hbm_tbps=args.hbm_tbps, alpha_inter=latency and latency / 1e6,
                        falloff=args.inter_node_falloff)
    run = Run(model=args.model, gpus=gpus or args.gpus, strategy=args.strategy, batch=args.batch_size,
              seq=args.seq_len, grad_accum=args.grad_accum, activation_checkpointing=args.activation_checkpointing,
              attention=args.attention, precision=args.precision, grad_dtype=args.grad_dtype,
              optimizer=args.optimizer, bucket_mb=args.bucket_mb, bucket_view=args.gradient_as_bucket_view,
              prefetch=not args.no_backward_prefetch, logits=args.logits, dropout=not args.no_dropout,
              mfu=getattr(args, "mfu", None),
              hfu=getattr(args, "hfu", None), fixed_ms=args.fixed_ms)
    return run, hw


def say_memory(out: dict) -> str:
    mem = out["memory_bytes"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in mem.items() if k != "total")
    verdict = "fits" if out["fits"] else "does NOT fit"
    return f"memory per GPU {out['memory_gib_per_gpu']:.1f} GiB ({parts}), {verdict} in {out['gpu_mem_gib']:g} GiB"


def predict_main(args):
    try:
        run, hw = run_from_args(args)
        measured = read_measurement(args.measured, args.measured_row) if args.measured else None
        if args.measured_tokens_per_s:
            measured = Measurement(args.measured_tokens_per_s, args.measured_gpus, "--measured-tokens-per-s")
        out = predict(run, hw, measured)
    except ValueError as e:  # parse() catches most of these first
        sys.exit(print(f"error: {e}", file=sys.stderr) or 2)
    for line in out["warnings"]:
        print(f"warning: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps({k: out[k] for k in JSON_KEYS}))
        return
    given = out["utilization"]
    other = "hfu" if given == "mfu" else "mfu"
    nodes = math.ceil(run.gpus / hw.gpus_per_node)
    print(f"{run.model.name} ({out['params'] / 1e9:.2f}B parameters), {run.strategy}, {run.gpus} GPUs "
          f"({hw.gpus_per_node} a node), {run.batch} x {run.seq_len} tokens a micro-batch, {run.grad_accum} "
          f"micro-batch{'es' * (run.grad_accum > 1)} a step, activation checkpointing {run.activation_checkpointing}")
    print(f"  {describe_hardware(hw)}")
    print(f"  step {out['step_ms']:.1f} ms, {out['tokens_per_s']:,.0f} tokens/s, {out['tokens_per_s_per_gpu']:,.0f} "
          f"a GPU, scaling efficiency {out['scaling_efficiency']:.2f}")
    print(f"  communication not hidden {out['exposed_comm_ms']:.1f} ms a step, each GPU sends "
          f"{out['sent_gb_per_gpu_per_step']:.1f} GB a step")
    print(f"  compute at {given.upper()} {out[given]:.3f} ({other.upper()} {out[other]:.3f}), "
          f"{out['flops_per_token'] / 1e9:.2f} GFLOPs a token ({out['hardware_flops_per_token'] / 1e9:.2f} with "
          f"recompute), MFU of the whole step {out['achieved_mfu']:.3f}")
    if out["rate_source"] == "default":
        print(f"  HFU 0.4 is a guess. On the published runs in benchmarks/README.md it gave {DEFAULT_GUESS[0]:.2f}-"
              f"{DEFAULT_GUESS[1]:.2f} of their tokens/s. Give --mfu, or measure one node (--measured-tokens-per-s).")
    elif out["rate_source"] != "given":
        print(f"  the rate is {out['rate_source']}")
    print(f"  {say_memory(out)}")
    if out["best_bucket_mb"]:
        print(f"  best bucket size {out['best_bucket_mb']} MiB")
    if nodes > 1 and "inter_busbw" not in hw.yours:
        print(f"  {line_rate_note(hw)}")


def forecast_main(args):
    import costmodel_fit  # the fitting lives beside this file
    costmodel_fit.forecast_main(args)


def fit_or_check_main(args):
    import costmodel_fit
    costmodel_fit.lesson_module().run({"fit": costmodel_fit.fit_main, "check": costmodel_fit.check_main}[
        args.command], lambda: args)


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


def not_negative(text):
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return x


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the numbered scripts
        sys.exit(print(f"error: {message}", file=sys.stderr) or 2)


def add_run_flags(q, gpus=True):
    """The flags that describe a run and its hardware, shared by predict and forecast."""
    q.add_argument("--model", required=True, help=f"{'|'.join(MODELS)} or a Hugging Face config.json")
    if gpus:
        q.add_argument("--gpus", type=positive(int), required=True)
    q.add_argument("--gpus-per-node", type=positive(int), default=None, help="default: the profile's")
    q.add_argument("--hardware", choices=list(HARDWARE), default="h100-ib",
                   help="a named profile, the defaults of the figures below")
    q.add_argument("--gpu-mem-gib", type=positive(float), default=None, help="each GPU's memory (profile: 80)")
    q.add_argument("--inter-node-gbps", type=bandwidth, default=None,
                   help="GB/s a node across nodes, each direction, all of a node's NICs; or with a unit, as NICs "
                        "are sold: 8x400Gb/s (= 400), 400Gbps (= 50), 50GB/s")
    q.add_argument("--intra-node-gbps", type=bandwidth, default=None,
                   help="GB/s a GPU within a node, each direction (NVLink: 450 on H100, 300 on A100, 150 on V100)")
    q.add_argument("--inter-node-latency-us", type=positive(float), default=None,
                   help="one hop between nodes, NCCL's ring (its model says 14 on InfiniBand; profile 100gbe: 25)")
    q.add_argument("--inter-node-falloff", type=not_negative, default=None, metavar="K",
                   help="past 2 nodes a node gets at most the line rate x (2 / nodes) ** K (0 on the InfiniBand "
                        f"profiles, {FALLOFF} on 100gbe)")
    q.add_argument("--peak-tflops", type=positive(float), default=None, help="each GPU's dense bf16 peak")
    q.add_argument("--hbm-tbps", type=positive(float), default=None,
                   help="each GPU's memory bandwidth in TB/s, which bounds the optimizer step (H100 3.35)")
    q.add_argument("--strategy", choices=list(STRATEGIES), default="ddp",
                   help="hsdp: FSDP within each node, the shards all-reduced across nodes")
    q.add_argument("--batch-size", type=positive(int), default=4, help="sequences per GPU per micro-batch")
    q.add_argument("--grad-accum", type=positive(int), default=1, help="micro-batches per optimizer step")
    q.add_argument("--seq-len", type=positive(int), default=None, help="default: the model's context")
    q.add_argument("--activation-checkpointing", choices=list(CHECKPOINTING), default="none")
    q.add_argument("--attention", choices=list(ATTENTION), default="flash",
                   help="flash: scores never stored (SDPA's kernels); eager: stored unless recomputed")
    q.add_argument("--precision", choices=list(PRECISIONS), default="bf16",
                   help="bf16: bf16 weights, fp32 master weights in the optimizer; bf16-pure: all bf16, no master; "
                        "amp: fp32 weights under autocast; fp32: pure fp32, activations too")
    q.add_argument("--grad-dtype", choices=["param", "fp32"], default="param",
                   help="fp32: fp32 gradients beside 16-bit weights, and fp32 buckets (Megatron, DeepSpeed)")
    q.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    q.add_argument("--logits", choices=["fp32", "bf16"], default="fp32",
                   help="fp32: the loss upcasts the logits (Hugging Face, torchtitan, autocast); bf16: it does not")
    q.add_argument("--no-dropout", action="store_true",
                   help="every dropout probability is 0 (Llama, MPT), so no dropout masks are kept")
    q.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="PyTorch DDP's flag: gradients live in the buckets, no second copy of them")
    q.add_argument("--bucket-mb", type=positive(float), default=None,
                   help="DDP/ZeRO buckets; default: the fastest (predict), PyTorch's 25 (forecast)")
    q.add_argument("--no-backward-prefetch", action="store_true",
                   help="FSDP's backward_prefetch=None: each all-gather waits behind the reduce-scatter")
    q.add_argument("--fixed-ms", type=not_negative, default=0.0,
                   help="time a micro-batch costs whatever its size (kernel launches, the data loader)")
    q.add_argument("--json", action="store_true")


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
    add_run_flags(q)
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
    w = sub.add_parser("forecast", help="fit your own 1- and 2-node steps, then forecast 4, 8 and 16 nodes")
    add_run_flags(w, gpus=False)
    w.add_argument("--step-ms", nargs="+", default=[], metavar="NODES:MS[:BATCH]",
                   help="measured step times: 1:120 is one node at 120 ms a step; 1:200:16 the same at batch 16")
    w.add_argument("--sweep", nargs="+", default=[],
                   help="benchmarks/all_reduce.py --json runs across nodes: the network's latency and bandwidth "
                        "(two nodes); on more nodes too, how the bandwidth falls")
    w.add_argument("--nodes", type=positive(int), nargs="+", default=[1, 2, 4, 8, 16], help="the nodes to forecast")
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
    if a.command in ("predict", "forecast"):
        check_run_flags(p, a)
    if a.command == "collective" and a.calibration and not os.path.isfile(a.calibration):
        p.error(f"--calibration {a.calibration}: no such file (write one with `fit`)")
    return a


def check_run_flags(p, a):
    """The checks argparse cannot make, each one `error:` line."""
    try:
        shape = model_shape(a.model)
    except ValueError as e:
        p.error(str(e))
    if a.seq_len is None and shape.ctx is None:
        p.error(f"--model {a.model}: the config has no max_position_embeddings, so give --seq-len")
    per_node = a.gpus_per_node or HARDWARE[a.hardware].gpus_per_node
    if a.command == "predict":
        if a.gpus % per_node and a.gpus > per_node:
            p.error(f"--gpus {a.gpus} is not a multiple of --gpus-per-node {per_node}")
        if a.measured and not os.path.isfile(a.measured):
            p.error(f"--measured {a.measured}: no such file")
        if a.measured_row and not a.measured:
            p.error("--measured-row: a row of --measured, which is not given")
    if a.bucket_mb and a.strategy in ("fsdp", "hsdp"):
        p.error(f"--bucket-mb: {a.strategy} communicates a unit (a layer) at a time, not in buckets")
    if a.no_backward_prefetch and a.strategy not in ("fsdp", "hsdp"):
        p.error(f"--no-backward-prefetch: only FSDP and HSDP prefetch, not {a.strategy}")
    if a.command == "forecast":
        import costmodel_fit
        try:
            a.steps = [costmodel_fit.parse_step(s, a.batch_size) for s in a.step_ms]
        except ValueError as e:
            p.error(f"--step-ms {e}")
        for path in a.sweep:
            if not os.path.isfile(path):
                p.error(f"--sweep {path}: no such file")
        if not any(s.nodes == 1 for s in a.steps):
            p.error("--step-ms: give one node's step (1:MS), the run the forecast starts from")


def main():
    sys.modules.setdefault("costmodel", sys.modules[__name__])  # costmodel_fit imports this module, not a copy
    a = parse()
    {"collective": collective_main, "predict": predict_main, "forecast": forecast_main, "fit": fit_or_check_main,
     "check": fit_or_check_main, "zero-table": zero_table_main}[a.command](a)


if __name__ == "__main__":
    main()
