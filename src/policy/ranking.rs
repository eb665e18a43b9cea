//! Ranking files: every head's score with the model's identity, the task and the
//! provenance (numerics, build, command line, date); per-KV-head aggregates (retention works per KV head); comparison
//! (Spearman rank correlation, top-K Jaccard) and a layer x head heatmap; the files
//! other tools read are `policy::atlas`'s.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::artifact::{read_versioned, Versioned};
use crate::model::ModelId;
use crate::provenance::Made;
use crate::results::write_atomic;
use crate::{Error, Result};

/// One score per (layer, query head), row-major `(n_layers, n_heads)`.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadMatrix {
    pub n_layers: usize,
    pub n_heads: usize,
    pub data: Vec<f64>,
}

impl HeadMatrix {
    /// All zeros.
    pub fn zeros(n_layers: usize, n_heads: usize) -> Self {
        Self {
            n_layers,
            n_heads,
            data: vec![0.0; n_layers * n_heads],
        }
    }

    /// Score of (layer, head).
    pub fn get(&self, layer: usize, head: usize) -> f64 {
        self.data[layer * self.n_heads + head]
    }

    /// Mutable score of (layer, head).
    pub fn at(&mut self, layer: usize, head: usize) -> &mut f64 {
        &mut self.data[layer * self.n_heads + head]
    }

    /// Add `other` element-wise.
    pub fn add(&mut self, other: &HeadMatrix) {
        self.data
            .iter_mut()
            .zip(&other.data)
            .for_each(|(a, b)| *a += b);
    }

    /// Multiply every score by `k`.
    pub fn scale(&mut self, k: f64) {
        self.data.iter_mut().for_each(|a| *a *= k);
    }
}

/// Version of the ranking file format.
pub const SCHEMA_VERSION: u32 = 1;

/// One query head's score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadScore {
    pub layer: usize,
    pub head: usize,
    pub kv_head: usize,
    pub score: f64,
}

/// One KV head's aggregate over the query heads that read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvHeadScore {
    pub layer: usize,
    pub kv_head: usize,
    pub max: f64,
    pub mean: f64,
}

/// Trials run and accepted at one haystack length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Acceptance {
    pub context_tokens: usize,
    pub run: usize,
    pub accepted: usize,
}

/// How stable the top-`k` heads are under resampling of the accepted trials: the
/// Jaccard overlap of each bootstrap resample's top-`k` with the full set's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopKStability {
    pub k: usize,
    /// Mean overlap over the resamples.
    pub mean_jaccard: f64,
    /// Its 5th percentile: 95% of resamples overlap at least this much.
    pub p05_jaccard: f64,
    /// Resamples drawn.
    pub rounds: usize,
}

impl Versioned for Ranking {
    const KIND: &'static str = "ranking";
    const SCHEMA_VERSION: u32 = SCHEMA_VERSION;
}

/// A ranking file: its provenance and every head's score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ranking {
    pub schema_version: u32,
    #[serde(flatten)]
    pub provenance: Provenance,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Every query head, in (layer, head) order.
    pub heads: Vec<HeadScore>,
    /// Every KV head, in (layer, kv_head) order.
    pub kv_heads: Vec<KvHeadScore>,
}

/// Identity and provenance of a ranking, everything but the scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// Model file stem and the GGUF's sha256.
    pub model: String,
    pub model_sha256: String,
    /// `wu` or `locos`, or the format an imported ranking was read from (`duo`,
    /// `heads-json`).
    pub method: String,
    /// The task spec the trials were generated from (including seeds).
    pub task: serde_json::Value,
    pub trials_run: usize,
    pub trials_accepted: usize,
    /// Per haystack length.
    pub acceptance: Vec<Acceptance>,
    /// Which steps were scored: `greedy` (the model's own output) or `teacher` (the
    /// gold answer teacher-forced; LOCOS only).
    pub step_source: String,
    /// Steps averaged over (LOCOS: answer steps of accepted trials; Wu: accepted trials).
    pub steps: usize,
    /// Bootstrap stability of the top heads (empty for imported rankings and rankings
    /// scored before it was recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stability: Vec<TopKStability>,
    /// Numerics, build, command line and date of the scoring run.
    #[serde(flatten)]
    pub made: Made,
}

impl Ranking {
    /// Build from a score matrix; `n_kv_heads` divides `scores.n_heads`.
    pub fn new(p: Provenance, scores: &HeadMatrix, n_kv_heads: usize) -> Self {
        let group = scores.n_heads / n_kv_heads;
        let mut heads = Vec::with_capacity(scores.data.len());
        let mut kv_heads = Vec::new();
        for layer in 0..scores.n_layers {
            for head in 0..scores.n_heads {
                heads.push(HeadScore {
                    layer,
                    head,
                    kv_head: head / group,
                    score: scores.get(layer, head),
                });
            }
            for kv in 0..n_kv_heads {
                let s: Vec<f64> = (kv * group..(kv + 1) * group)
                    .map(|h| scores.get(layer, h))
                    .collect();
                kv_heads.push(KvHeadScore {
                    layer,
                    kv_head: kv,
                    max: s.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    mean: s.iter().sum::<f64>() / group as f64,
                });
            }
        }
        Self {
            schema_version: SCHEMA_VERSION,
            provenance: p,
            n_layers: scores.n_layers,
            n_heads: scores.n_heads,
            n_kv_heads,
            heads,
            kv_heads,
        }
    }

    /// Read a ranking file, checking its schema version.
    pub fn load(path: &Path) -> Result<Self> {
        let r: Ranking = read_versioned(path)?;
        r.validate()
            .map_err(|reason| Error::invalid("ranking", format!("{}: {reason}", path.display())))?;
        Ok(r)
    }

    /// Check that the ranking is what its shape says: `n_layers` x `n_heads` query
    /// heads and `n_layers` x `n_kv_heads` KV heads, each exactly once and in order, with
    /// no score NaN. Every reader relies on this, so [`Self::load`] runs it.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let (layers, heads, kv) = (self.n_layers, self.n_heads, self.n_kv_heads);
        if layers == 0 || heads == 0 || kv == 0 || heads % kv != 0 {
            return Err(format!(
                "{layers} layers x {heads} heads with {kv} KV heads: all must be positive and \
                 the KV heads must divide the heads"
            ));
        }
        let n_heads = layers.checked_mul(heads);
        if n_heads != Some(self.heads.len()) {
            return Err(format!(
                "{} head scores for {layers} layers x {heads} heads",
                self.heads.len()
            ));
        }
        if layers.checked_mul(kv) != Some(self.kv_heads.len()) {
            return Err(format!(
                "{} KV head scores for {layers} layers x {kv} KV heads",
                self.kv_heads.len()
            ));
        }
        let group = heads / kv;
        for (i, h) in self.heads.iter().enumerate() {
            let want = (i / heads, i % heads, (i % heads) / group);
            if (h.layer, h.head, h.kv_head) != want || h.score.is_nan() {
                return Err(format!(
                    "head entry {i} is (layer {}, head {}, kv head {}, score {}); expected \
                     (layer {}, head {}, kv head {}) with a score",
                    h.layer, h.head, h.kv_head, h.score, want.0, want.1, want.2
                ));
            }
        }
        for (i, h) in self.kv_heads.iter().enumerate() {
            if (h.layer, h.kv_head) != (i / kv, i % kv) || h.max.is_nan() || h.mean.is_nan() {
                return Err(format!(
                    "KV head entry {i} is (layer {}, kv head {}); expected (layer {}, kv head \
                     {}) with scores",
                    h.layer,
                    h.kv_head,
                    i / kv,
                    i % kv
                ));
            }
        }
        Ok(())
    }

    /// Errors unless the ranking's shape is the model's (`n_layers` x `n_heads` with
    /// `n_kv_heads`).
    pub fn check_model(&self, n_layers: usize, n_heads: usize, n_kv_heads: usize) -> Result<()> {
        if (self.n_layers, self.n_heads, self.n_kv_heads) != (n_layers, n_heads, n_kv_heads) {
            return Err(Error::invalid(
                "ranking",
                format!(
                    "ranks {} layers x {} heads ({} KV), the model has {n_layers} x {n_heads} \
                     ({n_kv_heads} KV)",
                    self.n_layers, self.n_heads, self.n_kv_heads
                ),
            ));
        }
        Ok(())
    }

    /// Errors unless the ranking was made on the model `id` with `n_layers` x
    /// `n_heads` query heads; `path` names it in the message.
    pub fn check_for(
        &self,
        path: &Path,
        id: &ModelId,
        n_layers: usize,
        n_heads: usize,
    ) -> Result<()> {
        let p = &self.provenance;
        if !p.model_sha256.eq_ignore_ascii_case(&id.sha256)
            || (self.n_layers, self.n_heads) != (n_layers, n_heads)
        {
            return Err(Error::invalid(
                "ranking",
                format!(
                    "{} ranks {} (sha256 {}), not this model ({}, sha256 {})",
                    path.display(),
                    p.model,
                    p.model_sha256,
                    id.name,
                    id.sha256
                ),
            ));
        }
        Ok(())
    }

    /// Every head `(layer, head)`, highest score first (ties by layer, then head).
    pub fn ordered(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<&HeadScore> = self.heads.iter().collect();
        v.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then((a.layer, a.head).cmp(&(b.layer, b.head)))
        });
        v.into_iter().map(|h| (h.layer, h.head)).collect()
    }

    /// Write atomically as pretty JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self)
            .map_err(|e| Error::invalid("ranking", e.to_string()))?;
        write_atomic(path, json.as_bytes())
    }

    /// The `k` best heads, highest score first.
    pub fn top(&self, k: usize) -> Vec<&HeadScore> {
        let mut v: Vec<&HeadScore> = self.heads.iter().collect();
        v.sort_by(|a, b| b.score.total_cmp(&a.score));
        v.truncate(k);
        v
    }

    /// A layer (rows) x head (columns) heatmap as SVG, darker = higher score.
    pub fn heatmap_svg(&self) -> String {
        let (cell, left, top) = (18usize, 48usize, 40usize);
        let (w, h) = (
            left + self.n_heads * cell + 90,
            top + self.n_layers * cell + 30,
        );
        let max = self.heads.iter().map(|s| s.score).fold(0f64, f64::max);
        let min = self.heads.iter().map(|s| s.score).fold(0f64, f64::min);
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"10\">\n\
             <text x=\"{left}\" y=\"16\" font-size=\"12\">{} {} scores, {} (layer x head)</text>\n",
            self.provenance.method,
            self.task_name(),
            self.provenance.model
        );
        for s in &self.heads {
            // positive scores in red, negative in blue, both scaled to the extreme
            let (r, g, b) = if s.score >= 0.0 {
                let t = if max > 0.0 { s.score / max } else { 0.0 };
                (255.0, 255.0 * (1.0 - t), 255.0 * (1.0 - t))
            } else {
                let t = if min < 0.0 { s.score / min } else { 0.0 };
                (255.0 * (1.0 - t), 255.0 * (1.0 - t), 255.0)
            };
            svg.push_str(&format!(
                "<rect x=\"{}\" y=\"{}\" width=\"{cell}\" height=\"{cell}\" fill=\"rgb({},{},{})\" stroke=\"#ddd\"><title>layer {} head {}: {:.4}</title></rect>\n",
                left + s.head * cell,
                top + s.layer * cell,
                r as u8,
                g as u8,
                b as u8,
                s.layer,
                s.head,
                s.score
            ));
        }
        for layer in (0..self.n_layers).step_by(5) {
            svg.push_str(&format!(
                "<text x=\"4\" y=\"{}\">L{layer}</text>\n",
                top + layer * cell + 13
            ));
        }
        for head in 0..self.n_heads {
            svg.push_str(&format!(
                "<text x=\"{}\" y=\"{}\">{head}</text>\n",
                left + head * cell + 5,
                top - 4
            ));
        }
        let lx = left + self.n_heads * cell + 10;
        svg.push_str(&format!(
            "<text x=\"{lx}\" y=\"{}\">max {max:.3}</text>\n<text x=\"{lx}\" y=\"{}\">min {min:.3}</text>\n</svg>\n",
            top + 10,
            top + 24
        ));
        svg
    }

    fn task_name(&self) -> String {
        self.provenance
            .task
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("?")
            .to_string()
    }
}

/// Average ranks (1-based, ties sharing their mean rank).
fn ranks(x: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[a].total_cmp(&x[b]));
    let mut r = vec![0.0; x.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && x[idx[j + 1]] == x[idx[i]] {
            j += 1;
        }
        let mean = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = mean;
        }
        i = j + 1;
    }
    r
}

/// Spearman rank correlation of two equally long score lists (Pearson on average ranks).
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = ra.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = rb.iter().map(|y| (y - mb).powi(2)).sum();
    if va == 0.0 || vb == 0.0 {
        return 0.0;
    }
    cov / (va * vb).sqrt()
}

/// Jaccard overlap of the two rankings' top-`k` (layer, head) sets.
pub fn jaccard_top_k(a: &Ranking, b: &Ranking, k: usize) -> f64 {
    let set = |r: &Ranking| -> std::collections::BTreeSet<(usize, usize)> {
        r.top(k).iter().map(|s| (s.layer, s.head)).collect()
    };
    let (sa, sb) = (set(a), set(b));
    let union = sa.union(&sb).count();
    if union == 0 {
        return 0.0;
    }
    sa.intersection(&sb).count() as f64 / union as f64
}

/// Check that `a` and `b` score the same model's heads.
pub fn check_comparable(a: &Ranking, b: &Ranking) -> Result<()> {
    if (a.n_layers, a.n_heads) != (b.n_layers, b.n_heads) {
        return Err(Error::invalid(
            "rankings",
            format!(
                "{} is {}x{} heads, {} is {}x{}",
                a.provenance.model,
                a.n_layers,
                a.n_heads,
                b.provenance.model,
                b.n_layers,
                b.n_heads
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// 2 layers x 4 query heads over 2 KV heads, scored `scores` (row-major).
    pub(crate) fn ranking(scores: Vec<f64>) -> Ranking {
        let m = HeadMatrix {
            n_layers: 2,
            n_heads: 4,
            data: scores,
        };
        let p = Provenance {
            model: "tiny".into(),
            model_sha256: "00".into(),
            method: "wu".into(),
            task: serde_json::json!({"kind": "niah"}),
            trials_run: 3,
            trials_accepted: 2,
            acceptance: vec![Acceptance {
                context_tokens: 256,
                run: 3,
                accepted: 2,
            }],
            step_source: "greedy".into(),
            steps: 2,
            stability: Vec::new(),
            made: Made::now("fast"),
        };
        Ranking::new(p, &m, 2)
    }

    #[test]
    fn kv_aggregates_take_max_and_mean_over_the_group() {
        let r = ranking(vec![0.1, 0.3, 0.0, -0.2, 1.0, 0.0, 0.5, 0.5]);
        assert_eq!(r.kv_heads[0].max, 0.3);
        assert!((r.kv_heads[0].mean - 0.2).abs() < 1e-12);
        assert_eq!(r.kv_heads[1].max, 0.0);
        assert_eq!(r.heads[7].kv_head, 1);
        assert_eq!(r.top(2)[0].score, 1.0);
        assert!(r.heatmap_svg().contains("layer 1 head 0: 1.0000"));
    }

    #[test]
    fn spearman_and_jaccard_on_hand_computed_cases() {
        assert!((spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 30.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        // ranks (1, 2.5, 2.5) vs (1, 2, 3): cov 1.5, var 1.5 and 2 -> 1.5 / sqrt(3)
        let s = spearman(&[0.0, 5.0, 5.0], &[1.0, 2.0, 3.0]);
        assert!((s - 1.5 / 3f64.sqrt()).abs() < 1e-12, "{s}");
        let a = ranking(vec![8.0, 7.0, 6.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let b = ranking(vec![8.0, 0.0, 6.0, 7.0, 0.0, 0.0, 0.0, 0.0]);
        // top-3 {0,1,2} vs {0,3,2}: 2 shared of 4
        assert!((jaccard_top_k(&a, &b, 3) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn files_round_trip_and_foreign_schemas_are_refused() {
        let dir = std::env::temp_dir().join(format!("headwise-ranking-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("wu-niah.json");
        let r = ranking(vec![0.0; 8]);
        r.write(&path).unwrap();
        assert_eq!(Ranking::load(&path).unwrap(), r);
        let mut bad = r.clone();
        bad.schema_version = 99;
        std::fs::write(&path, serde_json::to_string(&bad).unwrap()).unwrap();
        let e = Ranking::load(&path).unwrap_err().to_string();
        assert!(e.contains("schema version 99"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
