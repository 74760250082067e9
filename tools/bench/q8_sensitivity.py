# How much two correct implementations of the 8B-shaped q8_0 drafter step may differ: the same
# random network (q8_0 weights, activations quantized to q8_0 per 32-block after a factored
# RMSNorm, as tools/bench/persistent_step.cu runs it) evaluated in numpy three ways: the plain
# f32 reference, with q and P rounded to f16 in the attention (the persistent kernel's tensor-core
# inputs), and with the embedding rows perturbed by a relative 1e-4 or 1e-6. A q8 code flips by a
# whole step wherever a tiny input difference crosses a rounding boundary, so any two
# implementations end ~2e-2 apart in x after 5 layers; persistent_step.cu's check compares against
# that sensitivity, measured on its own network. Run: python3 q8_sensitivity.py (numpy; ~15 s,
# ~7 GB of memory).

import numpy as np
H, NH, NKV, HD, I, L, R, CTX = 4096, 32, 8, 128, 12288, 5, 16, 512
rng = np.random.default_rng(1)
def qw(N, K):
    codes = rng.integers(-127, 128, size=(N, K), dtype=np.int8)
    sc = (np.sqrt(3.0 / K) / 127 * (1 + 0.5 * rng.uniform(-1, 1, size=(N, K // 32)))).astype(np.float16).astype(np.float32)
    return (codes.astype(np.float32).reshape(N, K // 32, 32) * sc[:, :, None]).reshape(N, K)
Ws = []
for l in range(L):
    Ws.append(dict(qkv=qw(H + 2 * NKV * HD, H), o=qw(H, H), g=qw(I, H), u=qw(I, H), d=qw(H, I),
                   nin=rng.uniform(0.8, 1.2, H).astype(np.float32), npost=rng.uniform(0.8, 1.2, H).astype(np.float32),
                   qn=rng.uniform(0.8, 1.2, HD).astype(np.float32), kn=rng.uniform(0.8, 1.2, HD).astype(np.float32),
                   kc=rng.uniform(-1, 1, (NKV, CTX, HD)).astype(np.float16).astype(np.float32),
                   vc=rng.uniform(-1, 1, (NKV, CTX, HD)).astype(np.float16).astype(np.float32)))
emb = rng.uniform(-1, 1, (R, H)).astype(np.float32)
def q8(v):  # per 32-block of each row: codes * d
    b = v.reshape(v.shape[0], -1, 32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    c = np.where(d > 0, np.rint(b / np.where(d > 0, d, 1)), 0)
    return (c * d).reshape(v.shape).astype(np.float32)
def rope(x, pos):
    i = np.arange(64, dtype=np.float32)
    f = np.float32(1e6) ** (-2 * i / 128)
    a = pos[:, None].astype(np.float32) * f[None]
    c, s = np.cos(a), np.sin(a)
    x1, x2 = x[..., :64], x[..., 64:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
def run(f16=False, pert=0.0):
    x = emb * (1 + pert * rng.uniform(-1, 1, emb.shape).astype(np.float32)) if pert else emb.copy()
    pos = np.arange(CTX, CTX + R)
    for W in Ws:
        rinv = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
        qkv = (q8(x * W['nin']) @ W['qkv'].T) * rinv
        q = qkv[:, :H].reshape(R, NH, HD); k = qkv[:, H:H + NKV * HD].reshape(R, NKV, HD); v = qkv[:, H + NKV * HD:].reshape(R, NKV, HD)
        q = q / np.sqrt((q * q).mean(-1, keepdims=True) + 1e-6) * W['qn']
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + 1e-6) * W['kn']
        q = np.stack([rope(q[:, h], pos) for h in range(NH)], 1); k = np.stack([rope(k[:, g], pos) for g in range(NKV)], 1)
        k16 = k.astype(np.float16).astype(np.float32); v16 = v.astype(np.float16).astype(np.float32)
        att = np.zeros((R, H), np.float32)
        for h in range(NH):
            g = h // 4
            K = np.concatenate([W['kc'][g], k16[:, g]], 0); V = np.concatenate([W['vc'][g], v16[:, g]], 0)
            qq = q[:, h] / np.sqrt(128)
            if f16: qq = (qq * np.float32(1.4426950408889634)).astype(np.float16).astype(np.float32) / np.float32(1.4426950408889634)
            s = qq @ K.T
            p = np.exp(s - s.max(-1, keepdims=True))
            if f16: p = p.astype(np.float16).astype(np.float32)
            att[:, h * HD:(h + 1) * HD] = (p @ V) / p.sum(-1, keepdims=True)
        x = x + q8(att) @ W['o'].T
        rinv = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
        a = q8(x * W['npost'])
        gg = (a @ W['g'].T) * rinv; uu = (a @ W['u'].T) * rinv
        m = gg / (1 + np.exp(-gg)) * uu
        x = x + q8(m) @ W['d'].T
    return x
def rel(a, b): return float(np.linalg.norm(a - b) / np.linalg.norm(b))
x0 = run(); x1 = run(f16=True); x2 = run(pert=1e-4); x3 = run(pert=1e-6)
print("x rel: f16 q/P vs reference %.3e; 1e-4 input noise %.3e; 1e-6 input noise %.3e; |x| rms %.3f" % (rel(x1, x0), rel(x2, x0), rel(x3, x0), float(np.sqrt((x0 * x0).mean()))))
