"""Run under torchrun (2 or 3 CPU ranks): real training clients, written for PyTorch's DDP, with only the DDP class
swapped for ddp_dropin's ManualDDP. Each client trains twice in this process, once with PyTorch's class and once with
ours, from the same initial weights and data; the weights must be equal bit for bit, and identical across ranks.

  hf:        Hugging Face's Trainer (through accelerate): a GPT-2 made from a config, gradient accumulation
             (no_sync) and clipping; Trainer's defaults otherwise (find_unused_parameters=True for a model of
             transformers', the Trainer's own seeding, sampler and AdamW with a schedule).
  lightning: Lightning's Trainer(strategy="ddp"): a model with BatchNorm, accumulate_grad_batches and
             gradient_clip_val, fit to the end, teardown included.
  fabric:    Lightning Fabric's strategy="ddp": a hand-written loop with fabric.no_backward_sync (accumulation),
             fabric.clip_gradients, a frozen bias and BatchNorm.
Usage: torchrun --nproc_per_node=2 tests/workers/clients_worker.py [hf] [lightning] [fabric] OUT_DIR
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

ManualDDP = load_script("ddp_dropin.py").ManualDDP


@contextlib.contextmanager
def ddp_class(module, cls, name="DistributedDataParallel"):
    """The DDP class as `module` sees it, swapped for `cls` while inside (a client's `isinstance` checks too)."""
    saved = getattr(module, name)
    setattr(module, name, cls)
    try:
        yield
    finally:
        setattr(module, name, saved)


def bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def compare(runs, what, steps):
    """Two runs' (wrapper, model): PyTorch's class and ours were used, the weights and buffers equal bit
    for bit, and our run's parameters identical across ranks (buffers are each rank's own after the last forward).
    Ours synchronized once per optimizer step: the client accumulated under no_sync()."""
    (wrapped_a, model_a), (wrapped_b, model) = runs
    a, b = model_a.state_dict(), model.state_dict()  # each model is left as its run ended
    assert type(wrapped_a).__name__ == "DistributedDataParallel" and type(wrapped_b) is ManualDDP, \
        (type(wrapped_a), type(wrapped_b))
    assert wrapped_b._syncs == steps, (what, wrapped_b._syncs, steps)
    assert a.keys() == b.keys()
    differ = [k for k in a if not bits(a[k], b[k])]
    assert not differ, f"{what}: weights differ from PyTorch's DDP run: {differ[:5]}"
    assert identical_across_ranks(list(model.parameters())), f"{what}: ranks differ"


# --- Hugging Face Trainer ---
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=97):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf(out):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
    runs = []
    for cls in (torch.nn.parallel.DistributedDataParallel, ManualDDP):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2))
        args = TrainingArguments(output_dir=os.path.join(out, cls.__name__), per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-3, max_steps=5,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, dataloader_num_workers=0, seed=7)
        with ddp_class(torch.nn.parallel, cls):
            trainer = Trainer(model=model, args=args, train_dataset=Tokens())
            trainer.train()
            trainer.save_model()  # unwraps the model through accelerate, rank 0 writes
        dist.barrier()
        runs.append((trainer.model_wrapped, model))
        saved = GPT2LMHeadModel.from_pretrained(args.output_dir).state_dict()
        assert all(bits(saved[k], v) for k, v in model.state_dict().items() if k in saved), "the saved model differs"
    compare(runs, "Hugging Face Trainer", trainer.state.global_step)
    return "Hugging Face Trainer (accelerate), find_unused_parameters, accumulation 2, clipping"


# --- Lightning ---
def lightning(out):
    import lightning.pytorch as pl
    import lightning.pytorch.strategies.ddp as strategy

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g))
    class Seen(pl.Callback):  # the wrapper Lightning trains with (teardown unwraps it again)
        def on_train_start(self, trainer, _):
            self.wrapper = trainer.strategy.model

    runs = []
    for cls in (strategy.DistributedDataParallel, ManualDDP):
        pl.seed_everything(0, verbose=False)
        seen = Seen()
        model = Net()
        trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size() if dist.is_initialized() else
                             int(os.environ["WORLD_SIZE"]), strategy="ddp", max_epochs=2, accumulate_grad_batches=2,
                             gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                             callbacks=[seen])
        with ddp_class(strategy, cls):
            trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
        runs.append((seen.wrapper, model))
    compare(runs, "Lightning Trainer", trainer.global_step)
    return "Lightning Trainer(strategy='ddp'), BatchNorm, accumulate_grad_batches 2, gradient_clip_val"


# --- Lightning Fabric ---
def fabric(out):
    import lightning.fabric as lf
    import lightning.fabric.strategies.ddp as strategy
    fab = lf.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp")
    fab.launch()  # under torchrun it starts no process: it uses (or makes) the job's process group
    runs, steps = [], 4
    for cls in (strategy.DistributedDataParallel, ManualDDP):
        torch.manual_seed(fab.global_rank)  # each rank its own init: the wrapper must broadcast rank 0's
        model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))
        model[0].bias.requires_grad_(False)  # frozen, and different per rank until broadcast
        g = torch.Generator().manual_seed(fab.global_rank)
        with ddp_class(strategy, cls):  # for the whole loop: no_backward_sync checks the class too
            wrapped, opt = fab.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
            for _ in range(steps):
                for micro in range(2):
                    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
                    with fab.no_backward_sync(wrapped, enabled=micro == 0):
                        fab.backward(nn.functional.cross_entropy(wrapped(x), y) / 2)
                fab.clip_gradients(wrapped, opt, max_norm=0.5)
                opt.step()
                opt.zero_grad()
        runs.append((wrapped._forward_module, model))
    compare(runs, "Lightning Fabric", steps)
    return "Lightning Fabric(strategy='ddp'), frozen bias, BatchNorm, no_backward_sync, clip_gradients"


def main():
    clients, out = sys.argv[1:-1], sys.argv[-1]
    said = [{"hf": hf, "lightning": lightning, "fabric": fabric}[client](out) for client in clients]
    if dist.get_rank() == 0:
        print(f"OK {'; '.join(said)}: ManualDDP == PyTorch's DDP bit for bit on {dist.get_world_size()} ranks",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
