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
//! `spec`: the oracle's greedy speculative loop (`spec_loop.py --json --engine-budget`) and the
//! Rust round engine (`dflash bench --json`) on the same pair, prompts, verify-width policy and
//! `max_new`, compared prompt by prompt: each side's spec stream equals its own greedy; where the
//! two greedy streams agree, the rounds (tokens committed per round) and tau are identical; where
//! they part (an f32 near-tie between torch and the Rust kernels), the position, the two tokens
//! and the target's top-2 logit gap are shown and the rounds before it must be identical.

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
    /// Prompt set: JSON lines with `ids` (as models/prompts-heldout.jsonl), or one id list per
    /// line (comma or space separated).
    #[arg(
        long,
        default_value = "models/prompts-heldout.jsonl",
        alias = "prompts-jsonl",
        alias = "prompts-file"
    )]
    prompts: String,
    /// The first N prompts (0: all).
    #[arg(long, default_value_t = 10, alias = "first")]
    limit: usize,
    /// EOS ids, comma separated, for both loops (default: the target config's eos_token_id).
    #[arg(long)]
    eos: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_new: usize,
    /// Verify-width cap (default: the block size).
    #[arg(long)]
    vt_cap: Option<usize>,
    /// Fixed verify width (both loops; the default is the engine's adaptive width).
    #[arg(long)]
    no_adaptive: bool,
    /// Adaptive width rounded up to a multiple of this (both loops; the CLI's default is 4).
    #[arg(long, default_value_t = 4)]
    verify_multiple: usize,
    /// Where the greedy streams part, a target top-2 logit gap (torch f32) below this is an
    /// f32 near-tie (reported, not a failure); above it, a real discrepancy.
    #[arg(long, default_value_t = 1e-3)]
    tie_gap: f64,
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
// spec loop: the oracle's loop vs the Rust engine (`dflash bench --json`), round for round

fn read_spec_prompts(path: &Path, limit: usize) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let ids: Vec<u32> = if line.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
            v["ids"]
                .as_array()
                .with_context(|| format!("{}:{}: no `ids`", path.display(), i + 1))?
                .iter()
                .map(|x| x.as_u64().map(|x| x as u32))
                .collect::<Option<_>>()
                .with_context(|| format!("{}:{}: non-integer id", path.display(), i + 1))?
        } else {
            line.replace(',', " ")
                .split_whitespace()
                .map(|x| x.parse::<u32>())
                .collect::<std::result::Result<_, _>>()
                .with_context(|| format!("{}:{}: bad id list", path.display(), i + 1))?
        };
        out.push(ids);
        if out.len() == limit && limit > 0 {
            break;
        }
    }
    Ok(out)
}

fn eos_ids(target: &Path) -> Vec<u32> {
    let v: serde_json::Value = std::fs::read_to_string(target.join("config.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    let e = v
        .get("text_config")
        .and_then(|t| t.get("eos_token_id"))
        .or_else(|| v.get("eos_token_id"));
    match e {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn usizes(v: &serde_json::Value) -> Vec<usize> {
    u32s(v).into_iter().map(|x| x as usize).collect()
}

fn first_diff(a: &[u32], b: &[u32]) -> Option<usize> {
    let n = a.len().min(b.len());
    (0..n)
        .find(|&i| a[i] != b[i])
        .or((a.len() != b.len()).then_some(n))
}

/// The last line of a command's stdout as JSON (the command may exit non-zero after printing
/// it: both loops report a spec != greedy prompt that way).
fn json_of(mut cmd: Command, what: &str) -> Result<serde_json::Value> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| {
        format!(
            "{what} ({}) printed no JSON:\n{}\n{}",
            out.status,
            tail(&stdout, 20),
            tail(&String::from_utf8_lossy(&out.stderr), 40)
        )
    })
}

pub fn parity_spec(a: SpecArgs) -> Result<()> {
    let root = repo_root();
    let prompts = read_spec_prompts(&root.join(&a.prompts), a.limit)?;
    if prompts.is_empty() {
        bail!("no prompts in {}", a.prompts);
    }
    let scratch = Scratch::new("spec-parity")?;
    let ids_txt = scratch.0.join("ids.txt");
    let jsonl = scratch.0.join("prompts.jsonl");
    let mut t = String::new();
    let mut j = String::new();
    for p in &prompts {
        let s: Vec<String> = p.iter().map(u32::to_string).collect();
        t += &s.join(",");
        t += "\n";
        j += &serde_json::json!({ "ids": p }).to_string();
        j += "\n";
    }
    std::fs::write(&ids_txt, t)?;
    std::fs::write(&jsonl, j)?;
    let eos = match &a.eos {
        Some(e) => e
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|x| x.trim().parse::<u32>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .context("--eos: comma separated ids")?,
        None => eos_ids(&root.join(&a.target)),
    };
    let eos_s: Vec<String> = eos.iter().map(u32::to_string).collect();

    // ---- the oracle (torch f32, no KV cache), with the engine's budget rule
    let mut py = Command::new(python());
    py.arg(root.join("tools/oracle/spec_loop.py"))
        .args(["--target", &a.target, "--draft", &a.draft])
        .arg("--prompts-file")
        .arg(&ids_txt)
        .args([
            "--max-new",
            &a.max_new.to_string(),
            "--engine-budget",
            "--json",
        ])
        .current_dir(&root);
    if !a.no_adaptive {
        py.args([
            "--adaptive",
            "--vt-multiple",
            &a.verify_multiple.to_string(),
        ]);
    }
    if let Some(c) = a.vt_cap {
        py.args(["--vt-cap", &c.to_string()]);
    }
    if !eos_s.is_empty() {
        py.args(["--eos", &eos_s.join(",")]);
    }
    println!(
        "== oracle: {} tools/oracle/spec_loop.py, {} prompts of {}, max_new {}, {} (EOS {:?})",
        python(),
        prompts.len(),
        a.prompts,
        a.max_new,
        if a.no_adaptive {
            "fixed width".to_string()
        } else {
            format!(
                "adaptive width rounded up to a multiple of {}",
                a.verify_multiple
            )
        },
        eos
    );
    let o = json_of(py, "spec_loop.py")?;

    // ---- the Rust engine (release build of the CLI, CPU backend)
    let mut rs = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    rs.args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "dflash-cli",
        "--",
        "bench",
    ])
    .args(["--target", &a.target, "--draft", &a.draft])
    .arg("--prompts")
    .arg(&jsonl)
    .args(["--max-new", &a.max_new.to_string(), "--json"])
    // The oracle's drafter computes in f32 with the target's own head: compare like with
    // like (the CLI's default Q8_0A8 drafter proposes slightly different blocks, which moves
    // tau but never the committed stream).
    .args(["--draft-precision", "f32", "--draft-head", "target"])
    .current_dir(&root);
    if a.no_adaptive {
        rs.arg("--no-adaptive");
    }
    rs.args(["--verify-multiple", &a.verify_multiple.to_string()]);
    if a.eos.is_some() {
        rs.arg("--no-eos");
        for e in &eos {
            rs.args(["--eos", &e.to_string()]);
        }
    }
    if let Some(c) = a.vt_cap {
        rs.args(["--verify-cap", &c.to_string()]);
    }
    println!(
        "== rust: cargo run --release -p dflash-cli -- bench --json --draft-precision f32 --draft-head target (same prompts)"
    );
    let r = json_of(rs, "dflash bench")?;

    let op = o["per_prompt"]
        .as_array()
        .context("oracle: no per_prompt")?;
    let rp = r["per_prompt"].as_array().context("rust: no per_prompt")?;
    if op.len() != prompts.len() || rp.len() != prompts.len() {
        bail!(
            "prompt counts differ: {} asked, oracle {}, rust {}",
            prompts.len(),
            op.len(),
            rp.len()
        );
    }
    println!(
        "{:>6} {:>4} | {:>6} {:>6} | {:>6} {:>6} | {:<10} {:<9} | verdict",
        "prompt", "len", "o.rnds", "o.tau", "r.rnds", "r.tau", "greedy", "spec=grdy"
    );
    let mut failures = Vec::new();
    let mut ties = 0;
    let mut agree = 0;
    let (mut ag_o, mut ag_r) = ((0usize, 0usize), (0usize, 0usize));
    for (i, (ov, rv)) in op.iter().zip(rp).enumerate() {
        let (o_tok, o_plain) = (u32s(&ov["tokens"]), u32s(&ov["plain_tokens"]));
        let (r_tok, r_plain) = (u32s(&rv["tokens"]), u32s(&rv["plain_tokens"]));
        let (o_rounds, r_rounds) = (
            usizes(&ov["committed_per_round"]),
            usizes(&rv["committed_per_round"]),
        );
        let o_tau = ov["tau"].as_f64().unwrap_or(f64::NAN);
        let r_tau = rv["tau"].as_f64().unwrap_or(f64::NAN);
        let o_ok = o_tok == o_plain;
        let r_ok = r_tok == r_plain;
        let diff = first_diff(&o_plain, &r_plain);
        let mut verdict = String::new();
        if !o_ok {
            failures.push(format!(
                "prompt {i}: the oracle's spec stream differs from its greedy"
            ));
            verdict += "ORACLE SPEC != GREEDY; ";
        }
        if !r_ok {
            failures.push(format!(
                "prompt {i}: the Rust spec stream differs from its greedy"
            ));
            verdict += "RUST SPEC != GREEDY; ";
        }
        let greedy = match diff {
            None => {
                agree += 1;
                if o_rounds == r_rounds {
                    verdict += "identical rounds";
                    ag_o.0 += o_rounds.iter().sum::<usize>();
                    ag_o.1 += o_rounds.len();
                    ag_r.0 += r_rounds.iter().sum::<usize>();
                    ag_r.1 += r_rounds.len();
                } else {
                    let k = o_rounds
                        .iter()
                        .zip(&r_rounds)
                        .take_while(|(x, y)| x == y)
                        .count();
                    verdict += &format!("ROUNDS DIFFER from round {k}");
                    failures.push(format!(
                        "prompt {i}: same greedy stream but different rounds (first at round {k}: \
                         oracle {:?}, rust {:?}): a real bug",
                        o_rounds.get(k),
                        r_rounds.get(k)
                    ));
                }
                "agree".to_string()
            }
            Some(k) => {
                // rounds that end before the parting position saw identical inputs
                let mut cum = 0;
                let before = r_rounds
                    .iter()
                    .take_while(|&&c| {
                        cum += c;
                        cum < k
                    })
                    .count();
                let same_before =
                    o_rounds.len() >= before && o_rounds[..before] == r_rounds[..before];
                let mut ids: Vec<String> = prompts[i].iter().map(u32::to_string).collect();
                ids.extend(o_plain[..k].iter().map(u32::to_string));
                let toks: Vec<String> = [o_plain.get(k), r_plain.get(k)]
                    .into_iter()
                    .flatten()
                    .map(u32::to_string)
                    .collect();
                let g = run_python(
                    "tools/oracle/logit_gap.py",
                    &[
                        "--target".into(),
                        a.target.clone(),
                        "--ids".into(),
                        ids.join(","),
                        "--tokens".into(),
                        toks.join(","),
                        "--json".into(),
                    ],
                )?;
                let g: serde_json::Value =
                    serde_json::from_str(g.lines().last().unwrap_or_default())
                        .context("parsing logit_gap.py output")?;
                let gap = g["gap"].as_f64().unwrap_or(f64::NAN);
                // the gap between the two chosen tokens in torch's logits
                let chosen: Vec<f64> = toks
                    .iter()
                    .filter_map(|t| g["tokens"][t].as_f64())
                    .collect();
                let pair_gap = if chosen.len() == 2 {
                    (chosen[0] - chosen[1]).abs()
                } else {
                    f64::NAN
                };
                verdict += &format!(
                    "greedy parts at token {k}: oracle {} rust {}, torch top-2 {} gap {gap:.2e}, \
                     logit(oracle) - logit(rust) {pair_gap:.2e}; {before} rounds before it {}",
                    o_plain.get(k).map_or("-".into(), u32::to_string),
                    r_plain.get(k).map_or("-".into(), u32::to_string),
                    g["top"],
                    if same_before { "identical" } else { "DIFFER" }
                );
                if pair_gap.is_nan() || pair_gap > a.tie_gap {
                    failures.push(format!(
                        "prompt {i}: greedy streams part at token {k} where the chosen tokens' \
                         logits differ by {pair_gap:.2e} (> tie gap {:.1e}): not a near-tie",
                        a.tie_gap
                    ));
                } else {
                    ties += 1;
                }
                if !same_before {
                    failures.push(format!(
                        "prompt {i}: the rounds before the parting position differ: a real bug"
                    ));
                }
                format!("part@{k}")
            }
        };
        println!(
            "{:>6} {:>4} | {:>6} {:>6.3} | {:>6} {:>6.3} | {:<10} {:<9} | {verdict}",
            i,
            prompts[i].len(),
            o_rounds.len(),
            o_tau,
            r_rounds.len(),
            r_tau,
            greedy,
            format!(
                "{}/{}",
                if o_ok { "yes" } else { "NO" },
                if r_ok { "yes" } else { "NO" }
            ),
        );
    }
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "all prompts: oracle tau pooled {:.4} (mean per prompt {:.4}), rust tau pooled {:.4} (mean per prompt {:.4})",
        f(&o, "tau_pooled"),
        f(&o, "tau_mean_per_prompt"),
        f(&r, "tau_pooled"),
        f(&r, "tau_mean_per_prompt")
    );
    println!(
        "prompts whose greedy streams agree: {agree}/{}; over them tau pooled oracle {:.4} rust {:.4} \
         ({} vs {} rounds); near-ties: {ties}",
        prompts.len(),
        ag_o.0 as f64 / ag_o.1.max(1) as f64,
        ag_r.0 as f64 / ag_r.1.max(1) as f64,
        ag_o.1,
        ag_r.1
    );
    if !failures.is_empty() {
        for s in &failures {
            println!("FAIL {s}");
        }
        bail!("{} spec-loop discrepancies", failures.len());
    }
    println!("spec parity OK");
    Ok(())
}
