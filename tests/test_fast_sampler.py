"""The opt-in fast sampler (cached_sample.generate_cached's cache= and threshold=, after Fast-dLLM): without a cache or a
threshold it is the exact sampler, token for token; the model's key/value cache is exact where it is built; a cache
rebuilt at every step gives the exact sampler's tokens (so the cache logic is the only difference of the fast modes);
without a threshold the cached sampler keeps the exact step schedule; the threshold unmasks what is confident and
ends blocks early."""

import pytest
import torch
from test_sample import EOS, MASK, SETTINGS, left_pad, no_mask_model, random_prompts, tiny_model

import cached_sample
import sample
from model import apply_rope, rope_cos_sin
from sample import SamplerOptions, generate
from cached_sample import KVCache, generate_cached

pytestmark = pytest.mark.numerics  # float32 against goldens and other code paths (conftest.py)


def float64_model(seed=0):
    """A model that never proposes the mask token, in float64: a different summation order cannot flip a token."""
    return no_mask_model(seed).double()


def padded_batch(seed=0):
    """Three prompts of lengths 5, 9, 7, left-padded: (ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(0, EOS, (n,), generator=g) for n in (5, 9, 7)])


@pytest.mark.parametrize("draws", ["global_rng", "per_row_generators"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_without_cache_or_threshold_it_is_the_exact_sampler(name, draws):
    """generate_cached(cache=None, threshold=None) degenerates to generate(): the same tokens, from the same random
    draws in the same order (the global RNG ends in the same state), on every setting checked against the official
    sampler, with a left-padded batch and a model that may propose the mask token itself."""
    model = tiny_model(seed=1)
    prompt, attention_mask = left_pad([random_prompts(1, n, seed=n)[0] for n in (3, 6, 5)])

    def run(sampler):
        torch.manual_seed(7)
        rows = [torch.Generator().manual_seed(s) for s in (1, 2, 3)] if draws == "per_row_generators" else None
        out = sampler(rows)
        return out, torch.get_rng_state()

    exact, exact_state = run(lambda rows: generate(model, prompt, attention_mask, generator=rows, **SETTINGS[name]))
    cached, cached_state = run(lambda rows: generate_cached(
        model, prompt, attention_mask, SamplerOptions(**SETTINGS[name], cache=None, threshold=None), generator=rows))
    assert torch.equal(cached, exact) and torch.equal(cached_state, exact_state)


def test_the_cache_holds_a_fresh_forwards_keys_and_values():
    """An empty KVCache stores, for every block, the keys and values a plain forward computes (RoPE applied); a span
    forward that reads them gives the full forward's hidden states at the span."""
    model = float64_model()
    ids, mask = padded_batch()
    blocks = model.model.transformer.blocks
    inputs = []
    hooks = [b.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for b in blocks]
    full = model(ids, attention_mask=mask, return_hidden=True)
    for h in hooks:
        h.remove()
    cache = KVCache()
    cached_run = model(ids, attention_mask=mask, return_hidden=True, cache=cache)
    assert torch.equal(cached_run, full) and len(cache.layers) == len(blocks)
    cos, sin = rope_cos_sin(ids.shape[1], model.config.head_dim, model.config.rope_theta, ids.device)
    for block, x, (k, v) in zip(blocks, inputs, cache.layers):
        n = block.attn_norm(x)
        B, L, _ = x.shape
        k_ref = apply_rope(block.k_proj(n).view(B, L, block.n_kv_heads, -1).transpose(1, 2), cos, sin)
        v_ref = block.v_proj(n).view(B, L, block.n_kv_heads, -1).transpose(1, 2)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    for s, e in ((0, 4), (3, 7), (6, ids.shape[1])):
        cache.start = s
        span = model(ids[:, s:e], attention_mask=mask, return_hidden=True, cache=cache)
        torch.testing.assert_close(span, full[:, s:e], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("kw", [dict(steps=16, block_length=4), dict(steps=8, block_length=8),
                                dict(steps=8, block_length=4, cfg_scale=1.5),
                                dict(steps=8, block_length=4, temperature=0.7)], ids=["b4", "b8", "cfg", "temp"])
def test_a_cache_rebuilt_every_step_gives_the_exact_tokens(cache, kw):
    """cache_refresh=1: every step rebuilds the cache from the current tokens, so nothing stale is read: the exact
    sampler's tokens, draws included (a span read of a fresh cache is the full forward: the test above)."""
    model = float64_model()
    ids, mask = padded_batch()
    exact = generate(model, ids, mask, gen_length=16, generator=torch.Generator().manual_seed(3), **kw)
    cached = generate_cached(model, ids, mask, SamplerOptions(gen_length=16, cache=cache, cache_refresh=1, **kw),
                             generator=torch.Generator().manual_seed(3))
    assert torch.equal(cached, exact)
    assert not (exact == MASK).any()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_one_step_per_block_never_reads_the_cache(cache):
    """A block's first step is a full forward (it builds the cache): with one step per block the cached sampler is
    the exact one. With more steps the later ones read stale keys and values, and the tokens may differ, but every
    mask is filled and the prompt kept."""
    model = float64_model()
    ids, mask = padded_batch()
    kw = dict(steps=4, gen_length=16, block_length=4)
    assert torch.equal(generate_cached(model, ids, mask, SamplerOptions(cache=cache, **kw)),
                       generate(model, ids, mask, **kw))
    out = generate_cached(model, ids, mask, SamplerOptions(steps=16, gen_length=16, block_length=4, cache=cache))
    assert torch.equal(out[:, :ids.shape[1]], ids) and not (out == MASK).any()


def unmasked_per_step(monkeypatch, sampler, **kw):
    """Run the sampler and return, per step, how many tokens each row unmasked."""
    counts, real = [], sample.transfer_index

    def record(confidence, k):
        chosen = real(confidence, k)
        counts.append(chosen.sum(1).tolist())
        return chosen
    monkeypatch.setattr(sample, "transfer_index", record)
    monkeypatch.setattr(cached_sample, "transfer_index", record)
    sampler(float64_model(), *padded_batch(), gen_length=16, **kw)
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize("steps,block_length", [(16, 4), (8, 4), (4, 16)])
def test_without_a_threshold_the_cached_sampler_keeps_the_exact_schedule(monkeypatch, steps, block_length):
    exact = unmasked_per_step(monkeypatch, generate, steps=steps, block_length=block_length)
    assert len(exact) == steps
    for cache in ("prefix", "dual"):
        assert unmasked_per_step(monkeypatch, lambda model, ids, mask, **kw: generate_cached(
            model, ids, mask, SamplerOptions(**kw)), steps=steps, block_length=block_length, cache=cache) == exact


def test_threshold_unmasks_every_confident_token_and_ends_blocks_early():
    model = float64_model()
    ids, mask = padded_batch()
    calls = []
    hook = model.register_forward_hook(lambda m, args, out: calls.append(1))
    out = generate_cached(model, ids, mask, SamplerOptions(steps=16, gen_length=16, block_length=4, cache=None,
                                                           threshold=0.0))
    assert len(calls) == 4  # every candidate beats 0: each block in one step
    assert not (out == MASK).any()
    calls.clear()
    # a threshold nothing reaches: one token per step, the most confident: the exact sampler with one per step
    out = generate_cached(model, ids, mask, SamplerOptions(steps=16, gen_length=16, block_length=4, cache=None,
                                                           threshold=1 - 1e-12))
    hook.remove()
    assert len(calls) == 16
    assert torch.equal(out, generate(model, ids, mask, steps=16, gen_length=16, block_length=4))
    for cache in ("prefix", "dual"):  # with a cache too: fewer steps, every mask filled
        fast = generate_cached(model, ids, mask, SamplerOptions(steps=16, gen_length=16, block_length=4, threshold=0.5,
                                                                cache=cache))
        assert not (fast == MASK).any() and torch.equal(fast[:, :ids.shape[1]], ids)


def test_per_row_generators_make_a_rows_noise_independent_of_its_batch():
    model = float64_model()
    ids, mask = padded_batch()
    seeds = [11, 12, 13]
    together = generate(model, ids, mask, steps=8, gen_length=8, block_length=4, temperature=1.0,
                        generator=[torch.Generator().manual_seed(s) for s in seeds])
    for r in range(3):
        alone = generate(model, ids[r:r + 1], mask[r:r + 1], steps=8, gen_length=8, block_length=4,
                         temperature=1.0, generator=[torch.Generator().manual_seed(seeds[r])])
        assert torch.equal(alone, together[r:r + 1])


def test_bad_fast_options_are_refused():
    model = float64_model()
    ids = random_prompts(1, 4, 0)
    with pytest.raises(ValueError, match="cache='full'"):
        generate_cached(model, ids, options=SamplerOptions(gen_length=4, steps=4, block_length=4, cache="full"))
    with pytest.raises(ValueError, match="threshold=1.5"):
        generate_cached(model, ids, options=SamplerOptions(gen_length=4, steps=4, block_length=4, cache="dual",
                                                           threshold=1.5))
    with pytest.raises(ValueError, match="2 generators for 1 rows"):
        generate(model, ids, gen_length=4, steps=4, block_length=4, generator=[torch.Generator()] * 2)


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
def test_what_each_mode_runs_at_each_step(cache):
    """Exact: the whole sequence at every step. Prefix: the whole sequence at a block's first step, then the block
    and everything after it. Dual: the whole sequence at a block's first step, then the block only."""
    model = float64_model()
    ids, mask = padded_batch()  # P = 9
    lengths = []
    hook = model.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    generate_cached(model, ids, mask,
                    SamplerOptions(steps=8, gen_length=8, block_length=4, cache=cache))  # 2 blocks x 4 steps, L = 17
    hook.remove()
    P, L = 9, 17
    want = {None: [L] * 8,
            "prefix": [L, L - P, L - P, L - P, L, L - P - 4, L - P - 4, L - P - 4],
            "dual": [L, 4, 4, 4, L, 4, 4, 4]}[cache]
    assert lengths == want


def test_sample_cli_fast_flags_and_checks(tmp_path, capsys):
    import embedded
    from model import LLaDA
    tok = embedded.make_char_tokenizer()
    config = embedded.tiny_config_for(tok, d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64,
                                      max_sequence_length=64)
    LLaDA(config).init_weights(torch.Generator().manual_seed(0)).save_pretrained(tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    common = ["--model", str(tmp_path / "m"), "--device", "cpu", "--raw", "--prompt", "1234"]
    cached = cached_sample.generate_with_options  # what `python cached_sample.py` chats with
    sample.main(common + ["--gen-length", "8", "--steps", "8", "--block-length", "4", "--cache", "dual",
                          "--threshold", "0.9"], sampler=cached)
    assert capsys.readouterr().out
    sample.main(common + ["--gen-length", "8", "--steps", "8", "--block-length", "8", "--cache", "dual",
                          "--cache-drift", "0.9"], sampler=cached)
    assert capsys.readouterr().out
    with pytest.raises(SystemExit):  # sample.py's own chat: the exact sampler; the cached one is named, in one line
        sample.main(common + ["--cache", "dual"])
    err = capsys.readouterr().err
    assert "python cached_sample.py" in err.strip().splitlines()[-1] and "Traceback" not in err
    for flags, message in ((["--gen-length", "0"], "--gen-length 0: must be at least 1"),
                           (["--threshold", "2"], "--threshold 2.0: a confidence in [0, 1)"),
                           (["--cache-drift", "0.9"], "--cache-drift 0.9: a cosine similarity in (0, 1], with --cache"),
                           (["--cache", "dual", "--cache-drift", "2"], "--cache-drift 2.0: a cosine similarity"),
                           (["--cache-refresh", "2"], "--cache-refresh 2: a number of steps >= 1, with --cache"),
                           (["--cache", "all"], "invalid choice: 'all'")):
        with pytest.raises(SystemExit):
            sample.main(common + flags)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # refused with the flags, before the model loads
        sample.main(common + ["--gen-length", "64"])
    assert "--gen-length 64 leaves no room for a prompt" in capsys.readouterr().err


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("kw", [dict(steps=16, block_length=4), dict(steps=8, block_length=8),
                                dict(steps=8, block_length=4, temperature=0.7)], ids=["b4", "b8", "temp"])
def test_a_cache_refreshed_every_step_gives_the_exact_tokens(cache, kw):
    """cache_refresh=1: every step is a full forward that rebuilds the cache, so every step sees what the exact
    sampler sees."""
    model = float64_model()
    ids, mask = padded_batch()
    exact = generate(model, ids, mask, gen_length=16, generator=torch.Generator().manual_seed(3), **kw)
    refreshed = generate_cached(model, ids, mask, SamplerOptions(gen_length=16, cache=cache, cache_refresh=1, **kw),
                                generator=torch.Generator().manual_seed(3))
    assert torch.equal(refreshed, exact)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("every", [2, 3])
def test_the_refresh_schedule_runs_what_it_says(cache, every):
    """cache_refresh=N: in each block, steps 0, N, 2N, ... run the whole sequence (and rebuild the cache), the others
    the span the cache mode reads."""
    model = float64_model()
    ids, mask = padded_batch()  # P = 9
    lengths = []
    hook = model.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    generate_cached(model, ids, mask, SamplerOptions(steps=8, gen_length=8, block_length=4, cache=cache,
                                                     cache_refresh=every))
    hook.remove()
    P, L = 9, 17
    span = {"prefix": [L - P, L - P - 4], "dual": [4, 4]}[cache]  # block 0's, block 1's
    want = [L if i % every == 0 else span[b] for b in range(2) for i in range(4)]
    assert lengths == want


def test_a_bad_refresh_is_refused():
    model = float64_model()
    ids = random_prompts(1, 4, 0)
    for bad, cache in ((0, "dual"), (1.5, "dual"), (2, None)):
        with pytest.raises(ValueError, match="cache_refresh"):
            generate_cached(model, ids, options=SamplerOptions(gen_length=4, steps=4, block_length=4, cache=cache,
                                                               cache_refresh=bad))


# -----------------------------------------------------------------------------
# The adaptive refresh (cache_drift): Elastic-Cache's attention-drift test, row by row


def test_attention_probs_are_what_the_fused_kernel_weighs_the_values_with():
    """cached_sample.attention_probs (the drift test's view of attention) times the values equals
    scaled_dot_product_attention with grouped-query heads and padded keys, in float64."""
    from cached_sample import attention_probs
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)  # (B, H, S, hd)
    # (B, Hkv, L, hd) each: kv head j serves query heads 2j, 2j + 1
    k, v = torch.randn(2, 2, 2, 6, 8, generator=g, dtype=torch.float64)
    key_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    p = attention_probs(q, k, key_mask)  # (B, H, S, L)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, enable_gqa=True)
    torch.testing.assert_close(p.double() @ v.repeat_interleave(2, dim=1), want, rtol=1e-6, atol=1e-6)
    assert torch.all(p[1, :, :, :2] == 0)  # padding receives nothing
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 3, dtype=p.dtype))


def test_the_model_reports_each_layers_attention_rows_for_the_queries_asked():
    model = float64_model()
    ids, mask = padded_batch()  # (3, 9)
    rows = []
    plain = model(ids, attention_mask=mask, return_hidden=True)
    probed = model(ids, attention_mask=mask, return_hidden=True, cache=KVCache(probe=(4, 7, rows)))
    assert torch.equal(probed, plain) and len(rows) == len(model.model.transformer.blocks)
    for r in rows:
        assert r.shape == (3, 3, 9)  # (B, queries 4 .. 6, every key)
        assert torch.all(r[0, :, :4] == 0)  # row 0 has 4 padding positions
        torch.testing.assert_close(r.sum(-1), torch.ones(3, 3, dtype=r.dtype))


def test_attention_drift_by_hand():
    """One layer, two rows, a block of 2 tokens at positions 2, 3 of 4. At the building step each row tracks the
    block token its block attends to most; the next step flags a row whose tracked token's attention row turned
    (cosine 0.6 < 0.9), not one whose row only scaled; a rebuilt row starts a new reference."""
    from cached_sample import attention_drift
    e = torch.eye(4)
    attn = torch.stack([torch.stack([e[3], e[3]]), torch.stack([e[2], e[0]])])[None]  # (1, B=2, Lb=2, L=4)
    # row 0: both queries attend to position 3 (block token 1); row 1: query 0 attends to position 2 (block token 0)
    built = torch.tensor([True, True])
    drifted, tracked, reference = attention_drift(attn, built, None, None, 0.9, block_start=2)
    assert drifted.tolist() == [False, False] and tracked.tolist() == [[1, 0]]
    assert torch.equal(reference[0], torch.stack([e[3], e[2]]))
    turned = torch.tensor([0.0, 0.0, 0.6, 0.8])  # cosine 0.6 with e[2]
    attn2 = attn.clone()
    attn2[0, 0, 1] = 0.5 * e[3] + 0.5 * e[3]  # row 0's tracked token: the same direction
    attn2[0, 1, 0] = turned  # row 1's tracked token turned
    drifted, tracked, reference = attention_drift(attn2, ~built, tracked, reference, 0.9, block_start=2)
    assert drifted.tolist() == [False, True]
    assert torch.equal(reference[0, 1], e[2])  # kept until the row is rebuilt
    drifted, tracked, reference = attention_drift(attn2, torch.tensor([False, True]), tracked, reference, 0.9, 2)
    assert drifted.tolist() == [False, False] and torch.equal(reference[0, 1], attn2[0, 1, tracked[0, 1]])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("kw", [dict(steps=8, block_length=4), dict(steps=8, block_length=8, threshold=0.5),
                                dict(steps=8, block_length=4, cfg_scale=0.5, temperature=0.5)],
                         ids=["b4", "threshold", "cfg"])
def test_a_row_the_drift_test_flags_is_rebuilt_and_sees_the_exact_tokens(monkeypatch, cache, kw):
    """With the test made to flag row 0 at every step, row 0's cache is rebuilt at every step (a full forward of that
    row alone, written into the batch's cache): row 0 gets the exact sampler's tokens (without a threshold) or the
    uncached threshold sampler's, and rows 1, 2 the plain cached sampler's, token for token."""
    model = float64_model()
    ids, mask = padded_batch()
    real, calls = cached_sample.attention_drift, []

    def row_zero(attn, built, tracked, reference, gamma, block_start):
        calls.append(1)
        drifted, tracked, reference = real(attn, built, tracked, reference, gamma, block_start)
        return torch.tensor([True, False, False]), tracked, reference

    def run(**fast):
        return generate_cached(model, ids, mask, SamplerOptions(gen_length=16, **kw, **fast),
                               generator=torch.Generator().manual_seed(3))

    plain = run(cache=cache)
    uncached = run(cache=None) if "threshold" in kw else generate(
        model, ids, mask, gen_length=16, generator=torch.Generator().manual_seed(3),
        **{k: v for k, v in kw.items() if k != "threshold"})
    monkeypatch.setattr(cached_sample, "attention_drift", row_zero)
    flagged = run(cache=cache, cache_drift=0.9)
    assert calls  # the hook ran
    assert torch.equal(flagged[0], uncached[0]) and torch.equal(flagged[1:], plain[1:])
    assert not torch.equal(plain[0], uncached[0])  # the cache alone does change row 0 here: the test can fail


def test_a_drift_threshold_of_zero_never_rebuilds(monkeypatch):
    """Probabilities are non-negative, so no cosine is below a tiny gamma: nothing is rebuilt, the tokens are the
    plain cache's; and gamma 1 rebuilds something."""
    model = float64_model()
    ids, mask = padded_batch()
    rebuilt = []
    real = cached_sample.rebuild_rows
    monkeypatch.setattr(cached_sample, "rebuild_rows", lambda *a: (rebuilt.append(int(a[-1].sum())), real(*a)))
    kw = dict(gen_length=16, steps=16, block_length=16, cache="dual")
    assert torch.equal(generate_cached(model, ids, mask, SamplerOptions(cache_drift=1e-9, **kw)),
                       generate_cached(model, ids, mask, SamplerOptions(**kw)))
    assert rebuilt == []
    generate_cached(model, ids, mask, SamplerOptions(cache_drift=1.0, **kw))
    assert sum(rebuilt) > 0


def test_a_bad_drift_threshold_is_refused():
    model = float64_model()
    ids = random_prompts(1, 4, 0)
    for bad, cache in ((0, "dual"), (1.5, "dual"), (0.9, None)):
        with pytest.raises(ValueError, match="cache_drift"):
            generate_cached(model, ids, options=SamplerOptions(gen_length=4, steps=4, block_length=4, cache=cache,
                                                               cache_drift=bad))
