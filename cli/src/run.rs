//! One speculative run and one plain greedy run, timed, shared by `generate` and `bench`.

use std::time::Instant;

use anyhow::Result;
use dflash_backend::Backend;
use dflash_spec_round::{plain_greedy, Drafter, Session, SpecConfig, Stats, StopReason, Target};

/// A finished speculative run.
pub struct SpecRun {
    pub tokens: Vec<u32>,
    pub stats: Stats,
    /// Tokens committed by each round (`m + 1`), in order.
    pub per_round: Vec<usize>,
    pub stop: Option<StopReason>,
    /// Wall time, prime included.
    pub wall_s: f64,
}

/// Run a session to the end, round by round (`burst(1)`), handing every burst of tokens to
/// `on_tokens` as soon as it is committed.
#[allow(clippy::too_many_arguments)]
pub fn spec_run<B: Backend>(
    be: &B,
    target: &mut dyn Target<B>,
    drafter: &mut dyn Drafter<B>,
    cfg: SpecConfig,
    prompt: &[u32],
    eos: &[u32],
    max_new: usize,
    mut on_tokens: impl FnMut(&[u32]) -> Result<()>,
) -> Result<SpecRun> {
    let t0 = Instant::now();
    let mut s = Session::new(be, target, drafter, cfg, prompt, eos, Some(max_new))?;
    let mut tokens = Vec::with_capacity(max_new);
    let mut per_round = Vec::new();
    let (mut rounds, mut committed) = (0usize, 0usize);
    while !s.finished() {
        // burst(1) runs at most one round when nothing is queued, so each round is seen alone
        let step = s.burst(1)?;
        let st = s.stats();
        if st.rounds != rounds {
            per_round.push(st.committed - committed);
            rounds = st.rounds;
            committed = st.committed;
        }
        if step.is_empty() {
            break;
        }
        // hand out what the round committed in one piece
        let mut chunk = step;
        let more = s.queued();
        if more > 0 {
            chunk.extend(s.burst(more)?);
        }
        on_tokens(&chunk)?;
        tokens.extend(chunk);
    }
    let wall_s = t0.elapsed().as_secs_f64();
    Ok(SpecRun {
        tokens,
        stats: s.stats().clone(),
        per_round,
        stop: s.stop_reason(),
        wall_s,
    })
}

/// Plain greedy decode of the same target, timed (prefill included).
pub fn plain_run<B: Backend>(
    be: &B,
    target: &mut dyn Target<B>,
    prompt: &[u32],
    eos: &[u32],
    max_new: usize,
) -> Result<(Vec<u32>, f64)> {
    let t0 = Instant::now();
    let p = plain_greedy(be, target, prompt, max_new, eos)?;
    Ok((p, t0.elapsed().as_secs_f64()))
}

/// First index where two streams differ (`None`: identical).
pub fn first_diff(a: &[u32], b: &[u32]) -> Option<usize> {
    let n = a.len().min(b.len());
    (0..n)
        .find(|&i| a[i] != b[i])
        .or((a.len() != b.len()).then_some(n))
}
