//! The Gate arm is not vacuous: over a backend whose per-token stash is off by one ulp (a
//! broken kernel), Gate reports the difference (naming the layer and the state) while Stash
//! silently restores the wrong state. Over the correct CPU backend Gate passes (the rollback
//! and exactness tests run it everywhere).

mod hybrid_common;

use dflash_backend::cpu::Cpu;
use dflash_backend::{AttnParams, Backend, DeltaParams, HostWeight, Result, RopeSpec, Weight};
use dflash_spec_round::{RollbackArm, SpecError, Target};
use dflash_targets::hybrid::{HybridTarget, TensorNames};
use dflash_targets::LoadOptions;
use hybrid_common::{random_tensors, tiny_config};

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    ConvStash,
    RecurrentStash,
}

/// The CPU backend with one fault: every stashed state but the last of a multi-token call
/// gets its first value nudged by one ulp.
struct Faulty {
    cpu: Cpu,
    fault: Fault,
}

fn nudge(stash: &mut [f32], t: usize) {
    let per = stash.len() / t;
    for row in 0..t.saturating_sub(1) {
        let x = &mut stash[row * per];
        *x = f32::from_bits(x.to_bits() ^ 1);
    }
}

impl Backend for Faulty {
    type Buf = Vec<f32>;
    type WeightBuf = Weight<Cpu>;

    fn name(&self) -> String {
        "faulty-cpu".into()
    }
    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        self.cpu.zeros(len)
    }
    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        self.cpu.upload(host)
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        self.cpu.download(buf)
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        self.cpu.len(buf)
    }
    fn upload_weight(&self, w: &HostWeight) -> Result<Weight<Self>> {
        let inner = self.cpu.upload_weight(w)?;
        Ok(Weight {
            name: inner.name.clone(),
            format: inner.format,
            rows: inner.rows,
            cols: inner.cols,
            buf: inner,
        })
    }
    fn copy2d(
        &self,
        src: &Vec<f32>,
        src_off: usize,
        src_stride: usize,
        dst: &mut Vec<f32>,
        dst_off: usize,
        dst_stride: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.cpu.copy2d(
            src, src_off, src_stride, dst, dst_off, dst_stride, rows, cols,
        )
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn matmul(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: &Weight<Self>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.cpu.matmul(x, rows, &w.buf, out)
    }
    fn gather_rows(&self, table: &Weight<Self>, ids: &[u32], out: &mut Vec<f32>) -> Result<()> {
        self.cpu.gather_rows(&table.buf, ids, out)
    }
    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.cpu.rms_norm(x, w, dim, eps, out)
    }
    fn rms_norm_gated(
        &self,
        x: &Vec<f32>,
        z: &Vec<f32>,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.cpu.rms_norm_gated(x, z, w, dim, eps, out)
    }
    fn rope(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        spec: &RopeSpec,
    ) -> Result<()> {
        self.cpu.rope(x, rows, n_heads, head_dim, pos0, spec)
    }
    fn attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        p: &AttnParams,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.cpu.attention(q, k, v, p, out)
    }
    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, out: &mut Vec<f32>) -> Result<()> {
        self.cpu.silu_mul(gate, up, out)
    }
    fn add_assign(
        &self,
        dst: &mut Vec<f32>,
        dst_off: usize,
        src: &Vec<f32>,
        len: usize,
    ) -> Result<()> {
        self.cpu.add_assign(dst, dst_off, src, len)
    }
    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<()> {
        self.cpu.scale(x, s)
    }
    fn mul_sigmoid(&self, x: &mut Vec<f32>, gate: &Vec<f32>) -> Result<()> {
        self.cpu.mul_sigmoid(x, gate)
    }
    fn argmax_rows(&self, x: &Vec<f32>, row0: usize, rows: usize, cols: usize) -> Result<Vec<u32>> {
        self.cpu.argmax_rows(x, row0, rows, cols)
    }
    fn causal_conv1d(
        &self,
        x: &Vec<f32>,
        t: usize,
        channels: usize,
        kernel: usize,
        w: &Vec<f32>,
        state: &mut Vec<f32>,
        out: &mut Vec<f32>,
        stash: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        match stash {
            Some(s) => {
                self.cpu
                    .causal_conv1d(x, t, channels, kernel, w, state, out, Some(&mut *s))?;
                if self.fault == Fault::ConvStash {
                    nudge(s, t);
                }
                Ok(())
            }
            None => self
                .cpu
                .causal_conv1d(x, t, channels, kernel, w, state, out, None),
        }
    }
    fn gdn_gates(
        &self,
        a: &Vec<f32>,
        b: &Vec<f32>,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
        n_heads: usize,
        g: &mut Vec<f32>,
        beta: &mut Vec<f32>,
    ) -> Result<()> {
        self.cpu.gdn_gates(a, b, a_log, dt_bias, n_heads, g, beta)
    }
    fn gated_delta_rule(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        p: &DeltaParams,
        state: &mut Vec<f32>,
        out: &mut Vec<f32>,
        stash: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        match stash {
            Some(s) => {
                self.cpu
                    .gated_delta_rule(q, k, v, g, beta, p, state, out, Some(&mut *s))?;
                if self.fault == Fault::RecurrentStash {
                    nudge(s, p.t);
                }
                Ok(())
            }
            None => self
                .cpu
                .gated_delta_rule(q, k, v, g, beta, p, state, out, None),
        }
    }
}

fn target(be: &Faulty, arm: RollbackArm) -> HybridTarget<Faulty> {
    let cfg = tiny_config(40, 32, "flfl", false);
    let src = random_tensors(&cfg, 3, 1.0);
    let names = TensorNames {
        prefix: "model.".into(),
        lm_head: "lm_head.weight".into(),
    };
    let opts = LoadOptions {
        precision: None,
        ctx_cap: Some(64),
        ..LoadOptions::default()
    };
    let mut t = HybridTarget::from_source(be, cfg, &src, &names, opts).unwrap();
    t.set_rollback(arm);
    t
}

#[test]
fn gate_reports_a_broken_stash() {
    for (fault, what) in [
        (Fault::ConvStash, "conv state"),
        (Fault::RecurrentStash, "recurrent state"),
    ] {
        let be = Faulty {
            cpu: Cpu::new(),
            fault,
        };
        let mut t = target(&be, RollbackArm::Gate);
        t.prime(&be, &[1, 2, 3, 4], &[]).unwrap();
        // A full accept needs no restore: the stash is not read and Gate agrees.
        t.verify(&be, &[5, 6, 7], 4, &[], false).unwrap();
        t.commit(&be, 3).unwrap();
        // A partial accept restores a nudged state: Gate must say which layer and state.
        t.verify(&be, &[8, 9, 10, 11], 7, &[], false).unwrap();
        match t.commit(&be, 2) {
            Err(SpecError::Gate(msg)) => {
                assert!(msg.contains(what) && msg.contains("layer 1"), "{msg}");
            }
            other => panic!("expected a gate error, got {:?}", other.err()),
        }

        // Stash over the same backend restores the nudged state without noticing; Replay
        // does not read the stash and stays right.
        let mut s = target(&be, RollbackArm::Stash);
        let mut r = target(&be, RollbackArm::Replay);
        for x in [&mut s, &mut r] {
            x.prime(&be, &[1, 2, 3, 4], &[]).unwrap();
            x.verify(&be, &[8, 9, 10, 11], 4, &[], false).unwrap();
            x.commit(&be, 2).unwrap();
        }
        let mut fresh = target(&be, RollbackArm::Stash);
        fresh.prime(&be, &[1, 2, 3, 4, 8, 9], &[]).unwrap();
        let st = |x: &HybridTarget<Faulty>| x.linear_states(&be).unwrap();
        assert!(st(&r) == st(&fresh), "replay must not depend on the stash");
        assert!(
            st(&s) != st(&fresh),
            "the nudged stash must show in the Stash arm"
        );
    }
}
