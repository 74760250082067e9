//! The round engine: one implementation for every target, driven through `dyn Target` and
//! `dyn Drafter`.

use std::collections::VecDeque;
use std::time::Instant;

use dflash_backend::Backend;

use crate::{DraftOptions, Drafter, Result, SpecConfig, SpecError, Stats, StopReason, Target};

/// Rows per chunk when the prompt's taps are ingested into the draft cache.
pub const INGEST_CHUNK: usize = 256;

fn check_prompt(prompt: &[u32], vocab: usize) -> Result<()> {
    if prompt.is_empty() {
        return Err(SpecError::EmptyPrompt);
    }
    for (i, &t) in prompt.iter().enumerate() {
        if t as usize >= vocab {
            return Err(SpecError::TokenOutOfRange {
                what: "prompt",
                index: i,
                id: t,
                vocab,
            });
        }
    }
    Ok(())
}

/// Plain greedy decode through the [`Target`] trait: the reference stream the speculative
/// stream must equal. `max_new` counts every generated token including the first; the output
/// has exactly `max_new` tokens unless an EOS id comes first (it is included) or the context
/// cap is reached.
pub fn plain_greedy<B: Backend>(
    be: &B,
    target: &mut dyn Target<B>,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<Vec<u32>> {
    let info = target.info();
    check_prompt(prompt, info.vocab)?;
    if prompt.len() > info.ctx_cap {
        return Err(SpecError::ContextCap {
            what: "prompt",
            needed: prompt.len(),
            cap: info.ctx_cap,
        });
    }
    let mut out = Vec::with_capacity(max_new);
    if max_new == 0 {
        return Ok(out);
    }
    let f = target.prime(be, prompt, &[])?;
    let mut last = first_argmax(&f.argmax)?;
    loop {
        out.push(last);
        if eos.contains(&last) || out.len() >= max_new {
            break;
        }
        let pos = target.pos();
        if pos >= info.ctx_cap {
            break;
        }
        let f = target.verify(be, &[last], pos, &[], false)?;
        target.commit(be, 1)?;
        last = first_argmax(&f.argmax)?;
    }
    Ok(out)
}

fn first_argmax(a: &[u32]) -> Result<u32> {
    a.last()
        .copied()
        .ok_or_else(|| SpecError::Protocol("target returned no argmax row".into()))
}

/// A speculative decoding session: primed once, then advanced in bursts so a scheduler can
/// interleave many sessions. Tokens computed past a burst's request stay inside the session
/// and come out first in the next burst.
pub struct Session<'a, B: Backend> {
    be: &'a B,
    target: &'a mut dyn Target<B>,
    drafter: &'a mut dyn Drafter<B>,
    cfg: SpecConfig,
    eos: Vec<u32>,
    taps: Vec<i32>,
    tap_width: usize,
    vt_cap: usize,
    vt: usize,
    /// The next token of the stream: known (the target's argmax) but not yet in the target's
    /// cache.
    last: u32,
    pending: VecDeque<u32>,
    produced: usize,
    budget: Option<usize>,
    stop: Option<StopReason>,
    stats: Stats,
}

impl<'a, B: Backend> Session<'a, B> {
    /// Check the pair, prime the target with taps and ingest the prompt's context rows into
    /// the drafter (in chunks of [`INGEST_CHUNK`] rows). `budget` bounds the tokens the
    /// session ever produces (`None`: until EOS or the context cap).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        be: &'a B,
        target: &'a mut dyn Target<B>,
        drafter: &'a mut dyn Drafter<B>,
        cfg: SpecConfig,
        prompt: &[u32],
        eos: &[u32],
        budget: Option<usize>,
    ) -> Result<Self> {
        let info = target.info();
        check_prompt(prompt, info.vocab)?;
        if drafter.hidden() != info.hidden {
            return Err(SpecError::HiddenMismatch {
                draft: drafter.hidden(),
                target: info.hidden,
            });
        }
        let taps = drafter.tap_layers().to_vec();
        info.check_taps(&taps)?;
        let n_drafts = drafter.n_drafts();
        let block = n_drafts + 1;
        let vt_cap = match cfg.verify_cap {
            None => block,
            Some(c) if (2..=block).contains(&c) => c,
            Some(c) => {
                return Err(SpecError::Config(format!(
                    "verify_cap {c} outside 2..={block} (anchor + {n_drafts} drafts)"
                )))
            }
        };
        if prompt.len() + block > info.ctx_cap {
            return Err(SpecError::ContextCap {
                what: "prompt + block",
                needed: prompt.len() + block,
                cap: info.ctx_cap,
            });
        }
        let tap_width = taps.len() * info.hidden;
        let mut stats = Stats::default();
        let t0 = Instant::now();
        target.set_rollback(cfg.rollback);
        drafter.reset(be, info.ctx_cap)?;
        let f = target.prime(be, prompt, &taps)?;
        let last = first_argmax(&f.argmax)?;
        let tb = f
            .taps
            .ok_or_else(|| SpecError::Protocol("prime returned no taps".into()))?;
        let p = prompt.len();
        let mut r0 = 0;
        while r0 < p {
            let rows = (p - r0).min(INGEST_CHUNK);
            if rows == p {
                drafter.ingest(be, &tb, rows)?;
            } else {
                let mut chunk = be.zeros(rows * tap_width)?;
                be.copy(&tb, r0 * tap_width, &mut chunk, 0, rows * tap_width)?;
                drafter.ingest(be, &chunk, rows)?;
            }
            r0 += rows;
        }
        if cfg.stats {
            be.synchronize()?;
        }
        stats.prime = t0.elapsed();
        let mut s = Session {
            be,
            target,
            drafter,
            cfg,
            eos: eos.to_vec(),
            taps,
            tap_width,
            vt_cap,
            vt: vt_cap,
            last,
            pending: VecDeque::new(),
            produced: 0,
            budget,
            stop: None,
            stats,
        };
        if budget == Some(0) {
            s.stop = Some(StopReason::Budget);
        }
        Ok(s)
    }

    /// Run rounds until at least `n` tokens are ready (or the session stops), and return up
    /// to `n` of them; the rest stay queued for the next burst.
    pub fn burst(&mut self, n: usize) -> Result<Vec<u32>> {
        while self.pending.len() < n && self.stop.is_none() {
            self.round()?;
        }
        let k = n.min(self.pending.len());
        Ok(self.pending.drain(..k).collect())
    }

    /// Whether the session has stopped and every token has been handed out.
    pub fn finished(&self) -> bool {
        self.stop.is_some() && self.pending.is_empty()
    }

    /// Why the session stopped, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    /// Tokens computed but not yet handed out.
    pub fn queued(&self) -> usize {
        self.pending.len()
    }

    /// Counters and phase times so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Committed target positions.
    pub fn pos(&self) -> usize {
        self.target.pos()
    }

    /// Queue one token; returns true when the session must stop after it.
    fn emit(&mut self, tok: u32) -> bool {
        self.pending.push_back(tok);
        self.produced += 1;
        if self.eos.contains(&tok) {
            self.stop = Some(StopReason::Eos);
            return true;
        }
        if self.budget.is_some_and(|b| self.produced >= b) {
            self.stop = Some(StopReason::Budget);
            return true;
        }
        false
    }

    fn clock(&self) -> Result<Option<Instant>> {
        if self.cfg.stats {
            self.be.synchronize()?;
            Ok(Some(Instant::now()))
        } else {
            Ok(None)
        }
    }

    /// One round (or the final emit-only step).
    fn round(&mut self) -> Result<()> {
        let be = self.be;
        let start = self.target.pos();
        let cap = self.target.info().ctx_cap;
        if self.drafter.ctx_len() != start {
            return Err(SpecError::Protocol(format!(
                "drafter holds {} context rows, target {start}",
                self.drafter.ctx_len()
            )));
        }
        let remaining = self
            .budget
            .map_or(usize::MAX, |b| b.saturating_sub(self.produced));
        let room = cap.saturating_sub(start);
        if remaining <= 1 || room == 0 {
            // The next token is already known: emit it without a forward.
            let last = self.last;
            if !self.emit(last) {
                self.stop = Some(StopReason::ContextCap);
            }
            return Ok(());
        }
        let vt = self.vt.min(remaining).min(room);
        let mut block = Vec::with_capacity(vt);
        block.push(self.last);

        // ---- draft
        let t0 = self.clock()?;
        if vt >= 2 {
            // Round 1 computes every draft of the block (reported as `first_draft`); later
            // rounds the `vt - 1` that get verified, rounded up to `verify_multiple` (lm_head
            // rows in whole multi-row tiles; the first `vt - 1` drafts do not depend on it).
            let n = if self.stats.rounds == 0 {
                self.drafter.n_drafts().max(vt - 1)
            } else {
                (vt - 1)
                    .next_multiple_of(self.cfg.verify_multiple.max(1))
                    .min(self.drafter.n_drafts())
                    .max(vt - 1)
            };
            let drafts = self.drafter.draft(
                be,
                &*self.target,
                self.last,
                start,
                n,
                DraftOptions {
                    markov: self.cfg.markov,
                    emb_scale: self.cfg.emb_scale,
                },
            )?;
            if drafts.len() < vt - 1 {
                return Err(SpecError::Protocol(format!(
                    "drafter returned {} drafts, the round verifies {}",
                    drafts.len(),
                    vt - 1
                )));
            }
            if self.stats.rounds == 0 {
                self.stats.first_draft = drafts.clone();
            }
            block.extend_from_slice(&drafts[..vt - 1]);
        }
        let t1 = self.clock()?;

        // ---- verify
        let f = self.target.verify(be, &block, start, &self.taps, false)?;
        if f.argmax.len() != vt {
            return Err(SpecError::Protocol(format!(
                "verify of {vt} rows returned {} argmax rows",
                f.argmax.len()
            )));
        }
        let t2 = self.clock()?;

        // ---- accept the longest matching prefix, commit m + 1 rows
        let m = (0..vt - 1)
            .take_while(|&i| block[i + 1] == f.argmax[i])
            .count();
        let keep = m + 1;
        self.target.commit(be, keep)?;
        let t3 = self.clock()?;

        // ---- ingest the kept rows' taps into the drafter
        let tb = f
            .taps
            .ok_or_else(|| SpecError::Protocol("verify returned no taps".into()))?;
        if keep == vt {
            self.drafter.ingest(be, &tb, keep)?;
        } else {
            let mut kept = be.zeros(keep * self.tap_width)?;
            be.copy(&tb, 0, &mut kept, 0, keep * self.tap_width)?;
            self.drafter.ingest(be, &kept, keep)?;
        }
        let t4 = self.clock()?;
        if let (Some(a), Some(b), Some(c), Some(d), Some(e)) = (t0, t1, t2, t3, t4) {
            self.stats.draft += b - a;
            self.stats.verify += c - b;
            self.stats.rollback += d - c;
            self.stats.ingest += e - d;
        }

        self.stats.rounds += 1;
        self.stats.drafted += vt - 1;
        self.stats.accepted += m;
        self.stats.committed += keep;
        self.last = f.argmax[m];
        self.vt = if self.cfg.adaptive {
            (m + 2)
                .max(3)
                .next_multiple_of(self.cfg.verify_multiple.max(1))
                .min(self.vt_cap)
        } else {
            self.vt_cap
        };
        for &tok in &block[..keep] {
            if self.emit(tok) {
                break;
            }
        }
        Ok(())
    }
}

/// Speculative greedy generation of exactly `max_new` tokens (fewer only on EOS, which is
/// included, or at the context cap). Returns the tokens and the session's statistics.
#[allow(clippy::too_many_arguments)]
pub fn generate<B: Backend>(
    be: &B,
    target: &mut dyn Target<B>,
    drafter: &mut dyn Drafter<B>,
    cfg: SpecConfig,
    prompt: &[u32],
    max_new: usize,
    eos: &[u32],
) -> Result<(Vec<u32>, Stats)> {
    let mut s = Session::new(be, target, drafter, cfg, prompt, eos, Some(max_new))?;
    let out = s.burst(max_new)?;
    Ok((out, s.stats().clone()))
}
