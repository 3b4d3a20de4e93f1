"""Dream-v0 in the block sampler and the command lines: our block low-confidence sampler (generate, and the fast
generate_cached) reads token i's prediction at position i - 1 (checked against LLaDA's official sampler run on
logits shifted by hand), the cached spans start one position earlier, a left-padded prompt gives the unpadded tokens;
sample.py and eval.py take a tiny Dream folder with no extra flag (ChatML prompts, the turn ends at <|im_end|>),
Dream's own sampler with --sampler dream, and a LoRA adapter in Dream's names."""

import json

import pytest
import torch
from official_sampler import official_generate  # LLaDA's official generate.py, beside this file
from test_sample import SETTINGS

import cached_sample
import data
import embedded
import eval as E
import sample
from adapters import load_adapter, save_adapter
from cached_sample import KVCache, generate_cached
from dream import diffusion_generate
from model import LLaDA, add_lora, merge_lora, padded_positions
from sample import SamplerOptions, append_masks, generate

SUDOKU_CSV = ("Puzzle,Solution\n3102200002100320,3142243142131324\n0142243142131320,3142243142131324\n"
              "3142000042131324,3142243142131324\n")


class NoMaskHead(torch.nn.Module):
    """The LM head with the mask token's logit at -1e9: a model that, like a trained one, never proposes the mask
    token (the cached sampler leaves an earlier block's masks alone, the exact one retries them)."""

    def __init__(self, head, mask_id):
        super().__init__()
        self.head, self.mask_id = head, mask_id

    def forward(self, h):
        logits = self.head(h)
        logits[..., self.mask_id] = -1e9
        return logits


def tiny_dream(seed=0, dtype=torch.float64, no_mask=False):
    """A random tiny Dream (ChatML char tokenizer, grouped-query heads, q/k/v biases drawn too) and its tokenizer;
    float64 by default, so that no rounding flips a choice between two runs that should agree. no_mask: its head
    never proposes the mask token (NoMaskHead)."""
    tokenizer = embedded.make_char_tokenizer(family="dream")
    config = embedded.tiny_config_for(tokenizer, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                                      max_sequence_length=512)
    g = torch.Generator().manual_seed(seed)
    model = LLaDA(config).init_weights(g, std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2, generator=g)
    assert model.predicts_shifted
    if no_mask:
        tr = model.model.transformer
        tr.ff_out = NoMaskHead(tr.ff_out, config.mask_token_id)
    return model.to(dtype).eval(), tokenizer


def dream_folder(path, seed=0, defaults=None):
    """tiny_dream saved as a Hugging Face folder (float32) with its tokenizer.json and, if given,
    generation_defaults.json."""
    model, tokenizer = tiny_dream(seed, torch.float32)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    if defaults is not None:
        (path / "generation_defaults.json").write_text(json.dumps(defaults))
    return model, tokenizer


def random_text_ids(n, seed, n_chars=len(embedded.DREAM_CHAR_VOCAB)):
    return torch.randint(0, n_chars, (n,), generator=torch.Generator().manual_seed(seed))  # characters only


def padded_batch(lengths=(5, 9, 7), seed=0):
    """Prompts of these lengths, left-padded with Dream's pad: (ids (B, P), attention_mask (B, P), the prompts)."""
    prompts = [random_text_ids(n, seed + n) for n in lengths]
    pad_id = embedded.make_char_tokenizer(family="dream").token_to_id(data.EOS)
    ids, mask = sample.left_padded([p.tolist() for p in prompts], pad_id)
    return ids, mask, prompts


class ShiftedByHand(torch.nn.Module):
    """The reference: the official model's logits (unshifted), moved one right by hand as Dream's generation code
    does (`logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)`), at Dream's official positions for a padded
    batch (tok_idx = cumsum(mask) - 1, pads 1). shift=False drops the shift: what the sampler must not do."""

    def __init__(self, model, shift=True):
        super().__init__()
        self.model, self.shift = model, shift

    def forward(self, x, attention_mask=None):
        positions = None
        if attention_mask is not None and (attention_mask == 0).any():
            positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        logits = self.model(x, attention_mask=attention_mask, position_ids=positions)  # (B, L, V)
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1) if self.shift else logits


# -----------------------------------------------------------------------------
# The block sampler on Dream: the shift, the cached spans, left padding


@pytest.mark.numerics
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_generate_equals_the_official_sampler_on_logits_shifted_by_hand(name, padded, one_thread):
    """Our generate on Dream = LLaDA's official generate on Dream's logits shifted by hand, on every setting checked
    for LLaDA (CFG, temperature, random remasking), with the same random draws. And the unshifted logits give other
    tokens: the test fails if the shift is dropped."""
    model, _ = tiny_dream()
    ids, mask, _ = padded_batch() if padded else (torch.stack([random_text_ids(6, s) for s in (1, 2)]), None, None)
    mask_id, kw = model.config.mask_token_id, SETTINGS[name]

    def run(sampler, model):
        return sampler(model, ids, mask, mask_id=mask_id, generator=torch.Generator().manual_seed(5), **kw)

    ours = run(generate, model)
    assert torch.equal(ours, run(official_generate, ShiftedByHand(model)))
    assert not torch.equal(ours, run(official_generate, ShiftedByHand(model, shift=False)))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("kw", [dict(steps=16, block_length=4), dict(steps=8, block_length=8),
                                dict(steps=8, block_length=4, cfg_scale=1.5),
                                dict(steps=8, block_length=4, temperature=0.7)], ids=["b4", "b8", "cfg", "temp"])
@pytest.mark.numerics
def test_a_cache_refreshed_every_step_gives_the_exact_tokens(cache, kw, one_thread):
    """A cache rebuilt at every step holds exact keys and values, so each span forward (one position earlier than
    the block for Dream: the state predicting the block's first token) gives the exact sampler's states: the tokens
    of generate, left-padded batch, dual and prefix caches."""
    model, _ = tiny_dream(no_mask=True)
    ids, mask, _ = padded_batch()
    exact = generate(model, ids, mask, gen_length=16, generator=torch.Generator().manual_seed(3), **kw)
    options = SamplerOptions(gen_length=16, cache=cache, cache_refresh=1, **kw)
    cached = generate_cached(model, ids, mask, options, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cached, exact)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_span_runs_from_the_position_before_the_block(cache, one_thread):
    """What each step runs on Dream: the whole sequence at a block's first step, then (prefix) the block and what
    follows it, or (dual) the block, each from one position earlier (P = 9, L = 17, blocks of 4)."""
    model, _ = tiny_dream(no_mask=True)
    ids, mask, _ = padded_batch()
    lengths = []
    hook = model.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    generate_cached(model, ids, mask, SamplerOptions(steps=8, gen_length=8, block_length=4, cache=cache))
    hook.remove()
    P, L = 9, 17
    span = {"prefix": [L - P + 1, L - P - 4 + 1], "dual": [5, 5]}[cache]
    assert lengths == [L, span[0], span[0], span[0], L, span[1], span[1], span[1]]


@pytest.mark.numerics
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_drift_test_sees_the_blocks_queries(cache, one_thread):
    """With a fresh cache, the attention rows the drift test gets from a span forward (which starts one position
    before the block) are those of the block's own queries in a full forward of the same tokens."""
    model, _ = tiny_dream(no_mask=True)
    ids, mask, _ = padded_batch()
    x, mask = append_masks(ids, mask, 8, model.config.mask_token_id)  # P = 9, L = 17, blocks of 4
    x[:, 9:12] = ids[:, -3:]  # some of the first block filled in
    layers = []
    KVCache(layers).states(model, x, mask)  # the whole sequence: the cache built
    for s in (9, 13):
        rows, full = [], []
        KVCache(layers, (s, s + 4) if cache == "dual" else (s, x.shape[1]), (s, s + 4, rows)).states(model, x, mask)
        KVCache(probe=(s, s + 4, full)).states(model, x, mask)
        assert len(rows) == len(full) == len(model.model.transformer.blocks)
        for got, want in zip(rows, full):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.numerics
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_row_the_drift_test_flags_is_rebuilt_and_sees_the_exact_tokens(monkeypatch, cache, one_thread):
    """Dream's rebuilt row (a full forward of that row alone, with its own positions) is exact: with the drift test
    made to flag row 0 at every step, row 0 gets generate's tokens and rows 1, 2 the plain cached sampler's."""
    model, _ = tiny_dream(no_mask=True)
    ids, mask, _ = padded_batch()
    real, calls = cached_sample.attention_drift, []
    kw = dict(gen_length=16, steps=8, block_length=4)

    def row_zero(*args):
        calls.append(1)
        return (torch.tensor([True, False, False]),) + real(*args)[1:]
    plain = generate_cached(model, ids, mask, SamplerOptions(cache=cache, **kw))
    monkeypatch.setattr(cached_sample, "attention_drift", row_zero)
    flagged = generate_cached(model, ids, mask, SamplerOptions(cache=cache, cache_drift=0.9, **kw))
    assert calls  # the hook ran
    assert torch.equal(flagged[0], generate(model, ids, mask, **kw)[0]) and torch.equal(flagged[1:], plain[1:])


@pytest.mark.parametrize("options", [dict(), dict(cfg_scale=1.5), dict(cache="dual"), dict(cache="prefix",
                                     threshold=0.3)], ids=["exact", "cfg", "dual", "prefix_threshold"])
@pytest.mark.numerics
def test_left_padded_prompts_give_the_unpadded_tokens(options, one_thread):
    """A left-padded Dream batch gives each prompt's tokens alone (float64): the pads are invisible and the
    sampler passes Dream's official positions, cumsum(mask) - 1, so the real tokens sit where they sit unpadded."""
    model, _ = tiny_dream(no_mask=True)
    ids, mask, prompts = padded_batch()
    o = SamplerOptions(gen_length=16, steps=8, block_length=8, **options)
    positions = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: positions.append(kw.get("position_ids")), with_kwargs=True)
    batch = cached_sample.generate_with_options(model, ids, mask, o)
    hook.remove()
    want = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (B, P): the prompt's
    assert all(torch.equal(p[:len(p) // (2 if o.cfg_scale else 1), :ids.shape[1]], want) for p in positions)
    for r, p in enumerate(prompts):
        alone = cached_sample.generate_with_options(model, p[None], None, o)
        assert torch.equal(batch[r, ids.shape[1]:], alone[0, len(p):]), r


# -----------------------------------------------------------------------------
# sample.py on a Dream folder


def chatml_ids(tokenizer, text):
    ids = data.encode(tokenizer, data.chat_prompt([{"role": "user", "content": text}], "chatml"))
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
        "<|im_start|>assistant\n")
    return torch.tensor([ids])


def test_the_answer_stops_at_the_turn_end():
    tokenizer = embedded.make_char_tokenizer(family="dream")
    ids = data.encode(tokenizer, "ab c<|im_end|>de<|endoftext|>")
    assert sample.decode_until_stop(tokenizer, ids) == "ab c"
    assert sample.decode_until_stop(tokenizer, data.encode(tokenizer, "xy<|endoftext|><|im_end|>")) == "xy"


def test_sample_py_on_a_dream_folder_with_no_extra_flag(tmp_path, capsys, one_thread):
    """The ChatML prompt, the block sampler with sample.py's lengths (128 tokens, blocks of 32, 128 steps), the reply
    cut at the turn end; and --sampler dream is Dream's own sampler, drawing from --seed."""
    model, tokenizer = dream_folder(tmp_path / "dream")
    prompt = chatml_ids(tokenizer, "solve 1234")
    common = ["--model", str(tmp_path / "dream"), "--prompt", "solve 1234", "--device", "cpu"]
    sample.main(common)
    out = generate(model, prompt, steps=128, gen_length=128, block_length=32)
    assert capsys.readouterr().out == sample.decode_until_stop(tokenizer, out[0, prompt.shape[1]:].tolist()) + "\n"
    sample.main(common + ["--sampler", "dream", "--gen-length", "16", "--steps", "8", "--seed", "3"])
    out = diffusion_generate(model, prompt, max_new_tokens=16, steps=8, generator=torch.Generator().manual_seed(3))
    assert capsys.readouterr().out == sample.decode_until_stop(tokenizer, out[0, prompt.shape[1]:].tolist()) + "\n"


def test_the_folder_can_name_dreams_sampler(tmp_path, capsys, one_thread):
    """generation_defaults.json naming Dream's sampler and its options is sample.py's default; a flag overrides it."""
    defaults = dict(sampler="dream", alg="entropy", top_p=0.9, gen_length=16, steps=8)
    model, tokenizer = dream_folder(tmp_path / "dream", defaults=defaults)
    prompt = chatml_ids(tokenizer, "hi")
    common = ["--model", str(tmp_path / "dream"), "--prompt", "hi", "--device", "cpu", "--temperature", "0.5"]
    sample.main(common)
    out = diffusion_generate(model, prompt, max_new_tokens=16, steps=8, alg="entropy", top_p=0.9, temperature=0.5,
                             generator=torch.Generator().manual_seed(0))
    assert capsys.readouterr().out == sample.decode_until_stop(tokenizer, out[0, prompt.shape[1]:].tolist()) + "\n"
    sample.main(common + ["--sampler", "block", "--block-length", "8"])
    out = generate(model, prompt, steps=8, gen_length=16, block_length=8, temperature=0.5,
                   generator=torch.Generator().manual_seed(0))
    assert capsys.readouterr().out == sample.decode_until_stop(tokenizer, out[0, prompt.shape[1]:].tolist()) + "\n"


def test_the_wrong_samplers_flags_are_refused_in_one_line(tmp_path, base, capsys):
    """--sampler dream on a LLaDA folder; a Dream option with the block sampler; a block option with Dream's; a bad
    value, given or named by the model folder. sample.py and eval.py say the same, in one line."""
    dream_folder(tmp_path / "dream")
    dream_folder(tmp_path / "odd", defaults=dict(sampler="fast"))
    llada, dream = ["--model", str(base / "model")], ["--model", str(tmp_path / "dream")]
    cases = [(llada + ["--sampler", "dream"], "--sampler dream: Dream's own sampler needs a Dream model"),
             (dream + ["--alg", "entropy", "--top-k", "5"], "--alg --top-k: not read by the block sampler"),
             (dream + ["--sampler", "dream", "--cache", "dual", "--block-length", "4"],
              "--block-length --cache: not read by the dream sampler"),
             (dream + ["--sampler", "dream", "--top-p", "0"], "--top-p 0.0: a probability in (0, 1]"),
             (["--model", str(tmp_path / "odd")], "generation_defaults.json: field 'sampler' = \"fast\"; expected one of")]
    for flags, message in cases:
        for main, argv in ((sample.main, ["--prompt", "hi"]), (E.main, ["--task", "sudoku", "--data", "x.csv"])):
            with pytest.raises(SystemExit):
                main(flags + argv)
            lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
            assert len(lines) == 1 and message in lines[0], lines


def test_a_lora_adapter_on_a_dream_base_loads_in_both_command_lines(tmp_path, capsys, one_thread):
    """An adapter saved in PEFT's layout on a Dream base (Dream's key names) is what sample.py and eval.py load."""
    folder, adapter = tmp_path / "dream", tmp_path / "adapter"
    model, tokenizer = dream_folder(folder, defaults=dict(task="sudoku", prompt_style="plain", gen_length=16,
                                                          block_length=8, steps=8, test_data="sudoku.csv"))
    (folder / "sudoku.csv").write_text(SUDOKU_CSV)
    add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    save_adapter(model, adapter, str(folder))
    from safetensors import safe_open
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:  # PEFT's keys in Dream's module names
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in set(f.keys())
    sample.main(["--model", str(folder), "--adapter", str(adapter), "--prompt", "hi", "--device", "cpu",
                 "--gen-length", "16", "--steps", "8"])
    prompt = chatml_ids(tokenizer, "hi")
    out = generate(model.eval(), prompt, steps=8, gen_length=16, block_length=8)  # the folder's block length
    assert capsys.readouterr().out == sample.decode_until_stop(tokenizer, out[0, prompt.shape[1]:].tolist()) + "\n"

    E.main(["--model", str(folder), "--adapter", str(adapter), "--task", "sudoku", "--out", str(tmp_path / "r.json")])
    merged = merge_lora(load_adapter(LLaDA.from_pretrained(folder), adapter))
    items = E.load_sudoku(folder / "sudoku.csv")
    _, want = E.evaluate(merged, tokenizer, items, "sudoku", SamplerOptions(gen_length=16, steps=8, block_length=8),
                         prompt_style="plain")
    got = json.loads((tmp_path / "r.json").read_text())["runs"][0]["records"]
    assert [r["generation"] for r in got] == [r["generation"] for r in want]


# -----------------------------------------------------------------------------
# eval.py on a Dream folder


def test_eval_py_on_a_dream_folder_with_no_extra_flag(tmp_path, monkeypatch, one_thread):
    """The folder's generation_defaults.json (plain prompts, 16 tokens in blocks of 8, its test file) as for the
    embedded task: the prompts are ChatML, the block sampler is the default, and the grades are evaluate()'s."""
    folder = tmp_path / "dream"
    model, tokenizer = dream_folder(folder, defaults=dict(task="sudoku", prompt_style="plain", gen_length=16,
                                                          block_length=8, steps=8, test_data="sudoku.csv"))
    (folder / "sudoku.csv").write_text(SUDOKU_CSV)
    prompts, real = [], E.generate_with_options
    monkeypatch.setattr(E, "generate_with_options", lambda m, p, *a: prompts.append(p) or real(m, p, *a))
    E.main(["--model", str(folder), "--task", "sudoku", "--out", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    items = E.load_sudoku(folder / "sudoku.csv")
    acc, want = E.evaluate(model, tokenizer, items, "sudoku", SamplerOptions(gen_length=16, steps=8, block_length=8),
                           prompt_style="plain")
    got = result["runs"][0]["records"]
    assert [r["generation"] for r in got] == [r["generation"] for r in want] and result["accuracy_mean"] == acc
    assert all(r["empty_cells"] == r["puzzle"].count("0") for r in got)
    text = tokenizer.decode(prompts[0][0].tolist(), skip_special_tokens=False)
    assert text.endswith(E.build_prompt("sudoku", items[0], "plain", fmt="chatml"))  # left pads, then the prompt
    assert text.endswith(f"puzzle: {items[0]['puzzle']}<|im_end|>\n<|im_start|>assistant\n")
    assert "sampler" not in result  # the block sampler: the settings of earlier files


def test_eval_py_with_dreams_sampler(tmp_path, one_thread):
    """--sampler dream: Dream's diffusion_generate on each batch, its draws (origin draws even when greedy) from the
    batch's first item's generator; the settings record the sampler and its options."""
    folder = tmp_path / "dream"
    model, tokenizer = dream_folder(folder, defaults=dict(task="sudoku", prompt_style="plain", gen_length=16,
                                                          steps=8, test_data="sudoku.csv"))
    (folder / "sudoku.csv").write_text(SUDOKU_CSV)
    E.main(["--model", str(folder), "--task", "sudoku", "--sampler", "dream", "--seeds", "4", "--batch-size", "2",
            "--out", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["sampler"], result["alg"], result["eps"]) == ("dream", "origin", 1e-3)
    items = E.load_sudoku(folder / "sudoku.csv")
    prompts = [data.encode(tokenizer, E.build_prompt("sudoku", it, "plain", fmt="chatml")) for it in items]
    want = []
    for start in (0, 2):
        ids, mask = sample.left_padded(prompts[start:start + 2], model.config.pad_token_id)
        out = diffusion_generate(model, ids, mask, max_new_tokens=16, steps=8,
                                 generator=E.item_generator(4, start, "cpu"))
        want += [tokenizer.decode(row.tolist(), skip_special_tokens=False) for row in out[:, ids.shape[1]:]]
    assert [r["generation"] for r in result["runs"][0]["records"]] == want


def test_dreams_turn_end_is_graded_as_lladas():
    """d1's graders know <|eot_id|>: a Dream generation, ending its turn with <|im_end|>, gets the grade the same text
    with LLaDA's turn end gets (here an empty answer tag, then the grid: d1's later rules find the 16 digits)."""
    puzzle, solution = "1200340000000000", "1243342121344312"
    item = dict(puzzle=puzzle, solution=solution)
    text = "<answer></answer>{end}" + solution
    dream, llada = (E.grade("sudoku", text.format(end=end), item) for end in ("<|im_end|>", "<|eot_id|>"))
    assert dream == llada and llada["correct_cells"] == llada["empty_cells"] == 12
