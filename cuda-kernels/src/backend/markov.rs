//! The DSpark Markov chain on the CUDA backend (kernels/reduce.cu, and the tensor-core step in
//! kernels/matmul.cu): per step, logits[k] += W2 . W1[previous token] and the argmax, the
//! previous token and the drafts kept on the device (graph-capturable). A Q8_0A8 W2 runs the
//! whole chain as one persistent cooperative launch; the other formats two launches per step.

use cudarc::driver::{CudaFunction, CudaSlice};
use dflash_backend::{BackendError, Weight};

use super::{
    am_final_threads, cfg, check, ensure, i32_of, internal, lock, raw_weight, Cuda, CudaBuf,
    CudaWeightBuf, Kernel, RawArgs, Result, Scratch,
};
use crate::error::dev;

/// Rows per block iteration of the bf16 / f16 / f32 / q8_0 / q4_0 Markov step kernels:
/// `MARKOV_R` (reduce.cu) rows for each of their 8 warps. A block's row range is a multiple
/// of it.
const MARKOV_ROWS_ITER: usize = 4 * 8;
/// Rows per block of the Q8_0A8 Markov step (`markov_step_a8`; a multiple of its 16-row tiles).
const MARKOV_CHUNK_A8: usize = 256;

/// Dynamic shared memory of `markov_chain_a8p` keeping `kt` W2 tiles: emb (rank floats), its
/// mma fragments (rank / 32 x 512 bytes), the tiles (rank / 32 blocks of 512 + 32 bytes each).
fn markov_persistent_smem(rank: usize, kt: usize) -> usize {
    rank * 4 + rank / 32 * 512 + kt * (rank / 32) * 544
}

impl Cuda {
    /// Whether the Markov chain over a bf16 (fragment order), q8_0 or q4_0 W2 with rank % 32 ==
    /// 0 runs its steps on the tensor cores (the default) or with the lane-contiguous CUDA-core
    /// kernels (`false`). Within f32 rounding of each other (another summation order), the
    /// argmax rule the same; a benchmark knob.
    pub fn set_markov_mma(&self, on: bool) {
        *lock(&self.markov_mma) = on;
    }

    /// Whether the Markov chain over a Q8_0A8 W2 runs as one persistent cooperative launch
    /// (the default: one block per multiprocessor keeps the head of its W2 rows in shared
    /// memory for every step, the steps meet at a grid barrier) or as two launches per step
    /// (`false`). The same bits either way; a benchmark knob.
    pub fn set_markov_persistent(&self, on: bool) {
        *lock(&self.markov_persistent) = on;
    }

    /// The Markov chain with the previous token and the results on the device
    /// (graph-capturable): `prev[0]` is the starting token and ends as the last draft;
    /// `toks[0..n]` receives the drafts. A Q8_0A8 W2 runs the whole chain as one persistent
    /// cooperative launch where it fits ([`Cuda::set_markov_persistent`]); otherwise two
    /// launches per step (programmatic dependent launches for a Q8_0A8 W2): the step on the
    /// tensor cores for bf16 / q8_0 / q4_0 with rank % 32 == 0 ([`Cuda::set_markov_mma`]), on
    /// the CUDA cores for the other formats and ranks.
    #[allow(clippy::too_many_arguments)]
    pub fn markov_chain_dev(
        &self,
        logits: &mut CudaBuf,
        n: usize,
        vocab: usize,
        prev: &mut CudaSlice<u32>,
        toks: &mut CudaSlice<u32>,
        w1: &Weight<Self>,
        w2: &Weight<Self>,
    ) -> Result<()> {
        check("markov_chain", "logits", n * vocab, logits.len)?;
        check("markov_chain", "toks", n, toks.len())?;
        if let Some(w) = [w1, w2]
            .into_iter()
            .find(|w| matches!(w.buf, CudaWeightBuf::Q4A8 { .. }))
        {
            // No Markov kernel reads the Q4_0A8 layout (the loader stores the Markov head in
            // bf16 or f32; a Q4_0A8 copy is a caller's choice this backend does not run).
            return Err(BackendError::Invalid {
                op: "markov_chain",
                msg: format!("{}: Q4_0A8 Markov weights are not supported on CUDA (use Q8_0A8, q4_0 or bf16)", w.name),
            });
        }
        if w1.rows != vocab || w2.rows != vocab || w1.cols != w2.cols {
            return Err(BackendError::Invalid {
                op: "markov_chain",
                msg: format!(
                    "w1 {:?} and w2 {:?} must both be [vocab = {vocab}, rank]",
                    (w1.rows, w1.cols),
                    (w2.rows, w2.cols)
                ),
            });
        }
        let rank = i32_of("markov_chain", "rank", w1.cols)?;
        let vocab_i = i32_of("markov_chain", "vocab", vocab)?;
        check("markov_chain", "prev", 1, prev.len())?;
        // Q8_0A8 W2 (rank a multiple of 32, as the format requires): the persistent chain, or
        // one warp per 16-row tile, 256 rows per block; other formats: 4 rows per warp
        // iteration, the vocabulary over one wave of blocks (below).
        let a8 = matches!(w2.buf, CudaWeightBuf::Q8A8 { .. });
        if a8 && n > 0 && *lock(&self.markov_persistent) {
            if let Some(kt) = self.markov_persistent_tiles(vocab, w2.cols)? {
                return self.markov_chain_persistent(logits, n, vocab, prev, toks, w1, w2, kt);
            }
        }
        // Lane-contiguous W2 loads where rank % 8 == 0 (row segments aligned). DSpark step on
        // the H200 (graph ms, 8B / 27B at ctx 512), scalar -> contiguous loads: bf16 2.570 ->
        // 2.349 / 3.390 -> 3.182, q4_0 2.949 -> 2.531 / 3.793 -> 3.320; q8_0 2.692 -> 2.737 /
        // 3.650 -> 3.876 then, but with one wave of blocks and its own kernel (nineteenth
        // session, reduce.cu) 2.002 -> 1.754 / 3.117 -> 2.721.
        let v = w2.cols.is_multiple_of(8);
        // The scalar kernel does not read the fragment order (K % 32 == 0 there, so v holds).
        if !v && matches!(w2.buf, CudaWeightBuf::Bf16P(_)) {
            return Err(internal());
        }
        // bf16 (fragment order), q8_0 and q4_0 with rank % 32 == 0: the tensor-core step
        // (matmul.cu, markov_step_mma_*), 16-row tiles. DSpark step on the H200 (graph ms, 8B
        // / 27B at ctx 512, 05:53 lease, two rounds), the lane-contiguous kernels -> it: bf16
        // 1.643 -> 1.608 / 2.471 -> 2.382, q8_0 1.781 -> 1.623 / 2.731 -> 2.494, q4_0 1.666 ->
        // 1.455 / 2.489 -> 2.108 (ncu, q4_0 lanes: 38 us per Markov step, issue-bound).
        let mma = match (
            &w2.buf,
            w2.cols.is_multiple_of(32) && *lock(&self.markov_mma),
        ) {
            (CudaWeightBuf::Bf16P(_), true) => Some(Kernel::MarkovStepMmaBf16P),
            (CudaWeightBuf::Q8_0 { .. }, true) => Some(Kernel::MarkovStepMmaQ8_0),
            (CudaWeightBuf::Q4_0 { .. }, true) => Some(Kernel::MarkovStepMmaQ4_0),
            _ => None,
        };
        // Dynamic shared memory: emb, then for markov_step_a8 its mma fragments (rank / 32 x
        // 512 bytes) and per warp (8) the first tile's MARKOV_PRE (8) blocks of codes (512
        // bytes) and scales (32 bytes), copied before the grid dependency wait; for the
        // tensor-core step emb's B fragments (rank / 32 x 32 x 16 bytes).
        let smem1 = w1.cols * 4
            + if a8 {
                w1.cols / 32 * 512 + 8 * 8 * (512 + 32)
            } else if mma.is_some() {
                w1.cols * 16
            } else {
                0
            };
        let vq = v
            && matches!(
                w2.buf,
                CudaWeightBuf::Q8_0 { .. } | CudaWeightBuf::Q4_0 { .. }
            );
        let kernel = if a8 {
            Kernel::MarkovStepA8
        } else if let Some(k) = mma {
            k
        } else if vq {
            Kernel::MarkovStepVQ
        } else if v {
            Kernel::MarkovStepV
        } else {
            Kernel::MarkovStep
        };
        let f1 = self.func_smem(kernel, smem1)?;
        // Rows per block. The other formats' step spreads the vocabulary over one wave of
        // resident blocks, a multiple of the warps' rows per iteration each: every row's
        // arithmetic is one warp's whatever the range, and the argmax winner does not depend
        // on how the rows are grouped (am_better orders the candidates totally), so the bits
        // do not depend on it. (Until the nineteenth session 1024 rows per block: 149 blocks
        // at 8B, each warp 32 dependent iterations of 4 rows, so the step waited on
        // round trips with ~18 KB in flight per multiprocessor.)
        let chunk_rows = if a8 {
            MARKOV_CHUNK_A8
        } else {
            let per_sm = self.markov_occupancy(&f1, kernel, smem1)?;
            vocab
                .div_ceil(per_sm * self.num_sms.max(1))
                .next_multiple_of(if mma.is_some() { 16 } else { MARKOV_ROWS_ITER })
        };
        let nb = vocab.div_ceil(chunk_rows);
        let mut s = lock(&self.scratch);
        ensure(&self.stream, &mut s.am_v, nb).map_err(dev)?;
        ensure(&self.stream, &mut s.am_i, nb).map_err(dev)?;
        let Scratch { am_v, am_i, .. } = &mut *s;
        let (am_v, am_i) = (
            am_v.as_mut().ok_or_else(internal)?,
            am_i.as_mut().ok_or_else(internal)?,
        );
        let f2 = self.func(Kernel::ArgmaxFinal)?;
        let (fmt1, fmt2, chunk, nb_i) = (
            w1.buf.fmt_code(),
            w2.buf.fmt_code(),
            i32_of("markov_chain", "rows per block", chunk_rows)?,
            nb as i32,
        );
        // Programmatic dependent launches for a Q8_0A8 W2 (with the Q8_0A8 matmuls,
        // `set_a8_pdl`): each step and each final wait for their inputs first thing, so the
        // launch overlaps the kernel before (same bits). H200, DSpark step at ctx 512 (06:55
        // lease, two rounds): q8_0a8 8B 0.997 -> 0.976 ms, 27B 1.568 -> 1.548; bf16 measured
        // slower with them (2.319 -> 2.362, 3.133 -> 3.179), so the other formats launch
        // normally (the kernels' griddep instructions are then no-ops).
        let pdl = *lock(&self.a8_pdl) && a8;
        let st = &*self.stream;
        let (threads_f, smem1) = (am_final_threads(nb), smem1 as u32);

        for k in 0..n {
            let mut row = logits.data.slice_mut(k * vocab..(k + 1) * vocab);
            let mut a = RawArgs::default();
            a.i32(fmt1);
            raw_weight(&mut a, &w1.buf, st);
            a.i32(fmt2);
            raw_weight(&mut a, &w2.buf, st);
            a.i32(rank)
                .i32(vocab_i)
                .dptr(&*prev, st)
                .dptr_mut(&mut row, st)
                .i32(chunk)
                .dptr_mut(&mut *am_v, st)
                .dptr_mut(&mut *am_i, st);
            // SAFETY: markov_step* parameters in order (fmt1, w1 q, w1 d, fmt2, w2 q, w2 d,
            // rank, vocab, prev, logits, chunk, pv, pi).
            unsafe { a.launch(st, &f1, cfg((nb as u32, 1, 1), 256, smem1), pdl) }?;
            let mut tk = toks.slice_mut(k..k + 1);
            let mut a = RawArgs::default();
            a.dptr(&*am_v, st)
                .dptr(&*am_i, st)
                .i32(nb_i)
                .dptr_mut(&mut tk, st)
                .dptr_mut(&mut *prev, st);
            // SAFETY: argmax_final's parameters in order (pv, pi, n_chunks, out, prev).
            unsafe { a.launch(st, &f2, cfg((1, 1, 1), threads_f, 0), pdl) }?;
        }
        Ok(())
    }

    /// Resident 256-thread blocks per multiprocessor of a bf16 / q8_0 / q4_0 Markov step
    /// kernel `k` (its function `f`) with `smem` bytes of dynamic shared memory.
    fn markov_occupancy(&self, f: &CudaFunction, k: Kernel, smem: usize) -> Result<usize> {
        if let Some(&b) = lock(&self.markov_occ).get(&(k, smem)) {
            return Ok(b);
        }
        let b = f
            .occupancy_max_active_blocks_per_multiprocessor(256, smem, None)
            .map_err(dev)?
            .max(1) as usize;
        lock(&self.markov_occ).insert((k, smem), b);
        Ok(b)
    }

    /// W2 tiles per block the persistent Markov chain keeps in shared memory, or None where
    /// its one 512-thread block per multiprocessor does not fit (then the step kernels run).
    fn markov_persistent_tiles(&self, vocab: usize, rank: usize) -> Result<Option<usize>> {
        if let Some(&kt) = lock(&self.markov_fit).get(&(vocab, rank)) {
            return Ok(kt);
        }
        let kt = self.markov_fit_of(vocab, rank)?;
        lock(&self.markov_fit).insert((vocab, rank), kt);
        Ok(kt)
    }

    fn markov_fit_of(&self, vocab: usize, rank: usize) -> Result<Option<usize>> {
        let kb = rank / 32;
        let per_block = (vocab.div_ceil(16)).div_ceil(self.num_sms.max(1));
        // 256 bytes of static shared memory (the block reduction) and 1 KiB the driver reserves.
        let fixed = markov_persistent_smem(rank, 0) + 256 + 1024;
        if kb == 0 || self.smem.block < fixed {
            return Ok(None);
        }
        let kt = ((self.smem.block - fixed) / (kb * 544)).min(per_block);
        let smem = markov_persistent_smem(rank, kt);
        let f = self.func_smem(Kernel::MarkovChainA8P, smem)?;
        // Every block resident at once (the cooperative launch would fail otherwise).
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(512, smem, None)
            .map_err(dev)?;
        Ok((per_sm >= 1).then_some(kt))
    }

    /// The Q8_0A8 Markov chain as one cooperative launch (`markov_chain_a8p`): `kt` W2 tiles
    /// per block in shared memory.
    #[allow(clippy::too_many_arguments)]
    fn markov_chain_persistent(
        &self,
        logits: &mut CudaBuf,
        n: usize,
        vocab: usize,
        prev: &mut CudaSlice<u32>,
        toks: &mut CudaSlice<u32>,
        w1: &Weight<Self>,
        w2: &Weight<Self>,
        kt: usize,
    ) -> Result<()> {
        let rank = w1.cols;
        let smem = markov_persistent_smem(rank, kt);
        let f = self.func_smem(Kernel::MarkovChainA8P, smem)?;
        let b = self.num_sms;
        let mut s = lock(&self.scratch);
        ensure(&self.stream, &mut s.am_v, 2 * b).map_err(dev)?;
        ensure(&self.stream, &mut s.am_i, 2 * b).map_err(dev)?;
        ensure(&self.stream, &mut s.mk_bar, 2).map_err(dev)?;
        let Scratch {
            am_v, am_i, mk_bar, ..
        } = &mut *s;
        let (am_v, am_i, bar) = (
            am_v.as_mut().ok_or_else(internal)?,
            am_i.as_mut().ok_or_else(internal)?,
            mk_bar.as_mut().ok_or_else(internal)?,
        );
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.i32(w1.buf.fmt_code());
        raw_weight(&mut a, &w1.buf, st);
        raw_weight(&mut a, &w2.buf, st);
        a.i32(i32_of("markov_chain", "rank", rank)?)
            .i32(i32_of("markov_chain", "vocab", vocab)?)
            .i32(i32_of("markov_chain", "n", n)?)
            .dptr_mut(&mut *prev, st)
            .dptr_mut(&mut logits.data, st)
            .dptr_mut(&mut *toks, st)
            .dptr_mut(&mut *am_v, st)
            .dptr_mut(&mut *am_i, st)
            .dptr_mut(&mut *bar, st)
            .i32(kt as i32);
        // SAFETY: markov_chain_a8p's parameters in order (fmt1, w1 q, w1 d, w2 q, w2 d, rank,
        // vocab, n, prev, logits, toks, pv, pi, bar, kt); pv / pi hold 2 x num_sms values, bar
        // 2 zeroed words; a cooperative launch of num_sms blocks (one per multiprocessor fits:
        // markov_persistent_tiles checked the occupancy).
        unsafe { a.launch_attrs(st, &f, cfg((b as u32, 1, 1), 512, smem as u32), false, true) }
    }
}
