"""Run a function on several ranks (gloo: processes forked from a server that has
imported torch and longattn; NCCL with LONGATTN_DIST_BACKEND=nccl on GPU machines:
spawned processes); an exception on any rank fails the test."""
from __future__ import annotations

import os
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import longattn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BACKEND = os.environ.get("LONGATTN_DIST_BACKEND", "gloo")

# gloo ranks fork from a server that has imported torch and longattn once
# (spawning each rank afresh re-imports them: seconds per rank, most of a
# distributed test's time). NCCL ranks are spawned: a server that touched CUDA
# cannot fork ranks that use it.
mp.set_forkserver_preload(["torch", "longattn", "dist_utils"])

# Run in a rank after its process group is destroyed, last (forked ranks leave
# through os._exit, so atexit handlers never run there).
_AT_TEARDOWN: list = []


def at_teardown(f) -> None:
    _AT_TEARDOWN.append(f)


def _entry(rank, world, port, fn, args, backend=None, done_dir=None):
    backend = backend or BACKEND
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":  # the same tests on GPUs: tensors are made on this rank's device
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(backend, rank=rank, world_size=world)
    fn(rank, world, *args)
    # Every rank finishes its traffic before any tears down: a rank that closes
    # its sockets while a peer's gloo thread still reads them aborts that peer.
    # (On failure the exception propagates and spawn terminates the others.)
    dist.barrier()
    if done_dir is not None:  # every rank's checks have passed
        open(os.path.join(done_dir, str(rank)), "w").close()
    dist.destroy_process_group()
    for f in _AT_TEARDOWN:
        f()


def generator(seed: int) -> torch.Generator:
    """A generator seeded alike on every rank, on the default device (this
    rank's GPU under NCCL, where a CPU generator cannot feed ``torch.randn``)."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def run_world(fn, world: int, *args, backend=None) -> None:
    """fn(rank, world, *args) on `world` ranks (gloo, or LONGATTN_DIST_BACKEND, or
    ``backend``); fn must be a module-level function.

    A rank killed by a signal fails the test unless every rank had already
    passed its checks and the barrier after them: gloo's worker threads can
    abort a process while it tears down ("terminate called without an active
    exception", seen once in CI in hundreds of runs); that is reported as a
    warning, not a failure of the code under test."""
    if (backend or BACKEND) == "nccl" and world > torch.cuda.device_count():
        import pytest

        pytest.skip(f"NCCL: {world} ranks need {world} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as done:
        try:
            method = "forkserver" if (backend or BACKEND) == "gloo" else "spawn"
            mp.start_processes(_entry, args=(world, _free_port(), fn, args, backend, done), nprocs=world, join=True,
                               start_method=method)
        except mp.ProcessExitedException as e:
            if len(os.listdir(done)) < world:
                raise
            warnings.warn(f"a rank aborted during process-group teardown after all ranks passed: {e}")


def _expect(got: dict, ref_out, ref_lse, ref_grads, tol, tag) -> None:
    from reference import GRAD_NAMES, assert_close

    assert_close(got, dict(out=ref_out, lse=ref_lse, **dict(zip(GRAD_NAMES, ref_grads))), tol, tag)


def _unsharded(unshard, out, lse, grads, lse_dim) -> dict:
    """The whole output, lse and q/k/v gradients from this rank's shards (collectives: every rank calls it)."""
    from reference import GRAD_NAMES

    return dict(out=unshard(out.detach()), lse=unshard(lse.detach(), lse_dim),
                **{n: unshard(g) for n, g in zip(GRAD_NAMES, grads)})


def assert_unsharded_close(tag, unshard, out, lse, grads, ref_out, ref_lse, ref_grads, tol, lse_dim=2):
    """Unshard this rank's output, lse and q/k/v gradients and compare each with
    the float64 reference (reference.assert_close); the message names what failed."""
    _expect(_unsharded(unshard, out, lse, grads, lse_dim), ref_out, ref_lse, ref_grads, tol, tag)


def assert_unsharded_matches(tag, unshard, out, lse, grads, reference, tol, lse_dim=2):
    """:func:`assert_unsharded_close` with the float64 reference made by
    ``reference()`` -> (out, lse, (dq, dk, dv)) on rank 0 alone, after every
    rank has unsharded (collectives): rank 0 then holds every rank's shard, so
    it checks them all, and the reference is paid once instead of once per
    rank (the ranks of a test share the machine's cores)."""
    got = _unsharded(unshard, out, lse, grads, lse_dim)
    if dist.get_rank() == 0:
        _expect(got, *reference(), tol, tag)


def assert_group_usable(world: int, group=None) -> None:
    """After an error that must leave no collective half-started: one more all-reduce completes."""
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == world


def assert_compiled_matches_eager(f, inputs) -> None:
    """f(*inputs) -> out or (out, lse): a fullgraph torch.compile (aot_eager) of f
    gives the eager values and gradients (loss: out^2 summed, plus lse summed)."""
    res = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        x = [t.clone().requires_grad_() for t in inputs]
        got = fn(*x)
        out, lse = got if isinstance(got, tuple) else (got, None)
        loss = out.square().sum() + (0 if lse is None else lse.sum())
        loss.backward()
        res.append([out.detach()] + ([] if lse is None else [lse.detach()]) + [t.grad for t in x])
    for got, want in zip(*res):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def dense_inputs(b: int, s: int, h: int, hkv: int, d: int):
    """Random q, k, v (B, S, H/Hkv, D), an output gradient and an lse gradient (B, H, S)."""
    return (torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d), torch.randn(b, s, h, d),
            torch.randn(b, h, s))


def varlen_inputs(lens, h: int, hkv: int, d: int, seed: int):
    """Packed documents of ``lens`` tokens: int32 cu_seqlens, q, k, v (T, H/Hkv, D), dO and dlse (H, T)."""
    torch.manual_seed(seed)
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    return (cu, torch.randn(total, h, d), torch.randn(total, hkv, d), torch.randn(total, hkv, d),
            torch.randn(total, h, d), torch.randn(h, total))


def run_sharded(op, q, k, v, do, dl, layout: str, **kw):
    """``op`` on q/k/v sharded in ``layout`` (return_lse), backward of
    sum(out * do) + sum(finite lse * dl) on the shards; returns (unshard,
    out, lse, (dq, dk, dv)) for :func:`assert_unsharded_close`."""
    sh = lambda x, dim=1: longattn.shard(x, layout=layout, seq_dim=dim)
    ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
    out, lse = op(ql, kl, vl, layout=layout, return_lse=True, **kw)
    ((out * sh(do)).sum() + (torch.where(torch.isfinite(lse), lse, 0) * sh(dl, 2)).sum()).backward()
    unshard = lambda x, dim=1: longattn.unshard(x, layout=layout, seq_dim=dim)
    return unshard, out, lse, (ql.grad, kl.grad, vl.grad)
