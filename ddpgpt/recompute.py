"""Activation checkpointing (the activation_checkpointing key): what each transformer block
keeps from its forward for its backward, and what its backward computes again instead.

  none       everything the backward needs is kept: the fastest, the most memory.
  full       each block keeps its input alone, and its backward runs its forward again:
             about one forward more per step (a third more compute), and the blocks'
             activations shrink to one (batch, block_size, n_embd) tensor a block.
  selective  each block keeps the outputs of all its matmuls, and of its attention where that
             is one fused kernel (a GPU's; the CPU's without dropout), and computes the rest
             again (norms, GELU or SwiGLU, rotations, dropout; the CPU's attention with
             dropout, op by op), for a memory between the two.

selective is op-level (torch's create_selective_checkpoint_contexts), as torchtitan's 'op'
option, but not its policy, which recomputes every second matmul too. Op-level, not "every k-th
block in full": no second key, spread evenly over the blocks (so over fsdp's per-block gathers),
and only what costs little recomputed, where k-th-block checkpointing's memory steps with k.

Both use torch.utils.checkpoint (non-reentrant), which restores the random number generators'
state before a recompute: dropout draws the same masks twice, and the losses are none's bit for
bit. Applied in place to each block's forward, inside fsdp's per-block unit and beneath
torch.compile (parallel.wrap), so the weights keep their names: checkpoints are the same
whatever the mode, and a run resumes under another."""
import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

aten = torch.ops.aten
# the operations whose outputs selective keeps: the Linears' matmuls (mm, or addmm with a
# bias) and the fused attention kernels of each device (their output and the log-sum-exp that
# their backward reads)
KEPT = {aten.mm.default, aten.addmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default}


def keep_matmuls(ctx, op, *args, **kwargs):
    """selective's policy, asked for each operation of a block's forward."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def apply(model, mode, loss_chunks):
    """Each block of model recomputes in its backward what `mode` says ('none' leaves them),
    and its training loss is computed in loss_chunks checkpointed slices (model.chunked_loss)."""
    model.loss_chunks = loss_chunks
    if mode == "none":
        return
    options = dict(use_reentrant=False)
    if mode == "selective":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                  keep_matmuls)
    for block in model.transformer.h:
        # the block's forward replaced on the instance, not the block wrapped in a module, so
        # that its weights' names stay transformer.h.N.*; fsdp's hooks and compile still go
        # through the block's __call__, around it
        block.forward = functools.partial(checkpoint, block.forward, **options)
