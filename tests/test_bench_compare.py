"""Honest comparisons on CPU: the baselines at their best (torch's context
parallel with K/V at their own head count, LongNet's function gathered), the
README numbers table generated from its files, the CLI as a new user meets it."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import longattn
from dist_utils import run_world
from longattn.bench import configs as C
from longattn.bench.__main__ import main
from longattn.bench.baselines import longnet_gather_dilated
from reference import assert_close, dilated_ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ LongNet-exact gather baseline
@pytest.mark.parametrize("b, s, h, hkv, segs, rates, causal", [
    (1, 64, 4, 4, (16, 32), (1, 2), False),
    (2, 100, 4, 2, (16, 64), (1, 4), True),     # partial last segments, GQA
    (1, 40, 8, 2, (8, 16, 64), (1, 2, 4), False),  # a segment longer than the sequence
    (1, 24, 2, 1, (32,), (4,), True),            # rate above the head count: offsets no head takes
])
def test_longnet_gather_equals_dilated_attention(b, s, h, hkv, segs, rates, causal):
    """The gather baseline computes longattn.dilated_attention's function (the
    float64 reference's output and lse, as dilated_attention does), so the "x"
    against it compares costs only. (Both sit ~1e-7 from the reference in
    float64: torch's CPU attention kernels accumulate below float64.)"""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, s, hkv, 8, dtype=torch.float64, generator=g) for _ in range(2))
    got = longnet_gather_dilated(q, k, v, segs, rates, causal, return_lse=True)
    want = longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, causal=causal,
                                      return_lse=True)
    ref = dilated_ref(q, k, v, segs, rates, causal=causal)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
    assert_close(dict(out=got[0], lse=got[1]), dict(out=ref[0], lse=ref[1]), 1e-6, "longnet-gather vs float64")
    assert_close(dict(out=got[0], lse=got[1]), dict(out=want[0], lse=want[1]), 1e-6, "vs dilated_attention")


def test_longnet_gather_in_the_run_command(tmp_path):
    """`run --impl longnet-gather` beside longattn-dilated in one run: it agrees
    with the reference; its backward is recorded as unsupported (not run), with the reason."""
    path = tmp_path / "g.json"
    main(["run", "--config", "dilated_tiny", "--impl", "longattn-dilated", "longnet-gather", "--iters", "1",
          "--warmup", "1", "--json", str(path)])
    rows = {r["impl"]: r for r in json.loads(path.read_text())["results"]}
    row = rows["longnet-gather"]
    assert row["status"] == "ok" and row["fwd_ms"] > 0 and row["rel_diff_vs_ref"] < 1e-5, row
    assert row["bwd_status"] == "unsupported" and "forward-only" in row["bwd_reason"]


# ------------------------------------------------------------------ torch's context parallel at its best
def test_torch_cp_inputs_keep_kv_heads():
    from longattn.bench.torch_cp import cp_sdpa_inputs

    q, k, v = torch.randn(1, 16, 8, 4), torch.randn(1, 16, 2, 4), torch.randn(1, 16, 2, 4)
    (qb, kb, vb), gqa = cp_sdpa_inputs(q, k, v)
    assert gqa and qb.shape == (1, 8, 16, 4) and kb.shape == vb.shape == (1, 2, 16, 4)
    assert torch.equal(kb, k.transpose(1, 2))
    assert not cp_sdpa_inputs(q, q, q)[1]


def _check_torch_cp_plumbing(rank, world):
    """run_torch_cp under gloo with a stand-in timer (torch's CP shards no CPU
    SDPA kernel): K/V go in with their own head count, the balancer is on for
    causal only, the faster rotate method is kept on every rank, torch's
    options are restored."""
    from torch.distributed.tensor.experimental._attention import _cp_options

    from longattn.bench.torch_cp import run_torch_cp

    before = (_cp_options.enable_load_balance, _cp_options.rotate_method)
    seen = []

    def time_pair(fwd, step, dev, warmup, iters, batched, label):
        # the timed call must look SDPA up when it runs: context_parallel swaps it in torch.nn.functional while active
        F, real, calls = torch.nn.functional, torch.nn.functional.scaled_dot_product_attention, []
        F.scaled_dot_product_attention = lambda *a, **kw: calls.append(kw) or a[0]
        try:
            fwd()
        finally:
            F.scaled_dot_product_attention = real
        assert calls and calls[0]["enable_gqa"], "the timed call bound SDPA before context_parallel could swap it"
        seen.append((_cp_options.rotate_method.name, _cp_options.enable_load_balance))
        slow = 2.0 if _cp_options.rotate_method.name == "ALL_GATHER" else 1.0
        return (slow, slow * 3 if step else None, 1, 2, 0.1, 0.2)

    allmax = lambda x: x
    for causal in (True, False):
        cfg = C.Config("t", 1, 64, 8, 16, kv_heads=2, causal=causal)
        make = lambda: (torch.randn(1, 64, 8, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16))
        seen.clear()
        measured, info = run_torch_cp(cfg, make, torch.device("cpu"), time_pair, allmax, warmup=1, iters=1,
                                      backward=True, batched=False, label="t")
        assert info["enable_gqa"] and info["kv_heads"] == 2 and info["load_balance"] == causal
        assert info["rotate_method"] == "alltoall" and set(info["rotate_probe_ms"]) == {"allgather", "alltoall"}
        assert isinstance(info["sdpa_backend"], str) and set(info["sdpa_probe_ms"]) == {"cudnn", "flash"}
        assert info["flash_impl"].startswith("FA2 (FA4 runs on CUDA")  # on CPU, with flash-attn-4 or not
        assert seen[-1][0] == "ALL_TO_ALL" and {lb for _, lb in seen} == {causal}
        assert measured[0] == 1.0
        assert (_cp_options.enable_load_balance, _cp_options.rotate_method) == before


@pytest.mark.dist
def test_torch_cp_plumbing_under_gloo():
    run_world(_check_torch_cp_plumbing, 2)


def _check_torch_cp_without_fa4_flash(rank, world):
    """Where SDPA's flash is switched to FA4 and torch's CP ring fails with it (as on an H100 with flash-attn-4
    4.0.0b36: its ring unpacks the op's outputs itself), the probe records the failure on every rank, switches FA4
    off and probes SDPA's own flash, and the row runs on the faster working kernel."""
    from longattn.bench import torch_cp

    switched_off = []
    torch_cp.fa4_flash = lambda dev: None  # as if torch had switched SDPA's flash to FA4
    torch_cp.fa4_flash_off = lambda: switched_off.append(True)

    def time_pair(fwd, step, dev, warmup, iters, batched, label):
        if label.endswith("sdpa flash"):
            raise ValueError("too many values to unpack (expected 2)")
        ms = 2.0 if label.endswith("sdpa cudnn") else 1.0
        return (ms, ms * 3, 1, 2, 0.1, 0.2)

    cfg = C.Config("t", 1, 64, 8, 16, kv_heads=2, causal=True)
    make = lambda: (torch.randn(1, 64, 8, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16))
    measured, info = torch_cp.run_torch_cp(cfg, make, torch.device("cpu"), time_pair, lambda x: x, warmup=1, iters=1,
                                           backward=True, batched=False, label="t")
    assert "too many values" in info["probe_errors"]["sdpa flash"]
    assert info["flash_impl"].startswith("FA2 (torch's context_parallel failed")
    assert info["sdpa_probe_ms"] == {"cudnn": 6.0, "flash": 3.0}
    assert switched_off  # FA4 behind SDPA's flash is switched off again
    assert measured[0] == 1.0


@pytest.mark.dist
def test_torch_cp_falls_back_when_fa4_flash_fails():
    run_world(_check_torch_cp_without_fa4_flash, 2)


def test_torch_cp_says_why_not():
    from longattn.bench.torch_cp import torch_cp_reason

    cuda = torch.device("cuda")
    assert "CUDA" in torch_cp_reason(C.get("tiny"), torch.device("cpu"))
    assert "varlen" in torch_cp_reason(C.get("varlen_tiny"), cuda)
    assert "window" in torch_cp_reason(C.get("window_small"), cuda)
    assert torch_cp_reason(C.get("gqa_32q8kv_128k_causal"), cuda) is None


# ------------------------------------------------------------------ results and README
def test_flex_exchange_impl_takes_tuning_fields():
    from longattn import tuning
    from longattn.bench.torch_cp import exchange_tuning, flex_dist_reason

    assert exchange_tuning("flex-exchange") is None
    assert exchange_tuning("flex-exchange:join_halo=1,split_chain=64") == tuning.FlexExchangeTuning(
        join_halo=True, split_chain=64)
    cfg, cpu = C.get("flex_swg_128k"), torch.device("cpu")
    assert "no field 'bogus'" in flex_dist_reason(cfg, "flex-exchange:bogus=1", cpu)
    assert "flex configs run" in flex_dist_reason(cfg, "flex-ring:join_halo=1", cpu)
    for bad, says in (("join_halo=2", "join_halo='2' is not a bool (0 or 1)"), ("split_chain=6.4", "is not a int"),
                      ("join_halo", "as FIELD=VALUE"), ("join_halo=1,join_halo=0", "each field once"),
                      ("", "name the fields")):
        assert says in flex_dist_reason(cfg, f"flex-exchange:{bad}", cpu), bad


def test_result_path_carries_the_commit(monkeypatch):
    from longattn.bench.measure import result_path, short_commit

    monkeypatch.setenv("LONGATTN_COMMIT", "0123456789abcdef-dirty")
    assert short_commit() == "0123456-dirty"
    assert result_path("out/dist_{commit}.json") == "out/dist_0123456-dirty.json"
    assert result_path("plain.json") == "plain.json"


def test_write_json_tabulates_rows_only(tmp_path):
    """A list of rows gets a CSV beside the JSON; a script's per-config dict is written as JSON alone."""
    import json

    from longattn.bench.measure import write_json

    write_json(str(tmp_path / "rows.json"), {"results": [{"config": "a", "ms": 1.5, "nested": {"x": 1}}]})
    assert (tmp_path / "rows.csv").read_text().splitlines() == ["config,ms", "a,1.5"]
    payload = {"results": {"flex_bsparse_32k": {"issue_ms": 2.0}}}
    write_json(str(tmp_path / "dict.json"), payload)
    assert json.loads((tmp_path / "dict.json").read_text()) == payload
    assert not (tmp_path / "dict.csv").exists()


def test_readme_numbers_table_is_generated_from_its_files():
    """README's table equals what `report --readme` generates from the files its marker names."""
    from longattn.bench.readme import readme_block, table

    with open(os.path.join(ROOT, "README.md")) as f:
        files, current = readme_block(f.read())
    assert files, "the marker names no result file"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert current == table(files)
    finally:
        os.chdir(cwd)


def test_readme_update_rewrites_between_markers(tmp_path):
    from longattn.bench.readme import BEGIN, END, readme_block

    src = os.path.join(ROOT, "benchmarks", "results", "dist_flex_2xh200_df7b171.json")
    shutil.copy(src, tmp_path / "f.json")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}old.json -->\n| stale |\n{END}\n\nafter\n")
    main(["report", "--readme", str(readme), str(tmp_path / "f.json")])
    text = readme.read_text()
    files, tab = readme_block(text)
    assert files == ["f.json"] and "| stale |" not in text and text.endswith("\n\nafter\n")
    assert "flex_doc_128k" in tab and "torch-cp-flex" in tab


def test_report_reads_a_decode_json_without_matplotlib(tmp_path, monkeypatch):
    """A decode result makes a report; without matplotlib report.md is still
    written and says how to get the plots."""
    src = os.path.join(ROOT, "benchmarks", "results", "decode_1xh200_ea260f1.json")
    shutil.copy(src, tmp_path / "dec.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    main(["report", str(tmp_path / "dec.json"), "--out", str(tmp_path / "rep")])
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "(decode)" in md and "sdpa-cudnn" in md
    assert "pip install matplotlib" in md


@pytest.mark.parametrize("src,png", [("decode_batched_h200_2307ec6.json", "decode"),
                                     ("hf_docs16_32k_h100_539dd63.json", "steps")])
def test_report_plots_decode_and_training_step_files(tmp_path, src, png):
    """A decode result gets its plot (each context's implementations, ms per token
    and layer), an hf-train result its own (each attention's step, tokens/s, peak memory)."""
    pytest.importorskip("matplotlib")
    shutil.copy(os.path.join(ROOT, "benchmarks", "results", src), tmp_path / "r.json")
    main(["report", str(tmp_path / "r.json"), "--out", str(tmp_path / "rep")])
    out = tmp_path / "rep" / f"r_{png}.png"
    assert out.exists() and out.stat().st_size > 10_000
    assert out.name in (tmp_path / "rep" / "report.md").read_text()


def test_report_refuses_a_file_no_command_wrote(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "x.json")])
    assert "not a result of" in capsys.readouterr().err


# ------------------------------------------------------------------ the CLI as a new user meets it
def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("list", "run", "dist", "scale", "decode", "hf-train", "report"):
        assert cmd in out, cmd


def test_dist_outside_torchrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-m", "longattn.bench", "dist", "--config", "tiny"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2
    assert "torchrun --nproc_per_node=" in res.stderr and "RANK expected" not in res.stderr


def test_every_measured_threshold_names_a_result_file_that_exists():
    """A tuning threshold's reason cites its measurement: each JSON file a field names is in benchmarks/results."""
    import dataclasses

    from longattn import tuning

    for obj in tuning.TUNINGS:
        for f in dataclasses.fields(obj):
            assert f.metadata.get("reason"), f"{type(obj).__name__}.{f.name} has no reason"
            for name in (f.metadata.get("source") or "").replace(",", " ").split():
                if name.endswith(".json"):
                    assert os.path.exists(os.path.join(ROOT, "benchmarks", "results", name)), (f.name, name)


def test_flex_carve_timing_plots_saved_results(tmp_path):
    """benchmarks/flex_carve_timing.py --from FILES --plot PNG draws saved runs (rows at several lengths, the
    planned executor named "carved" or "as planned") without a GPU; --from without --plot is a usage error."""
    pytest.importorskip("matplotlib")
    files = [os.path.join(ROOT, "benchmarks", "results", f"flex_carve_timing_{n}.json")
             for n in ("short_h200_5edc28f", "h200_f82abd3")]
    script = os.path.join(ROOT, "benchmarks", "flex_carve_timing.py")
    png = tmp_path / "carve.png"
    res = subprocess.run([sys.executable, script, "--from", *files, "--plot", str(png)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    res = subprocess.run([sys.executable, script, "--from", files[0]], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert res.returncode == 2 and "--from needs --plot" in res.stderr


def test_few_keys_ab_checks_before_timing():
    """benchmarks/few_keys_ab.py --check-only: the few-keys kernels it times against FA4 match float64 under the
    interpreter (GQA, rows the partial left empty) before any timing (tests/test_few_keys.py covers the
    kernels)."""
    script = os.path.join(ROOT, "benchmarks", "few_keys_ab.py")
    res = subprocess.run([sys.executable, script, "--check-only", "--rows", "130", "--keys", "70", "--heads", "4",
                          "--kv-heads", "2", "--dim", "16"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert res.returncode == 0 and "few_keys against float64" in res.stdout, res.stderr[-2000:]
