"""Every script's settings: each key's type, default, range and one line of help, written once.

configurator.py parses config files and --key=value into these classes and prints --help from them;
each class checks itself when it is made (__post_init__), the ranges with configurator.check and
what involves several keys below it. A Literal[...] type lists a key's choices.
"""
import math
import os
import re
from dataclasses import dataclass
from typing import Literal

from ddpgpt import configurator, profiling
from ddpgpt.arch import ROPE_THETA_RANGE, Arch, check_bias
from ddpgpt.configurator import check_only_for, key
from ddpgpt.data import Sampling
from ddpgpt.errors import UserError
from ddpgpt.hf import NAMES, check_init_from
from ddpgpt.schedule import cooldown_start
from ddpgpt.tokenfile import GPT2_EOT

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Backend = Literal["", "nccl", "gloo"]
Parallel = Literal["ddp", "fsdp"]
Recompute = Literal["none", "full", "selective"]
INIT_FROM = ("scratch", "resume", "auto")  # train.py's; else GPT-2's weights
SPIKE_WINDOW = 100  # the applied steps that spike_policy judges a step against
EMA_DECAY = 0.95  # ema_decay's default, which a run without ema_tail may leave alone
YEAR_S = 365 * 24 * 3600  # a watchdog limit beyond it is an error, not an OverflowError; 0: off
DEVICE_HELP = "auto: this rank's GPU when torch sees one, else cpu; cuda: cuda:<local rank>"
DTYPE_HELP = "auto: bfloat16 on a GPU that has it natively, else float16; float32 on a CPU"
LOAD_HELP = ("resume: out_dir's newest checkpoint (or out_dir is one checkpoint file); or "
             "GPT-2's weights, gpt2, gpt2-medium, ..., or a Hugging Face GPT-2 folder")

# plan.py's gpu_memory: a number and one of these units
MEMORY_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
MEMORY_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_memory(text):
    """Bytes of a memory size such as '80GiB', '24 GB' or '512MiB'; a UserError naming the
    value and the fix for anything else (a bare number, a unit not listed, under a byte, one
    too large for a float: 1e400GiB)."""
    found = MEMORY_SIZE.fullmatch(text)
    size = float(found.group(1)) * MEMORY_UNITS.get(found.group(2), math.nan) if found else 0
    if not 1 <= size < math.inf:
        raise UserError(f"gpu_memory={text!r} is not a memory size: give a number and a unit "
                        f"that make 1 byte or more, e.g. --gpu_memory=80GiB "
                        f"({', '.join(MEMORY_UNITS)}), or leave it out for this machine's GPU.")
    return int(size)


@dataclass
class TrainConfig:
    """Train a GPT with DistributedDataParallel, on one process or many."""
    # output
    out_dir: str = key("out", "where checkpoints, metrics.jsonl and the lock go")
    eval_interval: int = key(2000, "evaluate (and save) every this many steps", at_least=1)
    log_interval: int = key(1, "print a step's line every this many steps", at_least=1)
    eval_iters: int = key(200, "evaluation reads eval_iters x batch_size fixed windows per "
                               "split", at_least=1)
    eval_only: bool = key(False, "evaluate once and exit")
    always_save_checkpoint: bool = key(True, "save at every evaluation; False: only when the "
                                             "val loss improves (and at the end)")
    init_from: str = key("scratch", "scratch, resume, auto (resume if out_dir holds a "
                                    "checkpoint), or GPT-2's weights: gpt2, gpt2-medium, "
                                    "gpt2-large, gpt2-xl or a Hugging Face GPT-2 folder (or "
                                    "a Qwen3 folder that export.py wrote)")
    keep_checkpoints: int = key(3, "how many of the newest checkpoints to keep", at_least=1)
    hellaswag_interval: int = key(0, "HellaSwag at the evaluations whose iter is a multiple of "
                                     "this, on all ranks (0: never)", at_least=0)
    hellaswag_path: str = key("", "HellaSwag's validation file; '' for the cached copy, "
                                  "downloaded once")
    wandb_log: bool = key(False, "log to wandb too")
    wandb_project: str = key("ddpgpt", "the wandb project")
    wandb_run_name: str = key("gpt2", "the wandb run's name")
    tensorboard_log: bool = key(False, "log to TensorBoard too (rank 0): event files in "
                                       "tensorboard_dir")
    tensorboard_dir: str = key("", "the folder of this run's TensorBoard event files, one run "
                                   "per folder as out_dir; '': out_dir")
    profile_steps: str = key("", "iters to profile, e.g. 20-22 (or 20): each rank writes a "
                                 "torch.profiler trace of them into out_dir/profile/; '': none")
    profile_memory: bool = key(False, "with profile_steps on CUDA: a memory snapshot of those "
                                      "iters too (torch.cuda.memory's history)")
    # data
    data_dir: str = key("data/openwebtext", "the folder prepare.py wrote")
    data_mix: str = key("", "sources and their shares of the samples, e.g. "
                            "'data/web=0.7,data/code=0.3'; replaces data_dir")
    allow_data_change: bool = key(False, "resume on other data than the checkpoint's")
    sampling: Sampling = key("epoch", "epoch: every block once per epoch in a new order; "
                                      "random: windows anywhere, as nanoGPT; documents: windows "
                                      "that start where documents do (the document index)")
    gradient_accumulation_steps: int = key(5 * 8, "micro-steps per optimizer step, global: "
                                                  "divided by the world size", at_least=1)
    batch_size: int = key(12, "sequences per rank and micro-step", at_least=1)
    block_size: int = key(1024, "tokens per sequence", at_least=1)
    # model
    n_layer: int = key(12, "transformer blocks", at_least=1)
    n_head: int = key(12, "attention heads", at_least=1)
    n_embd: int = key(768, "width of the residual stream", at_least=1)
    dropout: float = key(0.0, "dropout probability", at_least=0, below=1)
    bias: bool = key(False, "biases in Linears and LayerNorms (gpt2 only)")
    vocab_size: int = key(0, "0: the data's vocabulary rounded up to a multiple of 64", at_least=0)
    arch: Arch = key("gpt2", "gpt2: GPT-2 (nanoGPT's); modern: RMSNorm, rotary positions, "
                             "QK-norm, SwiGLU, no biases, untied head (Qwen3's block)")
    proj_init: Literal["scaled", "zero"] = key(
        "scaled", "scaled: the blocks' output projections (c_proj) drawn with GPT-2's std of "
                  "0.02/sqrt(2 n_layer); zero: they start at zero, so each block starts as "
                  "the identity (a new model's only)")
    rope_theta: float = key(10000.0, "modern: the base of the rotary embeddings' frequencies "
                                     "(computed in float32)", **ROPE_THETA_RANGE)
    # the optimizer and its schedule
    optimizer: Literal["adamw", "muon"] = key(
        "adamw", "adamw: AdamW for every parameter; muon: Muon for the matrices "
                 "that muon_params names, AdamW (learning_rate) for the rest")
    learning_rate: float = key(6e-4, "the peak learning rate (AdamW's)", at_least=0)
    max_iters: int = key(600000, "optimizer steps in all", at_least=0)
    weight_decay: float = key(1e-1, "AdamW's, on the matrices only", at_least=0)
    beta1: float = key(0.9, "AdamW's beta1", at_least=0, below=1)
    beta2: float = key(0.95, "AdamW's beta2", at_least=0, below=1)
    muon_lr: float = key(0.02, "muon: Muon's peak learning rate; it follows the schedule in "
                               "proportion to learning_rate", above=0)
    muon_momentum: float = key(0.95, "muon: Muon's (Nesterov) momentum", at_least=0, below=1)
    muon_weight_decay: float = key(0.0, "muon: Muon's decoupled weight decay (times its "
                                        "learning rate)", at_least=0)
    muon_params: str = key("transformer.h.*.c_*.weight",
                           "muon: the parameters Muon steps, comma-separated patterns of "
                           "names (fnmatch; each 2-D); by default every matrix in the blocks")
    muon_coefficients: Literal["torch", "polar_express"] = key(
        "torch", "muon: torch: Newton-Schulz's one (a, b, c) at each of its 5 steps; "
                 "polar_express: Polar Express's, one per step, which take more of the "
                 "singular values near 1")
    muon_beta2: float = key(0.0, "muon: NorMuon's decay of the average of each row's mean "
                                 "square of the update, which evens the rows' steps (0: off; "
                                 "0.95: NorMuon's)", at_least=0, below=1)
    cautious_weight_decay: bool = key(
        False, "decay a weight (weight_decay, muon_weight_decay) only where its update has "
               "the weight's sign")
    ema_tail: float = key(0.0, "average the weights (an exponential moving average) over this "
                               "last share of max_iters, and end the run with the average: its "
                               "final evaluation, checkpoint and export (0: off)",
                          at_least=0, at_most=1)
    ema_decay: float = key(EMA_DECAY, "ema_tail: the average's decay per step", above=0, below=1)
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = key(
        "auto", "muon: the dtype of Newton-Schulz's matmuls; auto: bfloat16 where the device "
                "has it natively (CUDA from Ampere on, CPUs with AVX512-BF16 or AMX), else "
                "float32; bfloat16 is torch.optim.Muon's")
    grad_clip: float = key(1.0, "clip the gradient norm to this (0: no clipping)", at_least=0)
    decay_lr: bool = key(True, "False: a constant learning rate")
    lr_schedule: Literal["cosine", "wsd"] = key(
        "cosine", "cosine: warm-up, then cosine decay to min_lr at lr_decay_iters; wsd: "
                  "warm-up, stable, then a cooldown")
    warmup_iters: int = key(2000, "linear warm-up steps", at_least=0)
    lr_decay_iters: int = key(600000, "cosine: where it reaches min_lr", at_least=0)
    cooldown_frac: float = key(0.2, "wsd: the last share of max_iters, decaying as 1 - sqrt",
                               above=0, at_most=1)
    min_lr: float = key(6e-5, "the learning rate at the end of the decay", at_least=0)
    nan_policy: Literal["stop", "skip"] = key("stop", "on a non-finite loss or gradient: stop "
                                                      "without saving, or skip the step")
    spike_policy: Literal["off", "skip"] = key(
        "off", "skip: a step whose loss or gradient norm is spike_zscore standard deviations "
               f"above the last {SPIKE_WINDOW} steps is not applied")
    spike_zscore: float = key(6.0, "what spike_policy counts as a spike", above=0)
    # system
    backend: Backend = key("", "'' picks nccl on CUDA, gloo on a CPU")
    device: str = key("auto", DEVICE_HELP)
    dtype: Dtype = key("auto", DTYPE_HELP)
    compile: bool = key(False, "torch.compile the model")
    dist_timeout_s: int = key(600, "how long a collective may wait before the run fails",
                              at_least=1)
    hang_timeout_s: int = key(300, "no step for max(this, 10 x the median step): each rank's "
                                   "stacks, then exit (watchdog.py); 0: off", at_least=0,
                              at_most=YEAR_S)
    startup_timeout_s: int = key(1800, "the same limit until the first step completes; 0: off",
                                 at_least=0, at_most=YEAR_S)
    network_check: Literal["auto", "on", "off", "stop"] = key(
        "auto", "auto: with ranks on 2+ nodes, time the network before the first step and say "
                "where it is slow (docs/performance.md); on: on one node's 2+ ranks too; stop: "
                "as on, and end the run there when it is slow; off")
    network_min_gbps: float = key(0.0, "the least between-node bus bandwidth (GB/s) to take "
                                       "as fast; 0: the least of the fabric that NCCL's "
                                       "variables name", at_least=0)
    seed: int = key(1337, "the data order, the initial weights and dropout", at_least=0)
    # how the ranks share the model (parallel.py) and how checkpoints are written
    parallel: Parallel = key("ddp", "ddp: every rank holds all the weights, gradients and "
                                    "optimizer state; fsdp: each rank holds 1/N of them (FSDP2), "
                                    "and checkpoints are folders every rank writes its part of")
    reshard_after_forward: bool = key(
        True, "fsdp: free a block's gathered weights after its forward and gather them again "
              "for its backward (least memory); False: keep them until then (one all-gather "
              "less per block and micro-step, the gathered blocks' memory more)")
    reduce_every_micro_step: bool = key(
        False, "fsdp: reduce-scatter the gradients in every micro-step, so each rank keeps "
               "only its shard of them; False: in the last micro-step only, as ddp, each rank "
               "accumulating its whole gradients until then")
    activation_checkpointing: Recompute = key(
        "none", "none: keep every activation the backward needs; full: each block keeps its "
                "input alone and runs its forward again in the backward (least memory, about "
                "a third more compute); selective: each block keeps its matmuls' and "
                "attention's outputs and recomputes the rest (norms, activations, dropout)")
    loss_chunks: int = key(
        1, "compute the training loss in this many slices of the positions, each recomputed in "
           "the backward: the logits and their gradients (at GPT-2's vocabulary, more than a "
           "block keeps) take 1/loss_chunks of the memory, for the output layer's matmul again "
           "and its weight's gradient made per slice; with activation_checkpointing=full, the "
           "least memory", at_least=1)
    async_save: bool = key(True, "write checkpoints in the background while training goes on "
                                 "(one at a time; a run's last save waits), when the host has "
                                 "memory for their copy")

    def __post_init__(self):
        configurator.check(self)
        check_init_from(self.init_from, INIT_FROM)
        cooldown = cooldown_start(self)
        if self.decay_lr and self.lr_schedule == "wsd" and self.max_iters and \
                not self.eval_only and self.warmup_iters > cooldown:
            raise UserError(
                f"lr_schedule='wsd': warmup_iters={self.warmup_iters} does not end before the "
                f"cooldown, which starts at iter {cooldown} (the last cooldown_frac="
                f"{self.cooldown_frac} of max_iters={self.max_iters}), so the learning rate "
                f"would still be rising where it should decay: set warmup_iters to at most "
                f"{cooldown}, or raise max_iters.")
        # the combinations of arch and optimizer that cannot work
        check_bias(self.arch, self.bias)
        if self.init_from == "scratch" or self.init_from in NAMES:  # else the weights' arch
            check_only_for(self, "rope_theta", "arch", "modern")
        for name in ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_params",
                     "muon_ns_dtype", "muon_coefficients", "muon_beta2"):
            check_only_for(self, name, "optimizer", "muon")
        if self.from_weights and self.proj_init != "scaled":
            raise UserError(
                f"proj_init={self.proj_init!r} with init_from={self.init_from!r}: the "
                f"projections are the weights', and proj_init only says how a new model's "
                f"start. Leave proj_init out, or train from scratch.")
        if self.cautious_weight_decay and not (self.weight_decay or self.muon_weight_decay):
            raise UserError(
                "cautious_weight_decay=True with weight_decay=0 and muon_weight_decay=0: there "
                "is no weight decay to make cautious. Set weight_decay (AdamW's) or, with "
                "optimizer='muon', muon_weight_decay above 0, or leave cautious_weight_decay out.")
        if self.arch == "modern" and self.init_from in NAMES:
            raise UserError(f"arch='modern' with init_from={self.init_from!r}: OpenAI's GPT-2 "
                            f"weights are arch='gpt2'. Fine-tune them with arch='gpt2' (the "
                            f"default), or train the modern block from scratch.")
        if self.optimizer == "muon" and self.learning_rate == 0:
            raise UserError("optimizer='muon' with learning_rate=0: Muon's learning rate "
                            "follows the schedule of learning_rate in proportion (muon_lr at "
                            "its peak), which a peak of 0 leaves undefined. Set learning_rate "
                            "(the AdamW part's) above 0.")
        # the keys that only fsdp reads (what it cannot train in, float16, is parallel.check's:
        # the device says what dtype='auto' is)
        for name in ("reshard_after_forward", "reduce_every_micro_step"):
            check_only_for(self, name, "parallel", "fsdp")
        check_only_for(self, "tensorboard_dir", "tensorboard_log", True)
        if self.ema_decay != EMA_DECAY and not self.ema_tail:
            raise UserError(f"ema_decay={self.ema_decay} is a setting of the weights' average, "
                            f"and this run has none (ema_tail=0): set ema_tail, e.g. "
                            f"--ema_tail=0.1 for the last tenth of max_iters, or leave ema_decay "
                            f"out.")
        profiling.window(self.profile_steps, self.max_iters)

    @property
    def from_weights(self):
        """Does init_from name GPT-2's weights (by name, or a folder), not a start of ours?"""
        return self.init_from not in INIT_FROM

    @property
    def global_batch(self):
        """Samples per optimizer step, whatever the world size (data.py, point 1)."""
        return self.batch_size * self.gradient_accumulation_steps

    def micro_steps(self, world_size):
        """Each rank's share of the global micro-steps."""
        if self.gradient_accumulation_steps % world_size:
            micro = self.gradient_accumulation_steps
            raise UserError(
                f"gradient_accumulation_steps={micro} is the global number of micro-steps and "
                f"must be a multiple of the world size {world_size}: use "
                f"{max(1, micro // world_size) * world_size}.")
        return self.gradient_accumulation_steps // world_size


@dataclass
class PlanConfig(TrainConfig):
    """The memory plan of a training run (plan.py): per rank, the weights, gradients,
    optimizer state and activations at the peak of its first steps, counted by torch's
    tracker on fake tensors, and with a GPU's memory whether it fits and what would."""
    world_size: int = key(1, "the ranks the run will have (torchrun's nproc_per_node x nodes)",
                          at_least=1)
    gpu_memory: str = key("", "each GPU's memory, e.g. 80GiB or 24GB; '': this machine's GPU, "
                              "none on a CPU")
    json: bool = key(False, "print the plan as one JSON object")

    def __post_init__(self):
        super().__post_init__()
        if self.gpu_memory:
            parse_memory(self.gpu_memory)
        self.micro_steps(self.world_size)


@dataclass
class SampleConfig:
    """Sample text from a run's newest checkpoint, one checkpoint file, or GPT-2's weights."""
    init_from: str = key("resume", LOAD_HELP)
    out_dir: str = key("out", "a run's out_dir, or one checkpoint file")
    start: str = key("\n", "the prompt, or FILE:path to read it from a UTF-8 text file")
    num_samples: int = key(3, "how many samples", at_least=1)
    max_new_tokens: int = key(500, "tokens generated per sample", at_least=0)
    temperature: float = key(0.8, "below 1 sharpens the distribution, above 1 flattens it; "
                                  "for the likeliest token, --top_k=1", above=0)
    top_k: int = key(200, "sample among the k likeliest tokens only; 0 keeps them all", at_least=0)
    seed: int = key(1337, "the samples depend on it alone", at_least=0)
    device: str = key("auto", DEVICE_HELP)
    dtype: Dtype = key("auto", DTYPE_HELP)
    compile: bool = key(False, "torch.compile the model")

    def __post_init__(self):
        configurator.check(self)
        check_init_from(self.init_from, ("resume",))


@dataclass
class EvalConfig:
    """Evaluate a model: val loss, bits per byte and HellaSwag accuracy. For a checkpoint, the
    data and the evaluation settings not given are those it trained with, so that its val loss
    is the one train.py logged at its iter."""
    init_from: str = key("resume", LOAD_HELP)
    out_dir: str = key("out", "a run's out_dir, or one checkpoint file")
    data_dir: str = key("", "val loss and bits per byte on its val split; '': the checkpoint's "
                            "data (its data_dir or data_mix), none for GPT-2's weights")
    val_loss: bool = key(True, "evaluate the val loss and bits per byte; False: HellaSwag only")
    eval_iters: int = key(0, "eval_iters x batch_size windows of block_size tokens, as "
                             "train.py; 0: the checkpoint's, or train.py's default for GPT-2's "
                             "weights", at_least=0)
    batch_size: int = key(0, "windows per forward, and a HellaSwag batch is batch_size x "
                             "block_size tokens; 0: the checkpoint's, or train.py's default",
                          at_least=0)
    block_size: int = key(0, "0: the model's", at_least=0)
    hellaswag: bool = key(True, "score HellaSwag (skipped, saying so, when its file is neither "
                                "given, cached nor downloadable, unless set here)")
    hellaswag_path: str = key("", "HellaSwag's validation file; '' for the cached copy, "
                                  "downloaded once")
    device: str = key("auto", DEVICE_HELP)
    dtype: Dtype = key("auto", DTYPE_HELP)
    backend: Backend = key("", "'' picks nccl on CUDA, gloo on a CPU")
    dist_timeout_s: int = key(600, "how long a collective may wait", at_least=1)

    def __post_init__(self):
        configurator.check(self)
        if not (self.hellaswag or self.val_loss):
            raise UserError("hellaswag=False and val_loss=False leave nothing to evaluate: "
                            "keep one of them")
        check_init_from(self.init_from, ("resume",))


@dataclass
class PrepareConfig:
    """Tokenize a corpus into token files and meta.json (the format is tokenfile.py's): each
    non-empty document followed by end-of-text; empty ones are skipped."""
    dataset: str = key("openwebtext", (
        "'openwebtext' (its 21 archives from the hub, or a folder holding a copy of them); "
        "another hub dataset's train split; a .txt (one document), .jsonl, .json or .parquet "
        "file, compressed too (.gz, .bz2, .xz, .zst); a folder of them or a quoted glob; or "
        "'pystdlib', this Python's standard library, no network needed"))
    text_column: str = key("text", "the field or column that holds the text")
    hub_config: str = key("", "a hub dataset's subset, e.g. sample-10BT")
    streaming: bool = key(False, "stream a hub dataset (or local .parquet files) instead of "
                                 "storing it, for corpora larger than the disk")
    out_dir: str = key("", "'': data/<the dataset's name, or its file or folder stem>")
    tokenizer: str = key("gpt2", "a tiktoken encoding, 'byte', or a Hugging Face tokenizer: a "
                                 "hub name (owner/name) or a folder that AutoTokenizer reads")
    val_fraction: float = key(0.0005, "share of the documents for validation, rounded, at "
                                      "least one document", at_least=0, below=1)
    val_docs: int = key(0, "number of documents for validation; 0 (left out): val_fraction decides",
                        at_least=0)
    seed: int = key(2357, "chooses the validation documents", at_least=0)
    shard_tokens: int = key(0, "write shards of about this many tokens (whole documents), "
                               "each published when complete, so an interrupted run resumes; "
                               "0: one file per split", at_least=0)
    format: Literal["raw", "llmc"] = key(
        "raw", "raw: ddpgpt's (and nanoGPT's) headerless files; llmc: llm.c / modded-nanogpt "
               "shards, <name>_<split>_<index>.bin with llm.c's header")
    num_proc: int = key(None, "tokenizer processes, and for OpenWebText the processes that "
                              "count its archives (default: one per core)", at_least=1,
                        factory=os.cpu_count)

    def __post_init__(self):
        configurator.check(self)


@dataclass
class IndexConfig:
    """Make the document index of a data folder's splits (the format is docindex.py's), which
    sampling='documents' reads, for token files that have none: nanoGPT's, llm.c's, ddpgpt
    folders made before prepare.py wrote it."""
    data_dir: str = key("data/openwebtext", "the folder that holds the token files")
    eot_token: int = key(-1, "the id that ends each document, for files without meta.json "
                             f"(nanoGPT's, llm.c's); -1: GPT-2's {GPT2_EOT}. Where meta.json gives "
                             "one, that one (another is refused)", at_least=-1)


@dataclass
class ExportConfig:
    """Export a checkpoint as a Hugging Face GPT-2 folder (Qwen3 for arch='modern') or one file."""
    out_dir: str = key("out", "a run's out_dir (its newest checkpoint), or one checkpoint")
    to: str = key("", "the folder to write, or a file ending in .pt; it must not exist")
    POSITIONAL = ("out_dir", "to")


@dataclass
class PlotConfig:
    """Draw runs' curves from their metrics.jsonl into a PNG: loss, val loss, lr and tokens/s."""
    out_dir: str = key("out", "a run's out_dir; several, comma-separated, for one figure")
    to: str = key("", "the PNG; '': out_dir/curves.png for one run, else curves.png", was="out")
    smooth: int = key(0, "steps in the moving average; 0: a fiftieth of the run", at_least=0)
    title: str = key("", "a title above the panels")
    POSITIONAL = ("out_dir",)


@dataclass
class CompareConfig:
    """Compare two runs step by step: did they read the same global batches (and losses)?"""
    out_dir: str = key("", "the two runs' out_dirs, comma-separated")
    losses: bool = key(False, "also compare the losses, exactly")
    POSITIONAL = ("out_dir",)
