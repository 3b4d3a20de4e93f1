"""LLaDA's block diffusion sampler: the official generate.py, token for token, batched; and an opt-in fast one.

LLaDA (Nie et al. 2025, "Large Language Diffusion Models", Sec. 2.4 and Appendix B) answers by starting from a fully
masked response and running `steps` reverse-diffusion steps; each step predicts every masked token and keeps the
predictions it is most confident about ("low-confidence remasking"). With block_length < gen_length the response is
filled block by block, left to right ("semi-autoregressive remasking"). This file reproduces the official sampler
(github.com/ML-GSAI/LLaDA, generate.py) with the same arguments and the same random draws, and differs from it only
where the tokens cannot change:
  - the whole batch is handled at once (the official code picks each row's top-k positions in a Python loop);
  - the LM head runs only at the positions that can be unmasked this step (the current block and masks left before
    it), not over the prompt and the later blocks: this saves most of the head's cost (V = 126464 for LLaDA-8B).
    The product over fewer rows gives the same numbers on the CPU; a GPU library may pick another kernel for
    another row count, which can change logits by a rounding error;
  - classifier-free guidance also works without an attention mask (the official code raises a NameError there).
generate() is that exact sampler, loop for loop beside the official one. generate_cached() is the opt-in fast
sampler of Fast-dLLM (Wu et al. 2025, arXiv 2505.22618): a prefix or dual key/value cache reused over a block's
steps, and confidence-threshold parallel decoding; it trades exactness for speed, with the same arguments and draws.

    python sample.py --model DIR [--adapter DIR] --prompt "..." [--gen-length 128 --steps 128 --block-length 32]
    python sample.py --model DIR --prompt "..." --cache dual --cache-refresh 2 --threshold 0.995   # the fast sampler
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from gift import uniforms  # U(0, 1) draws from one generator, or one per row (gift.py Part I, torch only)

REMASKING = ("low_confidence", "random")  # the official strategies
CACHES = (None, "prefix", "dual")  # generate_cached's key/value caches (None: no cache)

# -----------------------------------------------------------------------------
# Building blocks (pure functions, one per line of the official loop)


def get_num_transfer_tokens(block_mask_index, steps):
    """How many tokens each row unmasks at each of the block's `steps` steps (official get_num_transfer_tokens).

    The reverse process splits t in [0, 1] into `steps` equal intervals and LLaDA's noise schedule is linear
    (paper Eq. (8)), so each step should unmask the same expected number of tokens: m // steps per step, plus one
    for each of the first m % steps steps (m = masks in the block). With more steps than masks, the last steps
    unmask nothing. block_mask_index (B, Lb) bool -> (B, steps) long, summing to m per row.
    """
    m = block_mask_index.sum(dim=1, keepdim=True)  # (B, 1)
    extra = torch.arange(steps, device=m.device)[None, :] < (m % steps)  # (B, steps): the first m % steps steps
    return m // steps + extra.long()


def add_gumbel_noise(logits, temperature, u):
    """Gumbel-max sampling, as the official add_gumbel_noise: argmax of exp(logits) / (-log u)^temperature, which
    is argmax(logits / temperature + Gumbel noise), a draw from softmax(logits / temperature).

    In float64 because, per the official docstring, low-precision Gumbel-max lowers MDM perplexity but hurts
    generation quality (arXiv:2409.02908). u: uniforms in [0, 1), float64, same shape as logits; they are drawn by
    the caller so that the draw can cover the official (B, L, V) shape. temperature 0 returns the logits untouched
    (greedy, in the model's dtype, as the official code).
    """
    if temperature == 0:
        return logits
    return logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature


def low_confidence(logits, x0):
    """The model's probability of each candidate: softmax of the (guided, un-noised) logits at x0.

    The softmax runs in the logits' dtype, exactly as the official `F.softmax(logits, dim=-1)` (bf16 for the real
    model, so confidences round to 8 mantissa bits and tie often; transfer_index resolves ties like the official
    torch.topk). logits (N, V), x0 (N,) -> (N,).
    """
    p = F.softmax(logits, dim=-1)
    return torch.gather(p, -1, x0[:, None]).squeeze(-1)


def transfer_index(confidence, k):
    """Mark the k[b] most confident positions of each row b: confidence (B, L), k (B,) -> (B, L) bool.

    The official code calls torch.topk(confidence[b], k[b]) row by row. We call torch.topk once for the whole batch
    at k = max(k) and keep each row's first k[b] indices (topk returns them sorted by confidence). Within a
    generate() call every row has the same k (each block starts fully masked in every row), and then this is
    exactly the official call, ties included: topk treats each row of a batch as it treats a lone row (on the CPU
    an introselect whose tie order is not "lowest index first", so a stable sort would NOT reproduce it). For
    unequal k, each row still gets a valid top-k[b] set, but equal confidences at its boundary may be resolved
    differently from a per-row topk call.
    """
    k_max = int(k.max())
    top = torch.topk(confidence, k_max, dim=-1).indices  # (B, k_max), most confident first
    keep = torch.arange(k_max, device=k.device)[None, :] < k[:, None]  # (B, k_max)
    return torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, top, keep)


def guided_logits(model, x, attention_mask, eligible, prompt_index, cfg_scale, mask_id, kv_cache=None, span=None,
                  attn_rows=None):
    """Logits (N, V) at the N eligible positions (row-major order), with classifier-free guidance if cfg_scale > 0.

    One forward pass over the whole sequence gives hidden states; the LM head then runs on the eligible rows only.
    Unsupervised CFG (LLaDA paper, Appendix B; official code): the batch is stacked with a copy whose prompt
    positions are masked, and logits = uncond + (cfg_scale + 1) * (cond - uncond), computed in the logits' dtype
    as the official code does. The head is taken from `.module` under DDP, and the hidden states from calling
    the wrapper, so that DDP / FSDP see a forward.
    kv_cache, span (cached samplers): an empty list is filled with the keys and values of this forward; with a
    filled one and span = (s, e), only positions s .. e - 1 run (eligible must lie inside them). attn_rows: passed to
    the model (LLaDA.forward), the query range relative to the span.
    """
    head = getattr(model, "module", model).head
    s, e = span or (0, x.shape[1])
    if cfg_scale > 0:  # the official test is `if cfg_scale > 0.`
        un_x = x.masked_fill(prompt_index, mask_id)  # prompt masked: the unconditional input
        x = torch.cat([x, un_x], dim=0)  # (2B, L)
        attention_mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask], dim=0)
    probe = {} if attn_rows is None else {"attn_rows": attn_rows}
    if kv_cache is None:
        h = model(x, attention_mask=attention_mask, return_hidden=True, **probe)  # (B or 2B, L, D)
    else:
        h = model(x[:, s:e], attention_mask=attention_mask, return_hidden=True, kv_cache=kv_cache, start=s, **probe)
    if cfg_scale <= 0:
        return head(h[eligible[:, s:e]])  # (N, V)
    B = len(eligible)
    logits, un_logits = head(torch.cat([h[:B][eligible[:, s:e]], h[B:][eligible[:, s:e]]], dim=0)).chunk(2, dim=0)
    return un_logits + (cfg_scale + 1) * (logits - un_logits)


def check_generate_args(prompt, attention_mask, steps, gen_length, block_length, remasking, generator, cache=None,
                        threshold=None, where="generate"):
    """The sampler's argument checks (the official code asserts two of them), before any forward pass."""
    if prompt.dim() != 2:
        raise ValueError(f"sample.py {where}: prompt must be (batch, prompt_len) token ids, got shape "
                         f"{tuple(prompt.shape)}; use prompt[None] for a single prompt")
    if attention_mask is not None and attention_mask.shape != prompt.shape:
        raise ValueError(f"sample.py {where}: attention_mask {tuple(attention_mask.shape)} must have the prompt's "
                         f"shape {tuple(prompt.shape)}")
    if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
        raise ValueError(f"sample.py {where}: gen_length ({gen_length}) must be a positive multiple of block_length "
                         f"({block_length}); e.g. block_length={gen_length} for a single block")
    num_blocks = gen_length // block_length
    if steps <= 0 or steps % num_blocks:
        hint = num_blocks * max(1, steps // num_blocks)
        raise ValueError(f"sample.py {where}: steps ({steps}) must be a positive multiple of the number of blocks "
                         f"gen_length / block_length = {num_blocks}; e.g. steps={hint}")
    if remasking not in REMASKING:
        raise ValueError(f"sample.py {where}: remasking={remasking!r}; expected one of {REMASKING}")
    if cache not in CACHES:
        raise ValueError(f"sample.py {where}: cache={cache!r}; expected one of {CACHES}")
    if threshold is not None and not 0 <= threshold < 1:
        raise ValueError(f"sample.py {where}: threshold={threshold}; expected a confidence in [0, 1)")
    if isinstance(generator, (list, tuple)) and len(generator) != len(prompt):
        raise ValueError(f"sample.py {where}: {len(generator)} generators for {len(prompt)} rows")


def append_masks(prompt, attention_mask, gen_length, mask_id):
    """The sampler's start: x = the prompt then gen_length masks (B, P + gen_length), and the attention mask
    extended with ones (the answer is attended to)."""
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :prompt.shape[1]] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(prompt.shape[0], gen_length)], dim=1)
    return x, attention_mask


# -----------------------------------------------------------------------------
# The exact sampler: the official generate(), loop for loop


@torch.no_grad()
def generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128, temperature=0.,
             cfg_scale=0., remasking="low_confidence", mask_id=None, generator=None):
    """LLaDA's official generate(), batched: the same arguments, random draws and tokens. Returns x
    (B, prompt_len + gen_length), prompt included.

    model: called as model(x, attention_mask=..., return_hidden=True) -> (B, L, D), with the LM head at
        getattr(model, "module", model).head; put it in eval mode first (LoRA dropout).
    prompt: (B, P) token ids; left-pad a batch of prompts and give attention_mask (B, P), 0 on the pads.
    steps: sampling steps in all, split evenly over the gen_length / block_length blocks.
    block_length < gen_length: semi-autoregressive, one block at a time, left to right.
    temperature: 0 = greedy; > 0 samples with float64 Gumbel noise.
    cfg_scale: unsupervised classifier-free guidance scale (0 = off).
    remasking: "low_confidence" (unmask the most probable predictions) or "random".
    mask_id: defaults to model.config.mask_token_id.
    generator: torch.Generator on the prompt's device for the random draws (None: the global RNG, as official).
        The draws have the official shapes and order ((B, L, V) float64 uniforms for the noise, then (B, L)
        float32 for random remasking), so the same RNG state gives the official tokens. A list of B generators
        draws each row's noise from its own (a row's tokens then do not depend on its batch).
    """
    mask_id = getattr(model, "module", model).config.mask_token_id if mask_id is None else mask_id
    check_generate_args(prompt, attention_mask, steps, gen_length, block_length, remasking, generator)
    x, attention_mask = append_masks(prompt, attention_mask, gen_length, mask_id)  # (B, L), (B, L) or None
    prompt_index = x != mask_id  # what CFG masks: every non-mask token at the start, left pads included
    B, L = x.shape
    positions = torch.arange(L, device=x.device)

    num_blocks = gen_length // block_length
    steps = steps // num_blocks  # per block, as in the official code
    for num_block in range(num_blocks):
        block_end = prompt.shape[1] + (num_block + 1) * block_length
        block_mask_index = x[:, block_end - block_length:block_end] == mask_id  # (B, block_length)
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)  # (B, steps)
        for i in range(steps):
            mask_index = x == mask_id  # (B, L)
            # the official confidence is -inf after the block and where x is no mask: only these N positions can
            # change (masks left in earlier blocks included), so the LM head runs only there
            eligible = mask_index & (positions < block_end)  # (B, L)
            logits = guided_logits(model, x, attention_mask, eligible, prompt_index, cfg_scale, mask_id)  # (N, V)

            # candidates: argmax, or Gumbel-max if temperature > 0. The (N, V) uniforms are drawn over the official
            # (B, L, V), 8 bytes each as there, so that one RNG state gives the official tokens
            V = logits.shape[-1]
            u = uniforms((B, L, V), generator, x.device, torch.float64)[eligible] if temperature else None
            x0 = torch.argmax(add_gumbel_noise(logits, temperature, u), dim=-1)  # (N,)
            # their confidence; random remasking draws (B, L) float32 uniforms, as the official code
            if remasking == "low_confidence":
                x0_p = low_confidence(logits, x0)  # (N,), in the logits' dtype
            else:
                x0_p = uniforms((B, L), generator, x.device)[eligible]  # (N,)
            x0 = x.masked_scatter(eligible, x0)  # (B, L), the official torch.where(mask_index, x0, x)
            confidence = torch.full((B, L), float("-inf"), dtype=x0_p.dtype, device=x.device)
            confidence = confidence.masked_scatter(eligible, x0_p)  # (B, L), -inf where nothing may change

            # the k most confident positions take their candidates (the official transfer_index); a candidate
            # equal to mask_id leaves its position masked, and eligible again at the next step, as officially
            transfer = transfer_index(confidence, num_transfer_tokens[:, i])  # (B, L) bool
            x[transfer] = x0[transfer]
    return x


# -----------------------------------------------------------------------------
# The fast sampler (Fast-dLLM, arXiv 2505.22618): key/value cache and confidence-threshold parallel decoding


def attention_drift(attn, built, tracked, reference, gamma, block_start):
    """The attention-drift test of Elastic-Cache (Nguyen-Tri et al. 2025, arXiv 2510.14973, Sec. 3): the token the
    block attends to most drifts least, so a change in its attention bounds the change of the others' from below.
    attn (n_layers, B, Lb, L): this step's head-averaged attention probabilities of the block's Lb queries over all
    L positions; built (B,) bool: the rows whose cache this step built. tracked (n_layers, B) long: the block token
    each row tracks in each layer, reference (n_layers, B, L): its attention row when the row's cache was built
    (None before the block's first step). A built row tracks this step's most attended block token from now on.
    Returns drifted (B,) bool, True where the cosine similarity between the tracked token's row at the building step
    and now is below gamma in some layer; and tracked, reference for the next step.
    Elastic-Cache compares consecutive steps; comparing with the row at the cache's building step also catches a
    drift that accumulates slowly (bench/README.md, section 3b, has what each costs and keeps)."""
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


def rebuild_rows(model, x, attention_mask, prompt_index, cfg_scale, mask_id, kv_cache, rows):
    """Recompute the cached keys and values of the rows (B,) bool with a full forward of those rows alone, written
    into kv_cache in place (under classifier-free guidance, their unconditional copies B + r too)."""
    idx = rows.nonzero().squeeze(1)  # (k,)
    fresh, none = [], torch.zeros_like(x[idx], dtype=torch.bool)  # no logits are needed
    guided_logits(model, x[idx], None if attention_mask is None else attention_mask[idx], none, prompt_index[idx],
                  cfg_scale, mask_id, fresh)
    if cfg_scale > 0:
        idx = torch.cat([idx, idx + len(x)])
    for (k, v), ((k_new, v_new),) in zip((layer[0] for layer in kv_cache), fresh):
        k[idx], v[idx] = k_new, v_new


@torch.no_grad()
def generate_cached(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128, temperature=0.,
                    cfg_scale=0., remasking="low_confidence", mask_id=None, generator=None, cache="dual",
                    threshold=None, refresh_cache_every_step=False, cache_refresh=None, cache_drift=None):
    """generate() made faster after Fast-dLLM (Wu et al. 2025, arXiv 2505.22618), at the cost of exactness. The
    arguments and random draws are generate()'s; cache=None with threshold=None is generate() itself.

    cache: "prefix" = at each block's first step one full forward stores every position's keys and values; the
        block's later steps run only the block and what follows it, the prompt and the finished blocks read from
        the cache. "dual" = those steps run only the block; the later (still masked) blocks read from the cache too.
        The cached keys and values are the block's first step's: an approximation, since attention is
        bidirectional. Only the current block's masks are eligible (the exact sampler also retries masks that an
        earlier block left, which happens only when the model predicts the mask token itself). None = no cache.
    threshold: confidence-aware parallel decoding: each step unmasks every eligible position whose confidence
        exceeds it (at least the most confident one per row), and a block ends as soon as it has no mask left
        (at most block_length steps); `steps` is then only checked. None = generate()'s schedule.
    refresh_cache_every_step: rebuild the cache at every step (a check: the cache is then exact, and the tokens
        are the exact sampler's; no speed-up).
    cache_refresh: N = a step that is a multiple of N within the block (0, N, 2N, ...) runs the full forward and
        rebuilds the cache, as the block's first step does; the others read it. None = only the block's first step
        (Fast-dLLM). With one block spanning the whole answer, the prompt's keys and values are otherwise never
        recomputed after the answer tokens decoded since; N = 1 runs every step in full (the exact tokens).
    cache_drift: gamma in (0, 1]: an adaptive refresh, Elastic-Cache's drift test (attention_drift), row by row:
        a row whose tracked token's attention drifted at a step gets its cache rebuilt at the next step (a full
        forward of that row; rebuild_rows), and reads it as the others do. Elastic-Cache also recomputes only the
        layers from the drifting one on, and keeps distant masks cached; here a drifting row is rebuilt whole.
    """
    mask_id = getattr(model, "module", model).config.mask_token_id if mask_id is None else mask_id
    check_generate_args(prompt, attention_mask, steps, gen_length, block_length, remasking, generator, cache,
                        threshold, where="generate_cached")
    if cache_refresh is not None and (cache is None or not isinstance(cache_refresh, int) or cache_refresh < 1):
        raise ValueError(f"sample.py generate_cached: cache_refresh={cache_refresh!r}; a whole number of steps >= 1, "
                         "with a cache")
    if cache_drift is not None and (cache is None or not 0 < cache_drift <= 1):
        raise ValueError(f"sample.py generate_cached: cache_drift={cache_drift!r}; a cosine similarity in (0, 1], "
                         "with a cache")
    x, attention_mask = append_masks(prompt, attention_mask, gen_length, mask_id)  # (B, L), (B, L) or None
    prompt_index = x != mask_id
    B, L = x.shape
    positions = torch.arange(L, device=x.device)

    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        block_start = prompt.shape[1] + num_block * block_length
        block_end = block_start + block_length
        num_transfer_tokens = get_num_transfer_tokens(x[:, block_start:block_end] == mask_id, steps)  # (B, steps)
        # without a cache, generate()'s eligible positions; a cached step sees the current block only
        in_block = positions < block_end if cache is None else (positions >= block_start) & (positions < block_end)
        kv_cache, drifted, tracked, reference = None, None, None, None
        for i in range(steps if threshold is None else block_length):
            eligible = (x == mask_id) & in_block  # (B, L), N True in all
            if threshold is not None and not eligible.any():
                break  # parallel decoding: the block is done early
            full = i == 0 or (cache_refresh is not None and i % cache_refresh == 0)  # this step rebuilds the cache
            if cache is not None and (full or refresh_cache_every_step):
                kv_cache = []  # a full forward stores every position's keys and values
                if refresh_cache_every_step:  # fill it now; this step then reads it as a later step does
                    guided_logits(model, x, attention_mask, eligible, prompt_index, cfg_scale, mask_id, kv_cache)
            elif drifted is not None and drifted.any():  # the drift test fired for these rows at the last step
                rebuild_rows(model, x, attention_mask, prompt_index, cfg_scale, mask_id, kv_cache, drifted)
            reads_cache = cache is not None and (not full or refresh_cache_every_step)
            span = (block_start, block_end if cache == "dual" else L) if reads_cache else None
            s = span[0] if span else 0  # the block's queries are block_start - s .. block_end - s of this forward
            rows = None if cache_drift is None else (block_start - s, block_end - s, [])
            logits = guided_logits(model, x, attention_mask, eligible, prompt_index, cfg_scale, mask_id, kv_cache,
                                   span, rows)  # (N, V)
            if rows is not None:
                attn = torch.stack(rows[2])[:, :B]  # the conditional rows' attention, (n_layers, B, Lb, L)
                built = torch.full((B,), full, device=x.device) if drifted is None or full else drifted
                drifted, tracked, reference = attention_drift(attn, built, tracked, reference, cache_drift,
                                                              block_start)

            # candidates and their confidence, drawn as in generate()
            V = logits.shape[-1]
            u = uniforms((B, L, V), generator, x.device, torch.float64)[eligible] if temperature else None
            x0 = torch.argmax(add_gumbel_noise(logits, temperature, u), dim=-1)  # (N,)
            if remasking == "low_confidence":
                x0_p = low_confidence(logits, x0)  # (N,)
            else:
                x0_p = uniforms((B, L), generator, x.device)[eligible]  # (N,)
            x0 = x.masked_scatter(eligible, x0)  # (B, L)
            confidence = torch.full((B, L), float("-inf"), dtype=x0_p.dtype, device=x.device)
            confidence = confidence.masked_scatter(eligible, x0_p)

            # generate()'s k most confident positions, or (threshold) every position above it and at least the
            # most confident one
            if threshold is None:
                transfer = transfer_index(confidence, num_transfer_tokens[:, i])
            else:
                transfer = transfer_index(confidence, eligible.any(1).long()) | (eligible & (confidence > threshold))
            x = torch.where(transfer, x0, x)
    return x


# -----------------------------------------------------------------------------
# Command line: chat with or complete from a checkpoint


def decode_until_stop(tokenizer, ids):
    """Text of the generated ids up to the first <|eot_id|> or <|endoftext|> (answers end in eot, then EOS pads)."""
    stops = {tokenizer.token_to_id(t) for t in ("<|eot_id|>", "<|endoftext|>")} - {None}
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=False)


def main(argv=None):
    p = argparse.ArgumentParser(description="Generate with LLaDA's block diffusion sampler.")
    p.add_argument("--model", required=True, help="model folder (config.json, safetensors, tokenizer.json), or what "
                   "gift.py printed: a checkpoint or run folder")
    p.add_argument("--adapter", default=None,
                   help="LoRA adapter folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--prompt", default=None, help="the user message; without it, chat interactively on stdin")
    p.add_argument("--raw", action="store_true", help="complete the prompt text as is, without the chat template")
    p.add_argument("--gen-length", type=int, default=None,
                   help="tokens to generate (default: the model folder's generation_defaults.json, else 128)")
    p.add_argument("--steps", type=int, default=None, help="sampling steps in all (default: the model's, else "
                   "gen-length)")
    p.add_argument("--block-length", type=int, default=None, help="block length (default: the model's, else "
                   "min(32, gen-length))")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--cfg-scale", type=float, default=0.0, help="classifier-free guidance scale (0 = off)")
    p.add_argument("--remasking", choices=REMASKING, default="low_confidence", help="remasking strategy")
    p.add_argument("--cache", choices=("none", "prefix", "dual"), default="none",
                   help="fast sampler: Fast-dLLM's key/value cache (none, without --threshold: the exact sampler)")
    p.add_argument("--threshold", type=float, default=None,
                   help="fast sampler: unmask every token more confident than this (parallel decoding; e.g. 0.9)")
    p.add_argument("--cache-refresh", type=int, default=None,
                   help="fast sampler: rebuild the --cache every N steps inside a block (default: at its first only)")
    p.add_argument("--cache-drift", type=float, default=None,
                   help="fast sampler: also rebuild a row's --cache when its attention drifts (Elastic-Cache's test: "
                   "cosine similarity below this, e.g. 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")
    args = p.parse_args(argv)
    for flag in ("gen_length", "steps", "block_length"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.threshold is not None and not 0 <= args.threshold < 1:
        p.error(f"--threshold {args.threshold}: a confidence in [0, 1)")
    if not args.temperature >= 0 or not args.cfg_scale >= 0:
        p.error(f"--temperature {args.temperature} / --cfg-scale {args.cfg_scale}: must be 0 (off) or more")
    if args.cache_refresh is not None and (args.cache == "none" or args.cache_refresh < 1):
        p.error(f"--cache-refresh {args.cache_refresh}: a number of steps >= 1, with --cache prefix or dual")
    if args.cache_drift is not None and (args.cache == "none" or not 0 < args.cache_drift <= 1):
        p.error(f"--cache-drift {args.cache_drift}: a cosine similarity in (0, 1], with --cache prefix or dual")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device; use --device cpu")

    # only the command line needs the model and tokenizer code; the samplers above need torch (and gift.uniforms)
    from data import chat_prompt, check_mask_token, encode_text, load_tokenizer
    from model import LLaDA, find_model, generation_defaults, load_adapter

    try:
        folder, adapter = find_model(args.model)
        defaults = generation_defaults(folder)  # what the model was trained to answer with (the embedded task's)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    adapter = args.adapter or adapter
    gen_length = args.gen_length or defaults.get("gen_length", 128)
    block_length = args.block_length or defaults.get("block_length") or min(32, gen_length)
    steps = args.steps or defaults.get("steps") or gen_length
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = LLaDA.from_pretrained(folder, dtype=dtype, device=args.device)
    if adapter:
        load_adapter(model, adapter)  # adds LoRA layers (on the model's device) with the adapter's r / alpha
    model.eval()  # LoRA dropout off
    tokenizer = load_tokenizer(folder)
    check_mask_token(tokenizer, model.config)
    generator = torch.Generator(args.device).manual_seed(args.seed)

    def reply(text):
        ids = encode_text(tokenizer, text)  # the chat text carries its own special tokens; nothing is added
        if len(ids) + gen_length > model.config.max_sequence_length:
            raise ValueError(f"the prompt of {len(ids)} tokens + --gen-length {gen_length} exceed the model's "
                             f"max_sequence_length {model.config.max_sequence_length}")
        prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
        kw = dict(steps=steps, gen_length=gen_length, block_length=block_length,
                  temperature=args.temperature, cfg_scale=args.cfg_scale, remasking=args.remasking, generator=generator)
        if args.cache == "none" and args.threshold is None:
            out = generate(model, prompt, **kw)
        else:
            out = generate_cached(model, prompt, **kw, cache=None if args.cache == "none" else args.cache,
                                  threshold=args.threshold, cache_refresh=args.cache_refresh,
                                  cache_drift=args.cache_drift)
        return decode_until_stop(tokenizer, out[0, len(ids):].tolist())

    if args.prompt is not None:
        try:
            print(reply(args.prompt if args.raw else chat_prompt([{"role": "user", "content": args.prompt}])))
        except ValueError as e:
            raise SystemExit(f"sample.py: {e}") from None
        return
    messages = []  # interactive multi-turn chat: the whole conversation is the prompt of each turn
    while True:
        try:
            text = input("user> ")
        except EOFError:
            break
        try:
            if args.raw:
                print(reply(text))
                continue
            answer = reply(chat_prompt(messages + [{"role": "user", "content": text}]))
        except ValueError as e:  # e.g. a character the model cannot read: say so, and ask again
            print(f"sample.py: {e}")
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": answer})
        print(f"assistant> {answer}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:  # a user's mistake (a file, a folder, a data row, a prompt): one line
        print(f"sample.py: error: {e}", file=sys.stderr)
        sys.exit(1)
