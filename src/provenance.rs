//! Provenance of every file headwise writes: the numerics the model ran with, the
//! headwise version and git commit of the build, the exact command line and the date.
//! [`Made`] is flattened into each artifact (`#[serde(flatten)]`), so its fields sit at
//! the file's top level (in `summary.json`: in every record):
//!
//! ```json
//! "numerics": "fast",
//! "headwise_version": "0.1.0",
//! "git_commit": "aaa969d2…",
//! "command": "headwise heads score --method all --task niah",
//! "date": "2026-12-01T09:30:00Z"
//! ```
//!
//! The commit comes from `build.rs` (`git rev-parse HEAD`, `-dirty` when tracked files
//! differ from it); it is `null` in a build outside a git checkout. `cpu` ([`cpu`]) names
//! the CPU model and its SIMD extensions: kernels are chosen by them at run time, and
//! greedy outputs differ between kernels. Files that runs continue also carry
//! `arithmetic`, the fingerprint of the floats the build computes on that CPU
//! ([`crate::model::arithmetic_fingerprint`]). A run resumes a file only with the same
//! numerics and the same floats ([`Made::resumable_by`]): where both carry a fingerprint,
//! the fingerprint decides and the CPU may differ (the folder's note then names the CPU
//! its earlier records ran on); where one lacks it, the CPU must be the same.
//! [`machine`] adds the thread count, for reports that measure speed.

use serde::{Deserialize, Serialize};

/// The `numerics` of a file that no model computed (a BM25 index).
pub const NO_MODEL: &str = "none";

/// Who made a file, how and when. Every field has a default, so files written before
/// provenance was recorded still load (their strings empty).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Made {
    /// The instrumented model's numerics (`fast`, `reference`, `ggml`), or [`NO_MODEL`].
    pub numerics: String,
    /// The version of the headwise build.
    pub headwise_version: String,
    /// The commit the build came from, with `-dirty` when tracked files differed from it
    /// when the build script last ran (it reruns when HEAD moves or `src/` changes);
    /// `None` outside a git checkout.
    pub git_commit: Option<String>,
    /// The command line, as typed (the program written `headwise`; arguments that need
    /// it single-quoted).
    pub command: String,
    /// When the file was made: UTC, RFC 3339 (`2026-12-01T09:30:00Z`).
    pub date: String,
    /// The CPU it ran on ([`cpu`]); empty in files made before it was recorded.
    pub cpu: String,
    /// The fingerprint of the model's arithmetic in this build, on this CPU, with these
    /// numerics ([`crate::model::arithmetic_fingerprint`]), for files a run continues;
    /// empty where none was taken (files made before it was recorded, files of no model).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub arithmetic: String,
    /// A remark: files whose provenance was filled in afterwards say so here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Made {
    /// This process, now: its command line, this build, the clock, and `numerics` (the
    /// name `--numerics` takes, e.g. [`crate::model::Numerics::name`]).
    pub fn now(numerics: &str) -> Self {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            numerics: numerics.to_string(),
            headwise_version: env!("CARGO_PKG_VERSION").to_string(),
            git_commit: option_env!("HEADWISE_GIT_COMMIT").map(str::to_string),
            command: command_line(),
            date: utc_rfc3339(secs),
            cpu: cpu(),
            arithmetic: String::new(),
            note: None,
        }
    }

    /// The same, with the fingerprint of the arithmetic of the model the run computes with.
    pub fn with_arithmetic(self, fingerprint: String) -> Self {
        Self {
            arithmetic: fingerprint,
            ..self
        }
    }

    /// Whether a file made with `self` may be reused or continued by the run `now`: the
    /// same numerics, computing the same floats. Where both carry an arithmetic
    /// fingerprint, that is the test of the floats and the CPU may differ (two CPUs whose
    /// kernels compute the same floats, e.g. the same instruction sets on another model);
    /// otherwise the CPU must be the same too. A field left empty in `self` (a file made
    /// before it was recorded) matches anything.
    pub fn resumable_by(&self, now: &Made) -> bool {
        let known = |was: &str, is: &str| was.is_empty() || was == is;
        known(&self.numerics, &now.numerics)
            && if self.fingerprinted(now) {
                self.arithmetic == now.arithmetic
            } else {
                known(&self.cpu, &now.cpu) && known(&self.arithmetic, &now.arithmetic)
            }
    }

    /// Whether both `self` and `now` carry an arithmetic fingerprint.
    fn fingerprinted(&self, now: &Made) -> bool {
        !self.arithmetic.is_empty() && !now.arithmetic.is_empty()
    }

    /// `self` (a run continuing a folder whose file was made with `old`) with the note a
    /// mixed folder needs: records made before the CPU or the arithmetic fingerprint was
    /// recorded keep saying so, and records made on another CPU (of the same
    /// fingerprint) name it, with this run's start as the boundary and the start and
    /// commit of the last run before it (the run stamps its own on the folder, which are
    /// theirs only if nothing says otherwise); an earlier note is kept, the new one
    /// appended.
    pub fn continuing(&self, old: &Made) -> Made {
        let unrecorded = match (old.cpu.is_empty(), old.arithmetic.is_empty()) {
            (true, true) if !self.arithmetic.is_empty() => "CPU and arithmetic fingerprint",
            (true, _) => "CPU",
            (false, true) if !self.arithmetic.is_empty() => "arithmetic fingerprint",
            _ => "",
        };
        let before = || {
            format!(
                "the records made before {} (the last run then began {}, commit {})",
                self.date,
                old.date,
                old.git_commit.as_deref().unwrap_or("unknown")
            )
        };
        let says = if !unrecorded.is_empty() {
            Some(format!("{} predate the recorded {unrecorded}", before()))
        } else if old.cpu != self.cpu {
            Some(format!(
                "{} ran on {}, with the same arithmetic fingerprint",
                before(),
                old.cpu
            ))
        } else {
            None
        };
        let note = match (&old.note, says) {
            (Some(n), Some(s)) => Some(format!("{}; {s}", n.trim_end_matches('.'))),
            (Some(n), None) => Some(n.clone()),
            (None, s) => s.or_else(|| self.note.clone()),
        };
        Made {
            note,
            ..self.clone()
        }
    }

    /// What [`Made::resumable_by`] found different, for an error message: e.g.
    /// `numerics reference, not fast` or `CPU "Intel Xeon, avx2", not "AMD EPYC, avx2"`.
    pub fn mismatch(&self, now: &Made) -> String {
        let mut out = Vec::new();
        if !self.numerics.is_empty() && self.numerics != now.numerics {
            out.push(format!("numerics {}, not {}", self.numerics, now.numerics));
        }
        if !self.fingerprinted(now) && !self.cpu.is_empty() && self.cpu != now.cpu {
            out.push(format!("CPU \"{}\", not \"{}\"", self.cpu, now.cpu));
        }
        if !self.arithmetic.is_empty() && self.arithmetic != now.arithmetic {
            out.push(format!(
                "arithmetic fingerprint \"{}\", not \"{}\" (this build computes other \
                 floats; continue with a build of commit {})",
                self.arithmetic,
                now.arithmetic,
                self.git_commit.as_deref().unwrap_or("unknown")
            ));
        }
        out.join("; ")
    }

    /// One Markdown line for a report (whose text gives the command): version, commit,
    /// numerics (and arithmetic fingerprint), date and CPU.
    pub fn markdown(&self) -> String {
        let commit = self
            .git_commit
            .as_deref()
            .map_or(String::new(), |c| format!(" (commit `{c}`)"));
        let cpu = match self.cpu.as_str() {
            "" => String::new(),
            c => format!(" ({c})"),
        };
        let note = self.note.as_deref().map_or(String::new(), |n| {
            format!(" Note: {}.", n.trim_end_matches('.'))
        });
        let arithmetic = match self.arithmetic.as_str() {
            "" => String::new(),
            a => format!(" (arithmetic `{a}`)"),
        };
        format!(
            "Made by headwise {}{commit} with `{}` numerics{arithmetic} on {}{cpu}.{note}",
            self.headwise_version, self.numerics, self.date
        )
    }
}

/// The SIMD extensions [`machine`] names when the CPU has them (the ones the kernels of
/// candle, ggml and headwise choose between).
const SIMD_FLAGS: [&str; 7] = [
    "avx2",
    "avx512f",
    "avx512dq",
    "avx512_vnni",
    "avx_vnni",
    "fma",
    "f16c",
];

/// The machine, for a report's README: CPU model (`/proc/cpuinfo`), threads and the
/// SIMD extensions among `SIMD_FLAGS` it has, e.g. `AMD EPYC, 2 threads, avx2 fma`.
pub fn machine() -> String {
    let (model, simd) = cpu_parts();
    let threads = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {threads} threads{simd}")
}

/// The CPU as [`Made::cpu`] records it: [`machine`] without the thread count, e.g.
/// `AMD EPYC, avx2 fma f16c`.
pub fn cpu() -> String {
    let (model, simd) = cpu_parts();
    format!("{model}{simd}")
}

/// The CPU model and `, ` followed by its SIMD extensions (empty when it has none).
fn cpu_parts() -> (String, String) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let model = field("model name").unwrap_or_else(|| "unknown CPU".into());
    let flags = field("flags").unwrap_or_default();
    let simd: Vec<&str> = SIMD_FLAGS
        .into_iter()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .collect();
    let simd = if simd.is_empty() {
        String::new()
    } else {
        format!(", {}", simd.join(" "))
    };
    (model, simd)
}

/// This process's command line, as [`Made::command`] records it.
pub fn command_line() -> String {
    // `args_os`: an argument that is not UTF-8 (clap takes such paths) must not panic.
    command_of(
        std::env::args_os()
            .skip(1)
            .map(|a| a.to_string_lossy().into_owned()),
    )
}

/// `headwise` followed by `args`, each single-quoted when the shell would split or expand
/// it.
fn command_of(args: impl Iterator<Item = String>) -> String {
    std::iter::once("headwise".to_string())
        .chain(args.map(|a| quoted(&a)))
        .collect::<Vec<_>>()
        .join(" ")
}

fn quoted(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./,:=@%+".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// `secs` after the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_rfc3339(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// The proleptic Gregorian (year, month, day) of day `days` after 1970-01-01 (Howard
/// Hinnant's `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_rfc3339_on_known_days() {
        // (seconds since the epoch, as `date -u -d @SECS +%FT%TZ` prints them)
        for (secs, date) in [
            (0, "1970-01-01T00:00:00Z"),
            (951_782_400, "2000-02-29T00:00:00Z"),
            (1_709_251_199, "2024-02-29T23:59:59Z"),
            (1_798_675_200, "2026-12-31T00:00:00Z"),
            (4_107_542_400, "2100-03-01T00:00:00Z"),
        ] {
            assert_eq!(utc_rfc3339(secs), date, "{secs}");
        }
        let now = Made::now("fast").date;
        assert!(
            now.len() == 20 && now.ends_with('Z') && now.starts_with("20"),
            "{now}"
        );
    }

    #[test]
    fn commands_join_the_arguments_and_quote_what_the_shell_would_split() {
        let args = [
            "heads",
            "score",
            "--lengths",
            "256,512",
            "--out",
            "my dir",
            "it's",
            "",
        ];
        assert_eq!(
            command_of(args.iter().map(|a| a.to_string())),
            r"headwise heads score --lengths 256,512 --out 'my dir' 'it'\''s' ''"
        );
        assert!(command_line().starts_with("headwise"));
    }

    #[test]
    fn the_build_names_its_version_and_commit() {
        let made = Made::now("reference");
        assert_eq!(made.numerics, "reference");
        assert_eq!(made.headwise_version, env!("CARGO_PKG_VERSION"));
        if let Some(c) = &made.git_commit {
            let hash = c.strip_suffix("-dirty").unwrap_or(c);
            assert!(
                hash.len() == 40 && hash.chars().all(|c| c.is_ascii_hexdigit()),
                "{c}"
            );
        }
    }

    #[test]
    fn the_machine_names_its_cpu_threads_and_simd() {
        let m = machine();
        assert!(m.contains(" threads"), "{m}");
        let listed = m.split(" threads").nth(1).unwrap_or_default();
        assert!(
            listed
                .split([',', ' '])
                .all(|f| f.is_empty() || SIMD_FLAGS.contains(&f)),
            "{m}"
        );
        // the CPU is the machine without its threads
        let (model, simd) = m.split_once(" threads").unwrap();
        let model = model.rsplit_once(", ").unwrap().0;
        assert_eq!(cpu(), format!("{model}{simd}"));
    }

    #[test]
    fn files_without_provenance_still_load_and_notes_are_left_out_when_absent() {
        let old: Made = serde_json::from_str("{}").unwrap();
        assert_eq!(old, Made::default());
        let json = serde_json::to_value(Made::now("fast")).unwrap();
        assert!(json.get("note").is_none() && json.get("git_commit").is_some());
        assert!(Made::now("fast").markdown().contains("`fast` numerics"));
        assert!(old.resumable_by(&Made::now("ggml")));
    }

    #[test]
    fn a_file_resumes_only_with_the_same_numerics_on_the_same_cpu() {
        let here = Made::now("fast");
        assert!(here.resumable_by(&Made::now("fast")));
        let ggml = Made::now("ggml");
        assert!(!here.resumable_by(&ggml));
        assert_eq!(here.mismatch(&ggml), "numerics fast, not ggml");
        let elsewhere = Made {
            cpu: "Some Other CPU, avx2".into(),
            ..Made::now("fast")
        };
        assert!(!elsewhere.resumable_by(&here));
        assert_eq!(
            elsewhere.mismatch(&here),
            format!("CPU \"Some Other CPU, avx2\", not \"{}\"", here.cpu)
        );
        // a file from before the CPU was recorded
        let unknown = Made {
            cpu: String::new(),
            ..Made::now("fast")
        };
        assert!(unknown.resumable_by(&here) && unknown.mismatch(&here).is_empty());
        // continuing a folder of unknown CPU says so; a known one adds nothing
        let note = here.continuing(&unknown).note.unwrap();
        assert!(note.contains("predate the recorded CPU"), "{note}");
        assert_eq!(here.continuing(&here).note, None);
        assert!(here.markdown().ends_with(&format!(" ({}).", here.cpu)));
    }

    #[test]
    fn with_fingerprints_on_both_sides_the_floats_decide_not_the_cpu() {
        let here = Made::now("fast").with_arithmetic("0123456789abcdef".into());
        let elsewhere = Made {
            cpu: "Some Other CPU, avx2 avx512f".into(),
            date: "2026-12-01T09:30:00Z".into(),
            git_commit: Some("abc1234".into()),
            ..here.clone()
        };
        assert!(elsewhere.resumable_by(&here) && elsewhere.mismatch(&here).is_empty());
        assert_eq!(
            here.continuing(&elsewhere).note.unwrap(),
            format!(
                "the records made before {} (the last run then began 2026-12-01T09:30:00Z, \
                 commit abc1234) ran on Some Other CPU, avx2 avx512f, with the same \
                 arithmetic fingerprint",
                here.date
            )
        );
        // other floats on another CPU: the fingerprint is the reason given, not the CPU
        let other = Made {
            arithmetic: "fedcba9876543210".into(),
            ..elsewhere.clone()
        };
        assert!(!other.resumable_by(&here));
        assert!(
            other
                .mismatch(&here)
                .starts_with("arithmetic fingerprint \"fedcba9876543210\", not"),
            "{}",
            other.mismatch(&here)
        );
        // a run that takes no fingerprint, or a file without one, needs the same CPU
        let unfingerprinted = Made::now("fast");
        assert!(!elsewhere.resumable_by(&unfingerprinted));
        let old = Made {
            arithmetic: String::new(),
            ..elsewhere
        };
        assert!(!old.resumable_by(&here));
        assert!(old.mismatch(&here).starts_with("CPU \"Some Other CPU"));
    }

    #[test]
    fn a_file_resumes_only_with_the_same_arithmetic() {
        let here = Made::now("fast").with_arithmetic("0123456789abcdef".into());
        assert!(here.resumable_by(&here.clone()));
        let other = Made::now("fast").with_arithmetic("fedcba9876543210".into());
        assert!(!here.resumable_by(&other));
        let why = here.mismatch(&other);
        assert!(
            why.starts_with(
                "arithmetic fingerprint \"0123456789abcdef\", not \"fedcba9876543210\""
            ),
            "{why}"
        );
        // a file from before the fingerprint is continued, and the folder says so
        let before = Made::now("fast");
        assert!(before.resumable_by(&here));
        let note = here.continuing(&before).note.unwrap();
        assert!(
            note.starts_with(&format!("the records made before {}", here.date))
                && note.ends_with("predate the recorded arithmetic fingerprint"),
            "{note}"
        );
        assert_eq!(here.continuing(&here).note, None);
        // an earlier note is kept and the new one appended; both fields missing say so
        let noted = Made {
            note: Some("cpu filled in afterwards.".into()),
            ..before.clone()
        };
        let note = here.continuing(&noted).note.unwrap();
        assert!(
            note.starts_with("cpu filled in afterwards; the records made before"),
            "{note}"
        );
        let bare = Made {
            cpu: String::new(),
            ..before
        };
        let note = here.continuing(&bare).note.unwrap();
        assert!(
            note.ends_with("predate the recorded CPU and arithmetic fingerprint"),
            "{note}"
        );
        assert!(here
            .markdown()
            .contains("numerics (arithmetic `0123456789abcdef`) on"));
        // written only when taken
        let json = serde_json::to_value(Made::now("fast")).unwrap();
        assert!(json.get("arithmetic").is_none());
        let json = serde_json::to_value(&here).unwrap();
        assert_eq!(json["arithmetic"], "0123456789abcdef");
    }
}
