//! Shared helpers of the hybrid target tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use dflash_backend::cpu::Cpu;
use dflash_backend::{KvStorage, RopeSpec};
use dflash_spec_round::{RollbackArm, Target};
use dflash_targets::hybrid::{
    HostTensors, HybridArch, HybridConfig, HybridTarget, LayerKind, TensorNames,
};
use dflash_targets::{LoadOptions, LogitRows};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::{Dtype, SafeTensors};

/// A reference case produced by `tests/hybrid_ref/make_ref.py`.
pub struct RefCase {
    pub dir: PathBuf,
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    pub ids: BTreeMap<String, Vec<u32>>,
}

pub fn ref_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/hybrid_ref")
        .join(case)
}

/// Read every tensor of `io.safetensors` (f32 as values, i64 as token ids).
pub fn read_io(dir: PathBuf) -> RefCase {
    let bytes = std::fs::read(dir.join("io.safetensors")).expect("io.safetensors");
    let st = SafeTensors::deserialize(&bytes).expect("parse io.safetensors");
    let mut tensors = BTreeMap::new();
    let mut ids = BTreeMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        match view.dtype() {
            Dtype::F32 => {
                let v = data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                tensors.insert(name, (view.shape().to_vec(), v));
            }
            Dtype::I64 => {
                let v = data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
                    .collect();
                ids.insert(name, v);
            }
            other => panic!("unexpected dtype {other:?} for {name}"),
        }
    }
    RefCase { dir, tensors, ids }
}

/// max |a - b| / max |b|.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// A small hybrid shape: `pattern` gives the layer kinds (`'l'` linear, `'f'` full).
pub fn tiny_config(vocab: usize, hidden: usize, pattern: &str, next_style: bool) -> HybridConfig {
    let layer_kinds: Vec<LayerKind> = pattern
        .chars()
        .map(|c| {
            if c == 'f' {
                LayerKind::Full
            } else {
                LayerKind::Linear
            }
        })
        .collect();
    let n = layer_kinds.len();
    let head_dim = 16;
    let rot = 8;
    HybridConfig {
        arch: if next_style {
            HybridArch::Qwen3Next
        } else {
            HybridArch::Qwen3_5
        },
        vocab,
        hidden,
        intermediate: 2 * hidden,
        n_layers: n,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim,
        rms_eps: 1e-6,
        rope: RopeSpec {
            inv_freq: (0..rot / 2)
                .map(|i| 1.0f32 / 10000f32.powf((2 * i) as f32 / rot as f32))
                .collect(),
            attention_scaling: 1.0,
        },
        tie_embeddings: false,
        layer_kinds,
        moe_layers: vec![false; n],
        moe: None,
        lin_k_heads: 2,
        lin_v_heads: 4,
        lin_dk: 8,
        lin_dv: 8,
        conv_kernel: 4,
        max_positions: 4096,
    }
}

/// `cfg` with the sparse MoE MLP on every layer whose index is odd (4 experts, top-2).
pub fn with_moe(mut cfg: HybridConfig) -> HybridConfig {
    cfg.moe = Some(dflash_targets::hybrid::MoeConfig {
        n_experts: 4,
        top_k: 2,
        intermediate: 16,
        shared_intermediate: 24,
        norm_topk: true,
    });
    cfg.moe_layers = (0..cfg.n_layers).map(|i| i % 2 == 1).collect();
    cfg
}

/// Random weights for `cfg` under the `model.` prefix, in the Qwen3.5 (separate projections)
/// or Qwen3-Next (fused) layout depending on `cfg.arch`.
pub fn random_tensors(cfg: &HybridConfig, seed: u64, emb_std: f32) -> HostTensors {
    random_tensors_steered(cfg, seed, emb_std, None)
}

/// As [`random_tensors`]; with `steer = Some((tok, strength))` every embedding row gets +4 on
/// column 0 and the lm_head row of `tok` gets `+strength` there, so the target often predicts
/// `tok` and a random drafter borrowing the same embedding / lm_head often agrees with it.
pub fn random_tensors_steered(
    cfg: &HybridConfig,
    seed: u64,
    emb_std: f32,
    steer: Option<(u32, f32)>,
) -> HostTensors {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = HostTensors::new();
    let d = cfg.hidden;
    let mat = |t: &mut HostTensors,
               rng: &mut StdRng,
               name: String,
               rows: usize,
               cols: usize,
               std: f32| {
        let s = std * 3f32.sqrt();
        let mut v: Vec<f32> = (0..rows * cols)
            .map(|_| s * (2.0 * rng.random::<f32>() - 1.0))
            .collect();
        if let Some((tok, strength)) = steer {
            if name.contains("embed_tokens") {
                for r in 0..rows {
                    v[r * cols] += 4.0;
                }
            } else if name == "lm_head.weight" && (tok as usize) < rows {
                v[tok as usize * cols] += strength;
            }
        }
        t.insert(name, &[rows, cols], v).unwrap();
    };
    let vecf =
        |t: &mut HostTensors, rng: &mut StdRng, name: String, shape: &[usize], lo: f32, hi: f32| {
            let n: usize = shape.iter().product();
            let v = (0..n)
                .map(|_| lo + (hi - lo) * rng.random::<f32>())
                .collect();
            t.insert(name, shape, v).unwrap();
        };
    let inv = |n: usize| 1.0 / (n as f32).sqrt();
    mat(
        &mut t,
        &mut rng,
        "model.embed_tokens.weight".into(),
        cfg.vocab,
        d,
        emb_std,
    );
    if !cfg.tie_embeddings {
        mat(
            &mut t,
            &mut rng,
            "lm_head.weight".into(),
            cfg.vocab,
            d,
            inv(d),
        );
    }
    vecf(
        &mut t,
        &mut rng,
        "model.norm.weight".into(),
        &[d],
        -0.2,
        0.2,
    );
    let (nk, nv, dk, dv) = (cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_dk, cfg.lin_dv);
    let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    for (i, kind) in cfg.layer_kinds.iter().enumerate() {
        let l = format!("model.layers.{i}.");
        match kind {
            LayerKind::Linear => {
                let a = format!("{l}linear_attn.");
                if cfg.arch == HybridArch::Qwen3Next {
                    mat(
                        &mut t,
                        &mut rng,
                        format!("{a}in_proj_qkvz.weight"),
                        2 * nk * dk + 2 * nv * dv,
                        d,
                        inv(d),
                    );
                    mat(
                        &mut t,
                        &mut rng,
                        format!("{a}in_proj_ba.weight"),
                        2 * nv,
                        d,
                        inv(d),
                    );
                } else {
                    mat(
                        &mut t,
                        &mut rng,
                        format!("{a}in_proj_qkv.weight"),
                        cfg.conv_channels(),
                        d,
                        inv(d),
                    );
                    mat(
                        &mut t,
                        &mut rng,
                        format!("{a}in_proj_z.weight"),
                        nv * dv,
                        d,
                        inv(d),
                    );
                    mat(
                        &mut t,
                        &mut rng,
                        format!("{a}in_proj_b.weight"),
                        nv,
                        d,
                        inv(d),
                    );
                    mat(
                        &mut t,
                        &mut rng,
                        format!("{a}in_proj_a.weight"),
                        nv,
                        d,
                        inv(d),
                    );
                }
                vecf(
                    &mut t,
                    &mut rng,
                    format!("{a}conv1d.weight"),
                    &[cfg.conv_channels(), 1, cfg.conv_kernel],
                    -0.8,
                    0.8,
                );
                vecf(&mut t, &mut rng, format!("{a}A_log"), &[nv], -2.0, 0.7);
                vecf(&mut t, &mut rng, format!("{a}dt_bias"), &[nv], -1.0, 1.0);
                vecf(&mut t, &mut rng, format!("{a}norm.weight"), &[dv], 0.7, 1.3);
                mat(
                    &mut t,
                    &mut rng,
                    format!("{a}out_proj.weight"),
                    d,
                    nv * dv,
                    inv(nv * dv),
                );
            }
            LayerKind::Full => {
                let s = format!("{l}self_attn.");
                mat(
                    &mut t,
                    &mut rng,
                    format!("{s}q_proj.weight"),
                    2 * nh * hd,
                    d,
                    inv(d),
                );
                mat(
                    &mut t,
                    &mut rng,
                    format!("{s}k_proj.weight"),
                    nkv * hd,
                    d,
                    inv(d),
                );
                mat(
                    &mut t,
                    &mut rng,
                    format!("{s}v_proj.weight"),
                    nkv * hd,
                    d,
                    inv(d),
                );
                mat(
                    &mut t,
                    &mut rng,
                    format!("{s}o_proj.weight"),
                    d,
                    nh * hd,
                    inv(nh * hd),
                );
                vecf(
                    &mut t,
                    &mut rng,
                    format!("{s}q_norm.weight"),
                    &[hd],
                    -0.2,
                    0.2,
                );
                vecf(
                    &mut t,
                    &mut rng,
                    format!("{s}k_norm.weight"),
                    &[hd],
                    -0.2,
                    0.2,
                );
            }
        }
        vecf(
            &mut t,
            &mut rng,
            format!("{l}input_layernorm.weight"),
            &[d],
            -0.2,
            0.2,
        );
        vecf(
            &mut t,
            &mut rng,
            format!("{l}post_attention_layernorm.weight"),
            &[d],
            -0.2,
            0.2,
        );
        if cfg.moe_layers[i] {
            let moe = cfg.moe.expect("MoE layer without an MoE shape");
            let m = format!("{l}mlp.");
            mat(
                &mut t,
                &mut rng,
                format!("{m}gate.weight"),
                moe.n_experts,
                d,
                inv(d),
            );
            for e in 0..moe.n_experts {
                let x = format!("{m}experts.{e}.");
                let mi = moe.intermediate;
                mat(
                    &mut t,
                    &mut rng,
                    format!("{x}gate_proj.weight"),
                    mi,
                    d,
                    inv(d),
                );
                mat(
                    &mut t,
                    &mut rng,
                    format!("{x}up_proj.weight"),
                    mi,
                    d,
                    inv(d),
                );
                mat(
                    &mut t,
                    &mut rng,
                    format!("{x}down_proj.weight"),
                    d,
                    mi,
                    inv(mi),
                );
            }
            let si = moe.shared_intermediate;
            let x = format!("{m}shared_expert.");
            mat(
                &mut t,
                &mut rng,
                format!("{x}gate_proj.weight"),
                si,
                d,
                inv(d),
            );
            mat(
                &mut t,
                &mut rng,
                format!("{x}up_proj.weight"),
                si,
                d,
                inv(d),
            );
            mat(
                &mut t,
                &mut rng,
                format!("{x}down_proj.weight"),
                d,
                si,
                inv(si),
            );
            mat(
                &mut t,
                &mut rng,
                format!("{m}shared_expert_gate.weight"),
                1,
                d,
                inv(d),
            );
        } else {
            mat(
                &mut t,
                &mut rng,
                format!("{l}mlp.gate_proj.weight"),
                cfg.intermediate,
                d,
                inv(d),
            );
            mat(
                &mut t,
                &mut rng,
                format!("{l}mlp.up_proj.weight"),
                cfg.intermediate,
                d,
                inv(d),
            );
            mat(
                &mut t,
                &mut rng,
                format!("{l}mlp.down_proj.weight"),
                d,
                cfg.intermediate,
                inv(cfg.intermediate),
            );
        }
    }
    t
}

/// A random hybrid target on the CPU with `cap` positions and the given arm.
pub fn random_target(
    cfg: &HybridConfig,
    seed: u64,
    emb_std: f32,
    cap: usize,
    arm: RollbackArm,
) -> HybridTarget<Cpu> {
    random_target_with(cfg, seed, emb_std, cap, arm, None, None, KvStorage::F32)
}

/// As [`random_target`], with steering (see [`random_tensors_steered`]), a weight format and
/// the full-attention layers' K / V storage.
#[allow(clippy::too_many_arguments)]
pub fn random_target_with(
    cfg: &HybridConfig,
    seed: u64,
    emb_std: f32,
    cap: usize,
    arm: RollbackArm,
    steer: Option<(u32, f32)>,
    precision: Option<dflash_backend::WeightFormat>,
    kv: KvStorage,
) -> HybridTarget<Cpu> {
    let be = Cpu::new();
    let src = random_tensors_steered(cfg, seed, emb_std, steer);
    let names = TensorNames {
        prefix: "model.".into(),
        lm_head: "lm_head.weight".into(),
    };
    let opts = LoadOptions {
        precision,
        ctx_cap: Some(cap),
        kv_storage: kv,
    };
    let mut t = HybridTarget::from_source(&be, cfg.clone(), &src, &names, opts).unwrap();
    t.set_rollback(arm);
    t
}

/// Logits of `tokens` fed to a fresh copy one prime: every row.
pub fn all_logits(t: &mut HybridTarget<Cpu>, be: &Cpu, tokens: &[u32]) -> Vec<f32> {
    t.reset(be).unwrap();
    let f = t.run(be, tokens, &[], LogitRows::All).unwrap();
    be_download(be, f.logits.as_ref().unwrap())
}

pub fn be_download(be: &Cpu, b: &Vec<f32>) -> Vec<f32> {
    use dflash_backend::Backend;
    be.download(b).unwrap()
}
