//! The Qwen3.5 / Qwen3-Next hybrid target (Gated DeltaNet + gated full attention) on CUDA:
//! logits against the CPU backend, and spec stream == plain greedy on CUDA under every
//! rollback arm (stash, replay, gate). Random tiny targets from the targets crate's own test
//! helpers (included read-only). Skipped, with the reason printed, without a CUDA device.

mod common;
#[path = "../../targets/tests/hybrid_common/mod.rs"]
mod hybrid_common;

use common::{gpu, report, rng};
use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, KvStorage};
use dflash_cuda_kernels::{Cuda, DELTA_CHUNK_MIN};
use dflash_draft_model::random::{random_tensor_map, tiny_config as draft_tiny_config};
use dflash_draft_model::{Drafter as DraftModel, LoadOptions as DraftLoad};
use dflash_spec_round::{generate, plain_greedy, DflashDrafter, RollbackArm, SpecConfig, Target};
use dflash_targets::hybrid::{HybridConfig, HybridTarget, TensorNames};
use dflash_targets::{LoadOptions, LogitRows};
use hybrid_common::{random_tensors_steered, tiny_config};
use rand::Rng;

fn target<B: Backend>(
    be: &B,
    cfg: &HybridConfig,
    seed: u64,
    cap: usize,
    arm: RollbackArm,
    steer: Option<(u32, f32)>,
    kv: KvStorage,
) -> HybridTarget<B> {
    let src = random_tensors_steered(cfg, seed, 1.0, steer);
    let names = TensorNames {
        prefix: "model.".into(),
        lm_head: "lm_head.weight".into(),
    };
    let opts = LoadOptions {
        precision: None,
        ctx_cap: Some(cap),
        kv_storage: kv,
    };
    let mut t =
        HybridTarget::from_source(be, cfg.clone(), &src, &names, opts).expect("hybrid target");
    t.set_rollback(arm);
    t
}

#[test]
fn hybrid_target_cuda_vs_cpu() {
    let Some(g) = gpu("hybrid_target_cuda_vs_cpu") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("hybrid_target_cuda_vs_cpu");
    for (pattern, next_style) in [("lfl", false), ("llf", true), ("lflf", false)] {
        let cfg = tiny_config(64, 32, pattern, next_style);
        let seed: u64 = r.random();
        // 19 tokens: the recurrent kernels; more than DELTA_CHUNK_MIN: the chunked delta rule.
        for n in [19usize, DELTA_CHUNK_MIN + 22] {
            let mut tc = target(
                &cpu,
                &cfg,
                seed,
                160,
                RollbackArm::Stash,
                None,
                KvStorage::F32,
            );
            let mut tg = target(g, &cfg, seed, 160, RollbackArm::Stash, None, KvStorage::F32);
            let toks: Vec<u32> = (0..n).map(|_| r.random_range(0..64)).collect();
            let fc = tc.run(&cpu, &toks, &[], LogitRows::All).expect("cpu run");
            let fg = tg.run(g, &toks, &[], LogitRows::All).expect("cuda run");
            let lc = cpu
                .download(fc.logits.as_ref().expect("logits"))
                .expect("dl");
            let lg = g.download(fg.logits.as_ref().expect("logits")).expect("dl");
            report(
                &format!(
                    "hybrid target logits pattern {pattern} next_style {next_style} ({n} tokens)"
                ),
                &lg,
                &lc,
                1e-4,
            );
        }
    }
}

#[test]
fn hybrid_spec_equals_greedy_on_cuda_every_arm() {
    let Some(g) = gpu("hybrid_spec_equals_greedy_on_cuda_every_arm") else {
        return;
    };
    let mut r = rng("hybrid_spec_equals_greedy_on_cuda_every_arm");
    let mut accepted = 0;
    for arm in [RollbackArm::Stash, RollbackArm::Replay, RollbackArm::Gate] {
        // The last pattern with the full-attention layers' K / V in f16 (and a long prompt).
        for (pattern, next_style, markov, kv) in [
            ("lfl", false, 0usize, KvStorage::F32),
            ("llf", true, 32, KvStorage::F32),
            ("lflf", false, 0, KvStorage::F16),
        ] {
            let cfg = tiny_config(64, 32, pattern, next_style);
            let seed: u64 = r.random();
            // The last pattern's prompt long enough for the chunked delta rule in its prefill.
            let plen = if pattern == "lflf" {
                r.random_range(DELTA_CHUNK_MIN..DELTA_CHUNK_MIN + 40)
            } else {
                r.random_range(1..10)
            };
            let prompt: Vec<u32> = (0..plen).map(|_| r.random_range(0..64u32)).collect();
            let max_new = r.random_range(8..=48usize);
            let cap = prompt.len() + 64 + 16;
            let mut t = target(g, &cfg, seed, cap, arm, Some((5, 2.0)), kv);
            let expected = plain_greedy(g, &mut t, &prompt, max_new, &[]).expect("greedy");
            let dcfg =
                draft_tiny_config(32, 2, 4, 2, 64, 8, &[-1, 1], None, markov).expect("draft cfg");
            let tensors = random_tensor_map(&dcfg, seed ^ 0x5eed);
            let model = DraftModel::<Cuda>::from_tensors(g, dcfg, &tensors, &DraftLoad::default())
                .expect("drafter");
            let mut drafter = DflashDrafter::new(&model).expect("drafter");
            let scfg = SpecConfig {
                markov: markov > 0,
                ..SpecConfig::default()
            };
            let (got, stats) =
                generate(g, &mut t, &mut drafter, scfg, &prompt, max_new, &[]).expect("spec");
            assert_eq!(
                got, expected,
                "{arm:?} {pattern}: spec stream != greedy on CUDA ({stats:?})"
            );
            accepted += stats.accepted;
            eprintln!(
                "SPEC==GREEDY cuda hybrid {arm:?} {pattern} next_style {next_style} markov {markov} K / V {kv:?}: {} tokens identical, rounds {} drafted {} accepted {}",
                got.len(),
                stats.rounds,
                stats.drafted,
                stats.accepted
            );
        }
    }
    assert!(
        accepted > 0,
        "no draft accepted: the hybrid rollback paths were not exercised"
    );
}
