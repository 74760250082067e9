//! The property the project stands on, for the hybrid target under every rollback arm: the
//! speculative stream equals plain greedy decode token for token, whatever the drafter
//! proposes (a scripted drafter with perfect / wrong / alternating / random / prefix drafts,
//! and the real DFlash / DSpark drafter from `dflash-draft-model` against steered targets).

mod common;
mod hybrid_common;

use common::{bad_fn, pattern, Pattern, ScriptDrafter};
use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, KvStorage, WeightFormat};
use dflash_draft_model::random::{random_tensor_map, tiny_config as draft_tiny_config};
use dflash_draft_model::{Drafter as DraftModel, LoadOptions as DraftLoad};
use dflash_spec_round::{
    generate, plain_greedy, DflashDrafter, RollbackArm, SpecConfig, Stats, Target,
};
use dflash_targets::hybrid::HybridConfig;
use hybrid_common::{random_target_with, tiny_config, with_moe};
use proptest::prelude::*;

const VOCAB: usize = 48;
const HIDDEN: usize = 32;
const ARMS: [RollbackArm; 3] = [RollbackArm::Stash, RollbackArm::Replay, RollbackArm::Gate];
const PATTERNS: [&str; 4] = ["lfl", "llf", "fll", "lflf"];

/// How the script drafter corrupts drafts.

#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    arm: RollbackArm,
    layers: usize,
    next_style: bool,
    moe: bool,
    bf16: bool,
    /// The full-attention layers' K / V caches in f16.
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

fn config(c: &Case) -> HybridConfig {
    let cfg = tiny_config(
        VOCAB,
        HIDDEN,
        PATTERNS[c.layers % PATTERNS.len()],
        c.next_style,
    );
    if c.moe {
        with_moe(cfg)
    } else {
        cfg
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            any::<u64>(),
            0usize..3,
            0usize..4,
            any::<bool>(),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.25),
            prop::bool::weighted(0.3),
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
                (seed, arm, layers, next_style, bf16, moe, kv16),
                prompt,
                (n_drafts, cap_sel, adaptive),
                (max_new, eos_at, pattern, tight_ctx),
                taps,
            )| Case {
                seed,
                arm: ARMS[arm],
                layers,
                next_style,
                moe,
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

fn run_case(c: &Case) -> Result<Stats, TestCaseError> {
    let be = Cpu::new();
    let cfg = config(c);
    let block = c.n_drafts + 1;
    let ctx_cap = if c.tight_ctx {
        c.prompt.len() + block + (c.max_new / 3)
    } else {
        c.prompt.len() + 64 + 8
    };
    let precision = c.bf16.then_some(WeightFormat::Bf16);
    let kv = if c.kv16 {
        KvStorage::F16
    } else {
        KvStorage::F32
    };
    let mut target = random_target_with(&cfg, c.seed, 1.0, ctx_cap, c.arm, None, precision, kv);
    let long = plain_greedy(&be, &mut target, &c.prompt, 200, &[]).unwrap();
    let eos: Vec<u32> = c.eos_at.map(|i| long[i % long.len()]).into_iter().collect();
    let expected = plain_greedy(&be, &mut target, &c.prompt, c.max_new, &eos).unwrap();
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
        Some(
            (2 + c.cap_sel % block.max(2).saturating_sub(1).max(1))
                .min(block)
                .max(2),
        )
    };
    let scfg = SpecConfig {
        verify_cap,
        adaptive: c.adaptive,
        rollback: c.arm,
        ..SpecConfig::default()
    };
    let (got, stats) = generate(
        &be,
        &mut target,
        &mut drafter,
        scfg,
        &c.prompt,
        c.max_new,
        &eos,
    )
    .unwrap();
    prop_assert_eq!(&got, &expected, "spec != plain under {:?}", c.arm);
    prop_assert!(stats.accepted <= stats.drafted);
    if matches!(c.pattern, Pattern::Wrong) {
        prop_assert_eq!(stats.accepted, 0);
    }
    // The drafter's context rows are exactly the committed rows' taps.
    let ctx = drafter.ctx;
    prop_assert_eq!(ctx, target.pos());
    let f = target.prime(&be, &truth[..ctx], &c.taps).unwrap();
    let fresh = be.download(f.taps.as_ref().unwrap()).unwrap();
    prop_assert!(
        fresh.len() == drafter.ingested.len()
            && fresh
                .iter()
                .zip(&drafter.ingested)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
        "ingested taps differ from a fresh forward over the committed stream"
    );
    Ok(stats)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn spec_equals_plain_greedy_hybrid(c in case()) {
        run_case(&c)?;
    }
}

/// Named corner cases under every arm: a zero-accept round right after a long accept (adaptive
/// on and off, every verify cap), max_new 1..=64, EOS at every position, a tight context.
#[test]
fn corner_cases_every_arm() {
    for arm in ARMS {
        let base = Case {
            seed: 11,
            arm,
            layers: 3,
            next_style: arm == RollbackArm::Replay,
            moe: arm == RollbackArm::Gate,
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
        let mut total = Stats::default();
        for adaptive in [true, false] {
            for cap_sel in 0..8 {
                let s = run_case(&Case {
                    adaptive,
                    cap_sel,
                    ..base.clone()
                })
                .unwrap();
                total.accepted += s.accepted;
                total.rounds += s.rounds;
            }
        }
        assert!(
            total.accepted > total.rounds,
            "{arm:?}: alternating drafts should accept long runs: {total:?}"
        );
        for max_new in 1..=64 {
            run_case(&Case {
                max_new,
                pattern: Pattern::Perfect,
                ..base.clone()
            })
            .unwrap();
        }
        for e in (0..64).step_by(3) {
            run_case(&Case {
                eos_at: Some(e),
                pattern: Pattern::Random(e as u64),
                ..base.clone()
            })
            .unwrap();
        }
        for max_new in [10, 30, 64] {
            run_case(&Case {
                tight_ctx: true,
                max_new,
                ..base.clone()
            })
            .unwrap();
        }
        // The full-attention layers' K / V in f16 (the Gate arm compares their rows after
        // the verify and after the replay): every verify cap, a tight context.
        for cap_sel in 0..8 {
            for tight_ctx in [false, true] {
                run_case(&Case {
                    kv16: true,
                    cap_sel,
                    tight_ctx,
                    ..base.clone()
                })
                .unwrap();
            }
        }
    }
}

// ------------------------------------------------------------------ the real drafter

#[derive(Clone, Debug)]
struct DCase {
    seed: u64,
    arm: RollbackArm,
    steer: Option<f32>,
    layers: usize,
    next_style: bool,
    draft_window: Option<usize>,
    block: usize,
    markov_rank: usize,
    markov_on: bool,
    mask_is_stream_token: bool,
    cap_sel: usize,
    adaptive: bool,
    max_new: usize,
    eos_at: Option<usize>,
    prompt: Vec<u32>,
}

const V: usize = 64;
const STEER: [f32; 2] = [1.5, 2.0];

fn run_drafter(c: &DCase) -> Result<Stats, TestCaseError> {
    let be = Cpu::new();
    let steer_tok = 5u32;
    let ctx_cap = c.prompt.len() + 64 + 16;
    let cfg = tiny_config(V, HIDDEN, PATTERNS[c.layers % PATTERNS.len()], c.next_style);
    let mut target = random_target_with(
        &cfg,
        c.seed,
        1.0,
        ctx_cap,
        c.arm,
        c.steer.map(|s| (steer_tok, s)),
        None,
        KvStorage::F32,
    );
    let long = plain_greedy(&be, &mut target, &c.prompt, 64, &[]).unwrap();
    let mut dcfg = draft_tiny_config(
        HIDDEN,
        2,
        4,
        2,
        V,
        c.block,
        &[-1, 1],
        c.draft_window,
        c.markov_rank,
    )
    .unwrap();
    if c.mask_is_stream_token {
        dcfg.mask_token_id = long[long.len() / 2];
    }
    let tensors = random_tensor_map(&dcfg, c.seed ^ 0x5eed);
    let model =
        DraftModel::<Cpu>::from_tensors(&be, dcfg, &tensors, &DraftLoad::default()).unwrap();
    let mut drafter = DflashDrafter::new(&model).unwrap();
    let eos: Vec<u32> = c.eos_at.map(|i| long[i % long.len()]).into_iter().collect();
    let expected = plain_greedy(&be, &mut target, &c.prompt, c.max_new, &eos).unwrap();
    let n_drafts = dflash_spec_round::Drafter::<Cpu>::n_drafts(&drafter);
    let vmax = n_drafts + 1;
    let verify_cap = if c.cap_sel == 0 {
        None
    } else {
        Some(2 + c.cap_sel % (vmax - 1))
    };
    let scfg = SpecConfig {
        verify_cap,
        adaptive: c.adaptive,
        markov: c.markov_on,
        rollback: c.arm,
        ..SpecConfig::default()
    };
    let (got, stats) = generate(
        &be,
        &mut target,
        &mut drafter,
        scfg,
        &c.prompt,
        c.max_new,
        &eos,
    )
    .unwrap();
    prop_assert_eq!(
        &got,
        &expected,
        "spec != plain under {:?} ({:?})",
        c.arm,
        stats
    );
    prop_assert!(stats.accepted <= stats.drafted);
    Ok(stats)
}

fn dcase() -> impl Strategy<Value = DCase> {
    (
        (
            any::<u64>(),
            0usize..3,
            prop_oneof![Just(None), Just(Some(STEER[0])), Just(Some(STEER[1]))],
            0usize..4,
            any::<bool>(),
        ),
        (
            prop_oneof![Just(None), Just(Some(3usize))],
            2usize..=8,
            prop_oneof![Just(0usize), Just(8usize)],
        ),
        (any::<bool>(), any::<bool>(), 0usize..8, any::<bool>()),
        (
            1usize..=64,
            prop::option::of(0usize..64),
            prop::collection::vec(0u32..V as u32, 1..10),
        ),
    )
        .prop_map(
            |(
                (seed, arm, steer, layers, next_style),
                (draft_window, block, markov_rank),
                (markov_on, mask_is_stream_token, cap_sel, adaptive),
                (max_new, eos_at, prompt),
            )| DCase {
                seed,
                arm: ARMS[arm],
                steer,
                layers,
                next_style,
                draft_window,
                block,
                markov_rank,
                markov_on,
                mask_is_stream_token,
                cap_sel,
                adaptive,
                max_new,
                eos_at,
                prompt,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn spec_equals_plain_with_real_drafter_hybrid(c in dcase()) {
        run_drafter(&c)?;
    }
}

/// Steered hybrid pairs accept drafts under every arm (so the proptest cannot pass
/// vacuously), and reject some too.
#[test]
fn steered_hybrid_pairs_accept_and_stay_exact() {
    for arm in ARMS {
        let mut total = Stats::default();
        for seed in 0..6u64 {
            for (markov_rank, mask_is_stream_token) in [(0, false), (8, true)] {
                let c = DCase {
                    seed,
                    arm,
                    steer: Some(STEER[seed as usize % 2]),
                    layers: seed as usize,
                    next_style: seed % 3 == 0,
                    draft_window: Some(3),
                    block: 8,
                    markov_rank,
                    markov_on: true,
                    mask_is_stream_token,
                    cap_sel: 0,
                    adaptive: seed % 3 != 0,
                    max_new: 64,
                    eos_at: None,
                    prompt: vec![1, 2, 3, (seed % 60) as u32],
                };
                let s = run_drafter(&c).unwrap();
                total.rounds += s.rounds;
                total.drafted += s.drafted;
                total.accepted += s.accepted;
                total.committed += s.committed;
            }
        }
        println!(
            "{arm:?}: rounds {} drafted {} accepted {} tau {:.2}",
            total.rounds,
            total.drafted,
            total.accepted,
            total.tau()
        );
        assert!(
            total.accepted > total.rounds,
            "{arm:?}: steered pairs should accept: {total:?}"
        );
        assert!(
            total.accepted < total.drafted,
            "{arm:?}: some drafts must be rejected: {total:?}"
        );
    }
}
