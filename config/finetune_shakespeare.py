# Fine-tune GPT-2 XL on tiny shakespeare (GPT-2 BPE): a few minutes on one A100.
# $ python data/shakespeare/prepare.py && python train.py config/finetune_shakespeare.py
# $ python sample.py --out_dir=out-shakespeare
import time

out_dir = "out-shakespeare"
eval_interval = 5
eval_iters = 40
wandb_log = False
wandb_project = "shakespeare"
wandb_run_name = "ft-" + str(time.time())

dataset = "shakespeare"
init_from = "gpt2-xl"  # the largest GPT-2

always_save_checkpoint = False  # only when val improves

# 1 batch_size * 32 gradient_accumulation_steps * 1024 tokens = 32,768 tokens/iter; shakespeare has 301,966 tokens: 1 epoch ~ 9.2 iters
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

# fine-tune at a constant learning rate
learning_rate = 3e-5
decay_lr = False
