"""A from-the-notes re-implementation of the Qwen3.5 hybrid text forward (README "Hybrid target semantics"),
token by token (recurrent GDN step, conv state of K-1 inputs), checked against the transformers fixtures.

It exists to prove the notes the Rust implementer follows are exact: it reads only the checkpoint
(config.json + model.safetensors) and reproduces prompt_logits, hidden_states and the GDN states after the
prompt of targets/tests/fixtures/qwen3_5_{hybrid,vl_text}.

    python tools/oracle/hybrid_ref.py [--fixtures DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def rms_zc(x, w, eps):  # zero-centred RMSNorm: x / rms(x) * (1 + w)
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w)


def load(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    t = {k: v.float() for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    if "text_config" in cfg:  # VL checkpoint: text part under model.language_model.
        tc = cfg["text_config"]
        pre = "model.language_model."
    else:
        tc = cfg
        pre = "model."
    w = {k[len(pre):]: v for k, v in t.items() if k.startswith(pre)}
    w["lm_head.weight"] = t["lm_head.weight"] if "lm_head.weight" in t else w["embed_tokens.weight"]
    return tc, w


class State:
    def __init__(self, tc):
        self.conv = {}  # layer -> [K-1, conv_dim] last K-1 pre-conv inputs (oldest first)
        self.rec = {}  # layer -> [Hv, dk, dv]
        self.k = {}  # layer -> [n, Hkv, hd] (roped)
        self.v = {}


def forward_token(tc, w, st: State, tok: int, pos: int):
    eps = tc["rms_norm_eps"]
    d = tc["hidden_size"]
    H, Hkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    rp = tc.get("rope_parameters") or {}
    prf = rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
    rot = int(hd * prf)
    theta = rp.get("rope_theta", tc.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = pos * inv
    cos = torch.cat([ang.cos(), ang.cos()]).float()
    sin = torch.cat([ang.sin(), ang.sin()]).float()

    def rope(x):  # x [heads, hd]; rotate-half on the first `rot` dims only
        xr, xp = x[:, :rot], x[:, rot:]
        x1, x2 = xr[:, : rot // 2], xr[:, rot // 2:]
        return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, xp], -1)

    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    K = tc["linear_conv_kernel_dim"]
    h = w["embed_tokens.weight"][tok]
    hs = [h]
    for i, lt in enumerate(tc["layer_types"]):
        p = f"layers.{i}."
        x = rms_zc(h, w[p + "input_layernorm.weight"], eps)
        if lt == "linear_attention":
            a_ = p + "linear_attn."
            qkv = w[a_ + "in_proj_qkv.weight"] @ x  # [2*nk*dk + nv*dv], order q | k | v
            z = (w[a_ + "in_proj_z.weight"] @ x).view(nv, dv)
            b = w[a_ + "in_proj_b.weight"] @ x  # [nv]
            a = w[a_ + "in_proj_a.weight"] @ x  # [nv]
            cw = w[a_ + "conv1d.weight"][:, 0, :]  # [conv_dim, K], depthwise, tap K-1 = current token
            prev = st.conv.get(i, torch.zeros(K - 1, qkv.shape[0]))
            window = torch.cat([prev, qkv[None]], 0)  # [K, conv_dim] oldest first
            st.conv[i] = window[1:]
            c = F.silu((window.T * cw).sum(-1))
            q, k, v = c[: nk * dk].view(nk, dk), c[nk * dk: 2 * nk * dk].view(nk, dk), c[2 * nk * dk:].view(nv, dv)
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            q = q * dk**-0.5
            rep = nv // nk  # v head j uses k head j // rep
            q, k = q.repeat_interleave(rep, 0), k.repeat_interleave(rep, 0)
            beta = torch.sigmoid(b)
            g = -torch.exp(w[a_ + "A_log"]) * F.softplus(a + w[a_ + "dt_bias"])
            S = st.rec.get(i, torch.zeros(nv, dk, dv)) * torch.exp(g)[:, None, None]
            kv_mem = (S * k[:, :, None]).sum(1)  # [nv, dv] = S^T k
            delta = (v - kv_mem) * beta[:, None]
            S = S + k[:, :, None] * delta[:, None, :]
            st.rec[i] = S
            o = (S * q[:, :, None]).sum(1)  # [nv, dv]
            o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * w[a_ + "norm.weight"] * F.silu(z)
            h = h + w[a_ + "out_proj.weight"] @ o.reshape(-1)
        else:
            a_ = p + "self_attn."
            qg = (w[a_ + "q_proj.weight"] @ x).view(H, 2 * hd)
            q, gate = qg[:, :hd], qg[:, hd:]  # per head: [query hd | gate hd]
            q = q * torch.rsqrt((q * q).mean(-1, keepdim=True) + eps) * (1.0 + w[a_ + "q_norm.weight"])
            k = (w[a_ + "k_proj.weight"] @ x).view(Hkv, hd)
            k = k * torch.rsqrt((k * k).mean(-1, keepdim=True) + eps) * (1.0 + w[a_ + "k_norm.weight"])
            v = (w[a_ + "v_proj.weight"] @ x).view(Hkv, hd)
            q, k = rope(q), rope(k)
            st.k[i] = torch.cat([st.k.get(i, torch.zeros(0, Hkv, hd)), k[None]])
            st.v[i] = torch.cat([st.v.get(i, torch.zeros(0, Hkv, hd)), v[None]])
            g_ = H // Hkv
            kk, vv = st.k[i].repeat_interleave(g_, 1), st.v[i].repeat_interleave(g_, 1)
            sc = torch.einsum("hd,nhd->hn", q, kk) * hd**-0.5
            o = torch.einsum("hn,nhd->hd", torch.softmax(sc, -1), vv).reshape(-1)
            o = o * torch.sigmoid(gate.reshape(-1))
            h = h + w[a_ + "o_proj.weight"] @ o
        u = rms_zc(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + w[p + "mlp.down_proj.weight"] @ (F.silu(w[p + "mlp.gate_proj.weight"] @ u) * (w[p + "mlp.up_proj.weight"] @ u))
        hs.append(h)
    z = rms_zc(h, w["norm.weight"], eps)
    hs[-1] = z  # transformers: hidden_states[L] is after the final norm
    return w["lm_head.weight"] @ z, torch.stack(hs)


def run_prompt(model_dir, ids, dtype=torch.float64):
    """Prompt logits [P, V] of this re-implementation in `dtype` (float64: the error gauge of the fixtures)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        tc, w = load(model_dir)
        w = {k: v.to(dtype) for k, v in w.items()}
        st = State(tc)
        return torch.stack([forward_token(tc, w, st, t, p)[0] for p, t in enumerate(ids.tolist())])
    finally:
        torch.set_default_dtype(old)


def check(case_dir):
    from make_fixtures import max_rel

    tc, w = load(os.path.join(case_dir, "model"))
    io = load_file(os.path.join(case_dir, "io.safetensors"))
    st = State(tc)
    logits, hss = [], []
    for pos, tok in enumerate(io["prompt_ids"].tolist()):
        lg, hs = forward_token(tc, w, st, tok, pos)
        logits.append(lg)
        hss.append(hs)
    logits = torch.stack(logits)
    hss = torch.stack(hss, 1)
    errs = {"prompt_logits": max_rel(logits, io["prompt_logits"]), "hidden_states": max_rel(hss, io["hidden_states"])}
    for k in io:
        if k.startswith("recurrent_state."):
            i = int(k.split(".")[1])
            errs[k] = max_rel(st.rec[i], io[k])
        if k.startswith("conv_state."):
            i = int(k.split(".")[1])
            errs[k] = max_rel(st.conv[i].T, io[k][:, 1:])  # transformers keeps K columns; the last K-1 matter
    # greedy continuation, token by token
    toks = []
    nxt = int(torch.argmax(logits[-1]))
    pos = io["prompt_ids"].shape[0]
    for _ in range(io["greedy_ids"].shape[0]):
        toks.append(nxt)
        lg, _ = forward_token(tc, w, st, nxt, pos)
        pos += 1
        nxt = int(torch.argmax(lg))
    same = toks == io["greedy_ids"].tolist()
    worst = max(errs.values())
    print(f"{os.path.basename(case_dir)}: max rel {worst:.1e} ({', '.join(f'{k} {v:.1e}' for k, v in errs.items() if not k[-1].isdigit())}); "
          f"states max rel {max([v for k, v in errs.items() if k[-1].isdigit()] or [0]):.1e}; greedy identical: {same}")
    return worst <= 1e-5 and same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(REPO, "targets", "tests", "fixtures"))
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    ok = all(check(os.path.join(args.fixtures, c)) for c in ("qwen3_5_hybrid", "qwen3_5_vl_text"))
    print("hybrid_ref:", "OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
