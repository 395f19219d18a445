# Evaluate the newest checkpoint of config/owt.py's run on train and val, then stop:
#   torchrun --standalone --nproc_per_node=8 train.py config/owt.py config/eval_owt.py
init_from = "resume"
eval_only = True
eval_iters = 500
wandb_log = False
