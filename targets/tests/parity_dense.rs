//! Parity with transformers 5.17 (`Qwen3ForCausalLM`) through the oracle fixture
//! `fixtures/qwen3_dense` (bf16-stored weights, f32 compute on both sides).
//!
//! Bound: max |ours - theirs| / max |theirs| <= 1e-5 per tensor (prompt logits, each tap /
//! hidden state, each greedy step's logits); the greedy continuation must be identical
//! (the fixture records a minimum top-1 margin of 4.8e-3, far above the error).

use std::path::PathBuf;

use dflash_backend::cpu::Cpu;
use dflash_backend::Backend;
use dflash_spec_round::{plain_greedy, Target};
use dflash_targets::{LoadOptions, LogitRows, Qwen3Dense};
use safetensors::{Dtype, SafeTensors};

const BOUND: f64 = 1e-5;

/// The oracle fixture root: `DFLASH_FIXTURES_DIR` when set (`cargo xtask parity targets`
/// points it at freshly regenerated fixtures), else the committed `tests/fixtures`.
fn fixture(case: &str) -> PathBuf {
    let root = std::env::var_os("DFLASH_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    println!("fixtures dir: {}", root.display());
    root.join(case)
}

struct Io {
    bytes: Vec<u8>,
}

impl Io {
    fn open(case: &str) -> Io {
        Io {
            bytes: std::fs::read(fixture(case).join("io.safetensors")).unwrap(),
        }
    }
    fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), v)
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::I64, "{name}");
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
}

/// max |a - b| / max |b|
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let max_ref = b.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    let max_diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    max_diff / max_ref.max(f64::MIN_POSITIVE)
}

#[test]
fn qwen3_dense_matches_transformers() {
    let be = Cpu::new();
    let io = Io::open("qwen3_dense");
    let prompt = io.ids("prompt_ids");
    let greedy = io.ids("greedy_ids");
    let (_, prompt_logits) = io.f32s("prompt_logits");
    let (hs_shape, hs) = io.f32s("hidden_states");
    let (_, greedy_logits) = io.f32s("greedy_logits");
    let mut m = Qwen3Dense::<Cpu>::load(
        &be,
        fixture("qwen3_dense").join("model"),
        LoadOptions::default(),
    )
    .unwrap();
    let c = m.config().clone();
    assert_eq!(hs_shape, vec![c.n_layers + 1, prompt.len(), c.hidden]);

    // Prompt logits and the taps -1..=L-2 (= hidden_states[0..L-1]).
    let taps: Vec<i32> = (-1..c.n_layers as i32 - 1).collect();
    let f = m.forward(&be, &prompt, 0, &taps, LogitRows::All).unwrap();
    let logits = be.download(f.logits.as_ref().unwrap()).unwrap();
    let e = rel_err(&logits, &prompt_logits);
    println!("qwen3_dense: prompt_logits rel err {e:.3e}");
    assert!(e <= BOUND, "prompt logits rel err {e}");
    let tv = be.download(f.taps.as_ref().unwrap()).unwrap();
    let (p, d, nt) = (prompt.len(), c.hidden, taps.len());
    for (j, &l) in taps.iter().enumerate() {
        let ours: Vec<f32> = (0..p)
            .flat_map(|r| tv[r * nt * d + j * d..r * nt * d + (j + 1) * d].to_vec())
            .collect();
        let k = (l + 1) as usize;
        let e = rel_err(&ours, &hs[k * p * d..(k + 1) * p * d]);
        println!("qwen3_dense: hidden_states[{k}] rel err {e:.3e}");
        assert!(e <= BOUND, "tap {l}: rel err {e}");
    }

    // Greedy continuation through the Target trait, and each step's logits.
    let n = greedy.len();
    let got = plain_greedy(&be, &mut m, &prompt, n, &[]).unwrap();
    assert_eq!(got, greedy, "greedy continuation differs from transformers");
    let v = c.vocab;
    m.prime(&be, &prompt, &[]).unwrap();
    let mut worst = 0f64;
    // Step 0's logits are the last prompt row.
    worst = worst.max(rel_err(&logits[(p - 1) * v..p * v], &greedy_logits[..v]));
    for i in 1..n {
        let f = m.verify(&be, &[greedy[i - 1]], m.pos(), &[], true).unwrap();
        m.commit(&be, 1).unwrap();
        let l = be.download(f.logits.as_ref().unwrap()).unwrap();
        worst = worst.max(rel_err(&l, &greedy_logits[i * v..(i + 1) * v]));
    }
    println!("qwen3_dense: greedy_logits rel err {worst:.3e}");
    assert!(worst <= BOUND, "greedy logits rel err {worst}");
}
