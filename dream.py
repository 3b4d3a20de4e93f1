"""Dream-v0's own parts beside the shared transformer (model.py runs Dream as a config of LLaDA): the files of its
tokenizer, and its own sampler.

- qwen2_tokenizer(): Dream-v0's folders carry no tokenizer.json but the slow Qwen2 tokenizer's vocab.json, merges.txt
  and tokenizer_config.json; this builds from them the fast tokenizer that transformers builds (data.load_tokenizer
  calls it for such a folder), token for token.
- diffusion_generate(): Dream's official sampler (github.com/HKUNLP/Dream, generation_utils.py), the same arguments,
  random draws and tokens. The paper evaluates Dream with LLaDA's block sampler (sample.py generate(), Appendix C);
  this one is `python sample.py --sampler dream` (docs/samplers.md).
"""

import io
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from model import (check_prompt, check_value, open_regular, padded_positions, read_json, read_json_file, shift_right,
                   unwrap)

# -----------------------------------------------------------------------------
# The tokenizer: the slow Qwen2 tokenizer's files, read as transformers' Qwen2Converter builds the fast one

# Qwen2's pre-tokenization (transformers' tokenization_qwen2.py, PRETOKENIZE_REGEX): contractions, a word with at
# most one non-letter before it, each digit alone, runs of punctuation, newlines with the spaces before them, spaces
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# tokenizer_config.json's special-token fields, in transformers' order, and the slow Qwen2Tokenizer's defaults
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
QWEN2_SPECIAL_DEFAULTS = dict(unk_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _bpe_merges(path, vocab):
    """merges.txt read as the slow tokenizer reads it (a "#version:" first line and blank lines skipped, then one
    "a b" merge a line, in rank order), each merge checked against vocab.json."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a Qwen2 tokenizer's vocab.json needs its merges.txt (copy it "
                                "from the model's Hugging Face folder)")
    merges = []
    with io.TextIOWrapper(open_regular(path), encoding="utf-8") as f:  # a FIFO is refused, never read
        for n, line in enumerate(f, 1):
            line = line.strip()
            if (n == 1 and line.startswith("#version:")) or not line:
                continue
            pair = tuple(line.split())
            if len(pair) != 2 or not all(t in vocab for t in (*pair, "".join(pair))):
                raise ValueError(f"{path}, line {n}: {line!r} is not a merge of two tokens of vocab.json into a third; "
                                 "merges.txt and vocab.json must come from the same tokenizer")
            merges.append(pair)
    return merges


def _added_token(token, path, special=None):
    """An AddedToken from a config's string or its object of AddedToken fields; `special` overrides the flag."""
    fields = dict(content=token) if isinstance(token, str) else token
    if not isinstance(fields, dict) or not isinstance(fields.get("content"), str):
        raise ValueError(f"{path}: {token!r} is not a token (a string, or an object with a 'content' string)")
    flags = {k: fields[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in fields}
    if special is not None:
        flags["special"] = special
    return AddedToken(fields["content"], **flags)


def qwen2_tokenizer(folder):
    """The fast tokenizer that transformers builds from a slow Qwen2 tokenizer's files (Qwen2Converter in
    convert_slow_tokenizer.py, then PreTrainedTokenizerFast's added tokens): a byte-level BPE with no unknown token
    (its 256 byte characters spell any text). The added tokens, matched in text before the BPE: tokenizer_config.json's
    added_tokens_decoder (or else the older added_tokens.json) in id order, each special also when a special-token
    field names it, then the named special tokens not among them."""
    folder = Path(folder)
    vocab = read_json_file(folder / "vocab.json")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(f"{folder / 'vocab.json'}: not a BPE vocabulary (an object of token: id)")
    tokenizer = Tokenizer(models.BPE(vocab, _bpe_merges(folder / "merges.txt", vocab), dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # the special tokens that the config's fields name, Qwen2's defaults for the fields it leaves out
    config_path = folder / "tokenizer_config.json"
    config = read_json_file(config_path) if config_path.exists() else {}  # a FIFO is refused, not taken for none
    named = [config.get(k, QWEN2_SPECIAL_DEFAULTS.get(k)) for k in SPECIAL_TOKEN_FIELDS]
    named = [_added_token(t, config_path, special=True)
             for t in named + list(config.get("additional_special_tokens") or []) if t is not None]
    names = {t.content for t in named}
    if "added_tokens_decoder" in config:
        source = config_path
        added = {int(i): _added_token(t, source) for i, t in config["added_tokens_decoder"].items()}
    else:  # older folders: added_tokens.json, {content: id}, special when a field names it
        source = folder / "added_tokens.json"
        listed = read_json_file(source) if source.exists() else {}
        added = {i: AddedToken(t, special=t in names, normalized=t not in names) for t, i in listed.items()}
    for token in added.values():
        token.special = token.special or token.content in names
    contents = {t.content for t in added.values()}
    missing = list({t.content: t for t in named if t.content not in contents}.values())
    tokenizer.add_tokens([added[i] for i in sorted(added)] + missing)
    for i, token in sorted(added.items()):
        got = tokenizer.token_to_id(token.content)  # add_tokens numbers new tokens on from the vocabulary's
        if got != i:
            raise ValueError(f"{source}: added token {token.content!r} has id {i}, but after the {len(vocab)} tokens "
                             f"of vocab.json it gets id {got}: the added tokens' ids must follow the vocabulary's")
    return tokenizer


def named_token(folder, field, default=None):
    """The token that a model folder's tokenizer_config.json names in `field` (a special-token field: "bos_token" is
    Dream-v0's <|beginoftext|>, LLaDA-8B's <|startoftext|>), as transformers reads it; without the file or the field
    (or null, Qwen2's BOS), `default`."""
    path = Path(folder) / "tokenizer_config.json"
    token = read_json(path).get(field) if path.exists() else None  # a FIFO is refused (open_regular)
    return default if token is None else _added_token(token, path).content


# -----------------------------------------------------------------------------
# The sampler (Dream-v0, github.com/HKUNLP/Dream, generation_utils.py): the official diffusion_generate

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")  # which masks each step unmasks
# diffusion_generate's arguments, each rule once (model.check_value); SamplerOptions' Dream fields read the same
DREAM_RULES = dict(
    max_new_tokens=dict(kind=int, range="[1, inf)", what="must be at least 1"),
    steps=dict(kind=int, range="[1, inf)", what="must be at least 1"),
    temperature=dict(kind=float, range="[0, inf)", what="must be 0 (greedy) or more, a finite number"),
    eps=dict(kind=float, range="(0, 1)", what="the reverse process's last time, in (0, 1) (Dream's default 1e-3)"),
    alg=dict(kind=str, choices=DREAM_ALGS),
    alg_temp=dict(kind=float, range="[0, inf)", what="must be 0 (off) or more, a finite number"),
    top_p=dict(kind=float, range="(0, 1]", what="a probability in (0, 1]"),
    top_k=dict(kind=int, range="[1, inf)", what="must be at least 1"),
)



def top_p_logits(logits, top_p):
    """Nucleus filter: keep the most probable tokens up to and including the first whose cumulative probability
    passes top_p (the top one always kept); the others get the dtype's smallest finite value. (N, V) -> (N, V)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p  # (N, V), in sorted order
    drop = torch.cat([torch.zeros_like(drop[:, :1]), drop[:, :-1]], dim=-1)  # shifted right: keep the crossing one
    drop = torch.zeros_like(drop).scatter_(-1, sorted_idx, drop)  # back to vocabulary order
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def top_k_logits(logits, top_k):
    """Keep the logits not below the k-th largest (ties at it kept); the others get the dtype's smallest value."""
    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (N, 1)
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, generator=None):
    """The official sample_tokens' draw: logits (N, V) -> probs (N, V) after temperature, top_p and top_k, and x0 (N,).

    The filters apply even at temperature 0 (they then change no argmax, but change probs, hence the topk_margin and
    entropy confidences). temperature > 0 draws x0 as the official Categorical(probs).sample() does: one
    torch.multinomial over probs renormalised to sum to 1, so the same generator state gives the same tokens. The
    mask id is a token like any other here: a drawn mask leaves its position masked. In the logits' dtype, as
    official (bf16 for the real model). Where Categorical rejects probs (NaN; rarely, in bf16, a sum off 1 by more
    than 1e-6) the official code silently takes the argmax instead; ours samples (multinomial raises on NaN).
    """
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = F.softmax(logits, dim=-1)  # (N, V)
    if temperature > 0:
        renormed = probs / probs.sum(-1, keepdim=True)  # what Categorical stores and samples from
        return probs, torch.multinomial(renormed, 1, replacement=True, generator=generator).squeeze(-1)
    return probs, probs.max(dim=-1).indices


def dream_confidence(probs, x0, alg):
    """How sure the model is of each candidate x0, the score the unmasking order ranks: maskgit_plus its
    probability, topk_margin top1 - top2 probability, entropy the negative entropy sum p log(p + 1e-10).
    probs (N, V), x0 (N,) -> (N,)."""
    if alg == "topk_margin":
        top2 = torch.topk(probs, 2, dim=-1).values  # (N, 2)
        return top2[:, 0] - top2[:, 1]
    if alg == "entropy":
        return torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return torch.gather(probs, -1, x0[:, None]).squeeze(-1)


def dream_num_transfer(mask_index, t, s, last):
    """How many tokens every row unmasks at the step from time t to s < t: the expected share s/t of the masks stays
    masked. Official rule, kept for its exact numbers: the batch-AVERAGE mask count m (float32), the same k for every
    row, int(m (1 - s/t)) truncated, and int(m) at the last step. With steps = masks the first step unmasks none
    (8 (1 - 0.875125) = 0.999 -> 0) and the last two. mask_index (B, L) bool; t, s float32 scalars -> int."""
    m = mask_index.sum() / mask_index.shape[0]  # float32 tensor
    return int(m) if last else int(m * (1 - s / t))


def maskgit_step(x, mask_index, confidence, x0, k, alg_temp, generator, mask_id):
    """One step of Dream's MaskGIT-style algorithms, x (B, L) changed in place: each row's k most confident masks
    take their candidates x0 (N,), or with alg_temp > 0 k masks drawn from softmax(confidence / alg_temp) without
    replacement. confidence (N,): each mask's score (dream_confidence), row-major as mask_index (B, L) lists them."""
    if k == 0:
        return  # the official loop skips the draw too
    scores = torch.full(x.shape, float("-inf"), dtype=confidence.dtype, device=x.device)
    scores[mask_index] = confidence  # (B, L), -inf off the masks
    if not alg_temp:  # None or 0: the k most confident
        idx = torch.topk(scores, k).indices  # (B, k)
    else:
        idx = torch.multinomial(F.softmax(scores / alg_temp, dim=-1), k, generator=generator)  # (B, k)
    # a row with fewer than k masks also takes k positions, official behaviour kept: its extra ones are -inf
    # positions off the masks, and they are set to the mask id (only when rows have unequal mask counts)
    proposed = torch.full_like(x, mask_id).masked_scatter(mask_index, x0)  # (B, L)
    x.scatter_(1, idx, proposed.gather(1, idx))


@torch.no_grad()
def diffusion_generate(model, prompt, attention_mask=None, max_new_tokens=512, steps=512, eps=1e-3, alg="origin",
                       alg_temp=None, temperature=0.0, top_p=None, top_k=None, generator=None):
    """Dream's official diffusion_generate (generation_utils.py `_sample`): the same arguments, draws and tokens.
    Returns x (B, P + max_new_tokens), prompt included.

    The answer starts as max_new_tokens masks; step i goes from time t = linspace(1, eps, steps + 1)[i] to the next
    time s, predicting every masked token (Dream predicts token j from position j - 1: the model's logits are shifted
    right by one, position 0 keeping its own). alg "origin" unmasks each mask independently with probability
    1 - s/t (all that remain at the last step); the others (MaskGIT-style) unmask the same number k of masks in every
    row (dream_num_transfer), the k most confident (maskgit_plus: probability, topk_margin: top1 - top2 margin,
    entropy: negative entropy), or, with alg_temp > 0, k drawn from softmax(confidence / alg_temp).

    model: Dream (model.predicts_shifted), in eval mode, called as model(x, attention_mask, position_ids=...,
        return_hidden=True); its LM head runs only at the masked positions (docs/samplers.md: the same numbers).
    prompt: (B, P) ids; left-pad a batch and give attention_mask (B, P), 0 on the pads. As officially, a mask with
        any 0 makes pads invisible (queries and keys) and positions cumsum(mask) - 1 (pads 1); otherwise (None or
        all ones) attention is full and positions are 0 .. L - 1.
    temperature: 0 = greedy; top_p (< 1) and top_k filter the logits first, at every temperature.
    generator: a torch.Generator on the prompt's device for every draw (None: torch's global RNG, as officially).
        The draws have the official kinds, shapes and order (origin: torch.rand over the batch's masks, then the
        multinomial of the tokens; the others: the multinomial of the tokens, then that of the positions), so
        torch.Generator().manual_seed(S) gives the official tokens of a run made after torch.manual_seed(S).
        Or a list of B generators, one per row: each row then steps as it would alone, unpadded (its own draws over
        its own positions, its own mask count in the tokens-per-step rule), so its tokens do not depend on the rows
        beside it; a list of one is the official run of an unpadded row.

    The official method called without a generation_config inherits temperature 1.0 and top_k 50 from
    Hugging Face's defaults; ours takes what it is given, greedy by default (docs/samplers.md).
    """
    module = unwrap(model)  # under DDP the config and head are the wrapped module's
    where = "dream.py diffusion_generate"
    if not module.predicts_shifted:
        raise ValueError(f"{where}: the model is not Dream (config model_type {module.config.model_type!r}), whose "
                         f"logits at i - 1 predict token i; LLaDA's sampler is generate()")
    given = dict(max_new_tokens=max_new_tokens, steps=steps, temperature=temperature, eps=eps, alg=alg,
                 alg_temp=alg_temp, top_p=top_p, top_k=top_k)
    for key, rule in DREAM_RULES.items():
        check_value(f"{where}: {key}={given[key]!r}", given[key], **rule)
    per_row = isinstance(generator, (list, tuple))
    if not (generator is None or isinstance(generator, torch.Generator)
            or per_row and all(isinstance(g, torch.Generator) for g in generator)):
        raise ValueError(f"{where}: generator must be one torch.Generator, a list of one per row, or None; got "
                         f"{type(generator).__name__}")
    check_prompt(prompt, attention_mask, generator, where, model, max_new_tokens, "max_new_tokens")
    mask_id, head = module.config.mask_token_id, module.head
    x = F.pad(prompt, (0, max_new_tokens), value=mask_id)  # (B, L), L = P + max_new_tokens
    if attention_mask is not None:
        attention_mask = F.pad(attention_mask, (0, max_new_tokens), value=1)  # (B, L): the answer is attended to
    position_ids = padded_positions(attention_mask)  # (B, L), or None without a pad
    attention_mask = None if position_ids is None else attention_mask  # no pad: the official "full" attention
    timesteps = torch.linspace(1, eps, steps + 1, device=x.device)  # float32, as officially
    pads = [0] * len(x) if attention_mask is None else (attention_mask.cumsum(1) == 0).sum(1).tolist()  # left pads

    for i in range(steps):
        t, s, last = timesteps[i], timesteps[i + 1], i == steps - 1
        mask_index = x == mask_id  # (B, L)
        h = model(x, attention_mask=attention_mask, position_ids=position_ids, return_hidden=True)  # (B, L, D)
        h = shift_right(h)[mask_index]  # (N, D): the state predicting each mask, row-major
        step = dict(t=t, s=s, last=last, head=head, alg=alg, alg_temp=alg_temp, temperature=temperature, top_p=top_p,
                    top_k=top_k, mask_id=mask_id)
        if not per_row:
            dream_step(x, mask_index, h, generator=generator, **step)
            continue
        for b, h_b in enumerate(h.split(mask_index.sum(1).tolist())):  # row b's masks: its rows of h
            p = pads[b]  # x[b:b + 1, p:] is a view: the step writes into x
            dream_step(x[b:b + 1, p:], mask_index[b:b + 1, p:], h_b, generator=generator[b], **step)
    return x


def dream_step(x, mask_index, h, t, s, last, head, alg, alg_temp, temperature, top_p, top_k, generator, mask_id):
    """One step of diffusion_generate from time t to s, x (B, L) changed in place: h (N, D) the states predicting the
    N masks of mask_index (B, L), row-major; every draw from `generator` (one torch.Generator or None)."""
    if alg == "origin":
        # every mask independently with probability 1 - s/t: one uniform per mask of the batch
        u = torch.rand(h.shape[:1], device=x.device if generator is None else generator.device, generator=generator)
        transfer = u.to(x.device) < (1 if last else 1 - s / t)  # (N,) bool
        x0 = torch.full_like(x[mask_index], mask_id)  # (N,): the others stay masked
        x0[transfer] = sample_tokens(head(h[transfer]), temperature, top_p, top_k, generator)[1]
        x[mask_index] = x0
        return
    probs, x0 = sample_tokens(head(h), temperature, top_p, top_k, generator)  # (N, V), (N,)
    maskgit_step(x, mask_index, dream_confidence(probs, x0, alg), x0, dream_num_transfer(mask_index, t, s, last),
                 alg_temp, generator, mask_id)
