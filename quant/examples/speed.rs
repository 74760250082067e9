//! Quick single-thread throughput check of the row kernels (GB/s of f32 input), for
//! iterating on the kernels. The full benchmark with the gguf-py peer is
//! `cargo xtask bench quant`. Usage: cargo run --release -p dflash-quant --example speed [MiB]
use dflash_quant::*;
use std::time::Instant;

fn best(mut f: impl FnMut()) -> f64 {
    f();
    let mut b = f64::MAX;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < 0.4 {
        let t = Instant::now();
        f();
        b = b.min(t.elapsed().as_secs_f64());
    }
    b
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let n = (mib << 20) / 4 / QK * QK;
    let mut s = 0x12345678u64;
    let x: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            f32::from_bits((u * 0.04).to_bits() & 0xFFFF_0000)
        })
        .collect();
    let gb = (n * 4) as f64 / 1e9;
    let mut q8 = quantize_q8_0(&x).unwrap();
    let mut q4 = quantize_q4_0(&x).unwrap();
    let mut h = vec![0u16; n];
    let mut y = vec![0.0f32; n];
    let r = |name: &str, t: f64| println!("{name:<12} {:>7.2} GB/s", gb / t);
    r("q8_0 enc", best(|| quantize_row_q8_0(&x, &mut q8).unwrap()));
    r(
        "q8_0 dec",
        best(|| dequantize_row_q8_0(&q8, &mut y).unwrap()),
    );
    r("q4_0 enc", best(|| quantize_row_q4_0(&x, &mut q4).unwrap()));
    r(
        "q4_0 dec",
        best(|| dequantize_row_q4_0(&q4, &mut y).unwrap()),
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        r("bf16 enc", best(|| encode_bf16_into(&x, &mut h).unwrap()));
        r("bf16 dec", best(|| try_decode_bf16(&h, &mut y).unwrap()));
        r("f16 enc", best(|| encode_f16_into(&x, &mut h).unwrap()));
        r("f16 dec", best(|| try_decode_f16(&h, &mut y).unwrap()));
    });
}
