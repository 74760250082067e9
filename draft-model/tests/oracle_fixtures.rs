//! Parity with the independent Python oracle (tools/oracle/, fixtures in tests/fixtures/).
//!
//! Error measure: for a tensor, `max |ours - oracle| / max |oracle|` (the max error relative to
//! the tensor's largest magnitude). Bounds: 1e-5 against the oracle for every precision (the
//! oracle computes with the identically quantized / bf16-upcast weights, so only f32 rounding
//! differs); 1e-6 between our cached round and our uncached forward; draft tokens identical.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostWeight, WeightFormat};
use dflash_draft_model::{DraftOptions, Drafter, LentWeights, LoadOptions, Precision, RowLayout};
use safetensors::{Dtype, SafeTensors};

const ORACLE_BOUND: f32 = 1e-5;
const CACHED_BOUND: f32 = 1e-6;

enum T {
    F(Vec<usize>, Vec<f32>),
    I(Vec<i64>),
}

fn read_io(path: &Path) -> HashMap<String, T> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let t = match view.dtype() {
            Dtype::F32 => T::F(
                shape,
                view.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::I64 => T::I(
                view.data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            ),
            d => panic!("{name}: unexpected dtype {d:?}"),
        };
        out.insert(name, t);
    }
    out
}

fn f<'a>(io: &'a HashMap<String, T>, name: &str) -> (&'a [usize], &'a [f32]) {
    match io.get(name) {
        Some(T::F(s, v)) => (s, v),
        _ => panic!("fixture lacks f32 tensor {name}"),
    }
}

fn ids(io: &HashMap<String, T>, name: &str) -> Vec<u32> {
    match io.get(name) {
        Some(T::I(v)) => v.iter().map(|&x| u32::try_from(x).unwrap()).collect(),
        _ => panic!("fixture lacks i64 tensor {name}"),
    }
}

/// max |a - b| / max |b|
fn rel_err(ours: &[f32], oracle: &[f32]) -> f32 {
    assert_eq!(ours.len(), oracle.len(), "length");
    let scale = oracle.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = ours
        .iter()
        .zip(oracle)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(scale > 0.0, "oracle tensor is all zeros");
    assert!(ours.iter().all(|x| x.is_finite()), "non-finite output");
    err / scale
}

/// `DFLASH_FIXTURES_DIR` when set (`cargo xtask parity draft` points it at freshly regenerated
/// fixtures), else the committed ones.
fn fixtures_dir() -> PathBuf {
    match std::env::var_os("DFLASH_FIXTURES_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
    }
}

/// max |a - b|
fn abs_err(ours: &[f32], oracle: &[f32]) -> f32 {
    ours.iter()
        .zip(oracle)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
}

struct Report {
    rows: Vec<(String, f32, f32, f32)>,
}

impl Report {
    fn check(&mut self, what: &str, ours: &[f32], oracle: &[f32], bound: f32) {
        let e = rel_err(ours, oracle);
        self.rows
            .push((what.to_string(), abs_err(ours, oracle), e, bound));
    }
    fn finish(self, case: &str) {
        let mut bad = Vec::new();
        for (what, abs, e, bound) in &self.rows {
            println!("PARITY {case} {what} max_abs={abs:.3e} max_rel={e:.3e} bound={bound:.0e}");
            if e.is_nan() || *e > *bound {
                bad.push(format!("{what}: {e:.3e} > {bound:.0e}"));
            }
        }
        assert!(bad.is_empty(), "{case}: {bad:?}");
    }
}

fn run_case(case: &str) {
    run_case_with(case, None)
}

/// `precision`: override the fixture's precision (bf16 storage of the bf16 checkpoint holds
/// exactly the values the oracle computes with, so the f32 fixtures apply unchanged).
fn run_case_with(case: &str, precision: Option<Precision>) {
    let root = fixtures_dir();
    println!("fixtures dir: {}", root.display());
    let dir = root.join(case);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).unwrap()).unwrap();
    let fixture_precision: Precision = meta["precision"].as_str().unwrap().parse().unwrap();
    let precision = precision.unwrap_or(fixture_precision);
    let case = &format!("{case}/{precision:?}");
    let want_layout = match meta["layout"].as_str().unwrap() {
        "dflash" => RowLayout::DFlash,
        "anchor" => RowLayout::AnchorPredicts,
        l => panic!("layout {l}"),
    };
    let ctx = meta["ctx_len"].as_u64().unwrap() as usize;
    let block = meta["block_size"].as_u64().unwrap() as usize;
    let io = read_io(&dir.join("io.safetensors"));

    let be = Cpu::new();
    let opts = LoadOptions {
        precision,
        layout_override: None,
        validate: true,
        fast_attention: false,
        kv_storage: Default::default(),
    };
    let dr = Drafter::load(&be, &dir.join("draft"), &opts).unwrap();
    assert_eq!(dr.layout, want_layout, "layout chosen from the checkpoint");
    assert_eq!(dr.cfg.block_size, block);
    assert_eq!(
        dr.cfg.target_layer_ids,
        meta["target_layer_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect::<Vec<_>>()
    );
    assert_eq!(dr.markov.is_some(), meta["markov"].as_bool().unwrap());
    assert_eq!(
        dr.confidence.is_some(),
        meta["confidence"].as_bool().unwrap()
    );

    let (es, ev) = f(&io, "target_embed");
    let (ls, lv) = f(&io, "target_lm_head");
    let lend = LentWeights::new(
        be.upload_weight(
            &HostWeight::from_f32("target_embed", es[0], es[1], ev, WeightFormat::F32).unwrap(),
        )
        .unwrap(),
        be.upload_weight(
            &HostWeight::from_f32("target_lm_head", ls[0], ls[1], lv, WeightFormat::F32).unwrap(),
        )
        .unwrap(),
    )
    .unwrap();
    let vocab = es[0];
    let (ts, tv) = f(&io, "taps");
    assert_eq!(ts[0], ctx);
    let taps = be.upload(tv).unwrap();
    let block_tokens = ids(&io, "block_tokens");
    assert_eq!(block_tokens.len(), block);
    assert_eq!(block_tokens, dr.block_tokens(block_tokens[0], block));
    let anchor = block_tokens[0];

    let mut rep = Report { rows: Vec::new() };

    // ---- uncached forward vs oracle
    let full = dr
        .forward_full(&be, &lend, &taps, ctx, &block_tokens, 1.0, true)
        .unwrap();
    rep.check(
        "ctx_features",
        &be.download(&full.ctx_features).unwrap(),
        f(&io, "ctx_features").1,
        ORACLE_BOUND,
    );
    for (i, out) in full.layer_outs.iter().enumerate() {
        rep.check(
            &format!("layer{i}_out"),
            out,
            f(&io, &format!("layer{i}_out")).1,
            ORACLE_BOUND,
        );
    }
    assert!(io.contains_key(&format!("layer{}_out", full.layer_outs.len() - 1)));
    assert!(!io.contains_key(&format!("layer{}_out", full.layer_outs.len())));
    let full_hidden = be.download(&full.final_hidden).unwrap();
    rep.check(
        "final_hidden",
        &full_hidden,
        f(&io, "final_hidden").1,
        ORACLE_BOUND,
    );

    let no_markov = DraftOptions {
        markov: false,
        return_logits: true,
        ..Default::default()
    };
    let out_full = dr
        .drafts_from_hidden(&be, &lend, &full.final_hidden, block, anchor, &no_markov)
        .unwrap();
    let (dls, dlv) = f(&io, "draft_logits");
    assert_eq!(dls, [dr.n_drafts(block), vocab]);
    rep.check(
        "draft_logits_uncached",
        out_full.logits.as_ref().unwrap(),
        dlv,
        ORACLE_BOUND,
    );
    assert_eq!(
        out_full.tokens,
        ids(&io, "draft_tokens"),
        "{case}: draft tokens (uncached)"
    );

    // ---- cached round: ingest in two uneven pieces, then one draft step
    let mut kv = dr.new_kv(&be, ctx + 8).unwrap();
    let split = ctx / 3;
    let w = dr.cfg.n_taps() * dr.cfg.hidden_size;
    let taps_a = be.upload(&tv[..split * w]).unwrap();
    let taps_b = be.upload(&tv[split * w..]).unwrap();
    dr.ingest(&be, &mut kv, &taps_a, split, 0).unwrap();
    dr.ingest(&be, &mut kv, &taps_b, ctx - split, split)
        .unwrap();
    assert_eq!(kv.len(), ctx);
    let cached_hidden = dr
        .forward_cached(&be, &mut kv, &lend, &block_tokens, 1.0)
        .unwrap();
    assert_eq!(kv.len(), ctx, "block rows are never committed");
    rep.check(
        "cached_vs_uncached_hidden",
        &be.download(&cached_hidden).unwrap(),
        &full_hidden,
        CACHED_BOUND,
    );
    let out = dr
        .draft(&be, &mut kv, &lend, anchor, ctx, &no_markov)
        .unwrap();
    rep.check(
        "draft_logits_cached",
        out.logits.as_ref().unwrap(),
        dlv,
        ORACLE_BOUND,
    );
    rep.check(
        "cached_vs_uncached_logits",
        out.logits.as_ref().unwrap(),
        out_full.logits.as_ref().unwrap(),
        CACHED_BOUND,
    );
    assert_eq!(
        out.tokens,
        ids(&io, "draft_tokens"),
        "{case}: draft tokens (cached)"
    );

    // ---- DSpark heads
    if dr.markov.is_some() {
        let with_markov = DraftOptions {
            markov: true,
            return_logits: true,
            ..Default::default()
        };
        let out = dr
            .draft(&be, &mut kv, &lend, anchor, ctx, &with_markov)
            .unwrap();
        rep.check(
            "markov_logits",
            out.logits.as_ref().unwrap(),
            f(&io, "markov_logits").1,
            ORACLE_BOUND,
        );
        assert_eq!(
            out.tokens,
            ids(&io, "markov_tokens"),
            "{case}: Markov tokens"
        );
        let conf = out.confidence.as_ref().expect("confidence head");
        rep.check(
            "confidence_logits",
            conf,
            f(&io, "confidence_logits").1,
            ORACLE_BOUND,
        );
    } else {
        assert!(out.confidence.is_none());
    }
    rep.finish(case);
}

#[test]
fn dflash_plain() {
    run_case("dflash_plain");
}

#[test]
fn dflash_swa() {
    run_case("dflash_swa");
}

#[test]
fn dflash_yarn() {
    run_case("dflash_yarn");
}

#[test]
fn dspark_markov() {
    run_case("dspark_markov");
}

#[test]
fn dflash_q8_0() {
    run_case("dflash_q8_0");
}

#[test]
fn dflash_q4_0() {
    run_case("dflash_q4_0");
}

#[test]
fn dflash_mixed() {
    run_case("dflash_mixed");
}

#[test]
fn dflash_plain_bf16_storage() {
    run_case_with("dflash_plain", Some(Precision::Bf16));
}

#[test]
fn dspark_markov_bf16_storage() {
    run_case_with("dspark_markov", Some(Precision::Bf16));
}

#[test]
fn dflash_swa_bf16_storage() {
    run_case_with("dflash_swa", Some(Precision::Bf16));
}
