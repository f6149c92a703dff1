"""
What DDP's gradient_as_bucket_view and static_graph buy: peak memory and step time of 2-rank DDP training
(gloo on the CPU, NCCL on GPUs), each setting in fresh torchrun processes, alternating.

    python benchmarks/ddp_settings.py                 # CPU: 2 ranks, gloo, a 6 x 384 GPT (10.7M parameters)
    python benchmarks/ddp_settings.py --device=cuda --nproc=1 --rounds=3

Memory: on the CPU the growth of each rank's peak RSS over its training steps (VmHWM, which never goes down), on
CUDA torch.cuda.max_memory_allocated; the figure is the mean over ranks. Time: the median step over the timed
steps. train.py uses what wins here (distributed.DDP_SETTINGS).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "+ static_graph": {"gradient_as_bucket_view": True, "static_graph": True},
}

WORKER = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from nanogpt.distributed import setup_distributed
from model import GPT, GPTConfig

def rss_peak_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])

device, settings, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
d = setup_distributed(device)
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=256, vocab_size=4096, n_layer=6, n_head=6, n_embd=384)).to(d.device)
opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), d.device.split(":")[0], verbose=False)
ddp = DDP(model, device_ids=[d.local_rank] if d.device.startswith("cuda") else None, **settings)
x = torch.randint(0, 4096, (8, 256), generator=torch.Generator().manual_seed(d.rank)).to(d.device)
cuda = d.device.startswith("cuda")
base = torch.cuda.memory_allocated() if cuda else rss_peak_kb() * 1024
ms = []
for step in range(7):
    for micro in range(2):  # gradient accumulation: no_sync on the first micro-step, as train.py
        ctx = ddp.no_sync() if micro == 0 else __import__("contextlib").nullcontext()
        with ctx:
            _, loss = ddp(x, x, return_logits=False)  # the training step's forward
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    if step >= 2:
        ms.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
peak = (torch.cuda.max_memory_allocated() if cuda else rss_peak_kb() * 1024) - base
grads = sum(p.numel() * p.element_size() for p in model.parameters())
with open(f"{{out}}.{{d.rank}}", "w") as f:
    json.dump({{"peak_bytes": peak, "ms": ms, "grad_bytes": grads}}, f)
dist.destroy_process_group()
"""


def run(setting: dict, device: str, nproc: int, tmp: str) -> dict:
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER.format(root=ROOT))
    out = os.path.join(tmp, "result")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           device, json.dumps(setting), out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if device == "cpu" else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"error: a DDP run failed: {proc.stderr.strip().splitlines()[-1]}")
    ranks = [json.load(open(f"{out}.{r}")) for r in range(nproc)]
    return {"peak_mib": statistics.mean(r["peak_bytes"] for r in ranks) / 2**20,
            "ms": statistics.median(m for r in ranks for m in r["ms"]), "grad_mib": ranks[0]["grad_bytes"] / 2**20}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name, setting in SETTINGS.items():
                r = run(setting, args.device, args.nproc, tmp)
                results[name].append(r)
                print(f"  round {i + 1}: {name}: peak +{r['peak_mib']:.0f} MiB, {r['ms']:.1f} ms/step", flush=True)
    grad = results["default"][0]["grad_mib"]
    print(f"{args.nproc} ranks on {args.device}, gradients {grad:.0f} MiB per rank; medians over {args.rounds} rounds:")
    print("| setting | peak memory growth per rank (MiB) | ms/step |")
    print("|---|---:|---:|")
    for name, runs in results.items():
        print(f"| {name} | {statistics.median(r['peak_mib'] for r in runs):.0f} | "
              f"{statistics.median(r['ms'] for r in runs):.1f} |")


if __name__ == "__main__":
    main()
