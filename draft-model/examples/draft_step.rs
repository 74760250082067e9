//! Time one cached draft step (block forward + lm_head rows + argmax) of a random drafter on
//! the CPU backend: `cargo run --release -p dflash-draft-model --features random --example
//! draft_step -- [hidden] [layers] [vocab] [ctx]`.

use std::time::Instant;

use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostWeight, WeightFormat};
use dflash_draft_model::random::{random_tensor_map, tiny_config};
use dflash_draft_model::{DraftOptions, Drafter, LentWeights, LoadOptions, Precision};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let hidden = args.first().copied().unwrap_or(256);
    let layers = args.get(1).copied().unwrap_or(4);
    let vocab = args.get(2).copied().unwrap_or(8192);
    let ctx = args.get(3).copied().unwrap_or(512);
    let be = Cpu::new();
    let cfg = tiny_config(
        hidden,
        layers,
        hidden / 64,
        (hidden / 128).max(1),
        vocab,
        16,
        &[1, 3, 5],
        None,
        0,
    )
    .expect("config");
    let map = random_tensor_map(&cfg, 1);
    for precision in [Precision::F32, Precision::Bf16, Precision::Q8_0] {
        let opts = LoadOptions {
            precision,
            ..Default::default()
        };
        let dr = Drafter::from_tensors(&be, cfg.clone(), &map, &opts).expect("drafter");
        let w = |n: &str| {
            let v: Vec<f32> = (0..vocab * hidden)
                .map(|i| ((i % 97) as f32 - 48.0) / 480.0)
                .collect();
            be.upload_weight(
                &HostWeight::from_f32(n, vocab, hidden, &v, WeightFormat::F32).expect("w"),
            )
            .expect("upload")
        };
        let lend = LentWeights::new(w("e"), w("h")).expect("lend");
        let taps = be.upload(&vec![0.1f32; ctx * 3 * hidden]).expect("taps");
        let mut kv = dr.new_kv(&be, ctx).expect("kv");
        let t0 = Instant::now();
        dr.ingest(&be, &mut kv, &taps, ctx, 0).expect("ingest");
        let ingest = t0.elapsed();
        let o = DraftOptions {
            markov: false,
            ..Default::default()
        };
        dr.draft(&be, &mut kv, &lend, 1, ctx, &o).expect("draft");
        let n = 50;
        let t0 = Instant::now();
        for _ in 0..n {
            dr.draft(&be, &mut kv, &lend, 1, ctx, &o).expect("draft");
        }
        let step = t0.elapsed() / n;
        println!(
            "hidden {hidden} layers {layers} vocab {vocab} ctx {ctx} {precision:?}: ingest {ingest:?}, draft step {step:?}"
        );
    }
}
