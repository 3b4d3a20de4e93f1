"""LLaDA's block diffusion sampler: the official generate.py, token for token, batched; an opt-in fast one; Dream's.

LLaDA (Nie et al. 2025, "Large Language Diffusion Models", Sec. 2.4 and Appendix B) answers by starting from a fully
masked response and running `steps` reverse-diffusion steps; each step predicts every masked token and keeps the
predictions it is most confident about ("low-confidence remasking"). With block_length < gen_length the response is
filled block by block, left to right ("semi-autoregressive remasking"). This file reproduces the official sampler
(github.com/ML-GSAI/LLaDA, generate.py) with the same arguments and the same random draws; it differs from it
only where the tokens cannot change (batched top-k, the LM head at the unmaskable positions only: docs/samplers.md).
The file reads in sections: the exact sampler generate() (copyable next to model.py alone); SamplerOptions, the
samplers' options declared once (one flag each in sample.py and eval.py); generate_cached(), the opt-in fast sampler
of Fast-dLLM (Wu et al. 2025, arXiv 2505.22618: key/value caches, confidence-threshold parallel decoding; faster, not
exact); diffusion_generate(), Dream-v0's own sampler (github.com/HKUNLP/Dream), token for token; the command line.
The block samplers also sample Dream, the paper's protocol for it (Appendix C): Dream's logits at position i - 1
predict token i, so each token is read one position to the left, as Dream's generation code shifts its logits.

    python sample.py --model DIR [--adapter DIR] --prompt "..." [--gen-length 128 --steps 128 --block-length 32]
    python sample.py --model DIR --prompt "..." --cache dual --cache-refresh 2 --threshold 0.995   # the fast sampler
    python sample.py --model DREAM_DIR --prompt "..." --sampler dream --alg entropy --steps 128   # Dream's own
"""

# =============================================================================
# The exact sampler: LLaDA's official generate(), loop for loop, batched. This section stands alone: copied next to
# model.py (it needs only torch and model.py's shift_right and unwrap), it samples as this file does.
# =============================================================================

import math
import numbers

import torch
import torch.nn.functional as F

from model import shift_right, unwrap

REMASKING = ("low_confidence", "random")  # the official strategies


def uniforms(shape, generator, device, dtype=None, lengths=None):
    """U(0, 1) draws of `shape` (B, ...) in `dtype` (None: float32) from one generator (None: torch's global one) or
    from a list of B generators, one per row: training's draw rule (gift.py Part I's uniforms; a test pins the two
    equal), copied here so that this section needs no trainer. lengths (B,) ints, with a list: row b draws over its
    last lengths[b] positions only (dim 1: its own tokens, not its left padding; the others 0.5), so that its draws
    do not depend on the length of the rows beside it."""
    if generator is None or isinstance(generator, torch.Generator):
        where = device if generator is None else generator.device
        return torch.rand(shape, dtype=dtype, device=where, generator=generator).to(device)
    if lengths is None:
        return torch.stack([torch.rand(shape[1:], dtype=dtype, device=g.device, generator=g)
                            for g in generator]).to(device)
    rows = [torch.rand((n, *shape[2:]), dtype=dtype, device=g.device, generator=g) for g, n in zip(generator, lengths)]
    pad = (0, 0) * (len(shape) - 2)  # F.pad's (left, right) pairs run from the last dim: dim 1 padded on the left
    return torch.stack([F.pad(r, pad + (shape[1] - n, 0), value=0.5) for r, n in zip(rows, lengths)]).to(device)


def get_num_transfer_tokens(block_mask_index, steps):
    """How many tokens each row unmasks at each of the block's `steps` steps (official get_num_transfer_tokens): the
    noise schedule is linear (paper Eq. (8)), so m // steps per step, plus one for each of the first m % steps steps
    (m = masks in the block; with more steps than masks, the last steps unmask nothing).
    block_mask_index (B, Lb) bool -> (B, steps) long, summing to m per row."""
    m = block_mask_index.sum(dim=1, keepdim=True)  # (B, 1)
    extra = torch.arange(steps, device=m.device)[None, :] < (m % steps)  # (B, steps): the first m % steps steps
    return m // steps + extra.long()


def add_gumbel_noise(logits, temperature, u):
    """Gumbel-max sampling, as the official add_gumbel_noise: argmax of exp(logits) / (-log u)^temperature is a draw
    from softmax(logits / temperature). Float64: low-precision Gumbel-max hurts generation quality (the official
    docstring, arXiv:2409.02908). u: float64 uniforms, the logits' shape, drawn by the caller over the official
    (B, L, V). temperature 0 returns the logits untouched (greedy, in the model's dtype, as the official code)."""
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

    The official code calls torch.topk(confidence[b], k[b]) row by row; one torch.topk at k = max(k), each row's
    first k[b] kept, is exactly that call, ties included, when every row has the same k (as in generate(): each block
    starts fully masked in every row): topk treats each row of a batch as a lone row (on the CPU an introselect whose
    tie order is not "lowest index first": a stable sort would NOT reproduce it). Unequal k: a valid top-k[b] each.
    """
    k_max = int(k.max())
    top = torch.topk(confidence, k_max, dim=-1).indices  # (B, k_max), most confident first
    keep = torch.arange(k_max, device=k.device)[None, :] < k[:, None]  # (B, k_max)
    return torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, top, keep)


def padded_positions(attention_mask):
    """Dream's RoPE positions for a left-padded batch, as its official generation computes them (tok_idx): a real
    token's index among its row's real tokens, cumsum(mask) - 1, and 1 on the pads; None when nothing is padded
    (positions 0 .. L - 1). attention_mask (B, L) or None -> (B, L) long or None."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def cfg_batch(x, attention_mask, prompt_index, cfg_scale, mask_id):
    """Unsupervised classifier-free guidance's input (LLaDA paper, Appendix B; official code): the batch (B, L)
    stacked with a copy whose prompt positions are masked, (2B, L), and its attention mask; as it is without CFG."""
    if cfg_scale <= 0:  # the official test is `if cfg_scale > 0.`
        return x, attention_mask
    un_x = x.masked_fill(prompt_index, mask_id)  # prompt masked: the unconditional input
    return torch.cat([x, un_x]), None if attention_mask is None else torch.cat([attention_mask, attention_mask])


def predicting_states(model, x, attention_mask, cache=None):
    """The final hidden states that predict the tokens at positions s .. e - 1 ((0, L) without a cache span):
    (B, e - s, D) and s. One forward (the wrapper is called, so that DDP / FSDP see it). A model that predicts
    shifted (Dream: model.predicts_shifted) gets its states moved one position right (shift_right, as its official
    generation moves its logits) and, for a left-padded batch, Dream's official positions (padded_positions); LLaDA
    uses positions 0 .. L - 1, as its official sampler. cache: the fast sampler's CacheUse, None for a plain forward."""
    shifted = getattr(unwrap(model), "predicts_shifted", False)
    s, e = (cache.span if cache is not None else None) or (0, x.shape[1])
    # Dream reads token s's prediction at position s - 1, so a span runs from one position earlier: that position's
    # state is computed afresh, seeing the block's current tokens, where a state kept from the step that built the
    # cache would be stale (and the block's first token would keep the prediction of a fully masked block)
    lo = max(s - 1, 0) if shifted else s
    kw = {"position_ids": padded_positions(attention_mask)} if shifted else {}  # (B, L) or None
    if cache is None:
        h = model(x, attention_mask=attention_mask, return_hidden=True, **kw)  # (B, L, D)
    else:
        if cache.attn_rows is not None:  # the model's probe of the queries qs .. qe - 1 (LLaDA.forward)
            kw["attn_rows"] = (cache.attn_rows[0] - lo, cache.attn_rows[1] - lo, cache.attn_rows[2])
        if cache.write:
            kw["kv_write"] = True
        h = model(x[:, lo:e], attention_mask=attention_mask, return_hidden=True, kv_cache=cache.kv, start=lo, **kw)
    return (shift_right(h)[:, s - lo:] if shifted else h), s  # (B, e - s, D)


def guided_logits(model, x, attention_mask, eligible, prompt_index, cfg_scale, mask_id, cache=None):
    """Logits (N, V) at the N eligible positions of x (B, L) (row-major order), each the logits that predict its
    token, with classifier-free guidance when cfg_scale > 0: uncond + (cfg_scale + 1) * (cond - uncond), in the
    logits' dtype, as the official code. The LM head runs on the eligible rows only."""
    x, attention_mask = cfg_batch(x, attention_mask, prompt_index, cfg_scale, mask_id)  # (B or 2B, L)
    h, s = predicting_states(model, x, attention_mask, cache)  # (B or 2B, e - s, D)
    head, rows = unwrap(model).head, eligible[:, s:s + h.shape[1]]
    if cfg_scale <= 0:
        return head(h[rows])  # (N, V)
    B = len(eligible)
    logits, un_logits = head(torch.cat([h[:B][rows], h[B:][rows]], dim=0)).chunk(2, dim=0)
    return un_logits + (cfg_scale + 1) * (logits - un_logits)


def candidates(logits, x, eligible, temperature, remasking, generator, lengths=None):
    """The eligible positions' candidate tokens and their confidence, drawn as the official loop draws them:
    logits (N, V) at the eligible positions of x (B, L) -> x0 (B, L), x with the candidates in (the official
    torch.where(mask_index, x0, x)), and confidence (B, L), -inf where nothing may change. A candidate is the argmax,
    or the Gumbel-max at temperature > 0 with uniforms drawn over the official (B, L, V) float64 (one RNG state, the
    official tokens; per-row generators: each row over its own `lengths` tokens); its confidence its probability
    (low_confidence) or, remasking "random", a float32 uniform."""
    (B, L), V = x.shape, logits.shape[-1]
    u = uniforms((B, L, V), generator, x.device, torch.float64, lengths)[eligible] if temperature else None
    x0 = torch.argmax(add_gumbel_noise(logits, temperature, u), dim=-1)  # (N,)
    if remasking == "low_confidence":
        x0_p = low_confidence(logits, x0)  # (N,)
    else:
        x0_p = uniforms((B, L), generator, x.device, lengths=lengths)[eligible]  # (N,)
    confidence = torch.full((B, L), float("-inf"), dtype=x0_p.dtype, device=x.device)
    return x.masked_scatter(eligible, x0), confidence.masked_scatter(eligible, x0_p)


def check_tensors(prompt, attention_mask, generator, where, model=None, gen_length=0, gen_name="gen_length"):
    """A sampler's tensors, before any forward pass (its options are SamplerOptions' check): a prompt of token ids
    (B, P), an attention mask of its shape, one generator or one per row; with `model`, ids that are rows of its
    embedding, and P + gen_length (the argument gen_name) within its context (a config may leave either out)."""
    if prompt.dim() != 2:
        raise ValueError(f"{where}: prompt must be (batch, prompt_len) token ids, got shape {tuple(prompt.shape)}; "
                         f"use prompt[None] for a single prompt")
    if attention_mask is not None and attention_mask.shape != prompt.shape:
        raise ValueError(f"{where}: attention_mask {tuple(attention_mask.shape)} must have the prompt's shape "
                         f"{tuple(prompt.shape)}")
    if isinstance(generator, (list, tuple)) and len(generator) != len(prompt):
        raise ValueError(f"{where}: {len(generator)} generators for {len(prompt)} rows")
    config = getattr(unwrap(model), "config", None)
    rows, context = getattr(config, "embedding_size", None), getattr(config, "max_sequence_length", None)
    lo, hi = (int(prompt.min()), int(prompt.max())) if prompt.numel() else (0, 0)
    if rows and not (0 <= lo and hi < rows):
        raise ValueError(f"{where}: prompt holds the token id {lo if lo < 0 else hi}, outside the model's vocabulary "
                         f"(ids 0 .. {rows - 1}: config embedding_size {rows})")
    if context and prompt.shape[1] + gen_length > context:
        raise ValueError(f"{where}: the prompt's {prompt.shape[1]} tokens + {gen_name}={gen_length} exceed the model's "
                         f"context (config max_sequence_length {context})")


def finished_rows(x, start, end, stop_ids, mask_id):
    """The early exit's test, (B,) bool: the rows of x (B, L) whose answer (from `start`) holds a stop token before
    `end` with no mask before it. The sampler never changes a token once unmasked, so such a row's text up to its
    first stop is final: the blocks after it cannot change what is read (decode_until_stop)."""
    answer = x[:, start:end]  # (B, n): the finished blocks
    stop = torch.isin(answer, stop_ids)  # (B, n)
    before = stop.int().cumsum(1) == 0  # the positions before the row's first stop
    return stop.any(1) & ~(before & (answer == mask_id)).any(1)


def eos_after_stop(x, start, stop_ids, eos_id):
    """x (B, L) with every answer position (from `start`) after its row's first stop token set to eos_id: what the
    early exit returns, as a model trained on EOS-padded answers (LLaDA's SFT) writes them."""
    stop = torch.isin(x[:, start:], stop_ids).int()  # (B, n)
    x[:, start:][stop.cumsum(1) - stop > 0] = eos_id
    return x


def check_stop_ids(stop_ids, generator, B, draws, where, device):
    """The early exit with random draws (`draws`) on a batch of B > 1 rows needs a generator per row: one generator's
    draws span the batch, so a row leaving would change the draws of the rows beside it. Returns stop_ids as a
    tensor on `device` (or None)."""
    if stop_ids is not None and draws and B > 1 and not isinstance(generator, (list, tuple)):
        raise ValueError(f"{where}: stop_ids (the early exit) with random draws on a batch of {B} rows needs one "
                         "generator per row (a list): one generator's draws span the batch")
    return None if stop_ids is None else torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)


def early_exit(x, live, start, end, stop_ids, mask_id, stats, left):
    """Which rows of `live` (k,) leave before the block that starts at `end` (finished_rows), (k,) bool;
    stats["skipped"] (a dict, or None) gains `left` tokens for each."""
    done = finished_rows(x[live], start, end, stop_ids, mask_id)  # (k,)
    if stats is not None:
        stats["skipped"] = stats.get("skipped", 0) + int(done.sum()) * left
    return done


def take_rows(rows, *values):
    """The rows `rows` (k,) of each value: a tensor (B, ...) or a list of B per-row generators; None and one generator
    (whose draws span the batch) as they are."""
    return [v if v is None or isinstance(v, torch.Generator) else v[rows] if torch.is_tensor(v) else
            [v[r] for r in rows.tolist()] for v in values]


def append_masks(prompt, attention_mask, gen_length, mask_id):
    """The sampler's start: x = the prompt then gen_length masks (B, P + gen_length), and the attention mask
    extended with ones (the answer is attended to)."""
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :prompt.shape[1]] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(prompt.shape[0], gen_length)], dim=1)
    return x, attention_mask


def check_block_arguments(said, gen_length, steps, block_length, temperature, cfg_scale, remasking, schedule=True):
    """The block sampler's arguments, each rule once (SamplerOptions runs this too): a ValueError naming the first
    bad one as said(name) puts it. Lengths whole numbers >= 1 and, with `schedule`, once all three are set, the
    official generate()'s block schedule; temperature and cfg_scale finite and >= 0; an official remasking."""
    for key, value in (("gen_length", gen_length), ("steps", steps), ("block_length", block_length)):
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
            raise ValueError(f"{said(key)}: expected an integer")
        if value is not None and value < 1:
            raise ValueError(f"{said(key)}: must be at least 1")
    for key, value in (("temperature", temperature), ("cfg_scale", cfg_scale)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"{said(key)}: expected a number")
        if not 0 <= value < math.inf:
            raise ValueError(f"{said(key)}: must be 0 (" + ("greedy" if key == "temperature" else "off") +
                             ") or more, a finite number")
    if remasking not in REMASKING:
        raise ValueError(f"{said('remasking')}; expected one of {REMASKING}")
    if not schedule or None in (gen_length, steps, block_length):
        return
    if block_length > gen_length:
        raise ValueError(f"{said('block_length')} is longer than {said('gen_length')}")
    n_blocks = gen_length // block_length
    if gen_length % block_length or steps % n_blocks:  # the official generate() asserts both
        hint = (f"steps {n_blocks * max(1, steps // n_blocks)}" if gen_length % block_length == 0 else
                f"block length {gen_length} (one block)")
        raise ValueError(f"{said('gen_length')} must be a multiple of {said('block_length')}, and {said('steps')} a "
                         f"multiple of the number of blocks {n_blocks}; e.g. {hint}")


@torch.no_grad()
def generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128, temperature=0.,
             cfg_scale=0., remasking="low_confidence", mask_id=None, generator=None, stop_ids=None, stats=None):
    """LLaDA's official generate(), batched: the same arguments, random draws and tokens. Returns x
    (B, prompt_len + gen_length), prompt included.

    model: called as model(x, attention_mask=..., return_hidden=True) -> (B, L, D), with the LM head at
        unwrap(model).head; in eval mode (LoRA dropout). A Dream model (model.predicts_shifted) is sampled the same
        way, each token read from the logits that predict it (position i - 1), as its generation code shifts them.
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
        draws each row's noise from its own, over its own tokens, not its left padding (uniforms' lengths): a row's
        tokens then do not depend on its batch.
    stop_ids: the token ids that end an answer (turn end, EOS; stop_ids(tokenizer)), or None: the official loop.
        Given (the early exit), a row leaves the batch before a block once the blocks before hold its first stop
        token with no mask before it (finished_rows: its text up to there is final), the loop ends when every row
        has left, and each row's ids after its first stop come back as EOS: the same text up to the stop as without
        (in float32 a smaller batch may round otherwise: README). With random draws on a batch, one generator per
        row (one generator's draws span the batch: a row leaving would change the others').
    stats: a dict, or None; stats["skipped"] gains the answer tokens the early exit did not sample.
    """
    mask_id = unwrap(model).config.mask_token_id if mask_id is None else mask_id
    given = dict(gen_length=gen_length, steps=steps, block_length=block_length, temperature=temperature,
                 cfg_scale=cfg_scale, remasking=remasking)
    check_block_arguments(lambda key: f"sample.py generate: {key}={given[key]!r}", **given)
    check_tensors(prompt, attention_mask, generator, "sample.py generate", model, gen_length)
    stop_ids = check_stop_ids(stop_ids, generator, len(prompt), temperature > 0 or remasking == "random",
                              "sample.py generate", prompt.device)
    x, attention_mask = append_masks(prompt, attention_mask, gen_length, mask_id)  # (B, L), (B, L) or None
    prompt_index = x != mask_id  # what CFG masks: every non-mask token at the start, left pads included
    positions = torch.arange(x.shape[1], device=x.device)  # (L,)

    num_blocks = gen_length // block_length
    steps = steps // num_blocks  # per block, as in the official code
    live, out = torch.arange(len(x), device=x.device), x  # the rows still sampled: all, but for the early exit
    for num_block in range(num_blocks):
        block_end = prompt.shape[1] + (num_block + 1) * block_length
        if stop_ids is not None:  # the early exit: rows whose text up to their first stop is final leave the batch
            live = live[~early_exit(out, live, prompt.shape[1], block_end - block_length, stop_ids, mask_id, stats,
                                    (num_blocks - num_block) * block_length)]
            if not len(live):
                break
        x, mask_b, prompt_index_b, generator_b = take_rows(live, out, attention_mask, prompt_index, generator)  # live
        lengths_b = None if mask_b is None else mask_b.sum(1).tolist()  # each row's own tokens, its pads not
        block_mask_index = x[:, block_end - block_length:block_end] == mask_id  # (B, block_length)
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)  # (B, steps)
        for i in range(steps):
            mask_index = x == mask_id  # (B, L)
            # the official confidence is -inf after the block and where x is no mask: only these N positions can
            # change (masks left in earlier blocks included), so the LM head runs only there
            eligible = mask_index & (positions < block_end)  # (B, L)
            logits = guided_logits(model, x, mask_b, eligible, prompt_index_b, cfg_scale, mask_id)  # (N, V)
            # candidates and their confidence, drawn as the official loop draws them
            x0, confidence = candidates(logits, x, eligible, temperature, remasking, generator_b, lengths_b)  # (B, L)

            # the k most confident positions take their candidates (the official transfer_index); a candidate
            # equal to mask_id leaves its position masked, and eligible again at the next step, as officially
            transfer = transfer_index(confidence, num_transfer_tokens[:, i])  # (B, L) bool
            x[transfer] = x0[transfer]
        out[live] = x
    if stop_ids is not None:
        eos_after_stop(out, prompt.shape[1], stop_ids, unwrap(model).config.eos_token_id)
    return out


# =============================================================================
# The options of every sampler (SamplerOptions), the fast sampler, Dream's own sampler, the command line
# =============================================================================

import argparse
import difflib
import json
from dataclasses import InitVar, dataclass, field, fields, replace
from pathlib import Path

from data import (EOS, EOT, IM_END, chat_format, chat_prompt, check_chat_tokens, check_mask_token, encode_text,
                  load_tokenizer)
from longjob import (SEED_RULE, SEEDS, add_dataclass_flags, add_dtype_flag, add_model_flags, check_adapter,
                     compute_dtype, find_model, load_weights, loading, run_command_line)
from model import GENERATION_DEFAULTS, LLaDAConfig, generation_defaults


CACHES = (None, "prefix", "dual")  # generate_cached's key/value caches (None: no cache)
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")  # Dream's diffusion_generate
SAMPLERS = ("block", "dream")  # generate / generate_cached, or diffusion_generate (SamplerOptions.sampler)
# the options only one of them reads: a flag of the other's is refused (check_sampler_choice)
BLOCK_ONLY = ("block_length", "cfg_scale", "remasking", "cache", "threshold", "cache_refresh", "cache_drift",
              "cache_window", "early_exit")
DREAM_ONLY = ("alg", "alg_temp", "eps", "top_p", "top_k")
BLOCK_ARGUMENTS = ("gen_length", "steps", "block_length", "temperature", "cfg_scale", "remasking")  # generate()'s own


@dataclass
class SamplerOptions:
    """How to sample an answer: which sampler (`sampler`: "block", generate() or the fast generate_cached(), for
    either family; "dream", Dream's own diffusion_generate()) and its arguments, declared once for the library call
    and for the flags of sample.py and eval.py (--gen-length, ..., --top-k).

    A field that no flag gives is taken from the model folder's generation_defaults.json when it names it (a Dream
    folder's {"sampler": "dream", "alg": "entropy"} makes Dream's sampler its default); the lengths still unset
    (None) are then filled in by whoever samples: sample.py with its own defaults, eval.py with d1's protocol for the
    task; generate_cached needs them set. Dream's sampler reads gen_length (its max_new_tokens), steps, temperature
    and its own options (alg ... top_k); a flag of the other sampler's options is refused (check_sampler_choice).
    What each fast-sampler option does, in more words: docs/samplers.md.
    """
    gen_length: int = field(default=None, metadata={"help": "tokens to generate; unset: the model folder's "
                            "generation_defaults.json (sample.py: else 128; eval.py: else d1's 512 for Sudoku / "
                            "Countdown, 256 for GSM8K / MATH500)"})
    steps: int = field(default=None, metadata={"help": "sampling steps in all, split evenly over the blocks; unset: "
                       "the model folder's, else gen-length (sample.py) or gen-length / 2 (eval.py, d1)"})
    block_length: int = field(default=None, metadata={"help": "semi-autoregressive block length; unset: the model "
                              "folder's, else min(32, gen-length) (sample.py) or 32 (eval.py, d1)"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (d1's protocol); > 0 samples with "
                               "float64 Gumbel noise (--sampler dream: from softmax(logits / temperature))"})
    cfg_scale: float = field(default=0.0, metadata={"help": "unsupervised classifier-free guidance scale (0 = off)"})
    remasking: str = field(default="low_confidence", metadata={"help": "remasking strategy (d1's protocol: "
                           "low_confidence)", "choices": REMASKING})
    cache: str = field(default=None, metadata={"help": "fast sampler: Fast-dLLM's key/value cache (none, without "
                       "--threshold: the exact sampler, the paper's numbers)", "choices": ("none", "prefix", "dual")})
    threshold: float = field(default=None, metadata={"help": "fast sampler: unmask every token more confident than "
                             "this (parallel decoding; e.g. 0.9)"})
    cache_refresh: int = field(default=None, metadata={"help": "fast sampler: rebuild the --cache every N steps "
                               "inside a block (unset: at its first only)"})
    cache_drift: float = field(default=None, metadata={"help": "fast sampler: also rebuild a row's --cache when its "
                             "attention drifts (Elastic-Cache's test: cosine similarity below this, e.g. 0.9)"})
    cache_window: int = field(default=None, metadata={"help": "fast sampler: a --cache rebuild after the first block "
                              "recomputes only the positions within this many tokens of the block, the rest reused "
                              "(unset: the whole sequence; e.g. the block length)"})
    early_exit: bool = field(default=None, metadata={"help": "block samplers: a row stops once a finished block "
                             "holds its first turn end or EOS with nothing masked before it (its text up to there is "
                             "final), the rest returned as EOS: the same answers, fewer steps. Unset: on where answers "
                             "are cut at the turn end (eval.py, the harness, sample.py); --no-early-exit: every block, "
                             "as the official generate"})
    sampler: str = field(default="block", metadata={"help": "block: the block low-confidence sampler above, for "
                         "either family (the paper's evaluation protocol, Appendix C); dream: Dream's own "
                         "diffusion_generate (a Dream model only; its options --alg ... --top-k)", "choices": SAMPLERS})
    alg: str = field(default="origin", metadata={"help": "--sampler dream: which masks to unmask (origin: each at "
                     "random; the others: the most confident first)", "choices": DREAM_ALGS})
    alg_temp: float = field(default=None, metadata={"help": "--sampler dream: > 0 draws the positions to unmask from "
                            "softmax(confidence / alg_temp) (unset: the most confident)"})
    eps: float = field(default=1e-3, metadata={"help": "--sampler dream: the last time of the reverse process "
                       "(Dream's own eps; not training's floor on t)"})
    top_p: float = field(default=None, metadata={"help": "--sampler dream: nucleus filter of the logits (unset: off)"})
    top_k: int = field(default=None, metadata={"help": "--sampler dream: keep the k largest logits (unset: off)"})

    # who gave the values, as a refusal names them (check_sampler_options): None a library call, "flags" a command
    # line, else a file's path; not a field (no flag, not in asdict), so dataclasses.replace needs it given again
    source: InitVar[str | None] = None

    def __post_init__(self, source):
        check_sampler_options(self, source)  # every option checked here, whoever builds the options

    @property
    def exact(self):
        """True when these options ask for the exact block sampler, generate() (no cache, no threshold)."""
        return self.sampler == "block" and self.cache is None and self.threshold is None


@dataclass
class CacheUse:
    """How one forward of the fast sampler uses its key/value cache (guided_logits): `kv`, an empty list, is filled
    with the keys and values of this forward; a filled one with span = (s, e) runs only positions s .. e - 1
    (eligible must lie inside them). attn_rows: (qs, qe, rows), the model's probe (LLaDA.forward) of the queries at
    positions qs .. qe - 1 of the sequence. write: the span's keys and values also replace the cached ones (a
    windowed refresh, SamplerOptions.cache_window)."""
    kv: list
    span: tuple = None
    attn_rows: tuple = None
    write: bool = False


def check_arguments(where, renamed=(), **values):
    """A library call's sampler arguments, checked as SamplerOptions checks every option: a ValueError naming the call
    `where` and its own argument names (renamed: (SamplerOptions field, the call's name) pairs)."""
    try:
        return SamplerOptions(**values)
    except ValueError as e:
        message = str(e)
        for ours, theirs in renamed:
            message = message.replace(f"{ours}=", f"{theirs}=")
        raise ValueError(f"{where}: {message}") from None


# -----------------------------------------------------------------------------
# The fast sampler (Fast-dLLM, arXiv 2505.22618): key/value cache and confidence-threshold parallel decoding


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


def rebuild_rows(model, x, attention_mask, prompt_index, cfg_scale, mask_id, kv_cache, rows):
    """Recompute the cached keys and values of the rows (B,) bool with a full forward of those rows alone, written
    into kv_cache in place (under classifier-free guidance, their unconditional copies B + r too)."""
    idx = rows.nonzero().squeeze(1)  # (k,)
    fresh, none = [], torch.zeros_like(x[idx], dtype=torch.bool)  # no logits are needed
    guided_logits(model, x[idx], None if attention_mask is None else attention_mask[idx], none, prompt_index[idx],
                  cfg_scale, mask_id, CacheUse(fresh))
    if cfg_scale > 0:
        idx = torch.cat([idx, idx + len(x)])
    for (k, v), ((k_new, v_new),) in zip((layer[0] for layer in kv_cache), fresh):
        k[idx], v[idx] = k_new, v_new


@torch.no_grad()
def generate_cached(model, prompt, attention_mask=None, options=None, generator=None, mask_id=None,
                    refresh_cache_every_step=False, stop_ids=None, stats=None):
    """generate() made faster after Fast-dLLM (Wu et al. 2025, arXiv 2505.22618), at the cost of exactness: a
    key/value cache (options.cache), confidence-threshold parallel decoding (options.threshold), and a cache rebuilt
    on a schedule (options.cache_refresh) or when attention drifts (options.cache_drift); SamplerOptions says what
    each does. options: a SamplerOptions with gen_length, steps and block_length set. The other arguments and the
    random draws are generate()'s; options with cache=None and threshold=None give generate()'s tokens.
    refresh_cache_every_step: rebuild the cache at every step (a check: the exact sampler's tokens as long as every
        block ends fully unmasked; tests/test_sample_eval_refusals.py shows both cases).
    stop_ids, stats: generate()'s early exit (a row leaves before a block, its keys and values with it).
    """
    o = options or SamplerOptions()  # checked when built
    if None in (o.gen_length, o.steps, o.block_length):
        raise ValueError(f"sample.py generate_cached: options.gen_length ({o.gen_length}), steps ({o.steps}) and "
                         f"block_length ({o.block_length}) must be set; e.g. SamplerOptions(gen_length=128, steps=128, "
                         "block_length=32, cache='dual')")
    check_tensors(prompt, attention_mask, generator, "sample.py generate_cached", model, o.gen_length)
    stop_ids = check_stop_ids(stop_ids, generator, len(prompt), o.temperature > 0 or o.remasking == "random",
                              "sample.py generate_cached", prompt.device)
    mask_id = unwrap(model).config.mask_token_id if mask_id is None else mask_id
    x, attention_mask = append_masks(prompt, attention_mask, o.gen_length, mask_id)  # (B, L), (B, L) or None
    prompt_index = x != mask_id
    B, L = x.shape
    positions = torch.arange(L, device=x.device)

    num_blocks = o.gen_length // o.block_length
    steps = o.steps // num_blocks  # per block
    kv_cache = None  # built at the first block's first step; rebuilt (or, cache_window, updated) at a block's first
    live, out = torch.arange(B, device=x.device), x  # the rows still sampled: all, but for the early exit
    for num_block in range(num_blocks):
        block_start = prompt.shape[1] + num_block * o.block_length
        block_end = block_start + o.block_length
        if stop_ids is not None:  # generate()'s early exit
            done = early_exit(out, live, prompt.shape[1], block_start, stop_ids, mask_id, stats,
                              (num_blocks - num_block) * o.block_length)
            live = live[~done]
            if not len(live):
                break
            if o.cache_window is not None and kv_cache is not None and done.any():  # kept across blocks: live rows'
                keep = (~done).nonzero().squeeze(1)
                keep = torch.cat([keep, keep + len(done)]) if o.cfg_scale > 0 else keep  # CFG's rows: [cond; uncond]
                kv_cache = [[(k[keep], v[keep]) for k, v in layer] for layer in kv_cache]
        x, mask_b, prompt_index_b, generator_b = take_rows(live, out, attention_mask, prompt_index, generator)  # live
        lengths_b = None if mask_b is None else mask_b.sum(1).tolist()  # each row's own tokens, its pads not
        B = len(x)
        num_transfer_tokens = get_num_transfer_tokens(x[:, block_start:block_end] == mask_id, steps)  # (B, steps)
        # without a cache, generate()'s eligible positions; a cached step sees the current block only
        in_block = positions < block_end if o.cache is None else (positions >= block_start) & (positions < block_end)
        drifted, tracked, reference = None, None, None
        for i in range(steps if o.threshold is None else o.block_length):
            eligible = (x == mask_id) & in_block  # (B, L), N True in all
            if o.threshold is not None and not eligible.any():
                break  # parallel decoding: the block is done early
            full = i == 0 or (o.cache_refresh is not None and i % o.cache_refresh == 0)  # this step rebuilds the cache
            windowed = (o.cache is not None and full and o.cache_window is not None and kv_cache is not None
                        and not refresh_cache_every_step)  # rebuild the window's keys and values only
            span = None
            if windowed:
                span = (max(block_start - o.cache_window, 0),
                        L if o.cache == "prefix" else min(block_end + o.cache_window, L))
            elif o.cache is not None and (full or refresh_cache_every_step):
                kv_cache = []  # a full forward stores every position's keys and values
                if refresh_cache_every_step:  # fill it now; this step then reads it as a later step does
                    guided_logits(model, x, mask_b, eligible, prompt_index_b, o.cfg_scale, mask_id,
                                  CacheUse(kv_cache))
            elif drifted is not None and drifted.any():  # the drift test fired for these rows at the last step
                rebuild_rows(model, x, mask_b, prompt_index_b, o.cfg_scale, mask_id, kv_cache, drifted)
            reads_cache = o.cache is not None and (not full or refresh_cache_every_step)
            span = (block_start, block_end if o.cache == "dual" else L) if reads_cache else span
            # the drift test watches the block's own queries (for Dream too, whose span starts one position earlier)
            rows = None if o.cache_drift is None else (block_start, block_end, [])
            cache = None if kv_cache is None else CacheUse(kv_cache, span, rows, windowed)
            logits = guided_logits(model, x, mask_b, eligible, prompt_index_b, o.cfg_scale, mask_id,
                                   cache)  # (N, V)
            if rows is not None:
                attn = torch.stack(rows[2])[:, :B]  # the conditional rows' attention, (n_layers, B, Lb, L)
                built = torch.full((B,), full, device=x.device) if drifted is None or full else drifted
                drifted, tracked, reference = attention_drift(attn, built, tracked, reference, o.cache_drift,
                                                              block_start)
            x0, confidence = candidates(logits, x, eligible, o.temperature, o.remasking, generator_b, lengths_b)

            # generate()'s k most confident positions, or (threshold) every position above it and at least the
            # most confident one
            if o.threshold is None:
                transfer = transfer_index(confidence, num_transfer_tokens[:, i])
            else:
                transfer = transfer_index(confidence, eligible.any(1).long()) | (eligible & (confidence > o.threshold))
            x = torch.where(transfer, x0, x)
        out[live] = x
    if stop_ids is not None:
        eos_after_stop(out, prompt.shape[1], stop_ids, unwrap(model).config.eos_token_id)
    return out


def generate_with_options(model, prompt, attention_mask=None, options=None, generator=None, stop_ids=None, stats=None):
    """Sample with `options` (lengths set): generate(), the exact sampler, when they ask for no cache and no threshold;
    generate_cached() otherwise; Dream's diffusion_generate() with sampler "dream" (its generator: one
    torch.Generator, as its draws span the batch). (B, P + gen_length). stop_ids, stats: the block samplers' early
    exit, unless options.early_exit is False (stop_ids None: off)."""
    o = options or SamplerOptions()
    if o.sampler == "dream" and o.early_exit:
        raise ValueError("sample.py: early_exit with sampler 'dream': Dream's diffusion_generate has no blocks, so no "
                         "part of an answer is final before the last step; use the block sampler, or drop early_exit")
    stop_ids = None if o.early_exit is False else stop_ids
    if o.sampler == "dream":
        return diffusion_generate(model, prompt, attention_mask, max_new_tokens=o.gen_length, steps=o.steps,
                                  eps=o.eps, alg=o.alg, alg_temp=o.alg_temp, temperature=o.temperature,
                                  top_p=o.top_p, top_k=o.top_k, generator=generator)
    if not o.exact:
        return generate_cached(model, prompt, attention_mask, o, generator, stop_ids=stop_ids, stats=stats)
    return generate(model, prompt, attention_mask=attention_mask, steps=o.steps, gen_length=o.gen_length,
                    block_length=o.block_length, temperature=o.temperature, cfg_scale=o.cfg_scale,
                    remasking=o.remasking, generator=generator, stop_ids=stop_ids, stats=stats)


# -----------------------------------------------------------------------------
# Dream's sampler (Dream-v0, github.com/HKUNLP/Dream, generation_utils.py): the official diffusion_generate


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

    The official method called without a generation_config inherits temperature 1.0 and top_k 50 from
    Hugging Face's defaults; ours takes what it is given, greedy by default (docs/samplers.md).
    """
    module = unwrap(model)  # under DDP the config and head are the wrapped module's
    where = "sample.py diffusion_generate"
    if not module.predicts_shifted:
        raise ValueError(f"{where}: the model is not Dream (config model_type {module.config.model_type!r}), whose "
                         f"logits at i - 1 predict token i; LLaDA's sampler is generate()")
    check_arguments(where, [("gen_length", "max_new_tokens")], sampler="dream", gen_length=max_new_tokens, steps=steps,
                    eps=eps, alg=alg, alg_temp=alg_temp, temperature=temperature, top_p=top_p, top_k=top_k)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"{where}: generator must be one torch.Generator or None, got {type(generator).__name__}: "
                         f"the official draws span the whole batch (one uniform per mask), not one row each")
    check_tensors(prompt, attention_mask, None, where, model, max_new_tokens, "max_new_tokens")
    mask_id, head = module.config.mask_token_id, module.head
    x = F.pad(prompt, (0, max_new_tokens), value=mask_id)  # (B, L), L = P + max_new_tokens
    if attention_mask is not None:
        attention_mask = F.pad(attention_mask, (0, max_new_tokens), value=1)  # (B, L): the answer is attended to
    position_ids = padded_positions(attention_mask)  # (B, L), or None without a pad
    attention_mask = None if position_ids is None else attention_mask  # no pad: the official "full" attention
    timesteps = torch.linspace(1, eps, steps + 1, device=x.device)  # float32, as officially

    for i in range(steps):
        t, s, last = timesteps[i], timesteps[i + 1], i == steps - 1
        mask_index = x == mask_id  # (B, L)
        h = model(x, attention_mask=attention_mask, position_ids=position_ids, return_hidden=True)  # (B, L, D)
        h = shift_right(h)[mask_index]  # (N, D): the state predicting each mask, row-major

        if alg == "origin":
            # every mask independently with probability 1 - s/t: one uniform per mask of the batch
            transfer = uniforms(h.shape[:1], generator, x.device) < (1 if last else 1 - s / t)  # (N,) bool
            x0 = torch.full_like(x[mask_index], mask_id)  # (N,): the others stay masked
            x0[transfer] = sample_tokens(head(h[transfer]), temperature, top_p, top_k, generator)[1]
            x[mask_index] = x0
            continue

        probs, x0 = sample_tokens(head(h), temperature, top_p, top_k, generator)  # (N, V), (N,)
        maskgit_step(x, mask_index, dream_confidence(probs, x0, alg), x0, dream_num_transfer(mask_index, t, s, last),
                     alg_temp, generator, mask_id)
    return x


# -----------------------------------------------------------------------------
# The sampler's flags, shared by both command lines (sample.py's and eval.py's): one flag per SamplerOptions field


def add_sampler_flags(parser):
    """--gen-length ... --cache-drift on `parser`, one per SamplerOptions field, each None when not given."""
    add_dataclass_flags(parser, SamplerOptions)


def options_of(values, source):
    """The SamplerOptions of `values` ({name: value}, flags or a file's fields: the keys that name a field and are
    not None; "cache": "none" is None), checked with `source` named (SamplerOptions.source)."""
    given = {f.name: values[f.name] for f in fields(SamplerOptions) if values.get(f.name) is not None}
    if given.get("cache") == "none":
        given["cache"] = None
    return SamplerOptions(**given, source=source)


def with_lengths(options, gen_length, block_length, tokens_per_step, source=None):
    """The options with their unset lengths filled in (the one rule of sample.py's, eval.py's d1 protocol and
    GiftLM's): gen_length, block_length (at most gen_length), steps = gen_length / tokens_per_step in whole blocks
    (at least one per block). source: who gave them, as SamplerOptions names it in a refusal."""
    gen = options.gen_length or gen_length
    block = options.block_length or min(block_length, gen)
    blocks = max(1, gen // block)
    steps = options.steps or max(blocks, gen // tokens_per_step // blocks * blocks)
    return replace(options, gen_length=gen, steps=steps, block_length=block, source=source)


def options_from_flags(args, defaults=None):
    """The SamplerOptions the parsed flags give; a field no flag gives comes from `defaults` (the model folder's
    generation_defaults.json), else keeps its default."""
    return options_of((defaults or {}) | {k: v for k, v in vars(args).items() if v is not None}, "flags")


def check_sampler_options(o, source=None):
    """The one check of every sampler option, run where SamplerOptions is built (__post_init__), before any slow work:
    a ValueError in one line naming the option as its `source` gave it: None = a library call (`threshold=1.5`),
    "flags" = a command line (`--threshold 1.5`), a file's path (`PATH: field 'threshold' = 1.5`). Types, choices,
    ranges, the options that need a cache, and the lengths against each other once all three are set (lengths left
    unset are each command line's to fill in)."""
    def said(key):
        value = getattr(o, key)
        return (f"{key}={value!r}" if source is None else f"--{key.replace('_', '-')} {value}" if source == "flags"
                else f"{source}: field {key!r} = {json.dumps(value)}")

    check_block_arguments(said, o.gen_length, o.steps, o.block_length, o.temperature, o.cfg_scale, o.remasking,
                          schedule=o.sampler == "block")  # Dream's own sampler has no blocks
    kinds = {"int": (numbers.Integral, "an integer"), "float": (numbers.Real, "a number"), "str": (str, "a string"),
             "bool": (bool, "true or false")}
    for f in (f for f in fields(o) if f.name not in BLOCK_ARGUMENTS):
        value, (kind, what) = getattr(o, f.name), kinds[getattr(f.type, "__name__", f.type)]
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)):
            raise ValueError(f"{said(f.name)}: expected {what}")
    for key, choices in dict(sampler=SAMPLERS, cache=CACHES, alg=DREAM_ALGS).items():
        if getattr(o, key) not in choices:
            where = said(key) if source in (None, "flags") else f"{source}: {key} {getattr(o, key)!r}"
            raise ValueError(f"{where}; expected one of {choices}")
    if o.top_k is not None and o.top_k < 1:
        raise ValueError(f"{said('top_k')}: must be at least 1")
    if o.threshold is not None and not 0 <= o.threshold < 1:
        raise ValueError(f"{said('threshold')}: a confidence in [0, 1)")
    if o.alg_temp is not None and not 0 <= o.alg_temp < math.inf:
        raise ValueError(f"{said('alg_temp')}: must be 0 (off) or more, a finite number")
    if o.cache_refresh is not None and (o.cache is None or not isinstance(o.cache_refresh, int) or o.cache_refresh < 1):
        raise ValueError(f"{said('cache_refresh')}: a number of steps >= 1, with --cache prefix or dual")
    if o.cache_drift is not None and (o.cache is None or not 0 < o.cache_drift <= 1):
        raise ValueError(f"{said('cache_drift')}: a cosine similarity in (0, 1], with --cache prefix or dual")
    if o.cache_window is not None and (o.cache is None or o.cache_window < 1):
        raise ValueError(f"{said('cache_window')}: a whole number of tokens >= 1 (the block length recomputes the "
                         "block just finished), with --cache prefix or dual")
    if not 0 < o.eps < 1:
        raise ValueError(f"{said('eps')}: the reverse process's last time, in (0, 1) (Dream's default 1e-3)")
    if o.top_p is not None and not 0 < o.top_p <= 1:
        raise ValueError(f"{said('top_p')}: a probability in (0, 1]")


def check_step_count(o, given=True, source=None):
    """No more steps than tokens (o's lengths set; `given`: whether the steps were asked for, by a flag or the file
    `source`; a folder's steps kept under a shorter --gen-length are left as they were): the steps beyond one per
    token place nothing and only repeat forward passes. A ValueError in one line."""
    if given and o.steps is not None and o.gen_length is not None and o.steps > o.gen_length:
        where = "--steps" if source is None else f"{source}: field 'steps' ="
        raise ValueError(f"{where} {o.steps}: more steps than the {o.gen_length} tokens to generate (the gen length); "
                         f"the steps beyond one per token place none and only repeat forward passes: use at most "
                         f"{o.gen_length}")


def check_lengths(o, folder):
    """--gen-length against the model folder's context (config.json), before the weights load: a ValueError in one
    line (the lengths against each other are SamplerOptions' own check)."""
    context = LLaDAConfig.from_json(Path(folder) / "config.json").max_sequence_length
    if o.gen_length >= context:
        raise ValueError(f"--gen-length {o.gen_length} leaves no room for a prompt in the model's "
                         f"max_sequence_length {context} ({Path(folder) / 'config.json'})")


def check_sampler_choice(args, o, folder):
    """--sampler against the other flags and the model, once the folder's settings are in `o`: a flag of the sampler
    not chosen is refused, and Dream's sampler on a model that is not Dream. A ValueError in one line."""
    unread = [n for n in (BLOCK_ONLY if o.sampler == "dream" else DREAM_ONLY) if getattr(args, n) is not None]
    if unread:
        flags = " ".join("--" + n.replace("_", "-") for n in unread)
        raise ValueError(f"{flags}: not read by the {o.sampler} sampler" + ("" if o.sampler == "dream" else
                                                                            "; Dream's sampler is --sampler dream"))
    if o.sampler != "dream":
        return
    config = LLaDAConfig.from_json(Path(folder) / "config.json")
    if not config.predicts_shifted:
        where = "" if args.sampler else f" (the sampler {Path(folder) / 'generation_defaults.json'} names)"
        raise ValueError(f"--sampler dream{where}: Dream's own sampler needs a Dream model, and {folder} is "
                         f"{config.model_type or 'llada'}; use --sampler block")


# -----------------------------------------------------------------------------
# What --model and --adapter name, checked by both command lines before the model loads (not needed to sample)

FOLDER_TEXT_FIELDS = ("task", "prompt_style", "test_data")  # generation_defaults.json's fields besides the sampler's


def folder_defaults(folder):
    """The model folder's generation_defaults.json ({} when it has none), checked: a JSON object of SamplerOptions'
    fields and FOLDER_TEXT_FIELDS, nothing else (a misspelt key is refused, not ignored), the former with
    SamplerOptions' types, choices and ranges (check_sampler_options), the latter strings; a ValueError naming the file
    and the field."""
    path, defaults = Path(folder) / GENERATION_DEFAULTS, generation_defaults(folder)  # a JSON object (read_json)
    known = [f.name for f in fields(SamplerOptions)] + list(FOLDER_TEXT_FIELDS)
    if unknown := [name for name in defaults if name not in known]:
        close = difflib.get_close_matches(unknown[0], known, 1)
        raise ValueError(f"{path}: field {unknown[0]!r} is not a generation setting"
                         + (f" (did you mean {close[0]!r}?)" if close else "") + f"; the settings: {', '.join(known)}")
    for name in FOLDER_TEXT_FIELDS:
        if defaults.get(name) is not None and not isinstance(defaults[name], str):
            raise ValueError(f"{path}: field {name!r} = {json.dumps(defaults[name])}: expected a string")
    check_step_count(options_of(defaults, path), source=path)  # SamplerOptions checks the rest
    return defaults


# -----------------------------------------------------------------------------
# Command line: chat with or complete from a checkpoint


def stop_ids(tokenizer):
    """The ids that end an answer: the turn end (<|eot_id|>, ChatML's <|im_end|>) and <|endoftext|> (answers end in a
    turn end, then EOS pads), those the tokenizer has."""
    return sorted({tokenizer.token_to_id(t) for t in (EOT, IM_END, EOS)} - {None})


def decode_until_stop(tokenizer, ids):
    """Text of the generated ids up to the first stop_ids token: the answer, as sample.py and GiftLM read it."""
    stops = set(stop_ids(tokenizer))
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=False)


def make_parser():
    """sample.py's flags: the model, the prompt, the sampler's (add_sampler_flags), the device."""
    p = argparse.ArgumentParser(description="Generate from a LLaDA or Dream model (its chat format from its tokenizer) "
                                "with the block diffusion sampler, or Dream's own (--sampler dream).")
    add_model_flags(p)
    p.add_argument("--prompt", default=None, help="the user message; without it, chat interactively on stdin (/reset "
                   "clears the conversation)")
    p.add_argument("--raw", action="store_true", help="complete the prompt text as is, without the chat template")
    add_sampler_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    add_dtype_flag(p)
    return p


def parse_args(argv=None):
    """sample.py's flags, checked before the model loads (a one-line error naming the flag), and the SamplerOptions
    they give, the fields not given taken from the model folder's generation_defaults.json (options_from_flags) and
    the lengths still unset from with_lengths. Returns (args, options); args gains .folder, the model folder, and
    .adapter, the flag's or the checkpoint's."""
    p = make_parser()
    args = p.parse_args(argv)
    try:
        options_from_flags(args)  # the flags' values, checked (SamplerOptions)
    except ValueError as e:
        p.error(str(e))
    if args.seed not in SEEDS:
        p.error(f"--seed {args.seed}: must be {SEED_RULE}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device; use --device cpu")

    try:
        args.folder, adapter = find_model(args.model)
        defaults = folder_defaults(args.folder)  # what the model was trained to answer with (the embedded task's)
        options = options_from_flags(args, defaults)
        check_sampler_choice(args, options, args.folder)
        options = with_lengths(options, 128, 32, 1, "flags")  # unset: 128 tokens, one per step, blocks of 32
        folder_steps = args.steps is None and args.gen_length is None and "steps" in defaults  # against the default
        check_step_count(options, args.steps is not None or folder_steps,  # the lengths filled in
                         Path(args.folder) / GENERATION_DEFAULTS if folder_steps else None)
        check_lengths(options, args.folder)
        args.adapter = args.adapter or adapter
        check_adapter(args.folder, args.adapter)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    return args, options


def load_model(args, options=None):
    """The model in eval mode (LoRA dropout off), its adapter loaded, on --device in --dtype; and its tokenizer. The
    tokenizer is checked against config.json (chat tokens, ids within the embedding) and, with `options`, --prompt's
    length against the context, before the weights load."""
    dtype = compute_dtype(args.dtype, args.device)  # auto: bf16 on a GPU, float32 on the CPU
    with loading(args.folder, args.adapter):
        tokenizer = load_tokenizer(args.folder)
        config = LLaDAConfig.from_json(Path(args.folder) / "config.json")
    if not args.raw:
        check_chat_tokens(tokenizer, args.folder, hint="; complete the text as is with --raw")
    check_mask_token(tokenizer, config)
    if options is not None and args.prompt is not None:
        text = args.prompt if args.raw else chat_prompt([{"role": "user", "content": args.prompt}],
                                                        chat_format(tokenizer))
        try:  # the prompt's own line, as main() says it after the model loads
            check_context(len(encode_text(tokenizer, text)), options.gen_length, config.max_sequence_length)
        except ValueError as e:
            raise SystemExit(f"sample.py: {e}") from None
    model = load_weights(args.folder, args.adapter, dtype, args.device).eval()
    return model, tokenizer


class ContextFull(ValueError):
    """A prompt that leaves no room for the answer in the model's context (the chat then starts over)."""


def check_context(n_prompt, gen_length, context):
    """ContextFull when a prompt of n_prompt tokens and gen_length answer tokens exceed the model's context."""
    if n_prompt + gen_length > context:
        raise ContextFull(f"the prompt of {n_prompt} tokens + --gen-length {gen_length} exceed the model's "
                          f"max_sequence_length {context}")


def main(argv=None):
    args, options = parse_args(argv)
    model, tokenizer = load_model(args, options)  # a --prompt too long for the context is said before the weights load
    fmt = chat_format(tokenizer)  # LLaDA's template, or ChatML for Dream's tokenizer
    generator = torch.Generator(args.device).manual_seed(args.seed)

    def reply(text):
        ids = encode_text(tokenizer, text)  # the chat text carries its own special tokens; nothing is added
        check_context(len(ids), options.gen_length, model.config.max_sequence_length)
        prompt = torch.tensor([ids], dtype=torch.long, device=args.device)  # (1, P)
        out = generate_with_options(model, prompt, None, options, generator, stop_ids(tokenizer))  # (1, P + gen)
        return decode_until_stop(tokenizer, out[0, len(ids):].tolist())

    if args.prompt is not None:
        try:
            print(reply(args.prompt if args.raw else chat_prompt([{"role": "user", "content": args.prompt}], fmt)))
        except ValueError as e:
            raise SystemExit(f"sample.py: {e}") from None
        return
    messages = []  # interactive multi-turn chat: the whole conversation is the prompt of each turn
    while True:
        try:
            text = input("user> ")
        except EOFError:
            break
        if text.strip() == "/reset" and not args.raw:
            messages = []
            print("sample.py: conversation cleared")
            continue
        try:
            if args.raw:
                print(reply(text))
                continue
            try:
                answer = reply(chat_prompt(messages + [{"role": "user", "content": text}], fmt))
            except ContextFull as e:  # the history outgrew the context: every later turn would fail the same way
                if not messages:
                    raise
                print(f"sample.py: {e} with the conversation so far; conversation cleared (/reset does it at will), "
                      "answering this message alone")
                messages = []
                answer = reply(chat_prompt([{"role": "user", "content": text}], fmt))
        except ValueError as e:  # e.g. a character the model cannot read: say so, and ask again
            print(f"sample.py: {e}")
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": answer})
        print(f"assistant> {answer}")


if __name__ == "__main__":
    run_command_line(main, "sample.py")  # a user's mistake: one line, exit status 1
