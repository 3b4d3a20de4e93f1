"""The cached sampler, after Fast-dLLM (Wu et al. 2025, arXiv 2505.22618): sample.py's block sampler made faster at
the cost of exactness, with a key/value cache (prefix or dual), confidence-threshold parallel decoding, a cache rebuilt
on a schedule, when attention drifts (Elastic-Cache, arXiv 2510.14973) or only near the block (a window). Opt-in:
the paper's numbers are the exact sampler's. Its options are SamplerOptions' cache fields (sample.py); what each does,
in more words, and what it costs: docs/samplers.md. The cache is one object, KVCache, that the model is handed
(model.LLaDA.forward's `cache`), as gpt-fast's KVCache and nanochat's engine keep theirs.

    python cached_sample.py --model DIR --prompt "..." --cache dual --cache-refresh 2 --threshold 0.995
"""

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import sample
from longjob import run_command_line
from model import check_prompt, predicting_hidden, unwrap
from sample import (SamplerOptions, append_masks, block_rows, candidates, check_stop_ids, eos_after_stop,
                    generate_with_options as exact_or_dream, get_num_transfer_tokens, guided_logits, transfer_index)


@dataclass
class KVCache:
    """The sampler's keys and values, one (k, v) per block, (B, Hkv, L, hd) each, and how one forward uses them:
    with `layers` empty the forward fills them with the whole sequence's (the model's plain output); with them filled
    and span = (s, e), the forward runs positions s .. e - 1 only, every other position's keys and values the cached
    ones (stale where those tokens have changed since: the cached sampler's approximation). write: the span's keys
    and values also replace the cached ones (a windowed rebuild, SamplerOptions.cache_window). probe: (qs, qe, rows),
    each block appends to rows its head-averaged attention of the queries at positions qs .. qe - 1 (the drift
    test). start: the first position of the forward's input (states sets it; LLaDA.forward reads it)."""
    layers: list = field(default_factory=list)
    span: tuple = None
    probe: tuple = None
    write: bool = False
    start: int = 0

    @property
    def length(self):
        """The cached sequence's length; None while empty (the forward then fills it)."""
        return self.layers[0][0].shape[2] if self.layers else None

    def layer(self, i):
        """What block i calls with its queries, keys and values: attend(i, ...)."""
        return functools.partial(self.attend, i)

    def attend(self, i, q, k, v, key_mask):
        """Block i's keys and values to attend to (B, Hkv, L, hd): this forward's own while filling; else the span's
        (k, v) (B, Hkv, S, hd) between the cached ones before and after it."""
        if len(self.layers) == i:  # filling, block by block
            self.layers.append((k, v))
        else:
            (k_all, v_all), s, e = self.layers[i], self.start, self.start + k.shape[2]
            if self.write:  # in place
                k_all[:, :, s:e], v_all[:, :, s:e] = k, v
                k, v = k_all, v_all
            else:
                k = torch.cat([k_all[:, :, :s], k, k_all[:, :, e:]], dim=2)
                v = torch.cat([v_all[:, :, :s], v, v_all[:, :, e:]], dim=2)
        if self.probe is not None:
            qs, qe, rows = self.probe[0] - self.start, self.probe[1] - self.start, self.probe[2]
            mask = key_mask if key_mask is None or key_mask.shape[2] == 1 else key_mask[:, :, qs:qe]
            rows.append(attention_probs(q[:, :, qs:qe], k, mask).mean(1))  # (B, qe - qs, L)
        return k, v

    def states(self, model, x, attention_mask):
        """guided_logits' forward through this cache: the final hidden states that predict the tokens at positions
        s .. e - 1 of x (the span; (0, L) without one), (B, e - s, D), and s (model.predicting_hidden's alignment)."""
        shifted = getattr(unwrap(model), "predicts_shifted", False)
        s, e = self.span or (0, x.shape[1])
        # Dream reads token s's prediction at position s - 1, so a span runs from one position earlier: that
        # position's state is computed afresh, seeing the block's current tokens, where a state kept from the step
        # that built the cache would be stale (and the block's first token would keep a fully masked block's)
        self.start = max(s - 1, 0) if shifted else s
        return predicting_hidden(model, x[:, self.start:e], attention_mask, cache=self)[:, s - self.start:], s


def attention_probs(q, k, key_mask):
    """softmax(q k^T / sqrt(hd)) in float32, what scaled_dot_product_attention weighs the values with: q (B, H, S,
    hd), k (B, Hkv, L, hd), key_mask None or (B, 1, 1 or S, L) bool -> (B, H, S, L). Written out only for the few
    queries the drift test inspects; the forward itself uses the fused kernel."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()  # (B, H, L, hd): query head h reads kv head h // g
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, L)
    if key_mask is None:
        return scores.softmax(-1)
    # a query that may see no key (a Dream padding query) gets weights 0, as the fused kernel gives it
    return scores.masked_fill(~key_mask, float("-inf")).softmax(-1).masked_fill(~key_mask.any(-1, keepdim=True), 0.0)


def attention_drift(attn, built, tracked, reference, gamma, block_start):
    """The attention-drift test of Elastic-Cache (Nguyen-Tri et al. 2025, arXiv 2510.14973, Sec. 3): the token the
    block attends to most drifts least, so a change in its attention bounds the change of the others' from below.
    attn (n_layers, B, Lb, L): this step's head-averaged attention probabilities of the block's Lb queries over all
    L positions; built (B,) bool: the rows whose cache this step built. tracked (n_layers, B) long: the block token
    each row tracks in each layer, reference (n_layers, B, L): its attention row when the row's cache was built
    (None before the block's first step). A built row tracks this step's most attended block token from now on.
    Returns drifted (B,) bool (the tracked token's row's cosine similarity to its building-step row below gamma in
    some layer) and tracked, reference for the next step. Comparing with the building step, not the last step as
    Elastic-Cache does, also catches a slow drift (bench/README.md, section 3b)."""
    n, B, Lb, L = attn.shape
    received = attn[:, :, :, block_start:block_start + Lb].sum(2)  # (n_layers, B, Lb): what each block token receives
    most = received.argmax(-1)  # (n_layers, B)
    if tracked is None:  # the block's first step: every row is built
        tracked, reference = most, attn.new_zeros(n, B, L)
    tracked = torch.where(built, most, tracked)  # (n_layers, B)
    now = attn.gather(2, tracked[:, :, None, None].expand(n, B, 1, L)).squeeze(2)  # (n_layers, B, L)
    reference = torch.where(built[:, None], now, reference)
    drifted = (F.cosine_similarity(now, reference, dim=-1) < gamma).any(0) & ~built  # (B,)
    return drifted, tracked, reference


def rebuild_rows(model, x, attention_mask, prompt_index, cfg_scale, mask_id, layers, rows):
    """Recompute the cached keys and values of the rows (B,) bool with a full forward of those rows alone, written
    into the cache's layers in place (under classifier-free guidance, their unconditional copies B + r too)."""
    idx = rows.nonzero().squeeze(1)  # (k,)
    fresh, none = KVCache(), torch.zeros_like(x[idx], dtype=torch.bool)  # no logits are needed
    guided_logits(model, x[idx], None if attention_mask is None else attention_mask[idx], none, prompt_index[idx],
                  cfg_scale, mask_id, fresh.states)
    if cfg_scale > 0:
        idx = torch.cat([idx, idx + len(x)])
    for (k, v), (k_new, v_new) in zip(layers, fresh.layers):
        k[idx], v[idx] = k_new, v_new


@torch.no_grad()
def generate_cached(model, prompt, attention_mask=None, options=None, generator=None, mask_id=None, stop_ids=None,
                    stats=None, eot_id=None):
    """sample.generate() made faster after Fast-dLLM (Wu et al. 2025, arXiv 2505.22618), at the cost of exactness: a
    key/value cache (options.cache), confidence-threshold parallel decoding (options.threshold), and a cache rebuilt
    on a schedule (options.cache_refresh), when attention drifts (options.cache_drift) or only near the block
    (options.cache_window); SamplerOptions says what each does. options: a SamplerOptions with gen_length, steps and
    block_length set. The other arguments and the random draws are generate()'s (its block loop, sample.block_rows,
    the early exit included: a row leaves before a block, its keys and values with it); options with cache=None
    and threshold=None give generate()'s tokens."""
    o = options or SamplerOptions()  # checked when built
    if None in (o.gen_length, o.steps, o.block_length):
        raise ValueError(f"cached_sample.py generate_cached: options.gen_length ({o.gen_length}), steps ({o.steps}) "
                         f"and block_length ({o.block_length}) must be set; e.g. SamplerOptions(gen_length=128, "
                         "steps=128, block_length=32, cache='dual')")
    where = "cached_sample.py generate_cached"
    check_prompt(prompt, attention_mask, generator, where, model, o.gen_length)
    if o.confidence_eos_eot_inf and eot_id is None:
        raise ValueError(f"{where}: confidence_eos_eot_inf needs eot_id, the turn end's token id")
    stop_ids = check_stop_ids(None if o.early_exit is False else stop_ids, generator, len(prompt),
                              o.temperature > 0 or o.remasking == "random", where, prompt.device)
    module = unwrap(model)
    mask_id, eos_id = module.config.mask_token_id if mask_id is None else mask_id, module.config.eos_token_id
    eos = dict(eos_inf=eos_id if o.logits_eos_inf else None,
               eos_eot_inf=(eos_id, eot_id) if o.confidence_eos_eot_inf else None)
    x, attention_mask = append_masks(prompt, attention_mask, o.gen_length, mask_id)  # (B, L), (B, L) or None
    prompt_index = x != mask_id
    L = x.shape[1]
    positions = torch.arange(L, device=x.device)

    steps = o.steps // (o.gen_length // o.block_length)  # per block
    layers = None  # the cache: built at the first block's first step; rebuilt (or, cache_window, updated) at a block's
    before = None  # the rows sampled in the block before (their keys and values are the cache's)
    for block_start, block_end, live, (xb, mask_b, prompt_b, generator_b, lengths_b) in block_rows(
            x, attention_mask, prompt_index, generator, prompt.shape[1], o.block_length, stop_ids, mask_id, stats):
        if o.cache_window is not None and layers is not None and len(live) < len(before):  # kept across blocks
            keep = torch.isin(before, live).nonzero().squeeze(1)  # the live rows' keys and values only
            keep = torch.cat([keep, keep + len(before)]) if o.cfg_scale > 0 else keep  # CFG's rows: [cond; uncond]
            layers = [(k[keep], v[keep]) for k, v in layers]
        before, B = live, len(xb)
        num_transfer_tokens = get_num_transfer_tokens(xb[:, block_start:block_end] == mask_id, steps)  # (B, steps)
        # without a cache, generate()'s eligible positions; a cached step sees the current block only
        in_block = positions < block_end if o.cache is None else (positions >= block_start) & (positions < block_end)
        drifted, tracked, reference = None, None, None
        for i in range(steps if o.threshold is None else o.block_length):
            eligible = (xb == mask_id) & in_block  # (B, L), N True in all
            if o.threshold is not None and not eligible.any():
                break  # parallel decoding: the block is done early
            full = i == 0 or (o.cache_refresh is not None and i % o.cache_refresh == 0)  # this step rebuilds the cache
            windowed = o.cache is not None and full and o.cache_window is not None and layers is not None
            span = None
            if windowed:  # rebuild the window's keys and values only
                span = (max(block_start - o.cache_window, 0),
                        L if o.cache == "prefix" else min(block_end + o.cache_window, L))
            elif o.cache is not None and full:
                layers = []  # a full forward stores every position's keys and values
            elif drifted is not None and drifted.any():  # the drift test fired for these rows at the last step
                rebuild_rows(model, xb, mask_b, prompt_b, o.cfg_scale, mask_id, layers, drifted)
            if o.cache is not None and not full:  # a step that reads the cache
                span = (block_start, block_end if o.cache == "dual" else L)
            # the drift test watches the block's own queries (for Dream too, whose span starts one position earlier)
            rows = None if o.cache_drift is None else (block_start, block_end, [])
            forward = None if layers is None else KVCache(layers, span, rows, windowed).states
            logits = guided_logits(model, xb, mask_b, eligible, prompt_b, o.cfg_scale, mask_id, forward)  # (N, V)
            if rows is not None:
                attn = torch.stack(rows[2])[:, :B]  # the conditional rows' attention, (n_layers, B, Lb, L)
                built = torch.full((B,), full, device=x.device) if drifted is None or full else drifted
                drifted, tracked, reference = attention_drift(attn, built, tracked, reference, o.cache_drift,
                                                              block_start)
            x0, confidence = candidates(logits, xb, eligible, o.temperature, o.remasking, generator_b, lengths_b, **eos)

            # generate()'s k most confident positions, or (threshold) every position above it and at least the
            # most confident one
            if o.threshold is None:
                transfer = transfer_index(confidence, num_transfer_tokens[:, i])
            else:
                transfer = transfer_index(confidence, eligible.any(1).long()) | (eligible & (confidence > o.threshold))
            xb = torch.where(transfer, x0, xb)
        x[live] = xb
    return x if stop_ids is None else eos_after_stop(x, prompt.shape[1], stop_ids, eos_id)


def generate_with_options(model, prompt, attention_mask=None, options=None, generator=None, stop_ids=None, stats=None,
                          eot_id=None):
    """sample.generate_with_options with the cached sampler too: generate_cached() when the options ask for a cache
    or a threshold, else sample's (the exact sampler, or Dream's own). (B, P + gen_length)."""
    o = options or SamplerOptions()
    if o.sampler == "block" and not o.exact:
        return generate_cached(model, prompt, attention_mask, o, generator, stop_ids=stop_ids, stats=stats,
                               eot_id=eot_id)
    return exact_or_dream(model, prompt, attention_mask, o, generator, stop_ids, stats, eot_id)


if __name__ == "__main__":
    run_command_line(lambda: sample.main(sampler=generate_with_options), "cached_sample.py")
