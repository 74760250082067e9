//! Qwen3 dense target: batch invariance of the forward, the Target protocol, errors.

use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, WeightFormat};
use dflash_spec_round::{plain_greedy, SpecError, Target};
use dflash_targets::random::{random_qwen3, tiny_qwen3_config};
use dflash_targets::LogitRows;

#[test]
fn verify_rows_are_bit_identical_to_single_row_decodes() {
    let be = Cpu::new();
    for (fmt, window) in [
        (WeightFormat::F32, None),
        (WeightFormat::Bf16, Some(5)),
        (WeightFormat::Q8_0, Some(3)),
    ] {
        let cfg = tiny_qwen3_config(96, 64, 3, window);
        let mut a = random_qwen3(&be, cfg.clone(), 7, fmt, 64).unwrap();
        let mut b = random_qwen3(&be, cfg, 7, fmt, 64).unwrap();
        let prompt: Vec<u32> = (0..11).map(|i| (i * 7 + 3) % 96).collect();
        let block: Vec<u32> = (0..16).map(|i| (i * 13 + 5) % 96).collect();
        let taps = [-1, 0, 1];
        a.forward(&be, &prompt, 0, &[], LogitRows::None).unwrap();
        let fa = a
            .forward(&be, &block, prompt.len(), &taps, LogitRows::All)
            .unwrap();
        let la = be.download(fa.logits.as_ref().unwrap()).unwrap();
        let ta = be.download(fa.taps.as_ref().unwrap()).unwrap();
        b.forward(&be, &prompt, 0, &[], LogitRows::None).unwrap();
        let w = 3 * 64;
        for (i, &tok) in block.iter().enumerate() {
            let fb = b
                .forward(&be, &[tok], prompt.len() + i, &taps, LogitRows::All)
                .unwrap();
            let lb = be.download(fb.logits.as_ref().unwrap()).unwrap();
            let tb = be.download(fb.taps.as_ref().unwrap()).unwrap();
            assert!(
                la[i * 96..(i + 1) * 96]
                    .iter()
                    .zip(&lb)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{fmt:?} row {i}: logits differ between the 16-row verify and the 1-row decode"
            );
            assert!(
                ta[i * w..(i + 1) * w]
                    .iter()
                    .zip(&tb)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{fmt:?} row {i}: taps differ"
            );
            assert_eq!(fa.argmax[i], fb.argmax[0]);
        }
    }
}

#[test]
fn tap_minus_one_is_the_embedding_and_prime_matches_forward() {
    let be = Cpu::new();
    let cfg = tiny_qwen3_config(50, 32, 2, None);
    let mut m = random_qwen3(&be, cfg, 1, WeightFormat::F32, 32).unwrap();
    let prompt = [3u32, 9, 27, 31];
    let f = m.prime(&be, &prompt, &[-1, 0]).unwrap();
    assert_eq!(f.argmax.len(), 1);
    let taps = be.download(f.taps.as_ref().unwrap()).unwrap();
    let mut emb = be.zeros(4 * 32).unwrap();
    m.embed_rows(&be, &prompt, &mut emb).unwrap();
    let emb = be.download(&emb).unwrap();
    for r in 0..4 {
        assert_eq!(&taps[r * 64..r * 64 + 32], &emb[r * 32..(r + 1) * 32]);
    }
    let g = m.forward(&be, &prompt, 0, &[], LogitRows::All).unwrap();
    assert_eq!(f.argmax[0], g.argmax[3]);
    assert_eq!(m.pos(), 4);
}

#[test]
fn protocol_and_input_errors_are_values() {
    let be = Cpu::new();
    let cfg = tiny_qwen3_config(50, 32, 2, None);
    let mut m = random_qwen3(&be, cfg, 1, WeightFormat::F32, 10).unwrap();
    assert!(matches!(
        m.prime(&be, &[], &[]),
        Err(SpecError::EmptyPrompt)
    ));
    assert!(matches!(
        m.prime(&be, &[1, 2], &[1]),
        Err(SpecError::TapLayer { layer: 1, .. })
    ));
    assert!(matches!(
        m.prime(&be, &[1, 2], &[-2]),
        Err(SpecError::TapLayer { .. })
    ));
    assert!(matches!(
        m.prime(&be, &[1, 50], &[]),
        Err(SpecError::TokenOutOfRange { id: 50, .. })
    ));
    assert!(matches!(
        m.prime(&be, &[1; 11], &[]),
        Err(SpecError::ContextCap { .. })
    ));
    m.prime(&be, &[1, 2, 3], &[0]).unwrap();
    assert!(matches!(
        m.verify(&be, &[1, 2], 2, &[], false),
        Err(SpecError::Protocol(_))
    ));
    assert!(matches!(m.commit(&be, 1), Err(SpecError::Protocol(_))));
    m.verify(&be, &[1, 2, 3], 3, &[], false).unwrap();
    assert!(matches!(
        m.verify(&be, &[1], 3, &[], false),
        Err(SpecError::Protocol(_))
    ));
    assert!(matches!(m.commit(&be, 4), Err(SpecError::Protocol(_))));
    m.verify(&be, &[1, 2, 3], 3, &[], false).unwrap();
    m.commit(&be, 2).unwrap();
    assert_eq!(m.pos(), 5);
    assert!(matches!(
        m.verify(&be, &[1; 6], 5, &[], false),
        Err(SpecError::ContextCap { .. })
    ));
}

#[test]
fn plain_greedy_counts_and_stops() {
    let be = Cpu::new();
    let cfg = tiny_qwen3_config(40, 32, 2, None);
    let mut m = random_qwen3(&be, cfg, 3, WeightFormat::F32, 64).unwrap();
    let prompt = [1u32, 2, 3];
    let full = plain_greedy(&be, &mut m, &prompt, 20, &[]).unwrap();
    assert_eq!(full.len(), 20);
    // The first generated token is the argmax after the prompt.
    let f = m.prime(&be, &prompt, &[]).unwrap();
    assert_eq!(full[0], f.argmax[0]);
    for n in [1usize, 2, 7] {
        assert_eq!(
            plain_greedy(&be, &mut m, &prompt, n, &[]).unwrap(),
            full[..n]
        );
    }
    let eos = full[5];
    let first = full.iter().position(|&t| t == eos).unwrap();
    assert_eq!(
        plain_greedy(&be, &mut m, &prompt, 20, &[eos]).unwrap(),
        full[..=first]
    );
    // The context cap ends the stream: 64 positions hold the prompt and 61 generated tokens,
    // and one more token is known without a forward.
    let long = plain_greedy(&be, &mut m, &prompt, 100, &[]).unwrap();
    assert_eq!(long.len(), 62);
    assert_eq!(long[..20], full[..]);
}

#[test]
fn inconsistent_configs_are_errors() {
    let be = Cpu::new();
    let mut c = tiny_qwen3_config(50, 32, 2, None);
    c.windows.pop();
    assert!(random_qwen3(&be, c, 1, WeightFormat::F32, 8).is_err());
    let mut c = tiny_qwen3_config(50, 32, 2, None);
    c.n_kv_heads = 3;
    assert!(random_qwen3(&be, c, 1, WeightFormat::F32, 8).is_err());
    let mut c = tiny_qwen3_config(50, 32, 2, Some(0));
    c.windows[0] = Some(0);
    assert!(random_qwen3(&be, c, 1, WeightFormat::F32, 8).is_err());
}
