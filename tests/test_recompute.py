"""activation_checkpointing and loss_chunks under torchrun (gloo, CPU), as a user runs them:
full and selective train with the losses of none bit for bit in float32, under fsdp with dropout
(the recompute must draw its masks again) and under ddp without (where the CPU runs the fused
attention kernel that selective keeps), with the loss in chunks and in one piece; a run resumes
exactly under another mode than the one that saved its checkpoint; the loss in chunks trains as
in one piece but for the sums' rounding."""
import collections

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import TINY, evals, resumed_from, steps, torchrun
from ddpgpt import checkpoint, configurator, recompute
from ddpgpt.errors import UserError
from ddpgpt.model import GPT, GPTConfig, rotary
from ddpgpt.settings import TrainConfig

# (parallel, dropout, arch, loss_chunks): both architectures (gpt2's head tied to its
# embeddings). full recomputes a block whole: what can go wrong is its dropout masks, drawn
# again, which do not depend on the parallel. selective keeps the fused attention kernel's
# outputs, and a CPU runs that kernel only without dropout (with dropout, attention is computed
# op by op): a case of each.
CASES = {"fsdp-dropout": ("fsdp", 0.1, "modern", 3), "ddp": ("ddp", 0.0, "gpt2", 1)}
MODES = ("none", "selective", "full")  # each resumed run (RESUMED) after the run it resumes
# {(case, mode): the mode whose run's checkpoint at STEPS // 2 it resumes}: an fsdp folder, and
# a ddp file saved by blocks that were not wrapped in a checkpoint
RESUMED = {("fsdp-dropout", "full"): "selective", ("ddp", "selective"): "none"}
STEPS = 4  # saving at STEPS // 2 and STEPS


def train_args(corpus, out, case, mode, *extra):
    parallel, dropout, arch, loss_chunks = CASES[case]
    return [f"--data_dir={corpus}", f"--out_dir={out}", *TINY, "--eval_iters=1",
            "--gradient_accumulation_steps=4", f"--max_iters={STEPS}",
            f"--eval_interval={STEPS // 2}", f"--parallel={parallel}", f"--dropout={dropout}",
            f"--arch={arch}", f"--activation_checkpointing={mode}",
            f"--loss_chunks={loss_chunks}", *extra]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory, session_env):
    """{(case, mode): out_dir} of every case in every mode on 2 ranks: STEPS steps, or those
    after STEPS // 2 of a run resumed from another mode's (RESUMED)."""
    root = tmp_path_factory.mktemp("recompute")
    out = {}
    for case in CASES:
        for mode in MODES:
            out[case, mode] = root / f"{case}-{mode}"
            args = train_args(corpus, out[case, mode], case, mode)
            if (case, mode) in RESUMED:
                source = checkpoint.path_for(out[case, RESUMED[case, mode]], STEPS // 2,
                                             folder=CASES[case][0] == "fsdp")
                resumed_from(source, out[case, mode], 2, args, STEPS // 2, session_env)
            else:
                torchrun(2, "train.py", *args, env=session_env)
    return out


def losses(out_dir):
    rows = steps(out_dir)
    return [(rows[i]["batch_fp"], rows[i]["loss"], rows[i]["grad_norm"]) for i in sorted(rows)]


def val_losses(out_dir):
    return [(r["iter"], r["val_loss"]) for r in evals(out_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_full_and_selective_train_as_none_bit_for_bit(runs, case):
    """From the step each run starts at: a resumed one's halfway."""
    expected, evaluated = losses(runs[case, "none"]), val_losses(runs[case, "none"])
    assert len(expected) == STEPS
    for mode in ("full", "selective"):
        start = STEPS // 2 if (case, mode) in RESUMED else 0
        assert losses(runs[case, mode]) == expected[start:], mode
        # the evaluation, without gradients, goes through the checkpointed blocks too
        assert val_losses(runs[case, mode]) == [e for e in evaluated if e[0] >= start], mode


@pytest.mark.slow
def test_a_run_resumes_exactly_under_another_mode(runs):
    """fsdp's checkpoint folder written under selective, resumed under full, and ddp's file
    written under none, resumed under selective: each goes on as the run that never stopped."""
    for (case, mode), saved_by in RESUMED.items():
        assert losses(runs[case, mode]) == losses(runs[case, saved_by])[STEPS // 2:], case


@pytest.mark.slow
def test_the_loss_in_chunks_trains_as_in_one_piece_but_for_rounding(runs, corpus, tmp_path, env):
    """The ddp case's run under none, its loss in one piece, against the same run with the loss
    in 2 chunks: the same batches, losses and gradient norms within float32's rounding of the
    sums."""
    out = tmp_path / "chunked"
    torchrun(2, "train.py", *train_args(corpus, out, "ddp", "none", "--loss_chunks=2"), env=env)
    chunked, whole = losses(out), losses(runs["ddp", "none"])
    assert len(chunked) == STEPS and [fp for fp, _, _ in chunked] == [fp for fp, _, _ in whole]
    for (_, loss, norm), (_, loss1, norm1) in zip(chunked, whole):
        assert loss == pytest.approx(loss1, rel=1e-5) and norm == pytest.approx(norm1, rel=1e-4)
    assert val_losses(out) == pytest.approx(val_losses(runs["ddp", "none"]), rel=1e-5)


class MadeBy(TorchDispatchMode):
    """{storage: the operation that first output it} of the operations run under it."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.setdefault(StorageWeakRef(t.untyped_storage()), op.__name__)
        return out


FUSED = "_scaled_dot_product_flash_attention_for_cpu.default"  # the CPU's attention kernel
# {(arch, dropout): the outputs a block keeps under selective beside its input, on the CPU, by
# the operation that made them}: every Linear's matmul (addmm: GPT-2's have biases) and the
# fused attention kernel's output and log-sum-exp, where the CPU runs it: without dropout
KEPT = {("gpt2", 0.0): {"addmm.default": 4, FUSED: 2}, ("modern", 0.0): {"mm.default": 7, FUSED: 2},
        ("gpt2", 0.1): {"addmm.default": 4}}


@pytest.mark.parametrize("arch, dropout", KEPT)
def test_selective_keeps_a_blocks_matmul_and_fused_attention_outputs_alone(arch, dropout):
    """What a block's forward made that is still alive after it, its output aside: what it
    keeps for its backward."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64,
                          arch=arch, dropout=dropout))
    recompute.apply(model, "selective", 1)
    block, x = model.transformer.h[0], torch.randn(2, 16, 32, requires_grad=True)
    rope = rotary(16, 16, 1e4, "cpu") if arch == "modern" else ()
    before = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), x, *rope)}
    with MadeBy() as mode:
        y = block(x, *rope)
    kept = collections.Counter(op for ref, op in mode.made.items() if not ref.expired() and
                               ref not in before | {StorageWeakRef(y.untyped_storage())})
    assert kept == KEPT[arch, dropout]


def test_an_unknown_mode_is_a_clear_error():
    with pytest.raises(UserError, match="activation_checkpointing='some' is not one of "
                                        "'none', 'full', 'selective'"):
        configurator.parse(TrainConfig, ["--activation_checkpointing=some"], "train.py")


def test_fewer_than_one_loss_chunk_is_a_clear_error():
    with pytest.raises(UserError, match="loss_chunks=0 must be at least 1"):
        configurator.parse(TrainConfig, ["--loss_chunks=0"], "train.py")
