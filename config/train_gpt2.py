# GPT-2 (124M) on OpenWebText: to a loss of ~2.85 in ~4 days on 8x A100 40GB.
# $ python data/openwebtext/prepare.py
# $ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

wandb_log = True
wandb_project = "owt"
wandb_run_name = "gpt2-124M"

# 12 batch size * 1024 block size * 40 grad accum (5 per GPU on 8 GPUs) = 491,520 tokens per step (~0.5M)
dataset = "openwebtext"

# a restart (torchrun --max-restarts, a requeued job) with this same command resumes the run in out_dir
init_from = "auto"
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

# 600,000 steps of 0.5M tokens: 300B tokens
max_iters = 600000
lr_decay_iters = 600000

eval_interval = 1000
eval_iters = 200
log_interval = 10

weight_decay = 1e-1
