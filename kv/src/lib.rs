//! The draft KV cache of dflash-rs, generic over [`Backend`].
//!
//! Per drafter layer it holds K (already k-normed and roped) and V of the context rows, in
//! committed order, row `j` at absolute position `pos0() + j` (always `j` today). Each layer
//! has two buffers of `(capacity + block) * n_kv_heads * head_dim` values, row-major
//! `[row, kv_head, head_dim]`, stored as [`KvStorage`] says: f32 (the default), fed to
//! [`Backend::attention`] directly with `n_kv = len() + block_rows`, or f16 (half the memory
//! and the bytes each draft step reads), fed to [`Backend::attention_fast_kv16`].
//!
//! A round of the drafter:
//! 1. context rows: [`DraftKv::append`] writes `t` new rows of a layer at `len()` (all layers),
//!    then [`DraftKv::commit`]`(t)` makes them part of the context. Long prompts go in
//!    [`INGEST_CHUNK`] rows at a time (see [`chunks`]).
//! 2. block rows: [`DraftKv::write_block`] writes the block's K/V after `len()` for one layer;
//!    attention then reads `len() + b` rows. Block rows are never committed: the next round
//!    (or the next append) overwrites them.
//! 3. rollback: [`DraftKv::crop`]`(n)` keeps the first `n` context rows.
//!
//! Overflow of the capacity is an error value ([`KvError::Overflow`]), never a panic.

use std::ops::Range;

use dflash_backend::{Backend, BackendError, KvStorage};
use thiserror::Error;

/// Rows ingested per chunk when a long prompt fills the cache (bounds transient memory).
pub const INGEST_CHUNK: usize = 256;

/// Errors of the draft KV cache.
#[derive(Debug, Error)]
pub enum KvError {
    #[error("draft KV overflow: {needed} rows needed, capacity {capacity}")]
    Overflow { needed: usize, capacity: usize },
    #[error("draft KV: {rows} block rows exceed the block size {block}")]
    Block { rows: usize, block: usize },
    #[error("draft KV: layer {layer} out of range ({n_layers} layers)")]
    Layer { layer: usize, n_layers: usize },
    #[error("draft KV: crop to {requested} rows, but only {len} are committed")]
    Crop { requested: usize, len: usize },
    #[error(
        "draft KV: commit of {needed} rows, but layer {layer} has {written} rows written after len"
    )]
    NotWritten {
        layer: usize,
        written: usize,
        needed: usize,
    },
    #[error("draft KV: invalid shape: {0}")]
    Shape(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, KvError>;

/// Dimensions of a draft KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Context rows the cache can hold.
    pub capacity: usize,
    /// Transient block rows kept after the context (the drafter's block size).
    pub block: usize,
}

impl KvShape {
    /// f32 values per row (`n_kv_heads * head_dim`).
    pub fn row_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

struct LayerKv<B: Backend> {
    k: B::Buf,
    v: B::Buf,
    /// Context rows written at `len` by `append` since the last commit / crop.
    staged: usize,
}

/// The draft KV cache: see the crate docs.
pub struct DraftKv<B: Backend> {
    shape: KvShape,
    storage: KvStorage,
    layers: Vec<LayerKv<B>>,
    len: usize,
}

impl<B: Backend> std::fmt::Debug for DraftKv<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftKv")
            .field("shape", &self.shape)
            .field("storage", &self.storage)
            .field("len", &self.len)
            .finish()
    }
}

impl<B: Backend> DraftKv<B> {
    /// Allocate zeroed f32 buffers for every layer.
    pub fn new(be: &B, shape: KvShape) -> Result<Self> {
        Self::with_storage(be, shape, KvStorage::F32)
    }

    /// Allocate zeroed buffers for every layer, stored as `storage` says (f16 needs an even
    /// `n_kv_heads * head_dim`).
    pub fn with_storage(be: &B, shape: KvShape, storage: KvStorage) -> Result<Self> {
        if shape.n_layers == 0 || shape.n_kv_heads == 0 || shape.head_dim == 0 {
            return Err(KvError::Shape(format!(
                "{shape:?}: layers, kv heads and head_dim must be positive"
            )));
        }
        if storage == KvStorage::F16 && !shape.row_width().is_multiple_of(2) {
            return Err(KvError::Shape(format!(
                "{shape:?}: f16 storage needs an even row width, got {}",
                shape.row_width()
            )));
        }
        let rows = shape
            .capacity
            .checked_add(shape.block)
            .ok_or_else(|| KvError::Shape(format!("{shape:?}: capacity + block overflows")))?;
        let n = rows
            .checked_mul(shape.row_width())
            .map(|n| storage.slots(n))
            .ok_or_else(|| KvError::Shape(format!("{shape:?}: buffer size overflows")))?;
        let mut layers = Vec::with_capacity(shape.n_layers);
        for _ in 0..shape.n_layers {
            layers.push(LayerKv {
                k: be.zeros(n)?,
                v: be.zeros(n)?,
                staged: 0,
            });
        }
        Ok(DraftKv {
            shape,
            storage,
            layers,
            len: 0,
        })
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// How the buffers store K and V.
    pub fn storage(&self) -> KvStorage {
        self.storage
    }

    /// Committed context rows.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Context rows the cache can hold.
    pub fn capacity(&self) -> usize {
        self.shape.capacity
    }

    /// Context rows that still fit.
    pub fn remaining(&self) -> usize {
        self.shape.capacity - self.len
    }

    /// Block rows available after the context.
    pub fn block(&self) -> usize {
        self.shape.block
    }

    pub fn n_layers(&self) -> usize {
        self.shape.n_layers
    }

    /// f32 values per row.
    pub fn row_width(&self) -> usize {
        self.shape.row_width()
    }

    /// Absolute position of row 0 (the `kv_pos0` of attention).
    pub fn pos0(&self) -> usize {
        0
    }

    /// Error unless `t` more context rows fit.
    pub fn ensure_room(&self, t: usize) -> Result<()> {
        let needed = self.len.saturating_add(t);
        if needed > self.shape.capacity {
            return Err(KvError::Overflow {
                needed,
                capacity: self.shape.capacity,
            });
        }
        Ok(())
    }

    fn layer_index(&self, layer: usize) -> Result<usize> {
        if layer >= self.layers.len() {
            return Err(KvError::Layer {
                layer,
                n_layers: self.layers.len(),
            });
        }
        Ok(layer)
    }

    /// K and V buffers of a layer (`(capacity + block)` rows stored as [`storage`](Self::storage)
    /// says; the first `len()` are context, the next ones whatever `write_block` / `append` put
    /// there).
    pub fn layer(&self, layer: usize) -> Result<(&B::Buf, &B::Buf)> {
        let l = &self.layers[self.layer_index(layer)?];
        Ok((&l.k, &l.v))
    }

    /// K buffer of a layer.
    pub fn k(&self, layer: usize) -> Result<&B::Buf> {
        Ok(self.layer(layer)?.0)
    }

    /// V buffer of a layer.
    pub fn v(&self, layer: usize) -> Result<&B::Buf> {
        Ok(self.layer(layer)?.1)
    }

    fn write_at_len(
        &mut self,
        be: &B,
        layer: usize,
        k_rows: &B::Buf,
        v_rows: &B::Buf,
        t: usize,
    ) -> Result<()> {
        let w = self.row_width();
        let n = t * w;
        let off = self.len * w;
        let l = &mut self.layers[layer];
        match self.storage {
            KvStorage::F32 => {
                be.copy(k_rows, 0, &mut l.k, off, n)?;
                be.copy(v_rows, 0, &mut l.v, off, n)?;
            }
            KvStorage::F16 => {
                be.f16_pack(k_rows, &mut l.k, off, n)?;
                be.f16_pack(v_rows, &mut l.v, off, n)?;
            }
        }
        Ok(())
    }

    /// Write `t` new context rows of `layer` at `len()` (the first `t` rows of `k_rows`,
    /// `v_rows`, each `[t, n_kv_heads, head_dim]`). They become context at [`commit`](Self::commit).
    pub fn append(
        &mut self,
        be: &B,
        layer: usize,
        k_rows: &B::Buf,
        v_rows: &B::Buf,
        t: usize,
    ) -> Result<()> {
        let layer = self.check_append(layer, t)?;
        self.write_at_len(be, layer, k_rows, v_rows, t)?;
        self.layers[layer].staged = t;
        Ok(())
    }

    /// The layer index of `t` rows appended to `layer`, after the checks (the layer exists,
    /// the rows fit).
    fn check_append(&self, layer: usize, t: usize) -> Result<usize> {
        let layer = self.layer_index(layer)?;
        self.ensure_room(t)?;
        Ok(layer)
    }

    /// The buffers [`append`](Self::append) writes, for a writer that produces the rows
    /// itself (a fused norm + RoPE + cache-write op): `layer`'s K and V caches and the first
    /// row (`len()`), after the same checks; write rows `row0..row0 + t`, then
    /// [`commit`](Self::commit).
    pub fn append_rows_mut(
        &mut self,
        layer: usize,
        t: usize,
    ) -> Result<(&mut B::Buf, &mut B::Buf, usize)> {
        let layer = self.check_append(layer, t)?;
        let row0 = self.len;
        let l = &mut self.layers[layer];
        l.staged = t;
        Ok((&mut l.k, &mut l.v, row0))
    }

    /// Make the `t` rows appended to every layer part of the context (`len += t`).
    pub fn commit(&mut self, t: usize) -> Result<()> {
        self.ensure_room(t)?;
        if t > 0 {
            if let Some((layer, l)) = self.layers.iter().enumerate().find(|(_, l)| l.staged < t) {
                return Err(KvError::NotWritten {
                    layer,
                    written: l.staged,
                    needed: t,
                });
            }
        }
        self.len += t;
        for l in &mut self.layers {
            l.staged = 0;
        }
        Ok(())
    }

    /// Write `b <= block()` transient block rows of `layer` right after the context; attention
    /// over `[ctx ; block]` then reads `len() + b` rows. Never committed.
    pub fn write_block(
        &mut self,
        be: &B,
        layer: usize,
        k_rows: &B::Buf,
        v_rows: &B::Buf,
        b: usize,
    ) -> Result<()> {
        let layer = self.check_block(layer, b)?;
        self.write_at_len(be, layer, k_rows, v_rows, b)?;
        self.layers[layer].staged = 0;
        Ok(())
    }

    /// The layer index of `b` block rows of `layer`, after the checks (the layer exists,
    /// `b <= block()`).
    fn check_block(&self, layer: usize, b: usize) -> Result<usize> {
        let layer = self.layer_index(layer)?;
        if b > self.shape.block {
            return Err(KvError::Block {
                rows: b,
                block: self.shape.block,
            });
        }
        Ok(layer)
    }

    /// The buffers [`write_block`](Self::write_block) writes, for a writer that produces the
    /// rows itself (a fused norm + RoPE + cache-write op): `layer`'s K and V caches and the
    /// first block row (`len()`), after the same checks; write rows `row0..row0 + b`.
    pub fn block_rows_mut(
        &mut self,
        layer: usize,
        b: usize,
    ) -> Result<(&mut B::Buf, &mut B::Buf, usize)> {
        let layer = self.check_block(layer, b)?;
        let row0 = self.len;
        let l = &mut self.layers[layer];
        l.staged = 0;
        Ok((&mut l.k, &mut l.v, row0))
    }

    /// Keep the first `n` context rows (rollback). Rows written but not committed are dropped.
    pub fn crop(&mut self, n: usize) -> Result<()> {
        if n > self.len {
            return Err(KvError::Crop {
                requested: n,
                len: self.len,
            });
        }
        self.len = n;
        for l in &mut self.layers {
            l.staged = 0;
        }
        Ok(())
    }

    /// Forget every row.
    pub fn clear(&mut self) {
        self.len = 0;
        for l in &mut self.layers {
            l.staged = 0;
        }
    }
}

/// Consecutive ranges of at most `size` rows covering `0..total` (chunked ingest).
/// A `size` of 0 is treated as 1.
pub fn chunks(total: usize, size: usize) -> impl Iterator<Item = Range<usize>> {
    let size = size.max(1);
    (0..total.div_ceil(size)).map(move |i| i * size..((i + 1) * size).min(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_in_order() {
        assert_eq!(chunks(0, 256).count(), 0);
        assert_eq!(chunks(5, 2).collect::<Vec<_>>(), vec![0..2, 2..4, 4..5]);
        assert_eq!(chunks(512, 256).collect::<Vec<_>>(), vec![0..256, 256..512]);
        assert_eq!(chunks(3, 0).collect::<Vec<_>>(), vec![0..1, 1..2, 2..3]);
    }
}
