"""Muon over the ranks: each matrix's update (its Nesterov momentum orthogonalised by
Newton-Schulz) is computed once per step, by one rank, its owner, on the whole matrix, and
reaches every rank that holds part of that matrix.

The owners (owners()): a function of the Muon matrices' shapes, in the optimizer's order, and
the world size alone, so every rank computes the same assignment without talking. Newton-Schulz
on an r x c matrix costs about r * c * min(r, c) multiply-adds; the matrices are taken from the
costliest down (the earlier one first among equals) and each goes to the rank with the least
cost so far (the lower rank among equals): greedy longest-processing-time, whose most loaded
rank has at most total / N plus the largest single matrix's cost.

Under ddp every rank holds the whole, all-reduced gradient. Every rank updates the momentum of every
matrix (elementwise and cheap), so the optimizer state is whole and the same on every rank, and
checkpoints are torch.optim.Muon's, under the same key ('momentum_buffer'): one written by
torch.optim.Muon resumes, and the other way round. Each owner alone makes the Nesterov updates of
its matrices and orthogonalises them, and one all_gather_single per step shares the results:
each rank's, flattened into one bucket of Newton-Schulz's dtype (muon_ns_dtype: bfloat16, torch's,
or float32) padded to the largest rank's, so a rank receives (N - 1) x that bucket: 2 bytes a Muon
parameter at most in bfloat16 (4 in float32), plus the padding (bytes_per_step()). Then every rank
applies each update with torch.optim.Muon's learning rate adjustment and decoupled weight decay. On
one process, in bfloat16, it is torch.optim.Muon, bit for bit.

Under fsdp each rank holds Shard(0) of each matrix, its weights, gradient and momentum: rank k holds
rows [k * ceil(r / N), (k + 1) * ceil(r / N)) (torch.chunk's rows, which DTensor's Shard(0) keeps).
The momentum is updated on the local rows. Two all_to_all_single per step then do the rest: each
rank sends its rows of the Nesterov update of each matrix to that matrix's owner (float32: 4 bytes a
Muon parameter over all ranks together), the owner orthogonalises the whole matrix and sends each
rank its rows of the result back (in Newton-Schulz's dtype: 2 bytes a parameter in bfloat16); each
rank applies them to its rows. Gather-to-owner and scatter rather than an all_gather, which under
fsdp would bring every whole matrix to every rank: N times the bytes, and the memory fsdp is there
to save. The momentum is a DTensor like the weights, so a checkpoint folder holds it sharded, as
AdamW's moments (sharded.py), and it resumes at any world size and under ddp."""
import functools

import torch
import torch.distributed as dist
# torch's learning-rate adjustment (private, of the torch that requirements.txt pins), so that
# the update is torch.optim.Muon's: a test checks bit for bit
from torch.optim._muon import _adjust_lr

from ddpgpt import parallel
from ddpgpt.errors import UserError

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# muon_coefficients='polar_express': one (a, b, c) per iteration, from Amsel, Persson, Musco and
# Gower's Polar Express (arXiv 2505.16932; 5 iterations, safety factor 2e-2, cushion 2), for a
# spectral norm of at most 1/1.01 at the start: each step's polynomial is the best for the
# interval of singular values the previous step leaves, so 5 steps bring more of them near 1
# than 5 of torch's one polynomial
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
POLAR_MARGIN = 1.01


def ns_dtype(setting, device_type):
    """The dtype of Newton-Schulz's matmuls for muon_ns_dtype (auto, or a name in NS_DTYPES).
    auto: bfloat16 where the device multiplies it natively, float32 where it would be emulated
    (a CPU without AVX512-BF16 or AMX turns each bfloat16 matmul into float32 work plus
    conversions: slower than float32, and less exact). CUDA: torch's own test, without
    emulation (compute capability 8.0 and up). A CPU: torch.cpu.get_capabilities(), cpuinfo's
    flags of this CPU on any OS, rather than /proc/cpuinfo (Linux only) or
    torch.backends.cpu.get_cpu_capability(), which says AVX512 for CPUs that have it without
    BF16. Others (ARM CPUs, mps) take float32, which is exact everywhere, until measured."""
    if setting != "auto":
        return NS_DTYPES[setting]
    native = False
    if device_type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    elif device_type == "cpu":
        caps = torch.cpu.get_capabilities()
        native = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return torch.bfloat16 if native else torch.float32


def owners(shapes, world_size):
    """The owner rank of each matrix (shapes: (rows, columns) in the optimizer's order),
    balanced by Newton-Schulz cost (the module's docstring)."""
    cost = [rows * cols * min(rows, cols) for rows, cols in shapes]
    load, owner = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -cost[i]):
        rank = min(range(world_size), key=load.__getitem__)
        owner[i] = rank
        load[rank] += cost[i]
    return owner


def bytes_per_step(shapes, world_size, dtype=torch.bfloat16):
    """What one rank receives in a ddp step's all_gather: N - 1 buckets of the largest, of
    updates in dtype, Newton-Schulz's."""
    owner = owners(shapes, world_size)
    bucket = max(sum(r * c for (r, c), o in zip(shapes, owner) if o == rank)
                 for rank in range(world_size))
    return (world_size - 1) * bucket * dtype.itemsize


class DistributedMuon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz runs once per matrix over the ranks (the module's
    docstring), for parameters that are whole (ddp, one process) or Shard(0) DTensors (fsdp).
    Its settings, param_groups and state are torch.optim.Muon's. Four more are attributes, not
    groups' settings, so that a checkpoint does not hold them and a resume takes the run's:
    ns_dtype, the dtype of Newton-Schulz's matmuls (bfloat16, torch's, by default: ns_dtype());
    polar_express, Polar Express's coefficients (POLAR_EXPRESS) rather than the group's
    ns_coefficients; cautious, weight decay only where the update has the weight's sign
    (cautious_decay()); beta2, NorMuon's (normalised_rows(); 0: off). A class: torch's
    optimizer API is one."""

    def __init__(self, params, ns_dtype=torch.bfloat16, polar_express=False, cautious=False,
                 beta2=0.0, **settings):
        super().__init__(params, **settings)
        self.ns_dtype, self.polar_express, self.cautious = ns_dtype, polar_express, cautious
        self.beta2 = beta2
        for group in self.param_groups:
            for p in group["params"]:
                check_layout(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        matrices = []  # (group, parameter, gradient, momentum) of those with a gradient
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)  # torch's checks and zero momentum
            matrices += [(group, p, parallel.local(g), parallel.local(b))
                         for p, g, b in zip(params, grads, bufs)]
        if not matrices:  # no gradients (the same on every rank): nothing to share
            return loss
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        shapes, groups = [p.shape for _, p, _, _ in matrices], [g for g, _, _, _ in matrices]
        owner = owners([tuple(s) for s in shapes], world)
        sharded = parallel.is_dtensor(matrices[0][1])
        # every rank's momentum moves; under ddp only the owner needs the update it makes
        updates = [nesterov(grad, buf, group, sharded or o == rank)
                   for (group, _, grad, buf), o in zip(matrices, owner)]
        orthogonalise = functools.partial(newton_schulz, dtype=self.ns_dtype,
                                          polar_express=self.polar_express)
        if sharded:
            ortho = orthogonalised_shards(updates, shapes, groups, owner, rank, world,
                                          orthogonalise, self.ns_dtype)
        else:
            ortho = orthogonalised_whole(updates, shapes, groups, owner, rank, world,
                                         orthogonalise, self.ns_dtype, matrices[0][1].device)
        if self.beta2:
            ortho = normalised_rows(ortho, shapes, [self.state[p] for _, p, _, _ in matrices],
                                    self.beta2, sharded, rank, world)
        for (group, p, _, _), o in zip(matrices, ortho):
            lr = group["lr"]
            weight = parallel.local(p)
            if self.cautious:
                cautious_decay(weight, o, lr * group["weight_decay"])
            else:
                weight.mul_(1 - lr * group["weight_decay"])
            weight.add_(o, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def normalised_rows(ortho, shapes, states, beta2, sharded, rank, world):
    """NorMuon (Li et al., arXiv 2510.05491): each orthogonalised update's rows (a Linear's output
    neurons) divided by the root of an exponential average (beta2) of their mean square, then
    the whole scaled back to the update's own Frobenius norm, so that Muon's learning rate
    keeps its meaning while no neuron's rows take a larger step than the others'. The average,
    state['second_moment'] (rows,) in float32, is whole and the same on every rank: under ddp
    each rank has every whole update after the gather; under fsdp each has its rows of each,
    and one all_reduce of every matrix's per-row sums of squares gives every rank all of them.
    Whole, it is not sharded in a checkpoint folder (it is not shaped like its parameter), and
    it resumes at any world size and under either parallel; a checkpoint without it (an
    earlier run's, torch.optim.Muon's) starts it at zero."""
    # where this rank's rows of each matrix start (all of its rows under ddp)
    starts = [sum(shard_rows(s[0], r, world) for r in range(rank)) if sharded else 0
              for s in shapes]
    squares = torch.zeros(sum(s[0] for s in shapes), device=ortho[0].device)
    whole = squares.split([s[0] for s in shapes])
    for o, start, rows in zip(ortho, starts, whole):
        rows[start:start + o.size(0)] = o.float().square().sum(1)
    if sharded:
        dist.all_reduce(squares)
    out = []
    for o, shape, state, start, rows in zip(ortho, shapes, states, starts, whole):
        second = state.setdefault("second_moment", rows.new_zeros(shape[0]))
        second.lerp_(rows / shape[1], 1 - beta2)
        scale = second.clamp(min=1e-10).rsqrt()
        # the same Frobenius norm as the update's (a zero update, as torch's state
        # initialisation steps with, stays zero)
        scale *= (rows.sum() / (rows * scale.square()).sum().clamp(min=1e-30)).sqrt()
        out.append(o.float() * scale[start:start + o.size(0), None])
    return out


def cautious_decay(weight, update, decay):
    """Decoupled weight decay (weight -= decay * weight) only where the update, which the step
    subtracts, has the weight's sign: where both move the weight toward zero (Chen et al.,
    Cautious Weight Decay, arXiv 2510.12402), so that the decay never works against the
    gradient's direction. Elementwise: under fsdp on each rank's rows."""
    if decay:
        weight.sub_(weight * (update * weight >= 0), alpha=decay)


def closure_loss(closure):
    """What every torch optimizer's step does first: run the closure (the forward and backward)
    with gradients on, and return its loss (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_layout(p):
    """A DTensor matrix must be what the step exchanges rows of: Shard(0) over all the ranks,
    one mesh dimension (fully_shard's default, train.py's parallel=fsdp). A model sharded
    otherwise in one's own loop would have its rows sent to the wrong ranks."""
    if not parallel.is_dtensor(p):
        return
    world = dist.get_world_size()
    if len(p.placements) != 1 or not p.placements[0].is_shard(0) or p.device_mesh.size() != world:
        raise UserError(
            f"DistributedMuon takes whole matrices, or DTensors sharded by rows over all the "
            f"ranks (Shard(0) on a 1-D mesh of every rank, {world} here, as fully_shard shards "
            f"by default and parallel=fsdp does), and a {tuple(p.shape)} matrix here is "
            f"{p.placements} over a mesh of shape {tuple(p.device_mesh.shape)}. Shard Muon's "
            f"matrices along dim 0 over one mesh dimension of every rank (fully_shard without "
            f"shard_placement_fn, and no HSDP mesh), or give Muon whole matrices (ddp).")


def nesterov(grad, buf, group, needed):
    """The momentum buffer updated in place, and the update to orthogonalise, as torch's
    (None where not needed)."""
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    return (grad.lerp(buf, momentum) if group["nesterov"] else buf) if needed else None


def newton_schulz(update, group, dtype, polar_express=False):
    """update made orthogonal: torch's _zeropower_via_newtonschulz with its dtype a setting
    (torch's is bfloat16 alone), the same operations in the same order, so in bfloat16 it is
    torch.optim.Muon's bit for bit (tested); with polar_express, POLAR_EXPRESS's coefficients
    and its margin. The iterations run on the wide orientation, whose Gram matrix is the
    smaller."""
    steps = POLAR_EXPRESS[:group["ns_steps"]] if polar_express \
        else [group["ns_coefficients"]] * group["ns_steps"]
    tall = update.size(0) > update.size(1)
    x = update.to(dtype).T if tall else update.to(dtype)
    norm = x.norm() * POLAR_MARGIN if polar_express else x.norm()
    x = x / norm.clamp(min=group["eps"])  # a spectral norm of 1 at most
    for a, b, c in steps:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalised_whole(updates, shapes, groups, owner, rank, world, orthogonalise, dtype,
                         device):
    """ddp: each update orthogonalised by its owner (updates: None where another rank owns it;
    orthogonalise(update, group): newton_schulz's result in dtype) into its rank's row of a
    (world, bucket) tensor in dtype, which one all_gather_single fills: the list form would
    have NCCL gather into a hidden flat buffer and copy out of it."""
    sizes = [sum(s.numel() for s, o in zip(shapes, owner) if o == r) for r in range(world)]
    mine = torch.zeros(max(sizes), dtype=dtype, device=device)
    at = 0
    for u, g, o in zip(updates, groups, owner):
        if o == rank:
            mine[at:at + u.numel()].copy_(orthogonalise(u, g).flatten())
            at += u.numel()
    # a one-rank group gathers too: bench gpu's check of NCCL on one GPU runs this path
    gathered = torch.empty(world * mine.numel(), dtype=dtype, device=device) \
        if dist.is_initialized() else mine
    if dist.is_initialized():
        dist.all_gather_single(gathered, mine)  # flat: gloo takes no (world, n) output
    gathered = gathered.view(world, -1)
    offsets, out = [0] * world, []
    for s, o in zip(shapes, owner):
        out.append(gathered[o][offsets[o]:offsets[o] + s.numel()].view(s))
        offsets[o] += s.numel()
    return out


def orthogonalised_shards(updates, shapes, groups, owner, rank, world, orthogonalise, dtype):
    """fsdp: each rank's rows of each update orthogonalised as a whole matrix by its owner:
    the rows gathered to the owner by one all_to_all_single, the results' rows sent back by
    another. updates: this rank's rows; shapes: the whole matrices'."""
    rows = [[shard_rows(shape[0], r, world) for r in range(world)] for shape in shapes]
    for u, shape, r in zip(updates, shapes, rows):
        if u.shape != (r[rank], shape[1]):
            raise RuntimeError(
                f"rank {rank} holds {tuple(u.shape)} of a {tuple(shape)} matrix sharded "
                f"Shard(0) over {world} ranks, where torch.chunk's split of its rows, which "
                f"shard_rows() expects DTensor to keep, gives ({r[rank]}, {shape[1]}): this "
                f"torch splits rows otherwise, so the exchange would send rows to the wrong "
                f"ranks; shard_rows() must follow it.")
    whole = gathered_to_owners(updates, rows, shapes, owner, rank)
    ortho = {i: orthogonalise(m, groups[i]) for i, m in whole.items()}
    return scattered_from_owners(ortho, rows, shapes, owner, rank, dtype, updates[0].device)


def gathered_to_owners(updates, rows, shapes, owner, rank):
    """{i: matrix i whole} for the matrices this rank owns: every rank sends each owner its
    rows of the owner's matrices, in the optimizer's order, and the owner stacks them in rank
    order. rows[i][r]: how many of matrix i's rows rank r holds."""
    world = len(rows[0])
    sent = exchange([[u.flatten() for u, o in zip(updates, owner) if o == to]
                     for to in range(world)],
                    [sum(r[frm] * s[1] for r, s, o in zip(rows, shapes, owner) if o == rank)
                     for frm in range(world)], updates[0].dtype, updates[0].device)
    parts = {i: [] for i, o in enumerate(owner) if o == rank}
    for frm in range(world):  # each sender's rows, in the order it sent them
        at = 0
        for i in parts:
            n = rows[i][frm] * shapes[i][1]
            parts[i].append(sent[frm][at:at + n].view(rows[i][frm], shapes[i][1]))
            at += n
    return {i: torch.cat(p) for i, p in parts.items()}


def scattered_from_owners(ortho, rows, shapes, owner, rank, dtype, device):
    """This rank's rows of every matrix's result, in the optimizer's order: each owner sends
    each rank its rows of the results it computed (ortho: {i: result}), in dtype."""
    world = len(rows[0])
    starts = [[sum(r[:k]) for k in range(world)] for r in rows]
    back = exchange([[ortho[i][starts[i][to]:starts[i][to] + rows[i][to]].flatten()
                      for i in sorted(ortho)] for to in range(world)],
                    [sum(r[rank] * s[1] for r, s, o in zip(rows, shapes, owner) if o == frm)
                     for frm in range(world)], dtype, device)
    out, at = [], [0] * world
    for r, s, o in zip(rows, shapes, owner):
        out.append(back[o][at[o]:at[o] + r[rank] * s[1]].view(r[rank], s[1]))
        at[o] += r[rank] * s[1]
    return out


def shard_rows(rows, rank, world):
    """How many of a matrix's rows Shard(0) puts on rank: torch.chunk's."""
    chunk = -(-rows // world)
    return max(0, min(rows, (rank + 1) * chunk) - rank * chunk)


def exchange(to_each, from_each, dtype, device):
    """One all_to_all_single: to_each[r], a list of flat tensors, goes to rank r; what each
    rank r sends here (from_each[r] elements of dtype) comes back, one tensor per rank."""
    send = [torch.cat(ts).to(dtype) if ts else torch.empty(0, dtype=dtype, device=device)
            for ts in to_each]
    received = torch.empty(sum(from_each), dtype=dtype, device=device)
    dist.all_to_all_single(received, torch.cat(send), output_split_sizes=from_each,
                           input_split_sizes=[t.numel() for t in send])
    return list(received.split(from_each))
