//! Exactness with the real DFlash / DSpark drafter (random tiny drafters from
//! `dflash-draft-model`): spec stream == plain greedy, with Markov on/off, sliding-window
//! draft layers and targets, a mask id equal to a token the target really produces, every
//! verify cap and adaptive on/off. Steered targets make the drafter agree often, so long
//! accepts (and zero accepts right after them) happen; the test asserts they did.

use dflash_backend::cpu::Cpu;
use dflash_backend::WeightFormat;
use dflash_draft_model::random::{random_tensor_map, tiny_config};
use dflash_draft_model::{Drafter as DraftModel, LoadOptions as DraftLoad};
use dflash_spec_round::{generate, plain_greedy, DflashDrafter, SpecConfig, Stats};
use dflash_targets::random::{random_qwen3_steered, tiny_qwen3_config};
use proptest::prelude::*;

const V: usize = 64;
const H: usize = 32;

#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    steer: Option<f32>,
    target_window: Option<usize>,
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

fn run(c: &Case) -> Result<Stats, TestCaseError> {
    let be = Cpu::new();
    let steer_tok = 5u32;
    let ctx_cap = c.prompt.len() + 64 + 16;
    let mut target = random_qwen3_steered(
        &be,
        tiny_qwen3_config(V, H, 3, c.target_window),
        c.seed,
        WeightFormat::F32,
        ctx_cap,
        c.steer.map(|s| (steer_tok, s)),
    )
    .unwrap();
    let long = plain_greedy(&be, &mut target, &c.prompt, 64, &[]).unwrap();
    let mut dcfg = tiny_config(
        H,
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
        // A mask id the target actually generates (mask rows must not be confused with it).
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
    let cfg = SpecConfig {
        verify_cap,
        adaptive: c.adaptive,
        markov: c.markov_on,
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
    prop_assert_eq!(&got, &expected, "spec != plain ({:?})", stats);
    prop_assert!(stats.accepted <= stats.drafted);
    if c.max_new >= 2 {
        // Round 1 drafts the whole block whatever the verify width.
        prop_assert_eq!(stats.first_draft.len(), n_drafts);
    }
    Ok(stats)
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            any::<u64>(),
            prop_oneof![Just(None), Just(Some(12.0f32)), Just(Some(20.0f32))],
        ),
        (
            prop_oneof![Just(None), Just(Some(4usize))],
            prop_oneof![Just(None), Just(Some(3usize))],
        ),
        (
            2usize..=8,
            prop_oneof![Just(0usize), Just(8usize)],
            any::<bool>(),
            any::<bool>(),
        ),
        (
            0usize..8,
            any::<bool>(),
            1usize..=64,
            prop::option::of(0usize..64),
        ),
        prop::collection::vec(0u32..V as u32, 1..10),
    )
        .prop_map(
            |(
                (seed, steer),
                (target_window, draft_window),
                (block, markov_rank, markov_on, mask_is_stream_token),
                (cap_sel, adaptive, max_new, eos_at),
                prompt,
            )| Case {
                seed,
                steer,
                target_window,
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
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn spec_equals_plain_with_real_drafter(c in case()) {
        run(&c)?;
    }
}

/// Steered pairs accept drafts (the proptest above cannot pass vacuously on them), and a
/// round with zero accepts follows a long accept somewhere in these runs.
#[test]
fn steered_pairs_accept_and_stay_exact() {
    let mut total = Stats::default();
    for seed in 0..12u64 {
        for (markov_rank, mask_is_stream_token) in [(0, false), (8, true)] {
            let c = Case {
                seed,
                steer: Some(if seed % 2 == 0 { 12.0 } else { 20.0 }),
                target_window: Some(4),
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
            let s = run(&c).unwrap();
            total.rounds += s.rounds;
            total.drafted += s.drafted;
            total.accepted += s.accepted;
            total.committed += s.committed;
        }
    }
    println!(
        "steered: rounds {} drafted {} accepted {} tau {:.2}",
        total.rounds,
        total.drafted,
        total.accepted,
        total.tau()
    );
    assert!(
        total.accepted > total.rounds,
        "steered pairs should accept more than one draft per round on average: {total:?}"
    );
    assert!(
        total.accepted < total.drafted,
        "some drafts must be rejected too: {total:?}"
    );
}
