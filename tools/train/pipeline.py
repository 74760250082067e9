#!/usr/bin/env python3
"""Train the shipped target + DFlash drafter pair in one run (GPU; also runs tiny on the CPU).

Stages (all in one process, each with a wall-clock budget):
  target : Qwen3ForCausalLM on the train token stream (random 512-token windows), AdamW,
           bf16 autocast, cosine schedule sized from the measured step time; held-out loss
           evaluated regularly; the best held-out checkpoint is kept (early stop on patience).
  gen    : the best target (bf16 weights) greedily continues random train-stream prefixes
           (32..128 tokens) to 512 tokens, batched with a KV cache: the drafter's data.
  draft  : DFlash drafter (dflash-semantics.md §4): random anchors in the generated part,
           block [x_anchor, MASK x (b-1)], context = target taps at positions < anchor,
           CE on rows 1..b-1 with weights exp(-(k-1)/gamma); taps from a no-grad target forward.
  eval   : greedy speculative loop vs plain greedy on held-out prompts (fp32): tau pooled and
           mean-per-prompt, and whether the committed stream equals plain greedy.
Outputs under --out: log lines on stdout, metrics.json, target_a/b.safetensors (bf16, split for
transfer), draft.safetensors (bf16). tools/train/assemble.py turns them into models/.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dflash_torch import (DFlashDraft, default_target_layer_ids, draft_config, plain_greedy,  # noqa: E402
                          spec_greedy, target_taps)

T0 = time.time()
METRICS = {}


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def save_metrics(out):
    json.dump(METRICS, open(os.path.join(out, "metrics.json"), "w"), indent=1)


def target_config(a, vocab, eos):
    return Qwen3Config(
        vocab_size=vocab, hidden_size=a.d, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, hidden_act="silu",
    )


def lr_at(step, total, peak, warm, floor=0.1):
    if step < warm:
        return peak * (step + 1) / warm
    p = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


CPU_AMP = os.environ.get("DFLASH_CPU_AMP") == "1"  # dry runs only: mimic the GPU's bf16 dtype flow


def amp(dev):
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" or CPU_AMP)


def low(dev):
    return torch.bfloat16 if dev.type == "cuda" or CPU_AMP else torch.float32


# ------------------------------------------------------------------------------------------ target
def stage_target(a, dev, train, held, vocab, eos):
    torch.manual_seed(a.seed)
    cfg = target_config(a, vocab, eos)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    METRICS["target_params"] = n_params
    METRICS["target_config"] = cfg.to_dict()
    log(f"target: {n_params/1e6:.3f}M params; train tokens {len(train)}, held-out {len(held)}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.t_wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.t_lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    S, B = a.seq, a.t_batch
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    nwin = (len(held) - 1) // S
    if a.t_eval_windows:
        nwin = min(nwin, a.t_eval_windows)
    hx = held[: nwin * S + 1]
    held_x = torch.stack([hx[i * S: i * S + S + 1] for i in range(nwin)])
    epoch_steps = len(train) / (B * S)
    max_steps = int(a.t_max_epochs * epoch_steps)

    @torch.no_grad()
    def held_loss():
        model.eval()
        tot, n = 0.0, 0
        for i in range(0, nwin, a.t_eval_batch):
            x = held_x[i: i + a.t_eval_batch].to(dev)
            with amp(dev):
                lg = model(input_ids=x[:, :-1]).logits
            l = F.cross_entropy(lg.float().reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="sum")
            tot += float(l)
            n += x[:, 1:].numel()
        model.train()
        return tot / n

    train_d = train.to(dev)
    ar = torch.arange(S + 1, device=dev)[None]
    best, best_step, best_state, bad = float("inf"), -1, None, 0
    total = max_steps
    hist = []
    t_start = time.time()
    step = 0
    tr_loss_ema = None
    while step < total:
        if step == 30:
            sync(dev)
            dt = (time.time() - t_start) / 30
            total = max(31, min(max_steps, int((a.t_budget - (time.time() - t_start)) / (dt * 1.08)) + 30))
            log(f"target: {dt*1000:.1f} ms/step -> {total} steps ({total/epoch_steps:.1f} epochs of {epoch_steps:.0f} steps)")
            METRICS["target_ms_per_step"] = dt * 1000
        idx = torch.randint(0, len(train) - S - 1, (B,), generator=g).to(dev)
        x = train_d[idx[:, None] + ar]
        for pg in opt.param_groups:
            pg["lr"] = lr_at(step, total, a.t_lr, a.t_warmup)
        with amp(dev):
            lg = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(lg.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.t_eval_every == 0 or step == total:
            tl = float(loss.detach())
            hl = held_loss()
            hist.append({"step": step, "train_loss": tl, "heldout_loss": hl, "t": time.time() - t_start})
            mark = ""
            if hl < best:
                best, best_step, bad, mark = hl, step, 0, " *"
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            else:
                bad += 1
            log(f"target step {step}/{total} train {tl:.4f} held-out {hl:.4f}{mark}")
            if bad >= a.t_patience:
                log(f"target: early stop (no held-out improvement for {bad} evals)")
                break
            if time.time() - t_start > a.t_budget + 10:
                log("target: time budget reached")
                break
    METRICS.update(target_steps=step, target_best_step=best_step, target_best_heldout=best,
                   target_history=hist, target_wall_s=time.time() - t_start, target_batch=B, target_seq=S,
                   target_tokens_seen=step * B * S, target_epochs=step / epoch_steps)
    # bf16 shipping weights (tied lm_head is not stored)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in best_state.items() if k != "lm_head.weight"}
    keys = sorted(sd)
    half = len(keys) // 2
    save_file({k: sd[k] for k in keys[:half]}, os.path.join(a.out, "target_a.safetensors"), metadata={"format": "pt"})
    save_file({k: sd[k] for k in keys[half:]}, os.path.join(a.out, "target_b.safetensors"), metadata={"format": "pt"})
    log(f"target: best held-out {best:.4f} at step {best_step}; saved bf16")
    save_metrics(a.out)
    return cfg


def load_target(a, cfg, dev, dtype):
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa")
    sd = load_file(os.path.join(a.out, "target_a.safetensors"))
    sd.update(load_file(os.path.join(a.out, "target_b.safetensors")))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.to(dev, dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------------------------- gen
@torch.no_grad()
def stage_gen(a, dev, target, train):
    g = torch.Generator(device="cpu").manual_seed(a.seed + 7)
    S = a.seq
    seqs, plens = [], []
    t_start = time.time()
    ntok = 0
    nb = 0
    while ntok < a.g_tokens and time.time() - t_start < a.g_budget:
        L = int(torch.randint(a.g_min_prefix, a.g_max_prefix + 1, (1,), generator=g))
        idx = torch.randint(0, len(train) - L, (a.g_batch,), generator=g)
        x = torch.stack([train[i: i + L] for i in idx.tolist()]).to(dev)
        out = target(input_ids=x, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        toks = [x]
        t = out.logits[:, -1].argmax(-1)
        for _ in range(S - L):
            toks.append(t[:, None])
            if sum(tt.shape[1] for tt in toks) >= S:
                break
            out = target(input_ids=t[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            t = out.logits[:, -1].argmax(-1)
        full = torch.cat(toks, 1)
        assert full.shape[1] == S, full.shape
        seqs.append(full.to("cpu", torch.int16))
        plens.append(torch.full((a.g_batch,), L, dtype=torch.int16))
        ntok += a.g_batch * (S - L)
        nb += 1
        del past, out
        log(f"gen batch {nb}: prefix {L}, {ntok} generated tokens, {time.time()-t_start:.1f}s")
    seqs = torch.cat(seqs)
    plens = torch.cat(plens)
    METRICS.update(gen_sequences=len(seqs), gen_tokens=ntok, gen_wall_s=time.time() - t_start, gen_batch=a.g_batch,
                   gen_prefix=[a.g_min_prefix, a.g_max_prefix], gen_seq=S)
    save_metrics(a.out)
    return seqs, plens


# -------------------------------------------------------------------------------------------- draft
def draft_batch(seqs, plens, idx, a, dev, mask_id):
    """Sample anchors and build block ids / labels / positions / attention mask."""
    b = a.block
    x = seqs[idx].to(dev, torch.long)  # [B,T]
    pl = plens[idx].to(dev, torch.long)
    B, T = x.shape
    N = a.d_anchors
    # anchors uniformly among positions [plen, T-2] (anchor and the next token are target-made)
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    valid = (pos >= pl[:, None]) & (pos <= T - 2)
    r = torch.rand(B, T, device=dev).masked_fill(~valid, 2.0)
    anchors = r.argsort(-1)[:, :N].sort(-1).values  # [B,N]
    k = torch.arange(b, device=dev)
    tpos = anchors[:, :, None] + k  # [B,N,b]
    lab = torch.gather(x, 1, tpos.clamp(max=T - 1).reshape(B, -1)).reshape(B, N, b)
    lab = lab.masked_fill(tpos > T - 1, -100)
    lab[:, :, 0] = -100
    blk = torch.full((B, N, b), mask_id, device=dev, dtype=torch.long)
    blk[:, :, 0] = torch.gather(x, 1, anchors)
    q_pos = tpos.reshape(B, N * b)
    ctx_pos = torch.arange(T, device=dev)[None].expand(B, T)
    ctx_ok = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]  # [B,N,T]
    ctx_ok = ctx_ok[:, :, None, :].expand(B, N, b, T).reshape(B, N * b, T)
    bid = torch.arange(N, device=dev).repeat_interleave(b)
    blk_ok = (bid[:, None] == bid[None, :])[None].expand(B, N * b, N * b)
    mask = torch.cat([ctx_ok, blk_ok], -1)[:, None]  # [B,1,Q,T+Q]
    return x, blk.reshape(B, N * b), lab.reshape(B, N * b), q_pos, ctx_pos, mask


def draft_loss(draft, target, batch, a, lids, weights, vocab):
    x, blk, lab, q_pos, ctx_pos, mask = batch
    B = x.shape[0]
    with torch.no_grad():
        hs = target.model(input_ids=x, output_hidden_states=True).hidden_states
        taps = torch.cat([hs[l + 1] for l in lids], -1)
        noise = target.get_input_embeddings()(blk)
    z = draft(noise, taps, q_pos, ctx_pos, mask)  # [B,Q,d]
    keep = lab.reshape(-1) != -100
    zk = z.reshape(-1, z.shape[-1])[keep]
    logits = target.get_output_embeddings()(zk).float()
    lk = lab.reshape(-1)[keep]
    row = torch.arange(a.block, device=x.device).repeat(lab.numel() // a.block)[keep]
    ce = F.cross_entropy(logits, lk, reduction="none")
    w = weights[row]
    loss = (ce * w).sum() / w.sum()
    with torch.no_grad():
        acc = (logits.argmax(-1) == lk).float()
        acc_row = torch.zeros(a.block, device=x.device).index_add_(0, row, acc)
        n_row = torch.zeros(a.block, device=x.device).index_add_(0, row, torch.ones_like(acc))
    return loss, acc_row, n_row


def stage_draft(a, dev, target, tcfg, seqs, plens, mask_id):
    torch.manual_seed(a.seed + 11)
    lids = a.target_layer_ids or default_target_layer_ids(tcfg.num_hidden_layers, a.d_layers)
    dcfg = draft_config(tcfg, a.d_layers, a.block, mask_id, lids, a.d_ffn)
    draft = DFlashDraft(dcfg).to(dev)
    if a.d_init:
        # continue training a drafter (e.g. the shipped one): same tensor names as we save
        init = {k: v.float() for k, v in load_file(a.d_init).items()}
        draft.load_state_dict(init, strict=True)
        log(f"draft: initialised from {a.d_init}")
        METRICS.update(draft_init=a.d_init)
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {n_params/1e6:.3f}M params, layers {a.d_layers}, target_layer_ids {lids}")
    METRICS.update(draft_params=n_params, draft_config=dcfg)
    seqs, plens = seqs.to(dev), plens.to(dev)
    n = len(seqs)
    n_held = max(a.d_batch, int(0.02 * n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(a.seed + 3))
    held_i, train_i = perm[:n_held], perm[n_held:]
    weights = torch.exp(-(torch.arange(a.block, device=dev).float() - 1) / a.gamma)
    weights[0] = 0
    decay = [p for p in draft.parameters() if p.dim() >= 2]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.d_wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.d_lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(a.seed + 5)
    epoch_steps = len(train_i) / a.d_batch

    def evaluate():
        draft.eval()
        torch.manual_seed(a.seed + 99)  # same anchors every eval
        tl, ta, tn = 0.0, torch.zeros(a.block, device=dev), torch.zeros(a.block, device=dev)
        nb = 0
        with torch.no_grad():
            for i in range(0, min(len(held_i), a.d_eval_seqs), a.d_batch):
                bt = draft_batch(seqs, plens, held_i[i: i + a.d_batch], a, dev, mask_id)
                with amp(dev):
                    l, ar, nr = draft_loss(draft, target, bt, a, lids, weights, tcfg.vocab_size)
                tl += float(l)
                ta += ar
                tn += nr
                nb += 1
        draft.train()
        acc = (ta / tn.clamp(min=1)).tolist()
        # expected accepted drafts if row errors were the only ones: sum_k prod_{j<=k} acc_j
        exp_tau, pr = 1.0, 1.0
        for k in range(1, a.block):
            pr *= acc[k]
            exp_tau += pr
        return tl / max(1, nb), acc, exp_tau

    total = int(a.d_max_epochs * epoch_steps)
    warm = max(1, int(0.04 * total))
    t_start = time.time()
    step = 0
    hist = []
    if a.d_init:
        hl, acc, et = evaluate()
        hist.append({"step": 0, "train_loss": None, "heldout_loss": hl, "heldout_exp_tau": et, "t": 0.0})
        log(f"draft step 0 (init) held-out {hl:.4f} acc rows1-4 {[round(v, 3) for v in acc[1:5]]} "
            f"row15 {acc[15]:.3f} exp-tau {et:.2f}")
        t_start = time.time()
    while step < total:
        if step == 20:
            sync(dev)
            dt = (time.time() - t_start) / 20
            total = max(21, min(total, int((a.d_budget - (time.time() - t_start)) / (dt * 1.05)) + 20))
            warm = max(1, int(0.04 * total))
            log(f"draft: {dt*1000:.1f} ms/step -> {total} steps ({total/epoch_steps:.2f} epochs)")
            METRICS["draft_ms_per_step"] = dt * 1000
        idx = train_i[torch.randint(0, len(train_i), (a.d_batch,), generator=g)]
        bt = draft_batch(seqs, plens, idx, a, dev, mask_id)
        for pg in opt.param_groups:
            pg["lr"] = lr_at(step, total, a.d_lr, warm, floor=0.05)
        with amp(dev):
            loss, _, _ = draft_loss(draft, target, bt, a, lids, weights, tcfg.vocab_size)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.d_eval_every == 0 or step == total:
            hl, acc, et = evaluate()
            hist.append({"step": step, "train_loss": float(loss.detach()), "heldout_loss": hl, "heldout_exp_tau": et,
                         "t": time.time() - t_start})
            log(f"draft step {step}/{total} train {float(loss.detach()):.4f} held-out {hl:.4f} "
                f"acc rows1-4 {[round(v, 3) for v in acc[1:5]]} row15 {acc[15]:.3f} exp-tau {et:.2f}")
            if time.time() - t_start > a.d_budget + 10:
                log("draft: time budget reached")
                break
    hl, acc, et = evaluate()
    METRICS.update(draft_steps=step, draft_wall_s=time.time() - t_start, draft_batch=a.d_batch,
                   draft_anchors=a.d_anchors, draft_history=hist, draft_final_heldout=hl,
                   draft_final_row_acc=acc, draft_final_exp_tau=et, draft_epochs=step / epoch_steps,
                   draft_train_seqs=len(train_i), draft_heldout_seqs=len(held_i), draft_lr=a.d_lr, gamma=a.gamma)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    save_file(sd, os.path.join(a.out, "draft.safetensors"), metadata={"format": "pt"})
    log(f"draft: final held-out {hl:.4f}, exp-tau {et:.2f}; saved bf16")
    save_metrics(a.out)
    return dcfg


# --------------------------------------------------------------------------------------------- eval
def stage_eval(a, dev, tcfg, dcfg, eos):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    target = load_target(a, tcfg, dev, torch.float32)
    draft = DFlashDraft(dcfg)
    sd = load_file(os.path.join(a.out, "draft.safetensors"))
    draft.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    draft.to(dev).eval()
    prompts = [json.loads(l) for l in open(os.path.join(a.data, "prompts-heldout.jsonl"))][: a.e_prompts]
    rows = []
    all_lens = []
    t_start = time.time()
    for i, p in enumerate(prompts):
        gen, lens = spec_greedy(target, draft, p["ids"], a.e_max_new, eos)
        ref = plain_greedy(target, p["ids"], a.e_max_new, eos)
        same = gen == ref
        tau = sum(lens) / max(1, len(lens))
        rows.append({"prompt": i, "tokens": len(gen), "rounds": len(lens), "tau": tau, "identical": same})
        all_lens += lens
        log(f"eval prompt {i}: {len(gen)} tokens, {len(lens)} rounds, tau {tau:.2f}, identical {same}")
        if time.time() - t_start > a.e_budget:
            log("eval: time budget reached")
            break
    pooled = sum(all_lens) / max(1, len(all_lens))
    # prompts that end at once with EOS (zero rounds) have no tau: left out of the mean
    taus = [r["tau"] for r in rows if r["rounds"] > 0]
    mean_pp = sum(taus) / max(1, len(taus))
    METRICS.update(eval_rows=rows, tau_pooled=pooled, tau_mean_per_prompt=mean_pp,
                   eval_identical=sum(r["identical"] for r in rows), eval_prompts=len(rows),
                   eval_max_new=a.e_max_new, eval_wall_s=time.time() - t_start, eval_dtype="float32")
    log(f"EVAL: tau pooled {pooled:.3f}, mean per prompt {mean_pp:.3f}, identical "
        f"{sum(r['identical'] for r in rows)}/{len(rows)}")
    save_metrics(a.out)


def smoke(dev, mask_id, eos):
    """Seconds-long check of every code path on this device with tiny random models."""
    import types
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=512, eos_token_id=eos)
    tgt = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").to(dev, low(dev)).eval()
    lids = default_target_layer_ids(6, 3)
    dc = draft_config(cfg, 3, 16, mask_id, lids)
    dr = DFlashDraft(dc).to(dev)
    a = types.SimpleNamespace(block=16, d_anchors=8)
    seqs = torch.randint(2, 64, (4, 128), device=dev, dtype=torch.int16)
    plens = torch.full((4,), 32, device=dev, dtype=torch.int16)
    opt = torch.optim.AdamW(dr.parameters(), lr=1e-3, fused=dev.type == "cuda")
    w = torch.exp(-(torch.arange(16, device=dev).float() - 1) / 7)
    w[0] = 0
    bt = draft_batch(seqs, plens, torch.arange(4), a, dev, mask_id)
    with amp(dev):
        loss, _, _ = draft_loss(dr, tgt, bt, a, lids, w, 64)
    loss.backward()
    opt.step()
    out = tgt(input_ids=seqs[:, :10].long(), use_cache=True, logits_to_keep=1)
    tgt(input_ids=out.logits[:, -1].argmax(-1)[:, None], past_key_values=out.past_key_values, use_cache=True)
    tgt.float()
    dr.eval()
    gen, lens = spec_greedy(tgt, dr, [5, 6, 7, 8], 20, eos)
    ref = plain_greedy(tgt, [5, 6, 7, 8], 20, eos)
    log(f"smoke ok: loss {float(loss.detach()):.3f}, spec==greedy {gen == ref}, rounds {len(lens)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="target,gen,draft,eval")
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--seq", type=int, default=512)
    # target
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--t-batch", type=int, default=128)
    ap.add_argument("--t-lr", type=float, default=2e-3)
    ap.add_argument("--t-wd", type=float, default=0.1)
    ap.add_argument("--t-warmup", type=int, default=100)
    ap.add_argument("--t-budget", type=float, default=150)
    ap.add_argument("--t-max-epochs", type=float, default=30)
    ap.add_argument("--t-eval-every", type=int, default=100)
    ap.add_argument("--t-eval-batch", type=int, default=128)
    ap.add_argument("--t-patience", type=int, default=4)
    ap.add_argument("--t-eval-windows", type=int, default=0, help="0 = the whole held-out stream")
    # gen
    ap.add_argument("--g-batch", type=int, default=4096)
    ap.add_argument("--g-tokens", type=int, default=16_000_000)
    ap.add_argument("--g-budget", type=float, default=90)
    ap.add_argument("--g-min-prefix", type=int, default=32)
    ap.add_argument("--g-max-prefix", type=int, default=128)
    # draft
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--d-layers", type=int, default=4)
    ap.add_argument("--d-ffn", type=int, default=0)
    ap.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--d-batch", type=int, default=64)
    ap.add_argument("--d-anchors", type=int, default=64)
    ap.add_argument("--d-lr", type=float, default=6e-4)
    ap.add_argument("--d-wd", type=float, default=0.01)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--d-budget", type=float, default=210)
    ap.add_argument("--d-max-epochs", type=float, default=50)
    ap.add_argument("--d-eval-every", type=int, default=250)
    ap.add_argument("--d-eval-seqs", type=int, default=256)
    ap.add_argument("--d-init", default="", help="continue from this drafter (safetensors, our tensor names)")
    # eval
    ap.add_argument("--e-prompts", type=int, default=20)
    ap.add_argument("--e-max-new", type=int, default=256)
    ap.add_argument("--e-budget", type=float, default=60)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    stats = json.load(open(os.path.join(a.data, "corpus_stats.json")))
    vocab, eos, mask_id = stats["vocab_size"], stats["eos_id"], stats["mask_id"]
    METRICS.update(args=vars(a), corpus=stats)
    train = torch.from_numpy(np.fromfile(os.path.join(a.data, "train.u16"), dtype=np.uint16).astype(np.int64))
    held = torch.from_numpy(np.fromfile(os.path.join(a.data, "heldout.u16"), dtype=np.uint16).astype(np.int64))
    stages = a.stages.split(",")
    if "smoke" in stages:
        smoke(dev, mask_id, eos)
    tcfg = target_config(a, vocab, eos)
    if "target" in stages:
        tcfg = stage_target(a, dev, train, held, vocab, eos)
    target = None
    if "gen" in stages or "draft" in stages:
        target = load_target(a, tcfg, dev, low(dev))
    if "gen" in stages:
        seqs, plens = stage_gen(a, dev, target, train)
    lids = a.target_layer_ids or default_target_layer_ids(tcfg.num_hidden_layers, a.d_layers)
    dcfg = draft_config(tcfg, a.d_layers, a.block, mask_id, lids, a.d_ffn)
    if "draft" in stages:
        dcfg = stage_draft(a, dev, target, tcfg, seqs, plens, mask_id)
    del target
    if "eval" in stages:
        stage_eval(a, dev, tcfg, dcfg, eos)
    METRICS["total_wall_s"] = time.time() - T0
    save_metrics(a.out)
    log("done")


if __name__ == "__main__":
    main()
