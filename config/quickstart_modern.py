# The quick start with the modern recipe: Qwen3's block (RMSNorm, rotary positions, QK-norm,
# SwiGLU, no biases, untied head) trained with Muon for its matrices and AdamW for the rest.
# The same data, model size, batch and schedule as config/quickstart.py; `python bench.py
# recipe` measures what the two keys change (docs/benchmarks.md, "Recipe"):
#   python prepare.py --dataset=pystdlib --tokenizer=byte --val_fraction=0.02
#   torchrun --standalone --nproc_per_node=2 train.py config/quickstart_modern.py
#   python sample.py --out_dir=out-quickstart-modern --start="def "
#   python export.py --out_dir=out-quickstart-modern --to=quickstart-qwen3   # a Qwen3 folder
data_dir = "data/pystdlib"
out_dir = "out-quickstart-modern"

arch = "modern"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0

batch_size = 16
gradient_accumulation_steps = 2  # a multiple of the ranks: 1 or 2 on a 2-core machine
optimizer = "muon"
muon_lr = 0.02  # Muon's peak, for the blocks' matrices
# recipe two's pieces that paid on this corpus (docs/training.md, "The modern recipe"): NorMuon,
# output projections that start at zero, and AdamW's rate 5 times the quick start's
muon_beta2 = 0.95
proj_init = "zero"
learning_rate = 1e-2  # AdamW's, for the embeddings, the head and the norms
max_iters = 1000
lr_decay_iters = 1000
warmup_iters = 50
min_lr = 1e-3  # Muon's is muon_lr x min_lr / learning_rate: as before, 0.1 of its peak
beta2 = 0.99  # a small model on few tokens per step: a shorter memory is steadier

eval_interval = 250
eval_iters = 20
log_interval = 25
