//! Full weights out of the engine: every parameter by name, the state dict, DeepSpeed's `save_16bit_model`.
use super::*;

/// Full weights out of the engine: every parameter by name, and DeepSpeed's `save_16bit_model`.
impl Engine {
    /// Every parameter by name as full fp32 copies (identical on every rank). Collective at stage 3, where it
    /// gathers the units one at a time: every rank calls it.
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.full_parameters_as(Kind::Float)
    }

    pub(super) fn full_parameters_as(&mut self, kind: Kind) -> Result<Vec<(String, Tensor)>> {
        if self.plan.partitions_parameters() {
            return self.gather_full_parameters(kind, false);
        }
        Ok(self
            .states
            .layout
            .slots
            .iter()
            .zip(&self.states.params)
            .map(|(s, t)| (s.name.clone(), t.detach().to_kind(kind).copy()))
            .collect())
    }

    /// Every variable of the VarStore by name, full size: trainable parameters in the model's dtype, frozen
    /// parameters and buffers in theirs (buffers as this rank has them). It is what `VarStore::load` of the same
    /// model reads back once written with `Tensor::write_safetensors` (a `vs.save` at stage 3 would write the
    /// empty tensors of the released units). Collective at stage 3, where it gathers the units one at a time:
    /// every rank calls it.
    pub fn state_dict(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.model_tensors(Some(views::kind_of(self.precision())), true)
    }

    /// The trainable parameters as `kind` (None: without them), the frozen ones (with `frozen`, in their dtype)
    /// and the buffers, by name. Stage 3 gathers the units one at a time (collective).
    pub(super) fn model_tensors(&mut self, kind: Option<Kind>, frozen: bool) -> Result<Vec<(String, Tensor)>> {
        let stage3 = self.plan.partitions_parameters();
        let mut out = match kind {
            // One walk over the units gathers both kinds of parameters.
            Some(kind) if stage3 => self.gather_full_parameters(kind, frozen)?,
            Some(kind) => self.full_parameters_as(kind)?,
            None => Vec::new(),
        };
        if frozen && !(stage3 && kind.is_some()) {
            match &mut self.states.parameters.frozen_units {
                Some(units) => out.extend(units.full_copies(self.comm.as_ref())?),
                None => out.extend(self.states.frozen.iter().map(|(n, t)| (n.clone(), t.detach().copy()))),
            }
        }
        out.extend(self.states.buffers.iter().map(|(n, t)| (n.clone(), t.detach().copy())));
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// (name, shape, kind) of every frozen parameter.
    pub(crate) fn frozen_specs(&self) -> Vec<(String, Vec<i64>, Kind)> {
        match &self.states.parameters.frozen_units {
            Some(units) => units.specs(),
            None => self.states.frozen.iter().map(|(n, t)| (n.clone(), t.size(), t.kind())).collect(),
        }
    }

    /// DeepSpeed's `save_16bit_model`: rank 0 writes [`Engine::state_dict`] (every parameter in the model's dtype,
    /// frozen parameters and buffers in theirs; safetensors, by name), a file `VarStore::load` reads.
    /// Collective. At stage 3 this gathers the units one at a time and needs
    /// `zero_optimization.stage3_gather_16bit_weights_on_model_save`; without it the weights exist only as
    /// shards, so it refuses and says where full weights come from instead of writing empty tensors.
    pub fn save_16bit_model(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        if self.plan.partitions_parameters() && !self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        {
            return Err(Error::Unsupported {
                key: "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                value: "false".into(),
                why: "at stage 3 the weights are sharded across ranks; set it to true to gather them on save, or save_checkpoint and run `zerorun consolidate DIR OUT`",
            });
        }
        let params = self.state_dict()?;
        if self.rank() == 0 {
            Tensor::write_safetensors(&params, path)
                .map_err(|e| Error::Io { path: path.into(), what: e.to_string() })?;
        }
        self.comm.barrier()?;
        Ok(())
    }
}
