//! `dflash bench --json` and the streamed `dflash generate` on the shipped pair (models/).

use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bench_json_is_consistent() {
    let (ok, stdout, stderr) = run(&["bench", "--limit", "3", "--max-new", "40", "--json"]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "--json prints one line: {stdout}");
    let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(v["prompts"], 3);
    assert_eq!(v["all_identical"], true);
    assert!(v["machine"]["cpu"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(v["machine"]["threads"].as_u64().unwrap() >= 1);
    let per = v["per_prompt"].as_array().unwrap();
    assert_eq!(per.len(), 3);
    let (mut rounds, mut committed, mut accepted, mut drafted) = (0, 0, 0, 0);
    for p in per {
        let toks = p["tokens"].as_array().unwrap();
        assert_eq!(toks, p["plain_tokens"].as_array().unwrap());
        assert!(toks.len() == 40 || toks.last() == Some(&serde_json::json!(0)));
        let r = p["rounds"].as_u64().unwrap();
        let per_round: Vec<u64> = p["committed_per_round"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(per_round.len() as u64, r);
        assert_eq!(
            per_round.iter().sum::<u64>(),
            p["committed"].as_u64().unwrap()
        );
        assert_eq!(
            p["committed"].as_u64().unwrap(),
            r + p["accepted"].as_u64().unwrap()
        );
        // every generated token but the final emit-only one comes from a round
        assert!(p["committed"].as_u64().unwrap() + 1 >= toks.len() as u64);
        rounds += r;
        committed += p["committed"].as_u64().unwrap();
        accepted += p["accepted"].as_u64().unwrap();
        drafted += p["drafted"].as_u64().unwrap();
    }
    assert_eq!(v["rounds"], rounds);
    let tau = v["tau_pooled"].as_f64().unwrap();
    assert!((tau - committed as f64 / rounds as f64).abs() < 1e-12);
    let acc = v["acceptance"].as_f64().unwrap();
    assert!((acc - accepted as f64 / drafted as f64).abs() < 1e-12);
    assert!(tau > 1.0, "the trained drafter accepted nothing");
    for k in [
        "spec_tok_s",
        "plain_tok_s",
        "speedup",
        "round_ms",
        "decode_ms_per_token",
    ] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k}");
    }
}

#[test]
fn streamed_text_equals_the_decoded_tokens() {
    let prompt = "def quicksort(arr):";
    let (ok, text_out, stderr) = run(&["generate", prompt, "--max-new", "48"]);
    assert!(ok, "{stderr}");
    let (ok, json_out, stderr) = run(&["generate", prompt, "--max-new", "48", "--json"]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(json_out.trim()).unwrap();
    let text = v["text"].as_str().unwrap();
    let (streamed, summary) = text_out.split_once("\n--\ntau ").unwrap();
    assert_eq!(streamed, format!("{prompt}{text}"));
    assert!(
        summary.contains("plain "),
        "plain comparison by default: {summary}"
    );
    assert!(summary.contains("streams identical: yes"), "{summary}");
    // --json without --compare-plain keeps the spec-only fields
    assert!(v.get("plain_tokens").is_none());
}
