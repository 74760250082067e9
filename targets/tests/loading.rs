//! Checkpoint loading: sharded files, tied embeddings, and bad checkpoints as error values.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dflash_backend::cpu::Cpu;
use dflash_backend::Backend;
use dflash_targets::{load_target, LoadOptions, LogitRows, Qwen3Dense, TargetError};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn fixture_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_dense/model")
}

type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors() -> Tensors {
    let bytes = std::fs::read(fixture_model().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect()
}

fn config() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_model().join("config.json")).unwrap())
        .unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-targets-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write_st(path: &Path, t: &Tensors) {
    let views: Vec<(String, TensorView<'_>)> = t
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn write_dir(name: &str, cfg: &serde_json::Value, t: &Tensors) -> PathBuf {
    let d = scratch(name);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    write_st(&d.join("model.safetensors"), t);
    d
}

/// (max |x - y|, max |x|) over two logit vectors.
fn max_diff(x: &[f32], y: &[f32]) -> (f32, f32) {
    let diff = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
    (diff, x.iter().fold(0f32, |m, v| m.max(v.abs())))
}

fn logits(be: &Cpu, dir: &Path) -> Vec<f32> {
    let mut m = Qwen3Dense::<Cpu>::load(be, dir, LoadOptions::default()).unwrap();
    let f = m
        .forward(be, &[1, 5, 9, 200, 7], 0, &[], LogitRows::All)
        .unwrap();
    be.download(f.logits.as_ref().unwrap()).unwrap()
}

#[test]
fn sharded_checkpoint_equals_single_file() {
    let be = Cpu::new();
    let t = read_tensors();
    let d = scratch("sharded");
    std::fs::write(d.join("config.json"), config().to_string()).unwrap();
    let (mut a, mut b) = (Tensors::new(), Tensors::new());
    let mut map = serde_json::Map::new();
    for (i, (n, v)) in t.into_iter().enumerate() {
        let file = if i % 2 == 0 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(n.clone(), file.into());
        if i % 2 == 0 {
            a.insert(n, v)
        } else {
            b.insert(n, v)
        };
    }
    write_st(&d.join("model-00001-of-00002.safetensors"), &a);
    write_st(&d.join("model-00002-of-00002.safetensors"), &b);
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let x = logits(&be, &fixture_model());
    let y = logits(&be, &d);
    assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
}

#[test]
fn tied_embeddings_use_the_embedding_as_head() {
    let be = Cpu::new();
    let mut t = read_tensors();
    let emb = t["model.embed_tokens.weight"].clone();
    // Untied with an explicit copy of the embedding as lm_head ...
    t.insert("lm_head.weight".into(), emb);
    let explicit = write_dir("untied-copy", &config(), &t);
    // ... equals tied with no lm_head tensor at all.
    t.remove("lm_head.weight");
    let mut cfg = config();
    cfg["tie_word_embeddings"] = true.into();
    let tied = write_dir("tied", &cfg, &t);
    let x = logits(&be, &explicit);
    let y = logits(&be, &tied);
    assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
    // An untied config without lm_head is an error naming it.
    let broken = write_dir("untied-missing", &config(), &t);
    let e = Qwen3Dense::<Cpu>::load(&be, &broken, LoadOptions::default())
        .err()
        .unwrap();
    assert!(
        matches!(&e, TargetError::MissingTensor { name } if name == "lm_head.weight"),
        "{e}"
    );
}

#[test]
fn bad_checkpoints_are_errors_naming_the_problem() {
    let be = Cpu::new();
    let load = |d: &Path| {
        Qwen3Dense::<Cpu>::load(&be, d, LoadOptions::default())
            .err()
            .unwrap()
    };

    let mut t = read_tensors();
    t.remove("model.layers.3.mlp.up_proj.weight");
    let e = load(&write_dir("missing", &config(), &t));
    assert!(
        matches!(&e, TargetError::MissingTensor { name } if name == "model.layers.3.mlp.up_proj.weight"),
        "{e}"
    );

    let mut t = read_tensors();
    let (d, _, b) = t["model.layers.1.self_attn.q_norm.weight"].clone();
    t.insert(
        "model.layers.1.self_attn.q_norm.weight".into(),
        (d, vec![16], b[..32].to_vec()),
    );
    let e = load(&write_dir("shape", &config(), &t));
    assert!(
        matches!(&e, TargetError::Shape { name, expected, found } if name == "model.layers.1.self_attn.q_norm.weight" && expected == &vec![32] && found == &vec![16]),
        "{e}"
    );

    let mut t = read_tensors();
    let (_, s, b) = t["model.norm.weight"].clone();
    t.insert("model.norm.weight".into(), (Dtype::I16, s, b));
    let e = load(&write_dir("dtype", &config(), &t));
    assert!(
        matches!(&e, TargetError::Dtype { name, .. } if name == "model.norm.weight"),
        "{e}"
    );

    let d = write_dir("truncated", &config(), &read_tensors());
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() - 100]).unwrap();
    assert!(matches!(load(&d), TargetError::SafeTensors { .. }));
    std::fs::write(
        d.join("model.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage",
    )
    .unwrap();
    assert!(matches!(load(&d), TargetError::SafeTensors { .. }));

    let mut cfg = config();
    cfg.as_object_mut().unwrap().remove("hidden_size");
    let e = load(&write_dir("nokey", &cfg, &read_tensors()));
    assert!(
        matches!(&e, TargetError::Config { msg, .. } if msg.contains("hidden_size")),
        "{e}"
    );

    let mut cfg = config();
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    let d = write_dir("arch", &cfg, &read_tensors());
    let e = load_target(&be, &d, LoadOptions::default()).err().unwrap();
    assert!(
        matches!(&e, TargetError::Unsupported(m) if m.contains("LlamaForCausalLM")),
        "{e}"
    );

    let e = load(Path::new("/nonexistent/dir"));
    assert!(matches!(e, TargetError::Io { .. }));
}

#[test]
fn precision_option_reencodes_weights() {
    let be = Cpu::new();
    let x = logits(&be, &fixture_model());
    for (fmt, bound) in [
        (dflash_backend::WeightFormat::F32, 0.0),
        (dflash_backend::WeightFormat::Q8_0, 0.05),
    ] {
        let mut m = Qwen3Dense::<Cpu>::load(
            &be,
            fixture_model(),
            LoadOptions {
                precision: Some(fmt),
                ctx_cap: Some(64),
                ..LoadOptions::default()
            },
        )
        .unwrap();
        let f = m
            .forward(&be, &[1, 5, 9, 200, 7], 0, &[], LogitRows::All)
            .unwrap();
        let y = be.download(f.logits.as_ref().unwrap()).unwrap();
        let (diff, max_ref) = max_diff(&x, &y);
        // bf16 -> f32 is exact: identical logits; q8_0 is a real re-quantisation.
        assert!(
            diff / max_ref <= bound,
            "{fmt:?}: rel err {}",
            diff / max_ref
        );
        if bound > 0.0 {
            assert!(diff > 0.0, "q8_0 changed nothing: the option was ignored");
        }
    }
}

/// `kv_storage: F16`: the K / V cache holds f16 values (half the slots), the logits stay
/// within the f16 rounding of K and V of the f32 cache's (here about 1e-4 relative) and do
/// change (the option is not ignored); a row's logits do not depend on how many rows the
/// forward runs (decode == verify, the property speculative decoding rests on).
#[test]
fn kv_storage_f16_halves_the_cache_and_stays_close() {
    use dflash_backend::KvStorage;
    use dflash_spec_round::Target;
    let be = Cpu::new();
    let x = logits(&be, &fixture_model());
    let toks = [1u32, 5, 9, 200, 7];
    let opts = LoadOptions {
        ctx_cap: Some(64),
        kv_storage: KvStorage::F16,
        ..LoadOptions::default()
    };
    let mut m = Qwen3Dense::<Cpu>::load(&be, fixture_model(), opts).unwrap();
    assert_eq!(m.kv_storage(), KvStorage::F16);
    let f = m.forward(&be, &toks, 0, &[], LogitRows::All).unwrap();
    let y = be.download(f.logits.as_ref().unwrap()).unwrap();
    let (diff, max_ref) = max_diff(&x, &y);
    assert!(diff / max_ref <= 2e-3, "rel err {}", diff / max_ref);
    assert!(
        diff > 0.0,
        "f16 K / V changed nothing: the option was ignored"
    );
    // Row by row (a decode of each token) == the rows of the one forward above.
    let vocab = y.len() / toks.len();
    let mut one = Qwen3Dense::<Cpu>::load(&be, fixture_model(), opts).unwrap();
    for (i, &t) in toks.iter().enumerate() {
        let f = one.verify(&be, &[t], i, &[], true).unwrap();
        one.commit(&be, 1).unwrap();
        let r = be.download(f.logits.as_ref().unwrap()).unwrap();
        assert!(
            r.iter()
                .zip(&y[i * vocab..(i + 1) * vocab])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {i}: decode != the row of the 5-row forward"
        );
    }
    // A shared instance stores its cache the same way.
    assert_eq!(m.share(&be, 8).unwrap().kv_storage(), KvStorage::F16);
}

#[test]
fn census_lists_tensors_the_target_does_not_read() {
    use dflash_targets::checkpoint::Checkpoint;
    use dflash_targets::config::Cfg;
    use dflash_targets::{unused_tensors, Qwen3Config};
    let ck = Checkpoint::open(fixture_model()).unwrap();
    let cfg = Qwen3Config::from_cfg(&Cfg::new(ck.config_path(), ck.config())).unwrap();
    assert!(unused_tensors(&ck, &cfg, "model.", "lm_head.weight").is_empty());
    let mut t = read_tensors();
    let extra = t["model.norm.weight"].clone();
    t.insert("model.layers.0.self_attn.q_proj.bias".into(), extra.clone());
    t.insert("mtp.head.weight".into(), extra);
    let d = write_dir("census", &config(), &t);
    let ck = Checkpoint::open(&d).unwrap();
    assert_eq!(
        unused_tensors(&ck, &cfg, "model.", "lm_head.weight"),
        vec![
            "model.layers.0.self_attn.q_proj.bias".to_string(),
            "mtp.head.weight".to_string()
        ]
    );
    // Loading still succeeds (plain targets warn, they do not refuse).
    Qwen3Dense::<Cpu>::load(&Cpu::new(), &d, LoadOptions::default()).unwrap();
}
