//! Rollback of the hybrid target under every arm: after `verify(t)` + `commit(keep)` the
//! target must be, bit for bit, the target that was only ever fed the committed tokens
//! (linear states, and the logits of whatever comes next).

mod hybrid_common;

use dflash_backend::cpu::Cpu;
use dflash_backend::Backend;
use dflash_spec_round::{RollbackArm, SpecError, Target};
use dflash_targets::hybrid::HybridTarget;
use dflash_targets::LogitRows;
use hybrid_common::{random_target, tiny_config, with_moe};
use proptest::prelude::*;

const ARMS: [RollbackArm; 3] = [RollbackArm::Stash, RollbackArm::Replay, RollbackArm::Gate];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits bits of `next` fed after the committed stream, and the linear states before it.
fn continuation(t: &mut HybridTarget<Cpu>, be: &Cpu, next: &[u32]) -> (Vec<u32>, Vec<Vec<u32>>) {
    let states = t
        .linear_states(be)
        .unwrap()
        .into_iter()
        .flat_map(|(c, r)| [bits(&c), bits(&r)])
        .collect();
    let f = t.run(be, next, &[], LogitRows::All).unwrap();
    (
        bits(&be.download(f.logits.as_ref().unwrap()).unwrap()),
        states,
    )
}

/// A fresh target fed `committed` in one prefill, then `next`.
fn fresh(
    t: &mut HybridTarget<Cpu>,
    be: &Cpu,
    committed: &[u32],
    next: &[u32],
) -> (Vec<u32>, Vec<Vec<u32>>) {
    t.prime(be, committed, &[]).unwrap();
    continuation(t, be, next)
}

fn toks(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((seed.wrapping_mul(2654435761).wrapping_add(i * 40503)) % vocab as u64) as u32)
        .collect()
}

#[test]
fn commit_every_keep_equals_fresh_target_under_every_arm() {
    let be = Cpu::new();
    for (pattern, next_style, moe) in [
        ("lflf", false, false),
        ("llfl", true, false),
        ("fll", false, false),
        ("lfl", true, true),
    ] {
        let cfg = tiny_config(97, 32, pattern, next_style);
        let cfg = if moe { with_moe(cfg) } else { cfg };
        let prompt = toks(1, 9, cfg.vocab);
        let block = toks(2, 7, cfg.vocab);
        let next = toks(3, 3, cfg.vocab);
        let mut reference = random_target(&cfg, 5, 1.0, 64, RollbackArm::Stash);
        for arm in ARMS {
            let mut t = random_target(&cfg, 5, 1.0, 64, arm);
            for keep in 1..=block.len() {
                t.prime(&be, &prompt, &[]).unwrap();
                let f = t.verify(&be, &block, prompt.len(), &[], true).unwrap();
                let vlog = be.download(f.logits.as_ref().unwrap()).unwrap();
                t.commit(&be, keep).unwrap();
                assert_eq!(t.pos(), prompt.len() + keep);
                let got = continuation(&mut t, &be, &next);
                let committed: Vec<u32> = prompt.iter().chain(&block[..keep]).copied().collect();
                let want = fresh(&mut reference, &be, &committed, &next);
                assert!(
                    got.1 == want.1,
                    "{pattern} {arm:?} keep {keep}: linear states differ from a fresh target"
                );
                assert!(
                    got.0 == want.0,
                    "{pattern} {arm:?} keep {keep}: next logits differ from a fresh target"
                );
                // The verified rows themselves equal the fresh target's rows.
                reference.prime(&be, &prompt, &[]).unwrap();
                let rf = reference.run(&be, &block, &[], LogitRows::All).unwrap();
                assert!(
                    bits(&vlog) == bits(&be.download(rf.logits.as_ref().unwrap()).unwrap()),
                    "{pattern} {arm:?}: verify rows differ from plain rows"
                );
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Round {
    t: usize,
    keep: usize,
}

fn rounds() -> impl Strategy<Value = Vec<Round>> {
    prop::collection::vec((1usize..=8, 1usize..=8), 1..10).prop_map(|v| {
        v.into_iter()
            .map(|(t, k)| Round { t, keep: k.min(t) })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random schedules of verify widths and keeps (zero-draft rounds, t = keep = 1, right
    /// after long accepts included): the state after every commit is the fresh target's.
    #[test]
    fn random_schedules_equal_fresh_target(
        seed in 0u64..1000,
        arm_i in 0usize..3,
        next_style in any::<bool>(),
        moe in prop::bool::weighted(0.3),
        mut sched in rounds(),
    ) {
        let be = Cpu::new();
        let cfg = tiny_config(61, 32, "lfl", next_style);
        let cfg = if moe { with_moe(cfg) } else { cfg };
        let arm = ARMS[arm_i];
        // Force the peer-engine trap: a long full accept then a zero-draft round.
        sched.insert(0, Round { t: 8, keep: 8 });
        sched.insert(1, Round { t: 1, keep: 1 });
        let mut t = random_target(&cfg, seed, 1.0, 128, arm);
        let mut reference = random_target(&cfg, seed, 1.0, 128, RollbackArm::Stash);
        let mut stream = toks(seed, 5, cfg.vocab);
        t.prime(&be, &stream, &[]).unwrap();
        for (i, r) in sched.iter().enumerate() {
            let block = toks(seed * 31 + i as u64, r.t, cfg.vocab);
            t.verify(&be, &block, t.pos(), &[], false).unwrap();
            t.commit(&be, r.keep).unwrap();
            stream.extend_from_slice(&block[..r.keep]);
            prop_assert_eq!(t.pos(), stream.len());
        }
        let next = toks(seed + 7, 2, cfg.vocab);
        let got = continuation(&mut t, &be, &next);
        let want = fresh(&mut reference, &be, &stream, &next);
        prop_assert!(got.1 == want.1, "{:?}: linear states differ", arm);
        prop_assert!(got.0 == want.0, "{:?}: next logits differ", arm);
    }
}

#[test]
fn protocol_errors() {
    let be = Cpu::new();
    let cfg = tiny_config(50, 32, "lf", false);
    let mut t = random_target(&cfg, 1, 1.0, 16, RollbackArm::Gate);
    assert!(matches!(
        t.prime(&be, &[], &[]),
        Err(SpecError::EmptyPrompt)
    ));
    t.prime(&be, &[1, 2, 3], &[]).unwrap();
    assert!(matches!(t.commit(&be, 1), Err(SpecError::Protocol(_))));
    assert!(matches!(
        t.verify(&be, &[4], 2, &[], false),
        Err(SpecError::Protocol(_))
    ));
    t.verify(&be, &[4, 5, 6], 3, &[], false).unwrap();
    assert!(matches!(
        t.verify(&be, &[4], 3, &[], false),
        Err(SpecError::Protocol(_))
    ));
    assert!(matches!(t.commit(&be, 0), Err(SpecError::Protocol(_))));
    assert!(matches!(t.commit(&be, 4), Err(SpecError::Protocol(_))));
    // The verify is still pending after a rejected commit.
    t.commit(&be, 2).unwrap();
    assert_eq!(t.pos(), 5);
    let e = t.verify(&be, &[50], 5, &[], false);
    assert!(
        matches!(e, Err(SpecError::TokenOutOfRange { id: 50, .. })),
        "{:?}",
        e.err()
    );
    let e = t.verify(&be, &[1; 12], 5, &[], false);
    assert!(
        matches!(
            e,
            Err(SpecError::ContextCap {
                needed: 17,
                cap: 16,
                ..
            })
        ),
        "{:?}",
        e.err()
    );
    let e = t.verify(&be, &[1], 5, &[1], false);
    assert!(
        matches!(e, Err(SpecError::TapLayer { layer: 1, .. })),
        "{:?}",
        e.err()
    );
    assert_eq!(t.pos(), 5);
    // After the errors the target still works: taps of layer -1 and 0.
    let f = t.verify(&be, &[7, 8], 5, &[-1, 0], true).unwrap();
    assert_eq!(f.argmax.len(), 2);
    assert_eq!(be.len(f.taps.as_ref().unwrap()), 2 * 2 * 32);
    assert_eq!(be.len(f.logits.as_ref().unwrap()), 2 * 50);
    t.commit(&be, 2).unwrap();
}
