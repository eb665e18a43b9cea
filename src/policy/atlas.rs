//! Head atlas interop: rankings to and from the files other tools of the field read.
//!
//! * **A DuoAttention pattern folder**: `full_attention_heads.tsv`, one line per layer
//!   with one tab-separated value per KV head, and `config.json` with `sink_size` and
//!   `recent_size` (the layout DuoAttention's `load_attn_pattern` and kvpress's
//!   `DuoAttentionPress` read). DuoAttention writes each KV head's learned gate in
//!   `[0, 1]`; headwise writes the KV head's best query-head score. Both readers keep
//!   the heads above a quantile of the matrix, so only the order matters. headwise adds
//!   the model's name and sha256 and the ranking's method and task to `config.json`.
//! * **A retrieval-head JSON** as Wu et al.'s and LOCOS's scripts write it:
//!   `{"L-H": [scores]}`, one key per (layer, query head), the head's score the mean of
//!   its list. headwise writes one score per head, its ranking's.
//!
//! Importing either gives a [`Ranking`] for `static_heads`. The file's shape must be the
//! model's (layers x KV heads, or every layer-head key exactly once), and a pattern
//! folder that names a model sha256 must name this one: a mismatch is one error before
//! any work. A pattern's KV-head value becomes the score of each query head that reads
//! the KV head.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::model::{Config, ModelId};
use crate::policy::ranking::{HeadMatrix, Provenance, Ranking};
use crate::provenance::Made;
use crate::results::write_atomic;
use crate::{Error, Result};

/// The KV-head matrix in a DuoAttention pattern folder.
pub const DUO_HEADS: &str = "full_attention_heads.tsv";
/// The sink and recent sizes in a DuoAttention pattern folder.
pub const DUO_CONFIG: &str = "config.json";

/// A file format of the atlas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtlasFormat {
    /// A DuoAttention pattern folder.
    Duo,
    /// Wu et al.'s / LOCOS's `{"L-H": [scores]}` JSON.
    HeadsJson,
}

impl AtlasFormat {
    /// Every format.
    pub const ALL: [AtlasFormat; 2] = [AtlasFormat::Duo, AtlasFormat::HeadsJson];

    /// Its name on the command line and in an imported ranking's `method`.
    pub fn name(self) -> &'static str {
        match self {
            AtlasFormat::Duo => "duo",
            AtlasFormat::HeadsJson => "heads-json",
        }
    }
}

/// `config.json` of a pattern folder: DuoAttention's two keys, and (written by headwise,
/// optional on reading) where the pattern came from. Other keys are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct DuoConfig {
    sink_size: usize,
    recent_size: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    task: Option<serde_json::Value>,
    /// The export's build, command line and date.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exported: Option<Made>,
}

/// A DuoAttention pattern as read from its folder.
#[derive(Debug, Clone, PartialEq)]
pub struct DuoPattern {
    /// `(n_layers, n_kv_heads)`, row-major by layer.
    pub scores: Vec<Vec<f64>>,
    pub sink: usize,
    pub recent: usize,
    /// The model's sha256, where the folder names one.
    pub model_sha256: Option<String>,
}

/// The `(n_layers, n_kv_heads)` matrix of `r`'s per-KV-head maxima as DuoAttention's
/// TSV (values printed to round-trip exactly).
pub fn duo_tsv(r: &Ranking) -> String {
    let mut out = String::new();
    for row in r.kv_heads.chunks(r.n_kv_heads) {
        let cells: Vec<String> = row.iter().map(|k| k.max.to_string()).collect();
        out.push_str(&cells.join("\t"));
        out.push('\n');
    }
    out
}

/// Write `r` as a DuoAttention pattern folder `dir` whose streaming heads keep `sink`
/// first and `recent` last positions, made by `made`; both files atomically.
pub fn write_duo(r: &Ranking, dir: &Path, sink: usize, recent: usize, made: Made) -> Result<()> {
    let config = DuoConfig {
        sink_size: sink,
        recent_size: recent,
        model: Some(r.provenance.model.clone()),
        model_sha256: Some(r.provenance.model_sha256.clone()),
        method: Some(r.provenance.method.clone()),
        task: Some(r.provenance.task.clone()),
        exported: Some(made),
    };
    let json = serde_json::to_string_pretty(&config)
        .map_err(|e| Error::invalid("pattern", e.to_string()))?;
    write_atomic(&dir.join(DUO_HEADS), duo_tsv(r).as_bytes())?;
    write_atomic(&dir.join(DUO_CONFIG), json.as_bytes())
}

/// Read a DuoAttention pattern folder.
pub fn read_duo(dir: &Path) -> Result<DuoPattern> {
    let bad = |path: &Path, reason: String| {
        Error::invalid("pattern", format!("{}: {reason}", path.display()))
    };
    let heads = dir.join(DUO_HEADS);
    let text = std::fs::read_to_string(&heads).map_err(|e| Error::io(&heads, e))?;
    let mut scores = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row = line
            .split(['\t', ' '])
            .filter(|c| !c.is_empty())
            .map(|c| match c.parse::<f64>() {
                Ok(v) if v.is_finite() => Ok(v),
                _ => Err(bad(
                    &heads,
                    format!("line {}: {c:?} is not a number", i + 1),
                )),
            })
            .collect::<Result<Vec<f64>>>()?;
        if let Some(first) = scores.first().map(Vec::len).filter(|&n| n != row.len()) {
            return Err(bad(
                &heads,
                format!(
                    "line {} has {} values, line 1 has {first}",
                    i + 1,
                    row.len()
                ),
            ));
        }
        scores.push(row);
    }
    if scores.is_empty() {
        return Err(bad(&heads, "no rows".into()));
    }
    let path = dir.join(DUO_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let config: DuoConfig = serde_json::from_str(&text).map_err(|e| bad(&path, e.to_string()))?;
    Ok(DuoPattern {
        scores,
        sink: config.sink_size,
        recent: config.recent_size,
        model_sha256: config.model_sha256,
    })
}

/// `r` as `{"L-H": [score]}`, one key per query head in (layer, head) order.
pub fn heads_json(r: &Ranking) -> String {
    let entries: Vec<String> = r
        .heads
        .iter()
        .map(|h| format!("\"{}-{}\": [{}]", h.layer, h.head, h.score))
        .collect();
    format!("{{{}}}\n", entries.join(", "))
}

/// Read `{"L-H": [scores]}`: each head's mean score, by (layer, head).
pub fn read_heads_json(path: &Path) -> Result<BTreeMap<(usize, usize), f64>> {
    let bad =
        |reason: String| Error::invalid("heads JSON", format!("{}: {reason}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let raw: BTreeMap<String, Vec<f64>> =
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let mut out = BTreeMap::new();
    for (key, scores) in raw {
        let head = key
            .split_once('-')
            .and_then(|(l, h)| Some((l.parse().ok()?, h.parse().ok()?)))
            .ok_or_else(|| bad(format!("key {key:?} is not \"layer-head\"")))?;
        if scores.is_empty() {
            return Err(bad(format!("{key} has no scores")));
        }
        let mean = scores.iter().sum::<f64>() / scores.len() as f64;
        if out.insert(head, mean).is_some() {
            return Err(bad(format!("head {key} appears twice")));
        }
    }
    Ok(out)
}

/// A ranking for the model `cfg` / `id` from the file at `path` in `format`, made by
/// `made` (the import's command line): the file's shape must be the model's, and a
/// pattern folder's model sha256, where it has one, this model's.
pub fn import(
    format: AtlasFormat,
    path: &Path,
    cfg: &Config,
    id: &ModelId,
    made: Made,
) -> Result<Ranking> {
    let (layers, heads, kv) = (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads);
    let mut m = HeadMatrix::zeros(layers, heads);
    let shape = |what: String| {
        Error::invalid(
            "pattern",
            format!(
                "{} is {what}, the model {} has {layers} layers x {heads} heads ({kv} KV heads)",
                path.display(),
                id.name
            ),
        )
    };
    let mut task = serde_json::json!({ "kind": "imported", "format": format.name(),
        "from": path.display().to_string() });
    match format {
        AtlasFormat::Duo => {
            let p = read_duo(path)?;
            if let Some(sha) = p
                .model_sha256
                .as_ref()
                .filter(|s| !s.eq_ignore_ascii_case(&id.sha256))
            {
                return Err(Error::invalid(
                    "pattern",
                    format!(
                        "{} was made for the model with sha256 {sha}, not {} (sha256 {})",
                        path.display(),
                        id.name,
                        id.sha256
                    ),
                ));
            }
            if p.scores.len() != layers || p.scores[0].len() != kv {
                return Err(shape(format!(
                    "{} layers x {} KV heads",
                    p.scores.len(),
                    p.scores[0].len()
                )));
            }
            let group = heads / kv;
            for (layer, row) in p.scores.iter().enumerate() {
                for head in 0..heads {
                    *m.at(layer, head) = row[head / group];
                }
            }
            task["sink_size"] = p.sink.into();
            task["recent_size"] = p.recent.into();
        }
        AtlasFormat::HeadsJson => {
            let scores = read_heads_json(path)?;
            let outside = scores.keys().find(|&&(l, h)| l >= layers || h >= heads);
            if let Some((l, h)) = outside {
                return Err(shape(format!("scoring head {l}-{h}")));
            }
            if scores.len() != layers * heads {
                return Err(shape(format!("{} heads scored", scores.len())));
            }
            for (&(l, h), &s) in &scores {
                *m.at(l, h) = s;
            }
        }
    }
    let provenance = Provenance {
        model: id.name.clone(),
        model_sha256: id.sha256.clone(),
        method: format.name().into(),
        task,
        trials_run: 0,
        trials_accepted: 0,
        acceptance: Vec::new(),
        step_source: "imported".into(),
        steps: 0,
        stability: Vec::new(),
        made,
    };
    let r = Ranking::new(provenance, &m, kv);
    r.validate().map_err(|e| Error::invalid("pattern", e))?;
    Ok(r)
}

/// Write `r` in `format` to `out`: a pattern folder (whose streaming heads keep `sink`
/// first and `recent` last positions; its `config.json` names `made`) or a JSON file
/// (whose format has no room for provenance).
pub fn export(
    r: &Ranking,
    format: AtlasFormat,
    out: &Path,
    (sink, recent): (usize, usize),
    made: Made,
) -> Result<()> {
    match format {
        AtlasFormat::Duo => write_duo(r, out, sink, recent, made),
        AtlasFormat::HeadsJson => write_atomic(out, heads_json(r).as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 layers x 4 query heads over 2 KV heads, the shape of `ranking`'s.
    fn cfg() -> Config {
        Config {
            n_heads: 4,
            ..crate::model::config::tests::tiny()
        }
    }

    fn id() -> ModelId {
        ModelId {
            name: "tiny".into(),
            sha256: "00".into(),
        }
    }

    fn ranking(scores: &[f64]) -> Ranking {
        crate::policy::ranking::tests::ranking(scores.to_vec())
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("headwise-atlas-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    const SCORES: [f64; 8] = [0.1, 0.3, -1e-7, -0.2, 1.0, 0.0, 0.5, 0.25];

    #[test]
    fn a_pattern_folder_holds_each_kv_heads_maximum_and_imports_back() {
        let r = ranking(&SCORES);
        // per KV head: max of heads (0, 1) and (2, 3) of each layer
        assert_eq!(duo_tsv(&r), "0.3\t-0.0000001\n1\t0.5\n");
        let dir = scratch("duo");
        export(&r, AtlasFormat::Duo, &dir, (4, 64), Made::now("none")).unwrap();
        let p = read_duo(&dir).unwrap();
        assert_eq!((p.sink, p.recent), (4, 64));
        assert_eq!(p.model_sha256.as_deref(), Some("00"));
        let back = import(AtlasFormat::Duo, &dir, &cfg(), &id(), Made::now("none")).unwrap();
        // every query head of a KV head scores the KV head's value
        let got: Vec<f64> = back.heads.iter().map(|h| h.score).collect();
        assert_eq!(got, [0.3, 0.3, -1e-7, -1e-7, 1.0, 1.0, 0.5, 0.5]);
        let max = |r: &Ranking| r.kv_heads.iter().map(|k| k.max).collect::<Vec<_>>();
        assert_eq!(max(&back), max(&r));
        assert_eq!(back.provenance.method, "duo");
        assert_eq!(back.provenance.task["recent_size"], 64);
        // another model's pattern, or another shape, is refused
        let other = ModelId {
            name: "other".into(),
            sha256: "cd".into(),
        };
        let e = import(AtlasFormat::Duo, &dir, &cfg(), &other, Made::now("none")).unwrap_err();
        assert!(e.to_string().contains("sha256 00"), "{e}");
        let mut wide = cfg();
        wide.n_kv_heads = 4;
        let e = import(AtlasFormat::Duo, &dir, &wide, &id(), Made::now("none")).unwrap_err();
        assert!(e.to_string().contains("2 layers x 2 KV heads"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn duoattentions_own_files_are_read() {
        // DuoAttention's config carries training arguments beside the two sizes and no
        // model hash; its TSV holds gates in [0, 1].
        let dir = scratch("theirs");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(DUO_HEADS), "0.9\t0.01\n0.02\t1.0\n").unwrap();
        std::fs::write(
            dir.join(DUO_CONFIG),
            r#"{"lr": 0.02, "reg_weight": 0.05, "sink_size": 64, "recent_size": 256}"#,
        )
        .unwrap();
        let r = import(AtlasFormat::Duo, &dir, &cfg(), &id(), Made::now("none")).unwrap();
        assert_eq!(r.provenance.model_sha256, "00");
        assert_eq!(
            r.top(2)
                .iter()
                .map(|h| (h.layer, h.head))
                .collect::<Vec<_>>(),
            [(1, 2), (1, 3)]
        );
        std::fs::write(dir.join(DUO_HEADS), "0.9\t0.01\n0.02\n").unwrap();
        let e = read_duo(&dir).unwrap_err().to_string();
        assert!(e.contains("line 2 has 1 values, line 1 has 2"), "{e}");
        std::fs::write(dir.join(DUO_HEADS), "0.9\tnan\n").unwrap();
        assert!(read_duo(&dir)
            .unwrap_err()
            .to_string()
            .contains("not a number"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn heads_json_round_trips_every_query_head_and_averages_lists() {
        let r = ranking(&SCORES);
        let dir = scratch("json");
        let path = dir.join("heads.json");
        export(&r, AtlasFormat::HeadsJson, &path, (0, 0), Made::now("none")).unwrap();
        let read = || {
            import(
                AtlasFormat::HeadsJson,
                &path,
                &cfg(),
                &id(),
                Made::now("none"),
            )
        };
        let got: Vec<f64> = read().unwrap().heads.iter().map(|h| h.score).collect();
        assert_eq!(got, SCORES);
        // a list's mean is the score; a missing head, an unknown one and a bad key fail
        let cases = [
            (r#"{"0-0": [0.0, 1.0], "1-3": [0.2]}"#, "2 heads scored"),
            (r#"{"2-0": [1.0]}"#, "scoring head 2-0"),
            (r#"{"layer0": [1.0]}"#, "not \"layer-head\""),
            (r#"{"0-0": []}"#, "0-0 has no scores"),
        ];
        for (text, needle) in cases {
            std::fs::write(&path, text).unwrap();
            let e = read().unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        std::fs::write(&path, r#"{"0-0": [0.0, 1.0]}"#).unwrap();
        assert_eq!(read_heads_json(&path).unwrap()[&(0, 0)], 0.5);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
