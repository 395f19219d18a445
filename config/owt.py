# GPT-2 124M on OpenWebText, nanoGPT's recipe, for one node of 8 GPUs:
#   python prepare.py
#   torchrun --standalone --nproc_per_node=8 train.py config/owt.py
# 12 sequences x 1024 tokens x 40 micro-steps = 491,520 tokens per step (about 0.5M);
# 600,000 steps = about 300B tokens. gradient_accumulation_steps is global: each of the
# 8 ranks does 5 micro-steps.
data_dir = "data/openwebtext"
out_dir = "out-owt"
wandb_log = False
wandb_project = "owt"
wandb_run_name = "gpt2-124M"

batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 1e-1

eval_interval = 1000
eval_iters = 200
log_interval = 10
compile = True
