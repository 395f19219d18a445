# Fine-tune OpenAI's GPT-2 (124M) on a local corpus, as nanoGPT's finetune_shakespeare does:
# GPT-2's tokens, a small constant learning rate, a few steps. Here the corpus is the Python
# standard library (no download but the weights; any folder of .txt files works the same):
#   python prepare.py --dataset=pystdlib --tokenizer=gpt2 --val_fraction=0.02 \
#       --out_dir=data/pystdlib-gpt2
#   python train.py config/finetune_gpt2.py
#   python sample.py --out_dir=out-finetune-gpt2 --start="def "
#   python export.py --out_dir=out-finetune-gpt2 --to=gpt2-pystdlib
# The first run downloads the weights into Hugging Face's cache (about 500 MB); with no network
# see "Fine-tuning GPT-2" in docs/evaluation.md. On 8 GPUs: torchrun --standalone --nproc_per_node=8
# train.py config/finetune_gpt2.py (gradient_accumulation_steps is global).
init_from = "gpt2"  # or gpt2-medium, gpt2-large, gpt2-xl, or a Hugging Face GPT-2 folder
data_dir = "data/pystdlib-gpt2"
out_dir = "out-finetune-gpt2"

# the architecture comes from the weights; block_size = 256 would crop GPT-2's 1024 positions
dropout = 0.0

# 1 sequence x 1024 tokens x 32 micro-steps = 32,768 tokens per step
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20
learning_rate = 3e-5  # small and constant: nudge the weights, do not retrain them
decay_lr = False

eval_interval = 5
eval_iters = 40
log_interval = 1
always_save_checkpoint = False  # only when the validation loss improves (and at the end)
