# A small GPT on the Python standard library's source, byte by byte, on a CPU in minutes:
#   python prepare.py --dataset=pystdlib --tokenizer=byte
#   python train.py config/quickstart.py
#   python sample.py --out_dir=out-quickstart --start="def "
data_dir = "data/pystdlib"
out_dir = "out-quickstart"
device = "cpu"

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
