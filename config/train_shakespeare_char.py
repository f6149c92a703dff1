# The baby GPT on a GPU: a character-level model of tiny shakespeare (about 3 minutes on an A100, val loss ~1.47).
# $ python data/shakespeare_char/prepare.py && python train.py config/train_shakespeare_char.py

out_dir = "out-shakespeare-char"
eval_interval = 250  # small model: it overfits, so evaluate often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # keep the best val loss only

wandb_log = False
wandb_project = "shakespeare-char"
wandb_run_name = "mini-gpt"

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # context of up to 256 previous characters

# the baby GPT
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # a small network can take a higher learning rate
max_iters = 5000
lr_decay_iters = 5000  # usually max_iters
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # a bit larger: few tokens per iteration
warmup_iters = 100
