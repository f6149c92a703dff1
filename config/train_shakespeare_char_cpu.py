# The baby GPT on a CPU of a few cores: tiny shakespeare, character level, tuned for time to a val loss of ~1.88.
# $ python data/shakespeare_char/prepare.py && python train.py config/train_shakespeare_char_cpu.py
# $ python sample.py --out_dir=out-shakespeare-char-cpu
#
# nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch 12, 2000 iterations, float32, no compile)
# reaches ~1.88-1.90. What is faster here, measured on a 2-core AVX-512-BF16 CPU (see README, "Performance"):
# bf16 autocast (its matmuls run ~2.5x faster than float32's) with the plain math attention (PyTorch's CPU flash
# kernel is ~5x slower in bf16 backward than in float32), a larger batch at a higher learning rate (more tokens per
# step's fixed costs), and no torch.compile (at this size it saves ~3% and costs ~20 s to compile).

out_dir = "out-shakespeare-char-cpu"
eval_interval = 200
eval_iters = 20
log_interval = 50
always_save_checkpoint = False

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 32
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
attention = "math"

learning_rate = 3e-3
max_iters = 800
lr_decay_iters = 800
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 50

device = "cpu"
dtype = "bfloat16"
compile = False
