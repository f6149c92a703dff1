# bench.py on a CPU with a few cores. Loaded automatically when the device is the CPU and no config file is given.
# $ python bench.py                      $ python benchmarks/ablation.py       $ python benchmarks/memory.py
#
# The default (GPT-2 124M, 12 x 1024 tokens per step, as nanoGPT's bench on a GPU) takes minutes per step on two
# cores. This is GPT-2's shape at half the depth and width and a quarter of the context, with GPT-2's real
# vocabulary: 50257 rows (not a multiple of 64, so padding to 50304 has something to show), and the head is most
# of the FLOPs, as in GPT-2 small. One step is 8 x 256 = 2,048 tokens: seconds, not minutes, on two cores (the
# measured figures, with their machine, are in docs/performance.md).
n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
batch_size = 8
vocab_size = 50257
gradient_accumulation_steps = 1
warmup_steps = 2  # the first step allocates the optimizer state; the second settles the allocator
timed_steps = 5
compile = False  # compiling costs each run more than it saves here; the cumulative ablation has its own compile row
device = "cpu"
