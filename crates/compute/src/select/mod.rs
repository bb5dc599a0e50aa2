//! `select`: SQL over CSV or JSON lines, as S3 Select does it, with GROUP BY, HAVING,
//! ORDER BY and LIMIT besides.
//!
//! With no output object it runs per input and returns its rows inline (aggregates,
//! counts, a few rows: up to [`INLINE_BYTES_MAX`]); with an output object it writes the
//! rows there as CSV or JSON lines and returns the counts.
//!
//! The input streams through once: a record is parsed (CSV by `csv-core`, which keeps
//! its state across chunks, so records and quoted fields may cross any chunk boundary;
//! JSON by `serde_json`), only the columns the query names are converted to values,
//! the WHERE clause filters, and the record is either projected and written or folded
//! into its group. Groups and ORDER BY rows are held in memory within the command's
//! memory bound; nothing else is.

pub mod like;
pub mod plan;
pub mod value;

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use serde::Deserialize;

use crate::Account;
use crate::{parse_args, ComputeError, Context, Kernel, Outcome, Sink, Source, Transform};
use plan::{AggFunc, Expr, Fail, Item, Plan, Scope, Work};
use value::Value;

const OP: &str = "select";
/// Rows returned inline (with no output object), as JSON: at most this many bytes.
pub const INLINE_BYTES_MAX: usize = 128 << 10;
/// One CSV record or JSON line: at most this many bytes.
pub const RECORD_BYTES_MAX: usize = 1 << 20;
/// Output is handed to the output object in pieces of about this size.
const WRITE_CHUNK: usize = 256 << 10;

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Csv,
    /// JSON lines: one object per line.
    Jsonl,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Args {
    pub query: String,
    /// The input's format.
    #[serde(default)]
    pub format: Format,
    /// CSV: the first record names the columns (default true). Columns can always be
    /// named by position: `_1`, `_2`, ...
    #[serde(default = "yes")]
    pub header: bool,
    #[serde(default = "comma")]
    pub delimiter: char,
    #[serde(default = "dquote")]
    pub quote: char,
    /// CSV: lines starting with this character are skipped.
    #[serde(default)]
    pub comment: Option<char>,
    /// The format of rows written to an output object.
    #[serde(default)]
    pub output_format: Format,
    /// CSV output: a first line with the column names (default true).
    #[serde(default = "yes")]
    pub output_header: bool,
}

fn yes() -> bool {
    true
}
fn comma() -> char {
    ','
}
fn dquote() -> char {
    '"'
}

fn bad(message: impl Into<String>) -> ComputeError {
    ComputeError::BadArguments { op: OP, message: message.into() }
}

impl Args {
    fn check(&self) -> Result<Plan, ComputeError> {
        for (name, c) in [("delimiter", Some(self.delimiter)), ("quote", Some(self.quote)), ("comment", self.comment)] {
            if let Some(c) = c {
                if !c.is_ascii() || c == '\n' || c == '\r' {
                    return Err(bad(format!("{name} must be one ASCII character other than a line end, not {c:?}")));
                }
            }
        }
        if self.delimiter == self.quote || Some(self.delimiter) == self.comment || Some(self.quote) == self.comment {
            return Err(bad("delimiter, quote and comment must differ"));
        }
        plan::parse(&self.query).map_err(|e| bad(format!("query: {e}")))
    }
}

/// Reads records out of the input's bytes, across chunks.
enum Reader {
    Csv { rdr: Box<csv_core::Reader>, rec: Vec<u8>, ends: Vec<usize>, used: usize, nends: usize, header: bool },
    Jsonl { line: Vec<u8> },
}

/// A record's fields as the reader holds them.
enum Fields<'r> {
    Csv { rec: &'r [u8], ends: &'r [usize] },
    Json(serde_json::Value),
}

/// The query's columns bound to the input: CSV field positions, or JSON names.
enum Binding {
    Unbound,
    Csv { fields: Vec<Option<usize>> },
    Json,
}

/// The running query.
struct Engine {
    plan: Plan,
    args: Args,
    /// The command's meter and memory account: groups, rows held for ORDER BY, output
    /// waiting to be written and the strings of expressions are charged before they are
    /// made.
    work: Work,
    reader: Reader,
    binding: Binding,
    /// Output column names, once `*` is expanded.
    names: Vec<String>,
    records: u64,
    /// Rows that passed WHERE (before LIMIT).
    matched: u64,
    rows_out: u64,
    /// Rows skipped for OFFSET so far (without ORDER BY or groups).
    skipped: u64,
    groups: Groups,
    /// ORDER BY: (sort keys, row) held until the end.
    held: Vec<(Vec<Value<'static>>, Vec<Value<'static>>)>,
    out: Out,
    /// Bytes of the output buffer charged (its capacity).
    out_charged: usize,
    done: bool,
}

/// Where rows go.
enum Out {
    Inline { rows: Vec<Vec<serde_json::Value>>, bytes: usize },
    Object { buf: Vec<u8>, written: u64, header_done: bool },
}

#[derive(Default)]
struct Groups {
    seed: foldhash::fast::RandomState,
    /// Hash of the keys to the groups with that hash.
    index: HashMap<u64, smallvec::SmallVec<[usize; 1]>, foldhash::fast::RandomState>,
    keys: Vec<Vec<Value<'static>>>,
    accs: Vec<Vec<Acc>>,
}

#[derive(Clone, Debug)]
enum Acc {
    Count(u64),
    Sum(Sum),
    Avg(Sum),
    Min(Value<'static>),
    Max(Value<'static>),
}

/// A SUM: exact over integers (128 bits), compensated (Kahan-Babuska-Neumaier, as SQLite
/// does) over floats.
#[derive(Clone, Debug, Default)]
struct Sum {
    n: u64,
    int: i128,
    float: f64,
    comp: f64,
    any_float: bool,
}

impl Sum {
    fn add(&mut self, v: &Value) -> Result<(), String> {
        match v {
            Value::Null => return Ok(()),
            Value::Int(i) => self.int += *i as i128,
            Value::Bool(b) => self.int += *b as i128,
            Value::Float(f) => {
                self.any_float = true;
                let t = self.float + f;
                self.comp += if self.float.abs() >= f.abs() { (self.float - t) + f } else { (f - t) + self.float };
                self.float = t;
            }
            Value::Text(_) => return Err(format!("SUM or AVG of the text {}", v.describe())),
        }
        self.n += 1;
        Ok(())
    }
    fn total(&self) -> f64 {
        self.float + self.comp + self.int as f64
    }
}

impl Acc {
    fn new(f: AggFunc) -> Acc {
        match f {
            AggFunc::Count => Acc::Count(0),
            AggFunc::Sum => Acc::Sum(Sum::default()),
            AggFunc::Avg => Acc::Avg(Sum::default()),
            AggFunc::Min => Acc::Min(Value::Null),
            AggFunc::Max => Acc::Max(Value::Null),
        }
    }

    /// Folds one value in (None: COUNT(*)'s row); a MIN or MAX charges the value it keeps
    /// before copying it, and gives back the one it drops.
    fn add(&mut self, v: Option<&Value>, account: &mut Account) -> Result<(), Fail> {
        match self {
            Acc::Count(n) => *n += v.is_none_or(|v| !v.is_null()) as u64,
            Acc::Sum(s) | Acc::Avg(s) => s.add(v.expect("an argument"))?,
            Acc::Min(m) | Acc::Max(m) => {
                let v = v.expect("an argument");
                if !v.is_null() && (m.is_null() || value::order(v, m) == self.wanted()) {
                    let (Acc::Min(m) | Acc::Max(m)) = self else { unreachable!() };
                    let need = v.owned_footprint();
                    account.charge(need, || format!("a MIN or MAX of {need} bytes")).map_err(Fail::Stop)?;
                    account.release(m.owned_footprint());
                    *m = v.clone().into_owned();
                }
            }
        }
        Ok(())
    }

    /// MIN keeps a value less than its own, MAX one greater.
    fn wanted(&self) -> std::cmp::Ordering {
        if matches!(self, Acc::Min(_)) {
            std::cmp::Ordering::Less
        } else {
            std::cmp::Ordering::Greater
        }
    }

    fn value(&self) -> Result<Value<'static>, String> {
        Ok(match self {
            Acc::Count(n) => Value::Int(*n as i64),
            Acc::Sum(s) if s.n == 0 => Value::Null,
            Acc::Sum(s) if s.any_float => Value::Float(s.total()),
            Acc::Sum(s) => {
                Value::Int(i64::try_from(s.int).map_err(|_| "integer overflow in SUM (CAST the argument AS FLOAT)".to_string())?)
            }
            Acc::Avg(s) if s.n == 0 => Value::Null,
            Acc::Avg(s) => Value::Float(s.total() / s.n as f64),
            Acc::Min(v) | Acc::Max(v) => v.clone(),
        })
    }
}

/// Values of one record, on the stack for the usual handful of columns.
type Values<'a> = smallvec::SmallVec<[Value<'a>; 8]>;

/// Group keys are hashed with foldhash, seeded per query: several times faster than
/// SipHash here (the GROUP BY demo query went from 8% of its time in hashing to under
/// 1.5%, measured with perf), and the random seed keeps crafted data from colliding.
fn hash_keys(state: &foldhash::fast::RandomState, keys: &[Value]) -> u64 {
    let mut h = state.build_hasher();
    for k in keys {
        k.hash_into(&mut h);
    }
    h.finish()
}

impl Engine {
    fn new(args: Args, ctx: &Context, inline: bool) -> Result<Engine, ComputeError> {
        let plan = args.check()?;
        let reader = match args.format {
            Format::Csv => Reader::Csv {
                rdr: Box::new(
                    csv_core::ReaderBuilder::new()
                        .delimiter(args.delimiter as u8)
                        .quote(args.quote as u8)
                        .comment(args.comment.map(|c| c as u8))
                        .build(),
                ),
                rec: vec![0; 4096],
                ends: vec![0; 64],
                used: 0,
                nends: 0,
                header: args.header,
            },
            Format::Jsonl => Reader::Jsonl { line: Vec::new() },
        };
        let out = if inline {
            Out::Inline { rows: Vec::new(), bytes: 0 }
        } else {
            Out::Object { buf: Vec::new(), written: 0, header_done: false }
        };
        Ok(Engine {
            plan,
            args,
            work: Work::new(OP, ctx),
            reader,
            binding: Binding::Unbound,
            names: Vec::new(),
            records: 0,
            matched: 0,
            rows_out: 0,
            skipped: 0,
            groups: Groups::default(),
            held: Vec::new(),
            out,
            out_charged: 0,
            done: false,
        })
    }

    /// The output columns' names (`*` is expanded once bound, and refused with aggregates).
    fn item_names(&self) -> Vec<String> {
        self.plan.items.iter().filter_map(|i| if let Item::Expr { name, .. } = i { Some(name.clone()) } else { None }).collect()
    }

    /// A record that cannot be read: counted, and named by its number.
    fn bad_record(&mut self, message: String) -> ComputeError {
        self.records += 1;
        self.data_err(message)
    }

    fn data_err(&self, message: String) -> ComputeError {
        ComputeError::Data { op: OP, message: format!("record {}: {message}", self.records) }
    }

    /// An evaluation's failure: bad data names the record; a stop is the command's.
    fn fail(&self, f: Fail) -> ComputeError {
        match f {
            Fail::Data(m) => self.data_err(m),
            Fail::Stop(e) => e,
        }
    }

    /// The next bytes of the input.
    fn feed(&mut self, mut data: &[u8]) -> Result<(), ComputeError> {
        while !data.is_empty() && !self.done {
            match &mut self.reader {
                Reader::Csv { rdr, rec, ends, used, nends, .. } => {
                    let (res, nin, nout, nend) = rdr.read_record(data, &mut rec[*used..], &mut ends[*nends..]);
                    data = &data[nin..];
                    *used += nout;
                    *nends += nend;
                    match res {
                        csv_core::ReadRecordResult::InputEmpty | csv_core::ReadRecordResult::End => {}
                        csv_core::ReadRecordResult::OutputFull => {
                            if rec.len() >= RECORD_BYTES_MAX {
                                return Err(self.data_err(format!("a record longer than {RECORD_BYTES_MAX} bytes")));
                            }
                            let n = rec.len() * 2;
                            rec.resize(n, 0);
                        }
                        csv_core::ReadRecordResult::OutputEndsFull => {
                            if ends.len() >= RECORD_BYTES_MAX / 8 {
                                return Err(self.data_err("a record with too many fields".into()));
                            }
                            let n = ends.len() * 2;
                            ends.resize(n, 0);
                        }
                        csv_core::ReadRecordResult::Record => self.csv_record()?,
                    }
                }
                Reader::Jsonl { line } => {
                    match memchr::memchr(b'\n', data) {
                        Some(i) => {
                            line.extend_from_slice(&data[..i]);
                            data = &data[i + 1..];
                            self.json_record()?;
                        }
                        None => {
                            line.extend_from_slice(data);
                            data = &[];
                        }
                    }
                    if let Reader::Jsonl { line } = &self.reader {
                        if line.len() > RECORD_BYTES_MAX {
                            return Err(self.data_err(format!("a line longer than {RECORD_BYTES_MAX} bytes")));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The input has ended: the last record, then groups and ordered rows.
    fn end(&mut self) -> Result<(), ComputeError> {
        if !self.done && matches!(self.reader, Reader::Csv { .. }) {
            // A last record without a line end.
            loop {
                let res = {
                    let Reader::Csv { rdr, rec, ends, used, nends, .. } = &mut self.reader else { unreachable!() };
                    let (res, _, nout, nend) = rdr.read_record(&[], &mut rec[*used..], &mut ends[*nends..]);
                    *used += nout;
                    *nends += nend;
                    match res {
                        csv_core::ReadRecordResult::OutputFull => rec.resize(rec.len() * 2, 0),
                        csv_core::ReadRecordResult::OutputEndsFull => ends.resize(ends.len() * 2, 0),
                        _ => {}
                    }
                    res
                };
                match res {
                    csv_core::ReadRecordResult::Record => self.csv_record()?,
                    csv_core::ReadRecordResult::OutputFull | csv_core::ReadRecordResult::OutputEndsFull => {}
                    _ => break,
                }
                if self.done {
                    break;
                }
            }
        }
        if !self.done {
            if let Reader::Jsonl { line } = &self.reader {
                if !line.is_empty() {
                    self.json_record()?;
                }
            }
        }
        if matches!(self.binding, Binding::Unbound) && self.plan.group.is_none() {
            // No records: the column names still come from the query (without `*`).
            self.names = self.item_names();
        }
        if let Some(g) = &self.plan.group {
            if g.keys.is_empty() && self.groups.keys.is_empty() {
                // Aggregates over no rows: one row (COUNT 0, SUM NULL, ...).
                self.groups.keys.push(Vec::new());
                self.groups.accs.push(g.aggs.iter().map(|a| Acc::new(a.func)).collect());
            }
            self.names = self.item_names();
            self.emit_groups()?;
        }
        if !self.plan.order.is_empty() {
            self.emit_held()?;
        }
        // CSV rows into an object: the header line even when no row matched.
        if let Out::Object { buf, header_done: header_done @ false, .. } = &mut self.out {
            if self.args.output_format == Format::Csv && self.args.output_header {
                write_header(buf, &self.names, &self.args);
                *header_done = true;
            }
        }
        Ok(())
    }

    fn csv_record(&mut self) -> Result<(), ComputeError> {
        let Reader::Csv { rec, ends, used, nends, header, .. } = &mut self.reader else { unreachable!() };
        let (rec_b, ends_b) = (std::mem::take(rec), std::mem::take(ends));
        let (n_used, n_ends) = (*used, *nends);
        let first = *header;
        *header = false;
        *used = 0;
        *nends = 0;
        let fields = Fields::Csv { rec: &rec_b[..n_used], ends: &ends_b[..n_ends] };
        let r = if first { self.bind_csv(&fields, true) } else { self.record(&fields) };
        let Reader::Csv { rec, ends, .. } = &mut self.reader else { unreachable!() };
        *rec = rec_b;
        *ends = ends_b;
        r
    }

    fn json_record(&mut self) -> Result<(), ComputeError> {
        let Reader::Jsonl { line } = &mut self.reader else { unreachable!() };
        let bytes = std::mem::take(line);
        let text = bytes.strip_suffix(b"\r").unwrap_or(&bytes);
        let r = if text.iter().all(u8::is_ascii_whitespace) {
            Ok(())
        } else {
            match serde_json::from_slice::<serde_json::Value>(text) {
                Ok(v @ serde_json::Value::Object(_)) => self.record(&Fields::Json(v)),
                Ok(_) => Err(self.bad_record("not a JSON object".into())),
                Err(e) => Err(self.bad_record(format!("not JSON: {e}"))),
            }
        };
        let Reader::Jsonl { line } = &mut self.reader else { unreachable!() };
        *line = bytes;
        line.clear();
        r
    }

    /// Binds the query's columns to CSV field positions: by the header's names, or by
    /// position (`_N`), from the header or the first record.
    fn bind_csv(&mut self, fields: &Fields, is_header: bool) -> Result<(), ComputeError> {
        let Fields::Csv { rec, ends } = fields else { unreachable!() };
        let names: Vec<Cow<str>> = (0..ends.len()).map(|i| String::from_utf8_lossy(field(rec, ends, i))).collect();
        let display = |names: &[Cow<str>]| names.iter().take(20).map(|n| n.as_ref()).collect::<Vec<_>>().join(", ");
        let mut bound = Vec::new();
        for r in &self.plan.refs {
            if !r.path.is_empty() {
                let path: Vec<&str> = r.path.iter().map(|(p, _)| p.as_str()).collect();
                return Err(bad(format!("query: {}.{}: CSV fields have no nested fields", r.name, path.join("."))));
            }
            let by_name = if is_header {
                // One rule: unquoted ignoring case, quoted exactly; two fields matching is
                // an error naming both.
                let mut hits = names.iter().enumerate().filter(|(_, n)| plan::name_matches(&r.name, r.quoted, n));
                match (hits.next(), hits.next()) {
                    (Some((_, a)), Some((_, b))) => {
                        return Err(bad(format!("query: the column {:?} matches the header fields {a:?} and {b:?}", r.name)))
                    }
                    (first, _) => first.map(|(i, _)| i),
                }
            } else {
                None
            };
            match by_name.or(r.position) {
                Some(i) => bound.push(Some(i)),
                None if is_header => return Err(bad(format!("query: no column {:?} in the header ({})", r.name, display(&names)))),
                None => return Err(bad(format!("query: no header: name the columns _1, _2, ... (not {:?})", r.name))),
            }
        }
        // `*`: every field, named by the header or by position.
        let mut items = Vec::new();
        for item in std::mem::take(&mut self.plan.items) {
            match item {
                Item::Star => {
                    for (i, n) in names.iter().enumerate() {
                        self.plan.refs.push(plan::ColRef { name: n.to_string(), quoted: true, path: vec![], position: Some(i) });
                        bound.push(Some(i));
                        let name = if is_header { n.to_string() } else { format!("_{}", i + 1) };
                        items.push(Item::Expr { expr: Expr::Col(self.plan.refs.len() - 1), name });
                    }
                }
                e => items.push(e),
            }
        }
        self.plan.items = items;
        self.names = self.item_names();
        self.binding = Binding::Csv { fields: bound };
        Ok(())
    }

    fn bind_json(&mut self, obj: &serde_json::Map<String, serde_json::Value>) {
        let mut items = Vec::new();
        for item in std::mem::take(&mut self.plan.items) {
            match item {
                Item::Star => {
                    for k in obj.keys() {
                        self.plan.refs.push(plan::ColRef { name: k.clone(), quoted: true, path: vec![], position: None });
                        items.push(Item::Expr { expr: Expr::Col(self.plan.refs.len() - 1), name: k.clone() });
                    }
                }
                e => items.push(e),
            }
        }
        self.plan.items = items;
        self.names = self.item_names();
        self.binding = Binding::Json;
    }

    /// One record: filter, then project or fold into its group.
    fn record(&mut self, fields: &Fields) -> Result<(), ComputeError> {
        match (&self.binding, fields) {
            (Binding::Unbound, Fields::Csv { .. }) => self.bind_csv(fields, false)?,
            (Binding::Unbound, Fields::Json(serde_json::Value::Object(m))) => self.bind_json(m),
            _ => {}
        }
        self.records += 1;
        let cols: Values = match (fields, &self.binding) {
            (Fields::Csv { rec, ends }, Binding::Csv { fields }) => fields
                .iter()
                .map(|i| match i {
                    Some(i) if *i < ends.len() => Value::infer(String::from_utf8_lossy(field(rec, ends, *i))),
                    _ => Value::Null,
                })
                .collect(),
            (Fields::Json(serde_json::Value::Object(m)), _) => {
                self.plan.refs.iter().map(|r| json_lookup(m, r)).collect::<Result<_, _>>().map_err(|e| self.data_err(e))?
            }
            _ => unreachable!("records match their binding"),
        };
        let scope = Scope { cols: &cols, keys: &[], aggs: &[], outputs: &[] };
        let r = self.fold(&scope);
        // The strings made for this record are gone with it.
        self.work.record_done();
        r
    }

    /// A record's values: filter, then project or fold into its group.
    fn fold(&mut self, scope: &Scope) -> Result<(), ComputeError> {
        if let Some(f) = &self.plan.filter {
            let t = self.plan.eval(f, scope, &mut self.work).and_then(|v| Ok(v.truth()?)).map_err(|e| self.fail(e))?;
            if t != Some(true) {
                return Ok(());
            }
        }
        self.matched += 1;
        if let Some(g) = &self.plan.group {
            let keys =
                g.keys.iter().map(|k| self.plan.eval(k, scope, &mut self.work)).collect::<Result<Values, _>>().map_err(|e| self.fail(e))?;
            let h = hash_keys(&self.groups.seed, &keys);
            let account = &mut self.work.account;
            let found = self.groups.index.get(&h).and_then(|slot| {
                slot.iter().copied().find(|&i| self.groups.keys[i].iter().zip(&keys).all(|(a, b)| value::same_group(a, b)))
            });
            let gi = match found {
                Some(i) => i,
                None => {
                    let i = self.groups.keys.len();
                    let what = || format!("{} groups", i + 1);
                    // The group's keys, accumulators and the room of its index entry are
                    // charged before they are made.
                    let need = 24 + keys.iter().map(Value::owned_footprint).sum::<usize>() + 24 + g.aggs.len() * std::mem::size_of::<Acc>();
                    account.charge(need, what)?;
                    grow(account, &mut self.groups.keys, what)?;
                    grow(account, &mut self.groups.accs, what)?;
                    grow_index(account, &mut self.groups.index, what)?;
                    self.groups.index.entry(h).or_default().push(i);
                    let keys: Vec<Value<'static>> = keys.into_iter().map(Value::into_owned).collect();
                    self.groups.keys.push(keys);
                    self.groups.accs.push(g.aggs.iter().map(|a| Acc::new(a.func)).collect());
                    i
                }
            };
            for (a, spec) in g.aggs.iter().enumerate() {
                let v = spec.arg.as_ref().map(|e| self.plan.eval(e, scope, &mut self.work)).transpose().map_err(|e| self.fail(e))?;
                self.groups.accs[gi][a].add(v.as_ref(), &mut self.work.account).map_err(|e| self.fail(e))?;
            }
            return Ok(());
        }
        self.output_row(scope)
    }

    /// The SELECT items over a record or a group: out now, or held for ORDER BY.
    fn output_row(&mut self, scope: &Scope) -> Result<(), ComputeError> {
        let row = self
            .plan
            .items
            .iter()
            .map(|i| match i {
                Item::Expr { expr, .. } => self.plan.eval(expr, scope, &mut self.work),
                Item::Star => unreachable!("expanded when bound, refused with aggregates"),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.fail(e))?;
        if self.plan.order.is_empty() {
            return self.emit(&row);
        }
        let outs = Scope { cols: scope.cols, keys: scope.keys, aggs: scope.aggs, outputs: &row };
        let keys = self
            .plan
            .order
            .iter()
            .map(|k| self.plan.eval(&k.expr, &outs, &mut self.work))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.fail(e))?;
        self.hold(keys, row)
    }

    /// A row held for ORDER BY: charged (its values, its place in the list) before it is
    /// copied.
    fn hold(&mut self, keys: Vec<Value>, row: Vec<Value>) -> Result<(), ComputeError> {
        let n = self.held.len();
        let what = || format!("{} rows to ORDER BY", n + 1);
        let need = 48 + keys.iter().chain(&row).map(Value::owned_footprint).sum::<usize>();
        self.work.account.charge(need, what)?;
        grow(&mut self.work.account, &mut self.held, what)?;
        let keys: Vec<Value<'static>> = keys.into_iter().map(Value::into_owned).collect();
        let row: Vec<Value<'static>> = row.into_iter().map(Value::into_owned).collect();
        self.held.push((keys, row));
        Ok(())
    }

    /// A row out, after OFFSET and up to LIMIT.
    fn emit(&mut self, row: &[Value]) -> Result<(), ComputeError> {
        if self.skipped < self.plan.offset {
            self.skipped += 1;
            return Ok(());
        }
        if self.plan.limit.is_some_and(|l| self.rows_out >= l) {
            self.done = true;
            return Ok(());
        }
        self.rows_out += 1;
        match &mut self.out {
            Out::Inline { rows, bytes } => {
                // A row's JSON is at least its text: too large a row is refused before it
                // is converted.
                if *bytes + row.iter().map(|v| v.text().len()).sum::<usize>() > INLINE_BYTES_MAX {
                    return Err(ComputeError::ResultTooLarge { op: OP, limit: INLINE_BYTES_MAX });
                }
                let r: Vec<serde_json::Value> = row.iter().map(Value::to_json).collect();
                *bytes += 2 + r.iter().map(|v| v.to_string().len() + 1).sum::<usize>();
                if *bytes > INLINE_BYTES_MAX {
                    return Err(ComputeError::ResultTooLarge { op: OP, limit: INLINE_BYTES_MAX });
                }
                rows.push(r);
            }
            Out::Object { buf, header_done, .. } => {
                // The most the row takes as CSV (every byte quoted and doubled) or JSON (every
                // byte escaped as \u00XX), with the header: room for it is charged first.
                let text: usize = row.iter().map(|v| v.text().len() + 16).sum();
                let names: usize = self.names.iter().map(|n| n.len() + 16).sum();
                let most = 6 * (text + names) + 2;
                if buf.capacity() - buf.len() < most {
                    let cap = (buf.len() + most).max(2 * buf.capacity());
                    self.work.account.charge(cap, || format!("{cap} bytes of output waiting to be written"))?;
                    buf.reserve_exact(cap - buf.len());
                    self.work.account.release(self.out_charged);
                    self.out_charged = cap;
                }
                match self.args.output_format {
                    Format::Csv => {
                        if !*header_done && self.args.output_header {
                            write_header(buf, &self.names, &self.args);
                        }
                        write_csv(buf, row, self.args.delimiter as u8, self.args.quote as u8);
                    }
                    Format::Jsonl => {
                        // Written value by value: text straight from the row, no copy.
                        buf.push(b'{');
                        for (i, (n, v)) in self.names.iter().zip(row).enumerate() {
                            if i > 0 {
                                buf.push(b',');
                            }
                            serde_json::to_writer(&mut *buf, n).expect("writing to memory");
                            buf.push(b':');
                            match v {
                                Value::Text(t) => serde_json::to_writer(&mut *buf, t.as_ref()),
                                v => serde_json::to_writer(&mut *buf, &v.to_json()),
                            }
                            .expect("writing to memory");
                        }
                        buf.extend_from_slice(b"}\n");
                    }
                }
                *header_done = true;
            }
        }
        if self.plan.limit.is_some_and(|l| self.rows_out >= l) {
            self.done = true;
        }
        Ok(())
    }

    fn emit_groups(&mut self) -> Result<(), ComputeError> {
        let g = self.plan.group.clone().expect("grouped");
        let keys = std::mem::take(&mut self.groups.keys);
        let accs = std::mem::take(&mut self.groups.accs);
        for (k, a) in keys.into_iter().zip(accs) {
            let copies = a.iter().map(|a| if let Acc::Min(v) | Acc::Max(v) = a { v.owned_footprint() } else { 0 }).sum();
            self.work.make(copies, "a group's MIN and MAX").map_err(|e| self.fail(e))?;
            let aggs = a.iter().map(Acc::value).collect::<Result<Vec<_>, _>>().map_err(|e| self.data_err(e))?;
            let scope = Scope { cols: &[], keys: &k, aggs: &aggs, outputs: &[] };
            let r = self.group_row(&g, &scope);
            self.work.record_done();
            r?;
            if self.done {
                break;
            }
        }
        Ok(())
    }

    /// A group through HAVING into the output.
    fn group_row(&mut self, g: &plan::Group, scope: &Scope) -> Result<(), ComputeError> {
        if let Some(h) = &g.having {
            if self.plan.eval(h, scope, &mut self.work).and_then(|v| Ok(v.truth()?)).map_err(|e| self.fail(e))? != Some(true) {
                return Ok(());
            }
        }
        self.output_row(scope)
    }

    fn emit_held(&mut self) -> Result<(), ComputeError> {
        let mut held = std::mem::take(&mut self.held);
        let order = self.plan.order.clone();
        // A stable sort takes scratch room of up to one entry per row.
        let scratch = held.len() * std::mem::size_of::<(Vec<Value>, Vec<Value>)>();
        self.work.account.charge(scratch, || format!("sorting {} rows for ORDER BY", held.len()))?;
        // Stable: rows equal in every key keep their input order.
        held.sort_by(|(a, _), (b, _)| {
            for (k, (x, y)) in order.iter().zip(a.iter().zip(b)) {
                let o = match (x.is_null(), y.is_null()) {
                    (true, true) => std::cmp::Ordering::Equal,
                    (true, false) => {
                        if k.nulls_first {
                            std::cmp::Ordering::Less
                        } else {
                            std::cmp::Ordering::Greater
                        }
                    }
                    (false, true) => {
                        if k.nulls_first {
                            std::cmp::Ordering::Greater
                        } else {
                            std::cmp::Ordering::Less
                        }
                    }
                    _ => {
                        let o = value::order(x, y);
                        if k.desc {
                            o.reverse()
                        } else {
                            o
                        }
                    }
                };
                if o.is_ne() {
                    return o;
                }
            }
            std::cmp::Ordering::Equal
        });
        self.work.account.release(scratch);
        for (_, row) in held {
            self.emit(&row)?;
            if self.done {
                break;
            }
        }
        Ok(())
    }

    /// Output bytes ready to be written (output objects only).
    fn take_output(&mut self, at_least: usize) -> Option<Vec<u8>> {
        match &mut self.out {
            Out::Object { buf, written, .. } if !buf.is_empty() && buf.len() >= at_least => {
                *written += buf.len() as u64;
                self.work.account.release(self.out_charged);
                self.out_charged = 0;
                Some(std::mem::take(buf))
            }
            _ => None,
        }
    }

    fn outcome(self) -> Outcome {
        let (rows, output) = match self.out {
            Out::Inline { rows, .. } => (rows, 0),
            Out::Object { written, .. } => (Vec::new(), written),
        };
        Outcome::Select { columns: self.names, rows, records: self.records, matched: self.matched, rows_out: self.rows_out, output }
    }
}

/// Makes room for one more element, charging the larger buffer before it is allocated
/// (while the old one is copied both exist) and giving the old one back after.
fn grow<T>(account: &mut Account, v: &mut Vec<T>, what: impl FnOnce() -> String) -> Result<(), ComputeError> {
    if v.len() < v.capacity() {
        return Ok(());
    }
    let (old, new) = (v.capacity(), (2 * v.capacity()).max(16));
    account.charge(new * std::mem::size_of::<T>(), what)?;
    v.reserve_exact(new - v.len());
    account.release(old * std::mem::size_of::<T>());
    Ok(())
}

/// As [`grow`], for the groups' hash index (hashbrown: buckets a power of two at least
/// 8/7 of the capacity, each an entry and a control byte).
fn grow_index<K, V, S: BuildHasher>(
    account: &mut Account,
    m: &mut HashMap<K, V, S>,
    what: impl FnOnce() -> String,
) -> Result<(), ComputeError>
where
    K: Eq + std::hash::Hash,
{
    if m.len() < m.capacity() {
        return Ok(());
    }
    let bytes = |cap: usize| if cap == 0 { 0 } else { (cap * 8 / 7).next_power_of_two() * (std::mem::size_of::<(K, V)>() + 1) + 16 };
    let (old, new) = (m.capacity(), (2 * m.capacity()).max(16));
    account.charge(bytes(new), what)?;
    m.reserve(new - m.len());
    account.release(bytes(old));
    Ok(())
}

fn field<'r>(rec: &'r [u8], ends: &[usize], i: usize) -> &'r [u8] {
    let start = if i == 0 { 0 } else { ends[i - 1] };
    &rec[start..ends[i]]
}

/// A JSON column: its key, then the keys of its path, each by the identifier rule (a key
/// matching two of an object's keys is an error naming both); a missing one is NULL.
fn json_lookup<'v>(m: &'v serde_json::Map<String, serde_json::Value>, r: &plan::ColRef) -> Result<Value<'v>, String> {
    let get = |m: &'v serde_json::Map<String, serde_json::Value>, k: &str, quoted: bool| {
        if quoted {
            return Ok(m.get(k));
        }
        let mut hits = m.iter().filter(|(n, _)| n.eq_ignore_ascii_case(k));
        match (hits.next(), hits.next()) {
            (Some((a, _)), Some((b, _))) => Err(format!("the column {k:?} matches the keys {a:?} and {b:?}")),
            (first, _) => Ok(first.map(|(_, v)| v)),
        }
    };
    let Some(mut v) = get(m, &r.name, r.quoted)? else { return Ok(Value::Null) };
    for (p, quoted) in &r.path {
        match v {
            serde_json::Value::Object(o) => match get(o, p, *quoted)? {
                Some(x) => v = x,
                None => return Ok(Value::Null),
            },
            _ => return Ok(Value::Null),
        }
    }
    Ok(Value::from_json(v))
}

/// The CSV output's first line: the column names.
fn write_header(buf: &mut Vec<u8>, names: &[String], args: &Args) {
    let names: Vec<Value> = names.iter().map(|n| Value::Text(Cow::Borrowed(n))).collect();
    write_csv(buf, &names, args.delimiter as u8, args.quote as u8);
}

/// One CSV row: fields with the delimiter, the quote or a line end are quoted, quotes
/// doubled; NULL is an empty field.
fn write_csv(buf: &mut Vec<u8>, row: &[Value], delim: u8, quote: u8) {
    for (i, v) in row.iter().enumerate() {
        if i > 0 {
            buf.push(delim);
        }
        let t = v.text();
        let b = t.as_bytes();
        if b.iter().any(|&c| c == delim || c == quote || c == b'\n' || c == b'\r') || (b.is_empty() && matches!(v, Value::Text(_))) {
            buf.push(quote);
            for &c in b {
                if c == quote {
                    buf.push(quote);
                }
                buf.push(c);
            }
            buf.push(quote);
        } else {
            buf.extend_from_slice(b);
        }
    }
    buf.push(b'\n');
}

/// Per input, rows inline.
struct Inline {
    engine: Engine,
    error: Option<ComputeError>,
}

impl Kernel for Inline {
    fn update(&mut self, data: &[u8]) {
        if self.error.is_none() {
            if let Err(e) = self.engine.feed(data) {
                self.error = Some(e);
            }
        }
    }
    fn wants_more(&self) -> bool {
        self.error.is_none() && !self.engine.done
    }
    fn finish(mut self: Box<Self>) -> Result<Outcome, ComputeError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.engine.end()?;
        Ok(self.engine.outcome())
    }
}

/// One input into an output object.
struct ToObject {
    args: Args,
}

impl Transform for ToObject {
    fn run(self: Box<Self>, inputs: &mut [&mut dyn Source], outputs: &mut [&mut dyn Sink], ctx: &Context) -> Result<Outcome, ComputeError> {
        let mut e = Engine::new(self.args, ctx, false)?;
        let (src, out) = (&mut *inputs[0], &mut *outputs[0]);
        while let Some(c) = src.next_chunk()? {
            e.feed(c)?;
            if let Some(b) = e.take_output(WRITE_CHUNK) {
                out.write(&b)?;
            }
            if e.done {
                break;
            }
        }
        e.end()?;
        if let Some(b) = e.take_output(1) {
            out.write(&b)?;
        }
        Ok(e.outcome())
    }
}

fn args(raw: &[u8]) -> Result<Args, ComputeError> {
    let a: Args = parse_args(OP, raw)?;
    a.check()?;
    Ok(a)
}

pub fn stream(raw: &[u8], ctx: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    Ok(Box::new(Inline { engine: Engine::new(args(raw)?, ctx, true)?, error: None }))
}

pub fn transform(raw: &[u8]) -> Result<Box<dyn Transform>, ComputeError> {
    Ok(Box::new(ToObject { args: args(raw)? }))
}
