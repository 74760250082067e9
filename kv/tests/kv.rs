use dflash_backend::cpu::Cpu;
use dflash_backend::{AttnParams, Backend};
use dflash_kv::{chunks, DraftKv, KvError, KvShape, INGEST_CHUNK};
use proptest::prelude::*;

fn shape(cap: usize) -> KvShape {
    KvShape {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 3,
        capacity: cap,
        block: 4,
    }
}

/// Rows whose values encode (tag, row, element) so misplaced rows are visible.
fn rows(tag: f32, first: usize, t: usize, w: usize) -> Vec<f32> {
    (0..t * w)
        .map(|i| tag * 10000.0 + ((first + i / w) * 100 + i % w) as f32)
        .collect()
}

#[test]
fn append_commit_and_read_back() {
    let be = Cpu::default();
    let mut kv = DraftKv::new(&be, shape(10)).unwrap();
    let w = kv.row_width();
    assert_eq!((kv.len(), kv.capacity(), kv.remaining(), w), (0, 10, 10, 6));
    for layer in 0..2 {
        kv.append(
            &be,
            layer,
            &rows(layer as f32 + 1.0, 0, 3, w),
            &rows(-(layer as f32) - 1.0, 0, 3, w),
            3,
        )
        .unwrap();
    }
    kv.commit(3).unwrap();
    assert_eq!(kv.len(), 3);
    for layer in 0..2 {
        kv.append(
            &be,
            layer,
            &rows(layer as f32 + 1.0, 3, 2, w),
            &rows(-(layer as f32) - 1.0, 3, 2, w),
            2,
        )
        .unwrap();
    }
    kv.commit(2).unwrap();
    for layer in 0..2 {
        let (k, v) = kv.layer(layer).unwrap();
        assert_eq!(k.len(), (10 + 4) * w);
        assert_eq!(&k[..5 * w], &rows(layer as f32 + 1.0, 0, 5, w)[..]);
        assert_eq!(&v[..5 * w], &rows(-(layer as f32) - 1.0, 0, 5, w)[..]);
    }
}

#[test]
fn block_rows_are_transient() {
    let be = Cpu::default();
    let mut kv = DraftKv::new(&be, shape(6)).unwrap();
    let w = kv.row_width();
    for layer in 0..2 {
        kv.append(&be, layer, &rows(1.0, 0, 6, w), &rows(2.0, 0, 6, w), 6)
            .unwrap();
    }
    kv.commit(6).unwrap();
    // The cache is full, yet a whole block still fits after the context.
    kv.write_block(&be, 0, &rows(9.0, 6, 4, w), &rows(8.0, 6, 4, w), 4)
        .unwrap();
    assert_eq!(kv.len(), 6);
    assert_eq!(&kv.k(0).unwrap()[6 * w..10 * w], &rows(9.0, 6, 4, w)[..]);
    assert_eq!(&kv.k(0).unwrap()[..6 * w], &rows(1.0, 0, 6, w)[..]);
    assert!(matches!(
        kv.write_block(&be, 0, &rows(9.0, 6, 5, w), &rows(8.0, 6, 5, w), 5),
        Err(KvError::Block { rows: 5, block: 4 })
    ));
    // Block rows cannot be committed.
    kv.crop(4).unwrap();
    kv.write_block(&be, 1, &rows(9.0, 4, 2, w), &rows(8.0, 4, 2, w), 2)
        .unwrap();
    assert!(matches!(
        kv.commit(2),
        Err(KvError::NotWritten { needed: 2, .. })
    ));
}

#[test]
fn row_accessors_write_where_append_and_write_block_do() {
    // A writer that fills the rows itself (the fused norm + RoPE + cache-write op) through
    // append_rows_mut / block_rows_mut leaves the cache as append / write_block do, with the
    // same checks.
    let be = Cpu::default();
    let (mut a, mut b) = (
        DraftKv::new(&be, shape(6)).unwrap(),
        DraftKv::new(&be, shape(6)).unwrap(),
    );
    let w = a.row_width();
    for (first, t) in [(0usize, 3usize), (3, 3)] {
        for layer in 0..2 {
            let (kr, vr) = (
                rows(1.0 + layer as f32, first, t, w),
                rows(-1.0, first, t, w),
            );
            a.append(&be, layer, &kr, &vr, t).unwrap();
            let (k, v, row0) = b.append_rows_mut(layer, t).unwrap();
            assert_eq!(row0, first);
            be.copy(&kr, 0, k, row0 * w, t * w).unwrap();
            be.copy(&vr, 0, v, row0 * w, t * w).unwrap();
        }
        a.commit(t).unwrap();
        b.commit(t).unwrap();
    }
    // Full: one more row is an overflow either way; a block still fits after the context.
    assert!(matches!(
        b.append_rows_mut(0, 1),
        Err(KvError::Overflow { .. })
    ));
    assert!(matches!(
        b.block_rows_mut(0, 5),
        Err(KvError::Block { rows: 5, block: 4 })
    ));
    assert!(b.block_rows_mut(2, 1).is_err());
    let blk = rows(9.0, 6, 4, w);
    a.write_block(&be, 1, &blk, &blk, 4).unwrap();
    let (k, v, row0) = b.block_rows_mut(1, 4).unwrap();
    assert_eq!(row0, 6);
    be.copy(&blk, 0, k, row0 * w, 4 * w).unwrap();
    be.copy(&blk, 0, v, row0 * w, 4 * w).unwrap();
    for layer in 0..2 {
        assert_eq!(
            a.layer(layer).unwrap(),
            b.layer(layer).unwrap(),
            "layer {layer}"
        );
    }
    assert_eq!((a.len(), b.len()), (6, 6));
    // Block rows stay uncommitted.
    b.crop(4).unwrap();
    b.block_rows_mut(0, 2).unwrap();
    assert!(matches!(
        b.commit(2),
        Err(KvError::NotWritten { needed: 2, .. })
    ));
}

#[test]
fn overflow_crop_and_layer_errors() {
    let be = Cpu::default();
    let mut kv = DraftKv::new(&be, shape(5)).unwrap();
    let w = kv.row_width();
    let r = rows(1.0, 0, 6, w);
    match kv.append(&be, 0, &r, &r, 6) {
        Err(KvError::Overflow {
            needed: 6,
            capacity: 5,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(kv.ensure_room(5).is_ok());
    assert!(matches!(
        kv.ensure_room(usize::MAX),
        Err(KvError::Overflow { .. })
    ));
    assert!(matches!(
        kv.append(&be, 2, &r, &r, 1),
        Err(KvError::Layer {
            layer: 2,
            n_layers: 2
        })
    ));
    assert!(matches!(kv.k(7), Err(KvError::Layer { layer: 7, .. })));
    // Committing rows that were not written to every layer is an error.
    kv.append(&be, 0, &r, &r, 3).unwrap();
    assert!(matches!(
        kv.commit(3),
        Err(KvError::NotWritten {
            layer: 1,
            written: 0,
            needed: 3
        })
    ));
    kv.append(&be, 1, &r, &r, 3).unwrap();
    assert!(matches!(
        kv.commit(4),
        Err(KvError::NotWritten { needed: 4, .. })
    ));
    kv.commit(3).unwrap();
    assert!(matches!(
        kv.crop(4),
        Err(KvError::Crop {
            requested: 4,
            len: 3
        })
    ));
    // Too short a source is a backend shape error, not a panic.
    assert!(matches!(
        kv.append(&be, 0, &r[..w].to_vec(), &r, 2),
        Err(KvError::Backend(_))
    ));
    assert!(matches!(
        DraftKv::<Cpu>::new(
            &be,
            KvShape {
                head_dim: 0,
                ..shape(5)
            }
        ),
        Err(KvError::Shape(_))
    ));
    assert!(matches!(
        DraftKv::<Cpu>::new(
            &be,
            KvShape {
                capacity: usize::MAX,
                ..shape(5)
            }
        ),
        Err(KvError::Shape(_))
    ));
    kv.clear();
    assert!(kv.is_empty());
}

#[test]
fn chunked_ingest_equals_one_shot() {
    let be = Cpu::default();
    let total = 600;
    let s = KvShape {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 2,
        capacity: 700,
        block: 16,
    };
    let w = s.row_width();
    let all = rows(3.0, 0, total, w);
    let mut a = DraftKv::new(&be, s).unwrap();
    a.append(&be, 0, &all, &all, total).unwrap();
    a.commit(total).unwrap();
    let mut b = DraftKv::new(&be, s).unwrap();
    let ranges: Vec<_> = chunks(total, INGEST_CHUNK).collect();
    assert_eq!(ranges, vec![0..256, 256..512, 512..600]);
    for r in ranges {
        let part = all[r.start * w..r.end * w].to_vec();
        b.append(&be, 0, &part, &part, r.len()).unwrap();
        b.commit(r.len()).unwrap();
    }
    assert_eq!(a.len(), b.len());
    assert_eq!(&a.k(0).unwrap()[..total * w], &b.k(0).unwrap()[..total * w]);
    assert_eq!(&a.v(0).unwrap()[..total * w], &b.v(0).unwrap()[..total * w]);
}

#[test]
fn buffers_feed_attention_over_ctx_and_block() {
    // Attention over [ctx ; block] read straight from the cache equals attention over
    // freshly concatenated buffers.
    let be = Cpu::default();
    let s = KvShape {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 4,
        capacity: 8,
        block: 3,
    };
    let w = s.row_width();
    let ctx: Vec<f32> = (0..5 * w).map(|i| ((i * 7) % 11) as f32 * 0.1).collect();
    let blk: Vec<f32> = (0..3 * w).map(|i| ((i * 5) % 13) as f32 * 0.1).collect();
    let mut kv = DraftKv::new(&be, s).unwrap();
    kv.append(&be, 0, &ctx, &ctx, 5).unwrap();
    kv.commit(5).unwrap();
    kv.write_block(&be, 0, &blk, &blk, 3).unwrap();
    let q: Vec<f32> = (0..3 * w).map(|i| ((i * 3) % 7) as f32 * 0.2).collect();
    let p = AttnParams {
        n_q: 3,
        n_kv: kv.len() + 3,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 4,
        q_pos0: 5,
        kv_pos0: kv.pos0(),
        causal: false,
        window: None,
        scale: 0.5,
    };
    let mut out_cache = vec![0.0; 3 * w];
    let (k, v) = kv.layer(0).unwrap();
    be.attention(&q, k, v, &p, &mut out_cache).unwrap();
    let mut cat = ctx.clone();
    cat.extend_from_slice(&blk);
    let mut out_cat = vec![0.0; 3 * w];
    be.attention(&q, &cat, &cat, &p, &mut out_cat).unwrap();
    assert_eq!(out_cache, out_cat);
}

#[derive(Clone, Debug)]
enum Op {
    Ingest(usize),
    Block(usize),
    Crop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..7).prop_map(Op::Ingest),
        (0usize..6).prop_map(Op::Block),
        (0usize..30).prop_map(Op::Crop)
    ]
}

proptest! {
    /// Random rounds of ingest / block / crop against a plain Vec model of the committed rows.
    #[test]
    fn matches_a_vec_model(ops in proptest::collection::vec(op(), 1..40)) {
        let be = Cpu::default();
        let s = shape(20);
        let w = s.row_width();
        let mut kv = DraftKv::new(&be, s).unwrap();
        let mut model: Vec<Vec<f32>> = vec![Vec::new(); 2];
        let mut tag = 0.0f32;
        for op in ops {
            tag += 1.0;
            match op {
                Op::Ingest(t) => {
                    let res: Result<(), KvError> = (|| {
                        for layer in 0..2 {
                            let r = rows(tag + layer as f32, kv.len(), t, w);
                            kv.append(&be, layer, &r, &r, t)?;
                        }
                        kv.commit(t)
                    })();
                    if model[0].len() / w + t > 20 {
                        let overflowed = matches!(res, Err(KvError::Overflow { .. }));
                        prop_assert!(overflowed);
                    } else {
                        prop_assert!(res.is_ok());
                        for (layer, m) in model.iter_mut().enumerate() {
                            m.extend(rows(tag + layer as f32, m.len() / w, t, w));
                        }
                    }
                }
                Op::Block(b) => {
                    let r = rows(-tag, 0, b, w);
                    let res = kv.write_block(&be, 0, &r, &r, b);
                    prop_assert_eq!(res.is_ok(), b <= 4);
                }
                Op::Crop(n) => {
                    let res = kv.crop(n);
                    if n <= model[0].len() / w {
                        prop_assert!(res.is_ok());
                        for m in model.iter_mut() {
                            m.truncate(n * w);
                        }
                    } else {
                        let crop_err = matches!(res, Err(KvError::Crop { .. }));
                        prop_assert!(crop_err);
                    }
                }
            }
            prop_assert_eq!(kv.len() * w, model[0].len());
            for (layer, m) in model.iter().enumerate() {
                prop_assert_eq!(&kv.k(layer).unwrap()[..m.len()], &m[..]);
                prop_assert_eq!(&kv.v(layer).unwrap()[..m.len()], &m[..]);
            }
        }
    }
}

/// An f16 cache holds the rows `append` / `write_block` were given, rounded to f16
/// (`f16_bits`), two values per f32 slot, in half the slots of an f32 one; an odd row width
/// is refused.
#[test]
fn f16_storage_packs_the_rows() {
    use dflash_backend::KvStorage;
    let be = Cpu::default();
    let shape = KvShape {
        n_layers: 1,
        n_kv_heads: 2,
        head_dim: 4,
        capacity: 6,
        block: 2,
    };
    let mut kv = DraftKv::with_storage(&be, shape, KvStorage::F16).unwrap();
    assert_eq!(kv.storage(), KvStorage::F16);
    let w = kv.row_width();
    assert_eq!(be.len(kv.k(0).unwrap()), (6 + 2) * w / 2);
    // Values that f16 rounds (and one it saturates).
    let k: Vec<f32> = (0..3 * w).map(|i| 1.0 + i as f32 / 3000.0).collect();
    let mut v: Vec<f32> = (0..3 * w).map(|i| -(i as f32) * 0.1).collect();
    v[5] = 1e6;
    kv.append(&be, 0, &k, &v, 3).unwrap();
    kv.commit(3).unwrap();
    kv.write_block(&be, 0, &k[..2 * w].to_vec(), &v[..2 * w].to_vec(), 2)
        .unwrap();
    let unpack = |buf: &Vec<f32>, n: usize| {
        let mut out = vec![0.0f32; n];
        be.f16_unpack(buf, 0, n, &mut out).unwrap();
        out
    };
    let round = |x: f32| half::f16::from_bits(dflash_backend::f16_bits(x)).to_f32();
    let (kc, vc) = kv.layer(0).unwrap();
    let (ku, vu) = (unpack(kc, 5 * w), unpack(vc, 5 * w));
    for i in 0..3 * w {
        assert_eq!(ku[i], round(k[i]), "k {i}");
        assert_eq!(vu[i], round(v[i]), "v {i}");
    }
    assert_eq!(vu[5], 65504.0, "saturated");
    assert_ne!(ku[1], k[1], "rounded to f16");
    for i in 0..2 * w {
        assert_eq!(ku[3 * w + i], round(k[i]), "block k {i}");
    }
    let odd = KvShape {
        head_dim: 3,
        n_kv_heads: 1,
        ..shape
    };
    assert!(matches!(
        DraftKv::with_storage(&be, odd, KvStorage::F16),
        Err(KvError::Shape(_))
    ));
}
