//! The embedded BM25 retriever: a tantivy index of `title` and `text`, searched with a
//! match query (any query term, BM25-scored over both fields), like Elasticsearch's
//! `match` that DRAGIN sends.
//!
//! An index folder holds tantivy's files and `headwise-index.json` (schema version, the
//! corpus's sha256 and passage count, provenance), written last, so a folder without it
//! is not an index.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, BoostQuery, Occur, Query, TermQuery};
use tantivy::schema::{Field, IndexRecordOption, Schema, Value, STORED, STRING, TEXT};
use tantivy::{doc, Index, IndexReader, ReloadPolicy, TantivyDocument, Term};

use crate::artifact::{read_versioned, Versioned};
use crate::provenance::{Made, NO_MODEL};
use crate::rag::corpus::Passage;
use crate::rag::retriever::{Hit, Retriever, MAX_K};
use crate::results::write_atomic;
use crate::{Error, Result};

/// Version of the index layout below.
pub const INDEX_SCHEMA_VERSION: u32 = 1;
const META: &str = "headwise-index.json";
/// Most distinct terms a query may have in one field; a longer query is refused (a 400
/// from the search server) rather than searched for minutes.
pub const MAX_QUERY_TERMS: usize = 1024;

impl Versioned for IndexMeta {
    const KIND: &'static str = "index";
    const SCHEMA_VERSION: u32 = INDEX_SCHEMA_VERSION;
    const ON_OTHER_VERSION: &'static str = "; rebuild the index";
}

/// What an index folder says about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexMeta {
    pub schema_version: u32,
    pub passages: usize,
    /// sha256 of the passages as indexed (id, title, text).
    pub corpus_sha256: String,
    /// Build, command line and date (numerics: [`NO_MODEL`]).
    #[serde(flatten)]
    pub made: Made,
}

/// An open tantivy index.
pub struct Bm25Index {
    index: Index,
    reader: IndexReader,
    id: Field,
    title: Field,
    text: Field,
    meta: IndexMeta,
}

impl std::fmt::Debug for Bm25Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bm25Index")
            .field("meta", &self.meta)
            .finish()
    }
}

fn schema() -> (Schema, Field, Field, Field) {
    let mut b = Schema::builder();
    let id = b.add_text_field("id", STRING | STORED);
    let title = b.add_text_field("title", TEXT | STORED);
    let text = b.add_text_field("text", TEXT | STORED);
    (b.build(), id, title, text)
}

fn tantivy_err(what: &str) -> impl Fn(tantivy::TantivyError) -> Error + '_ {
    move |e| Error::invalid("index", format!("{what}: {e}"))
}

/// Add `passages` to the empty `index` and commit; what the index then holds.
fn fill(index: &Index, passages: &[Passage]) -> Result<IndexMeta> {
    let (_, id, title, text) = schema();
    let mut writer = index
        .writer::<TantivyDocument>(50_000_000)
        .map_err(tantivy_err("writer"))?;
    for p in passages {
        writer
            .add_document(
                doc!(id => p.id.as_str(), title => p.title.as_str(), text => p.text.as_str()),
            )
            .map_err(tantivy_err("add"))?;
    }
    writer.commit().map_err(tantivy_err("commit"))?;
    // Merges run in the background: finish them before anyone reads or moves the files.
    writer
        .wait_merging_threads()
        .map_err(tantivy_err("merge"))?;
    Ok(IndexMeta {
        schema_version: INDEX_SCHEMA_VERSION,
        passages: passages.len(),
        corpus_sha256: corpus_sha256(passages),
        made: Made::now(NO_MODEL),
    })
}

/// sha256 over every passage's id, title and text.
fn corpus_sha256(passages: &[Passage]) -> String {
    let mut h = Sha256::new();
    for p in passages {
        for part in [&p.id, &p.title, &p.text] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
    }
    format!("{:x}", h.finalize())
}

impl Bm25Index {
    /// Index `passages` into the (new or empty) folder `dir`.
    pub fn build(dir: &Path, passages: &[Passage]) -> Result<Self> {
        if passages.is_empty() {
            return Err(Error::invalid("corpus", "no passages (empty corpus)"));
        }
        if dir.read_dir().is_ok_and(|mut d| d.next().is_some()) {
            return Err(Error::invalid(
                "index",
                format!("{}: not empty (remove it to rebuild)", dir.display()),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let (schema, ..) = schema();
        let index = Index::create_in_dir(dir, schema).map_err(tantivy_err("create"))?;
        let meta = fill(&index, passages)?;
        let json = serde_json::to_string_pretty(&meta)
            .map_err(|e| Error::invalid("index", e.to_string()))?;
        write_atomic(&dir.join(META), json.as_bytes())?;
        Self::open(dir)
    }

    /// Index `passages` in memory (nothing written).
    pub fn in_memory(passages: &[Passage]) -> Result<Self> {
        if passages.is_empty() {
            return Err(Error::invalid("corpus", "no passages (empty corpus)"));
        }
        let (schema, ..) = schema();
        let index = Index::create_in_ram(schema);
        let meta = fill(&index, passages)?;
        Self::from_index(index, meta, "in memory")
    }

    /// Open an index folder written by [`Bm25Index::build`].
    pub fn open(dir: &Path) -> Result<Self> {
        let meta_path = dir.join(META);
        let meta: IndexMeta = read_versioned(&meta_path)?;
        let index = Index::open_in_dir(dir).map_err(tantivy_err("open"))?;
        Self::from_index(index, meta, &dir.display().to_string())
    }

    fn from_index(index: Index, meta: IndexMeta, place: &str) -> Result<Self> {
        let s = index.schema();
        let field = |name: &str| {
            s.get_field(name)
                .map_err(|_| Error::invalid("index", format!("{place}: no field `{name}`")))
        };
        let (id, title, text) = (field("id")?, field("title")?, field("text")?);
        // The index never changes once built: no reload, so no watcher thread.
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(tantivy_err("reader"))?;
        Ok(Self {
            index,
            reader,
            id,
            title,
            text,
            meta,
        })
    }

    /// What the folder says about the index.
    pub fn meta(&self) -> &IndexMeta {
        &self.meta
    }

    /// The match query: every token of `query` (as each field's analyzer cuts it) as a
    /// should-clause over `title` and `text`. A token that repeats becomes one clause
    /// boosted by its count, which scores as the repeated clauses would, so a long query
    /// costs one clause per distinct token.
    ///
    /// Errors: [`Error::InvalidArgument`] beyond [`MAX_QUERY_TERMS`] distinct tokens in a
    /// field.
    fn query(&self, query: &str) -> Result<Box<dyn Query>> {
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        for field in [self.title, self.text] {
            let mut analyzer = self
                .index
                .tokenizer_for_field(field)
                .map_err(tantivy_err("tokenizer"))?;
            let mut stream = analyzer.token_stream(query);
            // Distinct tokens in order of first appearance, with their counts.
            let mut tokens: Vec<(String, u32)> = Vec::new();
            let mut at: std::collections::HashMap<String, usize> = Default::default();
            while stream.advance() {
                let token = &stream.token().text;
                if let Some(&i) = at.get(token) {
                    tokens[i].1 += 1;
                    continue;
                }
                if tokens.len() == MAX_QUERY_TERMS {
                    return Err(Error::invalid(
                        "query",
                        format!("more than {MAX_QUERY_TERMS} distinct terms"),
                    ));
                }
                at.insert(token.clone(), tokens.len());
                tokens.push((token.clone(), 1));
            }
            for (token, count) in tokens {
                let term = TermQuery::new(
                    Term::from_field_text(field, &token),
                    IndexRecordOption::WithFreqs,
                );
                let clause: Box<dyn Query> = match count {
                    1 => Box::new(term),
                    n => Box::new(BoostQuery::new(Box::new(term), n as f32)),
                };
                clauses.push((Occur::Should, clause));
            }
        }
        Ok(Box::new(BooleanQuery::new(clauses)))
    }
}

impl Retriever for Bm25Index {
    fn search(&self, query: &str, k: usize) -> Result<Vec<Hit>> {
        if k > MAX_K {
            return Err(Error::invalid("k", format!("{k} (allowed: 0..={MAX_K})")));
        }
        if k == 0 {
            return Ok(Vec::new());
        }
        let searcher = self.reader.searcher();
        let q = self.query(query)?;
        let top = searcher
            .search(&q, &TopDocs::with_limit(k).order_by_score())
            .map_err(tantivy_err("search"))?;
        top.into_iter()
            .map(|(score, addr)| {
                let doc: TantivyDocument = searcher.doc(addr).map_err(tantivy_err("fetch"))?;
                let get = |f: Field| {
                    doc.get_first(f)
                        .and_then(|v| v.as_str())
                        .unwrap_or_default()
                        .to_string()
                };
                Ok(Hit {
                    id: get(self.id),
                    title: get(self.title),
                    text: get(self.text),
                    score,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passages() -> Vec<Passage> {
        let p = |id: &str, title: &str, text: &str| Passage {
            id: id.into(),
            title: title.into(),
            text: text.into(),
        };
        vec![
            p(
                "a",
                "Lisbon",
                "Lisbon is the capital and largest city of Portugal.",
            ),
            p(
                "b",
                "Oslo",
                "Oslo is the capital of Norway, on the Oslofjord.",
            ),
            p(
                "c",
                "Kyoto",
                "Kyoto was the imperial capital of Japan for over a thousand years.",
            ),
        ]
    }

    #[test]
    fn the_passage_a_query_is_copied_from_comes_first() {
        let dir = std::env::temp_dir().join(format!("headwise-bm25-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let index = Bm25Index::build(&dir, &passages()).unwrap();
        let hits = index.search("imperial capital of Japan", 3).unwrap();
        assert_eq!(hits[0].id, "c");
        assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
        // Query syntax characters are plain text to a match query.
        assert_eq!(
            index.search("Norway: (Oslofjord\" AND", 1).unwrap()[0].id,
            "b"
        );
        assert!(index.search("zzzz", 3).unwrap().is_empty());
        // Reopened from disk, same answers; a second build into the folder is refused.
        let again = Bm25Index::open(&dir).unwrap();
        assert_eq!(again.meta().passages, 3);
        assert_eq!(
            again.search("largest city of Portugal", 1).unwrap()[0].id,
            "a"
        );
        assert!(Bm25Index::build(&dir, &passages()).is_err());
        drop((index, again));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(Bm25Index::open(&dir).is_err());
    }

    #[test]
    fn a_repeated_term_scores_as_its_repeated_clauses_and_a_flood_of_terms_is_refused() {
        let dir = std::env::temp_dir().join(format!("headwise-bm25-rep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let index = Bm25Index::build(&dir, &passages()).unwrap();
        let query = "capital capital capital of Japan Japan";
        // The query as one clause per token, repeats included, built here directly.
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        for field in [index.title, index.text] {
            for word in query.split(' ') {
                let term = Term::from_field_text(field, &word.to_lowercase());
                clauses.push((
                    Occur::Should,
                    Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs)),
                ));
            }
        }
        let searcher = index.reader.searcher();
        let plain = searcher
            .search(
                &BooleanQuery::new(clauses),
                &TopDocs::with_limit(3).order_by_score(),
            )
            .unwrap();
        let hits = index.search(query, 3).unwrap();
        assert_eq!(hits.len(), plain.len());
        for (hit, (score, addr)) in hits.iter().zip(&plain) {
            let doc: TantivyDocument = searcher.doc(*addr).unwrap();
            let id = doc.get_first(index.id).and_then(|v| v.as_str()).unwrap();
            assert_eq!(hit.id, id);
            assert!(
                (hit.score - score).abs() <= 1e-5 * score.abs(),
                "{} vs {score}",
                hit.score
            );
        }
        let flood: Vec<String> = (0..=MAX_QUERY_TERMS).map(|i| format!("w{i}")).collect();
        let err = index.search(&flood.join(" "), 3).unwrap_err().to_string();
        assert!(err.contains("more than 1024 distinct terms"), "{err}");
        assert!(index.search("capital", MAX_K + 1).is_err());
        drop(index);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
