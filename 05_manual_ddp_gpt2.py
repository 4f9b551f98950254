"""05 - DDP by hand, from the naive version to PyTorch's own design, training a small GPT-2.

It teaches three things, in this order. First comes average_gradients, the version a tutorial
writes, and why it is slow. Then comes DDPCore, a 140-line class. It does what PyTorch's
DistributedDataParallel does, bit for bit. Last comes a training script like nanoGPT's train.py. It
trains any Hugging Face causal LM and resumes exactly where it stopped. ddp_dropin.py adds DDP's
whole interface to DDPCore.

  CPU:     torchrun --nproc_per_node=4 05_manual_ddp_gpt2.py    # a 0.84M-parameter GPT-2, offline
  N GPUs:  torchrun --nproc_per_node=N 05_manual_ddp_gpt2.py --model gpt2 \\
               --dataset wikitext:wikitext-2-raw-v1 --seq-len 512 --compile
  2 nodes: torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST \\
               --master_port=29500 05_manual_ddp_gpt2.py --out ckpt   # ckpt on a shared disk
"""

import argparse
import contextlib
import functools
import glob
import itertools
import math
import os
import pathlib
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

# --- settings beyond the flags ---
ADAMW_BETAS, WEIGHT_DECAY, CLIP_NORM = (0.9, 0.95), 0.1, 1.0  # GPT-3's, as in nanoGPT
LR_FLOOR = 0.1  # the cosine schedule ends at this fraction of --lr
VAL_PART, VAL_BATCHES = 10, 8  # hold out the last tenth of the text, and score 8 batches a rank


# --- the idea, naive: what a tutorial writes ---
def average_gradients(model, world):
    """After backward, the ranks add up each gradient and divide the sum by their number. Every
    replica then takes the same step, so replicas that start identical stay identical."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # every rank must join each all-reduce, so it sends zeros
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(world)  # gloo has no average, so sum, then divide


# Why it is slow. It sends one message per tensor (52 here, 148 for GPT-2 124M), and each message
# pays the network's fixed delay. None starts before backward ends, so communication adds to the
# step. DDPCore sends a few large buckets instead. Each leaves from inside backward as soon as it
# is full, while backward computes the layers before it.

# --- the idea, as PyTorch's DDP does it ---
class DDPCore(nn.Module):
    """DistributedDataParallel's idea. After loss.backward(), every .grad holds the mean of all
    ranks' gradients. The all-reduces that made it ran while backward was still computing the rest.
    It needs every parameter that requires a gradient to get one in each synced backward, and every
    rank to run as many steps. ddp_dropin.ManualDDP lifts both limits."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.module, self.broadcast_buffers = module, broadcast_buffers
        self.process_group = process_group or dist.group.WORLD
        self.world = dist.get_world_size(self.process_group)
        self.require_backward_grad_sync = True  # False inside no_sync(), where backward stays local
        self.require_forward_param_sync = True  # broadcast the buffers before the next forward
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.device = next(module.parameters()).device  # where the rebuild broadcasts
        # Replicas must start identical, or the same mean gradient keeps them different forever.
        # So every rank takes rank 0's parameters, frozen ones too, since they shape the output.
        # If buffers are synced, it takes rank 0's buffers (BatchNorm's running statistics) too.
        buffers = list(module.buffers()) if broadcast_buffers else []
        broadcast_coalesced(list(module.parameters()) + buffers, 0, self.process_group)
        # DDP groups gradients into buckets. Before the first backward it cannot know their order,
        # so it takes one bucket per dtype, the last parameters' first, as gradients arrive roughly
        # back to front. Before the next step, _maybe_rebuild cuts them again in the order backward
        # showed. The first then holds 1 MiB, so it leaves early, and the rest hold 25 MiB. DDP's
        # source says "Experiments showed 1MB is a reasonable value."
        self._caps = ([1 << 20, 25 << 20] if bucket_cap_mb is None
                      else [int(bucket_cap_mb * (1 << 20))])
        self._set_buckets(sorted(bucket_layout(self.params, range(len(self.params)), [math.inf]),
                                 key=min, reverse=True))
        self._rebuilt, self._order = False, []  # the order gradients got ready in
        self._next, self._queued = 0, False  # the next bucket to launch, and is _finish queued
        me = weakref.ref(self)  # A weak link: the hooks alone never keep a dropped wrapper alive.

        def hook(i, p):
            core = me()
            if core is not None:
                core._on_grad_ready(i, p)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(hook, i))

    # -- one step, in the order it runs: forward, a hook per gradient, the end of backward --
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            if self.require_backward_grad_sync:  # not in no_sync(), which sends nothing
                self._maybe_rebuild()
            self._grads_into_buckets()
        if self.require_forward_param_sync and self.broadcast_buffers:  # rank 0's buffers
            broadcast_coalesced(list(self.module.buffers()), 0, self.process_group)
        output = self.module(*inputs, **kwargs)
        # As in DDP, rank 0 sends its buffers before each forward that follows a synced backward.
        self.require_forward_param_sync = (torch.is_grad_enabled()
                                           and self.require_backward_grad_sync)
        return output

    def _grads_into_buckets(self):
        """A missing .grad becomes its zeroed bucket slot. Autograd then adds into the bucket."""
        for b in self.buckets:
            missing = [slot for slot, p in enumerate(b.params) if p.grad is None]
            if len(missing) == len(b.params):
                b.flat.zero_()  # the usual case, one fill for the whole bucket
            else:  # only some are None, so keep what the others hold
                for slot in missing:
                    b.views[slot].zero_()
            for slot in missing:
                b.params[slot].grad = b.views[slot]

    def _on_grad_ready(self, i, p):
        """Runs inside backward, right after autograd added parameter i's gradient into p.grad."""
        if not self.require_backward_grad_sync:
            return  # accumulating locally, with no communication at all
        if not self._queued:  # this backward's first gradient, so queue _finish for its end
            self._queued = True
            # queue_callback is a private API of autograd's engine. PyTorch's own DDP uses it too.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if not self._rebuilt:
            self._order.append(i)  # the order in which backward really produces gradients
        bucket, slot = self._where[i]
        # A new .grad tensor (after create_graph=True, or if it was None) is copied into its slot.
        if p.grad.data_ptr() != bucket.views[slot].data_ptr():
            bucket.views[slot].copy_(p.grad)
            p.grad = bucket.views[slot]
        bucket.pending -= 1
        # Launch strictly in bucket order, the same on every rank. Ranks match collectives by the
        # order they issue them, and gradients may get ready in another order on another rank.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b):
        # Divide before the sum, as DDP does. A sum of N fp16 gradients could overflow where their
        # mean would not. DDP multiplies by 1/N, and so does this, for the same bits.
        b.flat.mul_(1 / self.world)
        b.work = dist.all_reduce(b.flat, group=self.process_group, async_op=True)  # returns at once

    def _finish(self):
        """End of backward. Wait for each bucket's all-reduce. Then every .grad holds the mean."""
        self._queued = False
        if self._next < len(self.buckets):  # a bucket that never filled never left
            names = [self.names[i] for b in self.buckets[self._next:] for i in b.indices]
            raise RuntimeError(f"DDPCore: a parameter got no gradient (one of {names[:5]}). Use "
                               "ddp_dropin.ManualDDP(model, find_unused_parameters=True) for it.")
        for b in self.buckets:
            b.work.wait()  # on NCCL the CUDA stream waits, not the CPU
            b.pending = len(b.params)  # counted down again by the next backward
        self._next = 0

    # -- before the second forward, the buckets are cut again, once, in the order gradients came --
    def _maybe_rebuild(self):
        if self._rebuilt or not self._order:
            return
        # The order seen, each parameter once, then any that never got ready. Every rank takes the
        # order of the group's first rank, because the buckets must be the same everywhere.
        order = torch.tensor(list(dict.fromkeys(self._order + list(range(len(self.params))))),
                             device=self.device)
        dist.broadcast(order, src=dist.get_global_rank(self.process_group, 0),
                       group=self.process_group)
        self._set_buckets(bucket_layout(self.params, order.tolist(), self._caps))
        self._rebuilt = True

    def _set_buckets(self, layout):
        grads = [p.grad for p in self.params]
        self.buckets = [Bucket([self.params[i] for i in idx], list(idx)) for idx in layout]
        self._where = [None] * len(self.params)  # parameter index -> (its bucket, its slot there)
        for b in self.buckets:
            for slot, i in enumerate(b.indices):
                self._where[i] = (b, slot)
                if grads[i] is not None:  # sums from no_sync() move into the new buckets
                    b.views[slot].copy_(grads[i])
                    self.params[i].grad = b.views[slot]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward adds into .grad locally. The next backward after it averages the sum."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before


class Bucket:
    """Several gradients in one flat tensor. Each .grad is a view of its slot, so none is copied."""

    def __init__(self, params, indices):
        self.params, self.indices = params, indices  # indices are their places in DDPCore.params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                device=params[0].device)
        offsets = itertools.accumulate([p.numel() for p in params], initial=0)
        self.views = [self.flat[o:o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
        self.pending = len(params)  # gradients this backward has still to produce
        self.work = None  # The last all-reduce. Kept, since gloo can crash at exit if it is freed.


def bucket_layout(params, order, caps):
    """Cut the parameters, taken in `order`, into buckets as DDP does. Each dtype and device fills
    its own bucket. The first closes at caps[0] bytes, the next at caps[1], and so on. Every
    later bucket uses the last cap."""
    running, done = {}, []
    for i in order:
        kind = (params[i].dtype, params[i].device)  # one flat tensor holds one dtype on one device
        indices, size, k = running.get(kind, ([], 0, 0))
        indices.append(i)
        size += params[i].numel() * params[i].element_size()
        running[kind] = (indices, size, k)
        if size >= caps[min(k, len(caps) - 1)]:
            done.append(indices)
            running[kind] = ([], 0, k + 1)
    return done + [indices for indices, _, _ in running.values() if indices]


def broadcast_coalesced(tensors, src, group):
    """Broadcast from the group's rank src, packed like DDP into few messages of about 250 MiB."""
    with torch.no_grad():
        for indices in bucket_layout(tensors, range(len(tensors)), [250 << 20]):
            batch = [tensors[i] for i in indices]
            flat = torch.cat([t.reshape(-1) for t in batch])
            dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
            for t, part in zip(batch, flat.split([t.numel() for t in batch])):
                t.copy_(part.view_as(t))


# --- data and model: any text, any Hugging Face causal LM ---
def byte_tokenizer():
    """A tokenizer of 256 bytes plus end-of-text. It needs no download and encodes any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|endoftext|>"]
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def load_tokens(args, tok):
    """Return (training, held-out) tokens of Python's sources (40 files), local files or a hub
    dataset. End-of-text ends each document, and the last tenth is held out."""
    if args.dataset == "stdlib":
        files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    else:  # a directory, a file or a glob, else the name of a hub dataset
        is_dir = os.path.isdir(args.dataset)
        pattern = os.path.join(args.dataset, "**", "*") if is_dir else args.dataset
        files = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
    if files or os.path.isdir(args.dataset):
        texts = [pathlib.Path(f).read_text(encoding="utf-8") for f in files]
    else:  # every rank asks at once, and the datasets cache downloads once, under a file lock
        import datasets
        datasets.disable_progress_bars()
        name, _, config = args.dataset.partition(":")
        texts = datasets.load_dataset(name, config or None, split="train")["text"]
    if not any(texts):  # or the tokenizer fails deep inside, with an IndexError
        raise UsageError(f"--dataset {args.dataset} holds no text to train on")
    rows = tok(texts, add_special_tokens=False)["input_ids"]
    ids = [i for row in rows for i in row + [tok.eos_token_id]]
    held = len(ids) // VAL_PART
    return torch.tensor(ids[: len(ids) - held]), torch.tensor(ids[len(ids) - held:])


def batches_from(data, args):
    """Yield this rank's share of a new shuffle each epoch (see 04_sampler.py), batch by batch."""
    sampler = torch.utils.data.DistributedSampler(data, seed=args.seed, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)  # without it, every epoch would replay the first one's order
        idx = list(sampler)  # No DataLoader: it draws from the generator that dropout uses.
        for k in range(len(idx) // args.batch_size):
            yield data[idx[k * args.batch_size:(k + 1) * args.batch_size]]


def build_model(args):
    """Return the tokenizer and a float32 model, --model or a new small GPT-2 with no dropout."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, logging
    from transformers.models.gpt2 import GPT2Config, GPT2LMHeadModel
    logging.set_verbosity_error()  # long documents trigger a harmless length warning
    logging.disable_progress_bar()  # no bar from each rank
    tok = AutoTokenizer.from_pretrained(args.model) if args.model else byte_tokenizer()
    config = AutoConfig.from_pretrained(args.model) if args.model else GPT2Config(
        vocab_size=len(tok), n_positions=args.seq_len, n_embd=128, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id)
    for key in ("activation_function", "hidden_act"):  # the same function, 1 kernel instead of ~8
        if getattr(config, key, None) == "gelu_new":
            setattr(config, key, "gelu_pytorch_tanh")
    if args.seq_len > getattr(config, "max_position_embeddings", args.seq_len):  # or n_positions
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's "
                         f"{config.max_position_embeddings} positions")
    torch.manual_seed(args.seed)  # the same weights on every rank, though DDPCore broadcasts them
    model = (AutoModelForCausalLM.from_pretrained(args.model, config=config) if args.model
             else GPT2LMHeadModel(config))
    return tok, model.float()


def compile_blocks(model, backend="inductor"):
    """Compile each block and the head on its own, as torchtitan does. A block's buckets then leave
    as its backward ends. The final norm stays eager, since each model names it differently."""
    blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)  # the stack
    for region in [*blocks, model.get_output_embeddings()]:
        region.compile(backend=backend)
    return len(blocks)


def cross_entropy(logits, targets):
    """The mean loss, in float32. With --compile it is compiled alone. The cast then fuses into its
    kernels, so no float32 copy of the logits (50,257 columns for GPT-2) is ever written."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def next_token_loss(net, batch, args, loss=cross_entropy):
    """Each position predicts the next token, so batch[:, :-1]'s logits meet batch[:, 1:]."""
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        logits = net(input_ids=batch[:, :-1], use_cache=False).logits  # no KV cache in training
    return loss(logits, batch[:, 1:])


# --- training ---
def wrap(model, impl, device, bucket_cap_mb=None):
    """Wrap the model for --impl: DDPCore, PyTorch's DDP (with the same buckets), or naive."""
    if impl == "manual":
        return DDPCore(model, bucket_cap_mb=bucket_cap_mb)
    if impl == "torch":
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids, bucket_cap_mb=bucket_cap_mb)
    broadcast_coalesced(list(model.parameters()) + list(model.buffers()), 0, dist.group.WORLD)
    return model  # naive also starts from rank 0's weights, and averages after backward


PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312}  # dense bf16 TFLOP/s (SXM), for MFU


def main(args):
    """Resume if --out holds a checkpoint. Train, check the replicas, then save and sample."""
    device = setup(args)
    if args.precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        args.precision = "bf16" if bf16 else "fp32"
    if device.type == "cuda":  # TF32 matmuls keep float32's range, at tensor-core speed
        torch.backends.cuda.matmul.allow_tf32 = True
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} impl={args.impl} "
           f"precision={args.precision} torch={torch.__version__}")
    state = load_newest(args.out) if args.out else None
    start = state["step"] if state else 0
    if start >= args.max_steps:
        print0(f"OK nothing to train: {args.out} holds step {start} of "
               f"--max-steps {args.max_steps}")
        return
    tok, model = build_model(args)
    train_ids, val_ids = load_tokens(args, tok)
    # Micro-batches per rank, in an epoch of training and in the held-out text (at most 8).
    per_epoch = (len(train_ids) - 1) // args.seq_len // WORLD // args.batch_size
    val_batches = min(VAL_BATCHES, (len(val_ids) - 1) // args.seq_len // WORLD // args.batch_size)
    if min(per_epoch, val_batches) < 1:
        raise UsageError(f"{len(train_ids) + len(val_ids):,} tokens are too few for {WORLD} ranks "
                         f"x --batch-size {args.batch_size} x --seq-len {args.seq_len}")
    n_val = val_batches * WORLD * args.batch_size  # held-out blocks, all ranks together
    data = train_ids.unfold(0, args.seq_len + 1, args.seq_len)  # blocks of seq_len + 1 tokens
    val = val_ids.unfold(0, args.seq_len + 1, args.seq_len)[:n_val]
    n_params = sum(p.numel() for p in model.parameters())  # tied weights count once
    print0(f"data: {len(train_ids):,} tokens, {per_epoch} micro-batches per rank per epoch, "
           f"{n_val} held-out blocks | model: {n_params / 1e6:.2f}M parameters")
    loss = cross_entropy
    if args.compile:  # by block, as one backward for the whole model would hold back every bucket
        print0(f"compiling {compile_blocks(model)} blocks, the head and the loss, one by one "
               "(the first steps wait)")
        loss = torch.compile(loss)
    ddp = wrap(model.to(device), args.impl, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=ADAMW_BETAS,
                            weight_decay=WEIGHT_DECAY,
                            fused=device.type == "cuda")  # The CPU keeps the exact default.

    def lr_factor(step):  # linear warm-up, then cosine decay to LR_FLOOR of --lr at --max-steps
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    if state:  # every rank loads the same checkpoint, so the replicas stay identical
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        print0(f"resumed from {args.out}/checkpoint-{start}.pt at step {start}")
    batches = itertools.islice(batches_from(data, args), start * args.grad_accum, None)  # skip done
    # MFU is the share of the GPU's peak that training uses. As nanoGPT counts it, a token costs 6
    # FLOPs per weight (forward and backward) plus attention's. Here position embeddings count too.
    cfg = model.config
    flops = 6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * args.seq_len
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    peak = args.peak_tflops or next((t for name, t in PEAK_TFLOPS.items() if name in gpu), None)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * WORLD
    losses, first_loss, t_log = [], None, time.perf_counter()
    model.train()  # from_pretrained returns a model in eval mode, with dropout off
    for step in range(start, args.max_steps):
        # Dropout needs random masks. The default model has none, but a pretrained gpt2 does.
        # A seed per step and rank gives each rank its own, and a resumed run draws them again.
        torch.manual_seed(args.seed + 7919 * step + RANK)  # unique for up to 7919 ranks
        for micro in range(args.grad_accum):
            # Sync on the last micro-batch only, as nanoGPT does. no_sync() sets this same flag.
            if args.impl != "naive":
                ddp.require_backward_grad_sync = micro == args.grad_accum - 1
            batch = next(batches).to(device, non_blocking=True)
            micro_loss = next_token_loss(ddp, batch, args, loss)
            (micro_loss / args.grad_accum).backward()
            losses.append(micro_loss.detach())
        if args.impl == "naive":
            average_gradients(model, WORLD)
        # Every .grad now holds the mean over ranks, so each rank clips the same global gradient.
        nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step in (start, args.max_steps - 1):
            mean = torch.stack(losses).mean()
            dist.all_reduce(mean)  # add up every rank's mean loss, not rank 0's alone, then divide
            last_loss = mean.item() / WORLD
            if not math.isfinite(last_loss):  # every rank holds the same mean, so all stop together
                raise UsageError(f"training diverged: loss {last_loss} at step {step + 1} "
                                 "(try a smaller --lr)")
            first_loss = last_loss if first_loss is None else first_loss
            dt = (time.perf_counter() - t_log) / len(losses) * args.grad_accum
            mfu = 100 * tokens_per_step / dt * flops / WORLD / (peak * 1e12) if peak else 0
            print0(f"step {step + 1:>5}/{args.max_steps} | loss {last_loss:7.4f} "
                   f"| lr {args.lr * lr_factor(step):.2e} | {dt * 1e3:7.1f} ms/step "
                   f"| {tokens_per_step / dt:9,.0f} tok/s" + (f" | MFU {mfu:.1f}%" if peak else ""))
            losses, t_log = [], time.perf_counter()
        # Every --eval-every steps and at the end, score the held-out text and save a checkpoint.
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps:
            paused = time.perf_counter()
            if args.eval_every:  # 0 turns the scoring off
                # Each rank scores its share of the held-out batches and divides by the number of
                # batches on all ranks. The all-reduce adds these parts up into the mean.
                model.eval()  # the bare model, with dropout off and no gradients to sync
                with torch.no_grad():
                    shares = val[RANK::WORLD].split(args.batch_size)
                    val_loss = sum(next_token_loss(model, b.to(device), args, loss) for b in shares)
                val_loss = val_loss / (val_batches * WORLD)
                dist.all_reduce(val_loss)
                model.train()
                print0(f"step {step + 1:>5}/{args.max_steps} | val loss {val_loss.item():7.4f}")
            if args.out and RANK == 0:  # the replicas are the same, so global rank 0 alone saves
                save_checkpoint(args.out, step + 1, {
                    "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "step": step + 1})
                print(f"saved {args.out}/checkpoint-{step + 1}.pt", flush=True)
            t_log += time.perf_counter() - paused  # not training time
    # Identical gradients on identical weights keep the replicas identical. Check it, bit for bit.
    mine = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    differs = (rank0 != mine).any().float()
    dist.all_reduce(differs)  # the number of ranks whose weights differ from rank 0's
    if RANK == 0 and args.out:  # saved so that AutoModelForCausalLM.from_pretrained loads them
        model.save_pretrained(args.out)
        tok.save_pretrained(args.out)
    if RANK == 0 and args.sample_tokens > 0:  # a new document, within the model's context
        torch.manual_seed(args.seed)
        n = min(args.sample_tokens, getattr(model.config, "max_position_embeddings", 1024) - 1)
        start_doc = torch.tensor([[tok.eos_token_id]], device=device)
        out = model.eval().generate(start_doc, do_sample=True, top_k=20, temperature=0.8,
                                    max_new_tokens=n, pad_token_id=tok.eos_token_id)
        print0("sample:\n" + tok.decode(out[0], skip_special_tokens=True) + "\n")
    if differs.item():
        raise RuntimeError(f"replicas diverged: {differs.item():.0f} rank(s) differ from rank 0")
    trend = "fell" if last_loss < first_loss else "did NOT fall"
    print0(f"OK {args.impl} DDP on {WORLD} rank{'s' * (WORLD > 1)}: replicas identical; "
           f"loss {trend} {first_loss:.4f} -> {last_loss:.4f}")


# --- checkpoints: the same block in 05, 06 and 08 ---
def load_newest(out):
    """The newest checkpoint in --out that loads, on every rank, or None. A run writes only into an
    --out that is new, empty or holds checkpoints, so never over files that no run wrote."""
    if os.path.isdir(out) and os.listdir(out) and not glob.glob("checkpoint-*", root_dir=out):
        raise UsageError(f"--out {out} holds files that no run wrote. Pick a new or empty folder.")
    os.makedirs(out, exist_ok=True)  # Now, so that a file of that name stops every rank here.
    found, me = [None, None], os.path.basename(__file__)  # the path, and the script that wrote it
    for path in reversed(checkpoints(out)) if RANK == 0 else []:  # Rank 0 picks one for all.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            found = [path, state.get("script", "an older version")]
            break
        except Exception as e:  # A disk fault. Saving that step again writes over it.
            print0(f"warning: {path} does not load ({type(e).__name__}), so this run skips it")
    dist.broadcast_object_list(found, src=0)  # On several nodes, all must see the --out disk.
    if found[0] and found[1] != me:  # Another script's checkpoint holds other things.
        raise UsageError(f"{found[0]} was written by {found[1]}, not {me}. "
                         "Start this run in a new --out.")
    return found[0] and torch.load(found[0], map_location="cpu", weights_only=True, mmap=True)


def checkpoints(out):  # the checkpoint files in --out, oldest first
    names = [f for f in glob.glob("checkpoint-*.pt", root_dir=out) if f[11:-3].isdigit()]
    return [f"{out}/{f}" for f in sorted(names, key=lambda f: int(f[11:-3]))]  # f[11:-3] is a step


def save_checkpoint(out, step, state, keep=2):  # Global rank 0 alone calls it.
    # Written aside, then renamed into place, so that no checkpoint is ever half written.
    torch.save({**state, "script": os.path.basename(__file__)}, f"{out}/checkpoint-tmp")
    os.replace(f"{out}/checkpoint-tmp", f"{out}/checkpoint-{step}.pt")
    for old in checkpoints(out)[:-keep]:  # The newest `keep` stay.
        os.remove(old)


# --- command line ---
def parse_args(argv=None):
    p = Parser(__doc__, timeout_s=300)
    count = at_least(1)
    g = p.add_argument_group("model, data, training, output")
    g.add_argument("--model", help="HF causal LM name or local dir, else a new small GPT-2")
    g.add_argument("--dataset", default="stdlib", help="stdlib, local dir/file/glob, or hub name")
    g.add_argument("--impl", choices=["manual", "naive", "torch"], default="manual",
                   help="DDPCore, the naive version, or PyTorch's DDP")
    g.add_argument("--compile", action="store_true", help="compile each block, the head, the loss")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 on a GPU that has it")
    g.add_argument("--batch-size", type=count, default=4, help="sequences per rank per micro-batch")
    g.add_argument("--seq-len", type=count, default=128, help="tokens per sequence")
    g.add_argument("--grad-accum", type=count, default=1, help="micro-batches per optimizer step")
    g.add_argument("--max-steps", type=count, default=200, help="optimizer steps")
    g.add_argument("--lr", type=at_least(1e-12, float), default=2e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=at_least(0), default=30, help="steps of linear warm-up")
    g.add_argument("--log-every", type=count, default=25, help="steps between loss lines")
    g.add_argument("--eval-every", type=at_least(0), default=50,
                   help="steps between val loss + checkpoint (0: no val)")
    g.add_argument("--sample-tokens", type=at_least(0), default=120, help="tokens to sample")
    g.add_argument("--peak-tflops", type=at_least(1e-9, float), help="the GPU's bf16 peak, for MFU")
    g.add_argument("--out", help="checkpoint dir: resume from it, save to it and save_pretrained")
    g.add_argument("--seed", type=at_least(0, below=2**32), default=0,
                   help="model init (the same on all ranks), data order, dropout")
    return p.parse_args(argv)


# --- setup: the same block in every numbered script, copied so that each file runs alone ---
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # from torchrun


class UsageError(Exception): ...  # A bad flag or input. run() prints one line, and exits 2.


def print0(*msg):  # rank 0 tells the story, once. One write, so that lines from ranks never mix.
    if RANK == 0:
        print(" ".join(map(str, msg)) + "\n", end="", flush=True)


def at_least(low, kind=int, below=math.inf):  # a number flag's type: low <= value < below
    def parse(text):
        if not low <= kind(text) < below:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {below}, got {text}")
        return kind(text)
    return parse


class Parser(argparse.ArgumentParser):  # the flags every script shares
    def __init__(self, doc, timeout_s=120):
        super().__init__(description=doc.split("\n")[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        self.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        self.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl if GPUs")
        self.add_argument("--timeout-s", type=at_least(1, float), default=timeout_s,
                          help="how long a rank waits for a peer")

    def error(self, message): raise UsageError(message)  # one line from rank 0 (run())


def setup(args):  # pick this rank's device, then join the group
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never asks CUDA
    backend = args.backend or ("nccl" if gpus >= local_world else "gloo")  # NCCL: a GPU per rank
    if (args.device == "cuda" and gpus == 0) or (backend == "nccl" and gpus < local_world):
        raise UsageError(f"--backend {backend}: {gpus} CUDA GPU(s) for {local_world} ranks")
    on_gpu = gpus >= local_world or args.device == "cuda"  # gloo lets the ranks share GPUs
    device = torch.device(f"cuda:{local_rank % gpus}" if on_gpu else "cpu")
    if device.type == "cuda":  # before init, so that NCCL binds this rank to its GPU
        torch.cuda.set_device(device)
    print0(f"device: {device.type}, {backend} "
           f"(--device {args.device}, {gpus} GPU(s) for {local_world} ranks/node)")
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):  # Runs main. setup()'s timeout ends a job whose peer died.
    try:
        main(parse_args())
    except UsageError as e:  # Every rank stops alike, with exit status 2. Rank 0 says why.
        print0(f"error: {e}")
        os._exit(2)  # Exit at once. Tearing down a live group can crash gloo's threads.
    dist.destroy_process_group()  # main() always joins the group first.
    time.sleep(0.05)  # Give gloo's threads a moment to let go of tensors, or exit can crash.


if __name__ == "__main__":
    run(main, parse_args)
