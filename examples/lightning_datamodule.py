"""ddpgpt's data path in PyTorch Lightning: a LightningDataModule over loader.BlockDataset and
loader.RankSampler, and a minimal LightningModule around model.GPT to drive it.

  python examples/lightning_datamodule.py --data_dir=data/pystdlib --devices=2 --max_steps=100
  python examples/lightning_datamodule.py --data_dir=data/pystdlib --devices=2 --max_steps=200 \\
      --ckpt_path=last                 # resume from out_dir/last.ckpt at the exact sample

What Lightning needs, all in make_trainer() and BlockDataModule (docs/lightning.md says why):
  - Trainer(use_distributed_sampler=False): else Lightning would wrap RankSampler in its
    DistributedSamplerWrapper and shard each rank's slice again; BlockDataModule refuses that.
  - rank and world size from the trainer; accumulate_grad_batches = gradient_accumulation_steps
    (global micro-steps) / world size, so the global batch does not depend on the world size.
  - the data position (global samples consumed) in the DataModule's state_dict, which Lightning
    saves in its checkpoints, so a resumed run continues at the exact sample; and what the
    data is, so that a resume on other data is refused, as train.py refuses it.

The optimizer is train.py's (optim.make) at constant learning rates: AdamW, or with
--optimizer=muon Muon for the blocks' matrices and AdamW for the rest (optim.MuonAdamW, which
Lightning steps as one optimizer).

Rank 0 writes out_dir/metrics.jsonl, one row per step with `batch_fp`, the fingerprint of the
samples all ranks read in that step, as train.py does: `python compare_runs.py` compares a
Lightning run with a train.py run. With --tensorboard_log=True the rows' numbers go to
Lightning's TensorBoardLogger too, in out_dir/lightning_logs/version_N (a new version for each
fit, resumed ones too, as Lightning does). Lightning itself is needed only here and in the
tests.
"""
import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Literal

# run as a script, this file's folder is on sys.path, not the checkout that holds ddpgpt/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpgpt import configurator, errors  # noqa: E402
from ddpgpt.arch import ROPE_THETA_RANGE, Arch, check_bias, model_args, n_tokens  # noqa: E402
from ddpgpt.configurator import check_only_for, key  # noqa: E402
from ddpgpt.data import Sampling  # noqa: E402
from ddpgpt.errors import UserError  # noqa: E402

SCRIPT = "examples/lightning_datamodule.py"  # as the user runs it: its help and errors say so


@dataclass
class LightningConfig:
    """Train a GPT with PyTorch Lightning on ddpgpt's data path."""
    data_dir: str = key("data/pystdlib", "the folder prepare.py wrote")
    out_dir: str = key("out-lightning", "Lightning's checkpoints and metrics.jsonl")
    devices: int = key(1, "processes on this node: GPUs, or CPU processes (gloo) without one",
                       at_least=1)
    max_steps: int = key(100, "optimizer steps in all", at_least=1)
    ckpt_path: str = key("", "'' trains from scratch; 'last': out_dir/last.ckpt; or a path")
    allow_data_change: bool = key(False, "resume on other data than the checkpoint's")
    checkpoint_interval: int = key(50, "save every this many steps", at_least=1)
    log_interval: int = key(10, "print the loss every this many steps", at_least=1)
    sampling: Sampling = key("epoch", "as train.py's; documents needs the data's document "
                                      "index")
    gradient_accumulation_steps: int = key(4, "global: divided by the world size", at_least=1)
    batch_size: int = key(12, "sequences per rank and micro-step", at_least=1)
    block_size: int = key(128, "tokens per sequence", at_least=1)
    num_workers: int = key(2, "DataLoader worker processes", at_least=0)
    n_layer: int = key(4, "transformer blocks", at_least=1)
    n_head: int = key(4, "attention heads", at_least=1)
    n_embd: int = key(128, "width of the residual stream", at_least=1)
    dropout: float = key(0.0, "dropout probability", at_least=0, below=1)
    bias: bool = key(False, "biases in Linears and LayerNorms (gpt2 only)")
    arch: Arch = key("gpt2", "as train.py's: gpt2, or modern (Qwen3's block)")
    rope_theta: float = key(10000.0, "modern: the rotary embeddings' base", **ROPE_THETA_RANGE)
    vocab_size: int = key(0, "0: the data's vocabulary rounded up to a multiple of 64",
                          at_least=0)
    learning_rate: float = key(1e-3, "constant: train.py has the schedule", at_least=0)
    optimizer: Literal["adamw", "muon"] = key("adamw", "as train.py's: adamw, or muon (Muon "
                                                       "for the blocks' matrices, AdamW for the "
                                                       "rest)")
    muon_lr: float = key(0.02, "muon: Muon's learning rate, constant", above=0)
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = key(
        "auto", "muon: Newton-Schulz's dtype, as train.py's")
    tensorboard_log: bool = key(False, "log each step to TensorBoard too: Lightning's "
                                       "TensorBoardLogger, in out_dir/lightning_logs")
    seed: int = key(1337, "the data order and the initial weights", at_least=0)

    def __post_init__(self):
        configurator.check(self)
        if self.ckpt_path not in ("", "last") and not os.path.isfile(self.ckpt_path):
            raise UserError(
                f"ckpt_path={self.ckpt_path!r} is not a file: give a checkpoint that Lightning "
                f"saved (such as {os.path.join(self.out_dir, 'step=0000050.ckpt')}), 'last' for "
                f"the newest in out_dir, or '' to train from scratch.")
        check_bias(self.arch, self.bias)
        check_only_for(self, "rope_theta", "arch", "modern")
        for name in ("muon_lr", "muon_ns_dtype"):
            check_only_for(self, name, "optimizer", "muon")
        if self.gradient_accumulation_steps % self.devices:
            raise UserError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} is the global "
                f"number of micro-steps and must be a multiple of devices={self.devices}.")


if __name__ == "__main__":  # a bad setting is said in a moment, before Lightning's imports
    configurator.end_now_if_unreadable(LightningConfig, sys.argv[1:], SCRIPT)

import lightning as L  # noqa: E402  (the imports that take seconds come after)
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from ddpgpt import data, loader, logs, metrics, optim, sources, tokenfile  # noqa: E402
from ddpgpt.model import GPT, GPTConfig  # noqa: E402
from ddpgpt.settings import TrainConfig  # noqa: E402

# Lightning 2.6.6 calls torch APIs that torch 2.13 deprecates: neither ours nor the user's to fix
warnings.filterwarnings("ignore", message=".* is deprecated", module="lightning")


class IndexedBlocks(loader.BlockDataset):
    """BlockDataset's (x, y) and the global sample index, so that what the ranks actually read
    can be fingerprinted."""

    def __getitem__(self, i):
        return (*super().__getitem__(i), i)


class BlockDataModule(L.LightningDataModule):
    """Every rank reads its disjoint slice of the global batches of data.py's contract: the
    same batches as train.py for the same seed and global batch, on any world size."""

    def __init__(self, data_dir, block_size, batch_size, global_micro_steps, seed,
                 mode="epoch", num_workers=2, allow_data_change=False):
        super().__init__()
        self.data_dir, self.block_size, self.seed, self.mode = data_dir, block_size, seed, mode
        self.batch_size, self.global_micro_steps = batch_size, global_micro_steps
        self.global_batch = batch_size * global_micro_steps
        self.num_workers, self.allow_data_change = num_workers, allow_data_change
        self.samples_at_start, self.steps_at_start = 0, 0  # where this fit began
        self.identity_at_start = None  # of the data a resumed checkpoint was trained on
        self.train_file = self.train_mix = self.train_identity = None

    def setup(self, stage):
        # ddpgpt's lines (the data's, a note on the data) on rank 0 alone, as train.py prints them
        logs.setup(self.trainer.is_global_zero)
        self.train_file = sources.open_split(self.data_dir, "train", self.block_size,
                                             mode=self.mode)
        # what the fingerprints need, made once: the tables that samples_fingerprint reads
        self.train_mix = data.with_windows(data.mixture([self.train_file]), self.block_size,
                                           self.mode)
        # what the data is, as train.py's checkpoints keep it, for this one's
        self.train_identity = sources.identity({"train": data.mixture([self.train_file])})

    def train_dataloader(self):
        trainer = self.trainer
        self.check_accumulation(trainer)
        self.check_resume(trainer)
        # Lightning has restored global_step by now: the position counts steps from here
        self.steps_at_start = trainer.global_step
        # endless: a loader with a length would make the whole run one Lightning epoch of that
        # length, which Lightning counts from the epoch's start again when it resumes
        sampler = loader.RankSampler(self.batch_size, trainer.global_rank, trainer.world_size,
                                     micro_steps=trainer.accumulate_grad_batches,
                                     start_step=self.samples_at_start // self.global_batch)
        dataset = IndexedBlocks(self.train_file, self.block_size, self.seed, self.mode)
        batches = DataLoader(dataset, batch_size=self.batch_size, sampler=sampler,
                             num_workers=self.num_workers)
        self.check_not_resharded(trainer, batches)
        return batches

    def check_accumulation(self, trainer):
        micro_steps = trainer.accumulate_grad_batches * trainer.world_size
        if micro_steps != self.global_micro_steps:
            raise UserError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) on "
                f"{trainer.world_size} process(es) makes {micro_steps} micro-steps per global "
                f"batch, not the {self.global_micro_steps} this DataModule reads: set "
                f"accumulate_grad_batches to {self.global_micro_steps} / world size.")

    def check_resume(self, trainer):
        """A resumed run starts at a whole global batch, and where Lightning's gradient
        accumulation starts a step: it counts each rank's micro-batches in its checkpoint and
        steps the optimizer when that count is a multiple of accumulate_grad_batches."""
        if self.samples_at_start % self.global_batch:
            raise UserError(
                f"the checkpoint consumed {self.samples_at_start} samples, not a whole number "
                f"of global batches of {self.global_batch}: resume with a global batch "
                f"(batch_size x gradient_accumulation_steps) that divides it.")
        sources.check_same_data(f"data_dir={self.data_dir!r}", self.identity_at_start,
                                self.train_identity, f"the checkpoint {trainer.ckpt_path}",
                                self.allow_data_change)
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if done % trainer.accumulate_grad_batches:
            raise UserError(
                f"the checkpoint was saved after {done} micro-batches per rank, which is not "
                f"a whole number of steps of {trainer.accumulate_grad_batches} micro-batches "
                f"per rank here: Lightning would step the optimizer in the middle of global "
                f"batches. Resume with the devices and gradient_accumulation_steps that saved "
                f"it.")

    @staticmethod
    def check_not_resharded(trainer, loader):
        """Ask Lightning, with its own test, whether it will replace the loader's sampler.
        This cannot wait for a hook that sees the replaced sampler: Lightning's replacement
        takes len() of an endless RankSampler, which raises before any hook runs."""
        if trainer._data_connector._requires_distributed_sampler(loader):
            raise UserError(
                f"Trainer(use_distributed_sampler=True), Lightning's default, wraps the "
                f"sampler of a DataLoader on {trainer.world_size} processes in a "
                f"DistributedSamplerWrapper, which would shard again what this DataModule's "
                f"RankSampler has already sharded: each rank's disjoint slice of every global "
                f"batch. Pass use_distributed_sampler=False to the Trainer.")

    def position(self):
        """Global samples consumed by the optimizer steps taken so far."""
        steps = self.trainer.global_step - self.steps_at_start
        return self.samples_at_start + steps * self.global_batch

    def state_dict(self):
        return {"samples_consumed": self.position(), "data_identity": self.train_identity}

    def load_state_dict(self, state):
        self.samples_at_start = state["samples_consumed"]
        self.identity_at_start = state.get("data_identity")

    def fingerprint(self, sample_indices):
        return data.samples_fingerprint(sample_indices, self.train_mix, self.block_size,
                                        self.seed, self.mode)


class GPTModule(L.LightningModule):
    """model.GPT trained on (x, y, index) batches; rank 0 logs each step to metrics.jsonl."""

    def __init__(self, args, train_cfg, out_dir, log_interval=10, tokens=None):
        super().__init__()
        self.model = GPT(GPTConfig(**args), tokens)
        self.train_cfg, self.out_dir, self.log_interval = train_cfg, out_dir, log_interval
        self.step_losses, self.step_indices, self.metrics = [], [], None

    def training_step(self, batch, batch_idx):
        x, y, indices = batch
        _, loss = self.model(x, y)
        self.step_losses.append(loss.detach())
        self.step_indices.append(indices)
        return loss  # Lightning divides it by accumulate_grad_batches before backward

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if len(self.step_indices) < self.trainer.accumulate_grad_batches:
            return  # mid-step: Lightning stepped the optimizer only after the last micro-batch
        loss = self.all_gather(torch.stack(self.step_losses).mean()).mean().item()
        indices = self.all_gather(torch.cat(self.step_indices)).flatten().cpu().numpy()
        self.step_losses, self.step_indices = [], []
        if self.metrics is not None:
            row = {"iter": self.trainer.global_step - 1, "loss": loss,
                   "batch_fp": self.trainer.datamodule.fingerprint(indices)}
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
            if self.logger is not None:  # TensorBoard's, with --tensorboard_log=True
                self.logger.log_metrics(metrics.scalars(row), step=row["iter"])
            if row["iter"] % self.log_interval == 0 or self.trainer.global_step == \
                    self.trainer.max_steps:
                print(f"step {row['iter']}: loss {loss:.4f}")

    def on_train_start(self):
        if self.trainer.is_global_zero:  # appended to: a resumed run adds its steps
            os.makedirs(self.out_dir, exist_ok=True)
            self.metrics = open(os.path.join(self.out_dir, "metrics.jsonl"), "a")
            # the start row, as train.py writes it, says where a resumed run's steps begin
            step = self.trainer.global_step
            start = metrics.start_row(step, step > 0, self.trainer.ckpt_path or "scratch",
                                      self.trainer.world_size)
            self.metrics.write(json.dumps(start) + "\n")

    def on_train_end(self):
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def configure_optimizers(self):
        # train.py's optimizer for these settings (train_cfg, a TrainConfig: nanoGPT's weight
        # decay and betas, Muon's defaults), at constant learning rates
        return optim.make(self.train_cfg, self.model, self.device.type)


def make_trainer(cfg):
    # out_dir/step=<step>.ckpt, the newest kept, and last.ckpt for --ckpt_path=last
    every = ModelCheckpoint(dirpath=cfg.out_dir, filename="{step:07d}", save_last=True,
                            every_n_train_steps=cfg.checkpoint_interval)
    return L.Trainer(
        accelerator="auto", devices=cfg.devices,
        strategy="ddp" if cfg.devices > 1 else "auto",  # on a CPU, ddp uses gloo
        use_distributed_sampler=False,  # RankSampler shards; see BlockDataModule
        accumulate_grad_batches=cfg.gradient_accumulation_steps // cfg.devices,
        max_steps=cfg.max_steps, gradient_clip_val=1.0,  # train.py's grad_clip
        callbacks=[every], default_root_dir=cfg.out_dir, logger=tensorboard_logger(cfg),
        enable_progress_bar=False)


def tensorboard_logger(cfg):
    """Lightning's TensorBoardLogger with tensorboard_log, in out_dir/lightning_logs; else no
    logger (False)."""
    if not cfg.tensorboard_log:
        return False
    metrics.import_tensorboard()  # the error of a missing tensorboard, before Lightning starts
    # without its placeholder hp_metric of -1: the scalars are metrics.jsonl's numbers alone
    return TensorBoardLogger(cfg.out_dir, name="lightning_logs", default_hp_metric=False)


def build(cfg):
    """(the DataModule, the LightningModule) for a configuration."""
    datamodule = BlockDataModule(cfg.data_dir, cfg.block_size, cfg.batch_size,
                                 cfg.gradient_accumulation_steps, cfg.seed, cfg.sampling,
                                 cfg.num_workers, cfg.allow_data_change)
    torch.manual_seed(cfg.seed)
    meta = tokenfile.read_meta(cfg.data_dir)
    train_cfg = TrainConfig(optimizer=cfg.optimizer, learning_rate=cfg.learning_rate,
                            muon_lr=cfg.muon_lr, muon_ns_dtype=cfg.muon_ns_dtype)
    return datamodule, GPTModule(model_args(cfg, meta), train_cfg, cfg.out_dir, cfg.log_interval,
                                 n_tokens(meta))


def main(argv):
    cfg = configurator.parse(LightningConfig, argv, SCRIPT)
    datamodule, module = build(cfg)
    make_trainer(cfg).fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path or None)
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, SCRIPT, sys.argv[1:]))
