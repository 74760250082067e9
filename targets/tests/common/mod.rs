//! Test doubles shared by the exactness tests.
#![allow(dead_code)]

use dflash_backend::Backend;
use dflash_spec_round::{DraftOptions, Drafter, Result, SpecError, Target};

/// A drafter that proposes from a known stream (the prompt followed by the target's greedy
/// continuation), corrupting the drafts where `bad(round, pos, i)` says so. It checks the
/// engine's protocol as it goes: the anchor must be the stream's token at `pos`, `pos` must
/// equal the ingested context length, and every ingested tap row is kept so a test can
/// compare them with a fresh forward over the committed stream.
pub struct ScriptDrafter<B: Backend> {
    pub truth: Vec<u32>,
    pub vocab: u32,
    pub taps: Vec<i32>,
    pub hidden: usize,
    pub n_drafts: usize,
    pub bad: Box<dyn FnMut(usize, usize, usize) -> bool>,
    pub ctx: usize,
    pub rounds: usize,
    pub ingested: Vec<f32>,
    pub cap: usize,
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend> ScriptDrafter<B> {
    pub fn new(
        truth: Vec<u32>,
        vocab: u32,
        taps: Vec<i32>,
        hidden: usize,
        n_drafts: usize,
        bad: Box<dyn FnMut(usize, usize, usize) -> bool>,
    ) -> Self {
        ScriptDrafter {
            truth,
            vocab,
            taps,
            hidden,
            n_drafts,
            bad,
            ctx: 0,
            rounds: 0,
            ingested: Vec::new(),
            cap: 0,
            _b: std::marker::PhantomData,
        }
    }
}

impl<B: Backend> Drafter<B> for ScriptDrafter<B> {
    fn tap_layers(&self) -> &[i32] {
        &self.taps
    }
    fn hidden(&self) -> usize {
        self.hidden
    }
    fn n_drafts(&self) -> usize {
        self.n_drafts
    }
    fn reset(&mut self, _be: &B, ctx_cap: usize) -> Result<()> {
        self.ctx = 0;
        self.rounds = 0;
        self.ingested.clear();
        self.cap = ctx_cap;
        Ok(())
    }
    fn ctx_len(&self) -> usize {
        self.ctx
    }
    fn ingest(&mut self, be: &B, taps: &B::Buf, rows: usize) -> Result<()> {
        let w = self.taps.len() * self.hidden;
        let v = be.download(taps)?;
        if v.len() != rows * w {
            return Err(SpecError::Protocol(format!(
                "ingest of {rows} rows got {} values, expected {}",
                v.len(),
                rows * w
            )));
        }
        self.ingested.extend_from_slice(&v);
        self.ctx += rows;
        if self.ctx > self.cap {
            return Err(SpecError::Protocol("drafter over capacity".into()));
        }
        Ok(())
    }
    fn draft(
        &mut self,
        _be: &B,
        _target: &dyn Target<B>,
        anchor: u32,
        pos: usize,
        _n: usize,
        _opts: DraftOptions,
    ) -> Result<Vec<u32>> {
        if pos != self.ctx {
            return Err(SpecError::Protocol(format!(
                "draft at {pos}, ctx {}",
                self.ctx
            )));
        }
        if self.truth.get(pos) != Some(&anchor) {
            return Err(SpecError::Protocol(format!(
                "anchor {anchor} at {pos}, the stream has {:?}",
                self.truth.get(pos)
            )));
        }
        let r = self.rounds;
        self.rounds += 1;
        Ok((0..self.n_drafts)
            .map(|i| {
                let t = self.truth.get(pos + 1 + i).copied().unwrap_or(0);
                if (self.bad)(r, pos, i) {
                    (t + 1 + (i as u32 % 3)) % self.vocab
                } else {
                    t
                }
            })
            .collect())
    }
}

/// How a scripted drafter errs, per round `r`, position `pos` and draft index `i`
/// (shared by the dense and hybrid exactness proptests).
#[derive(Clone, Copy, Debug)]
pub enum Pattern {
    /// Every draft right: long accepts.
    Perfect,
    /// Every draft wrong: zero accepts.
    Wrong,
    /// Even rounds perfect, odd rounds wrong from the first draft: a zero-accept round
    /// right after a long accept.
    Alternate,
    /// Draft `i` of a round is wrong with probability 1/4 (hash of round, position, i).
    Random(u64),
    /// Right up to draft `k`, wrong after.
    PrefixOf(usize),
}

pub fn bad_fn(p: Pattern) -> Box<dyn FnMut(usize, usize, usize) -> bool> {
    match p {
        Pattern::Perfect => Box::new(|_, _, _| false),
        Pattern::Wrong => Box::new(|_, _, _| true),
        Pattern::Alternate => Box::new(|r, _, _| r % 2 == 1),
        Pattern::Random(s) => Box::new(move |r, pos, i| {
            let mut h = s ^ ((r as u64) << 32) ^ ((pos as u64) << 16) ^ i as u64;
            h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h ^= h >> 29;
            h & 3 == 0
        }),
        Pattern::PrefixOf(k) => Box::new(move |_, _, i| i >= k),
    }
}

pub fn pattern() -> impl proptest::strategy::Strategy<Value = Pattern> {
    use proptest::prelude::*;
    prop_oneof![
        Just(Pattern::Perfect),
        Just(Pattern::Wrong),
        Just(Pattern::Alternate),
        any::<u64>().prop_map(Pattern::Random),
        (0usize..8).prop_map(Pattern::PrefixOf),
    ]
}
