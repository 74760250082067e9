//! The engine against a toy target whose next token depends on the whole history (a running
//! hash, like a recurrent state) and whose rollback is snapshot + replay, with a drafter that
//! knows the rule and errs where told. Checks: spec == plain greedy, the protocol (verify at
//! the committed length, one commit per verify, drafter in step with the target), counting,
//! EOS, the context cap and bursts; independent of any model code.

use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostWeight, Weight, WeightFormat};
use dflash_spec_round::{
    generate, plain_greedy, DraftOptions, Drafter, Forward, Result, RollbackArm, Session,
    SpecConfig, SpecError, StopReason, Target, TargetInfo,
};
use proptest::prelude::*;

const V: u32 = 37;

fn step(state: u64, tok: u32) -> u64 {
    (state ^ tok as u64)
        .wrapping_mul(0x100_0000_01b3)
        .rotate_left(17)
}

fn next_of(state: u64) -> u32 {
    ((state >> 20) % V as u64) as u32
}

struct Toy {
    cap: usize,
    committed: Vec<u32>,
    state: u64,
    pending: Option<(u64, Vec<u32>)>,
    lm: Weight<Cpu>,
    verifies: usize,
}

impl Toy {
    fn new(be: &Cpu, cap: usize) -> Toy {
        let lm = be
            .upload_weight(
                &HostWeight::from_f32(
                    "lm",
                    V as usize,
                    2,
                    &vec![0.0; 2 * V as usize],
                    WeightFormat::F32,
                )
                .unwrap(),
            )
            .unwrap();
        Toy {
            cap,
            committed: vec![],
            state: 0,
            pending: None,
            lm,
            verifies: 0,
        }
    }
    fn run(&mut self, be: &Cpu, tokens: &[u32], taps: &[i32]) -> Result<Forward<Cpu>> {
        let mut am = Vec::new();
        let mut tv = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            self.state = step(self.state, t);
            am.push(next_of(self.state));
            for _ in taps {
                tv.push(t as f32);
                tv.push((self.committed.len() + i) as f32);
            }
        }
        Ok(Forward {
            argmax: am,
            logits: None,
            taps: if taps.is_empty() {
                None
            } else {
                Some(be.upload(&tv)?)
            },
        })
    }
}

impl Target<Cpu> for Toy {
    fn info(&self) -> TargetInfo {
        TargetInfo {
            n_layers: 4,
            hidden: 2,
            vocab: V as usize,
            ctx_cap: self.cap,
        }
    }
    fn pos(&self) -> usize {
        self.committed.len()
    }
    fn set_rollback(&mut self, _arm: RollbackArm) {}
    fn prime(&mut self, be: &Cpu, prompt: &[u32], taps: &[i32]) -> Result<Forward<Cpu>> {
        self.committed.clear();
        self.state = 0;
        self.pending = None;
        let mut f = self.run(be, prompt, taps)?;
        self.committed.extend_from_slice(prompt);
        f.argmax = vec![*f.argmax.last().unwrap()];
        Ok(f)
    }
    fn verify(
        &mut self,
        be: &Cpu,
        tokens: &[u32],
        start: usize,
        taps: &[i32],
        _l: bool,
    ) -> Result<Forward<Cpu>> {
        if start != self.committed.len() || self.pending.is_some() {
            return Err(SpecError::Protocol(
                "verify off the committed length".into(),
            ));
        }
        if start + tokens.len() > self.cap {
            return Err(SpecError::ContextCap {
                what: "verify",
                needed: start + tokens.len(),
                cap: self.cap,
            });
        }
        self.verifies += 1;
        self.pending = Some((self.state, tokens.to_vec()));
        self.run(be, tokens, taps)
    }
    fn commit(&mut self, _be: &Cpu, keep: usize) -> Result<()> {
        let (snap, toks) = self
            .pending
            .take()
            .ok_or_else(|| SpecError::Protocol("commit without verify".into()))?;
        if keep == 0 || keep > toks.len() {
            return Err(SpecError::Protocol("bad keep".into()));
        }
        // snapshot + replay of the kept prefix
        self.state = snap;
        for &t in &toks[..keep] {
            self.state = step(self.state, t);
        }
        self.committed.extend_from_slice(&toks[..keep]);
        Ok(())
    }
    fn embed_rows(
        &self,
        _be: &Cpu,
        _ids: &[u32],
        _out: &mut Vec<f32>,
    ) -> dflash_backend::Result<()> {
        Ok(())
    }
    fn lm_head(&self) -> &Weight<Cpu> {
        &self.lm
    }
}

/// Knows the rule: replays the committed history from the ingested taps (token ids sit in
/// the taps) and drafts the true continuation, wrong where `bad(round, i)`.
struct Oracle {
    n: usize,
    hist: Vec<u32>,
    bad: fn(usize, usize) -> bool,
    rounds: usize,
    taps: Vec<i32>,
}

impl Drafter<Cpu> for Oracle {
    fn tap_layers(&self) -> &[i32] {
        &self.taps
    }
    fn hidden(&self) -> usize {
        2
    }
    fn n_drafts(&self) -> usize {
        self.n
    }
    fn reset(&mut self, _be: &Cpu, _cap: usize) -> Result<()> {
        self.hist.clear();
        self.rounds = 0;
        Ok(())
    }
    fn ctx_len(&self) -> usize {
        self.hist.len()
    }
    fn ingest(&mut self, be: &Cpu, taps: &Vec<f32>, rows: usize) -> Result<()> {
        let v = be.download(taps)?;
        assert_eq!(v.len(), rows * 2 * self.taps.len());
        for r in 0..rows {
            let row = &v[r * 2 * self.taps.len()..];
            assert_eq!(row[1] as usize, self.hist.len(), "tap row position");
            self.hist.push(row[0] as u32);
        }
        Ok(())
    }
    fn draft(
        &mut self,
        _be: &Cpu,
        _t: &dyn Target<Cpu>,
        anchor: u32,
        pos: usize,
        n: usize,
        _o: DraftOptions,
    ) -> Result<Vec<u32>> {
        assert_eq!(pos, self.hist.len());
        assert!(n >= 1 && n <= self.n);
        let mut s = self.hist.iter().fold(0, |s, &t| step(s, t));
        let mut prev = anchor;
        let r = self.rounds;
        self.rounds += 1;
        Ok((0..self.n)
            .map(|i| {
                s = step(s, prev);
                let t = next_of(s);
                prev = t;
                if (self.bad)(r, i) {
                    (t + 1) % V
                } else {
                    t
                }
            })
            .collect())
    }
}

fn bads() -> [fn(usize, usize) -> bool; 4] {
    [
        |_, _| false,
        |_, _| true,
        |r, _| r % 2 == 1,
        |r, i| (r * 7 + i * 3) % 5 == 0,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn spec_equals_plain_on_a_history_dependent_toy(
        prompt in prop::collection::vec(0u32..V, 1..20),
        n in 1usize..16,
        cap_sel in 0usize..16,
        adaptive in any::<bool>(),
        max_new in 0usize..80,
        eos in prop::option::of(0u32..V),
        bad in 0usize..4,
        ctx_extra in 0usize..100,
        stats in any::<bool>(),
        multiple in 1usize..9,
    ) {
        let be = Cpu::new();
        let cap = prompt.len() + n + 1 + ctx_extra;
        let mut t = Toy::new(&be, cap);
        let eos: Vec<u32> = eos.into_iter().collect();
        let want = plain_greedy(&be, &mut t, &prompt, max_new, &eos).unwrap();
        t.verifies = 0;
        let mut d = Oracle { n, hist: vec![], bad: bads()[bad], rounds: 0, taps: vec![0, 2] };
        let verify_cap = if cap_sel == 0 { None } else { Some(2 + cap_sel % n.max(1)) }.map(|v| v.min(n + 1));
        let cfg = SpecConfig { verify_cap, adaptive, stats, verify_multiple: multiple, ..SpecConfig::default() };
        let (got, st) = generate(&be, &mut t, &mut d, cfg, &prompt, max_new, &eos).unwrap();
        prop_assert_eq!(&got, &want);
        match got.iter().position(|x| eos.contains(x)) {
            Some(i) => prop_assert_eq!(got.len(), i + 1),
            None => prop_assert_eq!(got.len(), max_new.min(cap - prompt.len() + 1)),
        }
        if bad == 0 && max_new > 2 && n > 0 && eos.is_empty() && cap > prompt.len() + 3 {
            prop_assert!(st.accepted > 0);
        }
        if bad == 1 {
            prop_assert_eq!(st.accepted, 0);
        }
        prop_assert_eq!(d.hist.len(), t.pos());
        prop_assert_eq!(&d.hist[..], &t.committed[..]);
        prop_assert_eq!(st.rounds, t.verifies);
        prop_assert_eq!(st.committed, st.rounds + st.accepted);
        if !stats {
            prop_assert_eq!(st.verify + st.draft + st.rollback + st.ingest, std::time::Duration::ZERO);
        } else if st.rounds > 0 {
            prop_assert!(st.verify > std::time::Duration::ZERO);
        }
    }
}

#[test]
fn stop_reasons_and_bursts() {
    let be = Cpu::new();
    let prompt = [3u32, 1, 4];
    let mut t = Toy::new(&be, 40);
    let want = plain_greedy(&be, &mut t, &prompt, 1000, &[]).unwrap();
    assert_eq!(want.len(), 40 - 3 + 1);
    let mut d = Oracle {
        n: 5,
        hist: vec![],
        bad: |r, _| r % 3 == 2,
        rounds: 0,
        taps: vec![1],
    };
    let mut s = Session::new(
        &be,
        &mut t,
        &mut d,
        SpecConfig::default(),
        &prompt,
        &[],
        None,
    )
    .unwrap();
    let mut got = Vec::new();
    for k in [1usize, 0, 2, 9, 3].iter().cycle() {
        got.extend(s.burst(*k).unwrap());
        if s.finished() {
            break;
        }
    }
    assert_eq!(s.stop_reason(), Some(StopReason::ContextCap));
    assert_eq!(got, want);
    let eos = want[7];
    let mut d = Oracle {
        n: 5,
        hist: vec![],
        bad: |_, _| false,
        rounds: 0,
        taps: vec![1],
    };
    let mut s = Session::new(
        &be,
        &mut t,
        &mut d,
        SpecConfig::default(),
        &prompt,
        &[eos],
        Some(30),
    )
    .unwrap();
    let out = s.burst(100).unwrap();
    assert_eq!(s.stop_reason(), Some(StopReason::Eos));
    let first = want.iter().position(|&x| x == eos).unwrap();
    assert_eq!(out, want[..=first]);
    assert!(s.finished());
    assert!(s.burst(5).unwrap().is_empty());
}

/// Records how many drafts the engine asks for.
struct Asked<'a>(&'a mut Oracle, Vec<usize>);

impl Drafter<Cpu> for Asked<'_> {
    fn tap_layers(&self) -> &[i32] {
        self.0.tap_layers()
    }
    fn hidden(&self) -> usize {
        self.0.hidden()
    }
    fn n_drafts(&self) -> usize {
        self.0.n_drafts()
    }
    fn reset(&mut self, be: &Cpu, cap: usize) -> Result<()> {
        self.0.reset(be, cap)
    }
    fn ctx_len(&self) -> usize {
        self.0.ctx_len()
    }
    fn ingest(&mut self, be: &Cpu, taps: &Vec<f32>, rows: usize) -> Result<()> {
        self.0.ingest(be, taps, rows)
    }
    fn draft(
        &mut self,
        be: &Cpu,
        t: &dyn Target<Cpu>,
        anchor: u32,
        pos: usize,
        n: usize,
        o: DraftOptions,
    ) -> Result<Vec<u32>> {
        self.1.push(n);
        self.0.draft(be, t, anchor, pos, n, o)
    }
}

/// `verify_multiple` rounds the adaptive width (and the drafts asked for) up: with a drafter
/// that is always wrong (m = 0), the widths are 4 instead of 3 after round 1, except where
/// the budget clips them; the stream stays plain greedy.
#[test]
fn verify_multiple_rounds_the_width_up() {
    let be = Cpu::new();
    let prompt = [3u32, 1, 4];
    for (multiple, cap, want_drafted, want_asked) in [
        // round 1: 16 rows (the cap), 15 asked; then m = 0 every round
        (
            1usize,
            None,
            15 + 27 * 2 + 1,
            vec![15]
                .into_iter()
                .chain(std::iter::repeat_n(2, 27))
                .chain([1])
                .collect::<Vec<_>>(),
        ),
        (
            4,
            None,
            15 + 26 * 3 + 2 + 1,
            vec![15]
                .into_iter()
                .chain(std::iter::repeat_n(4, 26))
                .chain([4, 4])
                .collect(),
        ),
        // rounded widths never pass the cap; asked never passes the block
        (
            4,
            Some(3),
            2 + 27 * 2 + 1,
            vec![15]
                .into_iter()
                .chain(std::iter::repeat_n(4, 28))
                .collect(),
        ),
        (
            8,
            Some(16),
            15 + 22 * 7 + (6 + 5 + 4 + 3 + 2 + 1),
            vec![15]
                .into_iter()
                .chain(std::iter::repeat_n(8, 28))
                .collect(),
        ),
    ] {
        let mut t = Toy::new(&be, 200);
        let want = plain_greedy(&be, &mut t, &prompt, 30, &[]).unwrap();
        let mut o = Oracle {
            n: 15,
            hist: vec![],
            bad: |_, _| true,
            rounds: 0,
            taps: vec![1],
        };
        let mut d = Asked(&mut o, Vec::new());
        let cfg = SpecConfig {
            verify_cap: cap,
            verify_multiple: multiple,
            ..SpecConfig::default()
        };
        let (got, st) = generate(&be, &mut t, &mut d, cfg, &prompt, 30, &[]).unwrap();
        assert_eq!(got, want);
        assert_eq!(st.rounds, 29, "multiple {multiple} cap {cap:?}");
        assert_eq!(st.accepted, 0);
        assert_eq!(st.drafted, want_drafted, "multiple {multiple} cap {cap:?}");
        assert_eq!(d.1, want_asked, "multiple {multiple} cap {cap:?}");
    }
}
