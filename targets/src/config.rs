//! Reading HF `config.json` values with errors that name the key.

use dflash_backend::RopeSpec;
use serde_json::Value;

use crate::{Result, TargetError};

/// A view of one config object (the root, or a nested `text_config`).
pub struct Cfg<'a> {
    pub path: String,
    pub v: &'a Value,
}

impl<'a> Cfg<'a> {
    pub fn new(path: String, v: &'a Value) -> Self {
        Cfg { path, v }
    }

    fn err(&self, msg: String) -> TargetError {
        TargetError::Config {
            path: self.path.clone(),
            msg,
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| self.err(format!("missing or non-integer key `{key}`")))
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| self.err(format!("key `{key}` is not an integer: {v}"))),
        }
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        self.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| self.err(format!("missing or non-numeric key `{key}`")))
    }

    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(format!("key `{key}` is not a number: {v}"))),
        }
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("key `{key}` is not a boolean: {v}"))),
        }
    }

    pub fn str_or(&self, key: &str, default: &'a str) -> Result<&'a str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(format!("key `{key}` is not a string: {v}"))),
        }
    }

    pub fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| self.err(format!("key `{key}` holds a non-string: {x}")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(format!("key `{key}` is not a list: {v}"))),
        }
    }

    /// `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older files), with
    /// `partial_rotary_factor` from either place. Supports the `default` and `linear` types.
    pub fn rope(&self, head_dim: usize) -> Result<RopeSpec> {
        let params = self
            .get("rope_parameters")
            .or_else(|| self.get("rope_scaling"));
        let pget = |k: &str| params.and_then(|p| p.get(k)).filter(|v| !v.is_null());
        let theta = match pget("rope_theta") {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(format!("rope_theta is not a number: {v}")))?,
            None => self.f64_or("rope_theta", 10000.0)?,
        };
        let partial = match pget("partial_rotary_factor") {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(format!("partial_rotary_factor is not a number: {v}")))?,
            None => self.f64_or("partial_rotary_factor", 1.0)?,
        };
        let rtype = pget("rope_type")
            .or_else(|| pget("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let dim = (head_dim as f64 * partial) as usize;
        if dim == 0 || dim & 1 == 1 || dim > head_dim {
            return Err(self.err(format!(
                "rotary dim {dim} (head_dim {head_dim} x partial_rotary_factor {partial}) must be even and in 2..=head_dim"
            )));
        }
        // transformers: inv_freq = 1 / base ** (arange(0, dim, 2, int64).float() / dim), in f32.
        let mut inv_freq: Vec<f32> = (0..dim / 2)
            .map(|i| {
                let e = (2 * i) as f32 / dim as f32;
                1.0f32 / (theta as f32).powf(e)
            })
            .collect();
        match rtype {
            "default" => {}
            "linear" => {
                let f = pget("factor")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| self.err("linear rope without `factor`".into()))?;
                for x in &mut inv_freq {
                    *x /= f as f32;
                }
            }
            other => {
                return Err(TargetError::Unsupported(format!(
                    "{}: rope type `{other}` is not supported by the reference targets",
                    self.path
                )))
            }
        }
        Ok(RopeSpec {
            inv_freq,
            attention_scaling: 1.0,
        })
    }
}
