# Evaluate the pretrained gpt2-medium (n_layer=24, n_head=16, n_embd=1024) on OpenWebText: train and val loss, no training.
# $ python train.py config/eval_gpt2_medium.py
batch_size = 8
eval_iters = 500  # use more iterations for a good estimate
eval_only = True
wandb_log = False
init_from = "gpt2-medium"
