"""A transformers model under attn_implementation="longattn_ring", its batch
sharded by longattn.context_parallel (gloo, world 2 and 3), against the same
weights unsharded under "sdpa" in float64: the loss, every parameter gradient
(summed over the group) and the gathered logits; dense rows, packed documents,
right and left padding, a length the zigzag layout cannot split evenly, a
sliding window; greedy generation from a ShardedCache (Llama, dilated, and
Gemma 2, GPT-OSS and Llama 4 against eager); and bad inputs that raise on
every rank without a hang."""
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the hf extra needs Python >= 3.11

from dist_utils import assert_group_usable, generator, run_world  # noqa: E402
from reference import rel_err  # noqa: E402
from longattn.integrations.transformers import ShardedCache  # noqa: E402
from test_hf import mask_args  # noqa: E402

TOL = 1e-4


def _config(kind="llama", **extra):
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0)
    common.update(extra)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=4, **common)
    return transformers.LlamaConfig(**common)


def _models(kind):
    import longattn.integrations.transformers as lt

    lt.register()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="sdpa").double()
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="longattn_ring")
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    return model, ref


def _cases():
    torch.manual_seed(1)
    ids = torch.randint(1, 40, (2, 12))
    yield "dense", dict(input_ids=ids, labels=ids.clone())
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    yield "right padding", dict(input_ids=ids, labels=labels, attention_mask=mask)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100  # predicted from padding: not trained
    yield "left padding", dict(input_ids=ids, labels=labels, attention_mask=mask)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(7)) + list(range(5))])
    yield "packed documents", dict(input_ids=ids, labels=ids.clone(), position_ids=pos)
    yield "uneven length", dict(input_ids=ids[:, :10], labels=ids[:, :10].clone())
    # labels=None: the next token wherever both are real (right padding: labels masked at padding)
    yield "default labels", dict(input_ids=ids, attention_mask=mask.flip(1), labels=None,
                                 ref_labels=ids.masked_fill(mask.flip(1) == 0, -100))


def _reference(ref, case):
    """The unsharded model on the case; ``ref_*`` entries replace the
    argument they name, ``cu_seqlens`` is for shard_batch only."""
    kw = {k: v for k, v in case.items() if k not in ("input_ids", "cu_seqlens") and not k.startswith("ref_")}
    kw.update({k[4:]: v for k, v in case.items() if k.startswith("ref_")})
    ref.zero_grad(set_to_none=True)
    out = ref(case["input_ids"], use_cache=False, **kw)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in ref.named_parameters()}


def _compare_sharded(model, ref, case, tag, **shard_kw):
    """The model on the case sharded by shard_batch against the reference
    unsharded: loss, logits of real tokens, every parameter gradient (summed
    over the group). Returns (batch, output, reference loss)."""
    from longattn import context_parallel as cp

    want_loss, want_logits, want_grads = _reference(ref, case)
    batch = cp.shard_batch(**{k: v for k, v in case.items() if not k.startswith("ref_")}, **shard_kw)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    cp.all_reduce_grads(model)
    errs = {"loss": rel_err(cp.reduce_loss(out.loss), want_loss)}
    real = case.get("attention_mask", torch.ones_like(case["input_ids"])).bool()
    errs["logits"] = rel_err(batch["longattn_cp"].gather(out.logits.detach())[real], want_logits[real])
    errs.update({n: rel_err(p.grad, want_grads[n]) for n, p in model.named_parameters()
                 if want_grads[n] is not None})  # (a parameter the case leaves unused has none)
    bad = {n: e for n, e in errs.items() if not e < TOL}
    assert not bad, f"{tag}: {bad}"
    return batch, out, want_loss


def _check_matches(rank, world):
    from longattn import context_parallel as cp

    for kind in ("llama", "mistral"):
        model, ref = _models(kind)
        for name, case in _cases():
            batch, out, want_loss = _compare_sharded(model, ref, case, f"rank {rank}/{world} {kind} {name}")
            # the same loss from the helper, for models whose loss ignores shift_labels
            assert rel_err(cp.reduce_loss(cp.loss(out.logits, batch)), want_loss) < TOL

    # a DeviceMesh names the group too
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, ref = _models("llama")
    name, case = next(iter(_cases()))
    want_loss, _, _ = _reference(ref, case)
    batch = cp.shard_batch(**case, group=mesh)
    assert rel_err(cp.reduce_loss(model(**batch).loss, mesh), want_loss) < TOL


def _raises_everywhere(world, match, fn):
    with pytest.raises(ValueError, match=match):
        fn()
    assert_group_usable(world)


def _check_errors(rank, world):
    from longattn import context_parallel as cp

    model, _ = _models("llama")
    torch.manual_seed(1)
    ids = torch.randint(1, 40, (1, 12))
    batch = cp.shard_batch(ids)
    mismatch = "raised an error|differ across ranks"

    # the full batch differs on one rank
    other = ids.clone()
    other[0, 3] += 1 if rank == world - 1 else 0
    _raises_everywhere(world, "differ across ranks", lambda: cp.shard_batch(other))

    # dropout in training: every rank raises, naming the config setting
    drop = transformers.AutoModelForCausalLM.from_config(_config(attention_dropout=0.1),
                                                         attn_implementation="longattn_ring").train()
    _raises_everywhere(world, "attention_dropout", lambda: drop(**batch))

    # heads that GQA cannot pair
    odd = transformers.AutoModelForCausalLM.from_config(_config(num_key_value_heads=3, head_dim=8),
                                                        attn_implementation="longattn_ring")
    _raises_everywhere(world, "num_key_value_heads", lambda: odd(**batch))

    # a padding mask given to the model (on one rank only) instead of to shard_batch
    mask = torch.ones_like(batch["input_ids"])
    mask[0, 0] = 0 if rank == 0 else 1
    _raises_everywhere(world, "shard_batch" if rank == 0 else mismatch,
                       lambda: model(**batch, attention_mask=mask))

    # a 4-D mask
    four_d = torch.ones(1, 1, batch["input_ids"].shape[1], batch["input_ids"].shape[1], dtype=torch.bool)
    _raises_everywhere(world, "4-D|2-D", lambda: model(**batch, attention_mask=four_d))

    # local shards of different lengths (one rank drops a token)
    cut = dict(batch)
    if rank == 0:
        cut["input_ids"], cut["position_ids"] = batch["input_ids"][:, :-2], batch["position_ids"][:, :-2]
        cut["labels"] = cut["shift_labels"] = batch["labels"][:, :-2]
    _raises_everywhere(world, mismatch, lambda: model(**cut))

    # labels predicted from padding
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :3] = 0
    _raises_everywhere(world, "padding", lambda: cp.shard_batch(ids, labels=ids, attention_mask=mask))

    # without the sharded batch
    _raises_everywhere(world, "shard_batch", lambda: model(ids))

    # everything still runs afterwards
    model(**batch).loss.backward()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_ring_model_matches_unsharded(world):
    run_world(_check_matches, world)


def _check_families(rank, world):
    """Gemma 2 (logit soft-capping), GPT-OSS (sinks) and Llama 4 text (chunks
    of 4 on its local layers: dense rows, packed documents and padding cut at
    the chunk edges) under "longattn_ring" against eager in float64: loss,
    logits and every parameter gradient (the sinks' included), summed over
    the group as context-parallel training does."""
    from longattn import context_parallel as cp
    from test_hf import _pair

    for kind in ("gemma2", "gpt_oss", "llama4"):
        model, ref = _pair(kind, impl="longattn_ring", ref_impl="eager")
        if kind == "gpt_oss":
            with torch.no_grad():  # sinks comparable to the scores, so that they change the result
                for m in (model, ref):
                    for layer in m.model.layers:
                        layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
        on_index = kind == "llama4" and _chunks_on_index(ref.config)
        for name, case in _cases():
            if kind == "gemma2" and "attention_mask" in case:
                continue  # eager Gemma 2 in float64 turns rows of padding that see no key into NaN (test_hf)
            if on_index and name == "packed documents":  # documents start inside chunks: refused, not wrong
                for layout in ("zigzag", "documents"):
                    _raises_everywhere(world, "start inside a chunk",
                                       lambda: model(**cp.shard_batch(**case, layout=layout)))
                continue
            if kind == "gpt_oss" and name == "packed documents":
                _check_gpt_oss_documents(model, ref, case, f"rank {rank}/{world} {kind}", world)
                continue
            _compare_sharded(model, ref, case, f"rank {rank}/{world} {kind} {name}")
            if kind == "gemma2" and name == "packed documents":  # soft-capping on documents held whole
                _compare_sharded(model, ref, case, f"rank {rank}/{world} {kind} {name} documents", layout="documents")
        if kind == "llama4":  # a document that starts inside a chunk (its positions from 2; index 6 on one row)
            pos = torch.tensor([[2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5]])
            ids = dict(_cases())["dense"]["input_ids"][:1]
            for layout in ("zigzag", "documents"):
                _raises_everywhere(world, "start inside a chunk", lambda: model(**cp.shard_batch(
                    ids, labels=ids, position_ids=pos, layout=layout)))
        if kind == "llama4" and not on_index:  # chunks on documents held whole (soft-capping above, sinks below)
            case = dict(_cases())["packed documents"]
            _compare_sharded(model, ref, case, f"rank {rank}/{world} {kind} documents", layout="documents")
        if kind == "llama4":  # dense rows in the contiguous layout: one ring call per row
            name, case = next(iter(_cases()))
            _compare_sharded(model, ref, case, f"rank {rank}/{world} {kind} {name} contiguous", layout="contiguous")
        if kind == "gpt_oss":
            assert model.model.layers[0].self_attn.sinks.grad.abs().sum() > 0


def _chunks_on_index(config) -> bool:
    """Whether this transformers release cuts chunked attention's chunks at
    multiples of the token index (releases before 5.24) rather than of the
    positions inside packed documents: its own eager mask of two packed
    documents (3 and 5 tokens, chunks of 4) says. Index 7, position 4 of the
    second document, sees index 4 only where chunks follow the index."""
    from transformers import masking_utils as mu

    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    built = mask_args(config=config, inputs_embeds=torch.zeros(1, 8, 1, dtype=torch.float64), attention_mask=None,
                      position_ids=pos)
    m = mu.create_chunked_causal_mask(**built)[0, 0, 7, 4]
    return bool(m) if m.dtype == torch.bool else bool(m == 0)


def _check_gpt_oss_documents(model, ref, case, tag, world):
    """transformers' GPT-OSS builds its masks without position_ids: unsharded,
    restarting positions leave a packed row one causal sequence, which a batch
    sharded by documents cannot run: it raises on every rank, naming
    cu_seqlens. Documents given as cu_seqlens match GPT-OSS with the masks
    built on the position ids (transformers' packed-document masks, passed
    ready as the model allows), which differs from the one-sequence run."""
    from longattn import context_parallel as cp
    from transformers import masking_utils as mu

    _raises_everywhere(world, "masks without position_ids.*cu_seqlens", lambda: model(**cp.shard_batch(**case)))
    row = {k: v[:1] for k, v in case.items()}  # cu_seqlens describe one packed row
    pos = row["position_ids"]
    emb = torch.zeros(1, pos.shape[1], 1, dtype=torch.float64)
    built = mask_args(config=ref.config, inputs_embeds=emb, attention_mask=None, position_ids=pos)
    masks = {"full_attention": mu.create_causal_mask(**built),
             "sliding_attention": mu.create_sliding_window_causal_mask(**built)}
    starts = torch.nonzero(pos[0] == 0).flatten().tolist() + [pos.shape[1]]
    docs = dict(row, cu_seqlens=torch.tensor(starts, dtype=torch.int32), ref_attention_mask=masks)
    _, _, want = _compare_sharded(model, ref, docs, f"{tag} documents as cu_seqlens")
    _compare_sharded(model, ref, docs, f"{tag} documents held whole (sinks)", layout="documents")
    one_sequence, _, _ = _reference(ref, row)
    assert rel_err(one_sequence, want) > 1e-3  # the documents do change the result


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_ring_softcap_sinks_chunked_models(world):
    run_world(_check_families, world)


@pytest.mark.dist
def test_ring_model_errors_raise_on_every_rank():
    run_world(_check_errors, 2)


def _check_scripts(rank, world):
    """examples/finetune_hf.py with --cp and `bench hf-train` with
    longattn_ring run under gloo and give the one-device losses."""
    from longattn.bench import hf_train as bench
    from test_hf import _load as load

    ex = load("examples/finetune_hf.py")
    args = ["--steps", "2", "--seqlen", "64", "--batch", "2", "--hidden", "32", "--pack"]
    ring = ex.main(args + ["--attn", "longattn_ring", "--cp", str(world)])
    if rank == 0:
        one = ex.main(args + ["--attn", "longattn"])
        assert all(abs(a - b) < 1e-4 * abs(b) for a, b in zip(ring, one)), (ring, one)
    for docs in ("1", "4"):
        # float32 on GPUs too (bf16 is the bench's CUDA default), as the one-device losses below
        row = bench.main(["--tiny", "--attn", "longattn_ring", "--seqlen", "64", "--docs", docs, "--steps", "1",
                          "--warmup", "1", "--dtype", "fp32"])["results"][0]
        assert row["error"] is None and row["world"] == world
        if rank == 0:  # the same losses as one device (the ranks' shares summed), on the ring's device: the
            # model's initial weights come from that device's generator
            dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            one = bench.run(bench.parse(["--tiny", "--attn", "longattn", "--seqlen", "64", "--docs", docs,
                                         "--steps", "1", "--warmup", "1", "--dtype", "fp32"]), 1, dev)
            assert all(abs(a - b) < 1e-4 * abs(b) for a, b in zip(row["losses"], one["losses"])), (row, one)


@pytest.mark.dist
def test_ring_example_and_benchmark_run():
    run_world(_check_scripts, 2)


# ------------------------------------------------------------------- generation
class _UpdateWithoutKwargs(ShardedCache):
    """A ShardedCache called as models of transformers before 5.24 call a
    cache: ``update(key, value, layer_idx)``, no keyword arguments."""

    def update(self, key_states, value_states, layer_idx, *args, kwargs=None, **kw):
        return super().update(key_states, value_states, layer_idx, *args, **kw)


def _check_generate(rank, world):
    """model.generate from a ShardedCache: "longattn_ring" gives the greedy
    tokens of "sdpa" on one device (the prompt given whole, and a prefill
    sharded end to end through shard_batch); "longattn_dilated" those of
    recomputing dilated attention without a cache (use_cache=False)."""
    import longattn.integrations.transformers as lt
    from longattn import context_parallel as cp

    lt.register()
    from longattn.integrations.transformers import checks as lt_checks

    # a layer reaches the attention call through the keyword arguments the model passes update (not the tensors)
    probe, call_kwargs, t = lt.ShardedCache(), {}, torch.zeros(1, 2, 3, 8)
    k_out, v_out = probe.update(t, t, 0, kwargs=call_kwargs)
    assert k_out is t and v_out is t and not vars(t)
    assert call_kwargs == {"longattn_sharded_layer": probe.layers[0]}
    # an attention call that did not read its layer (another implementation) is reported at the next update
    with pytest.raises(ValueError, match="did not read its sharded layer"):
        probe.update(t, t, 0, kwargs={})
    # models of transformers before 5.24 pass no keyword arguments: the layer travels with the very key and value
    k_out, v_out = probe.update(t, t, 0)
    assert lt_checks.sharded_layer({}, t.clone(), v_out) is None  # other tensors: another call
    assert lt_checks.sharded_layer({}, k_out, v_out) is probe.layers[0]
    assert lt_checks.sharded_layer({}, k_out, v_out) is None  # handed over once
    probe.update(t, t, 0)  # the layer was read: no error
    with pytest.raises(ValueError, match="other than the tensors"):  # its own layer's call, the tensors changed
        lt_checks.sharded_layer({}, t.clone(), t, types.SimpleNamespace(layer_idx=0))
    probe.layers[0].read()
    extra = dict(eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(**extra), attn_implementation="sdpa")
    ring = transformers.AutoModelForCausalLM.from_config(_config(**extra), attn_implementation="longattn_ring")
    ring.load_state_dict(ref.state_dict())
    ids = torch.randint(1, 40, (2, 13), generator=generator(4))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = sdpa = ref.generate(ids, **kw)
    sharded = lt.ShardedCache(reserve=6, block=2)
    got = ring.generate(ids, past_key_values=sharded, **kw)
    assert torch.equal(got, want), (rank, got, want)
    # a model that calls update(key, value, layer_idx) without its keyword arguments, as transformers' own
    # before 5.24: the same tokens, each layer handed over with its key and value
    got = ring.generate(ids, past_key_values=_UpdateWithoutKwargs(reserve=6, block=2), **kw)
    assert torch.equal(got, want), (rank, got, want)
    part = sharded.layers[0].kv  # each rank holds a part: 13 + 5 tokens over the group
    assert part.layout.seqlens == [18, 18] and max(part.local_seqlens.tolist()) <= -(-18 // world) + 2
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    _raises_everywhere(world, "padding", lambda: ring.generate(ids, attention_mask=mask,
                                                               past_key_values=lt.ShardedCache(), **kw))
    cache = lt.ShardedCache(block=1)
    ring(**cp.shard_batch(ids[:, :-1]), past_key_values=cache)  # 12 tokens: dense zigzag rows for world 2 and 3
    assert cache.get_seq_length() == 12
    got = ring.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(got, want), (rank, got, want)

    dil_extra = dict(longattn_segment_lengths=[4, 8], longattn_dilation_rates=[1, 2], **extra)
    dil = transformers.AutoModelForCausalLM.from_config(_config(**dil_extra), attn_implementation="longattn_dilated")
    dil.load_state_dict(ref.state_dict())
    want = dil.generate(ids, use_cache=False, **kw)
    got = dil.generate(ids, past_key_values=lt.ShardedCache(layout="contiguous", block=2), **kw)
    assert torch.equal(got, want), (rank, got, want)
    assert not torch.equal(want, sdpa)  # the branches do act


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_generate_from_sharded_cache(world):
    run_world(_check_generate, world)


def _check_generate_families(rank, world):
    """Gemma 2 (soft-capping, a window of 4), GPT-OSS (sinks, a window of 4)
    and Llama 4 text (chunks of 4) generate from a ShardedCache the greedy
    tokens of "eager" on one device: the prompt given whole (pieces cut at
    the chunk edges), and a prefill sharded end to end through shard_batch
    (ring attention); decoding crosses window and chunk edges."""
    import longattn.integrations.transformers as lt
    from longattn import context_parallel as cp
    from test_hf import _pair

    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=0)
    ids = torch.randint(1, 50, (2, 13), generator=generator(5))
    for kind in ("gemma2", "gpt_oss", "llama4"):
        model, ref = _pair(kind, impl="longattn_ring", ref_impl="eager")
        ref = ref.float()
        if kind == "gpt_oss":
            with torch.no_grad():  # sinks comparable to the scores, so that they change the tokens
                for m in (model, ref):
                    for layer in m.model.layers:
                        layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
        want = ref.generate(ids, **kw)
        for layout in ("zigzag", "contiguous"):
            got = model.generate(ids, past_key_values=lt.ShardedCache(layout=layout, block=1), **kw)
            assert torch.equal(got, want), (rank, kind, layout, got, want)
        cache = lt.ShardedCache(block=2)
        model(**cp.shard_batch(ids[:, :-1]), past_key_values=cache)  # 12 tokens: dense zigzag rows for world 2 and 3
        got = model.generate(ids, past_key_values=cache, **kw)
        assert torch.equal(got, want), (rank, kind, "sharded prefill", got, want)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_generate_softcap_sinks_chunked_from_sharded_cache(world):
    run_world(_check_generate_families, world)


def test_ring_mask_hook_hands_chunks_and_missing_positions():
    """A chunked layer's mask under "longattn_ring" is its chunk size (the
    ring cuts the sharded documents there); a mask that transformers built
    without position_ids (as GPT-OSS builds its masks) says so; other layers
    get no mask."""
    import longattn.integrations.transformers as lt
    from longattn.integrations.transformers.masks import RingMask, chunks_on_positions
    from test_hf import _config as family_config
    from transformers import masking_utils as mu

    lt.register()
    hook = mu.ALL_MASK_ATTENTION_FUNCTIONS["longattn_ring"]
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    # where the release cuts chunks on token indices (before 5.24) is its own property, not the rank's mask's
    on_index = not chunks_on_positions()
    eager = family_config("llama4")
    eager._attn_implementation = "eager"
    assert on_index == _chunks_on_index(eager)
    assert hook(batch_size=1, q_length=8, kv_length=8, mask_function=chunked) == RingMask(4, chunk_on_index=on_index)
    assert hook(batch_size=1, q_length=8, kv_length=8, mask_function=mu.causal_mask_function) is None
    config = _config()
    config._attn_implementation = "longattn_ring"
    built = mask_args(config=config, inputs_embeds=torch.zeros(1, 8, 4), attention_mask=None)
    assert mu.create_causal_mask(**built) == RingMask(positions=False)
    assert mu.create_causal_mask(**built, position_ids=torch.arange(8)[None]) is None
