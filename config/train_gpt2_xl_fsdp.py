# GPT-2 XL (1.56B parameters) from scratch on OpenWebText, sharded with FSDP2 over 8 GPUs of 24 GB (RTX 4090, A10).
# $ python data/openwebtext/prepare.py
# $ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_xl_fsdp.py
#
# Memory per GPU for parameters + gradients + AdamW state (float32: 4 + 4 + 8 bytes per parameter); train.py
# prints the figure of its own shards at start ("memory per rank: ..."):
#   DDP (a full copy per GPU): 1,556,840,000 x 16 B = 23.2 GiB, plus DDP's 5.8 GiB of gradient buckets: no room
#     left on a 24 GB GPU before the first activation.
#   FSDP over 8 GPUs, 5 micro-steps per GPU: params 0.725 GiB + grads 5.800 GiB (unsharded) + AdamW 1.450 GiB =
#     7.975 GiB per GPU. The gradients are the whole model's: the 4 micro-steps before the last skip the
#     reduce-scatter, so every GPU accumulates all 1.56B gradients, in float32 (FSDP's reduce dtype), and only the
#     last micro-step's reduce-scatter leaves each its 0.725 GiB shard of them. Then one block's all-gathered bf16
#     parameters at a time (~60 MiB) and the activations: with activation checkpointing every block keeps only
#     its input (12 x 1024 x 1600 x 2 B = 38 MiB per block, 1.8 GiB for 48 blocks) and recomputes the rest in
#     the backward. About 10 GiB in all.
# (tests/test_parallel.py checks these figures against memory_per_rank of the model sharded over 8 ranks.)

wandb_log = True
wandb_project = "owt"
wandb_run_name = "gpt2-xl-fsdp"

parallelism = "fsdp"
activation_checkpointing = True
dtype = "bfloat16"  # FSDP's mixed precision: bf16 all-gathers and compute, float32 gradient reduction and AdamW

n_layer = 48
n_head = 25
n_embd = 1600

# The data, batch and schedule are config/train_gpt2.py's, which are TrainConfig's defaults: openwebtext, 12 x 1024
# tokens per micro-batch x 40 micro-steps (5 per GPU on 8 GPUs) = 491,520 tokens per step, 600,000 steps, weight
# decay 0.1; only the learning rate and the logging differ.
learning_rate = 2e-4  # GPT-3 XL's (1.3B): larger models take smaller steps
min_lr = 2e-5
eval_interval = 1000
log_interval = 10

# a restart (torchrun --max-restarts, a requeued job) with this same command resumes the run in out_dir
init_from = "auto"
