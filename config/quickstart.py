# A small GPT on the Python standard library's source, byte by byte: minutes on a CPU.
#   python prepare.py --dataset=pystdlib --tokenizer=byte --val_fraction=0.02
#   torchrun --standalone --nproc_per_node=2 train.py config/quickstart.py   # or python train.py
#   python sample.py --out_dir=out-quickstart --start="def "
# The device is train.py's default, auto: a GPU where torch sees one (one rank per GPU:
# --nproc_per_node=1 on a machine with one), else the CPU.
data_dir = "data/pystdlib"
out_dir = "out-quickstart"

n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0

batch_size = 16
gradient_accumulation_steps = 2  # a multiple of the ranks: 1 or 2 on a 2-core machine
learning_rate = 2e-3
max_iters = 1000
lr_decay_iters = 1000
warmup_iters = 50
min_lr = 2e-4
beta2 = 0.99  # a small model on few tokens per step: a shorter memory is steadier

eval_interval = 250
eval_iters = 20
log_interval = 25
