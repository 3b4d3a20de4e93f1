"""sample.py against a line-for-line transcription of LLaDA's official generate.py, plus the sampler's semantics:
the schedule, prompt kept, no mask left, batch rows independent, CFG with and without an attention mask,
left padding, and a scripted model whose logits we dictate, checked step by step."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from model import LLaDA, LLaDAConfig
from official_sampler import official_generate, official_get_num_transfer_tokens  # the oracle, beside this file
from sample import generate, get_num_transfer_tokens, transfer_index

pytestmark = pytest.mark.numerics  # float32 against goldens and other code paths (conftest.py)


V, MASK, EOS = 48, 47, 46


def tiny_model(seed=0, std=0.2):
    """A random float32 LLaDA, small enough for many sampler runs; std 0.2 makes its predictions peaked enough to
    be interesting (std 0.02 gives nearly uniform logits)."""
    cfg = LLaDAConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=64, vocab_size=V,
                      embedding_size=V, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS)
    return LLaDA(cfg).init_weights(torch.Generator().manual_seed(seed), std=std).eval()


class NoMaskHead(nn.Module):
    """The LM head with the mask token's logit pushed to -1e9 (finite, so CFG's cond - uncond stays finite): a model
    that, like trained LLaDA, never proposes the mask token."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h):
        logits = self.head(h)
        logits[..., MASK] = -1e9
        return logits


def no_mask_model(seed=0):
    model = tiny_model(seed)
    model.model.transformer.ff_out = NoMaskHead(model.model.transformer.ff_out)
    return model


def random_prompts(B, P, seed):
    return torch.randint(0, EOS, (B, P), generator=torch.Generator().manual_seed(seed))  # no eos, no mask


def left_pad(prompts):
    """Left-pad a list of 1-D prompts with EOS (LLaDA's pad) -> ids (B, P), attention_mask (B, P)."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), EOS, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = p
        mask[b, P - len(p):] = 1
    return ids, mask


# -----------------------------------------------------------------------------
# Token for token against the official sampler


SETTINGS = {  # name: generate() keywords (besides the prompt)
    "one_block": dict(steps=16, gen_length=16, block_length=16),
    "blocks": dict(steps=12, gen_length=24, block_length=8),
    "one_token_per_step": dict(steps=16, gen_length=16, block_length=4),
    "uneven_split": dict(steps=6, gen_length=20, block_length=10),  # 10 masks in 3 steps: 4, 3, 3
    "more_steps_than_masks": dict(steps=12, gen_length=8, block_length=4),  # 4 masks in 6 steps: 1,1,1,1,0,0
    "temperature": dict(steps=12, gen_length=24, block_length=8, temperature=1.0),
    "temperature_random": dict(steps=8, gen_length=16, block_length=8, temperature=0.7, remasking="random"),
    "greedy_random": dict(steps=8, gen_length=16, block_length=8, remasking="random"),
    "cfg_no_mask": dict(steps=8, gen_length=16, block_length=8, cfg_scale=1.5),
    "cfg_temperature": dict(steps=8, gen_length=16, block_length=4, cfg_scale=0.5, temperature=0.5),
}


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_generate_equals_official(name, padded):
    kw = SETTINGS[name]
    model = tiny_model(seed=1)
    if padded:  # rows of 3, 6 and 5 tokens, left-padded with EOS and an attention mask
        prompt, attention_mask = left_pad([random_prompts(1, n, seed=n)[0] for n in (3, 6, 5)])
    else:
        prompt, attention_mask = random_prompts(3, 6, seed=0), None
    ours = generate(model, prompt, attention_mask, **kw, generator=torch.Generator().manual_seed(7))
    ref = official_generate(model, prompt, attention_mask, **kw, mask_id=MASK,
                            generator=torch.Generator().manual_seed(7))
    assert torch.equal(ours, ref)
    if kw.get("temperature", 0) > 0:  # the generator matters: another seed gives other tokens
        other = generate(model, prompt, attention_mask, **kw, generator=torch.Generator().manual_seed(8))
        assert not torch.equal(other, ours)


def test_global_rng_when_no_generator():
    """generator=None draws from the global RNG exactly as the official code (torch.rand_like) does."""
    model, prompt = tiny_model(seed=2), random_prompts(2, 5, seed=3)
    kw = dict(steps=8, gen_length=16, block_length=8, temperature=1.0, remasking="random")
    torch.manual_seed(11)
    ours = generate(model, prompt, **kw)
    torch.manual_seed(11)
    assert torch.equal(ours, official_generate(model, prompt, **kw, mask_id=MASK))


# -----------------------------------------------------------------------------
# Building blocks


def test_num_transfer_tokens_schedule():
    def schedule(m, steps, Lb=24):
        mask = torch.zeros(1, Lb, dtype=torch.bool)
        mask[0, torch.randperm(Lb, generator=torch.Generator().manual_seed(m))[:m]] = True
        return get_num_transfer_tokens(mask, steps)[0].tolist()

    assert schedule(8, 4) == [2, 2, 2, 2]  # even split
    assert schedule(10, 4) == [3, 3, 2, 2]  # uneven: the first m % steps steps take one more
    assert schedule(3, 5) == [1, 1, 1, 0, 0]  # more steps than masks: the last steps unmask nothing
    assert schedule(0, 3) == [0, 0, 0]
    assert schedule(24, 1) == [24]
    # per row, and equal to the official loop on random masks
    mask = torch.rand(6, 13, generator=torch.Generator().manual_seed(0)) < 0.6
    for steps in (1, 2, 5, 13, 20):
        ours = get_num_transfer_tokens(mask, steps)
        assert ours.dtype == torch.long and ours.shape == (6, steps)
        assert torch.equal(ours, official_get_num_transfer_tokens(mask, steps))
        assert torch.equal(ours.sum(1), mask.sum(1))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.bf16)])
def test_transfer_index_breaks_ties_like_per_row_topk(dtype):
    """Confidences with many ties (bf16 softmax values tie often) and -inf: with one k for all rows (always the
    case inside generate) the chosen sets are exactly those of the official per-row torch.topk calls. On the CPU
    topk does not prefer the lowest index among ties, so a stable-sort ranking would fail this test."""
    g = torch.Generator().manual_seed(0)
    n_differs_from_stable_sort = 0
    for trial in range(300):
        B, L = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 200, (1,), generator=g))
        conf = torch.randint(0, 4, (B, L), generator=g).to(dtype)
        conf[torch.rand(B, L, generator=g) < 0.4] = float("-inf")
        conf[:, 0] = 1  # at least one finite value per row
        k_max = int((conf > float("-inf")).sum(1).min())
        k = torch.full((B,), int(torch.randint(0, k_max + 1, (1,), generator=g)))
        chosen = transfer_index(conf, k)
        for j in range(B):
            official = torch.zeros(L, dtype=torch.bool)
            official[torch.topk(conf[j], k=k[j]).indices] = True
            assert torch.equal(chosen[j], official)
            stable = torch.zeros(L, dtype=torch.bool)
            stable[torch.sort(conf[j], descending=True, stable=True).indices[:k[j]]] = True
            n_differs_from_stable_sort += not torch.equal(stable, official)
    assert n_differs_from_stable_sort > 0  # the ties above do matter

    # different k per row: each row still gets k[b] positions holding its k[b] largest values
    conf = torch.randint(0, 5, (4, 30), generator=g).to(dtype)
    k = torch.tensor([0, 3, 7, 30])
    chosen = transfer_index(conf, k)
    for j in range(4):
        assert int(chosen[j].sum()) == k[j]
        assert torch.equal(conf[j][chosen[j]].sort(descending=True).values, conf[j].topk(int(k[j])).values)


# -----------------------------------------------------------------------------
# Semantics of the sampler


@pytest.mark.parametrize("kw", [dict(steps=16, gen_length=16, block_length=4),
                                dict(steps=5, gen_length=20, block_length=20),
                                dict(steps=6, gen_length=16, block_length=8, temperature=1.0, remasking="random"),
                                dict(steps=8, gen_length=16, block_length=8, cfg_scale=1.0)])
def test_prompt_kept_and_no_mask_left(kw):
    model = no_mask_model(seed=3)
    prompt, attention_mask = left_pad([random_prompts(1, n, seed=n)[0] for n in (4, 7)])
    out = generate(model, prompt, attention_mask, **kw, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, prompt.shape[1] + kw["gen_length"]) and out.dtype == torch.long
    assert torch.equal(out[:, :prompt.shape[1]], prompt)
    assert not (out == MASK).any()


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_batch_rows_independent(cfg_scale):
    """At temperature 0, a batch gives each row what the row gives alone (float64: another batch shape sums in
    another order, which must not flip a near-tie on any CPU)."""
    model, prompt = tiny_model(seed=4).double(), random_prompts(4, 6, seed=5)
    kw = dict(steps=12, gen_length=24, block_length=8, cfg_scale=cfg_scale)
    batch = generate(model, prompt, **kw)
    for b in range(4):
        assert torch.equal(batch[b:b + 1], generate(model, prompt[b:b + 1], **kw))


def test_cfg_with_and_without_attention_mask():
    """CFG runs without an attention mask (the official code crashes there), an all-ones mask changes nothing,
    and guidance does change the answer."""
    model, prompt = tiny_model(seed=5), random_prompts(3, 6, seed=6)
    kw = dict(steps=8, gen_length=16, block_length=8, cfg_scale=2.0)
    without = generate(model, prompt, None, **kw)
    with_ones = generate(model, prompt, torch.ones_like(prompt), **kw)
    assert torch.equal(without, with_ones)
    assert torch.equal(without, official_generate(model, prompt, None, **kw, mask_id=MASK))
    assert not torch.equal(without, generate(model, prompt, None, **{**kw, "cfg_scale": 0.0}))


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_left_padded_prompts_equal_unpadded(cfg_scale):
    """Left pads hidden by the attention mask change nothing: each row of a padded batch generates what its
    unpadded prompt generates alone (RoPE is relative, so the shifted positions only change rounding: float64, so
    that rounding cannot flip a near-tie on any CPU)."""
    model = tiny_model(seed=6).double()
    prompts = [random_prompts(1, n, seed=10 + n)[0] for n in (2, 7, 4)]
    ids, attention_mask = left_pad(prompts)
    kw = dict(steps=12, gen_length=24, block_length=8, cfg_scale=cfg_scale)
    padded = generate(model, ids, attention_mask, **kw)
    for b, p in enumerate(prompts):
        alone = generate(model, p[None], **kw)
        assert torch.equal(padded[b, ids.shape[1]:], alone[0, len(p):])


def test_errors_name_the_problem():
    model, prompt = tiny_model(), random_prompts(1, 4, seed=0)
    with pytest.raises(ValueError, match="block_length"):
        generate(model, prompt, gen_length=20, block_length=8, steps=4)
    with pytest.raises(ValueError, match="number of blocks"):
        generate(model, prompt, gen_length=16, block_length=4, steps=6)
    with pytest.raises(ValueError, match="remasking"):
        generate(model, prompt, gen_length=8, block_length=8, steps=8, remasking="topk")
    with pytest.raises(ValueError, match="prompt"):
        generate(model, prompt[0], gen_length=8, block_length=8, steps=8)


def test_ddp_style_wrapper_and_mask_id_default():
    """mask_id comes from model.config, and config / head are found under .module (DDP) while the forward goes
    through the wrapper."""
    inner = tiny_model(seed=7)

    class Wrapper(nn.Module):  # what DDP looks like to the sampler
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, *args, **kw):
            self.calls += 1
            return self.module(*args, **kw)

    wrapped, prompt = Wrapper(inner), random_prompts(2, 5, seed=8)
    kw = dict(steps=4, gen_length=8, block_length=8)
    out = generate(wrapped, prompt, **kw)
    assert wrapped.calls == 4
    assert torch.equal(out, generate(inner, prompt, **kw, mask_id=MASK))


# -----------------------------------------------------------------------------
# A scripted "model": its logits at call t are tables[t], whatever the input


class RowCounter(nn.Module):
    """Identity LM head (hidden states are the logits) that records how many rows it was given."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def forward(self, h):
        self.rows.append(h.reshape(-1, h.shape[-1]).shape[0])
        return h


class ScriptedModel(nn.Module):
    def __init__(self, tables, mask_id):
        super().__init__()
        self.tables, self.config = tables, SimpleNamespace(mask_token_id=mask_id)
        self.head, self.seen = RowCounter(), []

    def forward(self, input_ids, attention_mask=None, return_hidden=False):
        self.seen.append(input_ids.clone())  # the state the sampler is in at this call
        h = self.tables[len(self.seen) - 1].expand(input_ids.shape[0], -1, -1)  # (B, L, V)
        return h if return_hidden else self.head(h)


@pytest.mark.parametrize("cfg_scale", [0.0, 2.0])
def test_scripted_model_step_by_step(cfg_scale):
    """Prompt [0, 1], 6 answer tokens in 2 blocks of 3, 2 steps per block: 2 then 1 unmasked per block.
    Every table gives each position one candidate with a chosen probability (the rest spread evenly)."""
    Vs, M, P, L = 6, 5, 2, 8  # tokens 0..4, mask 5

    def table(spec):  # spec: {position: (candidate, probability)}; unlisted positions are uniform
        probs = torch.full((L, Vs), 1.0 / Vs)
        for pos, (tok, p) in spec.items():
            probs[pos] = (1 - p) / (Vs - 1)
            probs[pos, tok] = p
        return probs.log()

    tables = [
        # block 1 (positions 2-4), step 1, k = 2: position 3 (0.9) proposes the mask token itself, so it stays
        # masked; position 4 (0.7) takes 2; the next block's 0.99 confidences are ignored (-inf after the block)
        table({2: (1, 0.5), 3: (M, 0.9), 4: (2, 0.7), 5: (1, 0.99), 6: (1, 0.99), 7: (1, 0.99)}),
        # block 1, step 2, k = 1: only masked positions compete, so the unmasked position 4 (0.99) is ignored
        table({2: (3, 0.6), 3: (4, 0.4), 4: (0, 0.99)}),
        # block 2 (positions 5-7), step 1, k = 2: the left-over mask at 3 (0.95) competes and wins, with 6 (0.8)
        table({3: (0, 0.95), 5: (1, 0.3), 6: (2, 0.8), 7: (3, 0.5)}),
        # block 2, step 2, k = 1: 7 (0.65) beats 5 (0.45); 5 stays masked, the block's budget went to position 3
        table({5: (4, 0.45), 7: (1, 0.65)}),
    ]
    states = [[0, 1, M, M, M, M, M, M],  # what the model sees at each call, then the result
              [0, 1, M, M, 2, M, M, M],
              [0, 1, 3, M, 2, M, M, M],
              [0, 1, 3, 0, 2, M, 2, M],
              [0, 1, 3, 0, 2, M, 2, 1]]
    prompt = torch.tensor([[0, 1], [0, 1]])
    kw = dict(steps=4, gen_length=6, block_length=3, cfg_scale=cfg_scale)
    model = ScriptedModel(tables, M)
    out = generate(model, prompt, **kw)
    assert [s[0].tolist() for s in model.seen] == states[:4]
    if cfg_scale > 0:  # each call sees the batch stacked with its unconditional copy: the prompt masked
        for s in model.seen:
            assert s.shape[0] == 4 and (s[2:, :P] == M).all() and torch.equal(s[2:, P:], s[:2, P:])
    assert out.tolist() == [states[4], states[4]]
    # the head saw only the masked positions up to the block's end: 3, 2, 4, 2 per row, for 2 rows (x2 with CFG)
    assert model.head.rows == [n * 2 * (2 if cfg_scale > 0 else 1) for n in (3, 2, 4, 2)]
    # and the official sampler agrees
    assert torch.equal(out, official_generate(ScriptedModel(tables, M), prompt, **kw, mask_id=M))


# -----------------------------------------------------------------------------
# Command line


def test_main_chat_and_raw(tmp_path, capsys):
    """python sample.py --model DIR --adapter DIR --prompt ... on a tiny checkpoint with the embedded char tokenizer."""
    embedded = pytest.importorskip("embedded")
    from adapters import save_adapter
    from model import add_lora
    tok = embedded.make_char_tokenizer()
    model_dir, adapter_dir = tmp_path / "model", tmp_path / "adapter"
    n = tok.get_vocab_size()
    cfg = LLaDAConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=64, vocab_size=n,
                      embedding_size=n, mask_token_id=tok.token_to_id("<|mdm_mask|>"),
                      eos_token_id=tok.token_to_id("<|endoftext|>"), pad_token_id=tok.token_to_id("<|endoftext|>"))
    model = LLaDA(cfg).init_weights(torch.Generator().manual_seed(0))
    model.save_pretrained(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(1))
    save_adapter(model, adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4

    import sample
    common = ["--model", str(model_dir), "--gen-length", "8", "--steps", "4", "--block-length", "4", "--device", "cpu"]
    sample.main(common + ["--adapter", str(adapter_dir), "--prompt", "Solve 1234"])
    sample.main(common + ["--raw", "--prompt", "1234", "--temperature", "1.0", "--cfg-scale", "0.5"])
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) >= 2  # one reply per call (a reply may itself hold newlines)
