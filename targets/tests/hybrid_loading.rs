//! Loading the hybrid target: config forms, sharded checkpoints, and bad input (each a typed
//! error naming the tensor / key, the expected and the found).

mod hybrid_common;

use std::path::PathBuf;

use dflash_backend::cpu::Cpu;
use dflash_backend::Backend;
use dflash_spec_round::{RollbackArm, Target};
use dflash_targets::hybrid::{
    HostTensors, HybridArch, HybridConfig, HybridTarget, LayerKind, TensorNames,
};
use dflash_targets::{LoadOptions, LogitRows, TargetError};
use hybrid_common::{random_tensors, read_io, ref_dir, tiny_config};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use serde_json::json;

fn names() -> TensorNames {
    TensorNames {
        prefix: "model.".into(),
        lm_head: "lm_head.weight".into(),
    }
}

fn load_err(cfg: &HybridConfig, src: &HostTensors) -> TargetError {
    HybridTarget::<Cpu>::from_source(
        &Cpu::new(),
        cfg.clone(),
        src,
        &names(),
        LoadOptions::default(),
    )
    .err()
    .expect("load must fail")
}

fn copy_without(src: &HostTensors, skip: &str, tweak: Option<(&str, Vec<usize>)>) -> HostTensors {
    use dflash_targets::hybrid::TensorSource;
    let mut out = HostTensors::new();
    for n in src.names() {
        if n == skip {
            continue;
        }
        let shape = src.shape(&n).unwrap().to_vec();
        let v = src.values(&n, &shape).unwrap();
        match &tweak {
            Some((name, new_shape)) if *name == n => {
                let len: usize = new_shape.iter().product();
                let mut v = v;
                v.resize(len, 0.5);
                out.insert(n.clone(), new_shape, v).unwrap();
            }
            _ => out.insert(n.clone(), &shape, v).unwrap(),
        }
    }
    out
}

#[test]
fn config_forms() {
    // No layer_types: full_attention_interval (default 4); partial_rotary_factor default 0.25.
    let base = json!({
        "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
    });
    let c = HybridConfig::from_json("cfg", &base).unwrap();
    let full: Vec<usize> = (0..8)
        .filter(|&i| c.layer_kinds[i] == LayerKind::Full)
        .collect();
    assert_eq!(full, vec![3, 7]);
    assert_eq!(c.rope.rot_dim(), 4, "16 x 0.25");
    assert_eq!(c.arch, HybridArch::Qwen3_5);
    assert!(!c.moe_layers.iter().any(|&m| m));
    let mut v = base.clone();
    v["full_attention_interval"] = json!(2);
    v["partial_rotary_factor"] = json!(0.5);
    let c = HybridConfig::from_json("cfg", &v).unwrap();
    assert_eq!(
        c.layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::Full)
            .count(),
        4
    );
    assert_eq!(c.rope.rot_dim(), 8);
    // Legacy layer type names are remapped as transformers does.
    let mut v = base.clone();
    v["num_hidden_layers"] = json!(3);
    v["layer_types"] = json!(["mamba", "attention", "linear_attention"]);
    let c = HybridConfig::from_json("cfg", &v).unwrap();
    assert_eq!(
        c.layer_kinds,
        vec![LayerKind::Linear, LayerKind::Full, LayerKind::Linear]
    );
    // The vision-language wrapper: text fields nested, the wrapper's tie flag wins.
    let vl = json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": base.clone(),
                    "vision_config": {"depth": 1}});
    let c = HybridConfig::from_json("cfg", &vl).unwrap();
    assert!(c.tie_embeddings);
    assert_eq!(c.hidden, 32);
    // Qwen3-Next: MoE where num_experts > 0 (default 512) unless in mlp_only_layers.
    let mut nx = base.clone();
    nx["model_type"] = json!("qwen3_next");
    nx["mlp_only_layers"] = json!([0, 5]);
    let c = HybridConfig::from_json("cfg", &nx).unwrap();
    assert_eq!(c.arch, HybridArch::Qwen3Next);
    assert_eq!(c.moe_layers.iter().filter(|&&m| !m).count(), 2);
    nx["num_experts"] = json!(0);
    assert!(!HybridConfig::from_json("cfg", &nx)
        .unwrap()
        .moe_layers
        .iter()
        .any(|&m| m));
}

#[test]
fn config_errors_name_the_key() {
    let base = json!({
        "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"]
    });
    assert!(HybridConfig::from_json("cfg", &base).is_ok());
    let mut v = base.clone();
    v["model_type"] = json!("llama");
    assert!(
        matches!(HybridConfig::from_json("cfg", &v), Err(TargetError::Unsupported(m)) if m.contains("llama"))
    );
    let mut v = base.clone();
    v.as_object_mut().unwrap().remove("hidden_size");
    assert!(
        matches!(HybridConfig::from_json("cfg", &v), Err(TargetError::Config { msg, .. }) if msg.contains("hidden_size"))
    );
    let mut v = base.clone();
    v["layer_types"] = json!(["linear_attention"]);
    assert!(
        matches!(HybridConfig::from_json("cfg", &v), Err(TargetError::Config { msg, .. }) if msg.contains("layer_types"))
    );
    let mut v = base.clone();
    v["layer_types"] = json!(["linear_attention", "sliding_attention"]);
    assert!(
        matches!(HybridConfig::from_json("cfg", &v), Err(TargetError::Unsupported(m)) if m.contains("sliding_attention"))
    );
    let mut v = base.clone();
    v["linear_num_value_heads"] = json!(5);
    v["linear_num_key_heads"] = json!(2);
    assert!(
        matches!(HybridConfig::from_json("cfg", &v), Err(TargetError::Config { msg, .. }) if msg.contains("linear_num_value_heads"))
    );
    let mut v = base.clone();
    v["hidden_act"] = json!("gelu");
    assert!(
        matches!(HybridConfig::from_json("cfg", &v), Err(TargetError::Unsupported(m)) if m.contains("gelu"))
    );
}

#[test]
fn moe_shape_is_checked() {
    let mut cfg = tiny_config(40, 32, "lf", false);
    let src = random_tensors(&cfg, 1, 1.0);
    cfg.moe_layers[1] = true;
    match load_err(&cfg, &src) {
        TargetError::Config { msg, .. } => assert!(msg.contains("MoE"), "{msg}"),
        e => panic!("{e:?}"),
    }
    cfg.moe = Some(dflash_targets::hybrid::MoeConfig {
        n_experts: 4,
        top_k: 2,
        intermediate: 16,
        shared_intermediate: 16,
        norm_topk: true,
    });
    // The dense MLP tensors of layer 1 do not make an MoE block: the router is named.
    match load_err(&cfg, &src) {
        TargetError::MissingTensor { name } => {
            assert_eq!(name, "model.layers.1.mlp.experts.0.gate_proj.weight")
        }
        e => panic!("{e:?}"),
    }
    cfg.moe.as_mut().unwrap().top_k = 5;
    match load_err(&cfg, &src) {
        TargetError::Config { msg, .. } => assert!(msg.contains("num_experts_per_tok"), "{msg}"),
        e => panic!("{e:?}"),
    }
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let cfg = tiny_config(40, 32, "lf", false);
    let src = random_tensors(&cfg, 1, 1.0);
    let a_log = "model.layers.0.linear_attn.A_log";
    match load_err(&cfg, &copy_without(&src, a_log, None)) {
        TargetError::MissingTensor { name } => assert_eq!(name, a_log),
        e => panic!("{e:?}"),
    }
    let conv = "model.layers.0.linear_attn.conv1d.weight";
    match load_err(
        &cfg,
        &copy_without(&src, "", Some((conv, vec![cfg.conv_channels(), 1, 3]))),
    ) {
        TargetError::Shape {
            name,
            expected,
            found,
        } => {
            assert_eq!(name, conv);
            assert_eq!(expected, vec![cfg.conv_channels(), 1, 4]);
            assert_eq!(found, vec![cfg.conv_channels(), 1, 3]);
        }
        e => panic!("{e:?}"),
    }
    let q = "model.layers.1.self_attn.q_proj.weight";
    match load_err(&cfg, &copy_without(&src, "", Some((q, vec![64, 32])))) {
        TargetError::Shape { name, expected, .. } => {
            assert_eq!(name, q);
            assert_eq!(expected, vec![2 * 4 * 16, 32], "query + gate rows");
        }
        e => panic!("{e:?}"),
    }
    // Untied without lm_head: named; tied without lm_head: the embedding serves.
    match load_err(&cfg, &copy_without(&src, "lm_head.weight", None)) {
        TargetError::MissingTensor { name } => assert_eq!(name, "lm_head.weight"),
        e => panic!("{e:?}"),
    }
    let mut tied = cfg.clone();
    tied.tie_embeddings = true;
    let be = Cpu::new();
    let t = HybridTarget::from_source(
        &be,
        tied,
        &copy_without(&src, "lm_head.weight", None),
        &names(),
        LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(t.lm_head().name, "model.embed_tokens.weight");
    // No embedding under any known prefix.
    assert!(matches!(
        TensorNames::detect(&copy_without(&src, "model.embed_tokens.weight", None)),
        Err(TargetError::MissingTensor { .. })
    ));
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-hybrid-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The VL reference checkpoint re-written as two shards with an index gives bit-identical
/// logits.
#[test]
fn sharded_checkpoint_equals_single_file() {
    let be = Cpu::new();
    let rc = read_io(ref_dir("qwen3_5_vl"));
    let model = rc.dir.join("model");
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let dir = temp_dir("sharded");
    std::fs::copy(model.join("config.json"), dir.join("config.json")).unwrap();
    let mut all: Vec<(String, TensorView)> = st.tensors();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let half = all.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&all[..half], &all[half..]].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let views: Vec<(String, TensorView)> =
            part.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        for (n, _) in &views {
            map.insert(n.clone(), json!(file));
        }
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string(&json!({"metadata": {}, "weight_map": map})).unwrap(),
    )
    .unwrap();
    let prompt = &rc.ids["prompt_ids"];
    let run = |dir: &PathBuf| {
        let mut t = HybridTarget::load(&be, dir, LoadOptions::default()).unwrap();
        t.set_rollback(RollbackArm::Gate);
        let f = t.run(&be, prompt, &[], LogitRows::All).unwrap();
        be.download(f.logits.as_ref().unwrap())
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<u32>>()
    };
    assert!(run(&dir) == run(&model), "sharded load differs");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A corrupt config and a truncated weight file are errors, not panics.
#[test]
fn corrupt_files_are_errors() {
    let rc = read_io(ref_dir("qwen3_5_text"));
    let model = rc.dir.join("model");
    let dir = temp_dir("corrupt");
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    std::fs::copy(
        model.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    assert!(matches!(
        HybridTarget::<Cpu>::load(&Cpu::new(), &dir, LoadOptions::default()),
        Err(TargetError::Config { .. })
    ));
    std::fs::copy(model.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        HybridTarget::<Cpu>::load(&Cpu::new(), &dir, LoadOptions::default()),
        Err(TargetError::SafeTensors { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}
