"""Train a small LongNet LM (dilated attention) on a text file, character level.

    python examples/train_longnet.py                  # a few hundred steps, CPU or GPU
    python examples/train_longnet.py --steps 1000 --seqlen 1024

Prints the loss every --log-every steps; it falls from ln(vocab) ~ 4.5 to
about 2.5 in 300 steps (CPU, ~30 s).
"""
import argparse
import math
import os
import time

import torch

from longattn.nn import LongNetLM

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(HERE, "data", "python_reference.txt"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    text = open(args.data, encoding="utf-8").read()
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n_val = len(data) // 10
    train, val = data[:-n_val], data[-n_val:]
    s = args.seqlen
    segs = [s // 4, s // 2, s]
    model = LongNetLM(len(vocab), dim=args.dim, depth=args.depth, num_heads=args.heads, segment_lengths=segs,
                      dilation_rates=[1, 2, 4], max_seqlen=s).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(i, args.steps) / args.steps)))

    def batch(src):
        ix = torch.randint(len(src) - s - 1, (args.batch,))
        x = torch.stack([src[i:i + s] for i in ix])
        y = torch.stack([src[i + 1:i + s + 1] for i in ix])
        return x.to(dev), y.to(dev)

    print(f"device={dev} vocab={len(vocab)} params={sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"segments={segs} rates=[1, 2, 4]")
    history = []
    t0 = time.time()
    for step in range(args.steps + 1):
        x, y = batch(train)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            with torch.no_grad():
                model.eval()
                vl = model(*batch(val))[1].item()
                model.train()
            print(f"step {step:5d}  train loss {loss.item():.3f}  val loss {vl:.3f}  {time.time() - t0:.1f}s", flush=True)
    return history


if __name__ == "__main__":
    main()
