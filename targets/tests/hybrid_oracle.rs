//! Parity of the hybrid target with the oracle's transformers 5.17 fixtures
//! (`tests/fixtures/qwen3_5_hybrid`, `tests/fixtures/qwen3_5_vl_text`, made by
//! `tools/oracle/make_target_fixtures.py`; bf16-stored weights computed in f32).
//!
//! Bound: max |ours - transformers| / max |transformers| <= 1e-5 for prompt logits, taps,
//! the logits behind every greedy token, and the conv / recurrent states after the prompt.
//! (The fixtures' own f32-vs-f64 distance is 2e-6 / 4e-6, recorded in their case.json.)

mod hybrid_common;

use std::path::PathBuf;

use dflash_backend::cpu::Cpu;
use dflash_backend::Backend;
use dflash_spec_round::Target;
use dflash_targets::hybrid::{HybridArch, HybridTarget, LayerKind};
use dflash_targets::{LoadOptions, LogitRows};
use hybrid_common::{read_io, rel_err};

const BOUND: f32 = 1e-5;

/// The oracle fixture root: `DFLASH_FIXTURES_DIR` when set (`cargo xtask parity targets` points it
/// at freshly regenerated fixtures), else the committed `tests/fixtures`.
fn fixture(case: &str) -> PathBuf {
    let root = std::env::var_os("DFLASH_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    println!("fixtures dir: {}", root.display());
    root.join(case)
}

fn check(case: &str) {
    let be = Cpu::new();
    let rc = read_io(fixture(case));
    let mut t = HybridTarget::load(&be, rc.dir.join("model"), LoadOptions::default()).unwrap();
    let cfg = t.config().clone();
    assert_eq!(cfg.arch, HybridArch::Qwen3_5);
    let prompt = &rc.ids["prompt_ids"];
    let p = prompt.len();
    let (l, d, v) = (cfg.n_layers, cfg.hidden, cfg.vocab);

    let taps: Vec<i32> = (-1..l as i32 - 1).collect();
    let f = t.run(&be, prompt, &taps, LogitRows::All).unwrap();
    let logits = be.download(f.logits.as_ref().unwrap()).unwrap();
    let (shape, want) = &rc.tensors["prompt_logits"];
    assert_eq!(shape, &vec![p, v]);
    let e = rel_err(&logits, want);
    println!("{case}: prompt logits rel err {e:.2e}");
    assert!(e <= BOUND, "{case}: prompt logits {e:e}");

    // hidden_states[l + 1] = residual stream after layer l, for l < L - 1 (hidden_states[L]
    // is after the final norm; the logits cover it).
    let tap = be.download(f.taps.as_ref().unwrap()).unwrap();
    let hs = &rc.tensors["hidden_states"].1;
    let nt = taps.len();
    let mut worst = 0f32;
    for j in 0..nt {
        let ours: Vec<f32> = (0..p)
            .flat_map(|r| tap[(r * nt + j) * d..(r * nt + j + 1) * d].to_vec())
            .collect();
        let e = rel_err(&ours, &hs[j * p * d..(j + 1) * p * d]);
        assert!(e <= BOUND, "{case}: hidden_states[{j}] rel err {e:e}");
        worst = worst.max(e);
    }
    println!("{case}: taps hidden_states[0..{nt}] worst rel err {worst:.2e}");

    // Linear states after the prompt: transformers keeps the last K pre-conv inputs as
    // [channels, K]; ours is the last K - 1 as [K - 1, channels].
    let states = t.linear_states(&be).unwrap();
    let linear: Vec<usize> = (0..l)
        .filter(|&i| cfg.layer_kinds[i] == LayerKind::Linear)
        .collect();
    assert_eq!(states.len(), linear.len());
    let k = cfg.conv_kernel;
    let ch = cfg.conv_channels();
    let mut worst_state = 0f32;
    for (li, (conv, rec)) in linear.iter().zip(&states) {
        let (cshape, tc) = &rc.tensors[&format!("conv_state.{li}")];
        assert_eq!(cshape, &vec![ch, k]);
        let want: Vec<f32> = (1..k)
            .flat_map(|j| (0..ch).map(move |c| tc[c * k + j]))
            .collect();
        let e1 = rel_err(conv, &want);
        let e2 = rel_err(rec, &rc.tensors[&format!("recurrent_state.{li}")].1);
        assert!(
            e1 <= BOUND && e2 <= BOUND,
            "{case}: layer {li} states {e1:e} {e2:e}"
        );
        worst_state = worst_state.max(e1).max(e2);
    }
    println!("{case}: conv / recurrent states after the prompt worst rel err {worst_state:.2e}");

    // Greedy continuation through prime + one-token steps, with the logits behind each token.
    let greedy = &rc.ids["greedy_ids"];
    let glog = &rc.tensors["greedy_logits"].1;
    let first = t.prime(&be, prompt, &[]).unwrap();
    let mut ours = vec![first.argmax[0]];
    let mut last_logits = {
        t.reset(&be).unwrap();
        let f = t.run(&be, prompt, &[], LogitRows::Last).unwrap();
        be.download(f.logits.as_ref().unwrap()).unwrap()
    };
    let mut worst_g = 0f32;
    for i in 0..greedy.len() {
        let e = rel_err(&last_logits, &glog[i * v..(i + 1) * v]);
        assert!(e <= BOUND, "{case}: greedy logits row {i}: {e:e}");
        worst_g = worst_g.max(e);
        if i + 1 == greedy.len() {
            break;
        }
        let f = t.run(&be, &[ours[i]], &[], LogitRows::Last).unwrap();
        ours.push(f.argmax[0]);
        last_logits = be.download(f.logits.as_ref().unwrap()).unwrap();
    }
    println!("{case}: greedy logits worst rel err {worst_g:.2e}");
    assert_eq!(&ours, greedy, "{case}: greedy continuation");
}

#[test]
fn oracle_qwen3_5_hybrid() {
    check("qwen3_5_hybrid");
}

#[test]
fn oracle_qwen3_5_vl_text() {
    check("qwen3_5_vl_text");
}
