//! Property: over random tiny drafters (full / sliding layers, GQA, Markov + confidence heads,
//! both row layouts), the cached round (chunked ingest in arbitrary pieces, then one block
//! forward) equals the uncached forward from scratch to 1e-6 and drafts the same tokens, for
//! contexts shorter and far longer than the sliding window and longer than one ingest chunk;
//! a step asked for fewer drafts (last layer on fewer rows) gives the same first drafts bit
//! for bit; a drafter loaded with `fast_attention` drafts the same on the CPU (its attention
//! is the exact op there); a drafter with an f16 cache equals its own uncached forward and
//! refuses an f32 cache.

use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostWeight, KvStorage, WeightFormat};
use dflash_draft_model::random::{random_tensor_map, tiny_config};
use dflash_draft_model::{DraftOptions, Drafter, LentWeights, LoadOptions, RowLayout};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

#[derive(Debug, Clone)]
struct Case {
    seed: u64,
    heads: usize,
    kv_heads: usize,
    layers: usize,
    window: Option<usize>,
    markov: bool,
    anchor_layout: bool,
    ctx: usize,
    cuts: Vec<usize>,
    block_len: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        any::<u64>(),
        prop_oneof![Just((4usize, 2usize)), Just((2, 2)), Just((4, 1))],
        1usize..=3,
        prop_oneof![Just(None), (1usize..12).prop_map(Some)],
        any::<bool>(),
        any::<bool>(),
        prop_oneof![0usize..40, 250usize..300],
        proptest::collection::vec(0usize..300, 0..4),
        1usize..=8,
    )
        .prop_map(
            |(
                seed,
                (heads, kv_heads),
                layers,
                window,
                markov,
                anchor_layout,
                ctx,
                cuts,
                block_len,
            )| {
                let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (ctx + 1)).collect();
                cuts.sort();
                Case {
                    seed,
                    heads,
                    kv_heads,
                    layers,
                    window,
                    markov,
                    anchor_layout,
                    ctx,
                    cuts,
                    block_len,
                }
            },
        )
}

fn run(c: &Case) -> Result<(), TestCaseError> {
    let be = Cpu::new();
    let (hidden, vocab, block) = (32usize, 64usize, 8usize);
    let taps = [0i64, 2];
    let mut cfg = tiny_config(
        hidden,
        c.layers,
        c.heads,
        c.kv_heads,
        vocab,
        block,
        &taps,
        c.window,
        if c.markov { 32 } else { 0 },
    )
    .unwrap();
    if c.anchor_layout {
        cfg.layout = RowLayout::AnchorPredicts;
    }
    let map = random_tensor_map(&cfg, c.seed);
    let dr = Drafter::from_tensors(&be, cfg, &map, &LoadOptions::default()).unwrap();
    let mut rng = StdRng::seed_from_u64(c.seed ^ 0x5eed);
    let mut w = |name: &str| {
        let v: Vec<f32> = (0..vocab * hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        be.upload_weight(&HostWeight::from_f32(name, vocab, hidden, &v, WeightFormat::F32).unwrap())
            .unwrap()
    };
    let lend = LentWeights::new(w("embed"), w("lm_head")).unwrap();
    let tw = taps.len() * hidden;
    let tap_vals: Vec<f32> = (0..(c.ctx + 5) * tw)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let anchor = rng.random_range(0..vocab as u32);
    let tokens = dr.block_tokens(anchor, c.block_len);

    // uncached
    let taps_buf = be.upload(&tap_vals).unwrap();
    let full = dr
        .forward_full(&be, &lend, &taps_buf, c.ctx, &tokens, 1.0, false)
        .unwrap();
    let opts = DraftOptions {
        markov: c.markov,
        block_len: Some(c.block_len),
        return_logits: true,
        ..Default::default()
    };
    let want = dr
        .drafts_from_hidden(&be, &lend, &full.final_hidden, c.block_len, anchor, &opts)
        .unwrap();

    // cached, ingest in the given pieces
    let extra = 1 + (c.seed % 5) as usize;
    let mut kv = dr.new_kv(&be, c.ctx + extra).unwrap();
    let mut bounds = vec![0];
    bounds.extend(c.cuts.iter().copied());
    bounds.push(c.ctx);
    // The context ingested in the pieces `bounds` cuts it into.
    let ingest_pieces = |d: &Drafter<Cpu>, kv: &mut dflash_kv::DraftKv<Cpu>| {
        for win in bounds.windows(2) {
            let (a, b) = (win[0], win[1]);
            let piece = be.upload(&tap_vals[a * tw..b * tw]).unwrap();
            d.ingest(&be, kv, &piece, b - a, a).unwrap();
        }
    };
    ingest_pieces(&dr, &mut kv);
    prop_assert_eq!(kv.len(), c.ctx);
    let hidden_cached = dr
        .forward_cached(&be, &mut kv, &lend, &tokens, 1.0)
        .unwrap();
    let e = rel(
        &be.download(&hidden_cached).unwrap(),
        &be.download(&full.final_hidden).unwrap(),
    );
    prop_assert!(e <= 1e-6, "hidden: {e}");
    let got = dr.draft(&be, &mut kv, &lend, anchor, c.ctx, &opts).unwrap();
    prop_assert_eq!(&got.tokens, &want.tokens);
    prop_assert_eq!(got.tokens.len(), dr.n_drafts(c.block_len));
    let e = rel(got.logits.as_ref().unwrap(), want.logits.as_ref().unwrap());
    prop_assert!(e <= 1e-6, "logits: {e}");
    if let (Some(a), Some(b)) = (&got.confidence, &want.confidence) {
        prop_assert!(rel(a, b) <= 1e-6);
    }
    prop_assert_eq!(got.confidence.is_some(), c.markov);
    prop_assert_eq!(kv.len(), c.ctx);
    // `fast_attention` asks for `Backend::attention_fast`, which is the exact op on the CPU: a
    // drafter loaded with it drafts the same, bit for bit (same cache: ingest has no attention).
    let fast_opts = LoadOptions {
        fast_attention: true,
        ..LoadOptions::default()
    };
    let fast = Drafter::from_tensors(&be, dr.cfg.clone(), &map, &fast_opts).unwrap();
    prop_assert!(fast.fast_attention && !dr.fast_attention);
    let got_fast = fast
        .draft(&be, &mut kv, &lend, anchor, c.ctx, &opts)
        .unwrap();
    prop_assert_eq!(&got_fast, &got);
    // An f16 cache (`kv_storage: F16`; on the CPU `attention_fast_kv16` unpacks it and runs the
    // exact op): the cached round equals the drafter's own uncached forward (both store K / V
    // rounded to f16), and a cache of the other storage is refused.
    let h_opts = LoadOptions {
        fast_attention: true,
        kv_storage: KvStorage::F16,
        ..LoadOptions::default()
    };
    let h = Drafter::from_tensors(&be, dr.cfg.clone(), &map, &h_opts).unwrap();
    prop_assert!(h.draft(&be, &mut kv, &lend, anchor, c.ctx, &opts).is_err());
    let mut kv16 = h.new_kv(&be, c.ctx + extra).unwrap();
    prop_assert_eq!(kv16.storage(), KvStorage::F16);
    ingest_pieces(&h, &mut kv16);
    let got16 = h
        .draft(&be, &mut kv16, &lend, anchor, c.ctx, &opts)
        .unwrap();
    let full16 = h
        .forward_full(&be, &lend, &taps_buf, c.ctx, &tokens, 1.0, false)
        .unwrap();
    let want16 = h
        .drafts_from_hidden(&be, &lend, &full16.final_hidden, c.block_len, anchor, &opts)
        .unwrap();
    prop_assert_eq!(&got16.tokens, &want16.tokens);
    let e = rel(
        got16.logits.as_ref().unwrap(),
        want16.logits.as_ref().unwrap(),
    );
    prop_assert!(e <= 1e-6, "f16 cache logits: {e}");
    // The drafter reuses its buffers across steps: a step of another block length, then the
    // same step again, gives bit-identical output.
    let other = DraftOptions {
        block_len: Some(1 + c.block_len % 8),
        ..opts
    };
    dr.draft(
        &be,
        &mut kv,
        &lend,
        (anchor + 1) % vocab as u32,
        c.ctx,
        &other,
    )
    .unwrap();
    let again = dr.draft(&be, &mut kv, &lend, anchor, c.ctx, &opts).unwrap();
    prop_assert_eq!(&again, &got);
    // Asking for fewer drafts runs the last layer on fewer rows only: the kept drafts, their
    // logits and confidences are bit for bit the first ones of the full step.
    let n_all = got.tokens.len();
    if n_all > 0 {
        let k = 1 + (c.seed as usize / 7) % n_all;
        let fewer = DraftOptions {
            max_drafts: Some(k),
            ..opts
        };
        let part = dr
            .draft(&be, &mut kv, &lend, anchor, c.ctx, &fewer)
            .unwrap();
        prop_assert_eq!(&part.tokens[..], &got.tokens[..k]);
        let (pl, gl) = (part.logits.as_ref().unwrap(), got.logits.as_ref().unwrap());
        prop_assert_eq!(pl.len(), k * vocab);
        prop_assert!(
            pl.iter()
                .zip(&gl[..k * vocab])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "logits of the first {} drafts differ",
            k
        );
        if let (Some(a), Some(b)) = (&part.confidence, &got.confidence) {
            prop_assert_eq!(&a[..], &b[..k]);
        }
    }

    // Next round: commit `extra` more context rows over the transient block rows the drafts
    // left behind, draft again, and compare with a from-scratch forward over all rows.
    let more = be
        .upload(&tap_vals[c.ctx * tw..(c.ctx + extra) * tw])
        .unwrap();
    dr.ingest(&be, &mut kv, &more, extra, c.ctx).unwrap();
    let ctx2 = c.ctx + extra;
    prop_assert_eq!(kv.len(), ctx2);
    let anchor2 = (anchor + 7) % vocab as u32;
    let got2 = dr.draft(&be, &mut kv, &lend, anchor2, ctx2, &opts).unwrap();
    let all = be.upload(&tap_vals[..ctx2 * tw]).unwrap();
    let tokens2 = dr.block_tokens(anchor2, c.block_len);
    let full2 = dr
        .forward_full(&be, &lend, &all, ctx2, &tokens2, 1.0, false)
        .unwrap();
    let want2 = dr
        .drafts_from_hidden(&be, &lend, &full2.final_hidden, c.block_len, anchor2, &opts)
        .unwrap();
    prop_assert_eq!(&got2.tokens, &want2.tokens);
    let e = rel(
        got2.logits.as_ref().unwrap(),
        want2.logits.as_ref().unwrap(),
    );
    prop_assert!(e <= 1e-6, "round 2 logits: {e}");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn cached_round_equals_uncached_forward(c in case()) {
        run(&c)?;
    }
}

/// Sliding layers really bound the context: changing a context row older than the window
/// changes nothing in an all-sliding drafter, and changes the output of a drafter with a
/// full layer.
#[test]
fn window_bounds_what_sliding_layers_see() {
    let be = Cpu::new();
    let (hidden, vocab, ctx, w) = (32usize, 64usize, 40usize, 6usize);
    for all_sliding in [true, false] {
        let layers = if all_sliding { 1 } else { 2 };
        let cfg = tiny_config(hidden, layers, 4, 2, vocab, 8, &[1], Some(w), 0).unwrap();
        let map = random_tensor_map(&cfg, 7);
        let dr = Drafter::from_tensors(&be, cfg, &map, &LoadOptions::default()).unwrap();
        let mut rng = StdRng::seed_from_u64(9);
        let mut mk = |n: &str| {
            let v: Vec<f32> = (0..vocab * hidden)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            be.upload_weight(
                &HostWeight::from_f32(n, vocab, hidden, &v, WeightFormat::F32).unwrap(),
            )
            .unwrap()
        };
        let lend = LentWeights::new(mk("e"), mk("h")).unwrap();
        let mut taps: Vec<f32> = (0..ctx * hidden)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let tokens = dr.block_tokens(3, 8);
        let run = |taps: &[f32]| {
            let t = be.upload(taps).unwrap();
            let out = dr
                .forward_full(&be, &lend, &t, ctx, &tokens, 1.0, false)
                .unwrap();
            be.download(&out.final_hidden).unwrap()
        };
        let before = run(&taps);
        // Block queries sit at ctx..ctx+8 and see keys > p - w >= ctx - w; perturb row 10.
        for v in &mut taps[10 * hidden..11 * hidden] {
            *v += 1.0;
        }
        let after = run(&taps);
        if all_sliding {
            assert_eq!(
                before, after,
                "an old context row leaked through the window"
            );
        } else {
            assert_ne!(before, after, "the full layer must see every context row");
        }
    }
}

/// An f16 cache needs the fast attention (the exact op reads f32): asking for it without is an
/// error at load, naming both options.
#[test]
fn f16_cache_needs_fast_attention() {
    let be = Cpu::new();
    let cfg = tiny_config(32, 1, 4, 2, 64, 8, &[0, 2], None, 0).unwrap();
    let map = random_tensor_map(&cfg, 3);
    let opts = LoadOptions {
        kv_storage: KvStorage::F16,
        ..LoadOptions::default()
    };
    let e = Drafter::from_tensors(&be, cfg, &map, &opts).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("fast_attention") && msg.contains("F16"),
        "{msg}"
    );
}
