"""Muon over the ranks (ddpgpt/muon.py): the owners of the matrices, Newton-Schulz's dtype, one
process equal to torch.optim.Muon bit for bit, and under torchrun (gloo) ddp on 2 ranks as on 1
process, fsdp as ddp, ddp's and fsdp's exact resumes, ddp's file resumed on one process and
under fsdp on 3 ranks, fsdp's folder on one process and under ddp on 4, and a rank killed
mid-run under fsdp."""
import copy
import os

import pytest
import torch

from conftest import (ROOT, TINY, batches_and_losses, evals, python, resumed_from, rows_so_far,
                      steps, torchrun)
from test_fsdp import killing_rank_1, relative_difference
from ddpgpt import checkpoint, muon, optim
from ddpgpt.errors import UserError
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import TrainConfig

# the ranks sum the gradients in other orders than one process does; in float32 Newton-Schulz
# (muon_ns_dtype) that difference stays at float32's rounding, where bfloat16 could round a
# last-bit difference of its input to the next bfloat16 (1.07e-5 measured over these 8 steps,
# when they took 4 micro-steps)
RTOL = 1e-5
# the quick start's blocks' matrices at n_embd=128 (GPT-2's block), and GPT-2 124M's
QUICKSTART = [(384, 128), (128, 128), (512, 128), (128, 512)] * 4
GPT2_124M = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12


def cost(shape):
    return shape[0] * shape[1] * min(shape)


@pytest.mark.parametrize("shapes", [QUICKSTART, GPT2_124M, [(3, 5)] * 3 + [(64, 64)]],
                         ids=["quickstart", "gpt2-124M", "fewer than the ranks"])
def test_the_owners_are_balanced_by_cost_and_deterministic(shapes):
    for world in (1, 2, 4, 8):
        owner = muon.owners(shapes, world)
        assert owner == muon.owners(list(shapes), world)  # a function of its inputs alone
        assert set(owner) <= set(range(world))
        load = [sum(cost(s) for s, o in zip(shapes, owner) if o == r) for r in range(world)]
        total, largest = sum(map(cost, shapes)), max(map(cost, shapes))
        assert max(load) <= total / world + largest
        if len(set(shapes)) <= 4 and len(shapes) % world == 0 and len(shapes) >= 4 * world:
            assert max(load) <= 1.1 * total / world  # many matrices: even shares
    assert muon.owners([(4, 4), (8, 8), (2, 2)], 2) == [1, 0, 1]  # costliest first


def small_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64,
                         bias=False, arch="modern"))


def train(model, optimizer, steps_in_all, start=0):
    """Losses of steps_in_all steps on fixed random batches (from step start on)."""
    cfg = TrainConfig(optimizer="muon", learning_rate=2e-3, muon_lr=0.04, warmup_iters=2,
                      lr_decay_iters=10, min_lr=2e-4, muon_weight_decay=0.1)
    losses = []
    for it in range(start, start + steps_in_all):
        optim.set_lr(optimizer, cfg, it)
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(it))
        _, loss = model(x, x.roll(1, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def muon_adamw(model, muon_class):
    cfg = TrainConfig(optimizer="muon", muon_weight_decay=0.1)
    matrices = optim.muon_parameters(model, cfg.muon_params)
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return optim.MuonAdamW(muon_class(matrices, lr=0.04, weight_decay=0.1),
                           optim.adamw(rest, 0.1, 2e-3, (0.9, 0.95), "cpu"))


def test_on_one_process_it_is_torch_muon_bit_for_bit_and_takes_its_state():
    ours, torchs = small_model(), small_model()
    a, b = muon_adamw(ours, muon.DistributedMuon), muon_adamw(torchs, torch.optim.Muon)
    assert train(ours, a, 4) == train(torchs, b, 4)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), torchs.parameters()))
    # torch.optim.Muon's state (an earlier version's checkpoint) goes on in ours, and back
    # (copies: load_state_dict keeps the tensors it is given)
    state = copy.deepcopy(b.state_dict())
    assert set(state["muon"]["state"][0]) == {"momentum_buffer"}
    a.load_state_dict(state)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert train(ours, a, 4, start=4) == train(torchs, b, 4, start=4)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), torchs.parameters()))


def test_the_tail_average_starts_at_the_tail_and_the_run_ends_with_it():
    """ema_tail: from the tail's first step (the last half of 6 here) the optimizer keeps each
    weight's average, which use_average makes the weights; before the tail, and with the tail
    off, it keeps none (a stale one, a resume's with the tail off, is dropped)."""
    model = small_model()
    cfg = TrainConfig(optimizer="muon", max_iters=6, ema_tail=0.5, ema_decay=0.75)
    optimizer, expected = optim.make(cfg, model, "cpu"), None
    for it in range(6):
        train(model, optimizer, 1, start=it)
        optim.average(optimizer, cfg, it)
        now = [p.detach().clone() for p in model.parameters()]
        if it >= 3:
            expected = now if it == 3 else [0.75 * e + 0.25 * w for e, w in zip(expected, now)]
        kept = ["ema" in state for _, state in optim.weights_and_states(optimizer)]
        assert len(kept) == len(now) and set(kept) == {it >= 3}
    optim.use_average(optimizer)
    assert all(torch.allclose(p, e, rtol=0, atol=1e-6)  # lerp rounds otherwise
               for p, e in zip(model.parameters(), expected))
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), now))
    optim.average(optimizer, TrainConfig(optimizer="muon", max_iters=6), 6)
    assert not any("ema" in state for _, state in optim.weights_and_states(optimizer))


def test_newton_schulz_runs_in_the_dtype_of_muon_ns_dtype_and_auto_where_it_is_native():
    cfg = TrainConfig(optimizer="muon", muon_ns_dtype="float32")
    assert optim.make(cfg, small_model(), "cpu").muon.ns_dtype == torch.float32
    assert muon.ns_dtype("bfloat16", "cpu") == torch.bfloat16
    # auto on this CPU, checked against the kernel's own flags where Linux shows them
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
        native = bool(flags & {"avx512_bf16", "amx_bf16"})
        assert muon.ns_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    update = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    group = muon.DistributedMuon([torch.zeros(48, 16)]).param_groups[0]
    exact = muon.newton_schulz(update, group, torch.float64)
    # float32 within its rounding of float64's result (5e-7 measured), bfloat16 within its own
    # (8e-3: 8 bits of mantissa)
    for dtype, within in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        ortho = muon.newton_schulz(update, group, dtype)
        assert ortho.dtype == dtype and ortho.shape == update.shape
        assert (ortho.double() - exact).abs().max() <= within


def test_polar_express_takes_more_singular_values_near_1_than_torchs_coefficients():
    """An update whose singular values span 0.01 to 1: after the same 5 steps, Polar Express's
    are within 0.15 of 1, torch's within 0.32 only (measured: 0.14 and 0.32)."""
    g = torch.Generator().manual_seed(0)
    left, right = torch.linalg.qr(torch.randn(64, 32, generator=g))[0], \
        torch.linalg.qr(torch.randn(32, 32, generator=g))[0]
    update = left @ torch.diag(torch.logspace(-2, 0, 32)) @ right.T
    group = muon.DistributedMuon([torch.zeros(64, 32)]).param_groups[0]
    off = [(torch.linalg.svdvals(muon.newton_schulz(update, group, torch.float32, polar)) - 1)
           .abs().max() for polar in (False, True)]
    assert off[1] <= 0.15 < 0.3 <= off[0]


def test_normuon_evens_the_rows_steps_and_keeps_the_updates_norm():
    """muon_beta2: a step's rows (a gradient whose rows' scales span 0.1 to 3) all move by the
    same amount, and the whole by the orthogonalised update's norm, as without NorMuon; from
    torch.optim.Muon's state (an earlier checkpoint's, without the second moment) too."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(48, 16, generator=g) * torch.linspace(0.1, 3, 48)[:, None]
             for _ in range(2)]
    theirs = torch.optim.Muon([torch.nn.Parameter(torch.zeros(48, 16))], lr=0.1, weight_decay=0)
    theirs.param_groups[0]["params"][0].grad = grads[0]
    theirs.step()
    for state in (None, theirs.state_dict()):
        w = torch.nn.Parameter(torch.randn(48, 16, generator=g))
        plain, ours = (muon.DistributedMuon([w], lr=0.1, weight_decay=0, ns_dtype=torch.float32,
                                            beta2=beta2) for beta2 in (0.0, 0.95))
        for opt in (plain, ours):
            if state is not None:
                opt.load_state_dict(copy.deepcopy(state))
        moved = []
        for opt in (plain, ours):
            before = w.detach().clone()
            w.grad = grads[1].clone()
            opt.step()
            moved.append(before - w.detach())
            w.data.copy_(before)
        rows = moved[1].norm(dim=1)
        assert rows.std() / rows.mean() < 1e-4 < 0.3 < (lambda r: r.std() / r.mean())(
            moved[0].norm(dim=1))
        assert torch.allclose(moved[1].norm(), moved[0].norm(), rtol=1e-5)
        assert set(ours.state[w]) == {"momentum_buffer", "second_moment"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_cautious_weight_decay_decays_only_where_the_update_has_the_weights_sign(optimizer):
    """A step with cautious_weight_decay against the same step without any decay (the same
    weights, state and batch): the weights differ by lr x weight_decay x the weight exactly
    where the update (the difference the undecayed step made) has the weight's sign, after
    two steps so that AdamW's sign is its first moment's, not the gradient's."""
    muon_only = dict(muon_weight_decay=0.1, muon_ns_dtype="float32") if optimizer == "muon" \
        else {}
    cfg = TrainConfig(optimizer=optimizer, cautious_weight_decay=True, **muon_only)
    model = small_model()
    opt = optim.make(cfg, model, "cpu")
    train(model, opt, 2)
    twin = copy.deepcopy(model)
    plain = optim.make(cfg, twin, "cpu")
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    for group in plain.param_groups:
        group["weight_decay"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1, start=2)
    train(twin, plain, 1, start=2)
    decayed, kept = 0, 0
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for group, twin_group in zip(opt.param_groups, plain.param_groups):
        for p, q in zip(group["params"], twin_group["params"]):
            w = before[index[id(p)]]
            mask = (w - q) * w >= 0
            expected = q - group["lr"] * group["weight_decay"] * w * mask
            assert torch.allclose(p, expected, rtol=0, atol=1e-7)
            if group["weight_decay"]:
                decayed, kept = decayed + int(mask.sum()), kept + int((~mask).sum())
    assert decayed and kept, "some weights are decayed and some are not"


def test_matrices_sharded_other_than_by_rows_over_every_rank_are_refused():
    """In one's own loop a model can be sharded otherwise than parallel=fsdp does it (a real
    one-process gloo group here)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        rows = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
        muon.DistributedMuon([rows])
        columns = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)]))
        with pytest.raises(UserError, match=r"sharded by rows over all the ranks .* a \(8, 4\) "
                                            r"matrix here is \(Shard\(dim=1\),\) over a mesh"):
            muon.DistributedMuon([rows, columns])
    finally:
        torch.distributed.destroy_process_group()


# recipe two's pieces on: Polar Express, NorMuon, cautious weight decay (Muon's and AdamW's)
# and the weights' tail average from step 2 (so that the checkpoint at 4 holds it), whose first
# value still counts for 0.9^5 of the end's (so that a resume that lost it would show); 12
# micro-steps, which 1, 2, 3 and 4 ranks divide
ARGS = [*TINY, "--arch=modern", "--optimizer=muon", "--muon_ns_dtype=float32",
        "--gradient_accumulation_steps=12", "--eval_interval=4", "--max_iters=8",
        "--grad_clip=0.1", "--muon_coefficients=polar_express", "--cautious_weight_decay=True",
        "--muon_weight_decay=0.1", "--muon_beta2=0.95", "--ema_tail=0.75", "--ema_decay=0.9"]


def end_difference(a, b):
    """The relative difference of two runs' final val losses: of the weights' averages they
    ended with."""
    return abs(evals(a)[-1]["val_loss"] / evals(b)[-1]["val_loss"] - 1)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory, session_env):
    """Out_dirs of the same 8 steps: 'one' process, 'ddp' and 'fsdp' on 2 ranks, saving at 4
    and 8."""
    root = tmp_path_factory.mktemp("muon")
    python("train.py", f"--data_dir={corpus}", *ARGS, f"--out_dir={root / 'one'}", env=session_env)
    for kind in ("ddp", "fsdp"):
        torchrun(2, "train.py", f"--data_dir={corpus}", *ARGS, f"--out_dir={root / kind}",
                 f"--parallel={kind}", env=session_env)
    return {kind: str(root / kind) for kind in ("one", "ddp", "fsdp")}


@pytest.mark.slow
def test_ddp_on_2_ranks_trains_as_one_process_and_fsdp_as_ddp(runs):
    assert sorted(steps(runs["one"])) == sorted(steps(runs["fsdp"])) == list(range(8))
    assert relative_difference(runs["one"], runs["ddp"]) <= RTOL
    assert relative_difference(runs["ddp"], runs["fsdp"]) <= RTOL
    assert end_difference(runs["one"], runs["ddp"]) <= RTOL
    assert end_difference(runs["ddp"], runs["fsdp"]) <= RTOL


@pytest.mark.slow
def test_muon_resumes_bit_for_bit_on_2_ranks_and_on_1_reads_the_same_batches(runs, corpus,
                                                                            tmp_path, env):
    """ddp's file at 4 resumed on 2 ranks repeats the uninterrupted run bit for bit, Muon's
    momentum saved in it; on one process, the same batches and the same losses but for the
    order of the sums (the one process accumulates what DDP's all-reduce adds)."""
    half = resumed(checkpoint.path_for(runs["ddp"], 4), tmp_path / "half", 2, "ddp", corpus, env)
    assert sorted(steps(half)) == list(range(4, 8))
    assert batches_and_losses(runs["ddp"], range(4, 8)) == batches_and_losses(half)
    assert evals(runs["ddp"])[-1] == evals(half)[-1]
    state, _ = checkpoint.load_latest(runs["ddp"])
    assert state["model_args"]["arch"] == "modern" and set(state["optimizer"]) == {"muon", "adamw"}
    assert state["optimizer"]["muon"]["state"], "Muon's momentum buffers are saved"
    # the run ends with its weights' average, resumed from the checkpoint at 4 bit for bit
    ended, ended_too = (checkpoint.model_state(checkpoint.load_latest(out)[0])
                        for out in (runs["ddp"], half))
    assert all(torch.equal(ended[name], ended_too[name]) for name in ended)
    one = resumed(checkpoint.path_for(runs["ddp"], 4), tmp_path / "one", 1, "ddp", corpus, env)
    assert sorted(steps(one)) == list(range(4, 8)) and relative_difference(runs["ddp"], one) <= RTOL
    assert end_difference(runs["ddp"], one) <= RTOL


@pytest.fixture(scope="module")
def killed(runs, corpus, tmp_path_factory, session_env):
    """runs['fsdp'] again, rank 1 killed (kill -9) after the save at 4: torchrun restarts both
    ranks, which resume from Muon's sharded momentum (the checkpoint folder at 4). Rank 0's
    reads take 200 ms more (slow_rank.py), so that the run is still going when the kill comes.
    Its out_dir, and what it printed. The resume of fsdp's folder on 2 ranks that two tests
    check (bit for bit, and the momentum it saves again), made once."""
    root = tmp_path_factory.mktemp("killed")
    out = str(root / "killed")
    said = killing_rank_1(
        os.path.join(ROOT, "tests", "slow_rank.py"),
        [f"--data_dir={corpus}", *ARGS, f"--out_dir={out}", "--parallel=fsdp",
         "--init_from=auto"], dict(session_env, SLOW_RANK="0"),
        lambda: checkpoint.list_checkpoints(out) and
        any(r.get("iter", -1) >= 5 for r in rows_so_far(out)), root / "log")
    return out, said


@pytest.mark.slow
def test_fsdp_resumes_bit_for_bit_and_its_folder_on_one_process(runs, killed, corpus, tmp_path,
                                                                 env):
    # fsdp's folder at 4 resumed on 2 ranks under fsdp (killed's restart): steps 4 to 8 are
    # the uninterrupted run's
    out, said = killed
    assert f"resuming from {checkpoint.path_for(out, 4, folder=True)} (iter 4)" in said
    assert batches_and_losses(runs["fsdp"], range(4, 8)) == batches_and_losses(out, range(4, 8))
    assert evals(runs["fsdp"])[-1] == evals(out)[-1]  # its weights' average, resumed
    state = checkpoint.read(checkpoint.path_for(out, 8, folder=True))[0]
    shapes = {i: tuple(p.shape) for i, p in enumerate(
        p for n, p in GPT(GPTConfig(**state["model_args"])).named_parameters()
        if n.startswith("transformer.h.") and p.dim() == 2)}
    momentum = state["optimizer"]["muon"]["state"]
    assert {i: tuple(v["momentum_buffer"].shape) for i, v in momentum.items()} == shapes
    assert {i: tuple(v["ema"].shape) for i, v in momentum.items()} == shapes
    # Muon's sharded momentum read whole: one process goes on as the one-process run
    one = resumed(checkpoint.path_for(runs["fsdp"], 4, folder=True), tmp_path / "one", 1,
                  "ddp", corpus, env)
    assert relative_difference(runs["one"], one) <= RTOL
    assert end_difference(runs["one"], one) <= RTOL


def resumed(source, out, nproc, kind, corpus, env):
    """The out_dir out of a run that resumes from a copy of source (a checkpoint at iter 4) to
    8, on nproc ranks under kind (conftest.resumed_from)."""
    args = [f"--data_dir={corpus}", *ARGS, f"--out_dir={out}", f"--parallel={kind}"]
    return resumed_from(source, out, nproc, args, 4, env)


@pytest.mark.slow
def test_ddp_checkpoints_resume_under_fsdp_on_3_ranks_and_fsdp_folders_under_ddp_on_4(
        runs, corpus, tmp_path, env):
    """Muon's momentum and the average: whole in ddp's file (2 ranks), each of 3 ranks takes its
    rows under fsdp (uneven shards); sharded in fsdp's folder (2 ranks), each of 4 ddp ranks
    reads them whole."""
    under_fsdp = resumed(checkpoint.path_for(runs["ddp"], 4), tmp_path / "fsdp", 3, "fsdp",
                         corpus, env)
    under_ddp = resumed(checkpoint.path_for(runs["fsdp"], 4, folder=True), tmp_path / "ddp", 4,
                        "ddp", corpus, env)
    assert relative_difference(runs["ddp"], under_fsdp) <= RTOL
    assert relative_difference(runs["fsdp"], under_ddp) <= RTOL
    assert end_difference(runs["ddp"], under_fsdp) <= RTOL
    assert end_difference(runs["fsdp"], under_ddp) <= RTOL


@pytest.mark.slow
def test_fsdp_recovers_from_a_rank_killed_mid_run_bit_for_bit(runs, killed):
    """kill -9 of rank 1 after the save at 4 (the killed fixture): torchrun restarts both ranks,
    which resume from Muon's sharded momentum and repeat the uninterrupted run."""
    out, said = killed
    assert f"resuming from {checkpoint.path_for(out, 4, folder=True)} (iter 4)" in said
    assert batches_and_losses(runs["fsdp"], range(8)) == batches_and_losses(out, range(8))
