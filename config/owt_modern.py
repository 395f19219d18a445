# The modern recipe at GPT-2 124M's size on OpenWebText (or FineWeb), for one node of 8 GPUs:
# Qwen3's block (RMSNorm, rotary positions, QK-norm, SwiGLU of 2048, no biases, untied head;
# the same FLOPs per token as GPT-2 124M) and Muon for its matrices, AdamW for the rest.
#   python prepare.py
#   torchrun --standalone --nproc_per_node=8 train.py config/owt_modern.py
#   python export.py --out_dir=out-owt-modern --to=owt-qwen3   # a Hugging Face Qwen3 folder
# Not measured at this size here (no GPU was lent): the keys below are nanochat's and
# modded-nanogpt's published choices for Muon at this width (learning rate 0.02, momentum
# 0.95, no warm-up needed by Muon, a long cooldown), config/owt.py's for the rest; the
# measurement behind the recipe is `python bench.py recipe`, at the quick start's size.
# 12 sequences x 1024 tokens x 40 micro-steps = 491,520 tokens per step; 10,000 steps are
# about 4.9B tokens, half of what llm.c's GPT-2 124M takes to reach its loss with AdamW.
data_dir = "data/openwebtext"
out_dir = "out-owt-modern"
wandb_log = False
wandb_project = "owt"
wandb_run_name = "modern-124M"

batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

arch = "modern"
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

optimizer = "muon"
muon_lr = 0.02  # Muon's peak, for the blocks' matrices
muon_momentum = 0.95
muon_beta2 = 0.95  # NorMuon; with proj_init, what paid at the quick start's size (training.md)
proj_init = "zero"
# AdamW's, for the embeddings, the head and the norms: 5 times GPT-2's, as paid at the quick
# start's size (training.md); nanochat's output layer takes 0.004, its embeddings far more
learning_rate = 3e-3
weight_decay = 1e-1
max_iters = 10000
lr_schedule = "wsd"  # warm-up, stable, then the last 40% decaying to min_lr
cooldown_frac = 0.4
warmup_iters = 200
min_lr = 0.0

eval_interval = 500
eval_iters = 200
log_interval = 10
compile = True
