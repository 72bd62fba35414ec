//! DeepSpeed's `csv_monitor` (deepspeed/monitor/csv_monitor.py): one file per tag,
//! `<dir>/<tag with '/' and ' ' as '_'>.csv`, opened for appending; the first write of a process adds the header
//! `step,<the tag's last '/' part>`, then a row `step,value` per event.
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::{Event, MonitorError, Result};

/// The CSV monitor of one run folder.
pub struct CsvMonitor {
    dir: PathBuf,
    files: BTreeMap<String, BufWriter<File>>,
}

/// The file name DeepSpeed gives a tag's CSV (without the folder).
pub fn file_name(tag: &str) -> String {
    format!("{}.csv", tag.replace(['/', ' '], "_"))
}

impl CsvMonitor {
    /// Creates the run folder.
    pub fn new(dir: &Path) -> Result<CsvMonitor> {
        std::fs::create_dir_all(dir).map_err(|e| MonitorError::io(dir, e))?;
        Ok(CsvMonitor { dir: dir.to_path_buf(), files: BTreeMap::new() })
    }

    /// Appends `event` to its tag's file (the header first, once per process).
    pub fn write(&mut self, event: &Event) -> Result<()> {
        if !self.files.contains_key(&event.tag) {
            let path = self.dir.join(file_name(&event.tag));
            let file =
                OpenOptions::new().create(true).append(true).open(&path).map_err(|e| MonitorError::io(&path, e))?;
            let mut w = BufWriter::new(file);
            let last = event.tag.rsplit('/').next().unwrap_or(&event.tag);
            writeln!(w, "step,{last}").map_err(|e| MonitorError::io(&path, e))?;
            self.files.insert(event.tag.clone(), w);
        }
        let w = self.files.get_mut(&event.tag).expect("opened above");
        // Rust's shortest round-trip formatting, as Python's repr of a float.
        writeln!(w, "{},{}", event.step, event.value).map_err(|e| MonitorError::io(&self.dir, e))
    }

    /// Flushes every file.
    pub fn flush(&mut self) -> Result<()> {
        for (tag, w) in &mut self.files {
            w.flush().map_err(|e| MonitorError::io(&self.dir.join(file_name(tag)), e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_become_deepspeeds_file_names_with_a_header_per_process() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(file_name("Train/Samples/train_loss"), "Train_Samples_train_loss.csv");
        assert_eq!(file_name("Train/Samples/elapsed time"), "Train_Samples_elapsed_time.csv");
        let mut m = CsvMonitor::new(dir.path()).unwrap();
        m.write(&Event::new("Train/Samples/lr", 0.0001, 32)).unwrap();
        m.write(&Event::new("Train/Samples/lr", 0.5, 64)).unwrap();
        m.flush().unwrap();
        let text = std::fs::read_to_string(dir.path().join("Train_Samples_lr.csv")).unwrap();
        assert_eq!(text, "step,lr\n32,0.0001\n64,0.5\n");
        // A restarted process appends, with a header of its own (as DeepSpeed's does).
        let mut m = CsvMonitor::new(dir.path()).unwrap();
        m.write(&Event::new("Train/Samples/lr", 0.25, 96)).unwrap();
        m.flush().unwrap();
        let text = std::fs::read_to_string(dir.path().join("Train_Samples_lr.csv")).unwrap();
        assert_eq!(text, "step,lr\n32,0.0001\n64,0.5\nstep,lr\n96,0.25\n");
    }
}
