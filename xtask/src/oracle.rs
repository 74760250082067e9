//! `cargo xtask parity draft|targets|spec`: live parity with the independent Python oracle
//! (`tools/oracle/`).
//!
//! `draft` / `targets`: regenerate the fixtures with the oracle into a temp dir, run the oracle's
//! own checks on them (`selfcheck.py` resp. `hybrid_ref.py`), compare the regenerated expectations
//! with the committed ones (oracle reproducibility across torch/transformers builds), then run the
//! crate's fixture tests with `DFLASH_FIXTURES_DIR` pointing at the temp dir and tabulate the
//! `PARITY` lines they print. Exits non-zero if any step fails, if a test did not report the temp
//! dir (it ignored the env var), or if a case reported nothing.
//!
//! `spec`: the oracle's greedy speculative loop (`spec_loop.py --json`) on a target + drafter pair,
//! printed next to whatever tau the caller passes with `--expect-tau` (the Rust CLI's figure).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;
use safetensors::{Dtype, SafeTensors};

use crate::{python, repo_root, run_python, Scratch};

#[derive(Args)]
pub struct FixtureArgs {
    /// Keep the regenerated fixtures (printed path) instead of deleting them.
    #[arg(long)]
    keep: bool,
    /// Only these cases (comma separated), for the regeneration step.
    #[arg(long, default_value = "")]
    cases: String,
    /// Skip `cargo test` (only regenerate, self-check and compare with the committed fixtures).
    #[arg(long)]
    no_test: bool,
}

#[derive(Args)]
pub struct SpecArgs {
    /// HF target directory.
    #[arg(long, default_value = "models/target")]
    target: String,
    /// Drafter directory.
    #[arg(long, default_value = "models/draft")]
    draft: String,
    /// File with one prompt per line (token ids, comma or space separated).
    #[arg(long)]
    prompts_file: Option<String>,
    /// JSON lines with an `ids` list (used when --prompts-file is not given).
    #[arg(long, default_value = "models/prompts-heldout.jsonl")]
    prompts_jsonl: String,
    /// Only the first N prompts (0: all).
    #[arg(long, default_value_t = 0)]
    first: usize,
    /// EOS token ids, comma separated (the shipped pair uses 0).
    #[arg(long, default_value = "0")]
    eos: String,
    #[arg(long, default_value_t = 64)]
    max_new: usize,
    /// Verify-width cap (default: the block size).
    #[arg(long)]
    vt_cap: Option<usize>,
    #[arg(long)]
    adaptive: bool,
    /// tau measured by the Rust engine on the same prompts; compared to the oracle's pooled tau.
    #[arg(long)]
    expect_tau: Option<f64>,
}

#[derive(Clone, Copy)]
enum Which {
    Draft,
    Targets,
}

impl Which {
    fn crate_dir(self) -> &'static str {
        match self {
            Which::Draft => "draft-model",
            Which::Targets => "targets",
        }
    }
    fn package(self) -> &'static str {
        match self {
            Which::Draft => "dflash-draft-model",
            Which::Targets => "dflash-targets",
        }
    }
}

pub fn parity_draft(a: FixtureArgs) -> Result<()> {
    run(Which::Draft, a)
}

pub fn parity_targets(a: FixtureArgs) -> Result<()> {
    run(Which::Targets, a)
}

fn run(which: Which, a: FixtureArgs) -> Result<()> {
    let root = repo_root();
    let scratch = Scratch::new(match which {
        Which::Draft => "parity-draft",
        Which::Targets => "parity-targets",
    })?;
    let dir = scratch.0.clone();
    let dir_s = dir.display().to_string();
    println!(
        "== regenerating {} fixtures with the oracle into {dir_s}",
        which.crate_dir()
    );
    let mut args: Vec<String> = match which {
        Which::Draft => vec![
            "--only".into(),
            "draft".into(),
            "--draft-out".into(),
            dir_s.clone(),
        ],
        Which::Targets => vec![
            "--only".into(),
            "targets".into(),
            "--targets-out".into(),
            dir_s.clone(),
        ],
    };
    if !a.cases.is_empty() {
        args.push("--cases".into());
        args.push(a.cases.clone());
    }
    print!("{}", run_python("tools/oracle/make_fixtures.py", &args)?);

    println!("== oracle self-checks");
    let out = match which {
        Which::Draft => run_python(
            "tools/oracle/selfcheck.py",
            &["--draft-fixtures".into(), dir_s.clone()],
        ),
        Which::Targets => run_python(
            "tools/oracle/hybrid_ref.py",
            &["--fixtures".into(), dir_s.clone()],
        ),
    };
    match out {
        Ok(s) => print!("{s}"),
        Err(e) if which_missing_hybrid(which, &dir) => println!("(skipped: {e})"),
        Err(e) => return Err(e),
    }

    println!("== regenerated vs committed expectations (oracle reproducibility)");
    let committed = root.join(which.crate_dir()).join("tests/fixtures");
    let repro_bad = compare_dirs(&dir, &committed)?;

    let mut failures = Vec::new();
    if repro_bad > 0 {
        failures.push(format!(
            "{repro_bad} regenerated tensors differ from the committed ones by > 1e-4 rel"
        ));
    }
    if !a.no_test {
        failures.extend(run_tests(which, &dir)?);
    }
    if a.keep {
        let kept = std::env::temp_dir().join(format!("dflash-{}-fixtures-kept", which.crate_dir()));
        let _ = std::fs::remove_dir_all(&kept);
        std::fs::rename(&dir, &kept).with_context(|| format!("keeping {}", kept.display()))?;
        println!("kept the regenerated fixtures in {}", kept.display());
    }
    if failures.is_empty() {
        println!("parity {}: OK", which.crate_dir());
        Ok(())
    } else {
        for f in &failures {
            println!("FAIL: {f}");
        }
        bail!(
            "parity {}: {} failure(s)",
            which.crate_dir(),
            failures.len()
        )
    }
}

fn which_missing_hybrid(which: Which, dir: &Path) -> bool {
    matches!(which, Which::Targets) && !dir.join("qwen3_5_hybrid").exists()
}

// -------------------------------------------------------------------------------------------
// regenerated vs committed

enum Tensor {
    F(Vec<f32>),
    I(Vec<i64>),
}

fn read_io(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let st =
        SafeTensors::deserialize(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let t = match view.dtype() {
            Dtype::F32 => Tensor::F(
                view.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::I64 => Tensor::I(
                view.data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            ),
            d => bail!("{}: {name}: unexpected dtype {d:?}", path.display()),
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// (max abs, max abs / max |committed|)
fn errs(new: &[f32], old: &[f32]) -> (f64, f64) {
    let scale = old.iter().fold(0f64, |m, x| m.max(f64::from(x.abs())));
    let abs = new
        .iter()
        .zip(old)
        .fold(0f64, |m, (a, b)| m.max(f64::from((a - b).abs())));
    (abs, if scale > 0.0 { abs / scale } else { abs })
}

fn compare_dirs(new_root: &Path, old_root: &Path) -> Result<usize> {
    let mut bad = 0;
    let mut cases: Vec<PathBuf> = std::fs::read_dir(new_root)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("io.safetensors").exists())
        .collect();
    cases.sort();
    for case in cases {
        let name = case
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let old_io = old_root.join(&name).join("io.safetensors");
        if !old_io.exists() {
            println!("  {name}: no committed fixture to compare");
            continue;
        }
        let new = read_io(&case.join("io.safetensors"))?;
        let old = read_io(&old_io)?;
        let (mut worst_abs, mut worst_rel, mut worst_name) = (0f64, 0f64, String::new());
        let mut notes = Vec::new();
        for (k, v) in &new {
            match (v, old.get(k)) {
                (Tensor::F(a), Some(Tensor::F(b))) if a.len() == b.len() => {
                    let (ab, rel) = errs(a, b);
                    if rel > 1e-4 {
                        bad += 1;
                        notes.push(format!("{k} rel {rel:.2e}"));
                    }
                    if rel > worst_rel || worst_name.is_empty() {
                        (worst_abs, worst_rel, worst_name) = (ab, rel, k.clone());
                    }
                }
                (Tensor::I(a), Some(Tensor::I(b))) if a == b => {}
                (Tensor::I(_), Some(Tensor::I(_))) => {
                    bad += 1;
                    notes.push(format!("{k} token ids differ"));
                }
                _ => {
                    bad += 1;
                    notes.push(format!("{k} missing or reshaped"));
                }
            }
        }
        println!(
            "  {name:<16} {} tensors, worst {worst_name:<18} max_abs {worst_abs:.2e} max_rel {worst_rel:.2e}{}",
            new.len(),
            if notes.is_empty() { String::new() } else { format!("  !! {}", notes.join(", ")) }
        );
    }
    Ok(bad)
}

// -------------------------------------------------------------------------------------------
// cargo test with DFLASH_FIXTURES_DIR

fn fixture_test_targets(which: Which) -> Result<Vec<String>> {
    let tests = repo_root().join(which.crate_dir()).join("tests");
    let mut names = Vec::new();
    for e in std::fs::read_dir(&tests).with_context(|| format!("listing {}", tests.display()))? {
        let p = e?.path();
        if p.extension().and_then(|s| s.to_str()) != Some("rs") {
            continue;
        }
        let stem = p
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        // named like a parity test and reading the oracle fixture dir (not other reference data)
        let src = std::fs::read_to_string(&p).unwrap_or_default();
        let reads_fixtures = src.contains("tests/fixtures") || src.contains("DFLASH_FIXTURES_DIR");
        if reads_fixtures
            && ["oracle", "parity", "fixture"]
                .iter()
                .any(|k| stem.contains(k))
        {
            names.push(stem);
        }
    }
    names.sort();
    Ok(names)
}

struct Row {
    case: String,
    tensor: String,
    abs: Option<f64>,
    rel: f64,
    bound: Option<f64>,
}

fn num(s: &str) -> Option<f64> {
    s.trim_matches(|c: char| c == '(' || c == ')' || c == ',')
        .parse()
        .ok()
}

/// `PARITY <case> <tensor> max_abs=<e> max_rel=<e> [bound=<b>]`, the draft-model's
/// `<case> <what...> max rel err <e> (bound <b>)`, or `<case>: <what...> rel err <e>`.
fn parse_line(line: &str) -> Option<Row> {
    let w: Vec<&str> = line.split_whitespace().collect();
    if w.first() == Some(&"PARITY") && w.len() >= 4 {
        let mut r = Row {
            case: w[1].into(),
            tensor: w[2].into(),
            abs: None,
            rel: f64::NAN,
            bound: None,
        };
        for kv in &w[3..] {
            if let Some((k, v)) = kv.split_once('=') {
                match k {
                    "max_abs" => r.abs = num(v),
                    "max_rel" => r.rel = num(v).unwrap_or(f64::NAN),
                    "bound" => r.bound = num(v),
                    _ => {}
                }
            }
        }
        return Some(r);
    }
    if let Some(c) = w.first().and_then(|c| c.strip_suffix(':')) {
        let i = w.windows(2).position(|x| x == ["rel", "err"])?;
        if i < 2 {
            return None;
        }
        let rel = num(w.get(i + 2)?)?;
        return Some(Row {
            case: c.into(),
            tensor: w[1..i].join(" "),
            abs: None,
            rel,
            bound: None,
        });
    }
    let i = w.windows(3).position(|x| x == ["max", "rel", "err"])?;
    if i < 2 {
        return None;
    }
    let rel = num(w.get(i + 3)?)?;
    let bound = w
        .iter()
        .position(|x| x.trim_start_matches('(') == "bound")
        .and_then(|j| w.get(j + 1))
        .and_then(|s| num(s));
    Some(Row {
        case: w[0].into(),
        tensor: w[1..i].join(" "),
        abs: None,
        rel,
        bound,
    })
}

fn run_tests(which: Which, dir: &Path) -> Result<Vec<String>> {
    let targets = fixture_test_targets(which)?;
    if targets.is_empty() {
        return Ok(vec![format!(
            "{} has no oracle/parity/fixture test files",
            which.crate_dir()
        )]);
    }
    // one cargo test per file, so each file is checked for honouring DFLASH_FIXTURES_DIR
    let dir_s = dir.display().to_string();
    let mut failures = Vec::new();
    let mut stdout = String::new();
    for t in &targets {
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["test", "-p", which.package(), "--test", t.as_str()]);
        cmd.args(["--", "--nocapture", "--test-threads=1"]);
        cmd.env("DFLASH_FIXTURES_DIR", dir).current_dir(repo_root());
        println!(
            "== cargo test -p {} --test {t} (DFLASH_FIXTURES_DIR={dir_s})",
            which.package()
        );
        let out = cmd.output().context("running cargo test")?;
        let so = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            println!("{so}");
            println!("{}", tail(&String::from_utf8_lossy(&out.stderr), 60));
            failures.push(format!(
                "cargo test -p {} --test {t} failed ({})",
                which.package(),
                out.status
            ));
        }
        if !so.contains(&dir_s) {
            failures.push(format!(
                "test file {t} never printed the temp dir {dir_s}: it ignores DFLASH_FIXTURES_DIR \
                 (see /work/fixture-format.md) and checked the committed fixtures instead"
            ));
        }
        stdout.push_str(&so);
    }
    let rows: Vec<Row> = stdout.lines().filter_map(parse_line).collect();
    let mut by_case: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for r in &rows {
        by_case.entry(r.case.clone()).or_default().push(r);
    }
    for (case, rs) in &by_case {
        println!("\n  {case}");
        println!(
            "    {:<30} {:>10} {:>10} {:>8}",
            "tensor", "max_abs", "max_rel", "bound"
        );
        for r in rs {
            let abs = r
                .abs
                .map(|x| format!("{x:.2e}"))
                .unwrap_or_else(|| "-".into());
            let bound = r
                .bound
                .map(|x| format!("{x:.0e}"))
                .unwrap_or_else(|| "-".into());
            let flag = match r.bound {
                Some(b) if r.rel.is_nan() || r.rel > b => "  FAIL",
                _ => "",
            };
            println!(
                "    {:<30} {abs:>10} {:>10.2e} {bound:>8}{flag}",
                r.tensor, r.rel
            );
            if !flag.is_empty() {
                failures.push(format!("{case} {}: {:.2e} > bound", r.tensor, r.rel));
            }
        }
    }
    let committed_cases: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("case.json").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    for c in committed_cases {
        // tests may report a case per precision as "<case>/<precision>"
        let reported = by_case
            .keys()
            .any(|k| k == &c || k.split('/').next() == Some(c.as_str()));
        if !reported {
            failures.push(format!("no parity figures reported for case {c}"));
        }
    }
    Ok(failures)
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// -------------------------------------------------------------------------------------------
// spec loop tau

pub fn parity_spec(a: SpecArgs) -> Result<()> {
    let mut args = vec![
        "--target".to_string(),
        a.target.clone(),
        "--draft".into(),
        a.draft.clone(),
        "--max-new".into(),
        a.max_new.to_string(),
        "--first".into(),
        a.first.to_string(),
        "--json".into(),
    ];
    match &a.prompts_file {
        Some(f) => args.extend(["--prompts-file".to_string(), f.clone()]),
        None => args.extend(["--prompts-jsonl".to_string(), a.prompts_jsonl.clone()]),
    }
    if !a.eos.is_empty() {
        args.extend(["--eos".to_string(), a.eos.clone()]);
    }
    if let Some(c) = a.vt_cap {
        args.push("--vt-cap".into());
        args.push(c.to_string());
    }
    if a.adaptive {
        args.push("--adaptive".into());
    }
    println!(
        "== oracle spec loop ({}): {} + {}",
        python(),
        a.target,
        a.draft
    );
    let out = run_python("tools/oracle/spec_loop.py", &args)?;
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default())
        .context("parsing spec_loop.py --json output")?;
    let tau = v["tau_pooled"].as_f64().unwrap_or(f64::NAN);
    println!(
        "oracle: prompts {} rounds {} accepted {} tau pooled {tau:.4} (mean per prompt {:.4}) identical {}",
        v["prompts"], v["rounds"], v["accepted"], v["tau_mean_per_prompt"].as_f64().unwrap_or(f64::NAN), v["identical"]
    );
    if v["identical"] != serde_json::Value::Bool(true) {
        bail!("the oracle's spec stream differs from its plain greedy");
    }
    if let Some(t) = a.expect_tau {
        let mean = v["tau_mean_per_prompt"].as_f64().unwrap_or(f64::NAN);
        println!(
            "rust:   tau {t:.4}   vs oracle pooled: diff {:.2e}, vs oracle per-prompt mean: diff {:.2e}",
            (t - tau).abs(),
            (t - mean).abs()
        );
        if (t - tau).abs() > 1e-9 && (t - mean).abs() > 1e-9 {
            bail!("tau differs: greedy is deterministic, the two loops must agree round for round");
        }
    }
    Ok(())
}
