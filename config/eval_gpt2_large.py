# Evaluate the pretrained gpt2-large (n_layer=36, n_head=20, n_embd=1280) on OpenWebText: train and val loss, no training.
# $ python train.py config/eval_gpt2_large.py
batch_size = 8
eval_iters = 500  # use more iterations for a good estimate
eval_only = True
wandb_log = False
init_from = "gpt2-large"
