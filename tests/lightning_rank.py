"""Run by test_lightning.py as a user runs a Lightning script, and Lightning starts the second
CPU process (gloo):

  python tests/lightning_rank.py OUT DESIGN DATA_DIR [DESIGN DATA_DIR ...]

Fits one after the other in the same two processes, each stopped at its first batch; after
each, every rank rewrites OUT.rank<r>.json with a row per fit: the sampler Lightning used, the
time from opening the data to that batch (wall and CPU) and the memory then. DESIGN is what
reads the data:
  ddpgpt           examples/lightning_datamodule.py's DataModule, use_distributed_sampler=False
  seed             the seed's design: a sample per token offset (benchmarks/datapath_rank.py's
                   EveryOffset) in a plain DataLoader, under Lightning's default
                   use_distributed_sampler=True, which puts a DistributedSampler in it
  default_sampler  ddpgpt's DataModule under that default, which it must refuse
"""
import gc
import json
import os
import sys
import time

import lightning as L
import psutil
from torch.utils.data import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script, tests/ is on sys.path, not the checkout
sys.path.insert(0, os.path.join(ROOT, "examples"))

from ddpgpt import tokenfile
from ddpgpt.settings import TrainConfig
from ddpgpt.arch import model_args
from benchmarks.datapath_rank import BATCH, BLOCK, EveryOffset
from lightning_datamodule import BlockDataModule, GPTModule, LightningConfig


class Timed:
    """Times a DataModule's opening of the data (setup), and from its making of the loader to
    the first batch. The model set-up between the two is left out; Lightning's barrier after
    the loader is made is in, so the wall time includes waiting for the other rank, and the
    CPU time is this rank's work alone."""

    def setup(self, stage):
        t, cpu = time.perf_counter(), time.process_time()
        super().setup(stage)
        self.setup_s = time.perf_counter() - t
        self.setup_cpu_s = time.process_time() - cpu

    def train_dataloader(self):
        self.t_loader, self.cpu_loader = time.perf_counter(), time.process_time()
        return super().train_dataloader()


class TimedBlocks(Timed, BlockDataModule):
    pass


class SeedData(L.LightningDataModule):
    def __init__(self, data_dir):
        super().__init__()
        self.path = os.path.join(data_dir, "train.bin")

    def setup(self, stage):
        self.dataset = EveryOffset(self.path)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=BATCH)  # shuffle=False, as in the seed


class TimedSeed(Timed, SeedData):
    pass


class FirstBatch(GPTModule):
    def __init__(self, args, record):
        super().__init__(args, TrainConfig(learning_rate=1e-3), out_dir=None)
        self.record = record

    def on_train_start(self):
        pass  # no metrics.jsonl: this run takes no step

    def on_train_batch_start(self, batch, batch_idx):
        wall, cpu = time.perf_counter(), time.process_time()
        datamodule = self.trainer.datamodule
        sampler = self.trainer.train_dataloader.sampler  # the one Lightning actually uses
        self.record(rank=self.global_rank, sampler=type(sampler).__name__,
                    shuffle=getattr(sampler, "shuffle", None), batch=list(batch[0].shape),
                    data_setup_s=datamodule.setup_s + wall - datamodule.t_loader,
                    data_setup_cpu_s=datamodule.setup_cpu_s + cpu - datamodule.cpu_loader,
                    rss=psutil.Process().memory_info().rss,
                    peak_rss=peak_rss())
        return -1  # the first batch is what is measured: Lightning ends the epoch here


def reset_peak_rss():
    """Start this fit's peak afresh: Linux keeps the largest RSS of a process (VmHWM), and
    writing 5 to clear_refs sets it back to the RSS now. getrusage's ru_maxrss never goes back,
    so it would give every fit the peak of the largest before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def fit(design, data_dir, record):
    cfg = LightningConfig(data_dir=data_dir, block_size=BLOCK, batch_size=BATCH, num_workers=0,
                          gradient_accumulation_steps=2, n_layer=1, n_head=1, n_embd=32)
    datamodule = TimedSeed(data_dir) if design == "seed" else TimedBlocks(
        data_dir, BLOCK, BATCH, cfg.gradient_accumulation_steps, cfg.seed)
    module = FirstBatch(model_args(cfg, tokenfile.read_meta(data_dir)), record)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                        use_distributed_sampler=design != "ddpgpt", enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=datamodule)


def main(out, runs):
    """runs: DESIGN DATA_DIR pairs. The rows are written after every fit, so that a fit that
    fails leaves those before it."""
    rows = []
    for design, data_dir in zip(runs[::2], runs[1::2]):
        def record(**measured):
            rows.append({"design": design, "data_dir": data_dir, **measured})
            with open(f"{out}.rank{measured['rank']}.json", "w") as f:
                json.dump(rows, f)
        gc.collect()  # the last run's trainer and model, before this run measures memory
        gc.disable()  # and no collection of them in the middle of a timing
        reset_peak_rss()
        fit(design, data_dir, record)
        gc.enable()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
