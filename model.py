"""LLaDA, the bidirectional masked-diffusion transformer, written from scratch, plus a hand-rolled LoRA.

Module names follow the official checkpoint (`model.transformer.blocks.0.q_proj.weight`, ...) so that real
LLaDA-8B folders load with no renaming table. The architecture (pinned by the official code's golden vectors in
tests/golden, github.com/ML-GSAI/LLaDA's Hugging Face modeling_llada.py):
    x = wte(ids)                                                       # no scaling, no position table
    per block:  h = x + attn_out(Attn(RoPE(q_proj(n)), RoPE(k_proj(n)), v_proj(n))),  n = attn_norm(x)
                x = h + ff_out(silu(ff_proj(m)) * up_proj(m)),                         m = ff_norm(h)
    logits = ff_out_head(ln_f(x))                                      # untied LM head, no logit scaling
Attention is full (non-causal): every token sees every non-padding token.

The same transformer runs Dream-v0 (github.com/HKUNLP/Dream: Qwen2.5 made bidirectional, model_type "Dream"): a Family
field (FAMILIES) carries each difference, never a second copy of a block; Qwen's field and key names are translated at
every file boundary (DREAM_FIELDS, DREAM_MODULES), and its logits at i - 1 predict token i, left to the caller.
"""

import collections
import contextlib
import copy
import dataclasses
import functools
import json
import math
import numbers
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

# -----------------------------------------------------------------------------
# Config: the official config.json, field for field


# Dream-v0's config.json names for our fields, and DreamConfig's default for a field its config.json leaves out (the
# official configuration_dream.py; eos, which it does not set, Dream-v0-7B's); its other fields are kept in `extra`
DREAM_FIELDS = dict(
    d_model=("hidden_size", 4096), n_heads=("num_attention_heads", 32), n_kv_heads=("num_key_value_heads", 32),
    n_layers=("num_hidden_layers", 32), mlp_hidden_size=("intermediate_size", 22016), vocab_size=("vocab_size", 151936),
    max_sequence_length=("max_position_embeddings", 32768), rope_theta=("rope_theta", 10000.0),
    rms_norm_eps=("rms_norm_eps", 1e-6), mask_token_id=("mask_token_id", 151666), pad_token_id=("pad_token_id", 151643),
    eos_token_id=("eos_token_id", 151643), weight_tying=("tie_word_embeddings", False),
    activation_type=("hidden_act", "silu"), attention_dropout=("attention_dropout", 0.0))
# Dream's checkpoint names of our modules, LLaDA's being ours: a block's ({i}: its index), then the others
DREAM_BLOCK = dict(attn_norm="input_layernorm", q_proj="self_attn.q_proj", k_proj="self_attn.k_proj",
                   v_proj="self_attn.v_proj", attn_out="self_attn.o_proj", ff_norm="post_attention_layernorm",
                   ff_proj="mlp.gate_proj", up_proj="mlp.up_proj", ff_out="mlp.down_proj")
DREAM_MODULES = (*((f"model.transformer.blocks.{{i}}.{ours}", f"model.layers.{{i}}.{theirs}")
                   for ours, theirs in DREAM_BLOCK.items()),
                 ("model.transformer.wte", "model.embed_tokens"), ("model.transformer.ln_f", "model.norm"),
                 ("model.transformer.ff_out", "lm_head"))


@dataclass(frozen=True)
class Family:
    """What sets a model family apart (LLaDAConfig.family, from model_type): code asks these, never the name."""
    architecture: str  # as errors and the run's banner name it
    fields: dict  # config.json's names of our fields and their defaults, {} = ours (LLaDA's)
    modules: tuple  # checkpoint names of our modules, () = ours
    implied: dict  # fields its config.json does not say (Dream: q/k/v biases, embedding rows = vocab_size)
    may_tie_head: bool  # the LM head may be the embedding matrix (weight_tying)
    predicts_shifted: bool  # the logits at position i - 1 predict token i (its generation code shifts them right)
    rope_in_float32: bool  # RoPE in float32 (LLaDA's rope_full_precision); else in the activations' dtype (Dream)
    pad_attends_nothing: bool  # a padded query attends to nothing, and the embedding's pad row is padding_idx (Dream)


FAMILIES = {  # config.json's model_type -> the family (none: LLaDA, a config made in code)
    "llada": Family("LLaDA-8B", {}, (), {}, may_tie_head=False, predicts_shifted=False, rope_in_float32=True,
                    pad_attends_nothing=False),
    "Dream": Family("Dream-v0", DREAM_FIELDS, DREAM_MODULES, dict(include_qkv_bias=True, embedding_size=None),
                    may_tie_head=True, predicts_shifted=True, rope_in_float32=False, pad_attends_nothing=True),
}
# config.json's fields of what neither family computes, each at its value that turns it off: refused alike otherwise
TURNED_OFF = dict(rope_scaling=None, use_sliding_window=False, sliding_window=None)

TIED_HEAD = "model.transformer.ff_out.weight"  # with weight_tying, the embedding matrix: not stored a second time


def rename(name, pairs):
    """`name` (a module, parameter or PEFT key) with its leading module path replaced by the pair that matches it."""
    for src, dst in pairs:
        if m := re.match(re.escape(src).replace(r"\{i\}", r"(\d+)") + r"(?=\.|$)", name):
            return dst.replace("{i}", "".join(m.groups())) + name[m.end():]
    return name


POSITIVE = dict(range="[1, inf)", what="must be positive")  # a size (check_value's rule)
FIXED = dict(fixed=True)  # a field this implementation cannot change: check() refuses any other value


@dataclass
class LLaDAConfig:
    """The config of LLaDA, whose config.json this is field for field (defaults: LLaDA-8B-Instruct's), and of Dream-v0
    (model_type "Dream": its names read through DREAM_FIELDS). A field's rule (check_value) is its metadata."""
    d_model: int = field(default=4096, metadata=POSITIVE)
    n_heads: int = field(default=32, metadata=POSITIVE)
    n_kv_heads: int | None = field(default=32, metadata=POSITIVE)
    n_layers: int = field(default=32, metadata=POSITIVE)
    mlp_hidden_size: int | None = field(default=12288, metadata=POSITIVE)  # when None: mlp_ratio * d_model
    mlp_ratio: int = field(default=4, metadata=POSITIVE)
    vocab_size: int = field(default=126464, metadata=POSITIVE)
    embedding_size: int | None = field(default=126464, metadata=POSITIVE)  # rows of wte and the LM head (None: vocab)
    # the two real numbers the forward uses: a value that would make every loss NaN is refused here, by name
    rope_theta: float = field(default=500000.0, metadata=dict(range="(1, inf)", what=(
        "must be a finite number greater than 1 (RoPE's base: theta^(-2i/head_dim) falls with i; LLaDA-8B's 500000)")))
    rms_norm_eps: float = field(default=1e-5, metadata=dict(range=f"[{torch.finfo(torch.float32).tiny}, inf)", what=(
        "must be a finite positive number, at least 1.2e-38 (RMSNorm's epsilon, added in float32; LLaDA-8B's 1e-05)")))
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    max_sequence_length: int = field(default=4096, metadata=POSITIVE)
    activation_type: str = field(default="silu", metadata=FIXED)
    block_type: str = field(default="llama", metadata=FIXED)
    layer_norm_type: str = field(default="rms", metadata=FIXED)
    weight_tying: bool = field(default=False, metadata=FIXED)
    include_bias: bool = field(default=False, metadata=FIXED)
    include_qkv_bias: bool = field(default=False, metadata=FIXED)
    bias_for_layer_norm: bool = field(default=False, metadata=FIXED)
    layer_norm_with_affine: bool = field(default=True, metadata=FIXED)
    alibi: bool = field(default=False, metadata=FIXED)
    rope: bool = field(default=True, metadata=FIXED)
    scale_logits: bool = field(default=False, metadata=FIXED)
    input_emb_norm: bool = field(default=False, metadata=FIXED)
    attention_layer_norm: bool = field(default=False, metadata=FIXED)
    block_group_size: int = field(default=1, metadata=FIXED)
    multi_query_attention: bool | None = None
    attention_dropout: float = field(default=0.0, metadata=FIXED)
    residual_dropout: float = field(default=0.0, metadata=FIXED)
    embedding_dropout: float = field(default=0.0, metadata=FIXED)
    model_type: str | None = None  # a key of FAMILIES (None: LLaDA, a config made in code, written without it)
    extra: dict = field(default_factory=dict)  # config.json's other fields, kept verbatim: a round trip loses nothing
    source: dataclasses.InitVar[str] = "config"  # what errors name: config.json's path

    def __post_init__(self, source="config"):
        """Each field's type and rule (check_fields; null only where allowed), the derived ones filled, then check()."""
        def said(name):  # the field as config.json writes it
            return f"{source}: field {self.json_name(name)!r} = {json.dumps(getattr(self, name), default=repr)}"

        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None and type(None) not in getattr(f.type, "__args__", ()):
                raise ValueError(f"{said(f.name)}: must not be null")
        check_fields(self, said)
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.mlp_hidden_size = self.mlp_hidden_size or self.mlp_ratio * self.d_model
        self.embedding_size = self.embedding_size or self.vocab_size
        self.check(source)

    def check(self, source="config"):
        if self.model_type not in (None, *FAMILIES):
            raise ValueError(f"{source}: field 'model_type' = {self.model_type!r} is not supported (this "
                             "implementation computes LLaDA, model_type \"llada\", and Dream-v0, \"Dream\")")
        family, n = self.family, self.json_name
        # Dream-v0 (Qwen2.5) computes LLaDA's fixed choices but two: biases on q, k, v, and a head tied or not
        required = {f.name: family.implied.get(f.name, f.default) for f in dataclasses.fields(self)
                    if f.metadata.get("fixed") and not (f.name == "weight_tying" and family.may_tie_head)}
        window = "use_sliding_window" if "use_sliding_window" in self.extra else "sliding_window"  # Qwen2's, or a size
        fixed = ([(n(k), getattr(self, k), want) for k, want in required.items()]
                 + [(k, self.extra.get(k, TURNED_OFF[k]), TURNED_OFF[k]) for k in ("rope_scaling", window)])  # in extra
        for name, value, want in fixed:
            if value != want:
                raise ValueError(f"{source}: field {name!r} = {value!r} is not supported (this implementation "
                                 f"computes the {family.architecture} architecture, {name} = {want!r})")
        if self.multi_query_attention and self.n_kv_heads != 1:
            raise ValueError(f"{source}: multi_query_attention is true but n_kv_heads = {self.n_kv_heads}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"{source}: {n('d_model')} ({self.d_model}) must divide by {n('n_heads')} "
                             f"({self.n_heads}) and {n('n_heads')} by {n('n_kv_heads')} ({self.n_kv_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"{source}: head_dim = {n('d_model')} / {n('n_heads')} must be even for RoPE")
        if family.pad_attends_nothing and not 0 <= self.pad_token_id < self.embedding_size:  # wte's padding_idx
            raise ValueError(f"{source}: field 'pad_token_id' = {self.pad_token_id} is not a row of the embedding "
                             f"(vocab_size {self.vocab_size})")

    @property
    def head_dim(self):
        return self.d_model // self.n_heads

    @property
    def family(self):
        """The family config.json's model_type names (FAMILIES; none: LLaDA)."""
        return FAMILIES.get(self.model_type or "llada", FAMILIES["llada"])

    @property
    def predicts_shifted(self):  # Family.predicts_shifted (shift_right aligns such outputs)
        return self.family.predicts_shifted

    def json_name(self, name):
        """Our field `name` as this family's config.json spells it (Dream: DREAM_FIELDS)."""
        return self.family.fields.get(name, (name,))[0]

    def checkpoint_name(self, name):
        """Our module or parameter name as this family's checkpoint and PEFT adapters spell it."""
        return rename(name, self.family.modules)

    def module_name(self, key):
        """A checkpoint key or module name of this family, as our module tree spells it."""
        return rename(key, [(theirs, ours) for ours, theirs in self.family.modules])

    @classmethod
    def from_json(cls, path):
        raw = read_json(path, "; config.json is the model's Hugging Face config, one JSON object of fields")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw, source="config"):
        """config.json's fields `raw`, Dream's read through DREAM_FIELDS (one left out: DreamConfig's default)."""
        family = FAMILIES.get(raw.get("model_type"), FAMILIES["llada"])  # an unknown model_type: refused by check()
        names = ({ours: theirs for ours, (theirs, _) in family.fields.items()} if family.fields else
                 {f.name: f.name for f in dataclasses.fields(cls) if f.name not in ("model_type", "extra")})
        given = {ours: raw[theirs] for ours, theirs in names.items() if theirs in raw}
        defaults = {ours: default for ours, (_, default) in family.fields.items()}
        extra = {k: v for k, v in raw.items() if k not in {*names.values(), "model_type"}}
        return cls(**defaults | given | family.implied, model_type=raw.get("model_type"), extra=extra, source=source)

    def to_dict(self):
        """config.json's fields, named as this family's config.json names them, `extra` included."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if self.family.fields:
            d = {theirs: d[ours] for ours, (theirs, _) in self.family.fields.items()} | {"model_type": self.model_type}
        elif self.model_type is None:  # a config made in code: its config.json says no model_type
            del d["model_type"]
        return dict(sorted({**self.extra, **d}.items()))  # HF writes keys sorted

    def to_json(self, path):
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


# -----------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in float32, cast back, then times the weight (as the official code)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(L, head_dim, theta, device, positions=None):
    """RoPE's cos, sin over the whole head_dim (rotate-half layout) in float32: (L, head_dim) for positions 0 .. L - 1,
    or (B, 1, L, head_dim) for `positions` (B, L)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if positions is None:
        angles = torch.outer(torch.arange(L, device=device, dtype=torch.float32), inv_freq)  # (L, head_dim/2)
    else:
        angles = positions.to(device, torch.float32)[:, None, :, None] * inv_freq  # (B, 1, L, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # duplicated over the two halves
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin, in_float32=True):
    """x (B, H, L, hd): x*cos + rotate_half(x)*sin, rotate_half([a, b]) = [-b, a], in float32 (LLaDA), or else in x's
    dtype with cos and sin rounded to it (Dream's official code: the same in float32, not in bf16)."""
    x32, cos, sin = (x.float(), cos, sin) if in_float32 else (x, cos.to(x.dtype), sin.to(x.dtype))
    a, b = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-b, a], dim=-1) * sin).to(x.dtype)


class Block(nn.Module):
    """Pre-norm LLaMA-style block with bidirectional attention and a SwiGLU MLP (official names)."""

    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        D, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.rope_in_float32 = cfg.family.rope_in_float32
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        bias = cfg.include_qkv_bias  # Dream (Qwen2.5) has biases on q, k and v, LLaDA none
        self.q_proj = nn.Linear(D, cfg.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, cfg.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, cfg.n_kv_heads * hd, bias=bias)
        self.attn_out = nn.Linear(D, D, bias=False)
        self.ff_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(D, cfg.mlp_hidden_size, bias=False)  # gate branch: SiLU applies here
        self.up_proj = nn.Linear(D, cfg.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, D, bias=False)

    def forward(self, x, rope, key_mask, kv=None):
        """x (B, S, D); rope (S, hd) or (B, 1, S, hd) complex, cos + i sin of these positions (LLaDA.forward says why
        complex); key_mask None or (B, 1, 1 or S, L) bool, True = may be attended to. kv: None, or this block's
        key/value cache (LLaDA.forward's `cache`): kv(q, k, v, key_mask) -> the keys and values to attend to."""
        B, L, D = x.shape
        cos, sin = rope.real, rope.imag  # (L, hd) or (B, 1, L, hd) float32
        n = self.attn_norm(x)
        q = self.q_proj(n).view(B, L, self.n_heads, -1).transpose(1, 2)  # (B, H, L, hd)
        k = self.k_proj(n).view(B, L, self.n_kv_heads, -1).transpose(1, 2)  # (B, Hkv, L, hd)
        v = self.v_proj(n).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.rope_in_float32), apply_rope(k, cos, sin, self.rope_in_float32)
        if kv is not None:
            k, v = kv(q, k, v, key_mask)
        # grouped-query attention: kv head j serves query heads j*g .. j*g+g-1 (what enable_gqa does)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=False,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        h = x + self.attn_out(y.transpose(1, 2).reshape(B, L, D))
        m = self.ff_norm(h)
        return h + self.ff_out(F.silu(self.ff_proj(m)) * self.up_proj(m))


def unwrap(model):
    """The model itself: DDP keeps it in .module (FSDP2 does not wrap)."""
    return getattr(model, "module", model)


def shift_right(h):
    """Dream's outputs (B, L, ...) aligned as its official code: i gets i - 1's (0 its own), so i predicts token i."""
    return torch.cat([h[:, :1], h[:, :-1]], dim=1)


def padded_positions(attention_mask):
    """Dream's RoPE positions (tok_idx) for a left-padded batch: cumsum(mask) - 1, and 1 on pads; None if unpadded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def predicting_hidden(model, input_ids, attention_mask=None, cache=None):
    """The final hidden states (B, L, D) predicting each token of input_ids at its position, from one call of the
    wrapper (DDP / FSDP see it); Dream's moved right (shift_right), at padded_positions. Part I's and the samplers'
    (cache: the cached sampler's KVCache, input_ids then a span of the sequence attention_mask covers)."""
    shifted = getattr(unwrap(model), "predicts_shifted", False)
    kw = {"position_ids": padded_positions(attention_mask)} if shifted else {}  # (B, L) or None
    kw |= {"cache": cache} if cache is not None else {}
    h = model(input_ids, attention_mask=attention_mask, return_hidden=True, **kw)  # (B, L, D)
    return shift_right(h) if shifted else h


class LLaDA(nn.Module):
    """LLaDA, the paper's main model, and Dream-v0 when config.model_type is "Dream": one tree in LLaDA's names."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.config = config
        # Dream's embedding takes the pad id as padding_idx (as the official code): that row gets no input gradient
        padding_idx = config.pad_token_id if config.family.pad_attends_nothing else None
        self.model = nn.Module()  # the extra level gives the official "model.transformer.*" key names
        self.model.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.embedding_size, config.d_model, padding_idx=padding_idx),
            blocks=nn.ModuleList([Block(config) for _ in range(config.n_layers)]),
            ln_f=RMSNorm(config.d_model, config.rms_norm_eps),
            ff_out=nn.Linear(config.d_model, config.embedding_size, bias=False),  # LM head (untied unless tied)
        ))
        self.tie_weights()
        self.activation_checkpointing = False

    @property
    def head(self):
        """The LM head as a module: apply it only to the hidden states whose logits are needed."""
        return self.model.transformer.ff_out

    @property
    def predicts_shifted(self):  # Family.predicts_shifted
        return self.config.predicts_shifted

    def tie_weights(self):
        """With weight_tying the head's weight IS the embedding matrix, as in HF (loads with assign=True untie it)."""
        if self.config.weight_tying:
            self.model.transformer.ff_out.weight = self.model.transformer.wte.weight

    def _apply(self, fn, *args, **kwargs):  # .to(), .to_empty(), .cuda(), .float(), ...: keep a tied head tied
        super()._apply(fn, *args, **kwargs)
        self.tie_weights()
        return self

    def set_activation_checkpointing(self, enabled=True):
        """Recompute each block in backward instead of storing its activations (needed for 4096-token training)."""
        self.activation_checkpointing = enabled

    @torch.no_grad()
    def init_weights(self, generator=None, std=0.02):
        """Random init for models trained from scratch: normal(0, std) matrices, unit norm weights, zero biases."""
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
        return self

    def forward(self, input_ids, attention_mask=None, return_hidden=False, position_ids=None, cache=None):
        """input_ids (B, L); attention_mask (B, L), 1 = real token, 0 = padding (hidden from every query; for Dream a
        padding query also sees no key, as its official code); position_ids (B, L), RoPE's (default 0 .. L - 1).
        Returns logits (B, L, V) aligned as the official model's (predicts_shifted), or with return_hidden the states
        after ln_f (B, L, D). cache (inference): a sampler's key/value cache (cached_sample.KVCache, as gpt-fast's):
        input_ids are then positions cache.start .. cache.start + L - 1 of cache.length tokens (the mask and positions
        cover all of them); block i attends through cache.layer(i)."""
        tr = self.model.transformer
        B, L = input_ids.shape
        x = tr.wte(input_ids)  # (B, L, D)
        start, L_all = (0, L) if cache is None else (cache.start, cache.length or L)
        cos, sin = rope_cos_sin(L_all, self.config.head_dim, self.config.rope_theta, x.device, position_ids)
        # one complex tensor, (L, hd) (or (B, 1, L, hd)) for this span's positions: FSDP2's mixed precision casts a
        # block's floating-point inputs to bf16, which would round the cos and sin tables that the official code keeps
        # in float32; a complex tensor is not cast (tests/test_bf16.py shows both)
        rope = torch.complex(cos, sin)[..., start:start + L, :]
        key_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L_all): True = may be attended to
            if self.config.family.pad_attends_nothing:  # and only from real queries: (B, 1, L, L_all)
                key_mask = key_mask & attention_mask.bool()[:, None, start:start + L, None]
        for i, block in enumerate(tr.blocks):
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, rope, key_mask, use_reentrant=False)
            else:
                x = block(x, rope, key_mask, None if cache is None else cache.layer(i))
        h = tr.ln_f(x)
        return h if return_hidden else self.head(h)

    # -------------------------------------------------------------------------
    # Checkpoint I/O in the Hugging Face layout

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None):
        """A Hugging Face folder, LLaDA's or Dream's (config.json's model_type): built on the meta device and filled
        shard by shard, so peak memory is about one copy of the weights. dtype None keeps the stored dtype."""
        config = read_config(path)  # checked against the weights' headers before anything is built
        with torch.device("meta"):
            model = cls(config)
        device = str(torch.device(device)) if device is not None else "cpu"
        for shard in weight_files(path):
            with open_weights(shard, device=device) as f:
                part = {k: (f.get_tensor(k) if dtype is None else f.get_tensor(k).to(dtype)) for k in f.keys()}
            for k, t in part.items():  # after the cast, so an overflow to inf in a narrower dtype is caught too
                check_finite(t, k, shard)
            model.load_state_dict({config.module_name(k): t for k, t in part.items()}, strict=False, assign=True)
            del part
        model.tie_weights()  # a tied head (not in the files) is the embedding just loaded
        return model

    def save_pretrained(self, path, max_shard_bytes=5 * 10**9):
        """config.json and safetensors shards of at most max_shard_bytes (an index when more than one) in the family's
        own names, a tied head stored once, as Hugging Face saves them; atomic_folder keeps a user's other files."""
        if any(isinstance(m, LoRALinear) for m in self.modules()):
            raise ValueError("the model has LoRA adapters: merge_lora(model) first, or save them with save_adapter")
        state = self.state_dict()
        state = {name: state[k].detach().contiguous().cpu() for name, k in checkpoint_keys(self.config, state).items()}
        config, dtypes = self.config, {v.dtype for v in state.values() if v.is_floating_point()}
        if len(dtypes) == 1:  # config.json's torch_dtype says what the files hold
            config = dataclasses.replace(config, extra={**config.extra, "torch_dtype": str(dtypes.pop())[6:]})
        shards, size = [{}], 0  # in order, a new one when the next tensor would pass max_shard_bytes
        for k, v in state.items():
            if shards[-1] and size + v.nbytes > max_shard_bytes:
                shards, size = shards + [{}], 0
            shards[-1][k], size = v, size + v.nbytes
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        with atomic_folder(path, own=r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?") as tmp:
            config.to_json(tmp / "config.json")
            for name, shard in zip(names, shards):
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())},
                         "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def weight_files(path):
    """The safetensors files of a Hugging Face folder: model.safetensors, or the shards its index lists."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        hint = "; it must be a JSON object whose 'weight_map' maps each tensor name to its shard file"
        weight_map = read_json(index, hint).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError(f"{index}: not a safetensors index{hint}")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    if missing := [f for f in files if not f.exists()]:
        raise FileNotFoundError(f"{missing[0]}: listed in {index.name} but missing")
    return files


@contextlib.contextmanager
def open_weights(file, device="cpu"):
    """safe_open, which checks the header at once: an empty, truncated or foreign file fails here, named."""
    open_regular(file).close()  # a FIFO would block safe_open
    try:
        f = safe_open(str(file), framework="pt", device=device)
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}; {Path(file).stat().st_size} bytes on "
                         "disk). An interrupted download or copy leaves such a file: fetch it again") from None
    with f:
        yield f


def check_finite(t, key, file):
    """Refuse a tensor holding NaN or inf (a diverged run or an overflowing cast writes them)."""
    flat, n = t.reshape(-1), 1 << 22  # checked in slices: isfinite's temporaries stay a few MB, not 5 B / element
    if t.is_floating_point() and not all(bool(torch.isfinite(flat[i:i + n]).all()) for i in range(0, len(flat), n)):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{file}: tensor {key!r} holds {bad} NaN or infinite values (of {t.numel()} {t.dtype}): a "
                         "diverged run saved it, or a cast overflowed; load an earlier checkpoint, or in a wider dtype")


def checkpoint_keys(config, keys):
    """{checkpoint key (config.checkpoint_name): our state-dict key} of a checkpoint's tensors, a tied head left out."""
    return {config.checkpoint_name(k): k for k in keys if not (config.weight_tying and k == TIED_HEAD)}


def weight_headers(path):
    """(files, {checkpoint key: (shape, file name)}) of the safetensors of folder `path`, from their headers alone."""
    shards, found = weight_files(path), {}
    for shard in shards:
        with open_weights(shard) as f:
            found |= {key: (tuple(f.get_slice(key).get_shape()), shard.name) for key in f.keys()}
    return shards, found


def compare_weights(path, model, found, against="the config"):
    """Refuse checkpoint keys and shapes `found` (weight_headers) other than `model`'s (a meta or FSDP2 one's too)."""
    state = model.state_dict()
    expected = {name: tuple(state[k].shape) for name, k in checkpoint_keys(model.config, state).items()}
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    wrong = sorted(f"{k}: checkpoint {found[k][0]} ({found[k][1]}) vs model {expected[k]}"
                   for k in set(found) & set(expected) if found[k][0] != expected[k])
    if missing or unexpected or wrong:
        raise ValueError(f"checkpoint {path} does not match {against}:"
                         + (f"\n  missing keys: {missing}" if missing else "")
                         + (f"\n  unexpected keys: {unexpected}" if unexpected else "")
                         + (f"\n  shape mismatches: {wrong}" if wrong else ""))


def read_config(folder):
    """The LLaDAConfig of a model folder's config.json, checked against its weights (check_config_against_weights)
    once per process while the files are unchanged (a command line asks several times); each caller gets a copy."""
    folder = Path(folder).resolve()
    files = sorted(f for pattern in ("config.json", "*.safetensors*") for f in folder.glob(pattern))
    return copy.deepcopy(_checked_config(folder, tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size)
                                                       for f in files if f.is_file())))


@functools.lru_cache(maxsize=16)
def _checked_config(folder, stamp):
    config = LLaDAConfig.from_json(folder / "config.json")
    check_config_against_weights(folder, config)
    return config


def check_config_against_weights(folder, config):
    """`config` (folder's config.json) against its safetensors' headers: one that does not describe its weights
    (n_layers 10^6 would build for minutes) fails at once, naming config.json and the field. Returns the files."""
    folder = Path(folder)
    shards, found = weight_headers(folder)
    source, n, name = folder / "config.json", config.json_name, config.checkpoint_name

    def refuse(fields, key, what):
        values = ", ".join(f"{n(f)!r} = {getattr(config, f)}" for f in fields)
        raise ValueError(f"{source}: field{'s' * (len(fields) > 1)} {values} {what}, but {found[key][1]} holds {key} "
                         f"of shape {found[key][0]}: config.json does not describe these weights (it belongs to "
                         "another model?)")

    # the blocks' indices in the file: a count check first, so that a huge n_layers builds no list of names
    prefix = name("model.transformer.blocks.7.attn_norm.weight").partition(".7.")[0] + "."  # the family's "...blocks."
    keys = collections.Counter(int(m.group(1)) for m in map(re.compile(re.escape(prefix) + r"(\d+)\.").match, found)
                               if m)  # {block index: its tensors in the file}
    indices, whole = sorted(keys), 9 + 3 * config.include_qkv_bias  # a whole block's tensors
    # fewer blocks than n_layers, or more, each of them whole (a stray key is left to the full comparison below)
    if len(indices) < config.n_layers or len(indices) > config.n_layers and set(keys.values()) == {whole}:
        held = f"{len(indices)} blocks, {prefix}{indices[0]} .. {indices[-1]}" if indices else "no block"
        raise ValueError(f"{source}: field {n('n_layers')!r} = {config.n_layers}, but the weights hold {held}: "
                         "config.json does not describe these weights (it belongs to another model?)")
    wte, kp, fp = (name(k) for k in ("model.transformer.wte.weight", "model.transformer.blocks.0.k_proj.weight",
                                     "model.transformer.blocks.0.ff_proj.weight"))
    if wte in found and found[wte][0][1:] != (config.d_model,):
        refuse(["d_model"], wte, "(the model width, the embedding's columns)")
    if wte in found and found[wte][0][:1] != (config.embedding_size,):
        rows = "vocab_size" if "embedding_size" in config.family.implied else "embedding_size"  # Dream's: vocab_size
        refuse([rows], wte, "(the embedding's rows)")
    if fp in found and found[fp][0] != (config.mlp_hidden_size, config.d_model):
        refuse(["mlp_hidden_size"], fp, "(the MLP's width)")
    if kp in found and found[kp][0] != (config.n_kv_heads * config.head_dim, config.d_model):
        refuse(["n_kv_heads", "n_heads", "d_model"], kp, "(k_proj's rows: n_kv_heads x d_model / n_heads)")
    with torch.device("meta"):  # the blocks' count and the widths match the files: a quick build, nothing allocated
        compare_weights(folder, LLaDA(config), found, against=source)  # every other name and shape
    return shards


def stored_dtype(path):
    """The dtype the weights of folder `path` are stored in (LLaDA-8B: bfloat16), from the first tensor's header."""
    with open_weights(weight_files(path)[0]) as f:
        dtype = f.get_slice(next(iter(f.keys()))).get_dtype()
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}[dtype]


@torch.no_grad()
def load_weight_rows(model, path, rank, world):
    """Fill a model sharded by FSDP2 (built on meta, fully_shard-ed, to_empty) from folder `path`, each rank reading
    its own rows (dim 0 in `world` chunks of ceil(n / world) rows, as torch.chunk), cast to the parameter's dtype."""
    params = dict(model.named_parameters())
    shards, found = weight_headers(path)
    compare_weights(path, model, found)
    for shard in shards:
        with open_weights(shard) as f:
            for key in f.keys():
                param = params[model.config.module_name(key)]
                local = param.to_local() if hasattr(param, "to_local") else param
                n = found[key][0][0]  # the tensor's rows
                start = min(rank * math.ceil(n / world), n)
                mine = f.get_slice(key)[start:start + local.shape[0]]
                check_finite(mine, key, shard)  # each rank checks the rows it reads
                local.copy_(mine)
    return model


# -----------------------------------------------------------------------------
# LoRA, by hand: y = W x + (B A dropout(x)) * alpha / r, with W frozen (PEFT's adapter folders: adapters.py)


class LoRALinear(nn.Module):
    """A frozen linear layer, its weight (and bias) under the same names, so the base checkpoint's keys are unchanged,
    plus lora_A (r, in) and lora_B (out, r) in float32 even on a bf16 base; B starts at zero: exactly the base."""

    def __init__(self, base: nn.Linear, r, alpha, dropout, generator=None, use_rslora=False):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r  # rsLoRA: PEFT's use_rslora
        dev = base.weight.device
        # A is drawn on the generator's device (a CPU generator cannot fill a GPU tensor), then moved: the same
        # seed gives the same adapter on every device
        A = torch.empty(r, self.in_features, dtype=torch.float32, device=dev if generator is None else generator.device)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)  # as PEFT
        self.lora_A = nn.Parameter(A.to(dev))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=dev, dtype=torch.float32))
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        delta = F.linear(F.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A), self.lora_B)
        return y + (delta * self.scaling).to(y.dtype)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj")  # the paper's LoRA recipe (Appendix C), and its rank, alpha and dropout
LORA = dict(r=128, alpha=256.0, dropout=0.05)
LINEARS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out", "o_proj", "gate_proj",
           "down_proj", "lm_head")  # a block's linears and the LM head: LLaDA's names, then Dream's where they differ


def lora_target_names(model, targets):
    """The linears whose name, ours or the checkpoint's, is an entry of `targets` or ends in "." + one, as PEFT matches
    a list ("ff_out": every block's MLP output AND the LM head; a regex, layers_to_transform: adapters.py)."""
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, LoRALinear)) and any(
        a in targets or any(a.endswith("." + t) for t in targets) for a in (n, model.config.checkpoint_name(n)))]


def add_lora(model, r=LORA["r"], alpha=LORA["alpha"], dropout=LORA["dropout"], targets=LORA_TARGETS, generator=None,
             ranks=None, alphas=None, use_rslora=False):
    """Replace the target linears (lora_target_names) by LoRALinear (A drawn from `generator`), freezing the rest.
    ranks / alphas: {module name: its own r / alpha}, PEFT's rank_pattern / alpha_pattern (adapters.py)."""
    model.requires_grad_(False)
    names = lora_target_names(model, targets)
    if not names:
        raise ValueError(f"LoRA targets {targets!r} match no linear layer of the model")
    for name in names:
        if model.config.weight_tying and name + ".weight" == TIED_HEAD:
            raise ValueError(f"LoRA targets {targets!r} reach the LM head, which is the embedding matrix "
                             "(tie_word_embeddings): its merged weight could not be saved tied; leave it out")
        base = model.get_submodule(name)
        if not isinstance(base, nn.Linear):
            raise ValueError(f"LoRA target {name!r} already has an adapter or is not a linear layer")
        model.set_submodule(name, LoRALinear(base, (ranks or {}).get(name, r), (alphas or {}).get(name, alpha), dropout,
                                             generator, use_rslora))
    model.lora_config = dict(r=r, alpha=alpha, dropout=dropout, targets=targets, use_rslora=use_rslora)
    return model


def lora_layers(model):
    """(module name, LoRALinear) for every adapter in the model, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def lora_disabled(model):
    """Run the frozen base model: the GIFT* reference model costs no extra memory under LoRA."""
    states = {m: m.enabled for _, m in lora_layers(model)}
    for m in states:
        m.enabled = False
    try:
        yield model
    finally:
        for m, s in states.items():
            m.enabled = s


def merged_weight(m, W, A, B):
    """W + B A * scale of the LoRALinear m (its own tensors or a state dict's), in float32, returned in W's dtype."""
    return (W.float() + (B @ A) * m.scaling).to(W.dtype)


@torch.no_grad()
def merge_lora(model):
    """Fold each adapter into its base weight (W += B A * scale) and put plain nn.Linear layers back."""
    for name, m in lora_layers(model):
        merged = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device,
                           dtype=m.weight.dtype)
        merged.weight.copy_(merged_weight(m, m.weight, m.lora_A, m.lora_B))
        if m.bias is not None:
            merged.bias.copy_(m.bias)
        model.set_submodule(name, merged)
    model.__dict__.pop("lora_config", None)
    return model


@torch.no_grad()
def merged_state_dict(model, state=None, base=None):
    """The base's state dict with every adapter folded in, `model` left as it is. state: the state dict to read instead
    (a sharded model's, gathered); base: a folder whose stored weights are the base (a bf16 LoRA's merge unrounded)."""
    full = model.state_dict() if state is None else state
    merged = {k: v for k, v in full.items() if ".lora_" not in k}
    for shard in weight_files(base) if base else ():
        with open_weights(shard) as f:
            merged |= {model.config.module_name(k): f.get_tensor(k) for k in f.keys()}
    for name, m in lora_layers(model):
        W = merged[f"{name}.weight"]  # the factors go to W's device: a base read from disk stays on the host
        merged[f"{name}.weight"] = merged_weight(m, W, *(full[f"{name}.lora_{t}"].to(W.device) for t in "AB"))
    return merged


# -----------------------------------------------------------------------------
# Checks: a sampler's tensors; one rule for an option's value, read from a dataclass field's metadata (LLaDAConfig,
# SamplerOptions, TrainOptions, ...) or from a dict per argument (a library call's), written where it is declared


def check_prompt(prompt, attention_mask, generator, where, model=None, gen_length=0, gen_name="gen_length"):
    """A sampler's tensors, before any forward pass: a prompt of token ids (B, P), an attention mask of its shape, one
    generator or one per row; with `model`, ids within its embedding and P + gen_length (named gen_name) its context."""
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


KINDS = {int: (numbers.Integral, "an integer"), float: (numbers.Real, "a number"), str: (str, "a string"),
         bool: (bool, "true or false")}


def in_interval(value, interval):
    """Whether the number `value` lies in `interval`, written "[lo, hi)", "(1, inf)", ... (NaN lies in none)."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    return ((lo <= value) if interval[0] == "[" else (lo < value)) and (
        (value <= hi) if interval[-1] == "]" else (value < hi))


def check_value(said, value, kind=None, range=None, choices=None, what=None, **_):
    """`value` (None: unset, passes) against one rule, `kind` (int: not a bool; float: any real), `range` (in_interval),
    `choices`, other metadata ignored; a one-line ValueError: said, the option as written ("--steps 0"), then `what`."""
    if value is None:
        return
    if kind is not None and (not isinstance(value, KINDS[kind][0]) or isinstance(value, bool) != (kind is bool)):
        raise ValueError(f"{said}: expected {KINDS[kind][1]}")
    if choices is not None and value not in choices:
        raise ValueError(f"{said}; expected one of {choices}")
    if range is not None and not in_interval(value, range):
        raise ValueError(f"{said}: {what or 'must be in ' + range}")


def check_fields(obj, said):
    """Each field of the dataclass `obj` against its metadata's rule, its kind from the annotation (check_value)."""
    for f in dataclasses.fields(obj):
        kind = next((t for t in getattr(f.type, "__args__", (f.type,)) if t in KINDS), None)
        check_value(said(f.name), getattr(obj, f.name), **dict(kind=kind) | dict(f.metadata))


# -----------------------------------------------------------------------------
# Files: JSON read with one-line errors; atomic writes (a crash mid-write leaves the old file); generation defaults


NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),  # not a regular file, in words
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path):
    """`path` opened to read bytes; a ValueError unless a regular file: a FIFO would block a read, a device not end."""
    if os.path.exists(path) and not os.path.isfile(path):  # and one swapped in after this opens without blocking
        kind = next((kind for test, kind in NOT_FILES if test(os.stat(path).st_mode)), "something else")
        raise ValueError(f"{path}: not a regular file but {kind}: not read")
    return open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")


def read_json(path, hint="", object_only=True):
    """The JSON object (not object_only: any value) in the file `path`, else one line saying where it breaks + hint."""
    with open_regular(path) as f:  # every JSON and JSONL file the project reads is opened by open_regular
        try:
            value = json.loads(f.read().decode("utf-8"))
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            where = f"line {e.lineno}, column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else e
            raise ValueError(f"{path}: not valid JSON ({str(where).splitlines()[0][:200]}){hint}") from None
    if object_only and not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_json_file(path):
    """A model folder's JSON file, any value (its callers check the shape), its error saying how it breaks."""
    return read_json(path, f". A truncated download leaves such a file: copy {path.name} from the model's Hugging "
                           "Face folder again", object_only=False)


def atomic_write_text(path, text):
    """`text` (str, or bytes) into `path`, whole or not at all: written into a new file of this call's beside it, then
    renamed, so that writers of one file never mix and no other file is touched; an OSError names the path."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # FileExistsError rather than another's
        (tmp.write_bytes if isinstance(text, bytes) else tmp.write_text)(text)
        os.replace(tmp, path)
    except OSError as e:
        if not isinstance(e, FileExistsError):  # ours to remove
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise OSError(e.errno, f"cannot write {path} ({e.strerror or e})") from e


@contextlib.contextmanager
def atomic_folder(path, own=None):
    """Yield a fresh folder beside `path` to write into; on success renamed to a new `path`, or its files moved into the
    old one, each replacing its namesake whole (JSON last), after those matching the regex `own` it does not replace
    are deleted; other files are left alone, as by HF's save_pretrained."""
    path = Path(path)
    if path.exists() and not path.is_dir():  # found before anything is written: no copy of the weights left beside it
        raise ValueError(f"{path}: a file, not a folder; a model or adapter is saved as a folder of files")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    umask = os.umask(0)
    os.umask(umask)
    for f in [tmp, *tmp.rglob("*")]:  # mkdtemp and safetensors make owner-only files; others on a cluster read them
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
    if not path.exists():  # a new folder: renamed whole
        os.replace(tmp, path)
        return
    new = {f.name for f in tmp.iterdir()}
    for f in path.iterdir():
        if own and f.name not in new and re.fullmatch(own, f.name) and f.is_file():
            f.unlink()
    for f in sorted(tmp.iterdir(), key=lambda f: f.suffix == ".json"):  # config.json, an index: after the weights
        os.replace(f, path / f.name)
    tmp.rmdir()


GENERATION_DEFAULTS = "generation_defaults.json"  # a model folder's own sampling / evaluation settings (optional)


def generation_defaults(folder):
    """The folder's generation_defaults.json (task, gen_length, ...: a gift.py run writes it for the embedded task)."""
    path = Path(folder) / GENERATION_DEFAULTS
    return read_json(path) if path.exists() else {}  # a FIFO there is refused (open_regular), not taken for none
