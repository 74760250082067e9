"""Plain-PyTorch DFlash drafter (z-lab layout, dflash-semantics.md §2) and helpers.

The module names give exactly the z-lab safetensors names of §2.1:
fc.weight, hidden_norm.weight, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, norm.weight.
The drafter has no embedding or LM head: it uses the (frozen) target's.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def rope_cos_sin(pos, head_dim, theta):
    """pos: integer tensor [...]; returns cos, sin [..., head_dim] (NeoX layout), fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    fr = pos.float()[..., None] * inv
    emb = torch.cat([fr, fr], -1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [B, S, H, hd]; cos/sin [B, S, hd]."""
    h = x.shape[-1] // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, H, Hkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.H, self.Hkv, self.hd = H, Hkv, hd
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, a, ctx, cos_q, sin_q, cos_k, sin_k, mask):
        B, Q, _ = a.shape
        T = ctx.shape[1]
        q = self.q_norm(self.q_proj(a).view(B, Q, self.H, self.hd))
        k = torch.cat([self.k_proj(ctx).view(B, T, self.Hkv, self.hd),
                       self.k_proj(a).view(B, Q, self.Hkv, self.hd)], 1)
        k = self.k_norm(k)
        v = torch.cat([self.v_proj(ctx).view(B, T, self.Hkv, self.hd),
                       self.v_proj(a).view(B, Q, self.Hkv, self.hd)], 1)
        q = apply_rope(q, cos_q, sin_q)
        k = apply_rope(k, cos_k, sin_k)
        q, k = q.to(v.dtype), k.to(v.dtype)
        rep = self.H // self.Hkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=1.0 / math.sqrt(self.hd))
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.H * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, h, ctx, rope, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, *rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d = c["hidden_size"]
        m = len(c["dflash_config"]["target_layer_ids"])
        self.fc = nn.Linear(m * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(d, c["rms_norm_eps"])
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)

    def forward(self, noise, taps, q_pos, ctx_pos, mask):
        """noise [B,Q,d] (target embeddings of the block tokens), taps [B,T,m*d],
        q_pos [B,Q], ctx_pos [B,T] absolute positions, mask bool [B,1,Q,T+Q] or None.
        Returns the final-normed block rows [B,Q,d]."""
        ctx = self.hidden_norm(self.fc(taps))
        hd, theta = self.c["head_dim"], self.c["rope_theta"]
        cos_q, sin_q = rope_cos_sin(q_pos, hd, theta)
        cos_k, sin_k = rope_cos_sin(torch.cat([ctx_pos, q_pos], 1), hd, theta)
        h = noise
        for layer in self.layers:
            h = layer(h, ctx, (cos_q, sin_q, cos_k, sin_k), mask)
        return self.norm(h)


def default_target_layer_ids(n_target, n_draft):
    """dflash-semantics.md §2.2 default rule (Python round = banker's rounding)."""
    if n_draft == 1:
        return [n_target // 2]
    return [int(round(1 + i * (n_target - 4) / (n_draft - 1))) for i in range(n_draft)]


def draft_config(tcfg, n_layers, block_size, mask_id, layer_ids, intermediate=None):
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(layer_ids)},
        "num_target_layers": tcfg.num_hidden_layers,
        "num_hidden_layers": n_layers,
        "hidden_size": tcfg.hidden_size,
        "num_attention_heads": tcfg.num_attention_heads,
        "num_key_value_heads": tcfg.num_key_value_heads,
        "head_dim": tcfg.head_dim,
        "intermediate_size": intermediate or tcfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "layer_types": ["full_attention"] * n_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "vocab_size": tcfg.vocab_size,
        "tie_word_embeddings": True,
        "eos_token_id": tcfg.eos_token_id,
        "dtype": "bfloat16",
    }


def target_taps(target, ids, layer_ids):
    """HF hidden_states[l+1] for l in layer_ids, concatenated on the feature axis, plus logits."""
    out = target(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[l + 1] for l in layer_ids], -1), out.logits


@torch.no_grad()
def plain_greedy(target, prompt, max_new, eos_id):
    """Plain greedy decode by full recompute (same kernels as the verify forward)."""
    dev = next(target.parameters()).device
    out = list(prompt)
    for _ in range(max_new):
        logits = target(input_ids=torch.tensor([out], device=dev)).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        if t == eos_id:
            break
    return out[len(prompt):]


@torch.no_grad()
def spec_greedy(target, draft, prompt, max_new, eos_id, propose=None):
    """Greedy DFlash loop of dflash-semantics.md §3.3 (target recomputed without a cache:
    the verify forward over out[:s] + block gives the next round's context taps).
    propose(out, s) -> b-1 tokens replaces the drafter (tests only).
    Returns (generated tokens, list of per-round acceptance lengths a+1)."""
    c = draft.c
    b = c["block_size"]
    mask_id = c["dflash_config"]["mask_token_id"]
    lids = c["dflash_config"]["target_layer_ids"]
    dev = next(target.parameters()).device
    emb = target.get_input_embeddings()
    lm_head = target.get_output_embeddings()
    P = len(prompt)
    taps, logits = target_taps(target, torch.tensor([prompt], device=dev), lids)
    out = list(prompt) + [int(logits[0, -1].argmax())]
    s = P
    lens = []
    while len(out) - P < max_new and out[-1] != eos_id:
        if propose is None:
            blk = torch.tensor([[out[s]] + [mask_id] * (b - 1)], device=dev)
            q_pos = torch.arange(s, s + b, device=dev)[None]
            ctx_pos = torch.arange(0, s, device=dev)[None]
            z = draft(emb(blk), taps[:, :s], q_pos, ctx_pos, None)
            drafts = lm_head(z[:, 1:]).argmax(-1)[0].tolist()
        else:
            drafts = list(propose(out, s))
        seq = out[: s + 1] + drafts
        taps_v, vlog = target_taps(target, torch.tensor([seq], device=dev), lids)
        post = vlog[0, s:].argmax(-1).tolist()  # post[j] = target's token for position s+j+1
        a = 0
        while a < b - 1 and drafts[a] == post[a]:
            a += 1
        out = out[: s + 1] + drafts[:a] + [post[a]]
        lens.append(a + 1)
        s = s + a + 1
        taps = taps_v
        gen = out[P:]
        if eos_id in gen:
            out = out[: P + gen.index(eos_id) + 1]
            break
    return out[P:][:max_new], lens
