# Evaluate the pretrained gpt2-xl (n_layer=48, n_head=25, n_embd=1600) on OpenWebText: train and val loss, no training.
# $ python train.py config/eval_gpt2_xl.py
batch_size = 8
eval_iters = 500  # use more iterations for a good estimate
eval_only = True
wandb_log = False
init_from = "gpt2-xl"
