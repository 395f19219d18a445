"""Activation checkpointing (the activation_checkpointing key): what each transformer block
keeps from its forward for its backward, and what its backward computes again instead: none
keeps everything, full its input alone (its forward runs again), selective the outputs of its
matmuls and fused attention (the rest is computed again). docs/fsdp.md gives each mode's
memory and cost, and why selective is op-level and not torchtitan's policy.

Applied in place to each block's forward, inside fsdp's per-block unit and beneath
torch.compile (parallel.wrap), so the weights keep their names: checkpoints are the same
whatever the mode, and a run resumes under another. torch.utils.checkpoint (non-reentrant)
restores the random number generators' state before a recompute: dropout draws the same masks
twice, and the losses are none's bit for bit."""
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
