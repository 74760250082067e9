//! Golden vectors made by gguf==0.19.0 (`tools/quant/make_fixtures.py`): checked here with
//! no Python. See the script for the categories and the one documented q4_0 divergence.

use dflash_quant::{
    decode_bf16, decode_f16, encode_bf16, encode_f16, quantize_q4_0, quantize_q8_0,
    try_dequantize_q4_0, try_dequantize_q8_0, BlockQ4_0, BlockQ8_0, QK,
};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn read(name: &str) -> Vec<u8> {
    std::fs::read(format!("{DIR}/{name}")).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

struct Manifest {
    blocks: usize,
    patched: Vec<usize>,
    cats: Vec<(String, usize, usize)>,
}

fn manifest() -> Manifest {
    let text = String::from_utf8(read("manifest.txt")).expect("manifest utf8");
    let mut m = Manifest {
        blocks: 0,
        patched: vec![],
        cats: vec![],
    };
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["gguf", v] => assert_eq!(*v, "0.19.0", "fixtures must come from gguf 0.19.0"),
            ["blocks", n] => m.blocks = n.parse().unwrap(),
            ["patched_q4_0_blocks", list] => {
                m.patched = list.split(',').map(|s| s.parse().unwrap()).collect()
            }
            ["category", name, start, n] => {
                m.cats
                    .push((name.to_string(), start.parse().unwrap(), n.parse().unwrap()))
            }
            _ => {}
        }
    }
    assert!(m.blocks > 0 && !m.cats.is_empty(), "empty manifest");
    m
}

fn category(m: &Manifest, block: usize) -> &str {
    m.cats
        .iter()
        .find(|(_, s, n)| block >= *s && block < s + n)
        .map(|(name, _, _)| name.as_str())
        .unwrap_or("?")
}

/// Compares two byte strings of `size`-byte records; panics naming every bad record's category.
fn compare(what: &str, m: &Manifest, size: usize, per_block: usize, want: &[u8], got: &[u8]) {
    assert_eq!(want.len(), got.len(), "{what}: length");
    let mut bad = vec![];
    for (i, (w, g)) in want.chunks(size).zip(got.chunks(size)).enumerate() {
        if w != g {
            bad.push(format!(
                "{what} record {i} ({}): want {w:02x?} got {g:02x?}",
                category(m, i * per_block / QK)
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} mismatches:\n{}",
        bad.len(),
        bad[..bad.len().min(20)].join("\n")
    );
}

#[test]
fn q8_0_matches_gguf() {
    let m = manifest();
    let x = f32s(&read("inputs.f32"));
    assert_eq!(x.len(), m.blocks * QK);
    let q = quantize_q8_0(&x).unwrap();
    compare(
        "q8_0",
        &m,
        34,
        QK,
        &read("q8_0.bin"),
        bytemuck::cast_slice(&q),
    );
}

#[test]
fn q4_0_matches_gguf_and_c() {
    let m = manifest();
    let x = f32s(&read("inputs.f32"));
    // The patched blocks are exactly the all-zero blocks with x[0] = -0.0, and there are some.
    assert!(
        !m.patched.is_empty(),
        "the -0.0 zero-block trap must be covered"
    );
    for b in 0..m.blocks {
        let blk = &x[b * QK..(b + 1) * QK];
        let trap = blk.iter().all(|&v| v == 0.0) && blk[0].is_sign_negative();
        assert_eq!(
            trap,
            m.patched.contains(&b),
            "block {b}: patched list is wrong"
        );
    }
    let q = quantize_q4_0(&x).unwrap();
    compare(
        "q4_0",
        &m,
        18,
        QK,
        &read("q4_0.bin"),
        bytemuck::cast_slice(&q),
    );
    for &b in &m.patched {
        assert_eq!(
            q[b].d.to_bits(),
            0x8000,
            "all-zero q4_0 block {b} has C's d = -0.0"
        );
    }
}

#[test]
fn bf16_and_f16_match_gguf() {
    let m = manifest();
    let x = f32s(&read("inputs.f32"));
    let b = encode_bf16(&x).unwrap();
    compare(
        "bf16",
        &m,
        2,
        1,
        &read("bf16.bin"),
        bytemuck::cast_slice(&b),
    );
    let h = encode_f16(&x).unwrap();
    compare("f16", &m, 2, 1, &read("f16.bin"), bytemuck::cast_slice(&h));
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn dequantize_matches_gguf() {
    let m = manifest();
    let q8: Vec<BlockQ8_0> = dflash_quant::q8_0_blocks_from_bytes(&read("q8_0.bin")).unwrap();
    let q4: Vec<BlockQ4_0> = dflash_quant::q4_0_blocks_from_bytes(&read("q4_0.bin")).unwrap();
    let mut y = vec![0.0f32; m.blocks * QK];
    try_dequantize_q8_0(&q8, &mut y).unwrap();
    assert_eq!(
        bits(&y),
        bits(&f32s(&read("q8_0.deq.f32"))),
        "q8_0 dequantize"
    );
    try_dequantize_q4_0(&q4, &mut y).unwrap();
    assert_eq!(
        bits(&y),
        bits(&f32s(&read("q4_0.deq.f32"))),
        "q4_0 dequantize"
    );
    // 16-bit decode: gguf's dequantize of bf16/f16 is the exact widening too.
    let x = f32s(&read("inputs.f32"));
    let b = encode_bf16(&x).unwrap();
    decode_bf16(&b, &mut y);
    for (i, (&v, &w)) in y.iter().zip(&b).enumerate() {
        assert_eq!(v.to_bits(), (w as u32) << 16, "bf16 decode at {i}");
    }
    let h = encode_f16(&x).unwrap();
    decode_f16(&h, &mut y);
    for (i, (&v, &w)) in y.iter().zip(&h).enumerate() {
        assert_eq!(
            v.to_bits(),
            half::f16::from_bits(w).to_f32().to_bits(),
            "f16 decode at {i}"
        );
    }
}
