"""transformers models under attn_implementation="longattn" / "longattn_dilated"
against the same weights under transformers' own "sdpa" and "eager" attention
in float64 (masks written out by transformers): logits on real tokens and every parameter gradient,
with no mask, right and left padding, packed sequences (Gemma 2's soft-capping,
GPT-OSS's sinks and Llama 4's chunked attention included); greedy generation
against "sdpa"/"eager"; and the errors for what longattn does not run."""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the hf extra needs Python >= 3.11

import longattn.integrations.transformers as lt  # noqa: E402
from reference import rel_err  # noqa: E402

lt.register()
TOL = 1e-4
S = 12


# The families with soft-capping, sinks, chunked attention: layer 0 sliding (chunked), layer 1 full.
FAMILY = {
    # logit soft-capping 2.0: the cap bites (scores ~ N(0, 1-3))
    "gemma2": dict(head_dim=8, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                   query_pre_attn_scalar=8),
    # a learned sink per query head (s_aux)
    "gpt_oss": dict(head_dim=8, sliding_window=4, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
    # layer 0 chunked (chunks of 4, RoPE), layer 1 full (NoPE, temperature tuning)
    "llama4": dict(head_dim=8, attention_chunk_size=4, no_rope_layers=[1, 0], intermediate_size=48,
                   intermediate_size_mlp=48, num_local_experts=2, num_experts_per_tok=1),
}


def mask_args(**kw) -> dict:
    """Keyword arguments of transformers' mask builders (``create_causal_mask``
    ...) with an empty cache, under the name the installed release gives it:
    ``cache`` from 5.24, ``past_key_values`` before."""
    import inspect

    from transformers import masking_utils as mu

    name = "cache" if "cache" in inspect.signature(mu.create_causal_mask).parameters else "past_key_values"
    return {**kw, name: None}


def _config(kind: str, **extra):
    common = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
                  eos_token_id=None, bos_token_id=None)
    if kind in FAMILY:
        common.update(FAMILY[kind])
    common.update(extra)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=4, **common)
    if kind == "qwen2":  # layer 0 full attention, layer 1 a sliding window of 4
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **common)
    two_kinds = dict(layer_types=["sliding_attention", "full_attention"])  # layer 0 a window of 4, layer 1 full
    more = dict(qwen3=(transformers.Qwen3Config, dict(head_dim=8)),
                gemma3=(transformers.Gemma3TextConfig, dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                                            **two_kinds)),
                phi3=(transformers.Phi3Config, {}), olmo=(transformers.OlmoConfig, {}),
                granite=(transformers.GraniteConfig, {}),
                cohere2=(transformers.Cohere2Config, dict(sliding_window=4, **two_kinds)),
                gemma2=(transformers.Gemma2Config, {}), gpt_oss=(transformers.GptOssConfig, {}),
                llama4=(transformers.Llama4TextConfig, {}))
    cls, own = more[kind]
    return cls(**{**own, **common})


MOE = ("gpt_oss", "llama4")


def _pair(kind: str, impl: str = "longattn", ref_impl: str = "sdpa", **extra):
    """The same random weights under impl (float32) and ref_impl (float64)."""
    torch.manual_seed(0)  # (each model its own config: from_config records the attention in it)
    # transformers' grouped-mm experts have no float64: the plain loop for mixture-of-experts families
    moe = dict(experts_implementation="eager") if kind in MOE else {}
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind, **extra), attn_implementation=ref_impl,
                                                        **moe).double()
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **extra), attn_implementation=impl, **moe)
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    return model, ref


def _inputs(case: str):
    torch.manual_seed(1)
    ids = torch.randint(1, 50, (2, S))
    kw, real = {}, torch.ones(2, S, dtype=torch.bool)
    if case in ("right", "left"):
        mask = torch.ones(2, S, dtype=torch.long)
        if case == "right":
            mask[0, 8:] = 0
            mask[1, 11:] = 0
        else:
            mask[0, :5] = 0
            mask[1, :1] = 0
        kw["attention_mask"] = mask
        real = mask.bool()
    elif case == "packed":  # documents of 5, 3, 4 tokens in row 0; 7 and 5 in row 1
        kw["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(7)) + list(range(5))])
        kw["use_cache"] = False  # transformers treats restarting positions as documents only without a cache
    elif case == "flash_kwargs":  # one packed row with the flash-attention varlen keywords
        ids = ids[:1]
        real = real[:1]
        cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
        kw["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
        kw["use_cache"] = False
        kw["extra"] = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    return ids, kw, real


def _run(model, ids, kw, real, weights):
    extra = kw.get("extra", {})
    kw = {k: v for k, v in kw.items() if k != "extra"}
    model.zero_grad(set_to_none=True)
    logits = model(ids, **kw, **extra).logits
    loss = (logits[real] * weights.to(logits.dtype)).sum()  # real tokens only: padding rows are not defined
    loss.backward()
    return logits[real].detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compare(model, ref, case):
    """Logits on real tokens and every parameter gradient of a loss on them."""
    ids, kw, real = _inputs(case)
    torch.manual_seed(2)
    w = torch.randn(int(real.sum()), model.config.vocab_size)
    got, g_got = _run(model, ids, kw, real, w)
    want, g_want = _run(ref, ids, kw, real, w)
    errs = {"logits": rel_err(got, want)}
    errs.update({n: rel_err(g_got[n], g_want[n]) for n in g_want})
    bad = {n: e for n, e in errs.items() if not e < TOL}
    assert not bad, f"{case}: {bad}"


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_logits_and_gradients_match_sdpa_and_eager(kind):
    """Against sdpa and eager in float64. Mistral: every layer has a window of 4 <
    12 tokens; Qwen2: one full layer, one windowed; all GQA (4 query heads, 2 kv
    heads). Eager only where no padding row sees no key at all: its float64
    additive mask turns such rows into NaN (softmax in float32), which then
    spread through the padding rows of later layers."""
    model, ref = _pair(kind, ref_impl="sdpa")
    cases = ["none", "right", "left", "packed"] + (["flash_kwargs"] if kind == "llama" else [])
    for case in cases:
        _compare(model, ref, case)
    model, ref = _pair(kind, ref_impl="eager")
    for case in ["none", "packed"] + (["right"] if kind == "llama" else []):
        _compare(model, ref, case)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "llama4"])
def test_softcap_sinks_chunked_match_eager(kind):
    """Gemma 2 (soft-capping), GPT-OSS (sinks), Llama 4 text (chunked
    attention on its local layers) against eager in float64: logits and every
    parameter gradient (the sinks' included) with no mask, right and left
    padding, packed sequences (Llama 4: chunks cut inside each document, also
    given as flash-attention keywords). Gemma 2 with padding against eager in
    float32: in float64 its additive mask turns the padding rows that see no
    key (its window of 4 within the padding) into NaN, which reach real rows
    through zero weights."""
    model, ref = _pair(kind, ref_impl="eager")
    if kind == "gpt_oss":
        with torch.no_grad():  # sinks comparable to the scores, so that they change the result
            for m in (model, ref):
                for layer in m.model.layers:
                    layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    padded = ["right", "left"]
    cases = ["none", "packed"] + (padded if kind != "gemma2" else [])
    for case in cases + (["flash_kwargs"] if kind == "llama4" else []):
        _compare(model, ref, case)
    if kind == "gpt_oss":
        assert model.model.layers[0].self_attn.sinks.grad.abs().sum() > 0
    if kind == "gemma2":
        for case in padded:
            _compare(model, ref.float(), case)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "llama4"])
def test_softcap_sinks_chunked_are_used(kind):
    """The comparison above can fail: without the family's feature the logits differ."""
    model, ref = _pair(kind, ref_impl="eager")
    ids, _, _ = _inputs("none")
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no weight: no sink
    elif kind == "gemma2":
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    else:
        model.config.attention_chunk_size = 64  # one chunk: full causal attention
    assert rel_err(model(ids).logits.detach(), ref(ids).logits.detach()) > 1e-3


def test_gpt_oss_documents_as_flash_kwargs():
    """transformers' GPT-OSS builds its masks without position_ids, so that
    restarting positions leave a packed row one sequence under eager and
    "longattn" alike (test_softcap_sinks_chunked_match_eager); its documents
    given as cu_seq_lens_q/k (as transformers' flash-attention path takes them)
    reach "longattn" as documents: eager's result with the masks built on the
    position ids (passed ready, as the model allows), which differs from the
    one-sequence run."""
    from transformers import masking_utils as mu

    model, ref = _pair("gpt_oss", ref_impl="eager")
    with torch.no_grad():
        for m in (model, ref):
            for layer in m.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    ids, kw, real = _inputs("flash_kwargs")
    built = mask_args(config=ref.config, inputs_embeds=torch.zeros(1, S, 1, dtype=torch.float64),
                      attention_mask=None, position_ids=kw["position_ids"])
    masks = {"full_attention": mu.create_causal_mask(**built),
             "sliding_attention": mu.create_sliding_window_causal_mask(**built)}
    torch.manual_seed(2)
    w = torch.randn(int(real.sum()), model.config.vocab_size)
    got, g_got = _run(model, ids, kw, real, w)
    want, g_want = _run(ref, ids, dict(position_ids=kw["position_ids"], use_cache=False, attention_mask=masks), real, w)
    errs = {"logits": rel_err(got, want), **{n: rel_err(g_got[n], g_want[n]) for n in g_want}}
    assert not {n: e for n, e in errs.items() if not e < TOL}, errs
    one_sequence, _ = _run(ref, ids, dict(position_ids=kw["position_ids"], use_cache=False), real, w)
    assert rel_err(one_sequence, want) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "llama4"])
def test_training_steps_on_cuda(kind):
    """Two AdamW steps of a mid-size model of each family (hidden 1024, 4
    layers, 16 query / 4 kv heads of 64, windows and chunks of 512, soft-cap
    50; 2 x 2048 tokens, one row right-padded) on CUDA in float32: the losses
    of "longattn" equal eager's to 4 digits and the gradients agree."""
    size = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                initializer_range=0.02)
    size.update(dict(gemma2=dict(sliding_window=512, attn_logit_softcapping=50.0, query_pre_attn_scalar=64),
                     gpt_oss=dict(sliding_window=512, intermediate_size=1024),
                     llama4=dict(attention_chunk_size=512, intermediate_size_mlp=2816,
                                 no_rope_layers=[1, 1, 1, 0]))[kind])  # 3 chunked layers : 1 full, as Llama 4
    torch.manual_seed(0)
    ids = torch.randint(1, 32000, (2, 2048), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 1500:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    runs = {}
    for impl in ("eager", "longattn"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(kind, **size), attn_implementation=impl).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            losses.append(float(loss))
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
        runs[impl] = losses, grads
    (want, g_want), (got, g_got) = runs["eager"], runs["longattn"]
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want)), (got, want)
    bad = {n: e for n in g_want if not (e := rel_err(g_got[n], g_want[n])) < 1e-3}
    assert not bad, bad


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "phi3", "olmo", "granite", "cohere2"])
def test_more_families_match_sdpa_and_eager(kind):
    """More families as they are (Gemma 3 and Cohere 2 with a sliding and a
    full layer): against sdpa in every case, against eager where its float64
    mask makes no NaN (see test_logits_and_gradients_match_sdpa_and_eager)."""
    model, ref = _pair(kind, ref_impl="sdpa")
    for case in ("none", "right", "left", "packed"):
        _compare(model, ref, case)
    model, ref = _pair(kind, ref_impl="eager")
    for case in ("none", "packed"):
        _compare(model, ref, case)


def test_eager_reference_is_sensitive():
    """The comparison can fail: a window the model does not have changes the logits."""
    model, ref = _pair("llama")
    ids, _, _ = _inputs("none")
    ref_logits = ref(ids).logits.detach().float()
    wrong = lt.attention_forward

    def windowed(module, q, k, v, mask, **kw):
        kw["sliding_window"] = 3
        return wrong(module, q, k, v, mask, **kw)

    transformers.AttentionInterface.register("longattn_test_wrong", windowed)
    transformers.masking_utils.AttentionMaskInterface.register(
        "longattn_test_wrong", transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["longattn"])
    model.set_attn_implementation("longattn_test_wrong")
    assert rel_err(model(ids).logits.detach(), ref_logits) > 1e-2


def test_autocast_bf16():
    """Under autocast RoPE leaves q/k in float32 while v is bf16; q/k/v run in the
    autocast dtype, as autocast does for SDPA."""
    model, ref = _pair("llama")
    ref = ref.float()
    ids, kw, real = _inputs("left")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(ids, **kw).logits, ref(ids, **kw).logits
    got.float().sum().backward()
    assert got.dtype == torch.bfloat16 and rel_err(got[real].detach(), want[real].detach()) < 2e-2


def _greedy(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss", "llama4"])
def test_generate_matches_sdpa(kind):
    """Greedy tokens with the KV cache (queries shorter than keys), without and
    with left padding; Mistral's window (4) is shorter than the prompt (7), so the
    sliding cache layers run too (Gemma 2, GPT-OSS: windows of 4; Llama 4:
    chunks of 4 over a sliding cache, decoding across chunk edges). Against
    eager where transformers has no sdpa (Gemma 2, GPT-OSS) or it differs."""
    model, ref = _pair(kind, ref_impl="sdpa" if kind in ("llama", "mistral") else "eager")
    ref = ref.float()
    torch.manual_seed(3)
    ids = torch.randint(1, 50, (2, 7))
    full = torch.ones(2, 7, dtype=torch.long)
    left = full.clone()
    left[0, :3] = 0
    for mask in (full, left):
        want = _greedy(ref, ids, mask, 6)
        got = _greedy(model, ids, mask, 6)
        assert torch.equal(got, want), (mask, got, want)


# ------------------------------------------------------------------------- dilated
def test_dilated_one_full_segment_is_dense_causal():
    """One branch whose segment covers the sequence (rate 1) is dense causal
    attention: equal to eager, no mask and right padding."""
    model, ref = _pair("llama", impl="longattn_dilated", longattn_segment_lengths=[64], longattn_dilation_rates=[1])
    for case in ("none", "right"):
        _compare(model, ref, case)


def test_dilated_right_padding_is_exact():
    """LongNet branches (segments 4, 8; rates 1, 2): a right-padded batch gives the
    logits of each sequence run alone, on its real tokens."""
    cfg = _config("llama", longattn_segment_lengths=[4, 8], longattn_dilation_rates=[1, 2])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="longattn_dilated")
    ids, kw, real = _inputs("right")
    batched = model(ids, **kw).logits
    for r in range(2):
        n = int(real[r].sum())
        alone = model(ids[r:r + 1, :n]).logits[0]
        assert rel_err(batched[r, :n].detach(), alone.detach()) < TOL
    dense = transformers.AutoModelForCausalLM.from_config(
        _config("llama", longattn_segment_lengths=[4, 8], longattn_dilation_rates=[1, 2]),
        attn_implementation="longattn")
    dense.load_state_dict(model.state_dict())
    assert rel_err(dense(ids).logits.detach(), model(ids).logits.detach()) > 1e-3  # the branches do act


def test_dilated_errors():
    cfg = _config("llama", longattn_segment_lengths=[4, 8], longattn_dilation_rates=[1, 2])
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="longattn_dilated")
    ids, kw, _ = _inputs("left")
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        model(ids, **kw)
    ids, kw, _ = _inputs("packed")
    with pytest.raises(ValueError, match="packed documents"):
        model(ids, **kw)
    ids, kw, _ = _inputs("left")
    with pytest.raises(ValueError, match="padding_side = 'right'"):  # left padding in generation too
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, **kw)
    bare = transformers.AutoModelForCausalLM.from_config(_config("llama"), attn_implementation="longattn_dilated")
    with pytest.raises(ValueError, match="longattn_segment_lengths"):
        bare(ids)
    mistral = transformers.AutoModelForCausalLM.from_config(
        _config("mistral", longattn_segment_lengths=[4], longattn_dilation_rates=[1]),
        attn_implementation="longattn_dilated")
    with pytest.raises(ValueError, match="sliding_window = None"):
        mistral(ids)


def test_dilated_generate_decodes_from_the_cache():
    """Greedy tokens decoded from the KV cache (dilated_decode_attention) equal
    those of recomputing dilated attention over the whole sequence at every
    step (use_cache=False); a prompt longer than the largest segment, GQA."""
    cfg = _config("llama", longattn_segment_lengths=[4, 8], longattn_dilation_rates=[1, 2])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="longattn_dilated")
    ids = torch.randint(1, 50, (2, 11), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    got, want = model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw)
    assert torch.equal(got, want), (got, want)


# -------------------------------------------------------------------------- errors
def test_unsupported_options_raise():
    ids = torch.randint(1, 50, (1, 8))
    drop = transformers.AutoModelForCausalLM.from_config(_config("llama", attention_dropout=0.1),
                                                         attn_implementation="longattn")
    drop.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        drop(ids)
    drop.eval()
    drop(ids)  # no dropout outside training
    model, _ = _pair("llama")
    with pytest.raises(ValueError, match="output_attentions=False"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="4-D mask|2-D"):
        model(ids, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="static"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static")
    attn = model.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        lt.attention_forward(attn, q, k, k, None)
    with pytest.raises(ValueError, match="soft-capping"):  # the single-device function runs it
        lt.dilated_attention_forward(attn, q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="attention sinks"):
        lt.dilated_attention_forward(attn, q, q, q, None, s_aux=torch.zeros(4))


def test_custom_mask_parts_raise():
    """Or-masks cannot be expressed: the mask hook raises instead of dropping
    them. Chunked attention (Llama 4) becomes documents cut at the chunk edges
    (after left padding) for "longattn"; the ring's hook hands on the chunk size
    (tests/test_hf_dist.py runs it); the dilated hook raises."""
    from longattn.integrations.transformers.masks import Documents
    from transformers import masking_utils as mu

    hook = mu.ALL_MASK_ATTENTION_FUNCTIONS["longattn"]
    chunked = mu.chunked_causal_mask_function(4, torch.tensor([0, 2]))
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, :2] = False
    docs = hook(batch_size=2, q_length=10, kv_length=10, mask_function=chunked, attention_mask=pad)
    assert isinstance(docs, Documents) and docs.cu_k.tolist() == [0, 4, 8, 10, 14, 18]
    short = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    assert hook(batch_size=1, q_length=4, kv_length=4, mask_function=short) is None  # one chunk: dense
    with pytest.raises(ValueError, match="chunked attention"):
        mu.ALL_MASK_ATTENTION_FUNCTIONS["longattn_dilated"](batch_size=1, q_length=8, kv_length=8,
                                                              mask_function=chunked)
    custom = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k == 0)
    with pytest.raises(ValueError, match="flex_attention"):
        hook(batch_size=1, q_length=8, kv_length=8, mask_function=custom)


def test_value_head_dim_smaller_than_query():
    """MLA-style value heads narrower than q/k: padded with zeros and cropped (exact)."""
    model, _ = _pair("llama")
    attn = model.model.layers[0].self_attn
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 6)
    out, w = lt.attention_forward(attn, q, k, v, None, scaling=0.3)
    assert w is None and out.shape == (2, 9, 4, 6)
    from reference import attention_ref

    vp = torch.nn.functional.pad(v, (0, 2))
    ref, _ = attention_ref(q.transpose(1, 2).double(), k.transpose(1, 2).double(), vp.transpose(1, 2).double(),
                        causal=True, scale=0.3)
    assert rel_err(out, ref[..., :6]) < TOL


def test_mask_hook_hands_the_call_documents():
    """What the mask hook returns is what transformers hands each attention call
    as attention_mask: None for dense rows, Documents (the real tokens as packed
    documents) for padding; a 2-D padding mask given to the call directly runs
    the same, and a padded row equals that sequence alone."""
    from longattn.integrations.transformers.masks import Documents

    hook = transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["longattn"]
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, :3] = False
    docs = hook(batch_size=2, q_length=9, kv_length=9, attention_mask=pad)
    assert isinstance(docs, Documents) and docs.cu_k.tolist() == [0, 6, 15]
    assert hook(batch_size=2, q_length=9, kv_length=9, attention_mask=torch.ones_like(pad)) is None
    model, _ = _pair("llama")
    attn = model.model.layers[0].self_attn
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    got, _ = lt.attention_forward(attn, q, k, v, docs, scaling=0.3)
    direct, _ = lt.attention_forward(attn, q, k, v, pad, scaling=0.3)
    assert torch.equal(got, direct) and not got[0, :3].any()
    from reference import attention_ref

    alone, _ = attention_ref(*(x[:1, :, 3:].transpose(1, 2).double() for x in (q, k, v)), causal=True, scale=0.3)
    assert rel_err(got[:1, 3:], alone) < TOL


def test_import_longattn_does_not_import_transformers():
    code = "import sys, longattn; assert 'transformers' not in sys.modules; longattn.context_parallel"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------- example and benchmark (tiny)
def _load(path):
    import importlib.util
    import os

    full = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], full)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_finetune_example_runs_and_matches_sdpa():
    ex = _load("examples/finetune_hf.py")
    args = ["--steps", "3", "--seqlen", "64", "--batch", "2", "--hidden", "32", "--pack"]
    got = ex.main(args + ["--attn", "longattn"])
    want = ex.main(args + ["--attn", "sdpa"])
    assert len(got) == 3 and all(abs(a - b) < 1e-4 * abs(b) for a, b in zip(got, want)), (got, want)


def test_hf_train_benchmark_tiny(tmp_path):
    """`bench hf-train`: several implementations in one run, one JSON whose
    name carries the commit; ours gives SDPA's losses on one sequence and on
    packed documents; transformers' flex_attention runs or says why not (no
    FlexAttention backward on CPU)."""
    from longattn.bench import hf_train as bench
    from longattn.bench.measure import short_commit

    for docs, attns in (("1", ["longattn", "sdpa"]), ("4", ["longattn", "sdpa", "flex_attention"])):
        out = tmp_path / f"hf_{docs}_{{commit}}.json"
        payload = bench.main(["--tiny", "--attn", *attns, "--docs", docs, "--steps", "2", "--warmup", "1",
                              "--seqlen", "64", "--out", str(out)])
        assert (tmp_path / f"hf_{docs}_{short_commit()}.json").exists()
        assert {"transformers", "torch", "commit", "command", "device"} <= set(payload["env"])
        rows = {r["attn"]: r for r in payload["results"]}
        assert list(rows) == attns
        for attn in ("longattn", "sdpa"):
            row = rows[attn]
            assert row["error"] is None and row["step_ms_median"] > 0 and row["tokens_per_s_per_gpu"] > 0
        a, b = rows["longattn"]["losses"], rows["sdpa"]["losses"]
        assert len(a) == 3 and all(abs(x - y) < 1e-4 * abs(y) for x, y in zip(a, b)), (docs, a, b)
        if "flex_attention" in rows:
            flex = rows["flex_attention"]
            assert (flex["error"] and "CPU" in flex["error"]) or flex["losses"] == pytest.approx(b, rel=1e-4)


def test_hf_train_one_device_row_skips_the_ranks_collectives(monkeypatch):
    """A one-device row after a ring row in the same process (as the
    distributed test's reference on rank 0 alone) neither waits for the other
    ranks to release the ring's exchange slots nor counts them in its peak."""
    import types

    from longattn.bench import hf_train as bench
    from longattn.distributed import transport

    monkeypatch.setitem(transport._slots, "left by a ring row", types.SimpleNamespace(buf=torch.empty(8), memops=False))
    row = bench.run(bench.parse(["--tiny", "--attn", "longattn", "--seqlen", "64", "--steps", "1", "--warmup", "1"]),
                    1, torch.device("cpu"))
    assert row["error"] is None and len(row["losses"]) == 2, row


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "llama4"])
def test_hf_train_benchmark_families_tiny(family):
    """`bench hf-train --family`: a tiny Gemma 2 (soft-capping, a window of 32),
    GPT-OSS (sinks, a window of 32, experts) and Llama 4 text (chunks of 32,
    a NoPE layer, experts) on 128 tokens: the initial loss under "longattn"
    equals eager's to 4 digits, the rows say the family and its config, and
    sdpa, which transformers refuses for soft-capping and sinks, is a row
    with the reason."""
    from longattn.bench import hf_train as bench

    attns = ["longattn", "eager"] + (["sdpa"] if family != "llama4" else [])
    payload = bench.main(["--tiny", "--family", family, "--attn", *attns, "--seqlen", "128", "--steps", "1",
                          "--warmup", "0"])
    rows = {r["attn"]: r for r in payload["results"]}
    assert all(r["family"] == family for r in rows.values())
    config = payload["model_config"]
    assert config[dict(gemma2="attn_logit_softcapping", gpt_oss="num_local_experts",
                       llama4="attention_chunk_size")[family]]
    got, want = rows["longattn"]["initial_loss"], rows["eager"]["initial_loss"]
    assert rows["longattn"]["error"] is None and abs(got - want) <= 1e-4 * abs(want), (got, want)
    assert payload["loss_check"]["eager"]["agree_4_digits"]
    if "sdpa" in rows:
        assert "transformers runs" in rows["sdpa"]["error"] and rows["sdpa"]["losses"] == []
    # GPT-OSS's packed row is one sequence unsharded: no longattn_ring row of packed documents
    packed_ring = bench.unavailable("longattn_ring", family, docs=4)
    assert (packed_ring is not None) == (family == "gpt_oss") and bench.unavailable("longattn_ring", family) is None


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "llama4"])
def test_hf_train_benchmark_families_on_cuda(family, tmp_path):
    """`bench hf-train --family` on CUDA in bf16, 4 layers of the ~1B
    family at 4096 tokens (windows, chunks and soft-capping as the family
    has them): "longattn" runs and its initial loss equals transformers' own
    attention's (eager) to 4 digits."""
    from longattn.bench import hf_train as bench

    payload = bench.main(["--family", family, "--attn", "longattn", "eager", "--layers", "4", "--seqlen", "4096",
                          "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "hf.json")])
    rows = {r["attn"]: r for r in payload["results"]}
    assert rows["longattn"]["error"] is None and rows["longattn"]["step_ms_median"] > 0
    assert payload["loss_check"]["eager"]["agree_4_digits"], payload["loss_check"]
