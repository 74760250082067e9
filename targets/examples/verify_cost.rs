//! Time of a t-row verify over a 1-row decode for a random Qwen3 dense target on the CPU.
//! `cargo run --release -p dflash-targets --example verify_cost -- [hidden] [layers] [vocab] [ctx]`

use std::time::Instant;

use dflash_backend::cpu::Cpu;
use dflash_backend::WeightFormat;
use dflash_spec_round::Target;
use dflash_targets::random::{random_qwen3, tiny_qwen3_config};

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let hidden = a.first().copied().unwrap_or(256);
    let layers = a.get(1).copied().unwrap_or(6);
    let vocab = a.get(2).copied().unwrap_or(8192);
    let ctx = a.get(3).copied().unwrap_or(256);
    let be = Cpu::new();
    // on the pool: every op forks inside it (see `Cpu::run`)
    be.run(|| run(&be, hidden, layers, vocab, ctx));
}

fn run(be: &Cpu, hidden: usize, layers: usize, vocab: usize, ctx: usize) {
    for fmt in [WeightFormat::F32, WeightFormat::Bf16] {
        let mut m = random_qwen3(
            be,
            tiny_qwen3_config(vocab, hidden, layers, None),
            1,
            fmt,
            ctx + 64,
        )
        .unwrap();
        let prompt: Vec<u32> = (0..ctx as u32).map(|i| i * 7 % vocab as u32).collect();
        m.prime(be, &prompt, &[]).unwrap();
        let mut line = format!("{fmt:?} hidden {hidden} layers {layers} vocab {vocab} ctx {ctx}:");
        let mut base = 0.0;
        for t in [1usize, 2, 4, 8, 16] {
            let block: Vec<u32> = (0..t as u32).collect();
            let reps = 20;
            let t0 = Instant::now();
            for _ in 0..reps {
                m.verify(be, &block, ctx, &[0], false).unwrap();
                m.commit(be, 1).unwrap();
                // undo the committed row so every rep runs at the same position
                m.prime_reset_to(ctx);
            }
            let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
            if t == 1 {
                base = ms;
            }
            line += &format!("  t={t}: {ms:.2} ms ({:.2}x)", ms / base);
        }
        println!("{line}");
    }
}
