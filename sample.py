"""LLaDA's block diffusion sampler: the official generate.py, token for token, batched; and the chat command.

LLaDA (Nie et al. 2025, "Large Language Diffusion Models", Sec. 2.4 and Appendix B) unmasks a fully masked answer
in `steps` reverse-diffusion steps, each keeping its most confident predictions (low-confidence remasking), block by
block when block_length < gen_length (semi-autoregressive). generate() is the official sampler (generate.py at HEAD,
github.com/ML-GSAI/LLaDA): its arguments, random draws and tokens (where it differs, the tokens cannot:
docs/samplers.md), plus an early exit; on Dream (Appendix C) each token is read from the logits one position to its
left. Below it, SamplerOptions: every sampler's options. Beside it: cached_sample.py (Fast-dLLM's), dream.py (Dream's).

    python sample.py --model DIR [--adapter DIR] --prompt "..." [--gen-length 128 --steps 128 --block-length 32]
    python sample.py --model DREAM_DIR --prompt "..." --sampler dream --alg entropy --steps 128   # Dream's own
"""

# =============================================================================
# The exact sampler: LLaDA's official generate(), loop for loop, batched; copied next to model.py, it samples as here.
# =============================================================================

import torch
import torch.nn.functional as F

from model import check_prompt, check_value, predicting_hidden, unwrap

# generate()'s arguments, each rule once (model.check_value); SamplerOptions' fields read the same rules
BLOCK_RULES = dict(
    gen_length=dict(kind=int, range="[1, inf)", what="must be at least 1"),
    steps=dict(kind=int, range="[1, inf)", what="must be at least 1"),
    block_length=dict(kind=int, range="[1, inf)", what="must be at least 1"),
    temperature=dict(kind=float, range="[0, inf)", what="must be 0 (greedy) or more, a finite number"),
    cfg_scale=dict(kind=float, range="[0, inf)", what="must be 0 (off) or more, a finite number"),
    remasking=dict(kind=str, choices=("low_confidence", "random")),  # the official strategies
)


def uniforms(shape, generator, device, dtype=None, lengths=None):
    """U(0, 1) draws of `shape` (B, ...) in `dtype` (None: float32) from one generator (None: torch's global one) or a
    list of B, one per row: gift.py's draw rule (a test pins the two equal). lengths (B,), with a list: row b draws
    over its last lengths[b] positions of dim 1 (its tokens, not its left pads; the others 0.5), whatever its batch."""
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
    """The official get_num_transfer_tokens: how many of its block's m masks (B, Lb) each row unmasks at each step,
    (B, steps); the schedule is linear (paper Eq. (8)): m // steps per step, one more at each of the first m % steps."""
    m = block_mask_index.sum(dim=1, keepdim=True)  # (B, 1)
    extra = torch.arange(steps, device=m.device)[None, :] < (m % steps)  # (B, steps): the first m % steps steps
    return m // steps + extra.long()


def add_gumbel_noise(logits, temperature, u):
    """Gumbel-max, as the official add_gumbel_noise: argmax of exp(logits) / (-log u)^temperature is a draw from
    softmax(logits / temperature), in float64 (low precision hurts generation quality: the official docstring,
    arXiv:2409.02908); u: float64 uniforms, the logits' shape. Temperature 0: the logits themselves (greedy)."""
    if temperature == 0:
        return logits
    return logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature


def transfer_index(confidence, k):
    """The k[b] most confident positions of each row b: confidence (B, L), k (B,) -> (B, L) bool. One torch.topk at
    max(k), each row's first k[b] kept, is the official torch.topk(confidence[b], k[b]) per row, ties included, when all
    k are equal (generate()): topk treats each row alone (on the CPU an introselect: not a stable sort's tie order)."""
    k_max = int(k.max())
    top = torch.topk(confidence, k_max, dim=-1).indices  # (B, k_max), most confident first
    keep = torch.arange(k_max, device=k.device)[None, :] < k[:, None]  # (B, k_max)
    return torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, top, keep)


def guided_logits(model, x, attention_mask, eligible, prompt_index, cfg_scale, mask_id, forward=None):
    """Logits (N, V) predicting the N eligible positions of x (B, L) (row-major order), the LM head run there only;
    cfg_scale > 0: unsupervised classifier-free guidance (LLaDA Appendix B), uncond + (cfg_scale + 1) * (cond - uncond)
    in the logits' dtype, as officially. forward: None, model.predicting_hidden of the whole sequence; or a cached
    sampler's (model, x, attention_mask) -> (the hidden states predicting positions s .. e - 1, s)."""
    if cfg_scale > 0:  # the official test; the batch stacked with its unconditional copy, the prompt masked: (2B, L)
        x = torch.cat([x, x.masked_fill(prompt_index, mask_id)])
        attention_mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
    h, s = (predicting_hidden(model, x, attention_mask), 0) if forward is None else forward(model, x, attention_mask)
    head, rows = unwrap(model).head, eligible[:, s:s + h.shape[1]]  # h: (B or 2B, e - s, D)
    if cfg_scale <= 0:
        return head(h[rows])  # (N, V)
    B = len(eligible)
    logits, un_logits = head(torch.cat([h[:B][rows], h[B:][rows]], dim=0)).chunk(2, dim=0)
    return un_logits + (cfg_scale + 1) * (logits - un_logits)


def candidates(logits, x, eligible, temperature, remasking, generator, lengths=None, eos_inf=None, eos_eot_inf=None):
    """Candidates and confidences, drawn as the official loop draws them: logits (N, V) at the eligible positions of
    x (B, L) -> x0 (B, L), x with the candidates in, and confidence (B, L), -inf where nothing may change: the argmax,
    at temperature > 0 Gumbel-noised with the official (B, L, V) float64 uniforms (per-row generators: over `lengths`);
    its probability or (remasking "random") a float32 uniform. LLaDA Appendix B.4's eos_inf (EOS id): EOS's logit -inf
    before the draw; eos_eot_inf (EOS, EoT ids): confidence_eos_eot_inf as the official code runs it, after the draw,
    `logits_with_noise[:, :, eos] = logits[:, :, eot] = -inf` (an EoT's confidence is 0, an EOS's at temperature 0)."""
    (B, L), V = x.shape, logits.shape[-1]
    if eos_inf is not None:
        logits[:, eos_inf] = float("-inf")
    u = uniforms((B, L, V), generator, x.device, torch.float64, lengths)[eligible] if temperature else None
    noisy = add_gumbel_noise(logits, temperature, u)  # (N, V)
    x0 = torch.argmax(noisy, dim=-1)  # (N,)
    if eos_eot_inf is not None:
        noisy[:, eos_eot_inf[0]] = logits[:, eos_eot_inf[1]] = float("-inf")
    if remasking == "low_confidence":  # the official F.softmax, in the logits' dtype (bf16 ties: transfer_index)
        x0_p = torch.gather(F.softmax(logits, dim=-1), -1, x0[:, None]).squeeze(-1)  # (N,)
    else:
        x0_p = uniforms((B, L), generator, x.device, lengths=lengths)[eligible]  # (N,)
    confidence = torch.full((B, L), float("-inf"), dtype=x0_p.dtype, device=x.device)
    return x.masked_scatter(eligible, x0), confidence.masked_scatter(eligible, x0_p)


def check_schedule(said, gen_length, steps, block_length):
    """The official generate()'s block schedule (its two asserts), once all three lengths are set."""
    if block_length > gen_length:
        raise ValueError(f"{said('block_length')} is longer than {said('gen_length')}")
    n_blocks = gen_length // block_length
    if gen_length % block_length or steps % n_blocks:
        hint = (f"steps {n_blocks * max(1, steps // n_blocks)}" if gen_length % block_length == 0 else
                f"block length {gen_length} (one block)")
        raise ValueError(f"{said('gen_length')} must be a multiple of {said('block_length')}, and {said('steps')} a "
                         f"multiple of the number of blocks {n_blocks}; e.g. {hint}")


def eos_after_stop(x, start, stop_ids, eos_id):
    """x (B, L) with every answer position (from `start`) after its row's first stop token set to eos_id: what the
    early exit returns, as a model trained on EOS-padded answers (LLaDA's SFT) writes them."""
    stop = torch.isin(x[:, start:], stop_ids).int()  # (B, n)
    x[:, start:][stop.cumsum(1) - stop > 0] = eos_id
    return x


def check_stop_ids(stop_ids, generator, B, draws, where, device):
    """stop_ids (the early exit) as a tensor on `device` (or None), refused with random `draws` on B > 1 rows and one
    generator: its draws span the batch, so a row leaving would change the draws of the rows beside it."""
    if stop_ids is not None and draws and B > 1 and not isinstance(generator, (list, tuple)):
        raise ValueError(f"{where}: stop_ids (the early exit) with random draws on a batch of {B} rows needs one "
                         "generator per row (a list): one generator's draws span the batch")
    return None if stop_ids is None else torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)


def append_masks(prompt, attention_mask, gen_length, mask_id):
    """The sampler's start: the prompt then gen_length masks (B, P + gen_length), the attention mask extended by 1s."""
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :prompt.shape[1]] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(prompt.shape[0], gen_length)], dim=1)
    return x, attention_mask


def block_rows(x, attention_mask, prompt_index, generator, P, block_length, stop_ids, mask_id, stats):
    """The block loop, shared with the cached sampler: (block start, block end, live, rows) per block, live (k,) the
    rows still sampled, rows their (x, attention mask, prompt positions, generators, lengths: each row's own tokens);
    the caller writes x[live] = rows[0]. stop_ids, the early exit: a row whose finished blocks hold a stop with no mask
    before it leaves (its text up to the stop is final), and stats["skipped"] (a dict, or None) counts what it skips."""
    live, n_blocks = torch.arange(len(x), device=x.device), (x.shape[1] - P) // block_length
    for b in range(n_blocks):
        start = P + b * block_length
        if stop_ids is not None:
            answer = x[live, P:start]  # (k, n): the finished blocks
            stop = torch.isin(answer, stop_ids)  # (k, n)
            before = stop.int().cumsum(1) == 0  # the positions before the row's first stop
            done = stop.any(1) & ~(before & (answer == mask_id)).any(1)  # (k,)
            if stats is not None:
                stats["skipped"] = stats.get("skipped", 0) + int(done.sum()) * (n_blocks - b) * block_length
            live = live[~done]
            if not len(live):
                return
        rows = [v if v is None or isinstance(v, torch.Generator) else v[live] if torch.is_tensor(v) else
                [v[r] for r in live.tolist()] for v in (x, attention_mask, prompt_index, generator)]
        yield start, start + block_length, live, rows + [None if rows[1] is None else rows[1].sum(1).tolist()]


@torch.no_grad()
def generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128, temperature=0.,
             cfg_scale=0., remasking="low_confidence", mask_id=None, logits_eos_inf=False, confidence_eos_eot_inf=False,
             generator=None, stop_ids=None, stats=None, eot_id=None):
    """LLaDA's official generate() at HEAD, batched (its arguments, random draws and tokens): x (B, P + gen_length).

    model: model(x, attention_mask=..., return_hidden=True) -> (B, L, D), its LM head unwrap(model).head, in eval mode
        (LoRA dropout); a Dream model (model.predicts_shifted) reads each token from the logits at position i - 1.
    prompt: (B, P) token ids; left-pad a batch of prompts and give attention_mask (B, P), 0 on the pads.
    steps: in all, split evenly over the gen_length / block_length blocks, filled left to right.
    temperature (0 greedy), cfg_scale (0 off), remasking, mask_id (None: config.mask_token_id): the official arguments;
        logits_eos_inf, confidence_eos_eot_inf its options (candidates), EOS config.eos_token_id, the EoT eot_id.
    generator: a torch.Generator (None: the global RNG, as official), drawn in the official shapes and order: the same
        RNG state gives the official tokens. A list of B: each row's own (uniforms), its tokens then batch-independent.
    stop_ids, stats: the early exit (block_rows; stop_ids(tokenizer)), or None, the official loop: each row's ids after
        its first stop come back as EOS, the same text up to it (in float32 a smaller batch may round otherwise).
    """
    module = unwrap(model)
    mask_id = module.config.mask_token_id if mask_id is None else mask_id
    given = dict(gen_length=gen_length, steps=steps, block_length=block_length, temperature=temperature,
                 cfg_scale=cfg_scale, remasking=remasking)
    for key, rule in BLOCK_RULES.items():
        check_value(f"sample.py generate: {key}={given[key]!r}", given[key], **rule)
    check_schedule(lambda key: f"sample.py generate: {key}={given[key]!r}", gen_length, steps, block_length)
    check_prompt(prompt, attention_mask, generator, "sample.py generate", model, gen_length)
    if confidence_eos_eot_inf and eot_id is None:
        raise ValueError("sample.py generate: confidence_eos_eot_inf needs eot_id, the turn end's id (LLaDA's: 126348)")
    eos_id = module.config.eos_token_id if logits_eos_inf or confidence_eos_eot_inf or stop_ids is not None else None
    stop_ids = check_stop_ids(stop_ids, generator, len(prompt), temperature > 0 or remasking == "random",
                              "sample.py generate", prompt.device)
    x, attention_mask = append_masks(prompt, attention_mask, gen_length, mask_id)  # (B, L), (B, L) or None
    prompt_index = x != mask_id  # what CFG masks: every non-mask token at the start, left pads included
    positions = torch.arange(x.shape[1], device=x.device)  # (L,)
    steps = steps // (gen_length // block_length)  # per block, as in the official code
    for block_start, block_end, live, (xb, mask_b, prompt_b, generator_b, lengths_b) in block_rows(
            x, attention_mask, prompt_index, generator, prompt.shape[1], block_length, stop_ids, mask_id, stats):
        num_transfer_tokens = get_num_transfer_tokens(xb[:, block_start:block_end] == mask_id, steps)  # (B, steps)
        for i in range(steps):
            # the official confidence is -inf after the block and where x is no mask: only these N positions can
            # change (masks left in earlier blocks included), so the LM head runs only there
            eligible = (xb == mask_id) & (positions < block_end)  # (B, L)
            logits = guided_logits(model, xb, mask_b, eligible, prompt_b, cfg_scale, mask_id)  # (N, V)
            x0, confidence = candidates(logits, xb, eligible, temperature, remasking, generator_b, lengths_b,
                                        eos_id if logits_eos_inf else None,
                                        (eos_id, eot_id) if confidence_eos_eot_inf else None)  # (B, L)
            # the k most confident positions take their candidates (the official transfer_index); a candidate
            # equal to mask_id leaves its position masked, and eligible again at the next step, as officially
            transfer = transfer_index(confidence, num_transfer_tokens[:, i])  # (B, L) bool
            xb[transfer] = x0[transfer]
        x[live] = xb
    return x if stop_ids is None else eos_after_stop(x, prompt.shape[1], stop_ids, eos_id)


# =============================================================================
# The options of every sampler (SamplerOptions: the flags of sample.py, eval.py and the harness), the command line
# =============================================================================

import argparse
import difflib
import json
from dataclasses import InitVar, dataclass, field, fields, replace
from pathlib import Path

from data import (EOS, EOT, IM_END, chat_format, chat_prompt, check_chat_tokens, check_mask_token, encode_text,
                  load_tokenizer)
from dream import DREAM_RULES, diffusion_generate
from longjob import (SEED_RULE, SEEDS, add_dataclass_flags, add_dtype_flag, add_model_flags, check_adapter,
                     compute_dtype, find_model, load_weights, loading, run_command_line)
from model import GENERATION_DEFAULTS, check_fields, generation_defaults, read_config

SAMPLERS = ("block", "dream")  # generate / cached_sample.generate_cached, or dream.diffusion_generate
# the options only one of them reads: a flag of the other's is refused (check_sampler_choice)
BLOCK_ONLY = ("block_length", "cfg_scale", "remasking", "logits_eos_inf", "confidence_eos_eot_inf", "cache",
              "threshold", "cache_refresh", "cache_drift", "cache_window", "early_exit")
DREAM_ONLY = ("alg", "alg_temp", "eps", "top_p", "top_k")
CACHED_ONLY = ("cache", "threshold", "cache_refresh", "cache_drift", "cache_window")  # cached_sample.py's
NEEDS_CACHE = ("cache_refresh", "cache_drift", "cache_window")  # meaningless without --cache


def rule(rules, name, help, **more):
    """A field's metadata: its flag's help and the value rule of `rules` (BLOCK_RULES, DREAM_RULES) for `name`."""
    return dict(rules.get(name, {}), help=help, **more)


@dataclass
class SamplerOptions:
    """How to sample an answer: which sampler (`sampler`: "block", generate() or cached_sample.py's generate_cached(),
    for either family; "dream", Dream's own diffusion_generate()) and its arguments, declared once for the library
    call and for the flags of sample.py, eval.py and the harness (--gen-length, ..., --top-k); each field's rule
    (type, range, choices) is its metadata, checked when the options are built (model.check_fields).

    A field that no flag gives is taken from the model folder's generation_defaults.json when it names it (a Dream
    folder's {"sampler": "dream", "alg": "entropy"} makes Dream's sampler its default); the lengths still unset
    (None) are then filled in by whoever samples: sample.py with its own defaults, eval.py with d1's protocol for the
    task; generate_cached needs them set. Dream's sampler reads gen_length (its max_new_tokens), steps, temperature
    and its own options (alg ... top_k); a flag of the other sampler's options is refused (check_sampler_choice).
    What each cached-sampler option does, in more words: docs/samplers.md.
    """
    gen_length: int = field(default=None, metadata=rule(BLOCK_RULES, "gen_length", "tokens to generate; unset: the "
                            "model folder's generation_defaults.json (sample.py: else 128; eval.py: else d1's 512 for "
                            "Sudoku / Countdown, 256 for GSM8K / MATH500)"))
    steps: int = field(default=None, metadata=rule(BLOCK_RULES, "steps", "sampling steps in all, split evenly "
                       "over the blocks; unset: the model folder's, else gen-length (sample.py) or gen-length / 2 "
                       "(eval.py, d1)"))
    block_length: int = field(default=None, metadata=rule(BLOCK_RULES, "block_length", "semi-autoregressive block "
                              "length; unset: the model folder's, else min(32, gen-length) (sample.py) or 32 (eval.py, "
                              "d1)"))
    temperature: float = field(default=0.0, metadata=rule(BLOCK_RULES, "temperature", "0 = greedy (d1's protocol); "
                               "> 0 samples with float64 Gumbel noise (Dream's sampler: from softmax(logits / T))"))
    cfg_scale: float = field(default=0.0, metadata=rule(BLOCK_RULES, "cfg_scale", "unsupervised classifier-free "
                             "guidance scale (0 = off)"))
    remasking: str = field(default="low_confidence", metadata=rule(BLOCK_RULES, "remasking", "remasking strategy (d1's "
                           "protocol: low_confidence)"))
    logits_eos_inf: bool = field(default=False, metadata=dict(help="block samplers: EOS's logit -inf, so no answer "
                                 "token is EOS (the official generate's logits_eos_inf, LLaDA Appendix B.4)"))
    confidence_eos_eot_inf: bool = field(default=False, metadata=dict(help="block samplers: the official generate's "
                                         "confidence_eos_eot_inf (LLaDA Appendix B.4; LLaDA's EVAL.md uses it for "
                                         "GSM8K at 512): an EoT candidate's confidence is 0, so it is placed last "
                                         "(at temperature 0 an EOS candidate's too, as the official code runs)"))
    cache: str = field(default=None, metadata=dict(help="cached sampler (cached_sample.py): Fast-dLLM's key/value "
                       "cache (none, without --threshold: the exact sampler, the paper's numbers)",
                       choices=("none", "prefix", "dual")))
    threshold: float = field(default=None, metadata=dict(help="cached sampler: unmask every token more confident "
                             "than this (parallel decoding; e.g. 0.9)", range="[0, 1)", what="a confidence in [0, 1)"))
    cache_refresh: int = field(default=None, metadata=dict(help="cached sampler: rebuild the --cache every N steps "
                               "inside a block (unset: at its first only)", range="[1, inf)",
                               what="a number of steps >= 1, with --cache prefix or dual"))
    cache_drift: float = field(default=None, metadata=dict(help="cached sampler: also rebuild a row's --cache when its "
                               "attention drifts (Elastic-Cache's test: cosine similarity below this, e.g. 0.9)",
                               range="(0, 1]", what="a cosine similarity in (0, 1], with --cache prefix or dual"))
    cache_window: int = field(default=None, metadata=dict(help="cached sampler: a --cache rebuild after the first "
                              "block recomputes only the positions within this many tokens of the block, the rest "
                              "reused (unset: the whole sequence; e.g. the block length)", range="[1, inf)",
                              what="a whole number of tokens >= 1 (the block length recomputes the block just "
                              "finished), with --cache prefix or dual"))
    early_exit: bool = field(default=None, metadata=dict(help="block samplers: a row stops once a finished block "
                             "holds its first turn end or EOS with nothing masked before it (its text up to there is "
                             "final), the rest returned as EOS: the same text up to it, fewer steps. Unset: on where "
                             "answers are cut at the turn end (the harness, sample.py), off in eval.py (d1's graders "
                             "read past it); --no-early-exit: every block, as the official generate"))
    sampler: str = field(default="block", metadata=dict(help="block: the block low-confidence sampler above, for "
                         "either family (the paper's evaluation protocol, Appendix C); dream: Dream's own "
                         "diffusion_generate (a Dream model only; its options --alg ... --top-k)", choices=SAMPLERS))
    alg: str = field(default="origin", metadata=rule(DREAM_RULES, "alg", "--sampler dream: which masks to unmask "
                     "(origin: each at random; the others: the most confident first)"))
    alg_temp: float = field(default=None, metadata=rule(DREAM_RULES, "alg_temp", "--sampler dream: > 0 draws the "
                            "positions to unmask from softmax(confidence / alg_temp) (unset: the most confident)"))
    eps: float = field(default=1e-3, metadata=rule(DREAM_RULES, "eps", "--sampler dream: the last time of the reverse "
                       "process, Dream's own eps (its timesteps run from 1 to eps; not gift.py's --eps)"))
    top_p: float = field(default=None, metadata=rule(DREAM_RULES, "top_p", "--sampler dream: nucleus filter of the "
                         "logits (unset: off)"))
    top_k: int = field(default=None, metadata=rule(DREAM_RULES, "top_k", "--sampler dream: keep the k largest logits "
                       "(unset: off)"))

    # who gave the values, as a refusal names them (check_sampler_options): None a library call, "flags" a command
    # line, else a file's path; not a field (no flag, not in asdict), so dataclasses.replace needs it given again
    source: InitVar[str | None] = None

    def __post_init__(self, source):
        check_sampler_options(self, source)  # every option checked here, whoever builds the options

    @property
    def exact(self):
        """True when these options ask for the exact block sampler, generate() (no cache, no threshold)."""
        return self.sampler == "block" and self.cache is None and self.threshold is None

    @property
    def draws(self):
        """True when the sampler draws random numbers (its seed matters): temperature > 0, random remasking, or Dream's
        alg origin or alg_temp, which draw the positions to unmask even when greedy."""
        if self.sampler == "dream":
            return self.temperature > 0 or self.alg == "origin" or bool(self.alg_temp)
        return self.temperature > 0 or self.remasking == "random"


def generate_with_options(model, prompt, attention_mask=None, options=None, generator=None, stop_ids=None, stats=None,
                          eot_id=None):
    """Sample with `options` (lengths set): generate(), the exact sampler, or with sampler "dream" Dream's own
    diffusion_generate() (dream.py; one torch.Generator for the batch, or one per row). Returns
    (B, P + gen_length). stop_ids, stats: the block sampler's early exit, unless options.early_exit is False;
    eot_id: the turn end's id (confidence_eos_eot_inf). The cached sampler's options (cache, threshold) are
    cached_sample.generate_with_options' (it samples with every sampler)."""
    o = options or SamplerOptions()
    if o.sampler == "dream" and o.early_exit:
        raise ValueError("sample.py: early_exit with sampler 'dream': Dream's diffusion_generate has no blocks, so no "
                         "part of an answer is final before the last step; use the block sampler, or drop early_exit")
    if not o.exact and o.sampler == "block":
        raise ValueError("sample.py generate_with_options: cache / threshold are the cached sampler's: use "
                         "cached_sample.generate_with_options")
    if o.sampler == "dream":
        return diffusion_generate(model, prompt, attention_mask, max_new_tokens=o.gen_length, steps=o.steps,
                                  eps=o.eps, alg=o.alg, alg_temp=o.alg_temp, temperature=o.temperature,
                                  top_p=o.top_p, top_k=o.top_k, generator=generator)
    return generate(model, prompt, attention_mask=attention_mask, steps=o.steps, gen_length=o.gen_length,
                    block_length=o.block_length, temperature=o.temperature, cfg_scale=o.cfg_scale,
                    remasking=o.remasking, logits_eos_inf=o.logits_eos_inf,
                    confidence_eos_eot_inf=o.confidence_eos_eot_inf, generator=generator,
                    stop_ids=None if o.early_exit is False else stop_ids, stats=stats, eot_id=eot_id)


def left_padded(prompts, pad_id):
    """Token-id lists as the samplers' batch, left-padded (every answer at positions P onwards): ids and attention
    mask (B, P), 0 on the pads."""
    P = max(len(x) for x in prompts)
    ids = torch.tensor([[pad_id] * (P - len(x)) + list(x) for x in prompts], dtype=torch.long)  # (B, P)
    attention_mask = torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in prompts], dtype=torch.long)  # (B, P)
    return ids, attention_mask


# -----------------------------------------------------------------------------
# The sampler's flags, shared by every command line (sample.py's, cached_sample.py's, eval.py's, the harness's)


def add_sampler_flags(parser):
    """--gen-length ... --top-k on `parser`, one per SamplerOptions field, each None when not given."""
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
    "flags" = a command line (`--threshold 1.5`), a file's path (`PATH: field 'threshold' = 1.5`). Each field's
    rule (its metadata), the options that need a cache, and the block schedule once all three lengths are set
    (lengths left unset are each command line's to fill in; Dream's own sampler has no blocks)."""
    def said(key):
        value = getattr(o, key)
        return (f"{key}={value!r}" if source is None else f"--{key.replace('_', '-')} {value}" if source == "flags"
                else f"{source}: field {key!r} = {json.dumps(value)}")

    check_fields(o, said)
    if o.cache is None and (needs := next((k for k in NEEDS_CACHE if getattr(o, k) is not None), None)):
        raise ValueError(f"{said(needs)}: {SamplerOptions.__dataclass_fields__[needs].metadata['what']}")
    if o.sampler == "block" and None not in (o.gen_length, o.steps, o.block_length):
        check_schedule(said, o.gen_length, o.steps, o.block_length)


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
    context = read_config(folder).max_sequence_length
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
    config = read_config(folder)
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


def resolve_model(given, task=None):
    """What a command's --model and --adapter name, and the SamplerOptions it samples with, resolved alike by every
    command line (sample.py, eval.py, the harness's GiftLM): (model folder, adapter, the folder's
    generation_defaults.json, options). A run or checkpoint folder finds its model (find_model); the adapter given wins
    over the checkpoint's, checked against the folder (check_adapter). Each option is the value given (a flag, a
    model_arg), else the folder's (for a `task`: only when the folder's task is that one), else SamplerOptions'; the
    lengths still unset are each command's rule (with_lengths). given: model, adapter and SamplerOptions' fields."""
    folder, adapter = find_model(given.model)
    adapter = given.adapter or adapter
    check_adapter(folder, adapter)
    defaults = folder_defaults(folder)
    if task is not None and defaults.get("task") not in (None, task):
        defaults = {}  # another task's settings
    options = options_from_flags(given, defaults)
    check_sampler_choice(given, options, folder)
    return folder, adapter, defaults, options


# -----------------------------------------------------------------------------
# Command line: chat with or complete from a checkpoint


def stop_ids(tokenizer):
    """The ids that end an answer: the turn end (<|eot_id|>, ChatML's <|im_end|>) and <|endoftext|> (answers end in a
    turn end, then EOS pads), those the tokenizer has."""
    return sorted({tokenizer.token_to_id(t) for t in (EOT, IM_END, EOS)} - {None})


def turn_end_id(tokenizer):
    """The id that ends a chat turn, <|eot_id|> (ChatML's <|im_end|>): the EoT of confidence_eos_eot_inf."""
    return tokenizer.token_to_id(IM_END if chat_format(tokenizer) == "chatml" else EOT)


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


def parse_args(argv=None, cached=False):
    """sample.py's flags (cached: cached_sample.py's, the same), checked before the model loads (a one-line error
    naming the flag), and the SamplerOptions they give, the fields not given taken from the model folder's
    generation_defaults.json (options_from_flags), the lengths still unset from with_lengths. Returns (args,
    options); args gains .folder, the model folder, and .adapter, the flag's or the checkpoint's."""
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
        args.folder, args.adapter, defaults, options = resolve_model(args)  # the folder's: the embedded task's
        if not (options.exact or options.sampler == "dream" or cached):
            raise ValueError("--cache / --threshold ask for the cached sampler: its chat is `python cached_sample.py "
                             "...` (the same flags)")
        options = with_lengths(options, 128, 32, 1, "flags")  # unset: 128 tokens, one per step, blocks of 32
        folder_steps = args.steps is None and args.gen_length is None and "steps" in defaults  # against the default
        check_step_count(options, args.steps is not None or folder_steps,  # the lengths filled in
                         Path(args.folder) / GENERATION_DEFAULTS if folder_steps else None)
        check_lengths(options, args.folder)
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
        config = read_config(args.folder)
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


def main(argv=None, sampler=None):
    """The chat command. sampler: generate_with_options, or another file's (cached_sample.py's: the cached sampler)."""
    args, options = parse_args(argv, cached=sampler is not None)
    model, tokenizer = load_model(args, options)  # a --prompt too long for the context is said before the weights load
    fmt = chat_format(tokenizer)  # LLaDA's template, or ChatML for Dream's tokenizer
    generator = torch.Generator(args.device).manual_seed(args.seed)
    eot_id = turn_end_id(tokenizer)  # confidence_eos_eot_inf's EoT
    sampler = sampler or generate_with_options

    def reply(text):
        ids = encode_text(tokenizer, text)  # the chat text carries its own special tokens; nothing is added
        check_context(len(ids), options.gen_length, model.config.max_sequence_length)
        prompt = torch.tensor([ids], dtype=torch.long, device=args.device)  # (1, P)
        out = sampler(model, prompt, None, options, generator, stop_ids(tokenizer), eot_id=eot_id)  # (1, P + gen)
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
