//! Typed configuration and statistics of the round engine.

use std::time::Duration;

use crate::RollbackArm;

/// Configuration of speculative decoding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecConfig {
    /// Most rows one verify runs (anchor + drafts), `2..=n_drafts + 1`; `None` = the whole
    /// block.
    pub verify_cap: Option<usize>,
    /// Adapt the verify width to the last accept: `vt = clamp(m + 2, 3, cap)`.
    pub adaptive: bool,
    /// Round the adaptive width up to a multiple of this (never past the cap), and ask the
    /// drafter for a multiple of this many drafts (never past its block; only the first
    /// `vt - 1` are verified): backends run multi-row tiles (the CPU's AVX-512 matmul: 8- and
    /// 4-row tiles), so a 7-row verify or lm_head can cost more than an 8-row one, and extra
    /// verified rows can only add accepts. `1` (the default) keeps `clamp(m + 2, 3, cap)`.
    pub verify_multiple: usize,
    /// Use the drafter's Markov chain when it has one.
    pub markov: bool,
    /// Rollback arm handed to hybrid targets.
    pub rollback: RollbackArm,
    /// Multiplier on the embedding rows the drafter borrows.
    pub emb_scale: f32,
    /// Measure per-phase wall time (synchronising the backend around each phase).
    pub stats: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            verify_cap: None,
            adaptive: true,
            verify_multiple: 1,
            markov: true,
            rollback: RollbackArm::Stash,
            emb_scale: 1.0,
            stats: true,
        }
    }
}

/// Counters and per-phase wall time of a session.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Rounds run (a final step that only emits the known next token is not a round).
    pub rounds: usize,
    /// Draft tokens sent to verification (`vt - 1` per round).
    pub drafted: usize,
    /// Draft tokens accepted (`m` per round).
    pub accepted: usize,
    /// Tokens committed by rounds (`m + 1` per round).
    pub committed: usize,
    /// Every draft token of round 1's block (after the Markov chain, if any), whatever the
    /// verify width; empty if round 1 drafted nothing.
    pub first_draft: Vec<u32>,
    pub prime: Duration,
    pub draft: Duration,
    pub verify: Duration,
    pub rollback: Duration,
    pub ingest: Duration,
}

impl Stats {
    /// Mean tokens committed per round (accepted drafts + the target's own token).
    pub fn tau(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.committed as f64 / self.rounds as f64
        }
    }

    /// Fraction of drafted tokens that were accepted.
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Why a session stopped producing tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The token budget was reached.
    Budget,
    /// An EOS id was produced (it is part of the output).
    Eos,
    /// The target's context cap was reached.
    ContextCap,
}
