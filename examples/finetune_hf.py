"""Train a transformers Llama model with longattn attention on examples/data (bytes as tokens).

    python examples/finetune_hf.py --attn longattn                      # one device (CPU or GPU)
    python examples/finetune_hf.py --attn longattn --pack               # packed documents
    torchrun --nproc_per_node=2 examples/finetune_hf.py --attn longattn_ring --cp 2
    python examples/finetune_hf.py --attn longattn_dilated --seqlen 512

The model is built from a Llama config with random weights; with real weights
only the model line changes: ``AutoModelForCausalLM.from_pretrained(name,
attn_implementation=args.attn)`` (``--pretrained NAME`` does that and uses the
model's tokenizer instead of bytes). ``--attn sdpa`` is transformers' own
attention, for comparison.

Context parallelism: ``--cp N`` splits every sequence over N ranks
(``longattn_ring``; gloo on CPU, NCCL on GPU); with more ranks than N the rest
is data parallel. Each step prints the loss and tokens/s (the whole batch,
and per rank).
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def byte_batches(data: bytes, seqlen: int, batch: int, pack: bool, gen: torch.Generator):
    """Random windows of the text, one byte per token (ids 1..255; 0 pads).
    pack: each row is whole paragraphs (documents) one after another,
    position_ids restarting at 0 in each."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    docs = [p for p in data.split(b"\n\n") if p] if pack else None
    while True:
        if not pack:
            ix = torch.randint(len(t) - seqlen, (batch,), generator=gen, device=gen.device)
            yield dict(input_ids=torch.stack([t[i:i + seqlen] for i in ix.tolist()]))
            continue
        rows, pos = [], []
        for _ in range(batch):
            ids, p = [], []
            j = int(torch.randint(len(docs), (1,), generator=gen, device=gen.device))
            while len(ids) < seqlen:
                d = list(docs[j % len(docs)][:seqlen])
                ids += d
                p += range(len(d))
                j += 1
            rows.append(ids[:seqlen])
            pos.append(p[:seqlen])
        yield dict(input_ids=torch.tensor(rows, device="cpu"), position_ids=torch.tensor(pos, device="cpu"))


def progress(step: int, steps: int, loss: float, tok_s: float, per_rank: float, width: int = 24) -> str:
    done = int(width * step / steps)
    bar = "=" * done + (">" if done < width else "") + " " * max(0, width - done - 1)
    return f"step {step:5d}/{steps} [{bar}] loss {loss:.3f}  {tok_s:,.0f} tok/s ({per_rank:,.0f} per rank)"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", default="longattn", choices=["sdpa", "longattn", "longattn_ring", "longattn_dilated"])
    p.add_argument("--cp", type=int, default=1, help="ranks per sequence (longattn_ring)")
    p.add_argument("--data", default=os.path.join(HERE, "data", "python_reference.txt"))
    p.add_argument("--pretrained", default=None, help="a model name or path for from_pretrained (needs its files)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pack", action="store_true", help="rows of whole paragraphs, position_ids restarting")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, LlamaConfig

    import longattn.integrations.transformers as lt
    from longattn import context_parallel as cp

    lt.register()
    # Several processes when started by torchrun (or, with --cp, inside a running process group).
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (args.cp > 1 and dist.is_initialized())
    cuda = torch.cuda.is_available()
    if distributed and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if (args.cp > 1) != (args.attn == "longattn_ring"):
        p.error("--attn longattn_ring goes with --cp N > 1 (and --cp with longattn_ring)")
    if world % args.cp:
        p.error(f"--cp {args.cp} must divide the number of ranks ({world})")
    cp_group = dp_group = None
    if args.cp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world // args.cp, args.cp), mesh_dim_names=("dp", "cp"))
        cp_group, dp_group = mesh.get_group("cp"), mesh.get_group("dp")
    elif world > 1:
        dp_group = dist.group.WORLD
    dp_rank = rank // args.cp
    dp_size = world // args.cp

    torch.manual_seed(args.seed)
    if args.pretrained:
        from transformers import AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.pretrained, attn_implementation=args.attn)
        tok = AutoTokenizer.from_pretrained(args.pretrained)
        text = open(args.data, encoding="utf-8").read()
        data = None
        ids_all = torch.tensor(tok(text)["input_ids"], device="cpu")
    else:
        extra = {}
        if args.attn == "longattn_dilated":
            s = args.seqlen
            extra = dict(longattn_segment_lengths=[s // 4, s // 2, s], longattn_dilation_rates=[1, 2, 4])
        config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seqlen, 2048),
                             pad_token_id=0, bos_token_id=None, eos_token_id=None, **extra)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
        data = open(args.data, "rb").read()
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(i, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed + dp_rank)  # the ranks of one sequence share the batch
    if data is not None:
        batches = byte_batches(data, args.seqlen, args.batch, args.pack, gen)
    else:
        def windows():
            while True:
                ix = torch.randint(len(ids_all) - args.seqlen, (args.batch,), generator=gen, device=gen.device)
                yield dict(input_ids=torch.stack([ids_all[i:i + args.seqlen] for i in ix.tolist()]))
        batches = windows()

    if rank == 0:
        n = sum(x.numel() for x in model.parameters())
        print(f"attn={args.attn} cp={args.cp} dp={dp_size} device={dev} params={n / 1e6:.2f}M "
              f"seqlen={args.seqlen} batch={args.batch} pack={args.pack}", flush=True)
    history = []
    for step in range(1, args.steps + 1):
        raw = {k: v.to(dev) for k, v in next(batches).items()}
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            if cp_group is not None:
                batch = cp.shard_batch(raw["input_ids"], labels=raw["input_ids"], position_ids=raw.get("position_ids"),
                                       group=cp_group, check=step == 1)
                loss = model(**batch).loss  # this rank's share of the token-weighted mean
            else:
                loss = model(**raw, labels=raw["input_ids"], use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cp_group is not None:
            cp.all_reduce_grads(model, cp_group)  # sum: the gradient of the unsharded loss
            loss = cp.reduce_loss(loss, cp_group)
        if dp_group is not None:
            cp.all_reduce_grads(model, dp_group)
            for x in model.parameters():
                if x.grad is not None:
                    x.grad.div_(dp_size)
            loss = cp.reduce_loss(loss, dp_group) / dp_size
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()  # waits for the step
        dt = time.perf_counter() - t0
        history.append(value)
        tokens = args.batch * args.seqlen * dp_size
        if rank == 0:
            print(progress(step, args.steps, value, tokens / dt, tokens / dt / world), flush=True)
    return history


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
