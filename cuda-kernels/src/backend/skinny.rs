//! The skinny matmul of the CUDA backend (kernels/matmul.cu, `skinny_*`): bf16 / q8_0 / q4_0
//! weights times 1-16 rows of x on the bf16 tensor cores (x split into bf16 hi + lo), K split
//! across blocks with the last block of a column tile adding the partial sums in order; several
//! matrices of one x in one launch (`matmul_many`), and the producers (norms, the SiLU product)
//! that write its x. A row's bits never depend on how many rows share the call.

use super::*;

/// Output features per block of the tensor-core skinny matmul (`16 * R` in matmul.cu, R = 2;
/// twice that for the R = 4 kernels of very tall matrices).
const SKINNY_TILE_ROWS: usize = 32;

/// Matrices of one x per tensor-core skinny launch at most: 1-3 through the `SKINNY` kernels
/// of matmul.cu, exactly 4 through their `SKINNY4` twins (`skinny4_*`): a Gated DeltaNet
/// layer's q / k / v, z, b and a, a gated attention layer's q, gate, k and v in one launch.
/// Four, not three: the fourth matrix alone (the 48-row `a`, the 1024-row `v`) was a launch of
/// 16-256 split blocks that took 13-16 us for 0.5-11 MB (ncu, 27B shape, H100, fifty-fourth
/// session), and inside the others' launch it is one more column tile or 32.
pub(super) const SKINNY_MATS: usize = 4;

/// Blocks per SM of the tensor-core skinny kernels at their register use (92-96 registers x
/// 128 threads on sm_90: 5), the occupancy their split-k fills.
pub(super) const SKINNY_BLOCKS_PER_SM: usize = 5;

/// Blocks per SM of the 64-row skinny kernels with 9-16 rows (`__launch_bounds__` in
/// matmul.cu: the q8_0 / q4_0 / bf16 `_n2_r4` kernels), the wave [`skinny_r4`] measures.
pub(super) const SKINNY_R4_BLOCKS_PER_SM: usize = 3;

/// Whether a skinny launch of `t32` column tiles of 32 rows (summed over its matrices) over
/// `kt` k tiles, for `rows` rows of x, runs the 64-row kernels instead of the 32-row ones
/// (vocabulary heads aside: [`Cuda::skinny_kernel`] gives them 64-row tiles always). Both
/// kernels sum every output in the same order for the same split (the k tiles a warp walks,
/// the fixed-order warp sum, the split partials in order: R only sets how many 16-row tiles a
/// warp carries), and the split is always [`skinny_splits`] of the 32-row tiles, so this
/// choice may depend on the row count without changing a bit. 64-row tiles where the launch
/// is unsplit and its 64-row blocks fill their last wave at least as well (at
/// [`SKINNY_R4_BLOCKS_PER_SM`]) as the 32-row ones do (at [`SKINNY_BLOCKS_PER_SM`]): at 9-16
/// rows (each k tile's x, as many bytes as its weights at 16 rows, read half as often) and for
/// q8_0 / q4_0 weights at any row count (their small loads: more in flight per warp).
///
/// H200, the 8B paired gate / up (24576 x 4096, 384 blocks for 396 slots): bf16 51.6 / 71.3 ->
/// 52.1 / 56.0 us at 1 / 16 rows (`tools/bench/skinny_share.cu`); the dense 8B target's
/// verify16 6.78 -> 6.19 ms (bf16), q8_0 decode1 6.11 -> 5.75 and verify16 7.36 -> 6.66; with
/// bf16 at one row the target's decode1 was 5.77 -> 5.88, hence 32-row tiles there. The 27B
/// gate / up (34816 rows: 544 blocks, 1.37 waves) keeps 32-row tiles (97.8 -> 104.6 us).
pub(super) fn skinny_r4(t32: usize, kt: usize, rows: usize, quantized: bool, sms: usize) -> bool {
    // Blocks over the slots of the waves they take: b1 / w1 >= b2 / w2 in integers.
    let waves = |b: usize, per_sm: usize| b.div_ceil(per_sm * sms).max(1) * per_sm * sms;
    let (b4, b2) = (t32.div_ceil(2), t32);
    let fills = b4 * waves(b2, SKINNY_BLOCKS_PER_SM) >= b2 * waves(b4, SKINNY_R4_BLOCKS_PER_SM);
    skinny_splits(t32, kt, sms).0 == 1 && fills && (rows > 8 || quantized)
}

/// Split-k of the tensor-core skinny matmul for `nb` column tiles over `kt` 32-wide k tiles:
/// (splits, k tiles per split). As many splits as fill one wave at [`SKINNY_BLOCKS_PER_SM`]
/// (more warps streaming; a second, partial wave costs more than it adds), at most 8 (their
/// partial sums) and at least 8 k tiles each. A function of (N, K, SM count) only, so a row's
/// result never depends on how many rows share the call. H200, bf16 weights, us per call at 1 /
/// 16 rows, from the earlier rule (ceil(2 SMs / nb) splits, at most kt / 8): 8B down 48.8 /
/// 51.5 -> 38.1 / 43.4 (3 -> 5 splits; k / v, 32 column tiles, 11.0 -> 13.2 at 16 splits,
/// hence the cap); graph replays, two interleaved rounds each: the dense Qwen3-8B target's
/// decode1 7.49 -> 7.07 ms and verify16 8.22 -> 7.91 ms at ctx 512, the bf16 / q8_0 / q4_0
/// drafter steps 3-8% faster.
pub(super) fn skinny_splits(nb: usize, kt: usize, sms: usize) -> (usize, usize) {
    let want = (SKINNY_BLOCKS_PER_SM * sms / nb.max(1)).max(1);
    let splits = want.min(8).min((kt / 8).max(1));
    let tps = kt.div_ceil(splits).max(1);
    (kt.div_ceil(tps).max(1), tps)
}

/// Whether a skinny launch runs its 64-row kernel instead of the 32-row one because of the
/// wave: the 32-row kernel's `b32` blocks need more than one wave at the `occ32` blocks per SM
/// the device's driver compiled it for, and the 64-row kernel's `b64` fit one at its `occ64`
/// (the same split, so the same bits: [`skinny_r4`]). [`skinny_r4`] and [`skinny_splits`]
/// assume [`SKINNY_BLOCKS_PER_SM`]; a kernel's real register count moves with the driver's
/// compiler and with code that never runs (the fifty-eighth session: the 8B gate / up at one
/// row, 768 blocks, took one wave at 78 registers and 1.16 at 81-96).
pub(super) fn wave_r4(b32: usize, occ32: usize, b64: usize, occ64: usize, sms: usize) -> bool {
    b32 > occ32 * sms && b64 <= occ64 * sms
}

impl Cuda {
    /// The tensor-core skinny kernel (bf16 / q8_0 / q4_0 weights, K % 32 == 0) for the row
    /// tile size of `w`, `rows` rows and a launch of `t32` column tiles of 32 rows (summed over
    /// the matrices of one `matmul_many` launch); None for the other formats and shapes.
    /// 32- or 64-row tiles as [`skinny_r4`] says (the same bits either way).
    pub(super) fn skinny_kernel(
        &self,
        w: &Weight<Self>,
        rows: usize,
        t32: usize,
    ) -> Option<(Kernel, usize)> {
        if !w.cols.is_multiple_of(32) {
            return None;
        }
        let quantized = matches!(
            w.buf,
            CudaWeightBuf::Q8_0 { .. } | CudaWeightBuf::Q4_0 { .. }
        );
        // Vocabulary heads (at least 8 x SMs tiles of 32 rows each): 64-row tiles at every row
        // count (their split is one either way).
        let head = w.rows.div_ceil(SKINNY_TILE_ROWS) >= 8 * self.num_sms;
        let tall = head || skinny_r4(t32, w.cols / 32, rows, quantized, self.num_sms);
        let kern = match (&w.buf, rows > 8, tall) {
            (CudaWeightBuf::Bf16(_), false, false) => Kernel::SkinnyBf16N1,
            (CudaWeightBuf::Bf16(_), true, false) => Kernel::SkinnyBf16N2,
            (CudaWeightBuf::Bf16P(_), false, false) => Kernel::SkinnyBf16PN1,
            (CudaWeightBuf::Bf16P(_), true, false) => Kernel::SkinnyBf16PN2,
            (CudaWeightBuf::Bf16P(_), false, true) => Kernel::SkinnyBf16PN1R4,
            (CudaWeightBuf::Bf16P(_), true, true) => Kernel::SkinnyBf16PN2R4,
            (CudaWeightBuf::Q8_0 { .. }, false, false) => Kernel::SkinnyQ8N1,
            (CudaWeightBuf::Q8_0 { .. }, true, false) => Kernel::SkinnyQ8N2,
            (CudaWeightBuf::Q4_0 { .. }, false, false) => Kernel::SkinnyQ4N1,
            (CudaWeightBuf::Q4_0 { .. }, true, false) => Kernel::SkinnyQ4N2,
            (CudaWeightBuf::Bf16(_), false, true) => Kernel::SkinnyBf16N1R4,
            (CudaWeightBuf::Bf16(_), true, true) => Kernel::SkinnyBf16N2R4,
            (CudaWeightBuf::Q8_0 { .. }, false, true) => Kernel::SkinnyQ8N1R4,
            (CudaWeightBuf::Q8_0 { .. }, true, true) => Kernel::SkinnyQ8N2R4,
            (CudaWeightBuf::Q4_0 { .. }, false, true) => Kernel::SkinnyQ4N1R4,
            (CudaWeightBuf::Q4_0 { .. }, true, true) => Kernel::SkinnyQ4N2R4,
            _ => return None,
        };
        let tile_rows = if tall {
            2 * SKINNY_TILE_ROWS
        } else {
            SKINNY_TILE_ROWS
        };
        Some((kern, tile_rows))
    }

    /// Blocks of a skinny kernel (128 threads, no dynamic shared memory) one SM holds at the
    /// registers the device's driver gave it; asked once per kernel.
    fn skinny_occupancy(&self, k: Kernel) -> Result<usize> {
        if let Some(&n) = lock(&self.occupancy).get(&k) {
            return Ok(n);
        }
        let n = self
            .func(k)?
            .occupancy_max_active_blocks_per_multiprocessor(128, 0, None)
            .map_err(dev)? as usize;
        lock(&self.occupancy).insert(k, n);
        Ok(n)
    }

    /// Whether the 64-row kernel `k64` (`b64` blocks) runs instead of the 32-row `k32` (`b32`
    /// blocks): [`wave_r4`] at both kernels' occupancy on this device.
    fn r4_for_the_wave(&self, k32: Kernel, k64: Kernel, b32: usize, b64: usize) -> Result<bool> {
        Ok(wave_r4(
            b32,
            self.skinny_occupancy(k32)?,
            b64,
            self.skinny_occupancy(k64)?,
            self.num_sms,
        ))
    }

    /// The 64-row sibling of a 32-row skinny kernel (None for the others).
    fn skinny_r4_sibling(kern: Kernel) -> Option<Kernel> {
        Some(match kern {
            Kernel::SkinnyBf16N1 => Kernel::SkinnyBf16N1R4,
            Kernel::SkinnyBf16N2 => Kernel::SkinnyBf16N2R4,
            Kernel::SkinnyBf16PN1 => Kernel::SkinnyBf16PN1R4,
            Kernel::SkinnyBf16PN2 => Kernel::SkinnyBf16PN2R4,
            Kernel::SkinnyQ8N1 => Kernel::SkinnyQ8N1R4,
            Kernel::SkinnyQ8N2 => Kernel::SkinnyQ8N2R4,
            Kernel::SkinnyQ4N1 => Kernel::SkinnyQ4N1R4,
            Kernel::SkinnyQ4N2 => Kernel::SkinnyQ4N2R4,
            _ => return None,
        })
    }

    /// The four-matrix twin (`skinny4_*`, 32-row tiles) of a skinny kernel: the same sums for
    /// the same split as the kernel and its 64-row sibling.
    fn skinny4_kernel(kern: Kernel) -> Option<Kernel> {
        Some(match kern {
            Kernel::SkinnyBf16N1 | Kernel::SkinnyBf16N1R4 => Kernel::Skinny4Bf16N1,
            Kernel::SkinnyBf16N2 | Kernel::SkinnyBf16N2R4 => Kernel::Skinny4Bf16N2,
            Kernel::SkinnyBf16PN1 | Kernel::SkinnyBf16PN1R4 => Kernel::Skinny4Bf16PN1,
            Kernel::SkinnyBf16PN2 | Kernel::SkinnyBf16PN2R4 => Kernel::Skinny4Bf16PN2,
            Kernel::SkinnyQ8N1 | Kernel::SkinnyQ8N1R4 => Kernel::Skinny4Q8N1,
            Kernel::SkinnyQ8N2 | Kernel::SkinnyQ8N2R4 => Kernel::Skinny4Q8N2,
            Kernel::SkinnyQ4N1 | Kernel::SkinnyQ4N1R4 => Kernel::Skinny4Q4N1,
            Kernel::SkinnyQ4N2 | Kernel::SkinnyQ4N2R4 => Kernel::Skinny4Q4N2,
            _ => return None,
        })
    }

    /// The gate / up twin (`skinny_glu_*`) of a skinny kernel: the same sums for the same
    /// split, a block holding a gate and the same up rows (half the kernel's tile rows each).
    fn skinny_glu_kernel(kern: Kernel) -> Option<Kernel> {
        Some(match kern {
            Kernel::SkinnyBf16N1 => Kernel::SkinnyGluBf16N1,
            Kernel::SkinnyBf16N2 => Kernel::SkinnyGluBf16N2,
            Kernel::SkinnyBf16N1R4 => Kernel::SkinnyGluBf16N1R4,
            Kernel::SkinnyBf16N2R4 => Kernel::SkinnyGluBf16N2R4,
            Kernel::SkinnyBf16PN1 => Kernel::SkinnyGluBf16PN1,
            Kernel::SkinnyBf16PN2 => Kernel::SkinnyGluBf16PN2,
            Kernel::SkinnyBf16PN1R4 => Kernel::SkinnyGluBf16PN1R4,
            Kernel::SkinnyBf16PN2R4 => Kernel::SkinnyGluBf16PN2R4,
            Kernel::SkinnyQ8N1 => Kernel::SkinnyGluQ8N1,
            Kernel::SkinnyQ8N2 => Kernel::SkinnyGluQ8N2,
            Kernel::SkinnyQ8N1R4 => Kernel::SkinnyGluQ8N1R4,
            Kernel::SkinnyQ8N2R4 => Kernel::SkinnyGluQ8N2R4,
            Kernel::SkinnyQ4N1 => Kernel::SkinnyGluQ4N1,
            Kernel::SkinnyQ4N2 => Kernel::SkinnyGluQ4N2,
            Kernel::SkinnyQ4N1R4 => Kernel::SkinnyGluQ4N1R4,
            Kernel::SkinnyQ4N2R4 => Kernel::SkinnyGluQ4N2R4,
            _ => return None,
        })
    }

    /// 1-16 rows of x times one weight (any format): the skinny matmul on the tensor cores or
    /// the SIMT kernel.
    pub(super) fn matmul_skinny(
        &self,
        x: &cudarc::driver::CudaView<'_, f32>,
        rows: usize,
        w: &Weight<Self>,
        out: &mut cudarc::driver::CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        if let Some(A8Parts { qs, d, q4 }) = w.buf.a8() {
            let mut mats = [A8Launch {
                qs,
                d,
                q4,
                n,
                out: out.slice_mut(0..rows * n),
            }];
            return self
                .matmul_a8(Some(x), None, None, rows, k, &mut mats, false)
                .map(|_| ());
        }
        if self
            .skinny_kernel(w, rows, n.div_ceil(SKINNY_TILE_ROWS))
            .is_some()
        {
            return self.matmul_skinny_mma(x, rows, &mut [(w, out.slice_mut(0..rows * n))]);
        }
        let (n_i, k_i, t_i) = (
            i32_of("matmul", "w.rows", n)?,
            i32_of("matmul", "w.cols", k)?,
            rows as i32,
        );
        let f = self.func(Kernel::SkinnySimt)?;
        let fmt = w.buf.fmt_code();
        let mut b = self.stream.launch_builder(&f);
        b.arg(&fmt);
        push_weight(&mut b, &w.buf);
        b.arg(x).arg(out).arg(&n_i).arg(&k_i).arg(&t_i);
        unsafe { b.launch(cfg((n.div_ceil(4) as u32, 1, 1), 128, 0)) }.map_err(dev)?;
        Ok(())
    }

    /// 1-16 rows of x times 1-4 weights of one K, all taking the same tensor-core skinny
    /// kernel ([`Cuda::skinny_kernel`]): x split into bf16 hi + lo once, then one launch over
    /// the matrices' column tiles, all with the split-k [`skinny_splits`] gives their total
    /// (one wave for the 8B q/k/v: 192 tiles x 3 splits, where a split per matrix made 1152
    /// blocks). A matrix launched with others may therefore sum its K in other pieces than
    /// a `matmul` of it alone (within the format's bound of it); every row's bits still
    /// depend only on the matrices, never on the row count.
    pub(super) fn matmul_skinny_mma(
        &self,
        x: &cudarc::driver::CudaView<'_, f32>,
        rows: usize,
        mats: &mut [(&Weight<Self>, cudarc::driver::CudaViewMut<'_, f32>)],
    ) -> Result<()> {
        self.skinny_launch(Some(x), None, rows, mats, false)
            .map(|_| ())
    }

    /// The skinny launch of [`Cuda::matmul_skinny_mma`] from an f32 `x` (split first) or from
    /// a producer's hi / lo pair (`x` None, `act` Some; Ok(false): stale, nothing launched);
    /// `acc`: add the products into the outputs (`add_assign`'s f32 add) instead of writing
    /// them.
    pub(super) fn skinny_launch(
        &self,
        x: Option<&cudarc::driver::CudaView<'_, f32>>,
        act: Option<&SplitAct>,
        rows: usize,
        mats: &mut [(&Weight<Self>, cudarc::driver::CudaViewMut<'_, f32>)],
        acc: bool,
    ) -> Result<bool> {
        let (w0, _) = mats.first().ok_or_else(internal)?;
        let k = w0.cols;
        let t32: usize = mats
            .iter()
            .map(|(w, _)| w.rows.div_ceil(SKINNY_TILE_ROWS))
            .sum();
        let (kern, tile_rows) = self.skinny_kernel(w0, rows, t32).ok_or_else(internal)?;
        if mats.len() > SKINNY_MATS
            || mats.iter().any(|(w, _)| {
                w.cols != k
                    || w.rows == 0
                    || self.skinny_kernel(w, rows, t32) != Some((kern, tile_rows))
            })
        {
            return Err(internal());
        }
        let kt = k / 32;
        // One split-k for the whole launch, from its column tiles together (so the launch
        // fills one wave as a single matrix of their total height would), K and the SM count:
        // never from the row count, so a row's bits do not depend on how many rows run.
        // From the 32-row tiles whichever kernel runs, so the 64-row kernels (the same sums
        // for the same split) keep every bit ([`skinny_r4`]).
        let (splits, tps) = skinny_splits(t32, kt, self.num_sms);
        // Four matrices: their own kernel, on 32-row tiles.
        let (kern, tile_rows) = if mats.len() == SKINNY_MATS {
            (
                Self::skinny4_kernel(kern).ok_or_else(internal)?,
                SKINNY_TILE_ROWS,
            )
        } else {
            // 64-row tiles where they take one wave and 32-row tiles need more (the same sums).
            let blocks = |tr: usize| -> usize {
                splits * mats.iter().map(|(w, _)| w.rows.div_ceil(tr)).sum::<usize>()
            };
            match Self::skinny_r4_sibling(kern) {
                Some(k4)
                    if tile_rows == SKINNY_TILE_ROWS
                        && self.r4_for_the_wave(
                            kern,
                            k4,
                            blocks(SKINNY_TILE_ROWS),
                            blocks(2 * SKINNY_TILE_ROWS),
                        )? =>
                {
                    (k4, 2 * SKINNY_TILE_ROWS)
                }
                _ => (kern, tile_rows),
            }
        };
        // Column tiles per matrix.
        let plan: Vec<usize> = mats
            .iter()
            .map(|(w, _)| w.rows.div_ceil(tile_rows))
            .collect();
        let ws_len: usize = mats
            .iter()
            .map(|(w, _)| if splits > 1 { splits * w.rows * 16 } else { 0 })
            .sum();
        let counters: usize = plan.iter().sum();
        let f = self.func(kern)?;
        let pdl = *lock(&self.skinny_pdl);
        let len = rows * k;
        let mut s = lock(&self.scratch);
        let second = act.is_some_and(|a| a.second);
        match (x, act) {
            (Some(x), None) => {
                // x -> bf16 hi + lo once per call (elementwise, so per-row determinism holds).
                let fs = self.func(Kernel::SplitBf16)?;
                let (_, hi, lo) = s.split_written(&self.stream, k, rows, false)?;
                let n64 = len as i64;
                let mut b = self.stream.launch_builder(&fs);
                b.arg(x).arg(&mut *hi).arg(&mut *lo).arg(&n64);
                unsafe { b.launch(grid_1d(len, 256)) }.map_err(dev)?;
            }
            (None, Some(a)) => {
                let (generation, shape) = if a.second {
                    (s.y_gen, s.y_shape)
                } else {
                    (s.x_gen, s.x_shape)
                };
                if generation != a.generation || shape != Some((a.k, a.rows)) || a.hi_only {
                    return Ok(false);
                }
                if a.k != k || a.rows != rows {
                    return Err(BackendError::Invalid {
                        op: "matmul_many_split",
                        msg: format!(
                            "activation of {} rows x {}, matrices of K {k} for {rows} rows",
                            a.rows, a.k
                        ),
                    });
                }
            }
            _ => return Err(internal()),
        }
        ensure(&self.stream, &mut s.mm_ws, ws_len.max(1)).map_err(dev)?;
        ensure(&self.stream, &mut s.mm_counters, counters).map_err(dev)?;
        let Scratch {
            mm_ws,
            mm_counters,
            x_hi,
            x_lo,
            y_hi,
            y_lo,
            ..
        } = &mut *s;
        let (ws, cnt) = (
            mm_ws.as_mut().ok_or_else(internal)?,
            mm_counters.as_mut().ok_or_else(internal)?,
        );
        let (hi, lo) = if second {
            (y_hi.as_ref(), y_lo.as_ref())
        } else {
            (x_hi.as_ref(), x_lo.as_ref())
        };
        let (hi, lo) = (hi.ok_or_else(internal)?, lo.ok_or_else(internal)?);
        let st = &*self.stream;
        let mut a = RawArgs::default();
        // Per matrix: its first block, split partials (ws) and tile counters.
        let (mut c, mut wo, mut co) = (
            [0usize; SKINNY_MATS],
            [0usize; SKINNY_MATS],
            [0usize; SKINNY_MATS],
        );
        let (mut total, mut wsum, mut csum) = (0, 0, 0);
        let four = mats.len() == SKINNY_MATS;
        let n_mats = mats.len();
        for (i, ((w, out), &nb)) in mats.iter_mut().zip(&plan).enumerate() {
            raw_weight(&mut a, &w.buf, st);
            a.dptr_mut(out, st).i32(i32_of("matmul", "w.rows", w.rows)?);
            if !four {
                // SKINNY: each matrix's split and k tiles per split (the same for all).
                a.i32(i32_of("matmul", "splits", splits)?).i32(i32_of(
                    "matmul",
                    "tiles per split",
                    tps,
                )?);
            }
            (c[i], wo[i], co[i]) = (total, wsum, csum);
            total += nb * splits;
            wsum += if splits > 1 { splits * w.rows * 16 } else { 0 };
            csum += nb;
        }
        if !four {
            // SKINNY (1-3 matrices): the missing ones, then the first blocks c1, c2 of
            // matrices 1 and 2 (the grid's end where missing); it derives the offsets itself.
            for _ in n_mats..3 {
                a.u64(0).u64(0).u64(0).i32(0).i32(1).i32(1);
            }
            for (i, &ci) in c.iter().enumerate().take(3).skip(1) {
                let ci = if i < n_mats { ci } else { total };
                a.i32(i32_of("matmul", "blocks", ci)?);
            }
        } else {
            // SKINNY4: the split, the first blocks, partials and counters of matrices 1-3.
            a.i32(i32_of("matmul", "splits", splits)?).i32(i32_of(
                "matmul",
                "tiles per split",
                tps,
            )?);
            for &ci in &c[1..] {
                a.i32(i32_of("matmul", "blocks", ci)?);
            }
            for &w in &wo[1..] {
                a.i64(w as i64);
            }
            for &ci in &co[1..] {
                a.i32(i32_of("matmul", "tile counters", ci)?);
            }
        }
        a.dptr(hi, st)
            .dptr(lo, st)
            .dptr_mut(&mut *ws, st)
            .dptr_mut(&mut *cnt, st)
            .i32(i32_of("matmul", "w.cols", k)?)
            .i32(rows as i32)
            .i32(acc as i32);
        // SAFETY: the parameters are those of the SKINNY (1-3 matrices) or SKINNY4 kernel macro
        // in matmul.cu, in order; it reads nothing but its weights before waiting for the
        // kernel before it (griddepcontrol), in every thread.
        unsafe {
            a.launch(
                st,
                &f,
                cfg((i32_of("matmul", "blocks", total)? as u32, 1, 1), 128, 0),
                pdl,
            )
        }?;
        Ok(true)
    }

    /// Whether `ws` (K = `k`, 1-4 of them) all take one tensor-core skinny kernel for `rows`
    /// (1-16) rows: what [`Cuda::matmul_many_split`] runs.
    pub(super) fn skinny_group(&self, ws: &[&Weight<Self>], k: usize, rows: usize) -> bool {
        (1..=SKINNY_ROWS).contains(&rows)
            && (1..=SKINNY_MATS).contains(&ws.len())
            && self.skinny_common(ws, k, rows)
    }

    /// Whether a producer may write the x of `ws` (K = `k`) for `rows` rows and
    /// [`Cuda::matmul_many_split`] take it: 1-16 rows, [`Cuda::set_skinny_producers`] and
    /// [`Cuda::skinny_group`]; more (a prefill), [`Cuda::set_prefill_producers`] and every
    /// matrix bf16 (plain or packed), or q8_0 / q4_0 where cuBLAS takes it.
    pub(super) fn split_group(&self, ws: &[&Weight<Self>], k: usize, rows: usize) -> bool {
        if rows <= SKINNY_ROWS {
            return *lock(&self.skinny_producers) && self.skinny_group(ws, k, rows);
        }
        *lock(&self.prefill_producers)
            && !ws.is_empty()
            && ws.iter().all(|w| {
                w.cols == k
                    && w.rows > 0
                    && self.cublas_takes(w, rows)
                    && matches!(
                        w.buf,
                        CudaWeightBuf::Bf16(_)
                            | CudaWeightBuf::Bf16P(_)
                            | CudaWeightBuf::Q8_0 { .. }
                            | CudaWeightBuf::Q4_0 { .. }
                    )
            })
    }

    /// Whether a producer's pair for `rows` rows holds hi halves only: a prefill's under
    /// [`PrefillPrecision::Fast`] (its one product reads no lo).
    pub(super) fn split_hi_only(&self, rows: usize) -> bool {
        rows > SKINNY_ROWS && self.prefill_fast()
    }

    /// Whether `ws` (K = `k`) all take one tensor-core skinny kernel for `rows` (1-16) rows
    /// in one launch of their total height.
    pub(super) fn skinny_common(&self, ws: &[&Weight<Self>], k: usize, rows: usize) -> bool {
        let t32: usize = ws.iter().map(|w| w.rows.div_ceil(SKINNY_TILE_ROWS)).sum();
        ws.first()
            .and_then(|w| self.skinny_kernel(w, rows, t32))
            .is_some_and(|kern| {
                ws.iter().all(|w| {
                    w.cols == k && w.rows > 0 && self.skinny_kernel(w, rows, t32) == Some(kern)
                })
            })
    }

    /// The matmuls of a producer's bf16 hi / lo activation: `outs[i] = x W_i^T` for the
    /// activation's rows, or with `acc` `outs[i] += x W_i^T` (`add_assign`'s f32 add). For
    /// 1-16 rows the skinny matmuls (bf16 / q8_0 / q4_0 weights, 1-4 of one K, one launch);
    /// for more (a prefill, no `acc`) cuBLAS (bf16 / q8_0 / q4_0 matrices it takes;
    /// [`Cuda::set_prefill_producers`]). The bits of `matmul_many` of the f32 rows the
    /// producer's separate op writes (then `add_assign`).
    /// Ok(false): the activation was stale (another launch wrote the pair since, or it is a
    /// hi-only pair and the precision changed), nothing launched.
    pub fn matmul_many_split(
        &self,
        act: &SplitAct,
        ws: &[&Weight<Self>],
        outs: &mut [&mut CudaBuf],
        acc: bool,
    ) -> Result<bool> {
        let (rows, k) = (act.rows, act.k);
        if rows > SKINNY_ROWS {
            return self.matmul_many_split_cublas(act, ws, outs, acc);
        }
        if ws.len() != outs.len() || !self.skinny_group(ws, k, rows) {
            return Err(BackendError::Invalid {
                op: "matmul_many_split",
                msg: format!(
                    "needs 1-{SKINNY_MATS} bf16 / q8_0 / q4_0 matrices of K {k} taking one skinny kernel, as many outputs; found {} matrices, {} outputs",
                    ws.len(),
                    outs.len()
                ),
            });
        }
        for (w, o) in ws.iter().zip(outs.iter()) {
            check("matmul_many_split", "out", rows * w.rows, o.len)?;
        }
        let mut mats: Vec<_> = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, o)| (*w, o.data.slice_mut(0..rows * w.rows)))
            .collect();
        self.skinny_launch(None, Some(act), rows, &mut mats, acc)
    }

    /// The gate and up projections of a producer's activation (1-16 rows) in one launch that
    /// writes `silu(x W_gate^T) * (x W_up^T)` as the down projection's bf16 hi / lo activation
    /// (a second pair, so the launch reads the first while it writes): the bits of
    /// [`Cuda::matmul_many_split`] of the two (one launch, the same split) then
    /// [`Cuda::silu_mul_split`], with neither f32 output written nor the SiLU launch. Ok(None),
    /// nothing launched: [`Cuda::set_skinny_glu`] off, `act` stale or of a prefill, an
    /// intermediate size that is not a multiple of 32 (no skinny matmul could read the
    /// output), or matrices the skinny launch of the two would not take (then that launch and
    /// the SiLU product run as before).
    pub fn matmul_glu_split(
        &self,
        act: &SplitAct,
        w_gate: &Weight<Self>,
        w_up: &Weight<Self>,
    ) -> Result<Option<SplitAct>> {
        let (rows, k, n) = (act.rows, act.k, w_gate.rows);
        if !*lock(&self.skinny_glu)
            || act.second
            || act.hi_only
            || !(1..=SKINNY_ROWS).contains(&rows)
            || w_up.rows != n
            || !n.is_multiple_of(32)
            || !self.skinny_group(&[w_gate, w_up], k, rows)
        {
            return Ok(None);
        }
        // The kernel and split of the two matrices' skinny launch: the same sums.
        let t32 = 2 * n.div_ceil(SKINNY_TILE_ROWS);
        let (kern, tile_rows) = self.skinny_kernel(w_gate, rows, t32).ok_or_else(internal)?;
        let Some(glu) = Self::skinny_glu_kernel(kern) else {
            return Ok(None);
        };
        let (splits, tps) = skinny_splits(t32, k / 32, self.num_sms);
        // 64-row tiles where they take one wave and 32-row tiles need more (the same sums).
        let glu4 = Self::skinny_r4_sibling(kern).and_then(Self::skinny_glu_kernel);
        let (kern, tile_rows) = match glu4 {
            Some(glu4)
                if tile_rows == SKINNY_TILE_ROWS
                    && self.r4_for_the_wave(
                        glu,
                        glu4,
                        n.div_ceil(SKINNY_TILE_ROWS / 2) * splits,
                        n.div_ceil(SKINNY_TILE_ROWS) * splits,
                    )? =>
            {
                (glu4, 2 * SKINNY_TILE_ROWS)
            }
            _ => (glu, tile_rows),
        };
        let tiles = n.div_ceil(tile_rows / 2);
        let f = self.func(kern)?;
        let pdl = *lock(&self.skinny_pdl);
        let mut s = lock(&self.scratch);
        if act.generation != s.x_gen || s.x_shape != Some((k, rows)) {
            return Ok(None);
        }
        ensure(&self.stream, &mut s.mm_ws, (splits * 2 * n * 16).max(1)).map_err(dev)?;
        ensure(&self.stream, &mut s.mm_counters, tiles).map_err(dev)?;
        ensure(&self.stream, &mut s.y_hi, rows * n).map_err(dev)?;
        ensure(&self.stream, &mut s.y_lo, rows * n).map_err(dev)?;
        s.y_gen += 1;
        s.y_shape = Some((n, rows));
        let out = SplitAct {
            k: n,
            rows,
            generation: s.y_gen,
            hi_only: false,
            second: true,
        };
        let Scratch {
            mm_ws,
            mm_counters,
            x_hi,
            x_lo,
            y_hi,
            y_lo,
            ..
        } = &mut *s;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        raw_weight(&mut a, &w_gate.buf, st);
        raw_weight(&mut a, &w_up.buf, st);
        a.i32(i32_of("matmul_glu_split", "w_gate.rows", n)?)
            .i32(i32_of("matmul_glu_split", "splits", splits)?)
            .i32(i32_of("matmul_glu_split", "tiles per split", tps)?)
            .dptr(x_hi.as_ref().ok_or_else(internal)?, st)
            .dptr(x_lo.as_ref().ok_or_else(internal)?, st)
            .dptr_mut(y_hi.as_mut().ok_or_else(internal)?, st)
            .dptr_mut(y_lo.as_mut().ok_or_else(internal)?, st)
            .dptr_mut(mm_ws.as_mut().ok_or_else(internal)?, st)
            .dptr_mut(mm_counters.as_mut().ok_or_else(internal)?, st)
            .i32(i32_of("matmul_glu_split", "w_gate.cols", k)?)
            .i32(rows as i32);
        let blocks = i32_of("matmul_glu_split", "blocks", tiles * splits)? as u32;
        // SAFETY: the parameters of the SKINNY_GLU kernel macro in matmul.cu, in order; it
        // reads nothing but its weights before waiting for the kernel before it.
        unsafe { a.launch(st, &f, cfg((blocks, 1, 1), 128, 0), pdl) }?;
        Ok(Some(out))
    }

    /// [`Cuda::matmul_many_split`] of a prefill's activation: each matrix through
    /// [`Cuda::matmul_cublas_split`] over the pair (the bits of `matmul`, which splits the f32
    /// rows itself).
    fn matmul_many_split_cublas(
        &self,
        act: &SplitAct,
        ws: &[&Weight<Self>],
        outs: &mut [&mut CudaBuf],
        acc: bool,
    ) -> Result<bool> {
        let (rows, k) = (act.rows, act.k);
        if acc || ws.len() != outs.len() || !self.split_group(ws, k, rows) {
            return Err(BackendError::Invalid {
                op: "matmul_many_split",
                msg: format!(
                    "{rows} rows (a prefill) need bf16 / q8_0 / q4_0 matrices of K {k} that cuBLAS takes, as many outputs and no accumulation; found {} matrices, {} outputs, accumulate {acc}",
                    ws.len(),
                    outs.len()
                ),
            });
        }
        let fast = self.prefill_fast();
        if act.hi_only != fast {
            return Ok(false);
        }
        let wlen = self.unpack_scratch(ws);
        let mut s = lock(&self.scratch);
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            let Some(bufs) = s.split_current(&self.stream, act, wlen)? else {
                return Ok(false);
            };
            self.matmul_cublas_split(bufs, rows, w, o, fast)?;
            self.prefill_producer_uses[0].fetch_add(1, Ordering::Relaxed);
        }
        Ok(true)
    }

    /// `rms_norm` of the first `rows` rows of `x` (width `dim`) written as the skinny matmuls'
    /// bf16 hi / lo activation ([`Cuda::matmul_many_split`]): the bits `split_bf16` makes of
    /// `rms_norm`'s output, with neither that output nor the split's launch.
    pub fn rms_norm_split(
        &self,
        x: &CudaBuf,
        w: &CudaBuf,
        dim: usize,
        eps: f32,
        rows: usize,
    ) -> Result<SplitAct> {
        check("rms_norm_split", "x", rows * dim, x.len)?;
        check("rms_norm_split", "w", dim, w.len)?;
        if rows == 0 || dim == 0 {
            return Err(BackendError::Invalid {
                op: "rms_norm_split",
                msg: format!("needs rows and dim > 0; found {rows} rows, dim {dim}"),
            });
        }
        let f = self.func(Kernel::RmsNormSplit)?;
        let hi_only = self.split_hi_only(rows);
        let pdl = *lock(&self.skinny_pdl);
        let mut s = lock(&self.scratch);
        let (act, hi, lo) = s.split_written(&self.stream, dim, rows, hi_only)?;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr(&x.data, st).dptr(&w.data, st).dptr_mut(&mut *hi, st);
        lo_arg(&mut a, lo, hi_only, st);
        a.i32(i32_of("rms_norm_split", "dim", dim)?).f32(eps);
        // SAFETY: rms_norm_split's parameters in order (x, w, hi, lo, dim, eps); it reads
        // nothing but the norm's weights before it waits for the kernel before it, in every
        // thread (launched programmatically with the skinny matmuls, `set_skinny_pdl`).
        unsafe {
            a.launch(
                st,
                &f,
                cfg(
                    (i32_of("rms_norm_split", "rows", rows)? as u32, 1, 1),
                    norm_threads(dim),
                    0,
                ),
                pdl,
            )
        }?;
        Ok(act)
    }

    /// `add_rms_norm` over the first `rows` rows (`h += o`, then the norm) with the normed
    /// rows written as the skinny matmuls' bf16 hi / lo activation instead of an f32 output:
    /// the bits of `add_rms_norm` then `split_bf16`. `dim` <= 32 x the norm's block size.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_split(
        &self,
        h: &mut CudaBuf,
        o: &CudaBuf,
        w: &CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<SplitAct> {
        check("add_rms_norm_split", "h", rows * dim, h.len)?;
        check("add_rms_norm_split", "o", rows * dim, o.len)?;
        check("add_rms_norm_split", "w", dim, w.len)?;
        let threads = norm_threads(dim);
        if rows == 0 || dim == 0 || dim > 32 * threads as usize {
            return Err(BackendError::Invalid {
                op: "add_rms_norm_split",
                msg: format!(
                    "needs rows > 0 and 0 < dim <= {}; found {rows} rows, dim {dim}",
                    32 * threads
                ),
            });
        }
        let f = self.func(Kernel::AddRmsNormSplit)?;
        let pdl = *lock(&self.a8_pdl);
        let hi_only = self.split_hi_only(rows);
        let mut s = lock(&self.scratch);
        let (act, hi, lo) = s.split_written(&self.stream, dim, rows, hi_only)?;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr_mut(&mut h.data, st)
            .dptr(&o.data, st)
            .dptr(&w.data, st)
            .dptr_mut(&mut *hi, st);
        lo_arg(&mut a, lo, hi_only, st);
        a.i32(i32_of("add_rms_norm_split", "dim", dim)?).f32(eps);
        // SAFETY: add_rms_norm_split's parameters in order (h, o, w, hi, lo, dim, eps); it
        // waits for the kernel before it (griddepcontrol), as add_rms_norm.
        unsafe {
            a.launch(
                st,
                &f,
                cfg(
                    (i32_of("add_rms_norm_split", "rows", rows)? as u32, 1, 1),
                    threads,
                    0,
                ),
                pdl,
            )
        }?;
        Ok(act)
    }

    /// [`Backend::mul_sigmoid`] of `x` by `gate` (`rows` rows of `width`, in place), also
    /// written as the skinny matmuls' bf16 hi / lo x of those rows (the bits of `mul_sigmoid`
    /// + split_bf16): a gated attention's o projection reads it.
    pub(super) fn mul_sigmoid_split(
        &self,
        x: &mut CudaBuf,
        gate: &CudaBuf,
        rows: usize,
        width: usize,
    ) -> Result<SplitAct> {
        let op = "mul_sigmoid_split";
        let n = rows * width;
        if n == 0 || x.len != n {
            return Err(BackendError::Invalid {
                op,
                msg: format!(
                    "x of {} values: expected {rows} rows of {width}, not empty",
                    x.len
                ),
            });
        }
        check(op, "gate", n, gate.len)?;
        let f = self.func(Kernel::MulSigmoidSplit)?;
        let hi_only = self.split_hi_only(rows);
        let mut s = lock(&self.scratch);
        let (act, hi, lo) = s.split_written(&self.stream, width, rows, hi_only)?;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr_mut(&mut x.data, st)
            .dptr(&gate.data, st)
            .dptr_mut(&mut *hi, st);
        lo_arg(&mut a, lo, hi_only, st);
        a.i64(n as i64);
        // SAFETY: mul_sigmoid_split's parameters in order (x, gate, hi, lo, n), the grid of
        // mul_sigmoid; it does not wait for the kernel before it, so no programmatic launch.
        unsafe { a.launch(st, &f, grid_1d(n, 256), false) }?;
        Ok(act)
    }

    /// [`Backend::rms_norm_gated`] of the first `rows` rows of `x` (`width` = heads x `dim`
    /// wide) into `out`, also written as the skinny matmuls' bf16 hi / lo x of those rows (the
    /// bits of `rms_norm_gated` + split_bf16): a Gated DeltaNet layer's o projection reads it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_gated_split(
        &self,
        x: &CudaBuf,
        z: &CudaBuf,
        w: &CudaBuf,
        dim: usize,
        eps: f32,
        out: &mut CudaBuf,
        rows: usize,
        width: usize,
    ) -> Result<SplitAct> {
        let op = "rms_norm_gated_split";
        if rows == 0 || dim == 0 || !width.is_multiple_of(dim) || width == 0 {
            return Err(BackendError::Invalid {
                op,
                msg: format!("{rows} rows of {width} values in heads of {dim}: expected rows > 0 and whole heads"),
            });
        }
        let n = rows * width;
        check(op, "x", n, x.len)?;
        check(op, "z", n, z.len)?;
        check(op, "w", dim, w.len)?;
        check(op, "out", n, out.len)?;
        let heads = n / dim;
        let f = self.func(Kernel::RmsNormGatedSplit)?;
        let hi_only = self.split_hi_only(rows);
        let mut s = lock(&self.scratch);
        let (act, hi, lo) = s.split_written(&self.stream, width, rows, hi_only)?;
        let st = &*self.stream;
        let mut a = RawArgs::default();
        a.dptr(&x.data, st)
            .dptr(&z.data, st)
            .dptr(&w.data, st)
            .dptr_mut(&mut out.data, st)
            .dptr_mut(&mut *hi, st);
        lo_arg(&mut a, lo, hi_only, st);
        a.i32(i32_of(op, "dim", dim)?).f32(eps);
        // SAFETY: rms_norm_gated_split's parameters in order (x, z, w, out, hi, lo, dim, eps),
        // the block size of rms_norm_gated; it does not wait for the kernel before it, so no
        // programmatic launch.
        unsafe {
            a.launch(
                st,
                &f,
                cfg((i32_of(op, "rows", heads)? as u32, 1, 1), 128, 0),
                false,
            )
        }?;
        Ok(act)
    }

    /// `silu(gate) * up` over `rows` rows of width `k`, written as the skinny matmuls' bf16
    /// hi / lo activation: the bits of `silu_mul` then `split_bf16`.
    pub fn silu_mul_split(
        &self,
        gate: &CudaBuf,
        up: &CudaBuf,
        rows: usize,
        k: usize,
    ) -> Result<SplitAct> {
        let n = rows * k;
        check("silu_mul_split", "gate", n, gate.len)?;
        check("silu_mul_split", "up", n, up.len)?;
        if n == 0 {
            return Err(BackendError::Invalid {
                op: "silu_mul_split",
                msg: format!("needs rows and k > 0; found {rows} rows, k {k}"),
            });
        }
        let f = self.func(Kernel::SiluMulSplit)?;
        let hi_only = self.split_hi_only(rows);
        let mut s = lock(&self.scratch);
        let (act, hi, lo) = s.split_written(&self.stream, k, rows, hi_only)?;
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&gate.data).arg(&up.data).arg(&mut *hi);
        if hi_only {
            b.arg(&NULL_PTR);
        } else {
            b.arg(&mut *lo);
        }
        b.arg(&n64);
        // SAFETY: silu_mul_split(const float *, const float *, u16 *, u16 *, long long).
        unsafe { b.launch(grid_1d(n, 256)) }.map_err(dev)?;
        Ok(act)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wave_r4_only_where_the_32_row_launch_overflows_a_wave_and_the_64_row_fits() {
        // The 8B gate / up at one row on 132 SMs: 768 GLU blocks of 32 rows, 384 of 64.
        assert!(wave_r4(768, 5, 384, 4, 132));
        assert!(wave_r4(768, 5, 384, 3, 132));
        assert!(!wave_r4(768, 6, 384, 4, 132)); // one wave at 6 per SM already
        assert!(!wave_r4(768, 5, 384, 2, 132)); // 64-row tiles would take two waves too
        assert!(!wave_r4(640, 5, 320, 3, 132)); // exactly one wave
        assert!(wave_r4(661, 5, 331, 3, 132));
    }
}
