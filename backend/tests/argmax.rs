//! `argmax_rows` on every instruction set against the plain loop of its contract (first
//! maximum wins, NaN never wins, index 0 for an all-NaN row), on rows full of the cases that
//! break vectorised argmaxes: NaN, ±inf, ±0, ties, the maximum in the tail.

use dflash_backend::cpu::{Cpu, Isa};
use dflash_backend::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn reference(row: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv: Option<f32> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if bv.is_none_or(|b| v > b) {
            best = i;
            bv = Some(v);
        }
    }
    best as u32
}

#[test]
fn argmax_rows_matches_the_reference_loop_on_every_isa() {
    let mut rng = StdRng::seed_from_u64(11);
    let bes: Vec<Cpu> = [Isa::Portable, Isa::Avx2Fma, Isa::Avx512]
        .into_iter()
        .filter(|i| i.supported())
        .map(|i| Cpu::with_threads(1).unwrap().with_isa(i).unwrap())
        .collect();
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::MAX,
        f32::MIN,
    ];
    for case in 0..3000 {
        let cols = match case % 4 {
            0 => rng.random_range(1..20usize),
            1 => rng.random_range(1..200usize),
            2 => 8192,
            _ => rng.random_range(60..70usize),
        };
        let rows = rng.random_range(1..4usize);
        let p_special: f64 = [0.0, 0.01, 0.3, 1.0][case % 4];
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| {
                if rng.random_bool(p_special) {
                    specials[rng.random_range(0..specials.len())]
                } else {
                    // few distinct values: many ties
                    (rng.random_range(-4i32..4) as f32) * 0.5
                }
            })
            .collect();
        let want: Vec<u32> = x.chunks(cols).map(reference).collect();
        for be in &bes {
            let got = be.argmax_rows(&x, 0, rows, cols).unwrap();
            assert_eq!(got, want, "{:?} cols {cols} case {case}", be.isa());
        }
    }
    // All NaN; all -inf; NaN then -inf; maximum in the last (tail) element.
    for (row, want) in [
        (vec![f32::NAN; 37], 0u32),
        (vec![f32::NEG_INFINITY; 37], 0),
        (
            [vec![f32::NAN; 20], vec![f32::NEG_INFINITY; 17]].concat(),
            20,
        ),
        ([vec![1.0; 36], vec![2.0]].concat(), 36),
        ([vec![-0.0; 18], vec![0.0; 18]].concat(), 0),
    ] {
        for be in &bes {
            assert_eq!(
                be.argmax_rows(&row, 0, 1, row.len()).unwrap(),
                vec![want],
                "{:?} {row:?}",
                be.isa()
            );
        }
    }
}
