//! A model as a list of units run in order (embedding, each block, head): the granularity at which stage 3
//! gathers parameters. Any model is at least one unit.
use tch::Tensor;

use crate::error::{Error, Result};

/// A model the engine runs unit by unit. Unit `i`'s parameters are the parameters (trainable or frozen) whose
/// names are one of its prefixes or start with a prefix and a `.` (the empty prefix takes every parameter); each
/// parameter belongs to exactly one unit, and unit `i` only uses its own parameters. Buffers (BatchNorm's running
/// statistics) need no unit: every rank holds them whole.
/// ```
/// use tch::nn::{self, Module};
/// use tch::Tensor;
///
/// struct Mlp {
///     layers: Vec<nn::Linear>,
/// }
///
/// impl zerorun_runtime::engine::UnitModel for Mlp {
///     fn unit_prefixes(&self) -> Vec<Vec<String>> {
///         (0..self.layers.len()).map(|i| vec![format!("layers.{i}")]).collect()
///     }
///     fn forward_unit(&self, unit: usize, x: &Tensor) -> Tensor {
///         self.layers[unit].forward(x).relu()
///     }
/// }
///
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let layers = (0..3).map(|i| nn::linear(vs.root() / "layers" / i, 8, 8, Default::default())).collect();
/// let model = Mlp { layers };
/// // The engine takes the units with `EngineOptions::default().units_of(&model)`.
/// assert_eq!(zerorun_runtime::engine::UnitModel::unit_prefixes(&model).len(), 3);
/// ```
pub trait UnitModel {
    /// The parameter-name prefixes of every unit, in execution order.
    fn unit_prefixes(&self) -> Vec<Vec<String>>;
    /// Runs unit `unit` on the previous unit's output (the model's input for unit 0).
    fn forward_unit(&self, unit: usize, input: &Tensor) -> Tensor;
}

/// Gives unit `i`'s variables (name, tensor) their storage and values right before stage 3 packs them; see
/// `builders.rs`.
pub type Materialize<'m> = dyn FnMut(usize, &[(&str, &Tensor)]) -> Result<()> + 'm;

/// A whole model as one unit: `Whole(|x| model.forward(x))`.
/// ```
/// use tch::nn::{self, Module};
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::seq().add(nn::linear(vs.root() / "a", 4, 4, Default::default())).add_fn(|x| x.relu());
/// let model = zerorun_runtime::engine::Whole(move |x: &tch::Tensor| net.forward(x));
/// let options = zerorun_runtime::EngineOptions::default().units_of(&model); // one unit: the whole model
/// # let _ = options;
/// ```
pub struct Whole<F: Fn(&Tensor) -> Tensor>(pub F);

impl<F: Fn(&Tensor) -> Tensor> UnitModel for Whole<F> {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        vec![vec![String::new()]]
    }

    fn forward_unit(&self, _unit: usize, input: &Tensor) -> Tensor {
        (self.0)(input)
    }
}

/// A stack of units given as closures with their prefixes: `Sequence::new().unit(["tok", "pos"], |x| ...)`.
#[derive(Default)]
/// ```
/// use tch::nn::{self, Module};
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let (tok, head) = (nn::embedding(vs.root() / "tok", 100, 16, Default::default()), nn::linear(vs.root() / "head", 16, 100, Default::default()));
/// let model = zerorun_runtime::engine::Sequence::new()
///     .unit(["tok"], move |ids| tok.forward(ids))
///     .unit(["head"], move |h| head.forward(h));
/// let options = zerorun_runtime::EngineOptions::default().units_of(&model);
/// # let _ = options;
/// ```
pub struct Sequence<'a> {
    units: Vec<(Vec<String>, UnitFn<'a>)>,
}

/// One unit's forward.
type UnitFn<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;

impl<'a> Sequence<'a> {
    /// No unit yet.
    pub fn new() -> Self {
        Sequence { units: Vec::new() }
    }

    /// Appends a unit owning the parameters under `prefixes`.
    pub fn unit<S: Into<String>>(
        mut self,
        prefixes: impl IntoIterator<Item = S>,
        forward: impl Fn(&Tensor) -> Tensor + 'a,
    ) -> Self {
        self.units.push((prefixes.into_iter().map(Into::into).collect(), Box::new(forward)));
        self
    }
}

impl UnitModel for Sequence<'_> {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        self.units.iter().map(|(p, _)| p.clone()).collect()
    }

    fn forward_unit(&self, unit: usize, input: &Tensor) -> Tensor {
        (self.units[unit].1)(input)
    }
}

/// Whether the parameter `name` is under `prefix` (whole path segments; the empty prefix takes every name).
pub(crate) fn owns(prefix: &str, name: &str) -> bool {
    prefix.is_empty()
        || name == prefix
        || (name.starts_with(prefix) && name.as_bytes().get(prefix.len()) == Some(&b'.'))
}

/// The unit of every parameter name: `names` are assigned in order; errors name a parameter no unit (or two
/// units) claim, and a unit that owns no parameter.
pub fn assign(prefixes: &[Vec<String>], names: &[String]) -> Result<Vec<usize>> {
    let mut unit_of = Vec::with_capacity(names.len());
    let mut used = vec![false; prefixes.len()];
    for name in names {
        let owners: Vec<usize> = (0..prefixes.len()).filter(|&u| prefixes[u].iter().any(|p| owns(p, name))).collect();
        match owners.as_slice() {
            [u] => {
                used[*u] = true;
                unit_of.push(*u);
            }
            [] => {
                return Err(Error::Parameter {
                    name: name.clone(),
                    why: format!("belongs to no unit (unit prefixes: {prefixes:?})"),
                })
            }
            many => {
                return Err(Error::Parameter {
                    name: name.clone(),
                    why: format!("belongs to several units: {many:?}; each parameter needs exactly one"),
                })
            }
        }
    }
    if let Some(u) = used.iter().position(|u| !u) {
        return Err(Error::Usage(format!("unit {u} (prefixes {:?}) owns no parameter", prefixes[u])));
    }
    Ok(unit_of)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn prefixes_match_whole_path_segments() {
        let units = vec![names(&["tok", "pos"]), names(&["blocks.1"]), names(&["blocks.10"])];
        let got = assign(&units, &names(&["blocks.1.w", "blocks.10.w", "pos.weight", "tok.weight"])).unwrap();
        assert_eq!(got, vec![1, 2, 0, 0]);
    }

    #[test]
    fn unclaimed_doubly_claimed_and_empty_units_are_errors() {
        let e = assign(&[names(&["a"])], &names(&["b.w"])).unwrap_err().to_string();
        assert!(e.starts_with("parameter `b.w`: belongs to no unit"), "{e}");
        let e = assign(&[names(&["a"]), names(&[""])], &names(&["a.w"])).unwrap_err().to_string();
        assert!(e.contains("belongs to several units: [0, 1]"), "{e}");
        let e = assign(&[names(&["a"]), names(&["c"])], &names(&["a.w"])).unwrap_err().to_string();
        assert_eq!(e, "unit 1 (prefixes [\"c\"]) owns no parameter");
    }
}
