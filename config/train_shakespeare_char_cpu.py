# The baby GPT on a CPU of a few cores: tiny shakespeare, character level, tuned for time to a val loss of ~1.88.
# $ python data/shakespeare_char/prepare.py && python train.py config/train_shakespeare_char_cpu.py
# $ python sample.py --out_dir=out-shakespeare-char-cpu
#
# nanoGPT's CPU recipe (4 layers x 128 wide, block 64, batch 12, 2000 iterations, float32, no compile) reaches a
# val loss of ~1.88-1.90; docs/performance.md times it and this config side by side (the figures, with their machine,
# date and command). What gets there faster on a CPU with bf16 in hardware:
# - bf16 autocast (dtype="auto" picks it on a CPU with bf16 in hardware): its matmuls run faster than float32's
#   there. A CPU without it (AVX2 only) emulates bf16, far slower, so "auto" runs float32 there.
# - the plain math attention under bf16 (attention="auto" picks it): PyTorch's CPU flash kernel is much slower in
#   bf16 backward than in float32; in float32, "auto" takes SDPA.
# - gelu="erf", the exact GELU (nanoGPT's too): PyTorch's CPU kernels for it are faster than the tanh form's.
# - 2 layers x 192 wide instead of 4 x 128: about the same time per step, a lower loss after the same steps
#   (1.875 vs 1.938 after 450).
# - batch 32 at learning rate 8e-3 (4x nanoGPT's tokens per step, 8x its learning rate), a cosine schedule that
#   ends with the run: ~450 steps instead of 2000.
# - no torch.compile: once compiled it gains nothing measurable at this size, and a cold compile costs time.

out_dir = "out-shakespeare-char-cpu"
eval_interval = 150
eval_iters = 20
log_interval = 25
always_save_checkpoint = False

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 32
block_size = 64

n_layer = 2
n_head = 3
n_embd = 192
dropout = 0.0
gelu = "erf"
attention = "auto"

learning_rate = 8e-3
max_iters = 450
min_lr = 8e-4
beta2 = 0.99
warmup_iters = 50

device = "cpu"
dtype = "auto"
compile = False
