"""python -m longattn.bench hf-train: the training step of a transformers model
(forward + backward + optimizer step) of one family (``--family``: Llama, Gemma 2,
GPT-OSS, Llama 4 text) under each attention implementation, several in one run
(one JSON, rows side by side, the same weights and batch for each).

    # one GPU: ours, transformers' SDPA and FlexAttention on 16 packed documents, one run
    python -m longattn.bench hf-train --attn longattn sdpa flex_attention --seqlen 32768 --docs 16
    python -m longattn.bench hf-train --attn longattn sdpa --seqlen 131072 --grad-ckpt
    # two GPUs (context parallelism)
    torchrun --nproc_per_node=2 -m longattn.bench hf-train --attn longattn_ring torch_cp --seqlen 131072 --grad-ckpt
    # Gemma 2 (soft-capping), GPT-OSS (sinks), Llama 4 (chunks) against transformers' own attention
    python -m longattn.bench hf-train --family gemma2 --attn longattn eager flex_attention --seqlen 16384 --grad-ckpt
    # CPU smoke run (also under torchrun, gloo)
    python -m longattn.bench hf-train --tiny --attn longattn sdpa

Model: ~1.1B parameters of the family (longattn.bench.hf_models), random weights,
bf16 on CUDA (fp32 on CPU), AdamW (fused on CUDA). Data: random tokens, batch 1
by default, the same on every run. Loss: token-weighted cross entropy in chunks
of --loss-chunk tokens (each chunk's logits recomputed in the backward), the same
code for every attention; each row's initial loss (before any optimizer step) is
compared with the first row's (``loss_check``: equal to 4 digits within 5e-4).
Packed documents (--docs N): position_ids restart at each document and no
attention mask is passed, from which transformers builds each implementation's
packed-document mask (a 4-D mask for sdpa, a block mask for flex_attention).

Attention (``--attn``, one or more; one device or torchrun, not mixed):
  sdpa               transformers' own SDPA attention (torch picks the kernel)
  eager              transformers' eager attention (the reference of Gemma 2 and GPT-OSS)
  flex_attention     transformers' own FlexAttention (compiled, its block mask)
  flash_attention_2  transformers' flash-attn 2 path (where flash_attn is installed)
  longattn           attn_implementation="longattn" (cuDNN on Hopper through longattn.attention)
  longattn_ring      attn_implementation="longattn_ring", the batch sharded by
                     longattn.context_parallel.shard_batch (zigzag), gradients summed over ranks
  torch_cp           torch.distributed.tensor.experimental.context_parallel around SDPA at its
                     best: native GQA (enable_gqa, K/V not repeated), causal load balancing,
                     the faster rotate method of the run, cuDNN first (recorded in the row)

Timing: CUDA events around each whole step (zero_grad, forward, backward,
gradient all-reduce, optimizer step) after --warmup steps; the median of
--steps. Memory: ``torch.cuda.max_memory_allocated`` during the timed steps,
absolute and minus what was allocated before them (weights, optimizer state),
plus the symmetric-memory exchange slots of longattn's copy transport (outside
the allocator's counters, as `bench dist` counts them). A step that runs out of
memory is recorded as such (exit code 0), with the allocator's numbers at that
point. Tokens/s per GPU: tokens of the global batch / step time / number of
GPUs. Results are JSON (and CSV) with the device, versions, commit and command;
the default file name carries the commit.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import hf_models
from .hf_models import FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ONE_DEVICE = ("sdpa", "eager", "flex_attention", "flash_attention_2", "longattn")
ATTN = ONE_DEVICE + ("longattn_ring", "torch_cp")


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m longattn.bench hf-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", choices=ATTN, nargs="+", default=["longattn"],
                   help="attention implementations, timed one after the other in this run")
    p.add_argument("--seqlen", type=int, default=None, help="tokens per sequence (default 32768; --tiny 256)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=1, help="packed documents per sequence (position_ids restarting)")
    p.add_argument("--layout", choices=["zigzag", "contiguous", "documents"], default="zigzag",
                   help="longattn_ring's sharding (shard_batch layout; documents: held whole where they fit)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    p.add_argument("--family", choices=FAMILIES, default="llama", help="model family (longattn.bench.hf_models)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab"):
        p.add_argument(f"--{flag}", type=int, default=None, help="overrides the family's value")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of every decoder layer")
    p.add_argument("--loss-chunk", type=int, default=8192)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--tiny", action="store_true", help="the family at hidden 64, vocab 256, 256 tokens")
    p.add_argument("--profile", action="store_true", help="also record the top kernels of one step")
    p.add_argument("--out", default=None, help="JSON path, {commit} filled in (default benchmarks/results/"
                                                "hf_train_..._COMMIT.json on CUDA; none with --tiny)")
    p.add_argument("--timeout-s", type=int, default=900, help="process-group timeout (a stuck collective dies)")
    a = p.parse_args(argv)
    hf_models.fill_shape(a)
    if a.tiny:
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
    multi = [a for a in args.attn if a not in ONE_DEVICE]
    if multi and world < 2:
        raise SystemExit(f"--attn {' '.join(multi)} runs over several ranks: start it with torchrun "
                         "--nproc_per_node=N -m longattn.bench hf-train ...")
    one = [a for a in args.attn if a in ONE_DEVICE]
    if one and world > 1:
        raise SystemExit(f"--attn {' '.join(one)}: the one-device rows; run them without torchrun")
    return world, dev


def unavailable(attn: str, family: str = "llama", docs: int = 1) -> Optional[str]:
    """Why transformers cannot run ``attn`` here (None: it can)."""
    why = hf_models.unavailable(family, attn, docs)
    if why:
        return why
    if attn == "flash_attention_2":
        # flash-attn-4 installs a `flash_attn` namespace too (flash_attn.cute), so ask for the flash-attn 2
        # distribution, as transformers does before it dispatches
        from importlib import metadata

        try:
            metadata.version("flash-attn")
        except metadata.PackageNotFoundError:
            return "not installed here: transformers' flash_attention_2 needs the flash-attn (2) package"
    return None


def _register_torch_cp():
    """SDPA as torch's context parallel runs it at its best: K/V with their own
    head count (``enable_gqa``; the ring rotates the smaller K/V), causal, no mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("torch_cp_sdpa", attn)
    AttentionMaskInterface.register("torch_cp_sdpa", lambda *a, **k: None)
    return "torch_cp_sdpa"


def build_model(args, attn, dev, dtype):
    from transformers import AutoModelForCausalLM

    import longattn.integrations.transformers as lt

    lt.register()
    impl = _register_torch_cp() if attn == "torch_cp" else attn
    config = hf_models.make_config(args)
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
    # made on the host whatever the default device (torch.set_default_device), then moved
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=g, device="cpu")
    pos = None
    if args.docs > 1:  # equal documents, the last one takes the remainder
        n = args.seqlen // args.docs
        starts = [i * n for i in range(args.docs)]
        p = torch.arange(args.seqlen, device="cpu")
        cpu = lambda x: torch.tensor(x, device="cpu")
        p = p - cpu(starts)[torch.searchsorted(cpu(starts[1:]), p, right=True)]
        pos = p.expand(args.batch, -1).contiguous()
    return ids.to(dev), (pos.to(dev) if pos is not None else None)


def chunked_loss(model, hidden, shift_labels, num_items, chunk: int):
    """sum(cross entropy over target tokens) / num_items; each chunk's logits
    (float32, soft-capped where the model caps them: Gemma 2) live only inside
    its checkpointed call."""
    from torch.utils.checkpoint import checkpoint

    w = model.lm_head.weight
    h = hidden.reshape(-1, hidden.shape[-1])
    t = shift_labels.reshape(-1)

    cap = hf_models.final_softcap(model)

    def part(hc, tc):
        logits = (hc @ w.t()).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return torch.nn.functional.cross_entropy(logits, tc, ignore_index=-100, reduction="sum")

    total = sum(checkpoint(part, h[i:i + chunk], t[i:i + chunk], use_reentrant=False)
                for i in range(0, h.shape[0], chunk))
    return total / num_items


def _shift(ids):
    out = torch.full_like(ids, -100)
    out[:, :-1] = ids[:, 1:]
    return out


def _labels(args, ids, pos):
    shift = _shift(ids)
    if pos is not None:  # a document's last token does not predict the next document
        shift[:, :-1][pos[:, 1:] == 0] = -100
    return shift, (shift != -100).sum()


def _torch_cp_setup(args, world, dev, ids, pos, shift, num_items, info):
    """(context manager, model inputs, local labels, items) of torch's context_parallel:
    the buffers sharded on entry (head-tail balanced), SDPA's CP kernels, cuDNN first."""
    if pos is not None:
        raise NotImplementedError("torch's context_parallel has no packed-document mode")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import sdpa_kernel

    from .torch_cp import sdpa_backends

    # causal load balancing (head-tail chunks, like zigzag): read by context_parallel on entry
    _cp_options.enable_load_balance = info["load_balance"] = args.seqlen % (2 * world) == 0
    mesh = init_device_mesh(dev.type, (world,))
    pos_full = torch.arange(args.seqlen, device=dev).expand(args.batch, -1).contiguous()
    ids_b, shift_b = ids.clone(), shift.clone()
    bufs = [ids_b, pos_full, shift_b]
    stack = contextlib.ExitStack()
    stack.enter_context(context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1],
                                         no_restore_buffers=set(bufs)))
    stack.enter_context(sdpa_kernel(sdpa_backends(), set_priority=True))
    return stack, dict(input_ids=ids_b, position_ids=pos_full), shift_b, num_items


def _pick_rotate(step, world, dev, info, steps: int = 2) -> list:
    """Time torch's two rotate methods (``steps`` steps each after one untimed)
    and keep the faster; the slowest rank's time decides, so all ranks agree.
    Returns the probe steps' losses, in order: they train the model, so the
    row's initial loss is the first of them."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from .torch_cp import ROTATE_METHODS

    probe, losses = {}, []
    for method in ROTATE_METHODS:
        set_rotate_method(method)
        losses.append(step())
        times, timed = _timed_steps(step, dev, steps)
        losses += timed
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        probe[method] = round(t.item(), 3)
    info.update(rotate_probe_ms=probe, rotate_method=min(ROTATE_METHODS, key=lambda m: probe[m]))
    set_rotate_method(info["rotate_method"])
    return losses


def _timed_steps(step, dev, n):
    """(step ms, losses) of ``n`` steps: CUDA events around each, wall clock on CPU."""
    times, losses = [], []
    for _ in range(n):
        if dev.type == "cuda":
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
    return times, losses


def run(args, world, dev, attn: Optional[str] = None):
    """One implementation's row (``attn``; default the first of ``args.attn``)."""
    from longattn import context_parallel as cp
    from longattn.distributed import transport

    attn = attn or args.attn[0]
    dtype = torch.bfloat16 if (args.dtype or ("bf16" if dev.type == "cuda" else "fp32")) == "bf16" else torch.float32
    head = dict(attn=attn, family=args.family, seqlen=args.seqlen, batch=args.batch, docs=args.docs,
                layout=args.layout, world=world, grad_ckpt=args.grad_ckpt, dtype=str(dtype).replace("torch.", ""))
    why = unavailable(attn, args.family, args.docs)
    if why:
        return dict(head, step_ms_median=None, step_ms=[], tokens_per_s_per_gpu=None, peak_mem_gib=None,
                    peak_extra_gib=None, base_mem_gib=None, losses=[], initial_loss=None, error=why,
                    top_kernels=None)
    model = build_model(args, attn, dev, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    ids, pos = make_batch(args, dev)
    shift, num_items = _labels(args, ids, pos)
    group = dist.group.WORLD if world > 1 else None
    ctx, info = contextlib.nullcontext(), {}
    model_in = dict(input_ids=ids, position_ids=pos) if pos is not None else dict(input_ids=ids)
    local_shift, local_items = shift, num_items
    if attn == "longattn_ring":
        # shard_batch shifts the labels itself: unshifted labels whose shift is `shift`
        batch = cp.shard_batch(ids, labels=torch.cat([ids[:, :1], shift[:, :-1]], dim=1), position_ids=pos,
                               group=group, layout=args.layout)
        model_in = {k: v for k, v in batch.items()
                    if k not in ("labels", "shift_labels", "num_items_in_batch", "use_cache")}
        local_shift, local_items = batch["shift_labels"], batch["num_items_in_batch"]

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
    if world > 1:  # a collective (every rank at this point); a one-device row holds no slots of its own
        transport.release_slots()
    try:
        if attn == "torch_cp":
            ctx, model_in, local_shift, local_items = _torch_cp_setup(args, world, dev, ids, pos, shift,
                                                                      num_items, info)
        with ctx:
            if attn == "torch_cp":
                losses += _pick_rotate(step, world, dev, info)
                info["sdpa_backends"] = "cudnn, flash, efficient (first that fits)"
            losses += [step() for _ in range(args.warmup)]
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            times, timed_losses = _timed_steps(step, dev, args.steps)
            losses += timed_losses
            if cuda:  # exchange slots in symmetric memory live outside the allocator's counters
                peak = torch.cuda.max_memory_allocated() + (transport.symmetric_bytes() if world > 1 else 0)
            if args.profile:
                from longattn.bench.measure import profile_top_kernels

                kernels = profile_top_kernels(step, dev)
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0]}"
        if cuda:
            peak = torch.cuda.max_memory_allocated()
    except NotImplementedError as e:  # e.g. torch's context_parallel on CPU (no sharding rule for the CPU kernel)
        error = f"not supported here: {str(e).splitlines()[0]}"
    finally:
        if attn == "torch_cp":
            from torch.distributed.tensor.experimental._attention import _cp_options

            _cp_options.enable_load_balance = True  # torch's default
    loss_vals = [float(x) for x in losses]
    if world > 1 and loss_vals and error is None:
        t = torch.tensor(loss_vals, dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        loss_vals = t.tolist()
    med = statistics.median(times) if times and error is None else None
    tokens = args.batch * args.seqlen
    gib = lambda x: None if x is None else round(x / 2 ** 30, 3)
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return dict(head, params=n_params, step_ms_median=None if med is None else round(med, 3),
                step_ms=[round(x, 3) for x in times],
                tokens_per_s_per_gpu=None if med is None else round(tokens / (med / 1e3) / world, 1),
                peak_mem_gib=gib(peak), peak_extra_gib=gib(None if peak is None or base is None else peak - base),
                base_mem_gib=gib(base), losses=[round(x, 5) for x in loss_vals],
                initial_loss=loss_vals[0] if loss_vals else None, error=error, top_kernels=kernels,
                **({"torch_cp": info} if info else {}))


def _command(world: int, argv) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                     if k.startswith("LONGATTN_") and k != "LONGATTN_COMMIT")
    launcher = f"torchrun --nproc_per_node={world}" if world > 1 else "python"
    return " ".join(x for x in (knobs, launcher, "-m longattn.bench hf-train", *argv) if x)


def default_out(args, world: int, commit: str) -> str:
    tag = f"_{args.family}" if args.family != "llama" else ""
    tag += f"_docs{args.docs}" if args.docs > 1 else ""
    tag += "_ckpt" if args.grad_ckpt else ""
    return os.path.join(ROOT, "benchmarks", "results",
                        f"hf_train_{'_'.join(args.attn)}_s{args.seqlen}_w{world}{tag}_{commit}.json")


def loss_check(rows) -> dict:
    """Each row's initial loss against the first row's that has one: the
    relative difference, and whether they agree to 4 significant digits."""
    done = [r for r in rows if r.get("initial_loss") is not None]
    if not done:
        return {}
    ref = done[0]["initial_loss"]
    out = {"reference": done[0]["attn"]}
    for r in done[1:]:
        rel = abs(r["initial_loss"] - ref) / max(abs(ref), 1e-30)
        out[r["attn"]] = dict(rel_diff=float(f"{rel:.3g}"), agree_4_digits=rel <= 5e-4)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    owned = not dist.is_initialized()  # under torchrun this command starts and ends the process group
    world, dev = _setup_dist(args)
    import transformers

    from longattn.bench.measure import environment, result_path, short_commit, write_json

    rows = [run(args, world, dev, attn) for attn in args.attn]
    env = environment(dev)
    env.update(command=_command(world, argv), transformers=transformers.__version__,
               python=platform.python_version(), world_size=world)
    payload = dict(benchmark="hf_train", env=env, args=vars(args), family=args.family,
                   model_config=hf_models.config_kwargs(args), loss_check=loss_check(rows), results=rows)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out = result_path(args.out) if args.out else None
        if out is None and not args.tiny:
            out = default_out(args, world, short_commit(env.get("commit")))
        if out:
            write_json(out, payload)
        for row in rows:
            print(json.dumps({k: row.get(k) for k in ("attn", "family", "seqlen", "docs", "layout", "world",
                                                      "step_ms_median", "tokens_per_s_per_gpu", "peak_mem_gib",
                                                      "peak_extra_gib", "initial_loss", "error")}), flush=True)
        print(json.dumps({"loss_check": payload["loss_check"]}), flush=True)
        if out:
            print(f"wrote {out}", flush=True)
    if dist.is_initialized() and owned:
        dist.barrier()
        dist.destroy_process_group()
    return payload


if __name__ == "__main__":
    main()
