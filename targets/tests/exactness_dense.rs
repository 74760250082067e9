//! The property the project stands on, for the dense target: the speculative stream equals
//! plain greedy decode token for token, whatever the drafter proposes.

mod common;

use common::{bad_fn, pattern, Pattern, ScriptDrafter};
use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, KvStorage, WeightFormat};
use dflash_spec_round::{generate, plain_greedy, Session, SpecConfig, StopReason, Target};
use dflash_targets::random::{random_qwen3, tiny_qwen3_config};
use proptest::prelude::*;

const VOCAB: usize = 48;
const HIDDEN: usize = 32;

/// How the script drafter corrupts drafts.

#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    window: Option<usize>,
    bf16: bool,
    /// The target's K / V cache in f16 (its attention then `attention_fast_kv16`).
    kv16: bool,
    prompt: Vec<u32>,
    n_drafts: usize,
    cap_sel: usize,
    adaptive: bool,
    max_new: usize,
    eos_at: Option<usize>,
    pattern: Pattern,
    tight_ctx: bool,
    taps: Vec<i32>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            any::<u64>(),
            prop_oneof![Just(None), Just(Some(3usize)), Just(Some(7usize))],
            any::<bool>(),
            any::<bool>(),
        ),
        prop::collection::vec(0u32..VOCAB as u32, 1..12),
        (1usize..8, 0usize..16, any::<bool>()),
        (
            1usize..=64,
            prop::option::of(0usize..64),
            pattern(),
            prop::bool::weighted(0.15),
        ),
        prop::sample::subsequence(vec![-1i32, 0, 1], 1..=3),
    )
        .prop_map(
            |(
                (seed, window, bf16, kv16),
                prompt,
                (n_drafts, cap_sel, adaptive),
                (max_new, eos_at, pattern, tight_ctx),
                taps,
            )| Case {
                seed,
                window,
                bf16,
                kv16,
                prompt,
                n_drafts,
                cap_sel,
                adaptive,
                max_new,
                eos_at,
                pattern,
                tight_ctx,
                taps,
            },
        )
}

fn run_case(c: &Case) -> Result<(), TestCaseError> {
    let be = Cpu::new();
    let fmt = if c.bf16 {
        WeightFormat::Bf16
    } else {
        WeightFormat::F32
    };
    let cfg = tiny_qwen3_config(VOCAB, HIDDEN, 3, c.window);
    let block = c.n_drafts + 1;
    let ctx_cap = if c.tight_ctx {
        c.prompt.len() + block + (c.max_new / 3)
    } else {
        c.prompt.len() + 64 + 8
    };
    let mut target = random_qwen3(&be, cfg, c.seed, fmt, ctx_cap).unwrap();
    if c.kv16 {
        target.set_kv_storage(&be, KvStorage::F16).unwrap();
        prop_assert_eq!(target.kv_storage(), KvStorage::F16);
    }
    // The stream to script the drafter from: plain greedy without EOS, as long as possible.
    let long = plain_greedy(&be, &mut target, &c.prompt, 200, &[]).unwrap();
    let eos: Vec<u32> = c.eos_at.map(|i| long[i % long.len()]).into_iter().collect();
    let expected = plain_greedy(&be, &mut target, &c.prompt, c.max_new, &eos).unwrap();
    // Output semantics: exactly max_new unless EOS (included) or the context cap.
    let room = ctx_cap - c.prompt.len() + 1;
    match expected.iter().position(|t| eos.contains(t)) {
        Some(i) => prop_assert_eq!(expected.len(), i + 1),
        None => prop_assert_eq!(expected.len(), c.max_new.min(room)),
    }

    let mut truth = c.prompt.clone();
    truth.extend_from_slice(&long);
    let mut drafter = ScriptDrafter::<Cpu>::new(
        truth.clone(),
        VOCAB as u32,
        c.taps.clone(),
        HIDDEN,
        c.n_drafts,
        bad_fn(c.pattern),
    );
    let verify_cap = if c.cap_sel == 0 {
        None
    } else {
        Some(2 + c.cap_sel % block.max(2).saturating_sub(1).max(1))
    };
    let verify_cap = verify_cap.map(|v| v.min(block).max(2));
    let cfg = SpecConfig {
        verify_cap,
        adaptive: c.adaptive,
        ..SpecConfig::default()
    };
    let (got, stats) = generate(
        &be,
        &mut target,
        &mut drafter,
        cfg,
        &c.prompt,
        c.max_new,
        &eos,
    )
    .unwrap();
    prop_assert_eq!(&got, &expected, "spec != plain");
    // Rounds commit what is emitted (no overshoot past the budget); at most one final token
    // is emitted without a round, and EOS may end the output inside a round's block.
    prop_assert!(got.len() <= stats.committed + 1);
    if eos.is_empty() {
        prop_assert!(got.len() >= stats.committed);
    }
    prop_assert!(stats.accepted <= stats.drafted);
    if matches!(c.pattern, Pattern::Wrong) {
        prop_assert_eq!(stats.accepted, 0);
    }
    if matches!(c.pattern, Pattern::Perfect | Pattern::Alternate)
        && got.len() >= 3
        && !c.tight_ctx
        && eos.is_empty()
    {
        prop_assert!(
            stats.accepted > 0,
            "a perfect drafter accepted nothing: {:?}",
            stats
        );
    }
    // The drafter's context rows are exactly the committed rows' taps.
    let ctx = drafter.ctx;
    prop_assert_eq!(ctx, target.pos());
    let f = target.prime(&be, &truth[..ctx], &c.taps).unwrap();
    let fresh = be.download(f.taps.as_ref().unwrap()).unwrap();
    prop_assert!(
        fresh
            .iter()
            .zip(&drafter.ingested)
            .all(|(a, b)| a.to_bits() == b.to_bits())
            && fresh.len() == drafter.ingested.len(),
        "ingested taps differ from a fresh forward over the committed stream"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn spec_equals_plain_greedy_dense(c in case()) {
        run_case(&c)?;
    }
}

/// Named corner cases (each also reachable by the proptest, kept explicit so they always run).
#[test]
fn corner_cases() {
    let base = Case {
        seed: 11,
        window: Some(3),
        bf16: false,
        kv16: false,
        prompt: vec![1, 2, 3, 4, 5],
        n_drafts: 7,
        cap_sel: 0,
        adaptive: true,
        max_new: 64,
        eos_at: None,
        pattern: Pattern::Alternate,
        tight_ctx: false,
        taps: vec![-1, 1],
    };
    // A zero-accept round right after a long accept, adaptive on and off; every verify cap.
    for adaptive in [true, false] {
        for cap_sel in 0..8 {
            run_case(&Case {
                adaptive,
                cap_sel,
                ..base.clone()
            })
            .unwrap();
        }
    }
    // max_new 1..=64, exactly max_new out.
    for max_new in 1..=64 {
        run_case(&Case {
            max_new,
            pattern: Pattern::Perfect,
            ..base.clone()
        })
        .unwrap();
    }
    // EOS at every position of the stream.
    for e in 0..64 {
        run_case(&Case {
            eos_at: Some(e),
            pattern: Pattern::Random(e as u64),
            ..base.clone()
        })
        .unwrap();
    }
    // A tight context cap.
    for max_new in [10, 30, 64] {
        run_case(&Case {
            tight_ctx: true,
            max_new,
            ..base.clone()
        })
        .unwrap();
    }
    // The K / V cache in f16: every verify cap, a tight context, with and without a window.
    for cap_sel in 0..8 {
        for (window, tight_ctx) in [(Some(3), false), (None, true)] {
            run_case(&Case {
                kv16: true,
                cap_sel,
                window,
                tight_ctx,
                ..base.clone()
            })
            .unwrap();
        }
    }
}

/// Bursts of any size, interleaved across two sessions, give the same streams as one call.
#[test]
fn interleaved_bursts_equal_whole_generation() {
    let be = Cpu::new();
    let mk = |seed| {
        random_qwen3(
            &be,
            tiny_qwen3_config(VOCAB, HIDDEN, 3, Some(5)),
            seed,
            WeightFormat::F32,
            128,
        )
        .unwrap()
    };
    let (mut t1, mut t2) = (mk(1), mk(2));
    let (p1, p2) = (vec![3u32, 1, 4, 1, 5], vec![2u32, 7, 1, 8]);
    let l1 = plain_greedy(&be, &mut t1, &p1, 200, &[]).unwrap();
    let l2 = plain_greedy(&be, &mut t2, &p2, 200, &[]).unwrap();
    let truth = |p: &[u32], l: &[u32]| [p, l].concat();
    let mut d1 = ScriptDrafter::<Cpu>::new(
        truth(&p1, &l1),
        VOCAB as u32,
        vec![0],
        HIDDEN,
        6,
        bad_fn(Pattern::Random(5)),
    );
    let mut d2 = ScriptDrafter::<Cpu>::new(
        truth(&p2, &l2),
        VOCAB as u32,
        vec![0],
        HIDDEN,
        6,
        bad_fn(Pattern::Alternate),
    );
    let cfg = SpecConfig::default();
    let mut s1 = Session::new(&be, &mut t1, &mut d1, cfg, &p1, &[], Some(50)).unwrap();
    let mut s2 = Session::new(&be, &mut t2, &mut d2, cfg, &p2, &[], None).unwrap();
    let (mut o1, mut o2) = (Vec::new(), Vec::new());
    let sizes = [1usize, 3, 2, 7, 1, 1, 5, 4, 9, 2];
    for i in 0..40 {
        let n = sizes[i % sizes.len()];
        o1.extend(s1.burst(n).unwrap());
        let b = s2.burst(n).unwrap();
        assert!(b.len() == n || s2.finished());
        o2.extend(b);
    }
    assert!(s1.finished());
    assert_eq!(s1.stop_reason(), Some(StopReason::Budget));
    assert_eq!(o1, l1[..50]);
    assert_eq!(o2[..], l2[..o2.len()]);
    assert!(s2.stats().accepted > 0);
    // The unbudgeted session runs to the context cap: 128 positions hold the prompt and
    // 124 committed tokens, and one more known token ends the stream.
    while !s2.finished() {
        o2.extend(s2.burst(16).unwrap());
    }
    assert_eq!(s2.stop_reason(), Some(StopReason::ContextCap));
    assert_eq!(o2.len(), 128 - p2.len() + 1);
    assert_eq!(o2[..], l2[..o2.len()]);
}

#[test]
fn session_errors() {
    use dflash_spec_round::SpecError;
    let be = Cpu::new();
    let mut t = random_qwen3(
        &be,
        tiny_qwen3_config(VOCAB, HIDDEN, 3, None),
        1,
        WeightFormat::F32,
        16,
    )
    .unwrap();
    let mk = |taps: Vec<i32>, hidden, n| {
        ScriptDrafter::<Cpu>::new(
            vec![],
            VOCAB as u32,
            taps,
            hidden,
            n,
            bad_fn(Pattern::Wrong),
        )
    };
    let cfg = SpecConfig::default();
    let err = |r: Result<Session<'_, Cpu>, SpecError>| r.err().unwrap();
    let mut d = mk(vec![0], HIDDEN, 7);
    assert!(matches!(
        err(Session::new(&be, &mut t, &mut d, cfg, &[], &[], None)),
        SpecError::EmptyPrompt
    ));
    assert!(matches!(
        err(Session::new(&be, &mut t, &mut d, cfg, &[1, 48], &[], None)),
        SpecError::TokenOutOfRange {
            id: 48,
            index: 1,
            ..
        }
    ));
    assert!(matches!(
        err(Session::new(&be, &mut t, &mut d, cfg, &[1; 9], &[], None)),
        SpecError::ContextCap {
            needed: 17,
            cap: 16,
            ..
        }
    ));
    let bad_cap = SpecConfig {
        verify_cap: Some(9),
        ..cfg
    };
    assert!(matches!(
        err(Session::new(&be, &mut t, &mut d, bad_cap, &[1], &[], None)),
        SpecError::Config(_)
    ));
    let bad_cap = SpecConfig {
        verify_cap: Some(1),
        ..cfg
    };
    assert!(matches!(
        err(Session::new(&be, &mut t, &mut d, bad_cap, &[1], &[], None)),
        SpecError::Config(_)
    ));
    let mut d = mk(vec![0], HIDDEN + 1, 7);
    assert!(matches!(
        err(Session::new(&be, &mut t, &mut d, cfg, &[1], &[], None)),
        SpecError::HiddenMismatch { .. }
    ));
    let mut d = mk(vec![2], HIDDEN, 7);
    assert!(matches!(
        err(Session::new(&be, &mut t, &mut d, cfg, &[1], &[], None)),
        SpecError::TapLayer { layer: 2, .. }
    ));
    let mut d = mk(vec![0], HIDDEN, 7);
    let mut s = Session::new(&be, &mut t, &mut d, cfg, &[1], &[], Some(0)).unwrap();
    assert!(s.burst(5).unwrap().is_empty());
    assert!(s.finished());
}

/// Sessions over instances that share one set of weights (`Qwen3Dense::share`), interleaved,
/// give each prompt's plain greedy stream.
#[test]
fn sessions_sharing_weights_interleave_exactly() {
    let be = Cpu::new();
    let base = random_qwen3(
        &be,
        tiny_qwen3_config(VOCAB, HIDDEN, 3, Some(5)),
        9,
        WeightFormat::Bf16,
        96,
    )
    .unwrap();
    let prompts = [vec![3u32, 1, 4], vec![2u32, 7, 1, 8, 2, 8], vec![5u32]];
    let mut reference = base.share(&be, 96).unwrap();
    let longs: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| plain_greedy(&be, &mut reference, p, 200, &[]).unwrap())
        .collect();
    let mut targets: Vec<_> = prompts
        .iter()
        .map(|_| base.share(&be, 96).unwrap())
        .collect();
    let mut drafters: Vec<_> = prompts
        .iter()
        .zip(&longs)
        .enumerate()
        .map(|(i, (p, l))| {
            let pat = [
                Pattern::Alternate,
                Pattern::Random(i as u64),
                Pattern::Perfect,
            ][i];
            ScriptDrafter::<Cpu>::new(
                [&p[..], &l[..]].concat(),
                VOCAB as u32,
                vec![-1, 1],
                HIDDEN,
                5,
                bad_fn(pat),
            )
        })
        .collect();
    let mut sessions: Vec<Session<'_, Cpu>> = targets
        .iter_mut()
        .zip(drafters.iter_mut())
        .zip(&prompts)
        .map(|((t, d), p)| {
            Session::new(&be, t, d, SpecConfig::default(), p, &[], Some(60)).unwrap()
        })
        .collect();
    let mut outs = vec![Vec::new(); prompts.len()];
    for step in 0..200 {
        for (i, s) in sessions.iter_mut().enumerate() {
            outs[i].extend(s.burst(1 + (step + i) % 4).unwrap());
        }
    }
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o[..], longs[i][..60], "session {i}");
        assert!(sessions[i].finished());
    }
}
