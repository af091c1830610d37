"""The benchmark CLI on CPU: every command on tiny configs, JSON schema,
report with a PNG, memory measurement of a known allocation."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from longattn.bench import configs as C
from longattn.bench.__main__ import main
from longattn.bench.impls import IMPLS, fwd_flops, useful_pairs
from longattn.bench.measure import peak_memory_bytes

ROW_KEYS = {"config", "impl", "status", "seqlen", "batch", "heads", "kv_heads", "head_dim", "causal"}


def test_list_has_required_configs(capsys):
    main(["list"])
    out = capsys.readouterr().out
    for name in ("tiny", "small", "medium", "large", "large_seq", "xlarge", "hd256", "many_heads", "window_small",
                 "gqa_llama70b", "gqa_32q4kv_d64", "gqa_llama8b", "longnet_1m", "varlen_mix_32k"):
        assert f"| {name} |" in out
    assert C.get("gqa_llama70b").hkv == 8 and C.get("gqa_32q4kv_d64").hkv == 4


def test_config_validation():
    with pytest.raises(ValueError, match="kv_heads"):
        C.Config("bad", 1, 16, 6, 8, kv_heads=4)
    with pytest.raises(ValueError, match="unknown config"):
        C.get("nope")


class _OnceBackward(torch.autograd.Function):
    """x * 2 whose backward refuses a second run on the same graph (as torch.compile's, which donates the
    buffers it saved)."""

    @staticmethod
    def forward(ctx, x):
        ctx.ran = False
        return x * 2

    @staticmethod
    def backward(ctx, g):
        if ctx.ran:
            raise RuntimeError("This backward function was compiled with non-empty donated buffers")
        ctx.ran = True
        return g * 2


def test_backward_alone_after_a_fresh_forward_where_it_cannot_run_twice():
    """A backward that cannot be replayed is timed after an untimed fresh forward per sample (cold timing; the
    row says how and why); batched timing cannot interleave those forwards and says so."""
    from longattn.bench import single

    x = torch.randn(64, 8, requires_grad=True)
    forwards = []

    def fn(x):
        forwards.append(1)
        return _OnceBackward.apply(x)

    for batched, timed_ok in ((False, True), (True, False)):
        row, forwards[:] = {"fwd_flops": 1e6}, []
        timed = single._timer(torch.device("cpu"), 1, 3, batched, None)
        single._time_backward_alone(row, fn, (x,), torch.ones(64, 8), timed)
        if timed_ok:
            assert row["bwd_ms"] > 0 and row["bwd_tflops"] > 0 and "bwd_alone_reason" not in row
            assert row["bwd_method"] == "after a fresh forward per sample"
            assert "donated buffers" in row["bwd_replay_reason"]
            assert len(forwards) == 1 + 1 + 3  # the kept graph's, then one per warm-up call and per sample
            assert x.grad is None
        else:
            assert "bwd_ms" not in row and "donated buffers" in row["bwd_alone_reason"]
            assert "cold timing" in row["bwd_alone_reason"] and len(forwards) == 1  # no forward per sample tried
    # a backward that runs twice is replayed from one forward's graph, as before
    row, forwards[:] = {"fwd_flops": 1e6}, []
    single._time_backward_alone(row, lambda x: (forwards.append(1), x * 3)[1], (x,), torch.ones(64, 8),
                                single._timer(torch.device("cpu"), 1, 3, False, None))
    assert row["bwd_ms"] > 0 and "bwd_method" not in row and len(forwards) == 1


def test_run_json_schema_and_honest_failures(tmp_path, capsys):
    """A few implementations of each kind on 128 tokens (the Triton ones, slow
    under the CPU interpreter, are left out): schema, measured numbers, honest
    "unsupported" rows listed once below the table, the named reference."""
    path = tmp_path / "r.json"
    impls = ["longattn", "sdpa-cudnn", "longattn-dilated-gather", "headsplit-gather", "dense-same-length",
             "longattn-varlen", "sdpa-per-doc"]
    main(["run", "--config", "tiny", "dilated_tiny", "varlen_tiny", "--impl", *impls, "--seqlen", "128",
          "--heads", "2", "--batch", "1", "--iters", "1", "--warmup", "1", "--json", str(path)])
    d = json.loads(path.read_text())
    assert d["kind"] == "run" and d["env"]["torch"] == torch.__version__ and "device" in d["env"]
    rows = d["results"]
    assert rows and all(ROW_KEYS <= set(r) for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {"longattn", "longattn-dilated-gather", "longattn-varlen", "sdpa-per-doc"} <= {r["impl"] for r in ok}
    for r in ok:
        assert r["fwd_ms"] > 0 and r["fwd_tflops"] > 0 and r["fwd_tokens_per_s"] > 0
        assert r["fwd_peak_mem_bytes"] > 0  # never 0 by construction
        # the backward is timed by itself, not derived from two medians
        assert r["bwd_ms"] > 0 and r["bwd_host_ms"] > 0 and r["bwd_tflops"] > 0 and r["fwd_bwd_ms"] > 0
    # what cannot run here says why, with no numbers
    cudnn = next(r for r in rows if r["impl"] == "sdpa-cudnn")
    assert cudnn["status"] == "unsupported" and "CUDA" in cudnn["reason"] and "fwd_ms" not in cudnn
    # exact implementations agree with ours; the head-split baseline computes another function and says so
    by = {(r["config"], r["impl"]): r for r in rows}
    gather = by["dilated_tiny", "longattn-dilated-gather"]
    assert gather["rel_diff_vs_ref"] < 1e-4 and gather["reference"] == "longattn.dilated_attention (auto)"
    assert by["varlen_tiny", "sdpa-per-doc"]["rel_diff_vs_ref"] < 1e-4
    assert "head-split" in by["dilated_tiny", "headsplit-gather"]["computes"]
    assert path.with_suffix(".csv").exists()
    table = capsys.readouterr().out
    lines = table.splitlines()
    header = lines[0]
    assert header.startswith("| config | impl |") and "rel diff vs longattn (auto)" in header
    assert "GFLOP/s" in header  # CPU figures in the unit that fits, not 0.0 TF/s
    assert not any(ln.startswith("| tiny | sdpa-cudnn") for ln in lines)  # no row of dashes
    assert "- sdpa-cudnn [tiny]: SDPA cudnn backend needs CUDA" in lines  # listed once, below
    hs = next(ln for ln in lines if ln.startswith("| dilated_tiny | headsplit-gather"))
    assert "e-01*" in hs or "e+00*" in hs
    assert any(ln.startswith("* headsplit-gather: computes another function") for ln in lines)
    # one run's report: time and FLOP/s per implementation for each config; curves need more runs
    out = tmp_path / "rep"
    main(["report", str(path), "--out", str(out)])
    for cfg in ("tiny", "dilated_tiny", "varlen_tiny"):
        assert (out / f"r_{cfg}_impls.png").stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert "![r_tiny_impls.png](r_tiny_impls.png)" in md
    assert "time and memory against sequence length: needs" in md


def test_scale_and_report(tmp_path):
    scale = tmp_path / "s.json"
    main(["scale", "--config", "dilated_tiny", "--impl", "longattn-dilated", "--seqlen", "256", "--heads", "2",
          "--max-seqlen", "512", "--json", str(scale)])
    d = json.loads(scale.read_text())
    assert d["longest_seqlen"] == {"longattn-dilated": 512}
    assert [r["seqlen"] for r in d["results"]] == [256, 512]
    out = tmp_path / "rep"
    main(["report", str(scale), "--out", str(out)])
    assert (out / "report.md").exists() and (out / "time_memory_vs_seqlen.png").stat().st_size > 1000


def test_help_lists_implementations_and_every_option_has_help(capsys):
    from longattn.bench.__main__ import _parser

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for name in IMPLS:
        assert f"  {name} " in out
    parser = _parser()
    subs = next(a for a in parser._actions if a.dest == "cmd").choices
    for cmd, sub in subs.items():
        for action in sub._actions:
            assert action.help, f"{cmd} {action.option_strings or action.dest} has no help"
    with pytest.raises(SystemExit):
        main(["run", "--config", "tiny", "--impl", "nope"])
    assert "unknown implementation(s) nope" in capsys.readouterr().err


def test_progress_lines_for_slow_work(capsys):
    from longattn.bench.measure import Progress, time_ms

    p = Progress("[run] x", every_s=0.0)
    p.step("timed sample 1/3")
    Progress(None, every_s=0.0).step("silent")
    time_ms(lambda: None, torch.device("cpu"), warmup=1, iters=2, label="[run] fast")  # fast: no lines
    err = capsys.readouterr().err
    assert err.startswith("[run] x: timed sample 1/3 (") and "silent" not in err and "fast" not in err


def test_profiler_status_lines_are_silenced(capfd):
    peak_memory_bytes(lambda: torch.ones(1000).sum(), torch.device("cpu"))
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err


def test_timing_modes_are_recorded(tmp_path):
    """Every timed row says how it was timed; on CPU "batched" falls back to cold
    wall time (it is for GPU streams) and says so."""
    from longattn.bench.measure import time_ms

    t = time_ms(lambda: torch.ones(10).sum(), torch.device("cpu"), warmup=1, iters=2, batched=True)
    assert t["timing"] == "cold" and t["host_ms"] > 0 and t["median_ms"] > 0
    path = tmp_path / "q.json"
    main(["run", "--config", "tiny", "--impl", "longattn", "--seqlen", "128", "--heads", "2", "--iters", "1",
          "--warmup", "1", "--timing", "batched", "--json", str(path)])
    d = json.loads(path.read_text())
    assert d["env"]["timing"] == "cold"
    row = d["results"][0]
    assert row["timing"] == "cold" and row["fwd_host_ms"] > 0 and row["fwd_bwd_host_ms"] > 0


def test_memory_reports_known_allocation():
    n = 32 << 20
    got = peak_memory_bytes(lambda: torch.empty(n, dtype=torch.uint8).fill_(1), torch.device("cpu"))
    assert n <= got < n + (4 << 20)


def test_environment_records_the_command(monkeypatch):
    """A script passes its own command line; the LONGATTN_* settings go before
    it; by default the command is the bench CLI's."""
    from longattn.bench.measure import environment

    for k in [k for k in os.environ if k.startswith("LONGATTN_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("LONGATTN_TRITON_AUTOTUNE", "0")
    cpu = torch.device("cpu")
    env = environment(cpu, command="python benchmarks/dilated_profile.py --iters 3")
    assert env["command"] == "LONGATTN_TRITON_AUTOTUNE=0 python benchmarks/dilated_profile.py --iters 3"
    assert environment(cpu)["command"].startswith("LONGATTN_TRITON_AUTOTUNE=0 python")
    assert " -m longattn.bench" in environment(cpu)["command"]


def test_flop_counts():
    c = C.Config("x", 2, 1024, 4, 64)
    assert fwd_flops(c) == 4 * 2 * 4 * 64 * 1024 * 1024
    assert useful_pairs(C.Config("x", 1, 1024, 4, 64, causal=True)) == 1024 * 1024 / 2
    w = C.Config("w", 1, 100, 1, 8, causal=True, window=(9, 0))
    assert useful_pairs(w) == sum(min(i, 9) + 1 for i in range(100))
    d = C.get("longnet_32k")
    assert IMPLS["headsplit-gather"].pair_fraction(d) == 1 / 5


@pytest.mark.dist
def test_dist_under_torchrun(tmp_path):
    """The CPU (gloo) `dist` run: every row ok or unsupported with its reason,
    no profiler lines, device-neutral words, and a report from this one run."""
    path = tmp_path / "d.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "longattn.bench", "dist",
           "--config", "tiny", "dilated_tiny", "varlen_tiny", "--impl", "ring-zigzag", "ring-contiguous",
           "torch-cp", "--seqlen", "1024", "--heads", "2", "--batch", "1", "--iters", "1", "--warmup", "1",
           "--timing", "batched", "--json", str(path)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(path.read_text())
    assert d["env"]["timing"] == "cold"  # batched asked for, no GPU stream here: recorded as cold
    rows = d["results"]
    assert all(r["status"] == "ok" or (r["status"] == "unsupported" and r["reason"]) for r in rows), rows
    impls = {r["impl"]: r for r in rows if r["config"] == "tiny"}
    assert impls["ring-zigzag"]["status"] == "ok" and impls["ring-zigzag"]["efficiency_fwd"] > 0
    # torch's context_parallel has no CPU path: said before anything runs, never a failure of ours
    assert impls["torch-cp"]["status"] == "unsupported" and "CUDA" in impls["torch-cp"]["reason"]
    assert [r["status"] for r in rows if r["impl"] == "dilated-over-ranks"] == ["ok"]
    # packed documents: ring_attention_varlen in both layouts beside attention_varlen; torch has no varlen mode
    varlen = {r["impl"]: r for r in rows if r["config"] == "varlen_tiny"}
    assert set(varlen) == {"single:longattn-varlen", "ring-zigzag", "ring-contiguous", "torch-cp"}
    assert varlen["torch-cp"]["status"] == "unsupported"
    assert varlen["ring-zigzag"]["efficiency_fwd_bwd"] > 0
    out = res.stdout + res.stderr
    assert "USDT" not in out and "profiler_start" not in out
    assert "GPU" not in out  # gloo on CPU: ranks and devices, not GPUs
    lines = res.stdout.splitlines()
    assert "| ranks |" in lines[0] and "peak MiB/rank" in lines[0]
    assert not any(ln.startswith("| tiny | torch-cp") for ln in lines)
    assert any(ln.startswith("- torch-cp [tiny, varlen_tiny]: ") for ln in lines)
    # progress lines are rounded, not raw floats
    prog = [ln for ln in res.stderr.splitlines() if ln.startswith("[dist] tiny ring-zigzag (2 ranks): ok")]
    assert prog and all(len(tok) < 8 for tok in prog[0].replace(",", " ").split() if tok[0].isdigit())
    rep = tmp_path / "rep"
    main(["report", str(path), "--out", str(rep)])
    assert (rep / "d_efficiency.png").stat().st_size > 1000
    assert "efficiency against the number of ranks: needs" in (rep / "report.md").read_text()


def test_default_command_runs_on_cpu():
    out = subprocess.run([sys.executable, "-m", "longattn.bench"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="0"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| tiny | longattn |" in out.stdout and "| dilated_tiny | longattn-dilated |" in out.stdout


@pytest.mark.dist
def test_dist_ulysses_and_hybrid_under_torchrun(tmp_path):
    """`dist --impl ulysses hybrid --mesh 2x2` on 4 gloo ranks, dense and
    packed documents; a mesh that does not fit the run is unsupported, with its reason."""
    path = tmp_path / "u.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "-m", "longattn.bench", "dist",
           "--config", "tiny", "varlen_tiny", "--impl", "ulysses", "hybrid", "hybrid-contiguous:3x1", "--mesh",
           "2x2", "--seqlen", "256", "--heads", "4", "--batch", "1", "--iters", "1", "--warmup", "1",
           "--json", str(path)]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {(r["config"], r["impl"]): r for r in json.loads(path.read_text())["results"]}
    for cfg in ("tiny", "varlen_tiny"):
        for impl in ("ulysses", "hybrid:2x2"):
            assert rows[cfg, impl]["status"] == "ok" and rows[cfg, impl]["efficiency_fwd_bwd"] > 0, rows[cfg, impl]
        assert rows[cfg, "hybrid-contiguous:3x1"]["status"] == "unsupported"
        assert "3 ranks, the run 4" in rows[cfg, "hybrid-contiguous:3x1"]["reason"]


def test_dist_mesh_option():
    from longattn.bench.dist import parse_mesh, with_mesh

    assert parse_mesh("2x4") == (2, 4)
    assert with_mesh(["hybrid", "hybrid-contiguous+copy", "hybrid:4x1", "ulysses"], "2x2") == [
        "hybrid:2x2", "hybrid-contiguous:2x2+copy", "hybrid:4x1", "ulysses"]
    with pytest.raises(ValueError, match="UxR"):
        parse_mesh("2by2")
    with pytest.raises(SystemExit):
        main(["dist", "--config", "tiny", "--impl", "hybrid", "--mesh", "two"])


@pytest.mark.dist
def test_dist_flex_under_torchrun(tmp_path):
    """Flex configs under `dist` on 2 gloo ranks: by default ring_flex_attention
    in both layouts beside T_single (longattn-flex on CPU, where torch-flex does
    not run) and torch's context-parallel FlexAttention, unsupported on CPU with its reason."""
    path = tmp_path / "f.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "longattn.bench", "dist",
           "--config", "flex_doc_tiny", "--seqlen", "512", "--heads", "2", "--iters", "1", "--warmup", "1",
           "--pattern-args", "200,312", "--json", str(path)]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["impl"]: r for r in json.loads(path.read_text())["results"]}
    assert list(rows) == ["single:longattn-flex", "flex-ring", "flex-ring-contiguous", "flex-exchange", "torch-cp-flex"]
    assert rows["single:longattn-flex"]["status"] == "ok" and rows["single:longattn-flex"]["fwd_bwd_ms"] > 0
    for impl in ("flex-ring", "flex-ring-contiguous", "flex-exchange"):
        r = rows[impl]
        assert r["status"] == "ok" and r["efficiency_fwd"] > 0 and r["efficiency_fwd_bwd"] > 0, r
        assert "mask=causal_document[200, 312]" in r["shape"] and r["fwd_flops"] < 4 * 2 * 64 * 512 * 512 / 2
    assert rows["torch-cp-flex"]["status"] == "unsupported" and "CUDA" in rows["torch-cp-flex"]["reason"]


def test_pattern_args_override():
    from longattn.bench.__main__ import _numbers

    assert _numbers("8192,128") == (8192, 128) and _numbers("0.5") == (0.5,) and _numbers("1e-2") == (0.01,)
    with pytest.raises(argparse.ArgumentTypeError, match="separated by commas"):
        _numbers("8192;128")
    cfg = C.get("flex_swg_tiny").with_overrides(pattern_args=(32, 8), seqlen=None)
    assert cfg.pattern_args == (32, 8) and "mask=local_global[32, 8]" in cfg.describe()
    with pytest.raises(ValueError, match="flex configs only"):
        C.get("tiny").with_overrides(pattern_args=(1,))


def test_dist_flex_impls_run_flex_configs_only():
    from longattn.bench.dist import _reason

    cpu = torch.device("cpu")
    assert "flex configs" in _reason(C.get("tiny"), "flex-ring", cpu)
    assert "flex-ring" in _reason(C.get("flex_swg_tiny"), "ring-zigzag", cpu)
    assert _reason(C.get("flex_swg_tiny"), "flex-ring-contiguous", cpu) is None
