"""Training step of a Llama-shaped transformers model: forward + backward +
optimizer step, under each attention implementation.

    # one GPU
    python benchmarks/hf_train.py --attn sdpa --seqlen 32768 --out benchmarks/results/x.json
    python benchmarks/hf_train.py --attn longattn --seqlen 131072 --grad-ckpt
    python benchmarks/hf_train.py --attn longattn --seqlen 32768 --docs 16      # 16 packed documents
    # two GPUs (context parallelism)
    torchrun --nproc_per_node=2 benchmarks/hf_train.py --attn longattn_ring --seqlen 131072 --grad-ckpt
    torchrun --nproc_per_node=2 benchmarks/hf_train.py --attn torch_cp --seqlen 131072 --grad-ckpt
    # CPU smoke run (also under torchrun, gloo)
    python benchmarks/hf_train.py --tiny --attn longattn

Model (default ~1.1B parameters with --vocab 32000): 16 layers, hidden 2048,
16 query / 4 KV heads (head dim 128), MLP 8192, RoPE, random weights, bf16 on
CUDA (fp32 on CPU), AdamW (fused on CUDA). Data: random tokens, batch 1 by
default, the same on every run. The loss is the token-weighted cross
entropy computed in chunks of --loss-chunk tokens (each chunk's logits are
recomputed in the backward), so that the vocabulary projection does not
dominate memory at long lengths; it is the same code for every attention.

Attention (``--attn``):
  sdpa           transformers' own SDPA attention (torch picks the kernel)
  longattn       attn_implementation="longattn" (cuDNN on Hopper through longattn.attention)
  longattn_ring  attn_implementation="longattn_ring", the batch sharded by
                 longattn.context_parallel.shard_batch (zigzag), gradients summed over ranks
  torch_cp       torch.distributed.tensor.experimental.context_parallel around an SDPA model
                 (K/V repeated to every query head: torch's CP has no GQA; causal load balancing)

Timing: CUDA events around each whole step (zero_grad, forward, backward,
gradient all-reduce, optimizer step) after --warmup steps; the median of
--steps. Memory: ``torch.cuda.max_memory_allocated`` during the timed steps,
absolute and minus what was allocated before them (weights, optimizer state).
A step that runs out of memory is recorded as such (exit code 0), with the
allocator's numbers at that point. Tokens/s per GPU: tokens of the global
batch / step time / number of GPUs. Results are JSON (and CSV) with the
device, versions, commit and command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTN = ("sdpa", "longattn", "longattn_ring", "torch_cp")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", choices=ATTN, default="longattn")
    p.add_argument("--seqlen", type=int, default=None, help="tokens per sequence (default 32768; --tiny 256)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=1, help="packed documents per sequence (position_ids restarting)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of every decoder layer")
    p.add_argument("--loss-chunk", type=int, default=8192)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, 4/2 heads, vocab 256, 256 tokens")
    p.add_argument("--profile", action="store_true", help="also record the top kernels of one step")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/hf_train_...json on CUDA; "
                                                "none with --tiny)")
    p.add_argument("--timeout-s", type=int, default=900, help="process-group timeout (a stuck collective dies)")
    a = p.parse_args(argv)
    if a.tiny:
        a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.vocab = 2, 64, 4, 2, 128, 256
        a.loss_chunk = min(a.loss_chunk, 128)
    a.seqlen = a.seqlen or (256 if a.tiny else 32768)
    a.steps = a.steps or (3 if a.tiny else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    return a


def _setup_dist(args):
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=args.timeout_s))
    world = dist.get_world_size() if dist.is_initialized() else 1
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if args.attn in ("longattn_ring", "torch_cp") and world < 2:
        raise SystemExit(f"--attn {args.attn} runs over several ranks: start it with torchrun --nproc_per_node=N")
    if args.attn in ("sdpa", "longattn") and world > 1:
        raise SystemExit(f"--attn {args.attn} is the one-device row: run it without torchrun")
    return world, dev


def _register_torch_cp():
    """SDPA with K/V repeated to every query head (torch's context parallel
    dispatches only SDPA calls without GQA), causal, no mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        g = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("torch_cp_sdpa", attn)
    AttentionMaskInterface.register("torch_cp_sdpa", lambda *a, **k: None)
    return "torch_cp_sdpa"


def build_model(args, dev, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    import longattn.integrations.transformers as lt

    lt.register()
    impl = _register_torch_cp() if args.attn == "torch_cp" else args.attn
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seqlen, 8192),
                         rope_theta=500000.0, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=dtype)
    if args.grad_ckpt:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def make_batch(args, dev):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=g)
    pos = None
    if args.docs > 1:  # equal documents, the last one takes the remainder
        n = args.seqlen // args.docs
        starts = [i * n for i in range(args.docs)]
        p = torch.arange(args.seqlen)
        p = p - torch.tensor(starts)[torch.searchsorted(torch.tensor(starts[1:]), p, right=True)]
        pos = p.expand(args.batch, -1).contiguous()
    return ids.to(dev), (pos.to(dev) if pos is not None else None)


def chunked_loss(model, hidden, shift_labels, num_items, chunk: int):
    """sum(cross entropy over target tokens) / num_items; each chunk's logits
    (float32) live only inside its checkpointed call."""
    from torch.utils.checkpoint import checkpoint

    w = model.lm_head.weight
    h = hidden.reshape(-1, hidden.shape[-1])
    t = shift_labels.reshape(-1)

    def part(hc, tc):
        logits = (hc @ w.t()).float()
        return torch.nn.functional.cross_entropy(logits, tc, ignore_index=-100, reduction="sum")

    total = sum(checkpoint(part, h[i:i + chunk], t[i:i + chunk], use_reentrant=False)
                for i in range(0, h.shape[0], chunk))
    return total / num_items


def _shift(ids):
    out = torch.full_like(ids, -100)
    out[:, :-1] = ids[:, 1:]
    return out


def run(args, world, dev):
    from longattn import context_parallel as cp

    dtype = torch.bfloat16 if (args.dtype or ("bf16" if dev.type == "cuda" else "fp32")) == "bf16" else torch.float32
    model = build_model(args, dev, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    ids, pos = make_batch(args, dev)
    shift = _shift(ids)
    if pos is not None:  # a document's last token does not predict the next document
        shift[:, :-1][pos[:, 1:] == 0] = -100
    num_items = (shift != -100).sum()
    group = dist.group.WORLD if world > 1 else None
    ctx_manager = None

    if args.attn == "longattn_ring":
        # shard_batch shifts the labels itself: unshifted labels whose shift is `shift`
        batch = cp.shard_batch(ids, labels=torch.cat([ids[:, :1], shift[:, :-1]], dim=1), position_ids=pos,
                               group=group)
        model_in = {k: v for k, v in batch.items()
                    if k not in ("labels", "shift_labels", "num_items_in_batch", "use_cache")}
        local_shift, local_items = batch["shift_labels"], batch["num_items_in_batch"]
    elif args.attn == "torch_cp":
        if pos is not None:
            raise NotImplementedError("torch's context_parallel has no packed-document mode")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:  # causal load balancing (head-tail chunks, like zigzag); on by default, set to be explicit
            from torch.distributed.tensor.experimental._attention import _cp_options

            _cp_options.enable_load_balance = True
        except ImportError:  # pragma: no cover - a torch without the option
            pass
        mesh = init_device_mesh(dev.type, (world,))
        pos_full = torch.arange(args.seqlen, device=dev).expand(args.batch, -1).contiguous()
        ids_b, shift_b = ids.clone(), shift.clone()
        bufs = [ids_b, pos_full, shift_b]
        backends = ([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                   if dev.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])

        class _Both:
            def __enter__(self):
                self.a = context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs))
                self.b = sdpa_kernel(backends)
                self.a.__enter__()
                self.b.__enter__()

            def __exit__(self, *exc):
                self.b.__exit__(*exc)
                return self.a.__exit__(*exc)

        ctx_manager = _Both()
        model_in = dict(input_ids=ids_b, position_ids=pos_full)
        local_shift, local_items = shift_b, num_items
    else:
        model_in = dict(input_ids=ids, position_ids=pos) if pos is not None else dict(input_ids=ids)
        local_shift, local_items = shift, num_items

    def step():
        opt.zero_grad(set_to_none=True)
        hidden = model.model(**model_in, use_cache=False).last_hidden_state
        loss = chunked_loss(model, hidden, local_shift, local_items, args.loss_chunk)
        loss.backward()
        if world > 1:
            cp.all_reduce_grads(model, group)
        opt.step()
        return loss.detach()

    cuda = dev.type == "cuda"
    times, losses, base, peak, error, kernels = [], [], None, None, None, None
    try:
        if ctx_manager is not None:
            ctx_manager.__enter__()
        try:
            for _ in range(args.warmup):
                losses.append(step())
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.steps):
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    losses.append(step())
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b))
                else:
                    t0 = time.perf_counter()
                    losses.append(step())
                    times.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                peak = torch.cuda.max_memory_allocated()
            if args.profile:
                from longattn.bench.measure import profile_top_kernels

                kernels = profile_top_kernels(step, dev)
        finally:
            if ctx_manager is not None:
                ctx_manager.__exit__(None, None, None)
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0]}"
        if cuda:
            peak = torch.cuda.max_memory_allocated()
    except NotImplementedError as e:  # e.g. torch's context_parallel on CPU (no sharding rule for the CPU kernel)
        error = f"not supported here: {str(e).splitlines()[0]}"
    loss_vals = [float(x) for x in losses]
    if world > 1 and loss_vals and error is None:
        t = torch.tensor(loss_vals, dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        loss_vals = t.tolist()
    med = statistics.median(times) if times and error is None else None
    tokens = args.batch * args.seqlen
    gib = lambda x: None if x is None else round(x / 2 ** 30, 3)
    return dict(attn=args.attn, seqlen=args.seqlen, batch=args.batch, docs=args.docs, world=world,
                grad_ckpt=args.grad_ckpt, dtype=str(dtype).replace("torch.", ""), params=n_params,
                step_ms_median=None if med is None else round(med, 3),
                step_ms=[round(x, 3) for x in times],
                tokens_per_s_per_gpu=None if med is None else round(tokens / (med / 1e3) / world, 1),
                peak_mem_gib=gib(peak), peak_extra_gib=gib(None if peak is None or base is None else peak - base),
                base_mem_gib=gib(base), losses=[round(x, 5) for x in loss_vals], error=error, top_kernels=kernels)


def _command(world: int) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                     if k.startswith("LONGATTN_") and k != "LONGATTN_COMMIT")
    launcher = f"torchrun --nproc_per_node={world}" if world > 1 else "python"
    return " ".join(x for x in (knobs, launcher, *sys.argv) if x)


def main(argv=None):
    args = parse(argv)
    owned = not dist.is_initialized()  # under torchrun this script starts and ends the process group
    world, dev = _setup_dist(args)
    import transformers

    from longattn.bench.measure import environment, write_json

    row = run(args, world, dev)
    env = environment(dev)
    env.update(command=_command(world), transformers=transformers.__version__, python=platform.python_version())
    payload = dict(benchmark="hf_train", env=env, args=vars(args), results=[row])
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out = args.out
        if out is None and not args.tiny:
            tag = f"_docs{args.docs}" if args.docs > 1 else ""
            tag += "_ckpt" if args.grad_ckpt else ""
            commit = (env.get("commit") or "nocommit")[:7]
            out = os.path.join(ROOT, "benchmarks", "results",
                               f"hf_train_{args.attn}_s{args.seqlen}_w{world}{tag}_{commit}.json")
        if out:
            write_json(out, payload)
        summary = {k: row[k] for k in ("attn", "seqlen", "docs", "world", "step_ms_median", "tokens_per_s_per_gpu",
                                       "peak_mem_gib", "peak_extra_gib", "error")}
        print(json.dumps(summary), flush=True)
        if out:
            print(f"wrote {out}", flush=True)
    if dist.is_initialized() and owned:
        dist.barrier()
        dist.destroy_process_group()
    return payload


if __name__ == "__main__":
    main()
