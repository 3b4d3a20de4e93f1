"""Regenerate the Dream golden vectors from the OFFICIAL Dream code (never from this repository's code).

Not run by the tests. It needs a scratch environment with torch 2.13.0 (CPU), transformers 4.46.2,
safetensors and numpy, plus three folders taken from public repositories (see tests/golden/README.md):

  --official   folder holding the official configuration_dream.py, modeling_dream.py, generation_utils.py
               (used: ZHZisZZ/dllm @ 03270de7, dllm/pipelines/dream/models/, the Dream-org HF files)
  --crosscheck optional second copy of the same three files (used: NVlabs/Fast-dLLM @ 24cc59e7, dream/model/);
               the forward passes and greedy generations are re-run with it and must agree
  --dllm       root of a dllm source tree (ZHZisZZ/dllm @ ca176752) with at least
               dllm/core/trainers/mdlm.py, dllm/core/schedulers/alpha.py, dllm/pipelines/dream/trainer.py,
               dllm/pipelines/dream/utils.py, dllm/utils/data.py

    python make_dream_golden.py --official DIR [--crosscheck DIR] --dllm DIR --out tests/golden/dream

The official files are imported as packages from those paths; none of their code lives in this repository.
"""

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import sys
import types

import torch
import torch.nn.functional as F

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------------------
# importing the official code from a folder
# ----------------------------------------------------------------------------------------------------------
def import_official(folder, pkg_name):
    """Import configuration_dream / modeling_dream / generation_utils from `folder` as package `pkg_name`."""
    pkg = types.ModuleType(pkg_name)
    pkg.__path__ = [os.path.abspath(folder)]
    sys.modules[pkg_name] = pkg
    # Both copies register "Dream" with AutoConfig / AutoModel at import (dllm's copy); a second registration
    # of the same name would raise, so the AutoConfig registry entry is dropped between the two imports.
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        CONFIG_MAPPING._extra_content.pop("Dream", None)
    except Exception:
        pass
    cfg = importlib.import_module(pkg_name + ".configuration_dream")
    gen = importlib.import_module(pkg_name + ".generation_utils")
    mod = importlib.import_module(pkg_name + ".modeling_dream")
    return cfg, mod, gen


def _load_file_as(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def import_dllm(root):
    """Import dllm's own MDLMTrainer / DreamTrainer / DreamSFTCollator without its heavy dependencies.

    dllm's package __init__ pulls in deepspeed, peft, datasets, wandb...; only these files are needed, so the
    package skeleton is built by hand and only the true dependencies of mdlm.py are stubbed: the training
    arguments base class (a plain dataclass here), the metric callbacks (no-ops) and prepend_bos (dllm's own
    function, taken from dllm/utils/data.py by source)."""
    def pkg(name):
        m = types.ModuleType(name)
        m.__path__ = []
        sys.modules[name] = m
        return m

    for n in ["dllm", "dllm.core", "dllm.utils", "dllm.core.trainers", "dllm.pipelines", "dllm.pipelines.dream"]:
        pkg(n)
    alpha = _load_file_as("dllm.core.schedulers.alpha", os.path.join(root, "dllm/core/schedulers/alpha.py"))
    sched = pkg("dllm.core.schedulers")
    sched.BaseAlphaScheduler = alpha.BaseAlphaScheduler
    sched.LinearAlphaScheduler = alpha.LinearAlphaScheduler

    configs = types.ModuleType("dllm.utils.configs")

    @dataclasses.dataclass
    class TrainingArguments:  # stand-in for dllm.utils.configs.TrainingArguments (a transformers one)
        def __post_init__(self):
            pass

    configs.TrainingArguments = TrainingArguments
    sys.modules["dllm.utils.configs"] = configs

    data = types.ModuleType("dllm.utils.data")
    src = open(os.path.join(root, "dllm/utils/data.py")).read()
    tree = ast.parse(src)
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "prepend_bos"][0]
    ns = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "dllm/utils/data.py", "exec"), ns)
    data.prepend_bos = ns["prepend_bos"]
    sys.modules["dllm.utils.data"] = data

    tu = types.ModuleType("dllm.core.trainers.utils")

    class _Noop:
        def __init__(self, *a, **k):
            pass

        def update(self, *a, **k):
            pass

    tu.NLLMetric = tu.PPLMetric = tu.OnEvaluateMetricsCallback = _Noop
    sys.modules["dllm.core.trainers.utils"] = tu

    mdlm = _load_file_as("dllm.core.trainers.mdlm", os.path.join(root, "dllm/core/trainers/mdlm.py"))
    tr = sys.modules["dllm.core.trainers"]
    tr.MDLMConfig, tr.MDLMTrainer = mdlm.MDLMConfig, mdlm.MDLMTrainer
    dtrainer = _load_file_as("dllm.pipelines.dream.trainer", os.path.join(root, "dllm/pipelines/dream/trainer.py"))
    dutils = _load_file_as("dllm.pipelines.dream.utils", os.path.join(root, "dllm/pipelines/dream/utils.py"))
    return alpha, mdlm, dtrainer, dutils, _Noop


# ----------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------
CKPTS = {
    # name: (config kwargs, weight std, sharded)
    "gqa": dict(
        folder="tiny_dream_gqa",
        config=dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                    mask_token_id=93, pad_token_id=90, bos_token_id=90, eos_token_id=90),
        std=0.3, emb_std=1.0, seed=1234, shard="200KB",
    ),
    "tied": dict(
        folder="tiny_dream_tied",
        config=dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                    mask_token_id=75, pad_token_id=70, bos_token_id=70, eos_token_id=70),
        std=0.4, emb_std=0.4, seed=4321, shard=None,
    ),
}


def build_checkpoint(cfg_mod, mod_mod, gen_mod, spec, out_dir):
    torch.manual_seed(spec["seed"])
    config = cfg_mod.DreamConfig(
        hidden_act="silu", initializer_range=0.02, use_cache=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=2, attention_dropout=0.0, rope_scaling=None,
        torch_dtype="float32", architectures=["DreamModel"], **spec["config"])
    # as in the real checkpoints' config.json (they load through trust_remote_code)
    config.auto_map = {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}
    model = mod_mod.DreamModel(config).float().eval()
    std = spec["std"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):  # q/k/v biases: the official init zeroes them; draw them here
                p.copy_(std * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                # also redraws the pad row (nn.Embedding(padding_idx=pad) zeroes it); for the tied checkpoint this
                # is the LM head too, hence its smaller std
                p.copy_(spec["emb_std"] * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    path = os.path.join(out_dir, spec["folder"])
    shutil.rmtree(path, ignore_errors=True)
    kw = dict(safe_serialization=True)
    if spec["shard"]:
        kw["max_shard_size"] = spec["shard"]
    model.save_pretrained(path, **kw)
    # save_pretrained writes a plain generation_config.json (GenerationConfig.from_model_config); the real
    # Dream-v0 checkpoints ship a DreamGenerationConfig one instead, with these values (mask_token_id null there
    # too). Replace it by the same thing, written by the official class.
    os.remove(os.path.join(path, "generation_config.json"))
    c = spec["config"]
    gen_mod.DreamGenerationConfig(
        temperature=0.0, top_p=None, top_k=None, steps=512, eps=1e-3, alg="origin", alg_temp=None,
        output_history=False, mask_token_id=None, bos_token_id=c["bos_token_id"], eos_token_id=c["eos_token_id"],
        pad_token_id=c["pad_token_id"], _from_model_config=True).save_pretrained(path)
    return model


def reload(mod_mod, path):
    m = mod_mod.DreamModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return m


# ----------------------------------------------------------------------------------------------------------
# forward vectors
# ----------------------------------------------------------------------------------------------------------
def four_d_mask(mask2d):
    # exactly as generation_utils.DreamGenerationMixin._sample builds it: query AND key
    return torch.logical_and(mask2d.unsqueeze(1).unsqueeze(-2), mask2d.unsqueeze(1).unsqueeze(-1))


def tok_idx_of(mask2d):
    tok_idx = mask2d.long().cumsum(-1) - 1
    tok_idx.masked_fill_(mask2d == 0, 1)
    return tok_idx


def forward_vectors(tag, model, cfg, g, notes):
    V, mask_id, pad_id = cfg.vocab_size, cfg.mask_token_id, cfg.pad_token_id
    out = {}
    # plain: B=2, L=12, ordinary ids (never pad/mask by chance) with ~30% set to mask
    B, L = 2, 12
    ids = torch.randint(0, pad_id, (B, L), generator=g)
    ids[torch.rand(B, L, generator=g) < 0.3] = mask_id
    ids[1, 8:] = mask_id
    with torch.no_grad():
        o = model(ids, output_hidden_states=True)
    out[f"{tag}.plain.input_ids"] = ids
    out[f"{tag}.plain.logits"] = o.logits.float()
    out[f"{tag}.plain.hidden_states"] = torch.stack(o.hidden_states).float()
    notes[f"{tag}.plain.logits.std"] = o.logits.std().item()

    # padded: B=3, L=12; rows 0/1 left-padded with pad_id (4 and 1 pads), row 2 unpadded
    B = 3
    pads = [4, 1, 0]
    ids = torch.randint(0, pad_id, (B, L), generator=g)
    ids[torch.rand(B, L, generator=g) < 0.3] = mask_id
    m2 = torch.ones(B, L, dtype=torch.long)
    for b, p in enumerate(pads):
        ids[b, :p] = pad_id
        m2[b, :p] = 0
    m4 = four_d_mask(m2)
    ti = tok_idx_of(m2)
    with torch.no_grad():
        la = model(ids, m4, None).logits.float()
        lb = model(ids, m4, ti).logits.float()
        lnone = model(ids).logits.float()
    out[f"{tag}.padded.input_ids"] = ids
    out[f"{tag}.padded.attention_mask"] = m2
    out[f"{tag}.padded.mask4d"] = m4.to(torch.uint8)
    out[f"{tag}.padded.tok_idx"] = ti
    out[f"{tag}.padded.logits_mask4d"] = la
    out[f"{tag}.padded.logits_mask4d_tokidx"] = lb
    out[f"{tag}.padded.logits_nomask"] = lnone
    real = m2.bool()
    for name, lg in [("mask4d", la), ("mask4d_tokidx", lb)]:
        notes[f"{tag}.padded.{name}.nan_at_pad_rows"] = bool(torch.isnan(lg[~real]).any())
        notes[f"{tag}.padded.{name}.nan_at_real_rows"] = bool(torch.isnan(lg[real]).any())
        notes[f"{tag}.padded.{name}.finite_everywhere"] = bool(torch.isfinite(lg).all())
    # what a pad query row holds: its attention output is all-zero (SDPA, bool mask, all keys masked) so the
    # pad row is lm_head(norm(residual stream without any attention contribution)). Check that.
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            h = h + layer.mlp(layer.post_attention_layernorm(h))  # attention output == 0
        pad_rows_ref = model.lm_head(model.model.norm(h)).float()
    diff = (la[~real] - pad_rows_ref[~real]).abs().max().item()
    notes[f"{tag}.padded.pad_rows_equal_attention_free_stack_maxdiff"] = diff
    # real rows with tok_idx positions == the same tokens run alone (no padding), positions 0..n-1
    md = 0.0
    with torch.no_grad():
        for b, p in enumerate(pads):
            alone = model(ids[b:b + 1, p:]).logits.float()[0]
            md = max(md, (lb[b, p:] - alone).abs().max().item())
    notes[f"{tag}.padded.tokidx_real_rows_vs_unpadded_maxdiff"] = md
    # 2-D mask through dllm's forward (it builds the same 4-D mask itself)
    with torch.no_grad():
        l2d = model(ids, m2, None).logits.float()
    notes[f"{tag}.padded.mask2d_vs_mask4d_maxdiff(dllm forward)"] = (l2d - la).nan_to_num(123.0).abs().max().item()
    return out


# ----------------------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------------------
class RngTrace:
    """Records every torch.rand / torch.multinomial call (the only RNG entry points the official sampler reaches:
    torch.rand directly for alg 'origin'; torch.multinomial through torch.distributions.Categorical.sample and
    directly for alg_temp > 0)."""

    def __init__(self):
        self.calls = []
        self.step = None

    def __enter__(self):
        self._rand, self._multi = torch.rand, torch.multinomial
        trace = self

        def rand(*size, **kw):
            r = trace._rand(*size, **kw)
            trace.calls.append(dict(step=trace.step, fn="torch.rand", size=list(r.shape), dtype=str(r.dtype),
                                    generator="global" if kw.get("generator") is None else "explicit",
                                    result=[round(v, 8) for v in r.flatten().tolist()]))
            return r

        def multinomial(inp, num_samples, replacement=False, **kw):
            r = trace._multi(inp, num_samples, replacement, **kw)
            trace.calls.append(dict(step=trace.step, fn="torch.multinomial", input_shape=list(inp.shape),
                                    input_dtype=str(inp.dtype), num_samples=num_samples,
                                    replacement=bool(replacement),
                                    input_rows_sum_to_1=bool(torch.allclose(inp.sum(-1), torch.ones(()), atol=1e-5))
                                    if inp.numel() else None,
                                    generator="global" if kw.get("generator") is None else "explicit",
                                    result=r.tolist()))
            return r

        torch.rand, torch.multinomial = rand, multinomial
        return self

    def __exit__(self, *a):
        torch.rand, torch.multinomial = self._rand, self._multi


GEN_FIELDS = ["temperature", "top_p", "top_k", "max_length", "max_new_tokens", "eps", "steps", "alg", "alg_temp",
              "num_return_sequences", "return_dict_in_generate", "output_history", "mask_token_id",
              "pad_token_id", "bos_token_id", "eos_token_id"]


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return v


def run_generate(model, gen_mod, prompt, mask2d, case, explicit=True, trace=None):
    captured = {}
    orig_sample = model._sample

    def _sample(input_ids, attention_mask=None, generation_config=None, **kw):
        captured["config"] = {k: _jsonable(getattr(generation_config, k, None)) for k in GEN_FIELDS}
        return orig_sample(input_ids, attention_mask=attention_mask, generation_config=generation_config, **kw)

    def tokens_hook(step, x, logits):
        if trace is not None:
            trace.step = 0 if step is None else step + 1  # the calls of step i come before hook(i)
        return x

    model._sample = _sample
    try:
        if explicit:
            gc = gen_mod.DreamGenerationConfig(
                temperature=case["temperature"], top_p=case["top_p"], top_k=case["top_k"], alg=case["alg"],
                alg_temp=case["alg_temp"], steps=case["steps"], eps=case["eps"],
                max_new_tokens=case["max_new_tokens"], mask_token_id=case["mask_token_id"],
                pad_token_id=case["pad_token_id"], bos_token_id=case["bos_token_id"],
                eos_token_id=case["eos_token_id"], return_dict_in_generate=True, output_history=True,
                num_return_sequences=1)
            if trace is not None:
                trace.step = 0
            res = model.diffusion_generate(prompt, generation_config=gc, attention_mask=mask2d,
                                           generation_tokens_hook_func=tokens_hook)
        else:  # the trap: no generation_config, only a few kwargs
            if trace is not None:
                trace.step = 0
            res = model.diffusion_generate(prompt, attention_mask=mask2d, max_new_tokens=case["max_new_tokens"],
                                           steps=case["steps"], alg=case["alg"], return_dict_in_generate=True,
                                           output_history=True, generation_tokens_hook_func=tokens_hook)
    finally:
        del model._sample
    return res, captured["config"]


def generation_cases(cfg):
    base = dict(eps=1e-3, mask_token_id=cfg.mask_token_id, pad_token_id=cfg.pad_token_id,
                bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, top_p=None, top_k=None,
                alg_temp=None, temperature=0.0, seed=None)
    cases = []
    for alg in ["maskgit_plus", "topk_margin", "entropy"]:
        for steps in [8, 3]:
            cases.append(dict(base, name=f"{alg}.greedy.steps{steps}", alg=alg, steps=steps, max_new_tokens=8))
    cases.append(dict(base, name="entropy.greedy.n12.steps4", alg="entropy", steps=4, max_new_tokens=12))
    cases.append(dict(base, name="origin.greedy.steps8", alg="origin", steps=8, max_new_tokens=8, seed=11))
    cases.append(dict(base, name="origin.greedy.steps3", alg="origin", steps=3, max_new_tokens=8, seed=12))
    cases.append(dict(base, name="origin.sampled.t0.8.topp0.9.steps4", alg="origin", steps=4, max_new_tokens=8,
                      temperature=0.8, top_p=0.9, seed=13))
    cases.append(dict(base, name="maskgit_plus.sampled.t0.7.topk10.steps4", alg="maskgit_plus", steps=4,
                      max_new_tokens=8, temperature=0.7, top_k=10, seed=14))
    cases.append(dict(base, name="entropy.sampled.t1.0.topp0.95.algtemp0.5.steps4", alg="entropy", steps=4,
                      max_new_tokens=8, temperature=1.0, top_p=0.95, alg_temp=0.5, seed=15))
    return cases


def generation_vectors(tag, model, cfg, gen_mod, g, cross=None):
    pad_id = cfg.pad_token_id
    # prompts: B=2 left-padded (lengths 5 and 8, padded to 8) and B=1 unpadded (length 6); no pad/mask ids inside
    p0 = torch.randint(0, pad_id, (5,), generator=g)
    p1 = torch.randint(0, pad_id, (8,), generator=g)
    batch = torch.full((2, 8), pad_id, dtype=torch.long)
    batch[0, 3:] = p0
    batch[1] = p1
    bmask = torch.ones(2, 8, dtype=torch.long)
    bmask[0, :3] = 0
    single = torch.randint(0, pad_id, (1, 6), generator=g)
    smask = torch.ones(1, 6, dtype=torch.long)
    prompts = {"batch2_leftpad": (batch, bmask), "batch1": (single, smask)}

    records = []
    for case in generation_cases(cfg):
        for pname, (ids, m) in prompts.items():
            trace = RngTrace()
            if case["seed"] is not None:
                torch.manual_seed(case["seed"])
            with trace:
                res, in_force = run_generate(model, gen_mod, ids.clone(), m.clone(), case, trace=trace)
            rec = dict(checkpoint=tag, case=case["name"], prompt=pname,
                       arguments={k: case[k] for k in ["alg", "alg_temp", "temperature", "top_p", "top_k",
                                                        "steps", "eps", "max_new_tokens", "mask_token_id",
                                                        "pad_token_id", "bos_token_id", "eos_token_id"]},
                       explicit_generation_config=True, return_dict_in_generate=True, output_history=True,
                       seed=case["seed"], config_in_force=in_force,
                       input_ids=ids.tolist(), attention_mask=m.tolist(),
                       sequences=res.sequences.tolist(),
                       history=[h.tolist() for h in res.history],
                       rng_calls=trace.calls)
            if cross is not None and case["seed"] is None:  # greedy: the cross-check copy must agree
                rc, _ = run_generate(cross, sys.modules["xcheck.generation_utils"], ids.clone(), m.clone(), case)
                assert torch.equal(rc.sequences, res.sequences), (tag, case["name"], pname)
            if case["seed"] is not None:  # replay: same seed -> same output (determinism of the record)
                torch.manual_seed(case["seed"])
                res2, _ = run_generate(model, gen_mod, ids.clone(), m.clone(), case)
                assert torch.equal(res2.sequences, res.sequences)
            records.append(rec)

    # the trap: no generation_config given; DreamGenerationConfig.from_model_config(model.config) is used
    trap_case = dict(name="TRAP.no_generation_config.maskgit_plus.steps8", alg="maskgit_plus", steps=8,
                     max_new_tokens=8)
    for pname, (ids, m) in prompts.items():
        torch.manual_seed(99)
        trace = RngTrace()
        with trace:
            res, in_force = run_generate(model, gen_mod, ids.clone(), m.clone(), trap_case, explicit=False,
                                         trace=trace)
        records.append(dict(checkpoint=tag, case=trap_case["name"], prompt=pname,
                            arguments=dict(max_new_tokens=8, steps=8, alg="maskgit_plus",
                                           return_dict_in_generate=True, output_history=True,
                                           attention_mask="as below"),
                            explicit_generation_config=False, seed=99, config_in_force=in_force,
                            input_ids=ids.tolist(), attention_mask=m.tolist(), sequences=res.sequences.tolist(),
                            history=[h.tolist() for h in res.history], rng_calls=trace.calls))
    return records


# ----------------------------------------------------------------------------------------------------------
# dllm SFT loss
# ----------------------------------------------------------------------------------------------------------
def sft_vectors(tag, model, cfg, dllm_root, seed):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    alpha, mdlm, dtrainer, dutils, Noop = import_dllm(dllm_root)
    V = cfg.vocab_size
    vocab = {f"t{i}": i for i in range(V)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                  pad_token=f"t{cfg.pad_token_id}", eos_token=f"t{cfg.eos_token_id}",
                                  bos_token=f"t{cfg.bos_token_id}", mask_token=f"t{cfg.mask_token_id}")
    tok.padding_side = "right"

    g = torch.Generator().manual_seed(777)
    eos = cfg.eos_token_id
    # two SFT rows as dllm.utils.default_sft_map_fn returns them: labels = ids with the prompt set to -100
    # (prompt lengths 5 and 7; answers of 7 and 9 tokens, each ending in eos)
    feats = []
    for plen, alen in [(5, 7), (7, 9)]:
        ids = torch.randint(0, cfg.pad_token_id, (plen + alen,), generator=g).tolist()
        ids[-1] = eos
        labels = [-100] * plen + ids[plen:]
        feats.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids), "prompt_len": plen})
    # examples/dream/sft.py's collator, with its random per-batch response cut-off switched off
    collator = dutils.DreamSFTCollator(tok, return_tensors="pt", padding=True, perbatch_cutoff=False,
                                       resp_cutoff_ratio=0.0, label_pad_token_id=tok.pad_token_id)
    batch = collator([dict(f) for f in feats])
    batch = {k: v for k, v in batch.items()}

    # a DreamTrainer without transformers.Trainer.__init__: only the attributes compute_loss reads
    def make_trainer(weight_type):
        t = object.__new__(dtrainer.DreamTrainer)
        t.processing_class = tok
        t.scheduler = alpha.LinearAlphaScheduler()
        t.time_epsilon = 1e-3
        t.loss_weight_type = weight_type
        t.loss_norm_type = "token"
        t.right_shift_logits = True
        t.meter = Noop()
        return t

    captured = {}
    real_forward = model.forward

    def fwd(*a, **k):
        o = real_forward(*a, **k)
        captured["noised_input_ids"] = k["input_ids"].clone()
        captured["attention_mask_passed"] = k["attention_mask"].clone()
        captured["raw_logits"] = o.logits.detach().clone()
        return o

    model.forward = fwd
    out = {}
    losses = {}
    try:
        for wt in ["scheduler", "cart[geo_p:0.3]"]:
            trainer = make_trainer(wt)
            inputs = {k: v.clone() for k, v in batch.items()}
            torch.manual_seed(seed)
            trace = RngTrace()
            with trace:
                loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
            losses[wt] = (loss.detach(), outputs.logits.detach().clone(), dict(captured), trace.calls)
    finally:
        del model.forward

    loss_s, shifted, cap, calls = losses["scheduler"]
    loss_c, shifted_c, cap_c, _ = losses["cart[geo_p:0.3]"]
    assert torch.equal(cap["noised_input_ids"], cap_c["noised_input_ids"]) and torch.equal(shifted, shifted_c)
    assert [c["fn"] for c in calls] == ["torch.rand", "torch.rand"], calls
    b, l = batch["input_ids"].shape
    u_t = torch.tensor(calls[0]["result"], dtype=torch.float32)
    # re-draw to have the exact float32 uniforms (the trace rounds them for JSON)
    torch.manual_seed(seed)
    u_t = torch.rand(b)
    u_mask = torch.rand(b, l)
    t = 1e-3 + (1 - 1e-3) * u_t
    p_mask = 1.0 - alpha.LinearAlphaScheduler()(t).unsqueeze(1).expand(b, l)
    maskable = batch["labels"] != -100
    masked = (u_mask < p_mask) & maskable
    noised = torch.where(masked, cfg.mask_token_id, batch["input_ids"])
    assert torch.equal(noised, cap["noised_input_ids"])
    # independent recomputation (float64 from the float32 logits) of dllm's formula
    w_sched = 1.0 / (t.double() + 1e-6)
    logp = torch.log_softmax(shifted.double(), -1)
    nll = -logp.gather(-1, batch["input_ids"].unsqueeze(-1)).squeeze(-1)
    loss64 = (nll * w_sched[:, None] * masked.double()).sum() / maskable.sum()
    cw = dtrainer.cart_weight(masked, t, p=0.3)
    loss64_cart = (nll * cw.double() * masked.double()).sum() / maskable.sum()
    assert abs(loss64.item() - loss_s.item()) < 1e-5 * max(1.0, abs(loss64.item())), (loss64, loss_s)
    assert abs(loss64_cart.item() - loss_c.item()) < 1e-5 * max(1.0, abs(loss64_cart.item())), (loss64_cart, loss_c)

    p = f"{tag}.sft."
    out[p + "input_ids"] = batch["input_ids"]
    out[p + "labels"] = batch["labels"]
    out[p + "attention_mask"] = batch["attention_mask"]
    out[p + "prompt_lengths"] = torch.tensor([f["prompt_len"] for f in feats])
    out[p + "u_t"] = u_t
    out[p + "t"] = t
    out[p + "p_mask"] = p_mask.contiguous()
    out[p + "u_mask"] = u_mask
    out[p + "maskable"] = maskable.to(torch.uint8)
    out[p + "masked"] = masked.to(torch.uint8)
    out[p + "noised_input_ids"] = noised
    out[p + "raw_logits"] = cap["raw_logits"].float()
    out[p + "logits_shifted"] = shifted.float()
    out[p + "weights_scheduler"] = (1.0 / (1.0 - (1.0 - t) + 1e-6)).float()  # as alpha.weight computes it
    out[p + "weights_cart"] = cw.float()
    out[p + "token_nll"] = nll.float()
    out[p + "loss_scheduler"] = loss_s.reshape(1).float()
    out[p + "loss_scheduler_f64"] = loss64.reshape(1)
    out[p + "loss_cart"] = loss_c.reshape(1).float()
    out[p + "loss_cart_f64"] = loss64_cart.reshape(1)
    info = dict(seed=seed, rng_calls=[{k: v for k, v in c.items() if k != "result"} for c in calls],
                loss_scheduler=loss_s.item(), loss_scheduler_f64=loss64.item(), loss_cart=loss_c.item(),
                loss_cart_f64=loss64_cart.item(), n_masked=int(masked.sum()), n_maskable=int(maskable.sum()),
                masked_pad_positions=int((masked & (batch["attention_mask"] == 0)).sum()),
                attention_mask_passed_to_model=str(cap["attention_mask_passed"].tolist()),
                nan_in_raw_logits=bool(torch.isnan(cap["raw_logits"]).any()))
    return out, info


# ----------------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--official", required=True)
    ap.add_argument("--crosscheck", default=None)
    ap.add_argument("--dllm", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sft-seed", type=int, default=5)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    cfg_mod, mod_mod, gen_mod = import_official(a.official, "dream_official")
    xmods = import_official(a.crosscheck, "xcheck") if a.crosscheck else None

    import transformers
    from safetensors.torch import save_file

    tensors, notes, gen_records = {}, {}, []
    notes["versions"] = dict(torch=torch.__version__, transformers=transformers.__version__)
    for tag, spec in CKPTS.items():
        build_checkpoint(cfg_mod, mod_mod, gen_mod, spec, a.out)
        model = reload(mod_mod, os.path.join(a.out, spec["folder"]))
        cfg = model.config
        notes[f"{tag}.model.generation_config(after from_pretrained)"] = {
            k: _jsonable(getattr(model.generation_config, k, None)) for k in GEN_FIELDS}
        g = torch.Generator().manual_seed(100 + len(tag))
        tensors.update(forward_vectors(tag, model, cfg, g, notes))
        cross = None
        if xmods:
            cross = xmods[1].DreamModel.from_pretrained(os.path.join(a.out, spec["folder"]),
                                                        torch_dtype=torch.float32).eval()
            with torch.no_grad():
                for k in [f"{tag}.plain", f"{tag}.padded"]:
                    ids = tensors[k + ".input_ids"]
                    if k.endswith("plain"):
                        d = (cross(ids).logits - tensors[k + ".logits"]).abs().max().item()
                    else:
                        m4 = tensors[k + ".mask4d"].bool()
                        d = max((cross(ids, m4, None).logits - tensors[k + ".logits_mask4d"]).abs().max().item(),
                                (cross(ids, m4, tensors[k + ".tok_idx"]).logits
                                 - tensors[k + ".logits_mask4d_tokidx"]).abs().max().item())
                    notes[f"{k}.crosscheck_maxdiff"] = d
                    notes[f"{k}.logits_absmax"] = tensors[k + (".logits" if k.endswith("plain") else ".logits_mask4d")].abs().max().item()
                    assert d < 1e-6 * max(1.0, notes[f"{k}.logits_absmax"]) * 10, (k, d)
        gen_records += generation_vectors(tag, model, cfg, gen_mod, g, cross=cross)
        notes[f"{tag}.from_model_config"] = {
            k: _jsonable(getattr(gen_mod.DreamGenerationConfig.from_model_config(cfg), k, None)) for k in GEN_FIELDS}
        if tag == "gqa":
            sft, info = sft_vectors(tag, model, cfg, a.dllm, a.sft_seed)
            tensors.update(sft)
            notes["gqa.sft"] = info

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    for k, v in list(tensors.items()):
        if v.dtype == torch.bool:
            tensors[k] = v.to(torch.uint8)
        elif v.dtype == torch.int32:
            tensors[k] = v.long()
    save_file(tensors, os.path.join(a.out, "golden.safetensors"))
    with open(os.path.join(a.out, "generate.json"), "w") as f:
        json.dump(dict(notes=notes, cases=gen_records), f, separators=(",", ":"))
    print(json.dumps(notes, indent=1))
    for k, v in tensors.items():
        print(k, list(v.shape), v.dtype)


if __name__ == "__main__":
    main()
