"""Independent PyTorch oracle for the DFlash / DSpark drafter.

Written from docs/dflash-semantics.md (sections 2, 3, 6 and 7), not from any engine's code.
Everything is plain tensor arithmetic with an explicit softmax attention, so every step can be
read against the spec:

* config parsing: z-lab nesting (``dflash_config.{mask_token_id,target_layer_ids,block_size}``),
  DeepSpec / seed top-level keys, the default ``target_layer_ids`` rule (sec. 2.2), ``layer_types``
  / ``sliding_window``, ``rope_theta`` + ``rope_scaling`` (transformers 4.x) or ``rope_parameters``
  (transformers 5.x);
* RoPE (neox rotate-half) with default / linear / llama3 / yarn inverse frequencies computed here
  in float64 and checked against transformers' own ``ROPE_INIT_FUNCTIONS`` (``check_inv_freq``);
* ctx features ``hidden_norm(fc(taps))`` (sec. 2.3);
* the block forward over ``[ctx ; block]`` (sec. 2.5): full layers no mask, sliding layers the causal
  window ``p - W < q <= p`` over absolute positions (sec. 2.8, project decision);
* draft logits through the target's lm_head, DFlash rows 1..b-1 or anchor-predicts rows 0..b-1;
* the vanilla Markov chain (sec. 7.2/7.3) and confidence logits (sec. 7.4).

The cached path (``DraftCache`` + ``block_forward``) keeps per-layer context K (k-normed, roped) and V
like the Rust ``kv`` crate; ``full_forward`` recomputes everything from all taps. They must agree.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def build_target_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """Default tap rule (semantics sec. 2.2): start 1, end n_target-3, Python (banker's) round."""
    if n_draft == 1:
        return [n_target // 2]
    return [int(round(1 + i * (n_target - 4) / (n_draft - 1))) for i in range(n_draft)]


@dataclass
class RopeCfg:
    rope_type: str  # default | linear | llama3 | yarn
    theta: float
    params: dict  # the full parameter dict (factor, original_max_position_embeddings, ...)
    dim: int  # rotary dimension (head_dim * partial_rotary_factor)
    max_position_embeddings: int


@dataclass
class DraftConfig:
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    layer_types: list[str]
    sliding_window: int | None
    rope: RopeCfg
    layout: str  # "dflash" (rows 1..b-1) | "anchor" (rows 0..b-1)
    markov_rank: int = 0
    markov_type: str | None = None
    confidence: bool = False
    confidence_with_markov: bool = False
    attention_bias: bool = False
    raw: dict = field(default_factory=dict)


def _rope_from_config(cfg: dict, head_dim: int) -> RopeCfg:
    if isinstance(cfg.get("rope_parameters"), dict):
        rp = dict(cfg["rope_parameters"])
        theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        rp = dict(cfg.get("rope_scaling") or {})
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    dim = int(head_dim * partial)
    return RopeCfg(
        rope_type=rtype,
        theta=theta,
        params=rp,
        dim=dim,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
    )


def parse_config(cfg: dict, tensor_names: set[str] | None = None, layout: str | None = None) -> DraftConfig:
    dfc = cfg.get("dflash_config") or {}
    hidden = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    n_layers = int(cfg["num_hidden_layers"])
    block_size = cfg.get("block_size", dfc.get("block_size"))
    mask = dfc.get("mask_token_id", cfg.get("mask_token_id"))
    ids = dfc.get("target_layer_ids", cfg.get("target_layer_ids"))
    n_target = cfg.get("num_target_layers", dfc.get("num_target_layers"))
    if ids is None:
        if n_target is None:
            raise ValueError("config has neither target_layer_ids nor num_target_layers")
        ids = build_target_layer_ids(int(n_target), n_layers)
    if block_size is None or mask is None:
        raise ValueError("config lacks block_size or mask_token_id")
    layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise ValueError("layer_types length != num_hidden_layers")
    window = cfg.get("sliding_window")
    if any(t == "sliding_attention" for t in layer_types) and not window:
        raise ValueError("sliding_attention layer without sliding_window")
    archs = cfg.get("architectures") or []
    if layout is None:
        layout = "anchor" if "Qwen3DSparkModel" in archs else "dflash"
    names = tensor_names or set()
    markov_rank = 0
    markov_type = None
    if "markov_head.markov_w1.weight" in names:
        markov_rank = int(cfg.get("markov_rank", dfc.get("markov_rank", 0)))
        markov_type = cfg.get("markov_head_type", dfc.get("markov_head_type", "vanilla"))
    confidence = "confidence_head.proj.weight" in names
    conf_markov = bool(cfg.get("confidence_head_with_markov", dfc.get("confidence_head_with_markov", False)))
    return DraftConfig(
        hidden=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=head_dim,
        intermediate=int(cfg["intermediate_size"]),
        eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab=int(cfg["vocab_size"]),
        block_size=int(block_size),
        mask_token_id=int(mask),
        target_layer_ids=[int(x) for x in ids],
        num_target_layers=None if n_target is None else int(n_target),
        layer_types=list(layer_types),
        sliding_window=None if window is None else int(window),
        rope=_rope_from_config(cfg, head_dim),
        layout=layout,
        markov_rank=markov_rank,
        markov_type=markov_type,
        confidence=confidence,
        confidence_with_markov=conf_markov,
        attention_bias=bool(cfg.get("attention_bias", False)),
        raw=cfg,
    )


# ----------------------------------------------------------------------------------------------
# RoPE (semantics sec. 6), float64
# ----------------------------------------------------------------------------------------------


def inv_freq_f64(rope: RopeCfg) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64) and attention factor, from the formulas of sec. 6."""
    dim = rope.dim
    base = rope.theta
    p = rope.params
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    pos_freq = base ** (i / dim)
    inv = 1.0 / pos_freq
    t = rope.rope_type
    if t == "default":
        return inv, 1.0
    if t == "linear":
        return inv / float(p["factor"]), 1.0
    if t == "llama3":
        s = float(p["factor"])
        lf = float(p["low_freq_factor"])
        hf = float(p["high_freq_factor"])
        lo = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > lo / lf, inv / s, inv)
        smooth = (lo / wavelen - lf) / (hf - lf)
        blended = (1 - smooth) * out / s + smooth * out
        medium = (wavelen >= lo / hf) & (wavelen <= lo / lf)
        return torch.where(medium, blended, out), 1.0
    if t == "yarn":
        s = p.get("factor")
        lo = p.get("original_max_position_embeddings") or rope.max_position_embeddings
        if s is None:
            s = rope.max_position_embeddings / lo
        s = float(s)
        lo = float(lo)

        def mscale(x, m=1.0):
            return 1.0 if x <= 1 else 0.1 * m * math.log(x) + 1.0

        af = p.get("attention_factor")
        if af is None:
            if p.get("mscale") and p.get("mscale_all_dim"):
                af = mscale(s, float(p["mscale"])) / mscale(s, float(p["mscale_all_dim"]))
            else:
                af = mscale(s)
        bf = p.get("beta_fast") or 32
        bs = p.get("beta_slow") or 1
        truncate = p.get("truncate", True)

        def cdim(r):
            return dim * math.log(lo / (2 * math.pi * r)) / (2 * math.log(base))

        low, high = cdim(bf), cdim(bs)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp
        inv_int = 1.0 / (s * pos_freq)
        return inv_int * (1 - extrap) + inv * extrap, float(af)
    raise ValueError(f"unsupported rope_type {t}")


def transformers_inv_freq(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """The reference: transformers' own rope init function for the same parameters (float32)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = dict(cfg.rope.params)
    rp["rope_theta"] = cfg.rope.theta
    rp["rope_type"] = cfg.rope.rope_type
    rp.pop("type", None)
    qc = Qwen3Config(
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.rope.max_position_embeddings,
        rope_parameters=rp,
    )
    if cfg.rope.rope_type == "default":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        inv, af = Qwen3RotaryEmbedding.compute_default_rope_parameters(qc, "cpu")
    else:
        inv, af = ROPE_INIT_FUNCTIONS[cfg.rope.rope_type](qc, "cpu")
    return inv.to(torch.float64), float(af)


def check_inv_freq(cfg: DraftConfig, rel_tol: float = 1e-7) -> tuple[float, float]:
    """Assert our float64 inv_freq equals transformers' (float32) within rel_tol; returns (max rel, af diff)."""
    ours, af = inv_freq_f64(cfg.rope)
    ref, ref_af = transformers_inv_freq(cfg)
    rel = ((ours - ref).abs() / ref.abs()).max().item()
    afd = abs(af - ref_af)
    assert rel <= rel_tol, f"inv_freq mismatch: max rel {rel}"
    assert afd <= 1e-12, f"attention_factor mismatch {af} vs {ref_af}"
    return rel, afd


def rope_tables(cfg: DraftConfig, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, dim] (neox: freqs repeated twice), scaled by the attention factor; angles in float64."""
    inv, af = inv_freq_f64(cfg.rope)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * af).to(dtype), (emb.sin() * af).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """x [n, heads, hd]; rotate-half on the first rot_dim dims."""
    xr, xp = x[..., :rot_dim], x[..., rot_dim:]
    h = rot_dim // 2
    x1, x2 = xr[..., :h], xr[..., h:]
    rot = torch.cat([-x2, x1], dim=-1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    return torch.cat([out, xp], dim=-1)


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------

QUANT_LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def policy_quant_type(name: str, precision: str) -> str | None:
    """Which gguf type the Rust precision policy uses for a tensor (None = keep float)."""
    if not name.endswith(".weight"):
        return None
    short = name[: -len(".weight")].split(".")[-1]
    if short not in QUANT_LINEARS:
        return None
    if precision in ("q8_0", "q4_0"):
        return precision
    if precision == "mixed":
        return "q8_0" if short in ("gate_proj", "up_proj", "down_proj") else None
    return None


def quant_roundtrip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """gguf 0.19.0 quantize then dequantize (row-major, blocks of 32 along the input dim)."""
    import gguf
    import numpy as np

    t = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[qtype]
    a = w.to(torch.float32).numpy().astype(np.float32)
    if qtype == "q4_0":
        blocks = a.reshape(-1, 32)
        allzero = (blocks == 0).all(axis=1)
        if allzero.any():
            raise ValueError("q4_0 all-zero block: gguf-py and ggml C may differ on its sign; avoid")
    q = gguf.quants.quantize(a, t)
    d = gguf.quants.dequantize(q, t).reshape(a.shape)
    return torch.from_numpy(d.astype(np.float32))


class DraftWeights:
    """Drafter tensors as float tensors of the compute dtype (bf16 upcast, quantized per policy)."""

    def __init__(self, tensors: dict[str, torch.Tensor], cfg: DraftConfig, precision: str = "f32", dtype=torch.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.t = {}
        for k, v in tensors.items():
            v = v.to(torch.float32)
            q = policy_quant_type(k, precision)
            if q is not None:
                v = quant_roundtrip(v, q)
            self.t[k] = v.to(dtype)
        m = len(cfg.target_layer_ids)
        fc = self.t["fc.weight"]
        if tuple(fc.shape) != (cfg.hidden, m * cfg.hidden):
            raise ValueError(f"fc.weight shape {tuple(fc.shape)} != ({cfg.hidden}, {m * cfg.hidden})")

    def __getitem__(self, k):
        return self.t[k]

    def get(self, k):
        return self.t.get(k)


def load_draft(draft_dir: str, precision: str = "f32", dtype=torch.float32, layout: str | None = None):
    from safetensors.torch import load_file

    with open(os.path.join(draft_dir, "config.json")) as f:
        raw = json.load(f)
    tensors = load_file(os.path.join(draft_dir, "model.safetensors"))
    cfg = parse_config(raw, set(tensors), layout)
    return cfg, DraftWeights(tensors, cfg, precision, dtype)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = (x * x).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * w


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def ctx_features(W: DraftWeights, taps: torch.Tensor) -> torch.Tensor:
    """c = hidden_norm(fc(taps)); taps [n, m*d]."""
    return rms_norm(linear(taps.to(W.dtype), W["fc.weight"]), W["hidden_norm.weight"], W.cfg.eps)


def _kv(W, i, x, positions):
    cfg = W.cfg
    p = f"layers.{i}.self_attn."
    n = x.shape[0]
    k = linear(x, W[p + "k_proj.weight"], W.get(p + "k_proj.bias")).view(n, cfg.n_kv_heads, cfg.head_dim)
    k = rms_norm(k, W[p + "k_norm.weight"], cfg.eps)
    cos, sin = rope_tables(cfg, positions, W.dtype)
    k = apply_rope(k, cos, sin, cfg.rope.dim)
    v = linear(x, W[p + "v_proj.weight"], W.get(p + "v_proj.bias")).view(n, cfg.n_kv_heads, cfg.head_dim)
    return k, v


def attention(cfg: DraftConfig, layer: int, q, qpos, k, v, kpos):
    """Explicit softmax attention. q [nq,H,hd], k/v [nk,Hkv,hd]. Full layers: no mask; sliding: p-W<q<=p."""
    g = cfg.n_heads // cfg.n_kv_heads
    kh = k.repeat_interleave(g, dim=1)  # head h uses kv head h // g
    vh = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kh) * (cfg.head_dim**-0.5)
    if cfg.layer_types[layer] == "sliding_attention":
        w = cfg.sliding_window
        qp = qpos[:, None]
        kp = kpos[None, :]
        allowed = (kp > qp - w) & (kp <= qp)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
    elif cfg.layer_types[layer] != "full_attention":
        raise ValueError(f"unknown layer type {cfg.layer_types[layer]}")
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vh)


class DraftCache:
    """Per-layer context K (k-normed, roped) and V, in committed order, with their absolute positions."""

    def __init__(self, W: DraftWeights):
        self.W = W
        self.k = [None] * W.cfg.n_layers
        self.v = [None] * W.cfg.n_layers
        self.pos = torch.zeros(0, dtype=torch.long)

    def __len__(self):
        return int(self.pos.shape[0])

    def ingest(self, taps: torch.Tensor, start: int) -> torch.Tensor:
        """Append context rows for positions start..start+n-1; returns their ctx features."""
        assert start == len(self), f"ingest at {start} but cache holds {len(self)} rows"
        c = ctx_features(self.W, taps)
        positions = torch.arange(start, start + c.shape[0])
        for i in range(self.W.cfg.n_layers):
            k, v = _kv(self.W, i, c, positions)
            self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k])
            self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v])
        self.pos = torch.cat([self.pos, positions])
        return c

    def crop(self, n: int):
        self.pos = self.pos[:n]
        self.k = [None if k is None else k[:n] for k in self.k]
        self.v = [None if v is None else v[:n] for v in self.v]


def block_forward(W: DraftWeights, cache: DraftCache, block_tokens: torch.Tensor, embed: torch.Tensor, start: int):
    """Block rows at positions start..start+b-1 attend to [cached ctx ; block]. Returns (layer outs, final)."""
    cfg = W.cfg
    b = block_tokens.shape[0]
    qpos = torch.arange(start, start + b)
    h = embed.to(W.dtype)[block_tokens]
    cos, sin = rope_tables(cfg, qpos, W.dtype)
    outs = []
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        a = rms_norm(h, W[p + "input_layernorm.weight"], cfg.eps)
        q = linear(a, W[p + "self_attn.q_proj.weight"], W.get(p + "self_attn.q_proj.bias"))
        q = rms_norm(q.view(b, cfg.n_heads, cfg.head_dim), W[p + "self_attn.q_norm.weight"], cfg.eps)
        q = apply_rope(q, cos, sin, cfg.rope.dim)
        kb, vb = _kv(W, i, a, qpos)
        if len(cache):
            k = torch.cat([cache.k[i], kb])
            v = torch.cat([cache.v[i], vb])
            kpos = torch.cat([cache.pos, qpos])
        else:
            k, v, kpos = kb, vb, qpos
        o = attention(cfg, i, q, qpos, k, v, kpos).reshape(b, cfg.n_heads * cfg.head_dim)
        h = h + linear(o, W[p + "self_attn.o_proj.weight"], W.get(p + "self_attn.o_proj.bias"))
        u = rms_norm(h, W[p + "post_attention_layernorm.weight"], cfg.eps)
        gate = linear(u, W[p + "mlp.gate_proj.weight"])
        up = linear(u, W[p + "mlp.up_proj.weight"])
        h = h + linear(torch.nn.functional.silu(gate) * up, W[p + "mlp.down_proj.weight"])
        outs.append(h)
    z = rms_norm(h, W["norm.weight"], cfg.eps)
    return outs, z


def full_forward(W: DraftWeights, taps: torch.Tensor, block_tokens: torch.Tensor, embed: torch.Tensor):
    """Uncached: ctx rows 0..n-1 from taps, block at n..n+b-1."""
    cache = DraftCache(W)
    c = cache.ingest(taps, 0)
    outs, z = block_forward(W, cache, block_tokens, embed, taps.shape[0])
    return c, outs, z


def draft_rows(cfg: DraftConfig, z: torch.Tensor) -> torch.Tensor:
    """The rows that become drafts: DFlash rows 1..b-1, anchor-predicts rows 0..b-1."""
    return z[1:] if cfg.layout == "dflash" else z


def draft_logits(cfg: DraftConfig, z: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    return draft_rows(cfg, z) @ lm_head.to(z.dtype).T


def markov_chain(W: DraftWeights, logits: torch.Tensor, zrows: torch.Tensor, anchor: int):
    """Vanilla Markov head, sequential: prev = anchor, then each realized (argmax) draft.

    Returns (markov_logits [nd,V], tokens [nd], confidence_logits [nd] or None)."""
    cfg = W.cfg
    w1 = W.get("markov_head.markov_w1.weight")
    w2 = W.get("markov_head.markov_w2.weight")
    if cfg.markov_type not in (None, "vanilla"):
        raise ValueError(f"markov head type {cfg.markov_type} not supported by the oracle")
    cw = W.get("confidence_head.proj.weight")
    cb = W.get("confidence_head.proj.bias")
    prev = int(anchor)
    out_logits, toks, conf = [], [], []
    for k in range(logits.shape[0]):
        lk = logits[k]
        if w1 is not None:
            lk = lk + w2 @ w1[prev]
        if cw is not None:
            feat = zrows[k]
            if cfg.confidence_with_markov:
                feat = torch.cat([feat, w1[prev]])
            c = (cw @ feat)[0]
            if cb is not None:
                c = c + cb[0]
            conf.append(c)
        t = int(torch.argmax(lk))
        out_logits.append(lk)
        toks.append(t)
        prev = t
    return (
        torch.stack(out_logits),
        torch.tensor(toks, dtype=torch.long),
        torch.stack(conf) if conf else None,
    )


def propose(W: DraftWeights, cache: DraftCache, anchor: int, start: int, embed, lm_head, use_markov=True):
    """One drafting step at a round start: block [anchor, MASK x (b-1)] at positions start.. (cache holds < start).
    Returns the draft tokens (nd of them)."""
    cfg = W.cfg
    blk = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long)
    blk[0] = anchor
    _, z = block_forward(W, cache, blk, embed, start)
    lg = draft_logits(cfg, z, lm_head)
    if use_markov and W.get("markov_head.markov_w1.weight") is not None:
        _, toks, _ = markov_chain(W, lg, draft_rows(cfg, z), anchor)
        return toks
    return torch.argmax(lg, dim=-1)


def check_rope_tables(cfg: DraftConfig, positions: torch.Tensor) -> float:
    """Our cos/sin (float64 angles, times attention factor) vs transformers' Qwen3RotaryEmbedding (float32).
    Returns the max abs difference."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rp = dict(cfg.rope.params)
    rp["rope_theta"] = cfg.rope.theta
    rp["rope_type"] = cfg.rope.rope_type
    rp.pop("type", None)
    qc = Qwen3Config(
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.rope.max_position_embeddings,
        rope_parameters=rp,
    )
    emb = Qwen3RotaryEmbedding(qc)
    x = torch.zeros(1, positions.shape[0], cfg.head_dim)
    cos_ref, sin_ref = emb(x, positions[None])
    cos, sin = rope_tables(cfg, positions, torch.float64)
    return max(
        float((cos - cos_ref[0].double()).abs().max()),
        float((sin - sin_ref[0].double()).abs().max()),
    )
