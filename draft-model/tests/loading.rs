//! Loading: bad input gives error values (never panics), sharded / f16 / f32 checkpoints,
//! census gate, precision policy, layout override.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostWeight, WeightFormat};
use dflash_draft_model::{
    DraftConfig, DraftError, DraftOptions, Drafter, LentWeights, LoadOptions, Precision, RowLayout,
    SafetensorsCheckpoint, TensorMap, TensorSource,
};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(case)
}

/// A fresh scratch directory under the system temp dir.
fn scratch(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "dflash-draft-model-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Copy a fixture's draft checkpoint dir into a scratch dir.
fn copy_draft(case: &str, tag: &str) -> PathBuf {
    let d = scratch(tag);
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(case).join("draft").join(f), d.join(f)).unwrap();
    }
    d
}

/// name -> (dtype, shape, raw bytes)
type Raw = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn read_raw(path: &Path) -> Raw {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Raw = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn write_raw(path: &Path, raw: &Raw) {
    let views: Vec<(String, TensorView)> = raw
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn bf16_to_f32(b: &[u8]) -> Vec<f32> {
    dflash_quant::bf16_bytes_to_f32(b).unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The fixture's lend + taps + block, and the draft logits of a full forward.
struct Io {
    lend: LentWeights<Cpu>,
    embed: Vec<f32>,
    taps: Vec<f32>,
    ctx: usize,
    block: Vec<u32>,
}

fn io(case: &str) -> Io {
    let be = Cpu::new();
    let bytes = std::fs::read(fixture(case).join("io.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f = |n: &str| -> (Vec<usize>, Vec<f32>) {
        let t = st.tensor(n).unwrap();
        (
            t.shape().to_vec(),
            t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    };
    let w = |n: &str| {
        let (s, v) = f(n);
        be.upload_weight(&HostWeight::from_f32(n, s[0], s[1], &v, WeightFormat::F32).unwrap())
            .unwrap()
    };
    let lend = LentWeights::new(w("target_embed"), w("target_lm_head")).unwrap();
    let embed = f("target_embed").1;
    let (ts, taps) = f("taps");
    let bt = st.tensor("block_tokens").unwrap();
    let block = bt
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    Io {
        lend,
        embed,
        taps,
        ctx: ts[0],
        block,
    }
}

fn full_hidden(dr: &Drafter<Cpu>, io: &Io) -> Vec<f32> {
    let be = Cpu::new();
    let taps = be.upload(&io.taps).unwrap();
    let out = dr
        .forward_full(&be, &io.lend, &taps, io.ctx, &io.block, 1.0, false)
        .unwrap();
    be.download(&out.final_hidden).unwrap()
}

fn load(dir: &Path, opts: &LoadOptions) -> Result<Drafter<Cpu>, DraftError> {
    Drafter::load(&Cpu::new(), dir, opts)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

// ---------------------------------------------------------------- bad input

#[test]
fn corrupt_header_is_an_error() {
    let d = copy_draft("dflash_plain", "corrupt");
    let mut bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    // Keep the length prefix, scribble over the JSON header.
    for b in bytes[8..40].iter_mut() {
        *b = b'#';
    }
    std::fs::write(d.join("model.safetensors"), &bytes).unwrap();
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::Safetensors { path, msg }) => {
            assert!(path.ends_with("model.safetensors"), "{path:?}");
            assert!(!msg.is_empty());
        }
        other => panic!("expected a safetensors error, got {other:?}"),
    }
    // An absurd header length.
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(d.join("model.safetensors"), &bytes).unwrap();
    assert!(matches!(
        load(&d, &LoadOptions::default()),
        Err(DraftError::Safetensors { .. })
    ));
    // An empty file.
    std::fs::write(d.join("model.safetensors"), b"").unwrap();
    assert!(matches!(
        load(&d, &LoadOptions::default()),
        Err(DraftError::Safetensors { .. })
    ));
}

#[test]
fn truncated_file_is_an_error() {
    let d = copy_draft("dflash_plain", "trunc");
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    for cut in [bytes.len() - 1, bytes.len() / 2, 100, 7] {
        std::fs::write(d.join("model.safetensors"), &bytes[..cut]).unwrap();
        match load(&d, &LoadOptions::default()) {
            Err(DraftError::Safetensors { .. }) => {}
            other => panic!("cut at {cut}: expected a safetensors error, got {other:?}"),
        }
    }
}

#[test]
fn missing_files_and_config_keys() {
    let d = scratch("nofiles");
    assert!(matches!(
        load(&d, &LoadOptions::default()),
        Err(DraftError::Io { .. })
    ));

    let d = copy_draft("dflash_plain", "nokey");
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v.as_object_mut().unwrap().remove("num_attention_heads");
    std::fs::write(d.join("config.json"), v.to_string()).unwrap();
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::MissingKey(k)) => assert_eq!(k, "num_attention_heads"),
        other => panic!("{other:?}"),
    }
    v["num_attention_heads"] = 4.into();
    v["dflash_config"]
        .as_object_mut()
        .unwrap()
        .remove("mask_token_id");
    std::fs::write(d.join("config.json"), v.to_string()).unwrap();
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::MissingKey(k)) => assert_eq!(k, "dflash_config.mask_token_id"),
        other => panic!("{other:?}"),
    }
    std::fs::write(d.join("config.json"), "{\"hidden_size\": 12").unwrap();
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::Json { path, .. }) => assert!(path.ends_with("config.json")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let d = copy_draft("dflash_plain", "shape");
    let mut raw = read_raw(&d.join("model.safetensors"));
    let e = raw
        .iter_mut()
        .find(|t| t.0 == "layers.1.self_attn.k_proj.weight")
        .unwrap();
    // [64, 128] -> [32, 256] (same byte count)
    e.2 = vec![32, 256];
    write_raw(&d.join("model.safetensors"), &raw);
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::Shape {
            tensor,
            expected,
            found,
        }) => {
            assert_eq!(tensor, "layers.1.self_attn.k_proj.weight");
            assert_eq!(expected, vec![64, 128]);
            assert_eq!(found, vec![32, 256]);
            let msg = DraftError::Shape {
                tensor,
                expected,
                found,
            }
            .to_string();
            assert!(
                msg.contains("k_proj") && msg.contains("[64, 128]") && msg.contains("[32, 256]")
            );
        }
        other => panic!("{other:?}"),
    }
    // A missing tensor is named too.
    let mut raw = read_raw(&fixture("dflash_plain").join("draft/model.safetensors"));
    raw.retain(|t| t.0 != "layers.0.mlp.down_proj.weight");
    write_raw(&d.join("model.safetensors"), &raw);
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::MissingTensor(n)) => assert_eq!(n, "layers.0.mlp.down_proj.weight"),
        other => panic!("{other:?}"),
    }
    // An integer tensor where a float one belongs.
    let mut raw = read_raw(&fixture("dflash_plain").join("draft/model.safetensors"));
    let e = raw.iter_mut().find(|t| t.0 == "norm.weight").unwrap();
    e.1 = Dtype::I16;
    write_raw(&d.join("model.safetensors"), &raw);
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::Dtype { tensor, .. }) => assert_eq!(tensor, "norm.weight"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn nan_tensor_loads_and_validate_reports_it() {
    let d = copy_draft("dflash_plain", "nan");
    let mut raw = read_raw(&d.join("model.safetensors"));
    let e = raw
        .iter_mut()
        .find(|t| t.0 == "layers.0.mlp.up_proj.weight")
        .unwrap();
    // bf16 NaN everywhere
    for c in e.3.chunks_exact_mut(2) {
        c.copy_from_slice(&0x7fc0u16.to_le_bytes());
    }
    write_raw(&d.join("model.safetensors"), &raw);
    for precision in [Precision::F32, Precision::Bf16] {
        let opts = LoadOptions {
            precision,
            ..Default::default()
        };
        let dr = load(&d, &opts).unwrap_or_else(|e| panic!("{precision:?}: {e}"));
        // and the forward runs (producing NaN) without panicking
        let io = io("dflash_plain");
        let h = full_hidden(&dr, &io);
        assert!(h.iter().any(|x| x.is_nan()));
    }
    let opts = LoadOptions {
        validate: true,
        ..Default::default()
    };
    match load(&d, &opts) {
        Err(DraftError::NonFinite {
            tensor,
            index,
            value,
        }) => {
            assert_eq!(tensor, "layers.0.mlp.up_proj.weight");
            assert_eq!(index, 0);
            assert!(value.is_nan());
        }
        other => panic!("{other:?}"),
    }
    // an infinity deep inside a tensor: the index is reported
    let mut raw = read_raw(&fixture("dflash_plain").join("draft/model.safetensors"));
    let e = raw.iter_mut().find(|t| t.0 == "fc.weight").unwrap();
    e.3[2 * 1000..2 * 1001].copy_from_slice(&0xff80u16.to_le_bytes());
    write_raw(&d.join("model.safetensors"), &raw);
    match load(&d, &opts) {
        Err(DraftError::NonFinite {
            tensor,
            index,
            value,
        }) => {
            assert_eq!(tensor, "fc.weight");
            assert_eq!(index, 1000);
            assert_eq!(value, f32::NEG_INFINITY);
        }
        other => panic!("{other:?}"),
    }
    // Quantizing a non-finite tensor is impossible: an error naming it, not a panic.
    let q = LoadOptions {
        precision: Precision::Q8_0,
        ..Default::default()
    };
    match load(&d, &q) {
        Err(DraftError::Encode { tensor, .. }) => assert_eq!(tensor, "fc.weight"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn token_out_of_range_is_an_error() {
    let be = Cpu::new();
    let dr = load(
        &fixture("dflash_plain").join("draft"),
        &LoadOptions::default(),
    )
    .unwrap();
    let io = io("dflash_plain");
    let vocab = 512u32;
    let taps = be.upload(&io.taps).unwrap();
    let mut kv = dr.new_kv(&be, io.ctx + 16).unwrap();
    dr.ingest(&be, &mut kv, &taps, io.ctx, 0).unwrap();
    for bad in [vocab, vocab + 7, u32::MAX] {
        match dr.draft(
            &be,
            &mut kv,
            &io.lend,
            bad,
            io.ctx,
            &DraftOptions::default(),
        ) {
            Err(DraftError::TokenOutOfRange { id, vocab: v }) => {
                assert_eq!((id, v), (bad, 512));
            }
            other => panic!("{other:?}"),
        }
        let mut blk = io.block.clone();
        blk[3] = bad;
        assert!(matches!(
            dr.forward_full(&be, &io.lend, &taps, io.ctx, &blk, 1.0, false),
            Err(DraftError::TokenOutOfRange { .. })
        ));
    }
    // The cache is untouched by the failed calls.
    assert_eq!(kv.len(), io.ctx);
    assert!(dr
        .draft(&be, &mut kv, &io.lend, 3, io.ctx, &DraftOptions::default())
        .is_ok());
}

#[test]
fn protocol_errors() {
    let be = Cpu::new();
    let dr = load(
        &fixture("dflash_plain").join("draft"),
        &LoadOptions::default(),
    )
    .unwrap();
    let io = io("dflash_plain");
    let taps = be.upload(&io.taps).unwrap();
    let mut kv = dr.new_kv(&be, io.ctx).unwrap();
    // ingest must start at the cache's next position
    assert!(matches!(
        dr.ingest(&be, &mut kv, &taps, 4, 1),
        Err(DraftError::Mismatch { .. })
    ));
    // taps buffer too short for the rows claimed
    assert!(matches!(
        dr.ingest(&be, &mut kv, &taps, io.ctx + 1, 0),
        Err(DraftError::Mismatch { .. })
    ));
    dr.ingest(&be, &mut kv, &taps, io.ctx, 0).unwrap();
    // overflow of the cache capacity
    match dr.ingest(&be, &mut kv, &taps, 1, io.ctx) {
        Err(DraftError::Kv(dflash_kv::KvError::Overflow { needed, capacity })) => {
            assert_eq!((needed, capacity), (io.ctx + 1, io.ctx));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(kv.len(), io.ctx);
    // a draft must start at the cache length
    assert!(matches!(
        dr.draft(
            &be,
            &mut kv,
            &io.lend,
            1,
            io.ctx - 1,
            &DraftOptions::default()
        ),
        Err(DraftError::Mismatch { .. })
    ));
    // block longer than block_size
    let o = DraftOptions {
        block_len: Some(17),
        ..Default::default()
    };
    assert!(matches!(
        dr.draft(&be, &mut kv, &io.lend, 1, io.ctx, &o),
        Err(DraftError::Invalid(_))
    ));
    // a KV cache of another shape
    let mut other = dflash_kv::DraftKv::new(
        &be,
        dflash_kv::KvShape {
            n_layers: 3,
            n_kv_heads: 2,
            head_dim: 32,
            capacity: 8,
            block: 16,
        },
    )
    .unwrap();
    assert!(matches!(
        dr.draft(&be, &mut other, &io.lend, 1, 0, &DraftOptions::default()),
        Err(DraftError::Mismatch { .. })
    ));
    // a lend of another hidden size
    let w = |n: &str| {
        be.upload_weight(&HostWeight::from_f32(n, 8, 64, &[0.0; 512], WeightFormat::F32).unwrap())
            .unwrap()
    };
    let small = LentWeights::new(w("e"), w("h")).unwrap();
    assert!(matches!(
        dr.draft(&be, &mut kv, &small, 1, io.ctx, &DraftOptions::default()),
        Err(DraftError::Mismatch { .. })
    ));
}

// ---------------------------------------------------------------- census gate

#[test]
fn dspark_census_refuses_unknown_tensors_dflash_warns() {
    let d = copy_draft("dspark_markov", "census");
    let mut raw = read_raw(&d.join("model.safetensors"));
    raw.push((
        "markov_head.gate_proj.weight".into(),
        Dtype::BF16,
        vec![2, 2],
        vec![0; 8],
    ));
    raw.push(("extra.bias".into(), Dtype::F32, vec![1], vec![0; 4]));
    write_raw(&d.join("model.safetensors"), &raw);
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::UnknownTensors(names)) => {
            assert_eq!(
                names,
                vec![
                    "extra.bias".to_string(),
                    "markov_head.gate_proj.weight".to_string()
                ]
            );
        }
        other => panic!("{other:?}"),
    }
    // The same extra tensor in a plain DFlash checkpoint: a warning, the load succeeds.
    let d = copy_draft("dflash_plain", "census2");
    let mut raw = read_raw(&d.join("model.safetensors"));
    raw.push(("extra.bias".into(), Dtype::F32, vec![1], vec![0; 4]));
    write_raw(&d.join("model.safetensors"), &raw);
    let dr = load(&d, &LoadOptions::default()).unwrap();
    assert!(dr.markov.is_none());
    // The DeepSpec copies of embed_tokens / lm_head are recognised (the dspark fixture ships
    // them and loads: see the oracle tests); so is a mask embedding, which is used.
}

#[test]
fn mask_embedding_replaces_mask_rows() {
    let be = Cpu::new();
    let cfg = DraftConfig::from_file(&fixture("dflash_plain").join("draft")).unwrap();
    let ck = SafetensorsCheckpoint::open(&fixture("dflash_plain").join("draft")).unwrap();
    let mut map = TensorMap::new();
    for n in ck.names() {
        map.insert(
            n.clone(),
            (ck.shape(&n).unwrap(), ck.read(&n).unwrap().to_f32()),
        );
    }
    let io = io("dflash_plain");
    let base = Drafter::from_tensors(&be, cfg.clone(), &map, &LoadOptions::default()).unwrap();
    // the mask embedding equal to the target's embedding row of MASK: same result
    let emb = &io.embed;
    let row = cfg.mask_token_id as usize * cfg.hidden_size;
    let mask_row = emb[row..row + cfg.hidden_size].to_vec();
    map.insert("mask_embedding".into(), (vec![cfg.hidden_size], mask_row));
    let with = Drafter::from_tensors(&be, cfg.clone(), &map, &LoadOptions::default()).unwrap();
    assert!(with.mask_embedding.is_some());
    assert_eq!(full_hidden(&base, &io), full_hidden(&with, &io));
    // a different one: different result
    map.insert(
        "mask_embedding".into(),
        (vec![cfg.hidden_size], vec![0.5; cfg.hidden_size]),
    );
    let other = Drafter::from_tensors(&be, cfg.clone(), &map, &LoadOptions::default()).unwrap();
    assert_ne!(full_hidden(&base, &io), full_hidden(&other, &io));
    // wrong size is a shape error
    map.insert("mask_embedding".into(), (vec![3], vec![0.5; 3]));
    assert!(matches!(
        Drafter::from_tensors(&be, cfg, &map, &LoadOptions::default()),
        Err(DraftError::Shape { .. })
    ));
}

#[test]
fn logit_head_prefix_and_model_prefix_are_remapped() {
    let d = copy_draft("dspark_markov", "remap");
    let mut raw = read_raw(&d.join("model.safetensors"));
    for t in raw.iter_mut() {
        if let Some(rest) = t.0.strip_prefix("markov_head.") {
            t.0 = format!("logit_head.{rest}");
        } else if t.0.starts_with("confidence_head.") {
            t.0 = format!("logit_head.{}", t.0);
        } else if t.0.starts_with("layers.") {
            t.0 = format!("model.{}", t.0);
        }
    }
    write_raw(&d.join("model.safetensors"), &raw);
    let dr = load(&d, &LoadOptions::default()).unwrap();
    assert!(dr.markov.is_some() && dr.confidence.is_some());
    let orig = load(
        &fixture("dspark_markov").join("draft"),
        &LoadOptions::default(),
    )
    .unwrap();
    let io = io("dspark_markov");
    assert_eq!(full_hidden(&dr, &io), full_hidden(&orig, &io));
}

// ---------------------------------------------------------------- formats

#[test]
fn sharded_checkpoint_equals_single_file() {
    let d = scratch("sharded");
    std::fs::copy(
        fixture("dflash_plain").join("draft/config.json"),
        d.join("config.json"),
    )
    .unwrap();
    let raw = read_raw(&fixture("dflash_plain").join("draft/model.safetensors"));
    let (a, b): (Raw, Raw) = raw.into_iter().partition(|t| t.0.starts_with("layers.0."));
    write_raw(&d.join("model-00001-of-00002.safetensors"), &a);
    write_raw(&d.join("model-00002-of-00002.safetensors"), &b);
    let mut wm = serde_json::Map::new();
    for t in &a {
        wm.insert(t.0.clone(), "model-00001-of-00002.safetensors".into());
    }
    for t in &b {
        wm.insert(t.0.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": wm});
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let dr = load(&d, &LoadOptions::default()).unwrap();
    let single = load(
        &fixture("dflash_plain").join("draft"),
        &LoadOptions::default(),
    )
    .unwrap();
    let io = io("dflash_plain");
    assert_eq!(full_hidden(&dr, &io), full_hidden(&single, &io));

    // an index naming a tensor no shard has
    wm.insert(
        "ghost.weight".into(),
        "model-00001-of-00002.safetensors".into(),
    );
    let index = serde_json::json!({"weight_map": wm});
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
    match load(&d, &LoadOptions::default()) {
        Err(DraftError::MissingTensor(n)) => assert_eq!(n, "ghost.weight"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn f32_and_f16_checkpoints() {
    let io = io("dflash_plain");
    let single = load(
        &fixture("dflash_plain").join("draft"),
        &LoadOptions::default(),
    )
    .unwrap();
    let want = full_hidden(&single, &io);
    let raw = read_raw(&fixture("dflash_plain").join("draft/model.safetensors"));
    // f32: the bf16 values exactly, so bit-identical results
    let d = copy_draft("dflash_plain", "f32");
    let as_f32: Raw = raw
        .iter()
        .map(|(n, _, s, b)| (n.clone(), Dtype::F32, s.clone(), f32_bytes(&bf16_to_f32(b))))
        .collect();
    write_raw(&d.join("model.safetensors"), &as_f32);
    assert_eq!(
        full_hidden(&load(&d, &LoadOptions::default()).unwrap(), &io),
        want
    );
    // f16: rounded once more, so close but not identical
    let as_f16: Raw = raw
        .iter()
        .map(|(n, _, s, b)| {
            let v = bf16_to_f32(b);
            let bits = dflash_quant::encode_f16(&v).unwrap();
            (
                n.clone(),
                Dtype::F16,
                s.clone(),
                bits.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    write_raw(&d.join("model.safetensors"), &as_f16);
    let got = full_hidden(&load(&d, &LoadOptions::default()).unwrap(), &io);
    let e = max_rel(&got, &want);
    assert!(e < 2e-2, "f16 checkpoint drift {e}");
}

#[test]
fn precision_policy_formats_and_mixed_equals_dequantized_reference() {
    let be = Cpu::new();
    let dir = fixture("dflash_plain").join("draft");
    let fmt = |p: Precision| {
        let dr = load(
            &dir,
            &LoadOptions {
                precision: p,
                ..Default::default()
            },
        )
        .unwrap();
        (
            dr.fc.format,
            dr.layers[0].wq.format,
            dr.layers[1].w_down.format,
        )
    };
    use WeightFormat as F;
    assert_eq!(fmt(Precision::F32), (F::F32, F::F32, F::F32));
    assert_eq!(fmt(Precision::Bf16), (F::Bf16, F::Bf16, F::Bf16));
    assert_eq!(fmt(Precision::Q8_0), (F::Q8_0, F::Q8_0, F::Q8_0));
    assert_eq!(fmt(Precision::Q4_0), (F::Q4_0, F::Q4_0, F::Q4_0));
    assert_eq!(fmt(Precision::Mixed), (F::Bf16, F::Bf16, F::Q8_0));
    // Sizes: the checkpoint's element count; bytes follow the formats.
    let raw = read_raw(&dir.join("model.safetensors"));
    let n: usize = raw.iter().map(|t| t.2.iter().product::<usize>()).sum();
    let f32d = load(&dir, &LoadOptions::default()).unwrap();
    assert_eq!(f32d.n_params(), n);
    assert_eq!(f32d.weight_bytes(), 4 * n);
    let q8 = load(
        &dir,
        &LoadOptions {
            precision: Precision::Q8_0,
            ..Default::default()
        },
    )
    .unwrap();
    let norms = n - q8.weights().iter().map(|w| w.rows * w.cols).sum::<usize>();
    let lin = n - norms;
    assert_eq!(q8.weight_bytes(), lin / 32 * 34 + 4 * norms);

    // Mixed == an f32 drafter whose MLP weights are the q8_0 round trip of the originals.
    let cfg = DraftConfig::from_file(&dir).unwrap();
    let ck = SafetensorsCheckpoint::open(&dir).unwrap();
    let mut map: TensorMap = HashMap::new();
    for n in ck.names() {
        let shape = ck.shape(&n).unwrap();
        let mut v = ck.read(&n).unwrap().to_f32();
        if n.contains(".mlp.") {
            let q = dflash_quant::quantize_q8_0(&v).unwrap();
            dflash_quant::dequantize_q8_0(&q, &mut v);
        }
        map.insert(n, (shape, v));
    }
    let reference = Drafter::from_tensors(&be, cfg, &map, &LoadOptions::default()).unwrap();
    let mixed = load(
        &dir,
        &LoadOptions {
            precision: Precision::Mixed,
            ..Default::default()
        },
    )
    .unwrap();
    let io = io("dflash_plain");
    let e = max_rel(&full_hidden(&mixed, &io), &full_hidden(&reference, &io));
    assert!(e <= 1e-6, "mixed vs dequantized f32 reference: {e}");
}

#[test]
fn layout_override() {
    let dir = fixture("dspark_markov").join("draft");
    let a = load(&dir, &LoadOptions::default()).unwrap();
    assert_eq!(a.layout, RowLayout::AnchorPredicts);
    assert_eq!(a.n_drafts(7), 7);
    let d = load(
        &dir,
        &LoadOptions {
            layout_override: Some(RowLayout::DFlash),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(d.n_drafts(7), 6);
    // The DFlash layout drafts rows 1..: its first draft logits row is the anchor layout's
    // second row.
    let be = Cpu::new();
    let io = io("dspark_markov");
    let taps = be.upload(&io.taps).unwrap();
    let o = DraftOptions {
        markov: false,
        return_logits: true,
        ..Default::default()
    };
    let mut outs = Vec::new();
    for dr in [&a, &d] {
        let mut kv = dr.new_kv(&be, io.ctx).unwrap();
        dr.ingest(&be, &mut kv, &taps, io.ctx, 0).unwrap();
        outs.push(
            dr.draft(&be, &mut kv, &io.lend, io.block[0], io.ctx, &o)
                .unwrap(),
        );
    }
    assert_eq!(outs[0].tokens[1..], outs[1].tokens[..]);
    let v = 512;
    assert_eq!(
        outs[0].logits.as_ref().unwrap()[v..],
        outs[1].logits.as_ref().unwrap()[..]
    );
    assert_eq!(outs[1].confidence.as_ref().unwrap().len(), 6);
}

#[test]
fn dspark_heads_shapes_follow_the_config() {
    use dflash_draft_model::random::{random_tensor_map, tiny_config};
    let be = Cpu::new();
    let cfg = tiny_config(32, 1, 2, 1, 64, 4, &[0], None, 32).unwrap();
    let mut map = random_tensor_map(&cfg, 3);
    let ok = Drafter::from_tensors(&be, cfg.clone(), &map, &LoadOptions::default()).unwrap();
    assert!(ok.confidence.as_ref().unwrap().with_markov);
    // config says with_markov, the tensor lacks the Markov part
    map.insert(
        "confidence_head.proj.weight".into(),
        (vec![1, 32], vec![0.1; 32]),
    );
    match Drafter::from_tensors(&be, cfg.clone(), &map, &LoadOptions::default()) {
        Err(DraftError::Shape {
            tensor,
            expected,
            found,
        }) => {
            assert_eq!(tensor, "confidence_head.proj.weight");
            assert_eq!((expected, found), (vec![1, 64], vec![1, 32]));
        }
        other => panic!("{other:?}"),
    }
    // config declares a Markov head the file lacks
    let mut map = random_tensor_map(&cfg, 3);
    map.remove("markov_head.markov_w2.weight");
    match Drafter::from_tensors(&be, cfg.clone(), &map, &LoadOptions::default()) {
        Err(DraftError::MissingTensor(n)) => assert_eq!(n, "markov_head.markov_w2.weight"),
        other => panic!("{other:?}"),
    }
    // w1 of the wrong rank
    let mut map = random_tensor_map(&cfg, 3);
    map.insert(
        "markov_head.markov_w1.weight".into(),
        (vec![64, 16], vec![0.0; 1024]),
    );
    assert!(matches!(
        Drafter::from_tensors(&be, cfg, &map, &LoadOptions::default()),
        Err(DraftError::Shape { .. })
    ));
}
