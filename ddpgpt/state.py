"""The training state: where a run is and what it trains on, in one object with torchtitan's
Stateful contract (state_dict / load_state_dict). A checkpoint keeps it beside the model's and
the optimizer's tensors, the loss scale and the settings (checkpoint.contents, and its mirror
checkpoint.resume); a new piece of where-the-run-is is added here alone.

Its keys in a checkpoint are nanoGPT's (iter_num, best_val_loss, model_args) and ddpgpt's:
samples_consumed (the data position), data_meta (the data's meta.json, which names the tokenizer),
data_identity (what the data is, so that a resume on other data is caught) and scored_ids (the
ids the loss is over: model.GPT's n_tokens). Saved reads a checkpoint's from any version, with
what an older one (nanoGPT's) that lacks a key implies."""
import math
import os
from typing import NamedTuple, Optional


class TrainState:
    """Where a run is (iter_num, samples, best_val) and what it trains (its model arguments and
    data). iter_num counts optimizer steps (the learning rate follows it); samples counts the
    global samples read (the data position). They part when a run resumes with another global
    batch, which is why the batch index is always samples // global_batch. A class, as the
    Stateful contract is one."""

    def __init__(self, model_args, data_meta, data_identity, global_batch, scored_ids):
        self.model_args, self.data_meta, self.data_identity = model_args, data_meta, data_identity
        self.scored_ids = scored_ids
        self.global_batch = global_batch  # the run's: where a nanoGPT checkpoint's steps end
        self.iter_num, self.samples, self.best_val = 0, 0, math.inf

    def state_dict(self):
        return {"model_args": self.model_args, "iter_num": self.iter_num,
                "samples_consumed": self.samples, "best_val_loss": self.best_val,
                "data_meta": self.data_meta, "data_identity": self.data_identity,
                "scored_ids": self.scored_ids}

    def load_state_dict(self, state):
        """Go on from a checkpoint's progress. Its model arguments and data are not taken: the run
        trains with its own, checked against the checkpoint's before (weights.check_resume)."""
        saved = Saved.of(state)
        self.iter_num, self.best_val = saved.iter_num, saved.best_val
        self.samples = saved.samples(self.global_batch)


class Saved(NamedTuple):
    """The training state a checkpoint of any version holds, for resuming and for the checks
    of a resume against the run's settings and data."""
    iter_num: int
    samples_consumed: Optional[int]  # None: nanoGPT's, which took whole steps (samples())
    best_val: float
    scaler: Optional[dict]
    config: dict  # the settings it was trained with; {} where it has none
    data_meta: Optional[dict]
    data_identity: Optional[dict]
    # the ids its loss is over; None: every row of the output layer, padding too (checkpoints
    # before the loss left the padding out, and nanoGPT's), which a resume keeps computing
    scored_ids: Optional[int]

    @classmethod
    def of(cls, state):
        return cls(iter_num=state["iter_num"], samples_consumed=state.get("samples_consumed"),
                   best_val=state.get("best_val_loss", math.inf), scaler=state.get("scaler"),
                   config=state.get("config") or {}, data_meta=state.get("data_meta"),
                   data_identity=state.get("data_identity"), scored_ids=state.get("scored_ids"))

    def samples(self, global_batch):
        """The data position."""
        return self.iter_num * global_batch if self.samples_consumed is None else \
            self.samples_consumed

    @property
    def tokenizer(self):
        """The tokenizer its data was in, or None where it names none."""
        return (self.data_meta or {}).get("tokenizer")

    @property
    def data_dir(self):
        """The data folder its settings name: data_dir, or nanoGPT's data/<dataset>."""
        return self.config.get("data_dir") or (self.config.get("dataset") and
                                               os.path.join("data", self.config["dataset"]))
