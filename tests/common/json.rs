//! JSON helpers shared by the config tests.
#![allow(dead_code)]
use serde_json::Value;

/// `base` with `fragment`'s keys merged in, recursively.
pub fn merged(mut base: Value, fragment: &Value) -> Value {
    if let (Value::Object(b), Value::Object(f)) = (&mut base, fragment) {
        for (k, v) in f {
            let slot = b.entry(k.clone()).or_insert(Value::Null);
            *slot = if slot.is_object() && v.is_object() { merged(slot.take(), v) } else { v.clone() };
        }
        return base;
    }
    fragment.clone()
}
