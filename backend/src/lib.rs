//! The compute seam of dflash-rs.
//!
//! Every model forward in the workspace (the drafter, the reference targets) is written once,
//! generic over [`Backend`]. Two implementations exist: [`cpu::Cpu`] (the f32 reference, rayon
//! over rows, quantized weights dequantized per block on the fly) in this crate, and the CUDA
//! backend in `dflash-cuda-kernels`. Tests run the same forward on both and compare.
//!
//! Conventions shared by every op:
//! * Activations are f32 buffers ([`Backend::Buf`]) in row-major order; shapes are passed
//!   explicitly as row counts and widths, and every op checks them against the buffer lengths,
//!   returning [`BackendError::Shape`] rather than panicking. A buffer may be longer than what
//!   an op reads or writes (scratch reuse): ops check "long enough" and leave the rest alone,
//!   except where a doc says "the whole buffer" (`scale`, `mul_sigmoid`, the row count of
//!   `rms_norm`, the token count of `gdn_gates`).
//! * A weight matrix is `[rows, cols]` = `[out_features, in_features]` (the PyTorch / safetensors
//!   layout), stored in one [`WeightFormat`]; `matmul` computes `x · Wᵀ`.
//! * Per-row determinism: the value of an output row never depends on how many other rows are
//!   processed in the same call. A 16-row verify therefore produces bit-identical rows to 16
//!   one-row decodes, which is what makes "speculative stream == plain greedy stream" exact.
//! * Positions are contiguous: row `r` of a RoPE / attention call sits at absolute position
//!   `pos0 + r`.

pub mod cpu;
mod error;
mod weight;

pub use error::BackendError;
pub use weight::{HostData, HostWeight, Weight, WeightFormat, A8_CHUNK_BLOCKS};

/// Result alias for backend operations.
pub type Result<T> = std::result::Result<T, BackendError>;

/// Rotary embedding parameters, precomputed on the host from the model config
/// (default, linear, llama3 or YaRN: they all reduce to per-pair inverse frequencies and a
/// post-rope scale).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// Inverse frequency of each rotated pair, length `rot_dim / 2`.
    pub inv_freq: Vec<f32>,
    /// Multiplier applied to both cos and sin (YaRN `attention_factor`; 1.0 otherwise).
    pub attention_scaling: f32,
}

impl RopeSpec {
    /// Number of leading dimensions of each head that are rotated (`2 * inv_freq.len()`);
    /// the rest pass through unchanged (partial rotary).
    pub fn rot_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }
}

/// Shape and masking of one attention call.
///
/// Queries are `[n_q, n_heads, head_dim]`, keys and values the first `n_kv` rows of
/// `[*, n_kv_heads, head_dim]` buffers (a KV cache may have spare capacity after them).
/// Query `i` sits at absolute position `q_pos0 + i`, key `j` at `kv_pos0 + j`.
/// Key `j` is visible to query `i` iff `(!causal || kpos <= qpos) && (window.is_none() || qpos < kpos + window)`.
/// A query that sees no key gets a zero output row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub n_q: usize,
    pub n_kv: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub q_pos0: usize,
    pub kv_pos0: usize,
    pub causal: bool,
    pub window: Option<usize>,
    /// Softmax scale, normally `head_dim^-0.5`.
    pub scale: f32,
}

impl AttnParams {
    /// The keys query row `i` sees, one contiguous range [lo, hi) of key indices: causal, up
    /// to its own position (`kv_pos0 + j <= q_pos0 + i`; none when `q_pos0 + i < kv_pos0`);
    /// with a window `w`, from `q_pos0 + i + 1 - w` (`kv_pos0 + j + w > q_pos0 + i`).
    pub fn visible_keys(&self, i: usize) -> (usize, usize) {
        let qpos = self.q_pos0 + i;
        let hi = if !self.causal {
            self.n_kv
        } else if qpos < self.kv_pos0 {
            0
        } else {
            (qpos - self.kv_pos0 + 1).min(self.n_kv)
        };
        let lo = match self.window {
            Some(w) => (qpos + 1)
                .saturating_sub(w)
                .saturating_sub(self.kv_pos0)
                .min(hi),
            None => 0,
        };
        (lo, hi)
    }
}

/// Shape of one gated-delta-rule call (Gated DeltaNet, as transformers' recurrent form).
///
/// `q`, `k`: `[t, n_k_heads, dk]`; `v`: `[t, n_v_heads, dv]`; `g` (log decay) and `beta`:
/// `[t, n_v_heads]`; state: `[n_v_heads, dk, dv]`; out: `[t, n_v_heads, dv]`.
/// Value head `h` reads key head `h / (n_v_heads / n_k_heads)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaParams {
    pub t: usize,
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    /// L2-normalise q and k per head (eps 1e-6) before the recurrence.
    pub qk_l2norm: bool,
    /// Multiplier applied to q after the optional normalisation (normally `dk^-0.5`).
    pub q_scale: f32,
}

/// The op set every model forward is written against.
///
/// Object safety is not required (forwards are generic over `B: Backend`); `Send + Sync`
/// is, so a backend can be shared across threads by reference.
pub trait Backend: Send + Sync + Sized + 'static {
    /// An f32 activation buffer.
    type Buf: Send + Sync;
    /// The storage of one weight matrix in its format.
    type WeightBuf: Send + Sync;

    /// Short name for logs and tables ("cpu", "cuda:0").
    fn name(&self) -> String;

    // ---------------------------------------------------------------- memory
    /// A zero-filled buffer of `len` f32.
    fn zeros(&self, len: usize) -> Result<Self::Buf>;
    /// A buffer of `len` f32 whose values are unspecified until written: for an op's output
    /// that the op writes whole before anything reads it (a GPU backend leaves out the zero
    /// fill, which at a long prompt's activations is gigabytes of writes per forward).
    /// Default: [`Backend::zeros`].
    fn scratch(&self, len: usize) -> Result<Self::Buf> {
        self.zeros(len)
    }
    /// Upload host values.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// Download a whole buffer.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Number of f32 in the buffer.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Upload a weight in its storage format. The backend may keep a different internal
    /// layout as long as `matmul` and `gather_rows` give the values the format defines.
    fn upload_weight(&self, w: &HostWeight) -> Result<Weight<Self>>;
    /// Strided 2-D copy:
    /// `dst[dst_off + r*dst_stride + c] = src[src_off + r*src_stride + c]` for `r < rows`, `c < cols`.
    /// Plain contiguous copies are `rows = 1`.
    #[allow(clippy::too_many_arguments)]
    fn copy2d(
        &self,
        src: &Self::Buf,
        src_off: usize,
        src_stride: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        dst_stride: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()>;
    /// Wait for queued work (a no-op on the CPU).
    fn synchronize(&self) -> Result<()>;

    // ---------------------------------------------------------------- linear algebra
    /// `out[r, o] = Σ_i x[r, i] · W[o, i]` for `r < rows`; `x` is `[rows, w.cols]`, `out` is
    /// `[rows, w.rows]` (only the first `rows * w.rows` values are written).
    fn matmul(
        &self,
        x: &Self::Buf,
        rows: usize,
        w: &Weight<Self>,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// Embedding lookup: `out[i, :] = W[ids[i], :]` dequantized to f32. An id `>= w.rows` is an
    /// error naming the id.
    fn gather_rows(&self, table: &Weight<Self>, ids: &[u32], out: &mut Self::Buf) -> Result<()>;

    // ---------------------------------------------------------------- normalisation
    /// Row-wise RMSNorm over rows of width `dim` (the buffer holds `len / dim` rows; also used per
    /// head with `dim = head_dim`): `out = w ⊙ x / sqrt(mean(x²) + eps)`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// Gated RMSNorm (Gated DeltaNet output norm): `out = (w ⊙ rmsnorm(x)) ⊙ silu(z)`, rows of `dim`.
    fn rms_norm_gated(
        &self,
        x: &Self::Buf,
        z: &Self::Buf,
        w: &Self::Buf,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;

    // ---------------------------------------------------------------- position
    /// NeoX rotate-half RoPE in place on `x = [rows, n_heads, head_dim]`, row `r` at position
    /// `pos0 + r`. Only the first `spec.rot_dim()` dims of each head rotate (pairs `i`,
    /// `i + rot_dim/2`); angle = `(pos as f32) * inv_freq[i]` in f32; cos and sin are multiplied
    /// by `spec.attention_scaling`.
    fn rope(
        &self,
        x: &mut Self::Buf,
        rows: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        spec: &RopeSpec,
    ) -> Result<()>;

    // ---------------------------------------------------------------- attention
    /// Scaled dot-product attention with GQA and the mask of [`AttnParams`]; softmax in f32.
    fn attention(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        p: &AttnParams,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// [`Backend::attention`] with the products allowed in reduced precision, for callers whose
    /// result only steers a guess (the drafter: its attention changes what it proposes, never
    /// what the target commits). A backend may compute `Q K^T` and `P V` with operands cut
    /// to 10 mantissa bits (TF32 tensor cores: about `1e-3` relative per product, softmax and
    /// accumulation in f32); rows stay deterministic as in [`Backend::attention`] (a row's
    /// output does not depend on the other rows of the call). The default is the exact op.
    fn attention_fast(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        p: &AttnParams,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.attention(q, k, v, p, out)
    }
    /// [`Backend::attention_fast`] over K and V stored as [`KvStorage::F16`] (rows `0..n_kv`
    /// read). A backend may feed the f16 values to f16 tensor cores as they are. The default
    /// unpacks them into f32 buffers and runs [`Backend::attention_fast`]
    /// ([`attention_fast_kv16_ops`]).
    fn attention_fast_kv16(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        p: &AttnParams,
        out: &mut Self::Buf,
    ) -> Result<()> {
        attention_fast_kv16_ops(self, q, k, v, p, out)
    }

    // ---------------------------------------------------------------- elementwise
    /// `out[i] = silu(gate[i]) · up[i]` for `i < len(gate)`; `up` and `out` must be at least as long.
    fn silu_mul(&self, gate: &Self::Buf, up: &Self::Buf, out: &mut Self::Buf) -> Result<()>;
    /// `dst[dst_off + i] += src[i]` for `i < len`.
    fn add_assign(
        &self,
        dst: &mut Self::Buf,
        dst_off: usize,
        src: &Self::Buf,
        len: usize,
    ) -> Result<()>;
    /// `x *= s` over the whole buffer.
    fn scale(&self, x: &mut Self::Buf, s: f32) -> Result<()>;
    /// `x *= sigmoid(gate)` elementwise over the whole buffer (gated attention output).
    fn mul_sigmoid(&self, x: &mut Self::Buf, gate: &Self::Buf) -> Result<()>;
    /// Index of the maximum of each of `rows` rows of width `cols`, starting at row `row0`
    /// (first occurrence wins on ties; NaN never wins).
    fn argmax_rows(&self, x: &Self::Buf, row0: usize, rows: usize, cols: usize)
        -> Result<Vec<u32>>;

    // ---------------------------------------------------------------- Gated DeltaNet (hybrid targets)
    /// Short causal depthwise conv1d with state, followed by SiLU.
    ///
    /// `x`: `[t, channels]`; `w`: `[channels, kernel]`; `state`: the previous `kernel - 1` input rows,
    /// `[kernel - 1, channels]` (oldest first), updated in place to the last `kernel - 1` rows of
    /// `[state ; x]`. `out[t, c] = silu(Σ_j w[c, j] · xpad[t + j, c])` with `xpad = [state ; x]`.
    /// If `stash` is given (`[t, kernel - 1, channels]`), the state after each step is written there.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv1d(
        &self,
        x: &Self::Buf,
        t: usize,
        channels: usize,
        kernel: usize,
        w: &Self::Buf,
        state: &mut Self::Buf,
        out: &mut Self::Buf,
        stash: Option<&mut Self::Buf>,
    ) -> Result<()>;
    /// Gated DeltaNet gates: `g = -exp(a_log[h]) · softplus(a[t, h] + dt_bias[h])`,
    /// `beta = sigmoid(b[t, h])`, for `a`, `b` of `[t, n_heads]`.
    #[allow(clippy::too_many_arguments)]
    fn gdn_gates(
        &self,
        a: &Self::Buf,
        b: &Self::Buf,
        a_log: &Self::Buf,
        dt_bias: &Self::Buf,
        n_heads: usize,
        g: &mut Self::Buf,
        beta: &mut Self::Buf,
    ) -> Result<()>;
    /// The gated delta rule, token by token (transformers' recurrent form, f32):
    /// `S ← S·exp(g_t); u = (v_t − Sᵀk_t)·β_t; S ← S + k_t uᵀ; o_t = Sᵀq_t`.
    /// If `stash` is given (`[t, n_v_heads, dk, dv]`), the state after each token is written there.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        g: &Self::Buf,
        beta: &Self::Buf,
        p: &DeltaParams,
        state: &mut Self::Buf,
        out: &mut Self::Buf,
        stash: Option<&mut Self::Buf>,
    ) -> Result<()>;

    /// A Gated DeltaNet layer's recurrence from its conv's rows: `qkv` is `[t, ch]` with
    /// `ch = 2 · n_k_heads · dk + n_v_heads · dv` (q, then k, then v in each row), `a` and `b`
    /// the gate projections `[t, n_v_heads]`; the gates as [`Backend::gdn_gates`], then
    /// [`Backend::gated_delta_rule`] over q / k / v. The same bits as those ops (the default,
    /// [`gated_delta_rule_qkv_ops`]); an override may read q / k / v in place and compute the
    /// gates where it uses them.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule_qkv(
        &self,
        qkv: &Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        a_log: &Self::Buf,
        dt_bias: &Self::Buf,
        p: &DeltaParams,
        state: &mut Self::Buf,
        out: &mut Self::Buf,
        stash: Option<&mut Self::Buf>,
    ) -> Result<()> {
        gated_delta_rule_qkv_ops(self, qkv, a, b, a_log, dt_bias, p, state, out, stash)
    }

    // ---------------------------------------------------------------- fused helpers with defaults
    /// Copy `len` contiguous values.
    fn copy(
        &self,
        src: &Self::Buf,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        self.copy2d(src, src_off, len, dst, dst_off, len, 1, len)
    }

    /// Store `src[0..n]` as f16 ([`f16_bits`]) into halves `h0..h0 + n` of `dst`
    /// ([`KvStorage::F16`]'s layout); `h0` and `n` even. The default goes through the host.
    fn f16_pack(&self, src: &Self::Buf, dst: &mut Self::Buf, h0: usize, n: usize) -> Result<()> {
        check_f16_range("f16_pack", h0, n)?;
        if self.len(src) < n {
            return Err(BackendError::shape("f16_pack", "src", n, self.len(src)));
        }
        if self.len(dst) < (h0 + n) / 2 {
            return Err(BackendError::shape(
                "f16_pack",
                "dst (f32 slots)",
                (h0 + n) / 2,
                self.len(dst),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let x = self.download(src)?;
        let packed: Vec<f32> = x[..n]
            .chunks_exact(2)
            .map(|p| f32::from_bits(f16_pair_bits(p[0], p[1])))
            .collect();
        let tmp = self.upload(&packed)?;
        self.copy(&tmp, 0, dst, h0 / 2, n / 2)
    }

    /// Halves `h0..h0 + n` of `src` ([`KvStorage::F16`]) as f32 (exact) into `dst[0..n]`;
    /// `h0` and `n` even. The default goes through the host.
    fn f16_unpack(&self, src: &Self::Buf, h0: usize, n: usize, dst: &mut Self::Buf) -> Result<()> {
        check_f16_range("f16_unpack", h0, n)?;
        let (slots, s0) = (n / 2, h0 / 2);
        if self.len(src) < s0 + slots {
            return Err(BackendError::shape(
                "f16_unpack",
                "src (f32 slots)",
                s0 + slots,
                self.len(src),
            ));
        }
        if self.len(dst) < n {
            return Err(BackendError::shape("f16_unpack", "dst", n, self.len(dst)));
        }
        if n == 0 {
            return Ok(());
        }
        let x = self.download(src)?;
        let vals: Vec<f32> = x[s0..s0 + slots]
            .iter()
            .flat_map(|s| f16_pair_values(s.to_bits()))
            .collect();
        let tmp = self.upload(&vals)?;
        self.copy(&tmp, 0, dst, 0, n)
    }

    /// Sequential (semi-autoregressive) Markov chain of a DSpark drafter, greedy:
    /// for `k in 0..n`: `logits[k] += W2 · W1[prev]`, `tok_k = argmax(logits[k])`, `prev = tok_k`,
    /// starting from `prev = first_prev`. `logits` is `[n, vocab]` and is updated in place;
    /// `w1` is `[vocab, rank]` and `w2` is `[vocab, rank]`. Returns the `n` tokens.
    fn markov_chain(
        &self,
        logits: &mut Self::Buf,
        n: usize,
        vocab: usize,
        first_prev: u32,
        w1: &Weight<Self>,
        w2: &Weight<Self>,
    ) -> Result<Vec<u32>> {
        let mut emb = self.zeros(w1.cols)?;
        let mut bias = self.zeros(vocab)?;
        let mut prev = first_prev;
        let mut toks = Vec::with_capacity(n);
        for k in 0..n {
            self.gather_rows(w1, &[prev], &mut emb)?;
            self.matmul(&emb, 1, w2, &mut bias)?;
            self.add_assign(logits, k * vocab, &bias, vocab)?;
            prev = self.argmax_rows(logits, k, 1, vocab)?[0];
            toks.push(prev);
        }
        Ok(toks)
    }

    // ---------------------------------------------------------------- fused sequences
    // A backend may run each of these as fewer launches; the default runs the separate ops
    // above, and an override must give the same values, bit for bit.

    /// The residual add and the following RMSNorm: `add_assign(h, 0, o, rows * dim)` then
    /// `rms_norm(h, w, dim, eps, out)` (which normalises every row of `h`).
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        h: &mut Self::Buf,
        o: &Self::Buf,
        w: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.add_assign(h, 0, o, rows * dim)?;
        self.rms_norm(h, w, dim, eps, out)
    }

    /// Several matmuls of the same `x`: `matmul(x, rows, ws[i], outs[i])` for each `i` (the
    /// q/k/v or gate/up projections of a layer). `ws` and `outs` have the same length. An
    /// override may sum in other pieces than `matmul` of a matrix alone (within the format's
    /// precision of it), but a row's bits must not depend on `rows`: the targets' exactness
    /// rests on a 1-row decode giving the bits of the same row in a 16-row verify.
    fn matmul_many(
        &self,
        x: &Self::Buf,
        rows: usize,
        ws: &[&Weight<Self>],
        outs: &mut [&mut Self::Buf],
    ) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(BackendError::Invalid {
                op: "matmul_many",
                msg: format!("{} weights but {} outputs", ws.len(), outs.len()),
            });
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, rows, w, out)?;
        }
        Ok(())
    }

    /// The rest of a pre-norm layer after its attention, over the first `rows` rows of the
    /// residual stream `h`: `h += attn W_o^T`, `xn = rms_norm(h, post_norm)`, `h += (silu(xn
    /// W_gate^T) * (xn W_up^T)) W_down^T` ([`layer_tail_ops`]: `matmul`, `add_rms_norm`,
    /// `matmul_many`, `matmul_silu_mul`, `add_assign`). An override gives the same bits and may
    /// leave the scratch buffers unwritten.
    fn layer_tail(
        &self,
        attn: &Self::Buf,
        rows: usize,
        h: &mut Self::Buf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        layer_tail_ops(self, attn, rows, h, w, s)
    }

    /// A Gated DeltaNet layer's gated norm of its recurrence's output into `normed`
    /// ([`Backend::rms_norm_gated`] of `g`), then [`Backend::layer_tail`] of those rows. An
    /// override gives the same bits (`normed` included) and may leave `s` unwritten; it may
    /// hand the normed rows to the o projection without a second pass over them.
    fn gated_norm_layer_tail(
        &self,
        g: &GatedNorm<'_, Self>,
        normed: &mut Self::Buf,
        rows: usize,
        h: &mut Self::Buf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        self.rms_norm_gated(g.x, g.z, g.w, g.dim, g.eps, normed)?;
        self.layer_tail(normed, rows, h, w, s)
    }

    /// A gated attention's output gate ([`Backend::mul_sigmoid`] of `attn` by `gate`, in
    /// place), then [`Backend::layer_tail`] of those rows. An override gives the same bits
    /// (`attn` included) and may leave `s` unwritten; it may hand the gated rows to the o
    /// projection without a second pass over them.
    #[allow(clippy::too_many_arguments)]
    fn sigmoid_gate_layer_tail(
        &self,
        attn: &mut Self::Buf,
        gate: &Self::Buf,
        rows: usize,
        h: &mut Self::Buf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        self.mul_sigmoid(attn, gate)?;
        self.layer_tail(attn, rows, h, w, s)
    }

    /// A layer's attention (`op`: [`Backend::attention`], [`Backend::attention_fast`] or
    /// [`Backend::attention_fast_kv16`]) of the `p.n_q` queries into `attn`, then
    /// [`Backend::layer_tail`] of those rows ([`attention_layer_tail_ops`]). An override
    /// gives the same bits (`attn` included) and may leave `s` unwritten; it may hand the
    /// attention's output to the o projection without a second pass over it.
    #[allow(clippy::too_many_arguments)]
    fn attention_layer_tail(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        p: &AttnParams,
        op: AttnOp,
        attn: &mut Self::Buf,
        h: &mut Self::Buf,
        w: &LayerTail<'_, Self>,
        s: TailScratch<'_, Self>,
    ) -> Result<()> {
        attention_layer_tail_ops(self, q, k, v, p, op, attn, h, w, s)
    }

    /// `rms_norm` of rows `row0..row0 + rows` of `x` (`dim` wide) into rows `0..rows` of
    /// `xn`, then `matmul(xn, rows, w, out)` (a model's final norm and its lm_head over some
    /// rows; [`norm_rows_matmul_ops`]). An override gives the same bits and may leave `xn`
    /// unwritten.
    #[allow(clippy::too_many_arguments)]
    fn norm_rows_matmul(
        &self,
        x: &Self::Buf,
        norm: &Self::Buf,
        dim: usize,
        eps: f32,
        row0: usize,
        rows: usize,
        xn: &mut Self::Buf,
        w: &Weight<Self>,
        out: &mut Self::Buf,
    ) -> Result<()> {
        norm_rows_matmul_ops(self, x, norm, dim, eps, row0, rows, xn, w, out)
    }

    /// A pre-norm layer's projections: `rms_norm(x, w, dim, eps, xn)` (every row of `x`) then
    /// `matmul_many(xn, rows, ws, outs)`. An override gives the same bits and may leave `xn`
    /// unwritten.
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul_many(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        dim: usize,
        eps: f32,
        xn: &mut Self::Buf,
        rows: usize,
        ws: &[&Weight<Self>],
        outs: &mut [&mut Self::Buf],
    ) -> Result<()> {
        self.rms_norm(x, w, dim, eps, xn)?;
        self.matmul_many(xn, rows, ws, outs)
    }

    /// A layer's per-head q/k RMSNorm and RoPE with the rows' K and V written to a cache
    /// ([`qk_norm_rope_kv_ops`]: `rms_norm` x 2, `rope` x 2, `copy` x 2): `q` rows
    /// `0..q_rows` = `rope(rms_norm(q0, q_norm))`; rows `row0..row0 + kv_rows` of `cache.k`
    /// = `rope(rms_norm(k0, k_norm))` and of `cache.v` = `v`; row `r` at position `pos0 + r`. Rows
    /// are `n_heads * head_dim` (q) and `n_kv_heads * head_dim` (k, v, caches) wide;
    /// `q_rows <= kv_rows`. An override gives the same bits and may leave `k_tmp` and the rows
    /// of `q` past `q_rows` unwritten.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv(
        &self,
        q0: &Self::Buf,
        k0: &Self::Buf,
        v: &Self::Buf,
        q_rows: usize,
        kv_rows: usize,
        p: &QkNormRope<'_, Self>,
        q: &mut Self::Buf,
        k_tmp: &mut Self::Buf,
        cache: KvCacheRows<'_, Self>,
    ) -> Result<()> {
        qk_norm_rope_kv_ops(self, q0, k0, v, q_rows, kv_rows, p, q, k_tmp, cache)
    }

    /// The SwiGLU down projection: `silu_mul(gate, up, act)` then `matmul(act, rows, w, out)`.
    /// An override may leave `act` unwritten.
    fn matmul_silu_mul(
        &self,
        gate: &Self::Buf,
        up: &Self::Buf,
        act: &mut Self::Buf,
        rows: usize,
        w: &Weight<Self>,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.silu_mul(gate, up, act)?;
        self.matmul(act, rows, w, out)
    }
}

/// A layer's per-head norms and rotation (see [`Backend::qk_norm_rope_kv`]).
pub struct QkNormRope<'a, B: Backend> {
    /// The q RMSNorm weight `[head_dim]`.
    pub q_norm: &'a B::Buf,
    /// The k RMSNorm weight `[head_dim]`.
    pub k_norm: &'a B::Buf,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    /// Position of row 0.
    pub pos0: usize,
    pub rope: &'a RopeSpec,
}

/// How a KV cache stores its values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvStorage {
    /// One f32 per value: row `j`, kv head `h`, dim `d` at `(j * n_kv_heads + h) * head_dim + d`.
    #[default]
    F32,
    /// f16 ([`Backend::f16_pack`]: round to nearest even, saturating at +-65504), two per f32
    /// slot of the buffer: value `i` (indexed as for `F32`) is the low 16 bits of slot `i / 2`
    /// for even `i`, the high 16 bits for odd `i`. Half the memory and the bytes read; for
    /// attention that may run in reduced precision ([`Backend::attention_fast_kv16`]: the
    /// drafter's). Rows must be an even number of values.
    F16,
}

impl KvStorage {
    /// Buffer slots (f32) holding `n` values.
    pub fn slots(self, n: usize) -> usize {
        match self {
            KvStorage::F32 => n,
            KvStorage::F16 => n.div_ceil(2),
        }
    }
}

/// Where [`Backend::qk_norm_rope_kv`] writes K and V: rows `row0..` of the two caches, stored
/// as `storage` says.
pub struct KvCacheRows<'a, B: Backend> {
    pub k: &'a mut B::Buf,
    pub v: &'a mut B::Buf,
    pub row0: usize,
    pub storage: KvStorage,
}

/// [`Backend::qk_norm_rope_kv`] as the separate ops (the trait's default): `rms_norm(q0 -> q)`
/// and `rms_norm(k0 -> k_tmp)` (every row of the buffers), `rope` of `q_rows` / `kv_rows`
/// rows, then `copy` of `k_tmp` and `v` into the caches.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_kv_ops<B: Backend>(
    be: &B,
    q0: &B::Buf,
    k0: &B::Buf,
    v: &B::Buf,
    q_rows: usize,
    kv_rows: usize,
    p: &QkNormRope<'_, B>,
    q: &mut B::Buf,
    k_tmp: &mut B::Buf,
    cache: KvCacheRows<'_, B>,
) -> Result<()> {
    if q_rows > kv_rows {
        return Err(BackendError::Invalid {
            op: "qk_norm_rope_kv",
            msg: format!("{q_rows} q rows for {kv_rows} k / v rows"),
        });
    }
    let (hd, kvw) = (p.head_dim, p.n_kv_heads * p.head_dim);
    be.rms_norm(q0, p.q_norm, hd, p.eps, q)?;
    be.rms_norm(k0, p.k_norm, hd, p.eps, k_tmp)?;
    be.rope(q, q_rows, p.n_heads, hd, p.pos0, p.rope)?;
    be.rope(k_tmp, kv_rows, p.n_kv_heads, hd, p.pos0, p.rope)?;
    match cache.storage {
        KvStorage::F32 => {
            be.copy(k_tmp, 0, cache.k, cache.row0 * kvw, kv_rows * kvw)?;
            be.copy(v, 0, cache.v, cache.row0 * kvw, kv_rows * kvw)
        }
        KvStorage::F16 => {
            check_f16_rows("qk_norm_rope_kv", kvw)?;
            be.f16_pack(k_tmp, cache.k, cache.row0 * kvw, kv_rows * kvw)?;
            be.f16_pack(v, cache.v, cache.row0 * kvw, kv_rows * kvw)
        }
    }
}

/// The rows of a row-wise op over `len` values of rows `dim` wide (the norms): an error when
/// `dim` is 0 or `len` is not whole rows.
pub fn rows_of(op: &'static str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(BackendError::Invalid {
            op,
            msg: format!("x has {len} values: expected whole rows of dim {dim} (> 0)"),
        });
    }
    Ok(len / dim)
}

/// The half range of [`Backend::f16_pack`] / [`Backend::f16_unpack`]: whole f32 slots.
pub fn check_f16_range(op: &'static str, h0: usize, n: usize) -> Result<()> {
    if !h0.is_multiple_of(2) || !n.is_multiple_of(2) {
        return Err(BackendError::Invalid {
            op,
            msg: format!("halves {h0}..{}: start and count must be even", h0 + n),
        });
    }
    Ok(())
}

/// An f16 cache's rows must hold an even number of values (whole f32 slots per row).
pub fn check_f16_rows(op: &'static str, row_width: usize) -> Result<()> {
    if !row_width.is_multiple_of(2) {
        return Err(BackendError::Invalid {
            op,
            msg: format!("f16 KV rows of {row_width} values: expected an even number"),
        });
    }
    Ok(())
}

/// f32 values -> f16 bits as [`KvStorage::F16`] rounds them: round to nearest even,
/// saturating at +-65504 (what CUDA's `cvt.rn.satfinite.f16x2.f32` gives); NaN stays NaN.
pub fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x.clamp(-65504.0, 65504.0)).to_bits()
}

/// One f32 slot of an f16 buffer holding `lo` (the even value) and `hi` (the odd one).
pub fn f16_pair_bits(lo: f32, hi: f32) -> u32 {
    f16_bits(lo) as u32 | (f16_bits(hi) as u32) << 16
}

/// The two values of one f32 slot of an f16 buffer (exact), even one first.
pub fn f16_pair_values(slot: u32) -> [f32; 2] {
    [slot as u16, (slot >> 16) as u16].map(|h| half::f16::from_bits(h).to_f32())
}

/// [`Backend::attention_fast_kv16`] as unpack + [`Backend::attention_fast`] (the trait's
/// default): rows `0..n_kv` of the f16 caches into f32 buffers first.
pub fn attention_fast_kv16_ops<B: Backend>(
    be: &B,
    q: &B::Buf,
    k: &B::Buf,
    v: &B::Buf,
    p: &AttnParams,
    out: &mut B::Buf,
) -> Result<()> {
    let kvw = p.n_kv_heads * p.head_dim;
    check_f16_rows("attention_fast_kv16", kvw)?;
    let n = p.n_kv * kvw;
    let (mut kf, mut vf) = (be.zeros(n)?, be.zeros(n)?);
    be.f16_unpack(k, 0, n, &mut kf)?;
    be.f16_unpack(v, 0, n, &mut vf)?;
    be.attention_fast(q, &kf, &vf, p, out)
}

/// Which attention op [`Backend::attention_layer_tail`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttnOp {
    /// [`Backend::attention`].
    Exact,
    /// [`Backend::attention_fast`].
    Fast,
    /// [`Backend::attention_fast_kv16`] (K and V stored as [`KvStorage::F16`]).
    FastKv16,
}

impl AttnOp {
    /// Run this attention op of `p.n_q` queries into `out`.
    pub fn run<B: Backend>(
        self,
        be: &B,
        q: &B::Buf,
        k: &B::Buf,
        v: &B::Buf,
        p: &AttnParams,
        out: &mut B::Buf,
    ) -> Result<()> {
        match self {
            AttnOp::Exact => be.attention(q, k, v, p, out),
            AttnOp::Fast => be.attention_fast(q, k, v, p, out),
            AttnOp::FastKv16 => be.attention_fast_kv16(q, k, v, p, out),
        }
    }
}

/// [`Backend::attention_layer_tail`] as the attention op then [`Backend::layer_tail`] (the
/// trait's default).
#[allow(clippy::too_many_arguments)]
pub fn attention_layer_tail_ops<B: Backend>(
    be: &B,
    q: &B::Buf,
    k: &B::Buf,
    v: &B::Buf,
    p: &AttnParams,
    op: AttnOp,
    attn: &mut B::Buf,
    h: &mut B::Buf,
    w: &LayerTail<'_, B>,
    s: TailScratch<'_, B>,
) -> Result<()> {
    op.run(be, q, k, v, p, attn)?;
    be.layer_tail(attn, p.n_q, h, w, s)
}

/// The width of a row of [`Backend::gated_delta_rule_qkv`]'s `qkv` (`2 · n_k_heads · dk +
/// n_v_heads · dv`), and the check that `qkv` holds `t` such rows.
pub fn delta_qkv_width(op: &'static str, qkv_len: usize, p: &DeltaParams) -> Result<usize> {
    let kd = p.n_k_heads * p.dk;
    let ch = 2 * kd + p.n_v_heads * p.dv;
    if qkv_len != p.t * ch {
        return Err(BackendError::shape(op, "qkv", p.t * ch, qkv_len));
    }
    Ok(ch)
}

/// The check that [`Backend::gated_delta_rule_qkv`]'s gate projections `a` and `b` are
/// `[t, n_v_heads]`.
pub fn delta_gate_inputs(
    op: &'static str,
    a_len: usize,
    b_len: usize,
    p: &DeltaParams,
) -> Result<()> {
    let n = p.t * p.n_v_heads;
    if a_len != n {
        return Err(BackendError::shape(op, "a", n, a_len));
    }
    if b_len != n {
        return Err(BackendError::shape(op, "b", n, b_len));
    }
    Ok(())
}

/// [`Backend::gated_delta_rule_qkv`] as the separate ops (the trait's default): q, k and v
/// copied out of `qkv`'s rows, [`Backend::gdn_gates`], then [`Backend::gated_delta_rule`].
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_qkv_ops<B: Backend>(
    be: &B,
    qkv: &B::Buf,
    a: &B::Buf,
    b: &B::Buf,
    a_log: &B::Buf,
    dt_bias: &B::Buf,
    p: &DeltaParams,
    state: &mut B::Buf,
    out: &mut B::Buf,
    stash: Option<&mut B::Buf>,
) -> Result<()> {
    let ch = delta_qkv_width("gated_delta_rule_qkv", be.len(qkv), p)?;
    let (t, kd, vd) = (p.t, p.n_k_heads * p.dk, p.n_v_heads * p.dv);
    delta_gate_inputs("gated_delta_rule_qkv", be.len(a), be.len(b), p)?;
    let mut q = be.scratch(t * kd)?;
    let mut k = be.scratch(t * kd)?;
    let mut v = be.scratch(t * vd)?;
    if t > 0 {
        be.copy2d(qkv, 0, ch, &mut q, 0, kd, t, kd)?;
        be.copy2d(qkv, kd, ch, &mut k, 0, kd, t, kd)?;
        be.copy2d(qkv, 2 * kd, ch, &mut v, 0, vd, t, vd)?;
    }
    let mut g = be.scratch(t * p.n_v_heads)?;
    let mut beta = be.scratch(t * p.n_v_heads)?;
    be.gdn_gates(a, b, a_log, dt_bias, p.n_v_heads, &mut g, &mut beta)?;
    be.gated_delta_rule(&q, &k, &v, &g, &beta, p, state, out, stash)
}

/// [`Backend::norm_rows_matmul`] as the separate ops (the trait's default): the rows copied
/// into a fresh buffer, normed from there into the front of `xn`, then the matmul.
#[allow(clippy::too_many_arguments)]
pub fn norm_rows_matmul_ops<B: Backend>(
    be: &B,
    x: &B::Buf,
    norm: &B::Buf,
    dim: usize,
    eps: f32,
    row0: usize,
    rows: usize,
    xn: &mut B::Buf,
    w: &Weight<B>,
    out: &mut B::Buf,
) -> Result<()> {
    let mut t = be.zeros(rows * dim)?;
    be.copy(x, row0 * dim, &mut t, 0, rows * dim)?;
    be.rms_norm(&t, norm, dim, eps, xn)?;
    be.matmul(xn, rows, w, out)
}

/// A layer's weights after its attention (see [`Backend::layer_tail`]).
pub struct LayerTail<'a, B: Backend> {
    /// o projection `[hidden, heads * head_dim]`.
    pub wo: &'a Weight<B>,
    /// The RMSNorm weight before the MLP `[hidden]`.
    pub post_norm: &'a B::Buf,
    /// Its epsilon.
    pub eps: f32,
    /// SwiGLU gate `[intermediate, hidden]`.
    pub w_gate: &'a Weight<B>,
    /// SwiGLU up `[intermediate, hidden]`.
    pub w_up: &'a Weight<B>,
    /// Down projection `[hidden, intermediate]`.
    pub w_down: &'a Weight<B>,
}

/// The gated RMSNorm of [`Backend::gated_norm_layer_tail`]: `(w · rms_norm(x)) · silu(z)` over
/// each `dim`-wide head of `x` (as [`Backend::rms_norm_gated`]).
pub struct GatedNorm<'a, B: Backend> {
    /// The rows to norm `[rows, heads * dim]`.
    pub x: &'a B::Buf,
    /// The gate `[rows, heads * dim]`.
    pub z: &'a B::Buf,
    /// The norm weight `[dim]`.
    pub w: &'a B::Buf,
    /// The width of a head.
    pub dim: usize,
    /// The norm's epsilon.
    pub eps: f32,
}

/// Scratch of [`Backend::layer_tail`] (an override may leave it unwritten): `o` and `xn`
/// `[rows, hidden]`, `gate`, `up` and `act` `[rows, intermediate]`.
pub struct TailScratch<'a, B: Backend> {
    /// The o projection's and the down projection's outputs.
    pub o: &'a mut B::Buf,
    /// The normed rows.
    pub xn: &'a mut B::Buf,
    /// The gate projection.
    pub gate: &'a mut B::Buf,
    /// The up projection.
    pub up: &'a mut B::Buf,
    /// silu(gate) * up.
    pub act: &'a mut B::Buf,
}

/// [`Backend::layer_tail`] as the separate ops (the trait's default; an override that cannot
/// take a call runs this).
pub fn layer_tail_ops<B: Backend>(
    be: &B,
    attn: &B::Buf,
    rows: usize,
    h: &mut B::Buf,
    w: &LayerTail<'_, B>,
    s: TailScratch<'_, B>,
) -> Result<()> {
    let d = w.wo.rows;
    be.matmul(attn, rows, w.wo, s.o)?;
    be.add_rms_norm(h, s.o, w.post_norm, rows, d, w.eps, s.xn)?;
    mlp_residual_ops(be, rows, h, w, s)
}

/// The SwiGLU MLP of a layer tail from the normed rows in `s.xn`, added into `h`: the part of
/// [`layer_tail_ops`] after the post-attention norm (`matmul_many`, `matmul_silu_mul`,
/// `add_assign`).
pub fn mlp_residual_ops<B: Backend>(
    be: &B,
    rows: usize,
    h: &mut B::Buf,
    w: &LayerTail<'_, B>,
    s: TailScratch<'_, B>,
) -> Result<()> {
    be.matmul_many(
        s.xn,
        rows,
        &[w.w_gate, w.w_up],
        &mut [&mut *s.gate, &mut *s.up],
    )?;
    be.matmul_silu_mul(s.gate, s.up, s.act, rows, w.w_down, s.o)?;
    be.add_assign(h, 0, s.o, rows * w.wo.rows)
}
