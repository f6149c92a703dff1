# Evaluate the pretrained gpt2 (n_layer=12, n_head=12, n_embd=768) on OpenWebText: train and val loss, no training.
# $ python train.py config/eval_gpt2.py
batch_size = 8
eval_iters = 500  # use more iterations for a good estimate
eval_only = True
wandb_log = False
init_from = "gpt2"
