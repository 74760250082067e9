//! `dflash generate --json` end to end on the oracle fixtures: the transformers Qwen3 target
//! of `targets/tests/fixtures/qwen3_dense` with the drafters of the draft-model fixtures
//! (trained against no one: random, so few accepts; exactness is what is checked).

use std::path::PathBuf;
use std::process::Command;

use safetensors::SafeTensors;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture_ids(name: &str) -> Vec<u32> {
    let bytes =
        std::fs::read(root().join("targets/tests/fixtures/qwen3_dense/io.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

/// The oracle fixture's prompt as a `--prompt-ids` argument, and transformers' greedy
/// continuation of it.
fn fixture_prompt() -> (String, Vec<u32>) {
    let ids = fixture_ids("prompt_ids")
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    (ids, fixture_ids("greedy_ids"))
}

/// A token-id array field of `generate --json`'s object.
fn json_ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no array {key} in {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn generate_json_matches_transformers_greedy() {
    let (ids, greedy) = fixture_prompt();
    let target = root().join("targets/tests/fixtures/qwen3_dense/model");
    for (draft, extra) in [
        ("dflash_plain", vec![]),
        ("dspark_markov", vec!["--verify-cap", "4"]),
        ("dflash_swa", vec!["--no-adaptive"]),
    ] {
        let draft = root()
            .join("draft-model/tests/fixtures")
            .join(draft)
            .join("draft");
        let max_new = greedy.len().to_string();
        let mut args = vec![
            "generate",
            "--target",
            target.to_str().unwrap(),
            "--draft",
            draft.to_str().unwrap(),
            "--prompt-ids",
            &ids,
            "--max-new",
            &max_new,
            "--compare-plain",
            "--json",
        ];
        args.extend(extra);
        let (ok, stdout, stderr) = run(&args);
        assert!(ok, "dflash failed: {stderr}");
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 1, "--json prints one line: {stdout}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        let toks: Vec<u32> = json_ids(&v, "tokens");
        assert_eq!(
            toks, greedy,
            "spec tokens differ from transformers' greedy continuation"
        );
        let plain: Vec<u32> = json_ids(&v, "plain_tokens");
        assert_eq!(plain, greedy);
        assert_eq!(v["identical"], serde_json::Value::Bool(true));
        for key in [
            "rounds",
            "drafted",
            "accepted",
            "tau",
            "first_draft",
            "draft_ms",
            "verify_ms",
            "rollback_ms",
            "ingest_ms",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        let rounds = v["rounds"].as_u64().unwrap() as f64;
        let accepted = v["accepted"].as_u64().unwrap() as f64;
        let tau = v["tau"].as_f64().unwrap();
        assert!((tau - (rounds + accepted) / rounds).abs() < 1e-9);
        assert!(!v["first_draft"].as_array().unwrap().is_empty());
    }
}

#[test]
fn generate_reports_bad_input() {
    let target = root().join("targets/tests/fixtures/qwen3_dense/model");
    let draft = root().join("draft-model/tests/fixtures/dflash_plain/draft");
    // `generate` on `target` and the plain fixture drafter with `rest`: it must fail, with a
    // message that holds `what`.
    let refused = |target: &str, rest: &[&str], what: &str| {
        let args = [
            &[
                "generate",
                "--target",
                target,
                "--draft",
                draft.to_str().unwrap(),
            ],
            rest,
        ];
        let (ok, _, stderr) = run(&args.concat());
        assert!(!ok, "{rest:?} must fail");
        assert!(stderr.contains(what), "{rest:?}: {stderr}");
    };
    let target = target.to_str().unwrap();
    refused(
        target,
        &["--prompt-ids", "1,2,99999", "--max-new", "4"],
        "99999",
    );
    refused("/nonexistent", &["--prompt-ids", "1"], "nonexistent");
    // `mixed` is a drafter policy: the target refuses it rather than quietly running q8_0.
    refused(
        target,
        &[
            "--prompt-ids",
            "1,2",
            "--max-new",
            "2",
            "--target-precision",
            "mixed",
        ],
        "--target-precision mixed",
    );
    // `--prefill fast` is CUDA's: the CPU refuses it rather than running the exact prefill.
    refused(
        target,
        &["--prompt-ids", "1,2", "--max-new", "2", "--prefill", "fast"],
        "--prefill fast",
    );
}

/// The shipped pair (models/), with the default directories and a text prompt: the streams
/// are identical and the trained drafter gets accepts.
#[test]
fn shipped_pair_text_prompt() {
    for prompt in ["def quicksort(arr):", "import os\n\nclass Config:"] {
        let (ok, stdout, stderr) = run(&[
            "generate",
            prompt,
            "--max-new",
            "64",
            "--compare-plain",
            "--json",
        ]);
        assert!(ok, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["identical"], serde_json::Value::Bool(true));
        assert_eq!(
            v["tokens"].as_array().unwrap().len(),
            v["n_tokens"].as_u64().unwrap() as usize
        );
        assert!(
            v["n_tokens"].as_u64().unwrap() == 64
                || v["tokens"].as_array().unwrap().last() == Some(&serde_json::json!(0))
        );
        assert!(
            v["tau"].as_f64().unwrap() > 1.0,
            "trained drafter accepted nothing: {stdout}"
        );
        assert!(v["text"].as_str().is_some());
    }
}

/// Every drafter precision and head keep the committed stream: the target decides. On the
/// fixtures (random drafters) the tokens equal transformers' greedy continuation; on the
/// shipped pair the Q8_0A8 drafter with its Q8_0A8 head still gets accepts.
#[test]
fn drafter_precision_and_head_never_change_the_stream() {
    let (ids, greedy) = fixture_prompt();
    let target = root().join("targets/tests/fixtures/qwen3_dense/model");
    let draft = root().join("draft-model/tests/fixtures/dspark_markov/draft");
    let max_new = greedy.len().to_string();
    for (prec, head) in [
        ("f32", "target"),
        ("q8_0a8", "target"),
        ("q8a8", "q8_0a8"),
        ("f32", "q8a8"),
    ] {
        let (ok, stdout, stderr) = run(&[
            "generate",
            "--target",
            target.to_str().unwrap(),
            "--draft",
            draft.to_str().unwrap(),
            "--prompt-ids",
            &ids,
            "--max-new",
            &max_new,
            "--draft-precision",
            prec,
            "--draft-head",
            head,
            "--compare-plain",
            "--json",
        ]);
        assert!(ok, "{prec} / {head}: {stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        let toks: Vec<u32> = json_ids(&v, "tokens");
        assert_eq!(toks, greedy, "{prec} / {head}");
        assert_eq!(v["identical"], serde_json::Value::Bool(true));
    }
    let (ok, stdout, stderr) = run(&[
        "generate",
        "def quicksort(arr):",
        "--max-new",
        "64",
        "--draft-precision",
        "q8_0a8",
        "--draft-head",
        "q8_0a8",
        "--compare-plain",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["identical"], serde_json::Value::Bool(true));
    assert!(
        v["tau"].as_f64().unwrap() > 1.0,
        "the Q8_0A8 drafter accepted nothing: {stdout}"
    );
    // Unknown values are refused by the argument parser.
    let (ok, _, stderr) = run(&["generate", "x", "--draft-head", "q4"]);
    assert!(!ok);
    assert!(stderr.contains("draft-head"), "{stderr}");
}

/// `--device cuda`: where a CUDA driver and a GPU exist, the speculative stream on the GPU
/// equals plain greedy on the GPU and transformers' greedy continuation (the f32 oracle
/// fixture); elsewhere the command fails with an error that names what is missing, never a
/// panic.
#[test]
fn device_cuda_runs_or_says_why() {
    let (ids, greedy) = fixture_prompt();
    let target = root().join("targets/tests/fixtures/qwen3_dense/model");
    let draft = root().join("draft-model/tests/fixtures/dspark_markov/draft");
    let max_new = greedy.len().to_string();
    let (ok, stdout, stderr) = run(&[
        "generate",
        "--device",
        "cuda",
        "--target",
        target.to_str().unwrap(),
        "--draft",
        draft.to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "--max-new",
        &max_new,
        "--compare-plain",
        "--json",
    ]);
    assert!(!stderr.contains("panicked"), "{stderr}");
    if !ok {
        assert!(
            stderr.contains("opening CUDA device 0: "),
            "a machine without CUDA must get a clear error: {stderr}"
        );
        eprintln!("no CUDA here: {}", stderr.lines().next().unwrap_or(""));
        return;
    }
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["identical"], serde_json::Value::Bool(true));
    assert_eq!(json_ids(&v, "tokens"), greedy);
    assert_eq!(json_ids(&v, "plain_tokens"), greedy);
    eprintln!(
        "CUDA: {} tokens, tau {:.2}, identical to plain greedy and to transformers",
        greedy.len(),
        v["tau"].as_f64().unwrap()
    );
}
