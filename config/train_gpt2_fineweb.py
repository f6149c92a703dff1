# GPT-2 (124M) on FineWeb-Edu's sample-10BT, build-nanogpt's recipe: one epoch of ~10B tokens, judged by val loss and
# HellaSwag. build-nanogpt ends at val ~3.07 and HellaSwag acc_norm ~0.30 (GPT-2 124M: 0.2955); see the README.
# $ python data/fineweb_edu/prepare.py
# $ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_fineweb.py

out_dir = "out-gpt2-fineweb"
dataset = "fineweb_edu"

# a restart (torchrun --max-restarts, a requeued job) with this same command resumes the run in out_dir
init_from = "auto"

# 64 sequences x 1024 tokens x 8 micro-steps (1 per GPU on 8 GPUs, 8 in a row on 1) = 524,288 tokens per step
batch_size = 64
block_size = 1024
gradient_accumulation_steps = 8

# 19,073 steps of 524,288 tokens: one pass over the ~10B train tokens
max_iters = 19073
lr_decay_iters = 19073
warmup_iters = 715
learning_rate = 6e-4
min_lr = 6e-5  # cosine to 10% of the max
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

# GPT-2's architecture (biases in Linears and LayerNorms, tanh GELU), its 50257 tokens padded to 50304 rows
n_layer, n_head, n_embd = 12, 12, 768
bias = True
dropout = 0.0
vocab_padding_multiple = 64

dtype = "bfloat16"
compile = True
attention = "sdpa"
sdpa_backend = "flash"

# build-nanogpt evaluates every 250 steps: 20 batches of 64 x 1024 per GPU = 160 over 8 GPUs
eval_interval = 250
eval_iters = 160
log_interval = 10
hellaswag = True  # at every eval: 10,042 examples split over the GPUs

wandb_log = False  # True to follow the run on Weights & Biases
wandb_project = "fineweb"
wandb_run_name = "gpt2-124M-fineweb-edu"
