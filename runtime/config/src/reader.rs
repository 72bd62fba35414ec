//! A JSON object reader that knows where it is: typed getters that name the JSON path on error,
//! aliases, "auto", and an unknown-key check that suggests the closest known key.
use serde_json::{Map, Value};

use super::error::{ConfigError, Result};

/// One JSON object of the config, consumed key by key. `finish` rejects whatever was not asked for.
pub(crate) struct Section {
    path: String,
    map: Map<String, Value>,
    known: Vec<&'static str>,
    /// Other names of known keys (`take_aliased`'s second and later names).
    aliases: Vec<&'static str>,
    /// What each typed getter expects of a key, for the generated config reference (`zerorun config keys`).
    kinds: Vec<(&'static str, String)>,
}

thread_local! {
    /// While [`collect_keys`] runs: the path of every key a section asked for (aliases left out), with what its
    /// getter expects ("" where the key is read by hand).
    static ASKED: std::cell::RefCell<Option<Vec<(String, String)>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` and returns, beside its result, the path of every key the sections it read asked for and the type its
/// getter expects, in the order they were asked (`Config::accepted_keys`).
pub(crate) fn collect_keys<T>(f: impl FnOnce() -> T) -> (T, Vec<(String, String)>) {
    ASKED.with(|a| *a.borrow_mut() = Some(Vec::new()));
    let out = f();
    let keys = ASKED.with(|a| a.borrow_mut().take()).unwrap_or_default();
    (out, keys)
}

/// A value that may be the string "auto" (written by HF Trainer integrations).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum MaybeAuto<T> {
    Absent,
    Auto,
    Value(T),
}

pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::String(s) => format!("\"{s}\""),
        Value::Array(_) => {
            let text = value.to_string();
            if text.len() <= 60 {
                text
            } else {
                "a long array".into()
            }
        }
        Value::Object(_) => "an object".into(),
        other => other.to_string(),
    }
}

impl Section {
    /// Reads `value` as an object at `path` ("" for the top level).
    pub fn new(path: &str, value: Value) -> Result<Section> {
        match value {
            Value::Object(map) => {
                Ok(Section { path: path.to_string(), map, known: Vec::new(), aliases: Vec::new(), kinds: Vec::new() })
            }
            other => Err(ConfigError::Type {
                path: if path.is_empty() { "(top level)".into() } else { path.into() },
                expected: "an object",
                got: describe(&other),
            }),
        }
    }

    pub fn path_of(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// Takes `key`; a JSON null counts as absent (optional keys are written as null by `config show`).
    pub fn take(&mut self, key: &'static str) -> Option<Value> {
        self.known.push(key);
        match self.map.remove(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    /// Takes the first present of several names for one key (current name first). Two names given with
    /// different values is an error; returns the name that was used.
    pub fn take_aliased(&mut self, keys: &[&'static str]) -> Result<Option<(&'static str, Value)>> {
        let mut found: Option<(&'static str, Value)> = None;
        self.aliases.extend(keys.iter().skip(1));
        for &key in keys {
            if let Some(v) = self.take(key) {
                match &found {
                    Some((first, fv)) if fv != &v => {
                        return Err(ConfigError::Alias {
                            first: self.path_of(first),
                            second: self.path_of(key),
                            first_value: describe(fv),
                            second_value: describe(&v),
                        })
                    }
                    Some(_) => {}
                    None => found = Some((key, v)),
                }
            }
        }
        Ok(found)
    }

    /// Records what `key` holds (the last word wins: `choice` refines `opt_string`'s "a string").
    fn kind(&mut self, key: &'static str, kind: impl Into<String>) {
        self.kinds.push((key, kind.into()));
    }

    fn typed<T>(&self, key: &str, v: Value, expected: &'static str, f: impl Fn(&Value) -> Option<T>) -> Result<T> {
        f(&v).ok_or_else(|| ConfigError::Type { path: self.path_of(key), expected, got: describe(&v) })
    }

    fn auto_aware<T>(
        &mut self,
        keys: &[&'static str],
        expected: &'static str,
        f: impl Fn(&Value) -> Option<T>,
    ) -> Result<MaybeAuto<T>> {
        self.kind(keys[0], expected);
        match self.take_aliased(keys)? {
            None => Ok(MaybeAuto::Absent),
            Some((_, Value::String(s))) if s == "auto" => Ok(MaybeAuto::Auto),
            Some((key, v)) => self.typed(key, v, expected, f).map(MaybeAuto::Value),
        }
    }

    fn no_auto<T>(&self, key: &str, v: MaybeAuto<T>) -> Result<Option<T>> {
        match v {
            MaybeAuto::Absent => Ok(None),
            MaybeAuto::Value(x) => Ok(Some(x)),
            MaybeAuto::Auto => {
                Err(ConfigError::Auto { path: self.path_of(key), why: "zerorun has no trainer to take it from" })
            }
        }
    }

    /// Whether `keys` (aliases) are absent or "auto", without taking the value.
    pub fn uint_auto_peek(&self, keys: &[&'static str]) -> MaybeAuto<()> {
        match keys.iter().find_map(|k| self.map.get(*k).filter(|v| !v.is_null())) {
            None => MaybeAuto::Absent,
            Some(Value::String(s)) if s == "auto" => MaybeAuto::Auto,
            Some(_) => MaybeAuto::Value(()),
        }
    }

    pub fn uint_auto(&mut self, keys: &[&'static str]) -> Result<MaybeAuto<u64>> {
        self.auto_aware(keys, "a non-negative integer", as_uint)
    }

    pub fn opt_uint(&mut self, key: &'static str) -> Result<Option<u64>> {
        let v = self.uint_auto(&[key])?;
        self.no_auto(key, v)
    }

    pub fn uint(&mut self, key: &'static str, default: u64) -> Result<u64> {
        Ok(self.opt_uint(key)?.unwrap_or(default))
    }

    pub fn opt_int(&mut self, key: &'static str) -> Result<Option<i64>> {
        let v = self.auto_aware(&[key], "an integer", as_int)?;
        self.no_auto(key, v)
    }

    pub fn opt_float(&mut self, key: &'static str) -> Result<Option<f64>> {
        let v = self.auto_aware(&[key], "a number", Value::as_f64)?;
        self.no_auto(key, v)
    }

    pub fn float(&mut self, key: &'static str, default: f64) -> Result<f64> {
        Ok(self.opt_float(key)?.unwrap_or(default))
    }

    pub fn opt_bool(&mut self, keys: &[&'static str]) -> Result<Option<bool>> {
        let v = self.auto_aware(keys, "true or false", Value::as_bool)?;
        self.no_auto(keys[0], v)
    }

    pub fn bool(&mut self, key: &'static str, default: bool) -> Result<bool> {
        Ok(self.opt_bool(&[key])?.unwrap_or(default))
    }

    pub fn opt_string(&mut self, key: &'static str) -> Result<Option<String>> {
        let v = self.auto_aware(&[key], "a string", |v| v.as_str().map(str::to_string))?;
        self.no_auto(key, v)
    }

    /// A string that must be one of `allowed` (compared case-insensitively); returns the canonical spelling.
    pub fn choice(
        &mut self,
        key: &'static str,
        allowed: &[&'static str],
        default: &'static str,
    ) -> Result<&'static str> {
        let value = self.opt_string(key)?;
        self.kind(key, format!("one of {}", quoted_list(allowed)));
        match value {
            None => Ok(default),
            Some(s) => {
                allowed.iter().copied().find(|a| a.eq_ignore_ascii_case(&s)).ok_or_else(|| ConfigError::Invalid {
                    path: self.path_of(key),
                    value: format!("\"{s}\""),
                    allowed: format!("one of {}", quoted_list(allowed)),
                })
            }
        }
    }

    pub fn float_pair(&mut self, key: &'static str, default: [f64; 2]) -> Result<[f64; 2]> {
        self.kind(key, "an array of two numbers");
        match self.take(key) {
            None => Ok(default),
            Some(Value::String(s)) if s == "auto" => self.no_auto(key, MaybeAuto::<()>::Auto).map(|_| default),
            Some(v) => self.typed(key, v, "an array of two numbers", |v| {
                let a = v.as_array()?;
                (a.len() == 2).then_some(())?;
                Some([a[0].as_f64()?, a[1].as_f64()?])
            }),
        }
    }

    /// A nested object; absent gives an empty section so defaults apply.
    pub fn section(&mut self, key: &'static str) -> Result<Section> {
        let path = self.path_of(key);
        self.kind(key, "an object");
        match self.take(key) {
            None => Section::new(&path, Value::Object(Map::new())),
            Some(v) => Section::new(&path, v),
        }
    }

    /// Takes a key whose whole value is accepted and ignored (a DeepSpeed feature zerorun does not have).
    pub fn ignore(&mut self, key: &'static str) -> Option<String> {
        self.kind(key, "any value");
        self.take(key).map(|_| self.path_of(key))
    }

    /// Rejects every key that was not asked for, suggesting the closest known key.
    pub fn finish(self) -> Result<()> {
        ASKED.with(|a| {
            if let Some(asked) = a.borrow_mut().as_mut() {
                for key in self.known.iter().filter(|k| !self.aliases.contains(k)) {
                    let kind = self.kinds.iter().rev().find(|(k, _)| k == key).map_or("", |(_, kind)| kind.as_str());
                    asked.push((self.path_of(key), kind.to_string()));
                }
            }
        });
        let Some(unknown) = self.map.keys().next() else { return Ok(()) };
        let best = self
            .known
            .iter()
            .map(|k| (strsim::normalized_damerau_levenshtein(unknown, k), *k))
            .max_by(|a, b| a.0.total_cmp(&b.0));
        let hint = match best {
            Some((score, k)) if score >= 0.5 || k.contains(unknown.as_str()) => {
                format!("; did you mean `{}`?", self.path_of(k))
            }
            _ if self.known.is_empty() => String::new(),
            _ => {
                let mut known = self.known.clone();
                known.sort_unstable();
                known.dedup();
                format!("; known keys here: {}", known.join(", "))
            }
        };
        Err(ConfigError::UnknownKey { path: self.path_of(unknown), hint })
    }
}

pub(crate) fn quoted_list(items: &[&str]) -> String {
    items.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ")
}

/// Integers, and floats with no fractional part (DeepSpeed configs write sizes as `5e8`).
fn as_uint(v: &Value) -> Option<u64> {
    if let Some(u) = v.as_u64() {
        return Some(u);
    }
    let f = v.as_f64()?;
    (f >= 0.0 && f.fract() == 0.0 && f <= u64::MAX as f64).then_some(f as u64)
}

fn as_int(v: &Value) -> Option<i64> {
    if let Some(i) = v.as_i64() {
        return Some(i);
    }
    let f = v.as_f64()?;
    (f.fract() == 0.0 && f.abs() <= i64::MAX as f64).then_some(f as i64)
}
