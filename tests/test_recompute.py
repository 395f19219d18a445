"""activation_checkpointing and loss_chunks under torchrun (gloo, CPU), as a user runs them:
full and selective train with the losses of none bit for bit in float32 with dropout (the
recompute must draw its masks again), and selective without (where the CPU runs the fused
attention kernel it keeps), under ddp and fsdp, with the loss in one piece and in chunks; a run
resumes exactly under another mode than the one that saved its checkpoint; the loss in chunks
trains as in one piece but for the sums' rounding."""
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

# each parallel with dropout, and one without; both architectures (gpt2's head tied to its
# embeddings); the loss in one piece, and in chunks (loss_chunks) under each parallel:
# (parallel, dropout, arch, loss_chunks)
CASES = {"ddp-dropout": ("ddp", 0.1, "gpt2", 1), "fsdp-dropout": ("fsdp", 0.1, "modern", 3),
         "ddp": ("ddp", 0.0, "gpt2", 2)}
# the modes each case compares with none. full recomputes a block whole: what can go wrong is
# its dropout masks, drawn again (the dropout cases). selective keeps the fused attention
# kernel's outputs, and a CPU runs that kernel only without dropout (with dropout, attention is
# computed op by op): every case.
COMPARED = {"ddp-dropout": ("full", "selective"), "fsdp-dropout": ("full", "selective"),
            "ddp": ("selective",)}
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
    """{(case, mode): out_dir} of every case trained STEPS steps on 2 ranks in none and in
    the modes it compares with none."""
    root = tmp_path_factory.mktemp("recompute")
    out = {(case, mode): str(root / f"{case}-{mode}") for case in CASES
           for mode in ("none", *COMPARED[case])}
    for (case, mode), out_dir in out.items():
        torchrun(2, "train.py", *train_args(corpus, out_dir, case, mode), env=session_env)
    return out


def losses(out_dir):
    rows = steps(out_dir)
    return [(rows[i]["batch_fp"], rows[i]["loss"], rows[i]["grad_norm"]) for i in sorted(rows)]


def val_losses(out_dir):
    return [(r["iter"], r["val_loss"]) for r in evals(out_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_full_and_selective_train_as_none_bit_for_bit(runs, case):
    expected = losses(runs[case, "none"])
    assert len(expected) == STEPS
    for mode in COMPARED[case]:
        assert losses(runs[case, mode]) == expected, mode
        # the evaluation, without gradients, goes through the checkpointed blocks too
        assert val_losses(runs[case, mode]) == val_losses(runs[case, "none"]), mode


@pytest.mark.slow
def test_a_run_resumes_exactly_under_another_mode(runs, corpus, tmp_path, env):
    """fsdp's checkpoint folder written under full, resumed under selective, and ddp's file
    written under selective, resumed under none: each goes on as the run that never stopped."""
    for case, saved_by, resumed_in in (("fsdp-dropout", "full", "selective"),
                                       ("ddp-dropout", "selective", "none")):
        out = tmp_path / case
        source = checkpoint.path_for(runs[case, saved_by], STEPS // 2,
                                     folder=CASES[case][0] == "fsdp")
        resumed_from(source, out, 2, train_args(corpus, out, case, resumed_in), STEPS // 2, env)
        assert losses(out) == losses(runs[case, "none"])[STEPS // 2:]


@pytest.mark.slow
def test_the_loss_in_chunks_trains_as_in_one_piece_but_for_rounding(runs, corpus, tmp_path, env):
    """The ddp case's loss in 2 chunks against the same run with the loss in one piece: the
    same batches, losses and gradient norms within float32's rounding of the sums."""
    one_piece = tmp_path / "one_piece"
    torchrun(2, "train.py", *train_args(corpus, one_piece, "ddp", "none", "--loss_chunks=1"),
             env=env)
    chunked, whole = losses(runs["ddp", "none"]), losses(one_piece)
    assert [fp for fp, _, _ in chunked] == [fp for fp, _, _ in whole]
    for (_, loss, norm), (_, loss1, norm1) in zip(chunked, whole):
        assert loss == pytest.approx(loss1, rel=1e-5) and norm == pytest.approx(norm1, rel=1e-4)
    assert val_losses(runs["ddp", "none"]) == pytest.approx(val_losses(one_piece), rel=1e-5)


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
