//! Models built unit by unit (`UnitBuilders`, `Engine::from_builders`): at stage 3 the initial weights are bitwise
//! those of building the whole model from the same seed (fp32 and bf16), and a builder that does not make the
//! same variables again is an error naming the parameter. One rank per engine: thread ranks share libtorch's
//! generator, so multi-rank runs of builders are processes (tests/launch_equivalence.rs).
use std::cell::Cell;
use std::time::Duration;

use serde_json::json;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions, UnitBuilders};

const DIMS: [i64; 4] = [6, 10, 10, 3];

fn config(stage: u8, bf16: bool) -> Config {
    Config::from_value(json!({
        "train_batch_size": 4, "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}
    }))
    .unwrap()
}

fn builders() -> UnitBuilders<'static> {
    (0..DIMS.len() - 1).fold(UnitBuilders::new(), |b, i| {
        b.unit([format!("layers.{i}")], move |p: &nn::Path| {
            let l = nn::linear(p / "layers" / i, DIMS[i], DIMS[i + 1], Default::default());
            Box::new(move |x: &Tensor| l.forward(x).tanh())
        })
    })
}

fn values(sd: Vec<(String, Tensor)>) -> Vec<(String, Vec<f32>)> {
    sd.into_iter().map(|(n, t)| (n, Vec::<f32>::try_from(t.to_kind(Kind::Float).reshape([-1])).unwrap())).collect()
}

/// libtorch's generator is process-wide and the tests of this file run in parallel threads: one at a time.
fn generator() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn comm() -> threads::ThreadComm {
    threads::group(1, Duration::from_secs(10)).pop().unwrap()
}

#[test]
fn builders_start_from_the_weights_of_the_ordinary_construction() {
    let _g = generator();
    for bf16 in [false, true] {
        tch::manual_seed(42);
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let layers: Vec<nn::Linear> = (0..DIMS.len() - 1)
            .map(|i| nn::linear(vs.root() / "layers" / i, DIMS[i], DIMS[i + 1], Default::default()))
            .collect();
        if bf16 {
            vs.bfloat16();
        }
        let after_ordinary = Tensor::randn([1], (Kind::Float, tch::Device::Cpu));
        let units: Vec<Vec<String>> = (0..layers.len()).map(|i| vec![format!("layers.{i}")]).collect();
        let mut ordinary = Engine::new(
            &vs,
            config(3, bf16),
            Box::new(comm()),
            EngineOptions { units: Some(units), ..Default::default() },
        )
        .unwrap();
        tch::manual_seed(42);
        let built_vs = nn::VarStore::new(tch::Device::Cpu);
        let (mut built, _model) =
            Engine::from_builders(&built_vs, config(3, bf16), Box::new(comm()), EngineOptions::default(), builders())
                .unwrap();
        let after_built = Tensor::randn([1], (Kind::Float, tch::Device::Cpu));
        assert_eq!(values(built.state_dict().unwrap()), values(ordinary.state_dict().unwrap()), "bf16 {bf16}");
        // The generator is left where the ordinary construction leaves it.
        assert_eq!(
            Vec::<f32>::try_from(after_built).unwrap(),
            Vec::<f32>::try_from(after_ordinary).unwrap(),
            "bf16 {bf16}"
        );
    }
}

#[test]
fn a_builder_that_makes_other_variables_the_second_time_is_an_error() {
    let _g = generator();
    let calls = Cell::new(0);
    let b = UnitBuilders::new().unit(["w"], |p: &nn::Path| {
        calls.set(calls.get() + 1);
        let n = if calls.get() == 1 { 4 } else { 5 };
        let w = p.var("w", &[n], nn::Init::Const(1.0));
        Box::new(move |x: &Tensor| x * &w.sum(Kind::Float))
    });
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let e = Engine::from_builders(&vs, config(3, false), Box::new(comm()), EngineOptions::default(), b)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(e, "parameter `w`: the builder of unit 0 made it [4], then [5]");
}
