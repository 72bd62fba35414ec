//! Stage 3's parameter shard on NVMe (ZeRO-Infinity's `offload_param.device = nvme`). This rank's chunk of each
//! unit lives in a swap file of its own between uses. Just ahead of the unit's all-gather the chunk is read into
//! one of `buffer_count` host buffers (read-ahead follows the order forward and backward visit the units), copied
//! into the unit's gathered buffer, and the host buffer goes back to the pool: the chunk does not change before the
//! optimizer step, so nothing is written back until the step writes the new values.
//!
//! The first units (execution order) whose chunks fit in `max_in_cpu` elements, and persistent units (which stay
//! gathered anyway), keep their chunk in host memory instead.
//!
//! With the optimizer in backward and fp32 values (the chunks are what the optimizer steps), a chunk read for a
//! gather in backward is kept for that unit's step, which comes as soon as its gradients are reduced: the step
//! updates the buffer the gather read instead of reading the chunk a second time ([`SwappedParams::keep_for_step`]).
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::path::Path;

use tch::{Kind, Tensor};
use zerorun_offload::{BufferPool, HostBuffer, IoConfig, SwapHandle, Swapper, PAGE};

use crate::config::{ConfigError, OffloadParamConfig};
use crate::engine::device::views;
use crate::error::Result;

/// One unit's chunk of the shard, ready to copy from: a view of the shard tensor (host or device), or a host
/// buffer read from NVMe.
pub(crate) enum Chunk {
    InMemory(Tensor),
    Read { buffer: HostBuffer, bytes: usize },
}

impl Chunk {
    /// Copies the chunk's elements into `dst` (a tensor of the model's dtype and the chunk's length, on any device;
    /// `residence` is where `dst` lives).
    pub fn copy_into(&self, dst: &Tensor, residence: crate::engine::device::Residence) -> Result<()> {
        match self {
            Chunk::InMemory(t) => {
                tch::no_grad(|| dst.shallow_clone().f_copy_(t))?;
            }
            Chunk::Read { buffer, bytes } if residence.on_device(dst) => {
                let host = Tensor::f_from_data_size(&buffer.as_slice()[..*bytes], &[dst.numel() as i64], dst.kind())?;
                tch::no_grad(|| dst.shallow_clone().f_copy_(&host))?;
            }
            Chunk::Read { buffer, bytes } => {
                // SAFETY: `dst` is the unit's own buffer, which nothing else reads or writes while its chunk is put in.
                unsafe { views::bytes(dst) }.copy_from_slice(&buffer.as_slice()[..*bytes]);
            }
        }
        Ok(())
    }
}

pub(crate) struct SwappedParams {
    kind: Kind,
    /// Per unit: its chunk's range in shard space (the concatenation of this rank's chunk of every unit).
    chunks: Vec<Range<usize>>,
    /// Per unit: the chunk kept in host memory (`max_in_cpu`, persistent units), or None: on NVMe.
    in_memory: Vec<Option<Tensor>>,
    swapper: Swapper,
    pool: BufferPool,
    /// Reads started ahead, by unit.
    reads: HashMap<usize, SwapHandle<HostBuffer>>,
    /// Writes in flight (the optimizer step's new values), with their buffers' bytes.
    writes: VecDeque<(SwapHandle<HostBuffer>, usize)>,
    buffer_count: usize,
    /// Whether chunks read for gathers are kept for the unit's step (the optimizer in backward).
    keeping: bool,
    /// Chunks read for a gather and kept for their unit's step, oldest first, at most [`KEPT`].
    kept: VecDeque<(usize, HostBuffer)>,
    /// Chunks read from NVMe so far.
    chunks_read: u64,
}

/// Chunks kept for their steps at once: the unit in backward and the one prefetched before it. The step of a
/// unit comes before the gather of the one after next, so more would only hold memory.
const KEPT: usize = 2;

fn key(unit: usize) -> String {
    format!("param{unit}")
}

impl SwappedParams {
    /// An empty store for this rank's chunks (`chunks` and `persistent` per unit; `kind` the model's dtype): the
    /// first units whose chunks fit in `max_in_cpu` elements and persistent units get host memory, the others
    /// swap files under `nvme_path`, checked for room. Start-up then `put`s each unit's chunk as the unit is
    /// sharded, so the shard is never whole in memory, and `finish`es.
    pub fn create(
        kind: Kind,
        chunks: Vec<Range<usize>>,
        persistent: &[bool],
        config: &OffloadParamConfig,
        io: IoConfig,
        prefix: &str,
    ) -> Result<SwappedParams> {
        let elt = kind.elt_size_in_bytes();
        let mut in_cpu = 0u64;
        let in_memory: Vec<Option<Tensor>> = chunks
            .iter()
            .zip(persistent)
            .map(|(r, &persistent)| {
                let fits = in_cpu + r.len() as u64 <= config.max_in_cpu;
                if fits {
                    in_cpu += r.len() as u64;
                }
                (persistent || fits).then(|| Tensor::zeros([r.len() as i64], (kind, tch::Device::Cpu)))
            })
            .collect();
        let swapped: Vec<usize> = (0..chunks.len()).filter(|&u| in_memory[u].is_none()).collect();
        let largest = swapped.iter().map(|&u| chunks[u].len()).max().unwrap_or(0);
        if largest as u64 > config.buffer_size {
            return Err(ConfigError::Invalid {
                path: "zero_optimization.offload_param.buffer_size".into(),
                value: config.buffer_size.to_string(),
                allowed: format!(
                    "at least the largest unit's shard on this rank, {largest} elements (or split that unit)"
                ),
            }
            .into());
        }
        let dir = Path::new(config.nvme_path.as_deref().expect("the config requires nvme_path for nvme"));
        let bytes_on_nvme: u64 = swapped.iter().map(|&u| (chunks[u].len() * elt) as u64).sum();
        zerorun_offload::preflight::check(dir, bytes_on_nvme)?;
        let buffer_count = (config.buffer_count as usize).max(2);
        let buffer_bytes = (largest * elt).div_ceil(PAGE).max(1) * PAGE;
        Ok(SwappedParams {
            kind,
            chunks,
            in_memory,
            swapper: Swapper::new(dir, prefix, io),
            pool: BufferPool::new(buffer_count * buffer_bytes),
            reads: HashMap::new(),
            writes: VecDeque::new(),
            buffer_count,
            keeping: false,
            kept: VecDeque::new(),
            chunks_read: 0,
        })
    }

    /// Stores unit `unit`'s first values (host or device memory) at start-up.
    pub fn put(&mut self, unit: usize, values: &Tensor) -> Result<()> {
        match &self.in_memory[unit] {
            Some(t) => {
                tch::no_grad(|| t.shallow_clone().f_copy_(values))?;
                Ok(())
            }
            None => self.write(unit, values),
        }
    }

    /// Ends start-up: every chunk written.
    pub fn finish(&mut self) -> Result<()> {
        self.flush()?;
        let on_nvme = self.in_memory.iter().filter(|c| c.is_none()).count();
        tracing::info!(bytes = self.swapped_bytes(), units_on_nvme = on_nvme, "parameter shards on NVMe");
        Ok(())
    }

    fn chunk_bytes(&self, unit: usize) -> usize {
        self.chunks[unit].len() * self.kind.elt_size_in_bytes()
    }

    /// Starts reading the chunks of the first units of `order` that `needed` says will be gathered, as far as
    /// the buffers allow (one stays free for a read nobody saw coming; chunks kept for their steps count against
    /// them, so keeping holds no more host memory than `buffer_count` buffers).
    pub fn read_ahead(&mut self, order: impl Iterator<Item = usize>, needed: impl Fn(usize) -> bool) {
        let window = (self.buffer_count - 1).saturating_sub(self.kept.len());
        let kept: Vec<usize> = self.kept.iter().map(|(u, _)| *u).collect();
        for u in order.filter(|&u| needed(u) && self.in_memory[u].is_none() && !kept.contains(&u)).take(window) {
            if self.reads.len() >= window {
                break;
            }
            if !self.reads.contains_key(&u) {
                let buffer = self.pool.take(self.chunk_bytes(u));
                self.reads.insert(u, self.swapper.swap_in(&key(u), buffer));
                self.chunks_read += 1;
            }
        }
    }

    /// Unit `unit`'s chunk: from memory, kept from its gather, from the read started ahead, or read now.
    pub fn chunk(&mut self, unit: usize) -> Result<Chunk> {
        if let Some(t) = &self.in_memory[unit] {
            return Ok(Chunk::InMemory(t.shallow_clone()));
        }
        let bytes = self.chunk_bytes(unit);
        if let Some(buffer) = self.take_kept(unit) {
            return Ok(Chunk::Read { buffer, bytes });
        }
        let read = match self.reads.remove(&unit) {
            Some(r) => r,
            None => {
                self.chunks_read += 1;
                self.swapper.swap_in(&key(unit), self.pool.take(bytes))
            }
        };
        Ok(Chunk::Read { buffer: read.wait()?, bytes })
    }

    /// Returns unit `unit`'s chunk once it is copied: to the pool, or while [`keep_for_step`](Self::keep_for_step)
    /// is on, kept for the unit's step (its bytes are the chunk's until a write of the unit).
    pub fn recycle(&mut self, unit: usize, chunk: Chunk) {
        let Chunk::Read { buffer, .. } = chunk else { return };
        if !self.keeping {
            self.pool.give_back(buffer);
            return;
        }
        self.kept.push_back((unit, buffer));
        while self.kept.len() > KEPT {
            let (_, oldest) = self.kept.pop_front().expect("more than KEPT");
            self.pool.give_back(oldest);
        }
    }

    /// Keeps the chunks gathers read for their units' steps (`on`: the optimizer in backward begins a step over
    /// fp32 values), or stops and gives back what is kept (the step ended).
    pub fn keep_for_step(&mut self, on: bool) {
        self.keeping = on && self.kind == Kind::Float;
        if !on {
            for (_, buffer) in self.kept.drain(..) {
                self.pool.give_back(buffer);
            }
        }
    }

    /// Unit `unit`'s kept chunk, no longer kept.
    fn take_kept(&mut self, unit: usize) -> Option<HostBuffer> {
        let at = self.kept.iter().position(|(u, _)| *u == unit)?;
        self.kept.remove(at).map(|(_, buffer)| buffer)
    }

    /// Stores `values` (the unit's chunk, the model's dtype) as the unit's chunk. The write runs in the
    /// background; a read started ahead of it is dropped (it would see the old values), and a later read of
    /// the unit waits for the write.
    pub fn write(&mut self, unit: usize, values: &Tensor) -> Result<()> {
        debug_assert_eq!(values.numel(), self.chunks[unit].len());
        // Device values (a CUDA model's step) come to host memory first: swap files are written from there.
        let values = values.f_to_device(tch::Device::Cpu)?.contiguous();
        // SAFETY: `values` is this call's own contiguous copy (or the caller's tensor, only read here).
        self.write_with(unit, |dst| dst.copy_from_slice(unsafe { views::bytes(&values) }))
    }

    /// [`write`](Self::write) with the chunk's bytes (the model's dtype) produced by `fill`, straight into the
    /// memory they go to.
    fn write_with(&mut self, unit: usize, fill: impl FnOnce(&mut [u8])) -> Result<()> {
        if let Some(t) = &self.in_memory[unit] {
            // SAFETY: the unit's resident chunk, which only this swapper touches, and not during a gather.
            fill(unsafe { views::bytes(t) });
            return Ok(());
        }
        if let Some(stale) = self.reads.remove(&unit) {
            self.pool.give_back(stale.wait()?);
        }
        // A kept chunk of the unit would hold the old values.
        if let Some(stale) = self.take_kept(unit) {
            self.pool.give_back(stale);
        }
        let bytes = self.chunk_bytes(unit);
        let mut buffer = self.pool.take(bytes);
        fill(&mut buffer.as_mut_slice()[..bytes]);
        self.write_buffer(unit, buffer, bytes)
    }

    /// Starts writing a host buffer holding the unit's chunk (its first `bytes`), bounded in writes in flight.
    fn write_buffer(&mut self, unit: usize, buffer: HostBuffer, bytes: usize) -> Result<()> {
        let held = buffer.capacity();
        self.writes.push_back((self.swapper.swap_out(&key(unit), buffer, bytes), held));
        while self.writes.len() >= self.buffer_count {
            self.finish_oldest_write()?;
        }
        Ok(())
    }

    /// Updates the fp32 values of shard-space `range` in place, unit by unit: each chunk it touches is read (the
    /// next ones ahead), `update(sub_range, values)` changes the part inside `range`, and the chunk is written back
    /// behind. What an optimizer step needs of the values with no copy of the shard: a step unit by unit, or a
    /// piece of one in backward (`optimizer_in_backward`).
    pub fn update_f32(
        &mut self,
        range: Range<usize>,
        mut update: impl FnMut(Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        debug_assert_eq!(self.kind, Kind::Float, "the optimizer steps fp32 values in place");
        let first = self.chunks.partition_point(|c| c.end <= range.start);
        let touched: Vec<usize> =
            (first..self.chunks.len()).take_while(|&u| self.chunks[u].start < range.end).collect();
        for (i, &u) in touched.iter().enumerate() {
            self.read_ahead(touched[i + 1..].iter().copied(), |_| true);
            let c = self.chunks[u].clone();
            let (a, b) = (c.start.max(range.start), c.end.min(range.end));
            let local = a - c.start..b - c.start;
            if b <= a {
                continue;
            }
            match self.chunk(u)? {
                Chunk::InMemory(t) => {
                    // SAFETY: the unit's resident chunk, which only this swapper touches, and not during a gather.
                    update(a..b, &mut unsafe { views::slice::<f32>(&t) }[local])?;
                }
                Chunk::Read { mut buffer, bytes } => {
                    let values: &mut [f32] = bytemuck::cast_slice_mut(&mut buffer.as_mut_slice()[..bytes]);
                    if let Err(e) = update(a..b, &mut values[local]) {
                        self.pool.give_back(buffer);
                        return Err(e);
                    }
                    self.write_buffer(u, buffer, bytes)?;
                }
            }
        }
        Ok(())
    }

    fn finish_oldest_write(&mut self) -> Result<()> {
        if let Some((w, _)) = self.writes.pop_front() {
            self.pool.give_back(w.wait()?);
        }
        Ok(())
    }

    /// Waits for every write, so an I/O error surfaces in the step that caused it.
    pub fn flush(&mut self) -> Result<()> {
        while !self.writes.is_empty() {
            self.finish_oldest_write()?;
        }
        Ok(())
    }

    /// The whole shard in memory (checkpoints, the optimizer step of fp32 models): every unit's chunk in order.
    pub fn read_all(&mut self, len: usize) -> Result<Tensor> {
        let out = Tensor::zeros([len as i64], (self.kind, tch::Device::Cpu));
        for u in 0..self.chunks.len() {
            self.read_ahead(u + 1..self.chunks.len(), |_| true);
            let chunk = self.chunk(u)?;
            let r = self.chunks[u].clone();
            // `out` is host memory made here, whatever the engine's residence.
            let host = crate::engine::device::Residence::Host;
            let copied = chunk.copy_into(&out.narrow(0, r.start as i64, r.len() as i64), host);
            self.recycle(u, chunk);
            copied?;
        }
        Ok(out)
    }

    /// Replaces the whole shard (shard space, any float kind) and waits for the writes.
    pub fn write_all(&mut self, values: &Tensor) -> Result<()> {
        let values = values.to_kind(self.kind);
        for u in 0..self.chunks.len() {
            let r = self.chunks[u].clone();
            self.write(u, &values.narrow(0, r.start as i64, r.len() as i64))?;
        }
        self.flush()
    }

    /// Replaces the whole shard with an fp32 master's values (shard space) rounded to the model's dtype, unit by
    /// unit through the swap buffers: the 16-bit optimizer step needs no copy of the shard.
    pub fn write_all_from_f32(&mut self, master: &[f32]) -> Result<()> {
        let kind = self.kind;
        for u in 0..self.chunks.len() {
            let src = &master[self.chunks[u].clone()];
            self.write_with(u, |dst| match kind {
                Kind::BFloat16 => half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                    bytemuck::cast_slice_mut::<u8, half::bf16>(dst),
                    src,
                ),
                Kind::Half => half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                    bytemuck::cast_slice_mut::<u8, half::f16>(dst),
                    src,
                ),
                _ => dst.copy_from_slice(bytemuck::cast_slice(src)),
            })?;
        }
        self.flush()
    }

    /// Bytes of parameters on NVMe.
    pub fn swapped_bytes(&self) -> usize {
        (0..self.chunks.len()).filter(|&u| self.in_memory[u].is_none()).map(|u| self.chunk_bytes(u)).sum()
    }

    /// Bytes of parameters kept in host memory (`max_in_cpu`).
    pub fn kept_bytes(&self) -> usize {
        (0..self.chunks.len()).filter(|&u| self.in_memory[u].is_some()).map(|u| self.chunk_bytes(u)).sum()
    }

    /// Host buffers that are not parameters: idle swap buffers, those of the reads started ahead (at least a
    /// chunk's pages each) and those of the writes in flight.
    pub fn buffer_bytes(&self) -> usize {
        let reading: usize = self.reads.keys().map(|&u| self.chunk_bytes(u).div_ceil(PAGE) * PAGE).sum();
        let writing: usize = self.writes.iter().map(|(_, held)| held).sum();
        let kept: usize = self.kept.iter().map(|(_, b)| b.capacity()).sum();
        self.pool.idle_bytes() + reading + writing + kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OffloadDevice;

    fn store(dir: &Path) -> SwappedParams {
        let config = OffloadParamConfig {
            device: OffloadDevice::Nvme,
            nvme_path: Some(dir.display().to_string()),
            buffer_count: 3,
            buffer_size: 1 << 20,
            max_in_cpu: 0,
            pin_memory: false,
        };
        let io = IoConfig { block_size: 1 << 20, queue_depth: 4, intra_op_parallelism: 1 };
        let mut s =
            SwappedParams::create(Kind::Float, vec![0..1000, 1000..3000], &[false, false], &config, io, "t").unwrap();
        s.put(0, &Tensor::arange(1000, (Kind::Float, tch::Device::Cpu))).unwrap();
        s.put(1, &Tensor::arange_start(1000, 3000, (Kind::Float, tch::Device::Cpu))).unwrap();
        s.finish().unwrap();
        s
    }

    fn values(s: &mut SwappedParams, unit: usize) -> Vec<f32> {
        let r = s.chunks[unit].clone();
        let t = Tensor::zeros([r.len() as i64], (Kind::Float, tch::Device::Cpu));
        let chunk = s.chunk(unit).unwrap();
        chunk.copy_into(&t, crate::engine::device::Residence::Host).unwrap();
        s.recycle(unit, chunk);
        Vec::<f32>::try_from(t).unwrap()
    }

    #[test]
    fn a_chunk_gathered_in_a_step_in_backward_is_stepped_without_a_second_read() {
        let dir = std::env::temp_dir().join(format!("zerorun-swapped-params-keep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = store(&dir);
        // Without keeping, a gather and then the unit's step each read the chunk.
        let before = s.chunks_read;
        assert_eq!(values(&mut s, 1)[0], 1000.0);
        s.update_f32(1000..3000, |_, v| {
            v.iter_mut().for_each(|x| *x += 1.0);
            Ok(())
        })
        .unwrap();
        assert_eq!(s.chunks_read - before, 2);
        // Kept: the gather's read is the step's; the step's new values are what the next read sees.
        s.keep_for_step(true);
        let before = s.chunks_read;
        assert_eq!(values(&mut s, 1)[0], 1001.0);
        s.update_f32(1000..3000, |_, v| {
            v.iter_mut().for_each(|x| *x += 1.0);
            Ok(())
        })
        .unwrap();
        assert_eq!(s.chunks_read - before, 1, "the step updated the buffer its gather read");
        // A kept chunk a write replaced is not handed out.
        assert_eq!(values(&mut s, 0)[0], 0.0);
        s.write(0, &Tensor::full([1000], 7.0, (Kind::Float, tch::Device::Cpu))).unwrap();
        s.keep_for_step(false);
        s.flush().unwrap();
        assert_eq!(values(&mut s, 0)[0], 7.0);
        assert_eq!(values(&mut s, 1)[..2], [1002.0, 1003.0]);
        // The step's end gave every kept buffer back: reads come from NVMe again.
        let before = s.chunks_read;
        values(&mut s, 1);
        assert_eq!(s.chunks_read - before, 1);
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
