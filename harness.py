"""lm-evaluation-harness (EleutherAI's lm-eval, optional: pip install -r requirements-extras.txt) on this repo's LLaDA
and Dream models: GiftLM, lm-eval's model "gift" (importing this file registers it), reads a model folder (or a
gift.py checkpoint or run) and answers lm-eval's requests, generate_until with sample.py's samplers and the
likelihoods with LLaDA's Monte Carlo estimate of the ELBO (below); its model_args also take the names of LLaDA's,
Dream's and dllm's harnesses (docs/harness.md). The command line runs lm-eval's tasks or a folder of task YAMLs of
your own, each checked before the model loads; eval.py's d1 protocol does without lm-eval.

    python harness.py --model DIR --tasks arc_easy,gsm8k [--include-path DIR] [--out results.json]
    torchrun --nproc_per_node 8 harness.py --model DIR --tasks gsm8k   # lm-eval gives each rank a slice of the docs
    import harness; lm_eval.simple_evaluate(model="gift", model_args="model=DIR,mc_num=128,gen_length=256", tasks=[...])
"""

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist

from data import BOS, chat_format, chat_prompt, check_chat_tokens, check_mask_token, encode_text, load_tokenizer
from dream import named_token
from eval import BLOCK_LENGTH, d1_options, item_generator
from longjob import (DTYPES, SEED_RULE, SEEDS, add_dtype_flag, add_model_flags, barrier, compute_dtype,
                     end_distributed, find_model, gather_objects, hms, json_or_empty, load_weights, run_command_line,
                     seconds_left, setup_distributed)
from model import atomic_write_text, check_fields, read_config, shift_right
from sample import (SamplerOptions, add_sampler_flags, check_step_count, decode_until_stop, generate,
                    generate_with_options, left_padded, options_from_flags, options_of, resolve_model, stop_ids,
                    turn_end_id)

try:  # lm-evaluation-harness, optional: GiftLM (its model "gift") and harness.py need it
    import lm_eval.models  # noqa: F401  the harness's own models, registered first (lazily), stay available
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry
    HARNESS_MISSING = None
except ImportError as e:  # then harness.GiftLM and harness.py say how to install it, in one line
    LM, HARNESS_MISSING = object, (f"lm-evaluation-harness is not installed ({e}); install it with: "
                                   "pip install -r requirements-extras.txt (lm-eval==0.4.13)")


# -----------------------------------------------------------------------------
# The model "gift" (GiftLM), this repo's models in lm-evaluation-harness.
# generate_until: the sampler of SamplerOptions on left-padded batches, as eval.evaluate() runs it.
# loglikelihood: LLaDA's Monte Carlo estimate of its likelihood bound (Nie et al. 2025, arXiv 2502.09992; the official
#   evaluation/eval_llada.py). For a continuation y of L tokens after the context x:
#       ELBO = E_{l ~ U{1..L}} E_{M ~ U(l-subsets of y)} [ (L / l) sum_{i in M} log p(y_i | x, y with M masked) ]
#   one draw = one row of a forward pass, the draws of consecutive requests sharing passes of `batch_size` rows (right-
#   padded), each request's from its own generator: no draw depends on its neighbours. The l of the mc_num draws are
#   stratified over 1..L; the context is never masked; Dream reads token i at position i - 1. ELBO <= log p(y | x).
# paired (--paired-draws; common random numbers): a question's choices (one context) draw from one generator seeded by
#   the context alone: equal lengths share their l and masks, so the noise of their difference cancels; other lengths
#   share k = floor(u L) + 1 (one u: the same fractions l / L) and keys drawn per position (the l lowest are masked).
#   Each l stays uniform on 1..L (to 2^-53), each mask uniform given l: each choice's estimate stays unbiased.

@dataclass
class HarnessOptions:
    """GiftLM's model_args besides SamplerOptions' (those unset: the folder's generation_defaults.json, the task's),
    each field's rule in its metadata (model.check_fields): lm-eval's --model_args arrive typed by guess ("maybe",
    "1.5", "cuda:0" on any machine), so every one is checked before the model loads."""
    model: str = field(metadata=dict(what="a model folder"))  # or a checkpoint or run folder (as eval.py's --model)
    adapter: str = None  # a LoRA adapter folder, merged before sampling
    dtype: str = field(default="auto", metadata=dict(choices=DTYPES + ("float64",)))
    device: str = None  # one process only: torchrun's ranks each take their own
    batch_size: int = field(default=8, metadata=dict(range="[1, inf)", what="must be an integer >= 1 (no 'auto')"))
    mc_num: int = field(default=128, metadata=dict(range="[1, inf)", what="must be an integer >= 1"))  # draws/request
    seed: int = field(default=0, metadata=dict(range=f"[0, {len(SEEDS)})", what=f"must be {SEED_RULE}"))
    check_greedy: bool = True  # False: is_greedy is always False, without its L extra passes
    paired: bool = False  # the choices of a question (one context) share their likelihood draws (paired, above)
    add_bos_token: bool = False  # every context starts with the family's BOS token (Dream's evaluation sets it)

    def __post_init__(self):
        check_fields(self, lambda name: f"GiftLM: {name} {getattr(self, name)!r}")
        try:
            device = torch.device(self.device or "cpu")
        except RuntimeError:  # not a device name
            device = None
        backend = getattr(torch, device.type, None) if device else None  # torch.cuda, torch.mps, ...
        count = backend.device_count() if hasattr(backend, "device_count") else 0
        if device is None or device.type != "cpu" and (device.index or 0) >= count:
            raise ValueError(f"GiftLM: device {self.device!r}: not a device of this machine (this torch sees "
                             f"{torch.cuda.device_count()} CUDA devices, {torch.mps.device_count()} MPS); e.g. cpu"
                             + (" or cuda:0" if torch.cuda.device_count() else ""))


def stratified_mask_counts(L, b, generator, paired=False):
    """How many of the L continuation tokens each of b draws masks: l_j = ((k - 1 + round(j L / b)) mod L) + 1,
    j = 0 .. b - 1, k ~ U{1..L} (eval_llada.py's stratified draws: the b counts spread evenly over 1..L). The offsets
    are rounded apart from k, so each l_j is exactly uniform on 1..L (eval_llada.py rounds k + j L / b with torch.round,
    whose half-to-even ties make l_j depend on k's parity). paired: k = floor(r L / 2^53) + 1, r ~ U{0..2^53 - 1}, the
    same r for any L (paired, above). (b,) long, on the CPU."""
    k = ((int(torch.randint(2 ** 53, (), generator=generator)) * L >> 53) + 1 if paired
         else int(torch.randint(1, L + 1, (), generator=generator)))
    offsets = (2 * torch.arange(b) * L + b) // (2 * b)  # round(j L / b), halves up, in integers
    return (k - 1 + offsets) % L + 1


def continuation_masks(L, counts, generator, paired=False):
    """For each count l, a uniformly random set of l of the L positions: (b, L) bool, row j with counts[j] True. The
    keys are drawn row by row, or paired position by position (position i's b keys the same for any L > i)."""
    b = len(counts)
    keys = torch.rand(L, b, generator=generator).T if paired else torch.rand(b, L, generator=generator)  # (b, L)
    order = keys.argsort(dim=1)  # a random permutation per row
    first = torch.arange(L)[None, :] < counts[:, None]  # (b, L): the permutation's first l entries are masked
    return torch.zeros(b, L, dtype=torch.bool).scatter(1, order, first)


def elbo_rows(context, continuation, mc_num, generator, paired=False):
    """One request's mc_num draws (the estimator above) as rows for elbo_passes: (x0 (P + L,) token ids, masked
    (P + L,) bool, never the context, L / l), the context non-empty (Dream reads the first continuation token at its
    last position). The counts first, then the masks (torch.rand reads the generator in order): a rerun and any device
    give the same."""
    P, L = len(context), len(continuation)
    if P < 1 or L < 1:
        raise ValueError(f"elbo_rows: a context of {P} and a continuation of {L} tokens; each needs at least one")
    counts, x0 = stratified_mask_counts(L, mc_num, generator, paired), torch.tensor(list(context) + list(continuation))
    masked = torch.cat([torch.zeros(mc_num, P, dtype=torch.bool), continuation_masks(L, counts, generator, paired)], 1)
    return [(x0, m, L / l) for m, l in zip(masked, counts.tolist())]


@torch.no_grad()
def elbo_passes(model, rows, batch_size):
    """The draw of each row (x0, masked, L / l) of `rows` (any requests' in turn), float64, yielded in order:
    batch_size rows per forward pass, right-padded to its longest (the padding hidden by the attention mask, the
    positions unchanged), so a draw is the same beside any others, up to rounding."""
    device, mask_id, rows = next(model.parameters()).device, model.config.mask_token_id, iter(rows)
    while batch := list(itertools.islice(rows, batch_size)):
        x0, masked = (torch.nn.utils.rnn.pad_sequence([r[i] for r in batch], batch_first=True).to(device)
                      for i in (0, 1))  # (b, T): padded with token 0, never masked
        lengths = torch.tensor([len(r[0]) for r in batch])
        real = (torch.arange(x0.shape[1])[None, :] < lengths[:, None]).to(device)  # (b, T): False = padding
        hidden = model(torch.where(masked, mask_id, x0), attention_mask=real, return_hidden=True)  # (b, T, D)
        hidden = shift_right(hidden) if model.predicts_shifted else hidden  # position i: predicting token i
        rows_, cols = masked.nonzero(as_tuple=True)  # the N masked tokens: the only logits the estimate reads
        logits = model.head(hidden[rows_, cols])  # (N, V)
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        logp_y = logp.gather(-1, x0[rows_, cols][:, None])[:, 0].double()  # (N,)
        sums = torch.zeros(len(batch), dtype=torch.float64, device=device).index_add_(0, rows_, logp_y)  # (b,)
        yield from (torch.tensor([r[2] for r in batch], dtype=torch.float64, device=device) * sums).tolist()


def greedy_continuation(model, context, L):
    """The L token ids the block sampler gives greedily after the context, one per step (eval_llada.py's is_greedy)."""
    prompt = torch.tensor([list(context)], device=next(model.parameters()).device)  # (1, P)
    return generate(model, prompt, steps=L, gen_length=L, block_length=L)[0, len(context):].tolist()


MAX_GEN_TOKS = 256  # lm-eval's max_gen_toks for a task that names none
TASK_GENERATION = ("until", "max_gen_toks", "do_sample", "temperature")  # the generation_kwargs GiftLM reads


def task_generation(task, gen_kwargs, given=()):
    """What a generation task's generation_kwargs ask of the sampler, those it states: gen_length (its max_gen_toks),
    temperature (0 where do_sample is false, as lm-eval's models read it; else its temperature), the latter only where
    model_args do not give one (`given`: their SamplerOptions names). A key GiftLM does not read, or a value it cannot
    honour: a ValueError naming the task and the key."""
    def said(key):
        return f"GiftLM: task {task!r}: {key} {gen_kwargs[key]!r}"
    if unread := [key for key in gen_kwargs if key not in TASK_GENERATION]:
        raise ValueError(f"GiftLM: task {task!r}: generation_kwargs {unread[0]}: not read by GiftLM (it reads "
                         f"{', '.join(TASK_GENERATION)}); drop it from the task, or give the sampler's options in "
                         "model_args (docs/harness.md)")
    asked = {}
    if "max_gen_toks" in gen_kwargs:
        if type(gen_kwargs["max_gen_toks"]) is not int or gen_kwargs["max_gen_toks"] < 1:
            raise ValueError(f"{said('max_gen_toks')}: must be an integer >= 1")
        asked["gen_length"] = gen_kwargs["max_gen_toks"]
    do_sample, temperature = gen_kwargs.get("do_sample"), gen_kwargs.get("temperature")
    if do_sample not in (None, True, False):
        raise ValueError(f"{said('do_sample')}: expected true or false")
    if temperature is not None and not (type(temperature) in (int, float) and 0 <= temperature < float("inf")):
        raise ValueError(f"{said('temperature')}: must be 0 (greedy) or more, a finite number")
    if "temperature" in given:
        return asked  # model_args' temperature wins
    if do_sample is True and not temperature:
        raise ValueError(f"{said('do_sample')} with temperature {temperature!r}: sampling needs a temperature > 0 "
                         "(give the task one, or model_args temperature)")
    if do_sample is False or temperature is not None:
        asked["temperature"] = 0.0 if do_sample is False else float(temperature)
    return asked


def sampler_sources(given):
    """What model_args (or harness.py's flags) name, resolved (sample.resolve_model; given: model, adapter and
    SamplerOptions' fields, None where not given): (model folder, adapter, the SamplerOptions of both, lengths unset
    where neither gives them; for generation_options the sampler options given {name: value} and those of the folder's
    generation_defaults.json)."""
    folder, adapter, defaults, options = resolve_model(given)
    names = [f.name for f in fields(SamplerOptions)]
    return (folder, adapter, options, {n: getattr(given, n) for n in names if getattr(given, n) is not None},
            {n: defaults[n] for n in names if defaults.get(n) is not None})


def generation_options(given, defaults, asked):
    """(options, n) for one task's requests: the sampler's options and how many tokens of each answer are returned
    (None: all it generates). Each option is the first given of: model_args (`given`), the task (`asked`,
    task_generation), the model folder's generation_defaults.json (`defaults`); the lengths still unset by d1's rule
    (eval.d1_options: blocks of 32, two tokens per step), gen_length lm-eval's 256. A length of the task's (its
    max_gen_toks, or lm-eval's 256) is rounded up to whole blocks and each answer cut back to n = that many tokens
    (lm-eval's meaning: at most max_gen_toks); one of model_args' or the folder's is generated and returned as it is.
    Refused as eval.py and sample.py refuse them (sample.check_schedule, check_step_count): a ValueError in one line
    naming the argument."""
    values = defaults | asked | given
    n = None
    if "gen_length" in asked and "gen_length" not in given or "gen_length" not in values:  # the task's length
        n = values.setdefault("gen_length", MAX_GEN_TOKS)
        if values.get("sampler", "block") == "block":
            block = values.get("block_length") or min(BLOCK_LENGTH, n)  # d1_options' block for n tokens
            values["gen_length"] = -(-n // block) * block
    try:
        options = d1_options(options_of(values, None), values["gen_length"])
        check_step_count(options, "steps" in given, "model_args")
    except ValueError as e:
        raise ValueError(f"GiftLM: {e}") from None
    return options, n


def cut_at_stops(text, until):
    """The text before the first occurrence of any of the `until` strings (lm-eval's stop sequences)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


PROGRESS_SECONDS = 10  # GiftLM's likelihood requests: rank 0 says how far it is at most this often

# The model_args of LLaDA's evaluation/eval_llada.py, Dream's eval/eval.py and dllm's harnesses, so that their published
# lm-eval commands run with --model gift (docs/harness.md: each name, its meaning there, and the commands).
THEIR_NAMES = {"model_path": "model", "pretrained": "model", "is_check_greedy": "check_greedy",  # theirs: ours
               "max_new_tokens": "gen_length", "diffusion_steps": "steps", "block_size": "block_length"}
THEIR_FIXED = {  # their name: (the values that are what GiftLM does anyway, why another is refused)
    "cfg": ((0,), "LLaDA's cfg also guides its likelihood estimate, GiftLM's has no guidance (cfg_scale: sampling)"),
    "classifier_free_guidance": ((1,), "Dream's guidance of its likelihood estimate (1 = none); GiftLM's has none"),
    "nll_type": (("mc",), "GiftLM's likelihood is the Monte Carlo ELBO, Dream's 'mc' (not its autoregressive ones)"),
    "log_type": (("ftb",), "GiftLM scores the continuation given the context, Dream's 'ftb'"),
    "sampling_eps": ((0,), "GiftLM's ELBO estimate masks l of the L tokens, l uniform: no floor on the masking rate"),
    "escape_until": ((False,), "GiftLM cuts each answer at the task's stop strings"),
    "suppress_tokens": (([], "[]", None), "GiftLM's samplers suppress no token"),
    "begin_suppress_tokens": (([], "[]", None), "GiftLM's samplers suppress no token"),
}


def their_model_args(model_args):
    """GiftLM's model_args from ones in LLaDA's, Dream's or dllm's names too, checked against config.json before the
    model loads (a ValueError naming the argument); on Dream, Dream's lengths also pick its sampler as it evaluates."""
    args = {k: v for k, v in model_args.items() if k not in THEIR_NAMES}
    for theirs, ours in THEIR_NAMES.items():
        if theirs in model_args:
            if ours in args:
                raise ValueError(f"GiftLM: {theirs} is GiftLM's {ours}, given twice; give it once")
            args[ours] = model_args[theirs]
    for name, (honoured, why) in THEIR_FIXED.items():
        if name in args and args.pop(name) not in honoured:
            raise ValueError(f"GiftLM: {name}={model_args[name]!r}: {why}")
    if isinstance(args.get("batch_size"), str) and args["batch_size"].isdigit():  # lm-eval's --batch_size 8: a string
        args["batch_size"] = int(args["batch_size"])
    if not isinstance(args.get("model"), str):
        raise ValueError(f"GiftLM: model {args.get('model')!r}: give a model folder (model, model_path or pretrained)")
    config = read_config(find_model(args["model"])[0])
    if args.pop("mask_id", config.mask_token_id) != config.mask_token_id:
        raise ValueError(f"GiftLM: mask_id={model_args['mask_id']!r}: the model's mask token is {config.mask_token_id}")
    n = args.setdefault("max_length", config.max_sequence_length)  # the context a request is cut to, as theirs
    if type(n) is not int or not 1 < n <= config.max_sequence_length:
        raise ValueError(f"GiftLM: max_length={n!r}: the model reads 2 to {config.max_sequence_length} tokens")
    if config.predicts_shifted and {"max_new_tokens", "diffusion_steps"} & set(model_args) and "sampler" not in args:
        args = {"sampler": "dream", "alg": "entropy"} | args
    return args


DREAM_BOS = "<|beginoftext|>"  # Dream's (Qwen2.5's) BOS: its evaluation's add_bos_token puts it before each context


class GiftLM(LM):
    """A model folder of this repo for lm-evaluation-harness; model_args: HarnessOptions' and SamplerOptions' fields,
    and LLaDA's, Dream's and dllm's names (their_model_args)."""

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        """lm-eval's --model_args string (its own parser), with additional_config (create_from_arg_obj)."""
        from lm_eval.utils import simple_parse_args_string
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """The model_args, lm-eval's own --batch_size, --max_batch_size and --device (additional_config) filling in
        only those they leave out (lm-eval's LM passes both: a TypeError for a batch_size in model_args)."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**(given | dict(arg_dict)))

    def __init__(self, model=None, **model_args):
        super().__init__()
        model_args.pop("max_batch_size", None)  # lm-eval's, for a batch_size "auto", which GiftLM does not take
        model_args = their_model_args(model_args | ({"model": model} if model is not None else {}))
        max_length = model_args.pop("max_length")
        own, names = [f.name for f in fields(HarnessOptions)], [f.name for f in fields(SamplerOptions)]
        unknown = sorted(set(model_args) - set(own) - set(names))
        if unknown:
            raise ValueError(f"GiftLM: unknown model_args {', '.join(unknown)}; GiftLM takes {', '.join(own)} and "
                             f"{', '.join(names)} (and LLaDA's, Dream's and dllm's names: docs/harness.md)")
        opts = HarnessOptions(**{k: v for k, v in model_args.items() if k in own})
        given = argparse.Namespace(model=opts.model, adapter=opts.adapter, **{n: model_args.get(n) for n in names})
        self.folder, self.adapter, self.options, self.given, self.defaults = sampler_sources(given)
        if "gen_length" in self.given:  # no task changes these lengths: refused now, before the model loads
            generation_options(self.given, self.defaults, {})
        self.tokenizer = load_tokenizer(self.folder)
        check_chat_tokens(self.tokenizer, self.folder)  # as eval.py's: the chat format's tokens, before the weights
        bos_text = named_token(self.folder, "bos_token", DREAM_BOS if chat_format(self.tokenizer) == "chatml" else BOS)
        self.bos = [self.tokenizer.token_to_id(bos_text)] if opts.add_bos_token else []  # before every context
        if None in self.bos:
            raise ValueError(f"GiftLM: add_bos_token=True: the tokenizer of {self.folder} has no {bos_text}")
        self._rank, self._world_size, where = setup_distributed()  # torchrun's ranks: each gets a slice
        self._device = torch.device(opts.device) if opts.device and self._world_size == 1 else where
        self.model = load_weights(self.folder, self.adapter, compute_dtype(opts.dtype, self._device), self._device,
                                  merge=True).eval()
        check_mask_token(self.tokenizer, self.model.config)
        self.fmt = chat_format(self.tokenizer)
        self.eot_id = turn_end_id(self.tokenizer)  # confidence_eos_eot_inf
        self.batch_size, self.mc_num, self.seed = opts.batch_size, opts.mc_num, opts.seed
        self.check_greedy, self.max_length = opts.check_greedy, max_length  # the model's, or a shorter max_length
        self.paired = opts.paired
        bos = self.tokenizer.token_to_id(BOS)  # an empty context is this one token (add_bos_token: the family's BOS)
        eos = self.model.config.eos_token_id  # ChatML's (Dream's) empty context
        self.prefix_id = (self.bos or [eos if bos is None or self.fmt == "chatml" else bos])[0]

    # --- what the harness asks of a model ---

    @property
    def tokenizer_name(self):
        return str(self.folder).replace("/", "__")

    def chat_template(self, chat_template=False):
        return self.fmt

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        """The model's own chat format (data.chat_prompt); without add_generation_prompt the last (assistant)
        message is continued as is (a task's gen_prefix, e.g. d1's "<reasoning>")."""
        if add_generation_prompt:
            return chat_prompt(chat_history, self.fmt)
        return chat_prompt(chat_history[:-1], self.fmt) + chat_history[-1]["content"]

    def all_gather(self, tensor):  # the harness's collectives (gather_object and barrier: longjob's)
        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst=0):
        parts = gather_objects(obj)
        return parts if self._rank == dst else None

    def barrier(self):
        barrier()

    # --- requests ---

    def _args(self, request, n, kind):
        """The request's arguments, refusing a shape this model does not read (e.g. a multimodal task's images)."""
        if len(request.args) != n:
            raise ValueError(f"GiftLM: task {request.task_name!r}: a {kind} request with {len(request.args)} "
                             f"arguments (this model reads text only: {n}); not supported")
        return request.args

    def _encode(self, text, request):
        return encode_text(self.tokenizer, text, what=f"task {request.task_name!r}: the text")

    def _context_and_continuation(self, context, continuation, request):
        """Token ids of both, split as the harness's models split them: the context's trailing spaces move to the
        continuation; an empty context is the prefix token; a long context keeps its last tokens."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self._encode(context, request) if context else []
        whole = self._encode(context + continuation, request)
        cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else self._encode(continuation, request)
        if not cont or len(cont) >= self.max_length:
            raise ValueError(f"GiftLM: task {request.task_name!r}: a continuation of {len(cont)} tokens (the "
                             f"model reads 1 to {self.max_length - 1})")
        return (self.bos + ctx or [self.prefix_id])[-(self.max_length - len(cont)):], cont

    def _elbos(self, pairs, paired=False):
        """The ELBO estimate (the mean of mc_num draws) of each (context, continuation) in turn, consecutive ones
        sharing forward passes; seeded by the seed and token ids (paired: the context's alone, so a question's choices
        share their draws), so the same in any order, batch or rank."""
        def rows(context, continuation):
            key = [self.seed, context] if paired else [self.seed, context, continuation]
            digest = hashlib.sha256(json.dumps(key).encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            return elbo_rows(context, continuation, self.mc_num, g, paired)
        draws = elbo_passes(self.model, (row for pair in pairs for row in rows(*pair)), self.batch_size)
        for _ in pairs:
            yield torch.tensor(list(itertools.islice(draws, self.mc_num)), dtype=torch.float64).mean().item()

    def loglikelihood(self, requests):
        """(ELBO estimate of log p(continuation | context), is_greedy) per request."""
        pairs = [self._context_and_continuation(*self._args(r, 2, "loglikelihood"), r) for r in requests]
        out, elbos = [], self._elbos(pairs, self.paired)
        for request, (ctx, cont), elbo in zip(self._with_progress(requests, "loglikelihood"), pairs, elbos):
            out.append((elbo, bool(self.check_greedy) and greedy_continuation(self.model, ctx, len(cont)) == cont))
            self.cache_hook.add_partial("loglikelihood", request.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests):
        """The ELBO of the whole text after the prefix token; a text longer than the context in windows of
        max_length / 2 tokens, each after the max_length / 2 before it (a sum of conditional ELBOs, a lower bound)."""
        windows = []
        for request in requests:
            (text,) = self._args(request, 1, "loglikelihood_rolling")
            ids = [self.prefix_id] + (self._encode(text, request) if text else [])
            window = self.max_length - 1 if len(ids) <= self.max_length else self.max_length // 2
            windows.append([(ids[max(0, s - (self.max_length - window)):s], ids[s:s + window])
                            for s in range(1, len(ids), window)])
        out, elbos = [], self._elbos([pair for ws in windows for pair in ws])  # never paired: one text each
        for request, ws in zip(self._with_progress(requests, "loglikelihood_rolling"), windows):
            out.append(sum(next(elbos) for _ in ws))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, out[-1])
        return out

    def _with_progress(self, requests, kind):
        """The requests in turn; rank 0 says how far it is every PROGRESS_SECONDS (a likelihood request is mc_num /
        batch_size forward passes: with a large mc_num, hours of them)."""
        start = said = time.time()
        for done, request in enumerate(requests, 1):
            yield request
            if self._rank == 0 and time.time() - said >= PROGRESS_SECONDS:
                said = time.time()
                print(f"GiftLM: {kind}: {done}/{len(requests)} requests, ETA "
                      f"{hms(seconds_left(start, done, len(requests) - done))}", flush=True)

    def _generation_options(self, gen_kwargs, task):
        """(options, n): the sampler's options for a task's request and the tokens of each answer returned (None:
        all), model_args before the task before the model folder (generation_options)."""
        return generation_options(self.given, self.defaults, task_generation(task, gen_kwargs, self.given))

    def _sample(self, prompts, options, noise):
        """The answers (B lists of gen_length ids) to a batch of token-id prompts, left-padded, each drawing from its
        own generator, item_generator(seed, its noise) (either sampler: Dream's takes one per row), so that an answer
        does not depend on its batch (eval.sample_answers' call, the generators per request)."""
        device = next(self.model.parameters()).device
        prompt, attention_mask = left_padded(prompts, self.model.config.pad_token_id)  # (B, P)
        generators = [item_generator(self.seed, i, device) for i in noise] if options.draws else None
        out = generate_with_options(self.model, prompt.to(device), attention_mask.to(device), options, generators,
                                    stop_ids(self.tokenizer), eot_id=self.eot_id)
        return out[:, prompt.shape[1]:].tolist()

    def generate_until(self, requests):
        """Each context sampled with the options, in batches of batch_size consecutive requests with the same
        generation arguments; the text up to the family's turn end, then up to the first `until` string. A prompt that
        leaves no room for its answer in the context is refused, naming its task, before any is sampled (as eval.py's
        prompts are); an empty one is the prefix token."""
        out, start, seen, noise, prompts = [], 0, {}, [], []
        for request in requests:  # its sampling noise: item_generator(seed, doc_id), as eval.py's items'
            key = (request.task_name, request.doc_id)
            noise.append((request.doc_id or 0) + seen.get(key, 0) * 2 ** 32)  # a repeat (same doc) draws anew
            seen[key] = seen.get(key, 0) + 1
            context, kwargs = self._args(request, 2, "generate_until")
            prompts.append(self.bos + self._encode(context, request) or [self.prefix_id])
            gen_length = self._generation_options(kwargs, request.task_name)[0].gen_length
            if len(prompts[-1]) + gen_length > self.max_length:
                raise ValueError(f"GiftLM: task {request.task_name!r}: a prompt of {len(prompts[-1])} tokens + "
                                 f"{gen_length} to generate exceed the model's max_sequence_length {self.max_length}; "
                                 "lower the task's max_gen_toks (or gen_length) or its few-shot examples")
        while start < len(requests):
            kwargs = self._args(requests[start], 2, "generate_until")[1]
            end = start + 1
            while (end < len(requests) and end - start < self.batch_size
                   and self._args(requests[end], 2, "generate_until")[1] == kwargs):
                end += 1
            options, n = self._generation_options(kwargs, requests[start].task_name)
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            answers = self._sample(prompts[start:end], options, noise[start:end])  # (B, gen_length) ids
            for request, answer in zip(requests[start:end], answers):
                out.append(cut_at_stops(decode_until_stop(self.tokenizer, answer[:n]), until))
                self.cache_hook.add_partial("generate_until", request.args, out[-1])
            start = end
        return out


if HARNESS_MISSING:
    del GiftLM  # harness.GiftLM says how to install lm-eval (__getattr__)
else:
    with contextlib.suppress(ValueError):  # registered already by this file loaded under another name (__main__)
        model_registry.register("gift")(GiftLM)


def __getattr__(name):
    """harness.GiftLM without lm-eval installed: an ImportError saying how to install it, in one line."""
    if name == "GiftLM" and HARNESS_MISSING:
        raise ImportError(HARNESS_MISSING)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lm_eval_main():
    """lm-eval's own command line (`lm_eval run ...`, sys.argv) with the model "gift" registered: docs/harness.md's
    gift_lm_eval. A user's mistake (a model_arg, a task's generation_kwargs, ...) ends in one line on stderr, exit
    status 1, as python harness.py's."""
    if HARNESS_MISSING:
        raise SystemExit(f"gift_lm_eval: {HARNESS_MISSING}")
    from lm_eval.__main__ import cli_evaluate
    run_command_line(cli_evaluate, "gift_lm_eval")


# -----------------------------------------------------------------------------
# The command line: python harness.py

def harness_tasks(args, check_generation=task_generation):
    """--tasks as lm-eval's Task (and Group) objects, and their TaskManager, checked before the model loads (a
    ValueError naming the flag or task): each name known and its YAML read (lm-eval renders the first document),
    its generation_kwargs (check_generation(name, kwargs)), a document for each torchrun rank (a rank without one
    stops the others), its few-shot examples."""
    from lm_eval.evaluator_utils import get_sample_size
    from lm_eval.tasks import TaskManager
    names = [name.strip() for name in args.tasks.split(",")]
    if not all(names):
        raise ValueError(f"--tasks {args.tasks!r}: an empty name (names are separated by commas)")
    if args.include_path and not os.path.isdir(args.include_path):
        raise ValueError(f"--include-path {args.include_path}: no such folder")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit {args.limit:g}: must be > 0 (documents, or a share of them below 1)")
    if (args.num_fewshot or 0) < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: must be 0 or more")
    here = TaskManager(include_path=args.include_path, include_defaults=False) if args.include_path else None
    if here is None or not set(names) <= set(here.all_tasks):  # lm-eval's own: indexing them takes a while
        here = TaskManager(include_path=args.include_path)
    loaded = dict(tasks={}, groups={}, group_map={})
    for name in names:
        try:  # a user's YAML: a template that fails, a missing data file; lm-eval's index skips one it cannot read
            for key, part in here.load(name).items():
                loaded[key].update(part)
        except Exception as e:
            bad = "".join(f"; it cannot read {path} ({' '.join(str(why).split())[:200]})"
                          for path, why in unreadable_yamls(args.include_path))
            raise ValueError(f"--tasks {name}: lm-eval cannot load it ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]}){bad}") from e
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name, task in loaded["tasks"].items():
        docs, own = task.eval_docs, task.get_config("num_fewshot")
        if min(len(docs), get_sample_size(task, args.limit) or len(docs)) < world:
            raise ValueError(f"task {name}: fewer documents to evaluate (--limit {args.limit}) than the {world} ranks; "
                             "each rank needs one")
        shots = own if args.num_fewshot is None or own == 0 else args.num_fewshot  # as simple_evaluate sets it
        pool = (len(task.sampler.fewshot_docs()) - (task.fewshot_cfg.split == task.config.test_split)
                if hasattr(task, "sampler") else 0)  # a test document is not its own example
        if (shots or 0) > pool:
            raise ValueError(f"--num-fewshot {shots}: task {name} has {max(pool, 0)} few-shot examples")
        if task.get_config("output_type") == "generate_until":
            check_generation(name, task.get_config("generation_kwargs") or {})
    children = {child for group in loaded["group_map"].values() for child in group}  # the named ones, in groups
    return [o for name, o in {**loaded["groups"], **loaded["tasks"]}.items() if name not in children], here


def unreadable_yamls(folder):
    """(path, exception) of each YAML file under `folder` (None: none) that lm-eval's loader cannot read."""
    from lm_eval.tasks._yaml_loader import load_yaml
    for path in sorted(Path(folder).rglob("*.yaml")) if folder else []:
        try:
            load_yaml(path, resolve_func=False)
        except Exception as e:  # what lm-eval's index catches, and skips
            yield path, e


HARNESS_FIELDS = ("results", "configs", "versions", "config")  # lm-eval's results, as harness.py writes them


def check_harness_out(out):
    """A ValueError unless harness.py may write its results to `out`: a new file in an existing folder, or the
    results of an earlier harness.py (never a model's config.json, a task's data or a user's JSON)."""
    if out.is_dir() or not out.parent.is_dir():
        raise ValueError(f"--out {out}: {'a folder' if out.is_dir() else 'its folder does not exist'}; name a results "
                         ".json file in an existing folder")
    if out.exists() and not (set(HARNESS_FIELDS) <= (old := json_or_empty(out)).keys()
                             and isinstance(old["config"], dict) and old["config"].get("model") in ("GiftLM", "gift")):
        raise ValueError(f"--out {out}: the file exists and is not the results of harness.py; it would be "
                         "replaced: name another --out, or move the file away")


def harness_main(argv=None):
    """python harness.py: lm-eval's tasks (or --include-path's YAMLs); rank 0 prints the table, writes --out."""
    p = argparse.ArgumentParser(description="Evaluate a LLaDA or Dream model on lm-evaluation-harness tasks "
                                            "(torchrun --nproc_per_node N harness.py ... for several GPUs).")
    add_model_flags(p)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. arc_easy,gsm8k")
    p.add_argument("--include-path", default=None, help="folder of task YAMLs of your own")
    p.add_argument("--limit", type=float, default=None, help="only the first N documents of each task")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument("--apply-chat-template", action="store_true", help="wrap each prompt in the model's chat format")
    p.add_argument("--mc-num", type=int, default=128, help="Monte Carlo draws (forward passes) per likelihood")
    p.add_argument("--no-check-greedy", action="store_true",
                   help="is_greedy always False (saves the L greedy passes of each likelihood request)")
    p.add_argument("--paired-draws", action="store_true", help="the choices of a question share their likelihood "
                   "draws (the same l and masks): less noise between choices, each estimate still unbiased")
    p.add_argument("--seed", type=int, default=0, help="seed of the likelihood draws and of sampling")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts per generate call; likelihood draws per forward pass")
    add_dtype_flag(p, DTYPES + ("float64",))
    p.add_argument("--out", default=None, help="write the harness's results (JSON) here")
    add_sampler_flags(p)
    args = p.parse_args(argv)
    if HARNESS_MISSING:
        raise SystemExit(f"harness.py: {HARNESS_MISSING}")
    import lm_eval
    from lm_eval.utils import make_table
    try:  # the flags (GiftLM checks its model_args again), --out and the tasks, before the model loads
        HarnessOptions(args.model, adapter=args.adapter, dtype=args.dtype, batch_size=args.batch_size,
                       mc_num=args.mc_num, seed=args.seed)
        options_from_flags(args)
        if args.out:
            check_harness_out(Path(args.out))
        _, _, _, given, defaults = sampler_sources(args)

        def check_generation(name, kwargs):  # each task's lengths and temperature, as GiftLM will take them
            generation_options(given, defaults, task_generation(name, kwargs, given))
        tasks, task_manager = harness_tasks(args, check_generation)
    except ValueError as e:
        p.error(str(e))
    sampler = {f.name: getattr(args, f.name) for f in fields(SamplerOptions) if getattr(args, f.name) is not None}
    lm = GiftLM(model=args.model, adapter=args.adapter, dtype=args.dtype, batch_size=args.batch_size,
                mc_num=args.mc_num, seed=args.seed, check_greedy=not args.no_check_greedy, paired=args.paired_draws,
                **sampler)
    limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit,
                                      apply_chat_template=args.apply_chat_template, log_samples=False,
                                      task_manager=task_manager, random_seed=args.seed, numpy_random_seed=args.seed,
                                      torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    if lm.rank == 0:
        print(make_table(results))
        if args.out:
            atomic_write_text(args.out, json.dumps(results, indent=1, default=str))
            print(f"wrote {args.out}")
    end_distributed()
    return results


if __name__ == "__main__":
    run_command_line(harness_main, "harness.py")  # a user's mistake: one line, exit status 1
