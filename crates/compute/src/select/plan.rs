//! From SQL text to a plan: parsed by `sqlparser`, then checked and compiled into a small
//! expression tree over the columns the query names. Everything the engine cannot do is
//! refused here, by name, before a byte of the object is read.

use std::borrow::Cow;
use std::cmp::Ordering;

use sqlparser::ast;
use sqlparser::dialect::GenericDialect;
use sqlparser::parser::Parser;

use super::like::{self, Like};
use super::value::{self, Arith, SqlType, Value};
use crate::{Account, ComputeError, Context, Meter};

/// Expressions nest at most this deep (the parser's own limit covers its recursion, not
/// long chains such as `a+a+a+...`, which we evaluate recursively).
pub const DEPTH_MAX: usize = 64;
/// A query is at most this long (it travels in the descriptor's arguments anyway).
pub const QUERY_BYTES_MAX: usize = 8 << 10;

/// A column the query names. CSV columns bind to a field index once the header (or the
/// first record) is read; JSON columns are looked up by name in each record.
#[derive(Clone, Debug, PartialEq)]
pub struct ColRef {
    pub name: String,
    /// A quoted identifier matches a header name exactly; an unquoted one ignoring case.
    pub quoted: bool,
    /// JSON only: the keys below `name` (`s.address.city`), each with whether it was
    /// quoted.
    pub path: Vec<(String, bool)>,
    /// `_1`, `_2`, ...: the field's position (S3 Select's names for CSV columns).
    pub position: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Func {
    Lower,
    Upper,
    Length,
    Abs,
    Coalesce,
    NullIf,
    Substring,
    Trim { leading: bool, trailing: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    Lit(Value<'static>),
    /// A column: index into [`Plan::refs`].
    Col(usize),
    /// After grouping: a GROUP BY key, an aggregate's value.
    Key(usize),
    Agg(usize),
    /// ORDER BY an output column (by alias or position).
    Output(usize),
    Neg(Box<Expr>),
    Not(Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Cmp(Cmp, Box<Expr>, Box<Expr>),
    Arith(Arith, Box<Expr>, Box<Expr>),
    Concat(Box<Expr>, Box<Expr>),
    IsNull(Box<Expr>, bool),
    /// IS [NOT] TRUE / FALSE: never NULL.
    IsBool {
        expr: Box<Expr>,
        value: bool,
        negated: bool,
    },
    IsDistinct {
        a: Box<Expr>,
        b: Box<Expr>,
        negated: bool,
    },
    Like {
        expr: Box<Expr>,
        pattern: Box<Expr>,
        escape: Option<char>,
        negated: bool,
        ci: bool,
        /// The compiled pattern when it is a literal: index into [`Plan::likes`].
        like: Option<usize>,
    },
    In {
        expr: Box<Expr>,
        list: Vec<Expr>,
        negated: bool,
    },
    Between {
        expr: Box<Expr>,
        low: Box<Expr>,
        high: Box<Expr>,
        negated: bool,
    },
    Cast(Box<Expr>, SqlType),
    Case {
        operand: Option<Box<Expr>>,
        whens: Vec<(Expr, Expr)>,
        otherwise: Option<Box<Expr>>,
    },
    Func(Func, Vec<Expr>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AggFunc {
    Count,
    Sum,
    Avg,
    Min,
    Max,
}

/// One aggregate: its function and its argument (None for COUNT(*)).
#[derive(Clone, Debug, PartialEq)]
pub struct AggSpec {
    pub func: AggFunc,
    pub arg: Option<Expr>,
}

#[derive(Clone, Debug)]
pub enum Item {
    Expr {
        expr: Expr,
        name: String,
    },
    /// `*`: every column, known once the header or first record is read.
    Star,
}

#[derive(Clone, Debug)]
pub struct Group {
    pub keys: Vec<Expr>,
    pub aggs: Vec<AggSpec>,
    pub having: Option<Expr>,
}

#[derive(Clone, Debug)]
pub struct OrderKey {
    pub expr: Expr,
    pub desc: bool,
    pub nulls_first: bool,
}

/// A checked query.
#[derive(Clone, Debug)]
pub struct Plan {
    pub refs: Vec<ColRef>,
    pub items: Vec<Item>,
    pub filter: Option<Expr>,
    /// Some for a query with aggregates or GROUP BY: its items, HAVING and ORDER BY are
    /// over the keys and aggregates.
    pub group: Option<Group>,
    pub order: Vec<OrderKey>,
    pub limit: Option<u64>,
    pub offset: u64,
    pub likes: Vec<Like>,
}

/// What an expression is evaluated over.
pub struct Scope<'s, 'a> {
    pub cols: &'s [Value<'a>],
    pub keys: &'s [Value<'a>],
    pub aggs: &'s [Value<'a>],
    pub outputs: &'s [Value<'a>],
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Over one record's columns.
    Row,
    /// Over a group's keys and aggregates.
    Post,
}

pub fn parse(sql: &str) -> Result<Plan, String> {
    if sql.len() > QUERY_BYTES_MAX {
        return Err(format!("the query is {} bytes, more than {QUERY_BYTES_MAX}", sql.len()));
    }
    let stmts = Parser::new(&GenericDialect {})
        .with_recursion_limit(DEPTH_MAX)
        .try_with_sql(sql)
        .and_then(|mut p| p.parse_statements())
        .map_err(|e| e.to_string())?;
    let [ast::Statement::Query(q)] = &stmts[..] else {
        return Err(format!("expected one SELECT statement, got {}", stmts.len()));
    };
    Compiler::default().query(q)
}

#[derive(Default)]
struct Compiler {
    refs: Vec<ColRef>,
    likes: Vec<Like>,
    /// Names the FROM clause gives the object (its name and alias), lowercase.
    qualifiers: Vec<String>,
    keys: Vec<Expr>,
    aggs: Vec<AggSpec>,
}

fn unsupported(what: &str) -> String {
    format!("{what} is not supported")
}

impl Compiler {
    fn query(mut self, q: &ast::Query) -> Result<Plan, String> {
        if q.with.is_some() {
            return Err(unsupported("WITH"));
        }
        if q.fetch.is_some() || !q.locks.is_empty() || q.for_clause.is_some() || q.settings.is_some() || q.format_clause.is_some() {
            return Err(unsupported("FETCH, FOR, SETTINGS or FORMAT"));
        }
        if !q.pipe_operators.is_empty() {
            return Err(unsupported("a pipe operator"));
        }
        let ast::SetExpr::Select(s) = q.body.as_ref() else {
            return Err(unsupported("UNION, INTERSECT, EXCEPT, VALUES or a nested query"));
        };
        self.check_select(s)?;
        if s.projection.is_empty() {
            return Err("SELECT names nothing to return".into());
        }
        let grouped = match &s.group_by {
            ast::GroupByExpr::All(_) => return Err(unsupported("GROUP BY ALL")),
            ast::GroupByExpr::Expressions(keys, mods) => {
                if !mods.is_empty() {
                    return Err(unsupported("ROLLUP, CUBE or GROUPING SETS"));
                }
                for k in keys {
                    // GROUP BY 2: the second SELECT item.
                    let k = match k {
                        ast::Expr::Value(ast::ValueWithSpan { value: ast::Value::Number(n, _), .. }) => {
                            let at = n.parse::<usize>().ok().filter(|i| *i >= 1 && *i <= s.projection.len());
                            match at.map(|i| &s.projection[i - 1]) {
                                Some(ast::SelectItem::UnnamedExpr(e) | ast::SelectItem::ExprWithAlias { expr: e, .. }) => e,
                                _ => return Err(format!("GROUP BY {n}: not the position of a SELECT expression")),
                            }
                        }
                        k => k,
                    };
                    let k = self.expr(k, Mode::Row, 0)?;
                    self.keys.push(k);
                }
                !keys.is_empty()
            }
        };
        let aggregate = grouped
            || s.having.is_some()
            || s.projection.iter().any(|i| match i {
                ast::SelectItem::UnnamedExpr(e) | ast::SelectItem::ExprWithAlias { expr: e, .. } => has_aggregate(e),
                _ => false,
            });
        let mode = if aggregate { Mode::Post } else { Mode::Row };
        let filter = s.selection.as_ref().map(|e| self.expr(e, Mode::Row, 0)).transpose()?;
        let mut items = Vec::new();
        for item in &s.projection {
            items.push(match item {
                ast::SelectItem::UnnamedExpr(e) => Item::Expr { expr: self.expr(e, mode, 0)?, name: column_name(e) },
                ast::SelectItem::ExprWithAlias { expr, alias } => Item::Expr { expr: self.expr(expr, mode, 0)?, name: alias.value.clone() },
                ast::SelectItem::Wildcard(o) | ast::SelectItem::QualifiedWildcard(_, o) => {
                    if o.opt_ilike.is_some()
                        || o.opt_exclude.is_some()
                        || o.opt_except.is_some()
                        || o.opt_replace.is_some()
                        || o.opt_rename.is_some()
                    {
                        return Err(unsupported("a wildcard with options"));
                    }
                    if aggregate {
                        return Err("SELECT * cannot be used with aggregates or GROUP BY".into());
                    }
                    Item::Star
                }
                _ => return Err(unsupported("this SELECT item")),
            });
        }
        let having = s.having.as_ref().map(|e| self.expr(e, Mode::Post, 0)).transpose()?;
        let mut order = Vec::new();
        if let Some(ob) = &q.order_by {
            if ob.interpolate.is_some() {
                return Err(unsupported("INTERPOLATE"));
            }
            let ast::OrderByKind::Expressions(keys) = &ob.kind else { return Err(unsupported("ORDER BY ALL")) };
            for k in keys {
                if k.with_fill.is_some() {
                    return Err(unsupported("WITH FILL"));
                }
                let desc = match k.options.sort {
                    None | Some(ast::OrderBySort::Asc) => false,
                    Some(ast::OrderBySort::Desc) => true,
                    Some(_) => return Err(unsupported("ORDER BY ... USING")),
                };
                let expr = match self.output_ref(&k.expr, &items)? {
                    Some(i) => Expr::Output(i),
                    None => self.expr(&k.expr, mode, 0)?,
                };
                // SQLite's default: NULLs sort first ascending, last descending.
                order.push(OrderKey { expr, desc, nulls_first: k.options.nulls_first.unwrap_or(!desc) });
            }
        }
        let (limit, offset) = match &q.limit_clause {
            None => (None, 0),
            Some(ast::LimitClause::LimitOffset { limit, offset, limit_by }) => {
                if !limit_by.is_empty() {
                    return Err(unsupported("LIMIT BY"));
                }
                (
                    limit.as_ref().map(|e| count(e, "LIMIT")).transpose()?,
                    offset.as_ref().map(|o| count(&o.value, "OFFSET")).transpose()?.unwrap_or(0),
                )
            }
            Some(ast::LimitClause::OffsetCommaLimit { offset, limit }) => (Some(count(limit, "LIMIT")?), count(offset, "OFFSET")?),
        };
        let group = aggregate.then(|| Group { keys: std::mem::take(&mut self.keys), aggs: std::mem::take(&mut self.aggs), having });
        Ok(Plan { refs: self.refs, items, filter, group, order, limit, offset, likes: self.likes })
    }

    fn check_select(&mut self, s: &ast::Select) -> Result<(), String> {
        if s.distinct.is_some() {
            return Err(unsupported("SELECT DISTINCT (use GROUP BY)"));
        }
        if s.top.is_some() || s.into.is_some() || s.select_modifiers.is_some() || !s.optimizer_hints.is_empty() {
            return Err(unsupported("TOP, INTO or a SELECT modifier"));
        }
        if !s.lateral_views.is_empty() || s.prewhere.is_some() || !s.connect_by.is_empty() || s.qualify.is_some() {
            return Err(unsupported("LATERAL VIEW, PREWHERE, CONNECT BY or QUALIFY"));
        }
        if !s.cluster_by.is_empty() || !s.distribute_by.is_empty() || !s.sort_by.is_empty() || !s.named_window.is_empty() {
            return Err(unsupported("CLUSTER BY, DISTRIBUTE BY, SORT BY or WINDOW"));
        }
        if s.exclude.is_some() || s.value_table_mode.is_some() {
            return Err(unsupported("EXCLUDE or AS VALUE"));
        }
        let [from] = &s.from[..] else {
            return Err(format!("FROM must name the one object, not {} tables", s.from.len()));
        };
        if !from.joins.is_empty() {
            return Err(unsupported("JOIN"));
        }
        let ast::TableFactor::Table {
            name,
            alias,
            args: None,
            with_hints,
            version: None,
            partitions,
            json_path: None,
            sample: None,
            index_hints,
            ..
        } = &from.relation
        else {
            return Err("FROM must name the object (FROM s3object s, FROM t, ...), not a subquery or function".into());
        };
        if !with_hints.is_empty() || !partitions.is_empty() || !index_hints.is_empty() {
            return Err(unsupported("table hints or partitions"));
        }
        if let Some(ast::ObjectNamePart::Identifier(i)) = name.0.last() {
            self.qualifiers.push(i.value.to_lowercase());
        }
        if let Some(a) = alias {
            if !a.columns.is_empty() {
                return Err(unsupported("column aliases on FROM"));
            }
            self.qualifiers.push(a.name.value.to_lowercase());
        }
        Ok(())
    }

    /// ORDER BY a SELECT alias or a position.
    fn output_ref(&self, e: &ast::Expr, items: &[Item]) -> Result<Option<usize>, String> {
        match e {
            ast::Expr::Identifier(id) => {
                let quoted = id.quote_style.is_some();
                let hits: Vec<(usize, &String)> = items
                    .iter()
                    .enumerate()
                    .filter_map(|(at, i)| match i {
                        Item::Expr { name, .. } if name_matches(&id.value, quoted, name) => Some((at, name)),
                        _ => None,
                    })
                    .collect();
                // Two outputs spelled differently that both match: ambiguous (outputs of
                // one name are one column, the first).
                match hits.first() {
                    Some((_, a)) => match hits.iter().find(|(_, n)| n != a) {
                        Some((_, b)) => Err(format!("ORDER BY {id}: matches the output columns {a:?} and {b:?}")),
                        None => Ok(Some(hits[0].0)),
                    },
                    None => Ok(None),
                }
            }
            ast::Expr::Value(v) => match &v.value {
                ast::Value::Number(n, _) => {
                    let k: usize = n.parse().map_err(|_| format!("ORDER BY {n}: not a column position"))?;
                    if items.iter().any(|i| matches!(i, Item::Star)) {
                        return Err("ORDER BY a position cannot be used with SELECT *".into());
                    }
                    if k == 0 || k > items.len() {
                        return Err(format!("ORDER BY {k}: there are {} output columns", items.len()));
                    }
                    Ok(Some(k - 1))
                }
                _ => Ok(None),
            },
            _ => Ok(None),
        }
    }

    fn column(&mut self, parts: &[ast::Ident]) -> Result<Expr, String> {
        let parts = match parts {
            [q, rest @ ..] if !rest.is_empty() && self.qualifiers.contains(&q.value.to_lowercase()) => rest,
            p => p,
        };
        let first = &parts[0];
        let position = first
            .value
            .strip_prefix('_')
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|n| *n >= 1 && first.quote_style.is_none() && parts.len() == 1)
            .map(|n| n - 1);
        let r = ColRef {
            name: first.value.clone(),
            quoted: first.quote_style.is_some(),
            path: parts[1..].iter().map(|p| (p.value.clone(), p.quote_style.is_some())).collect(),
            position,
        };
        // Spellings of one column (`carrier`, `CARRIER`, `"carrier"`) are one expression,
        // so that GROUP BY keys, HAVING and ORDER BY recognise each other. Each spelling
        // is still bound on its own, so that one naming no field, or two, is refused.
        let same = self.refs.iter().position(|x| same_column(x, &r));
        if !self.refs.contains(&r) {
            self.refs.push(r);
        }
        Ok(Expr::Col(same.unwrap_or(self.refs.len() - 1)))
    }

    fn expr(&mut self, e: &ast::Expr, mode: Mode, depth: usize) -> Result<Expr, String> {
        use ast::Expr as A;
        if depth > DEPTH_MAX {
            return Err(format!("the expression nests deeper than {DEPTH_MAX}"));
        }
        // After grouping, a whole GROUP BY expression is a key.
        if mode == Mode::Post && !self.keys.is_empty() && !has_aggregate(e) {
            if let Ok(r) = self.expr(e, Mode::Row, depth) {
                if let Some(i) = self.keys.iter().position(|k| *k == r) {
                    return Ok(Expr::Key(i));
                }
            }
        }
        let d = depth + 1;
        let sub = |c: &mut Compiler, e: &ast::Expr| c.expr(e, mode, d).map(Box::new);
        Ok(match e {
            A::Identifier(id) => {
                if mode == Mode::Post {
                    return Err(not_grouped(e));
                }
                self.column(std::slice::from_ref(id))?
            }
            A::CompoundIdentifier(ids) => {
                if mode == Mode::Post {
                    return Err(not_grouped(e));
                }
                self.column(ids)?
            }
            A::Value(v) => Expr::Lit(literal(&v.value)?),
            A::Nested(e) => return self.expr(e, mode, d),
            A::UnaryOp { op, expr } => match op {
                ast::UnaryOperator::Not => Expr::Not(sub(self, expr)?),
                ast::UnaryOperator::Minus => Expr::Neg(sub(self, expr)?),
                ast::UnaryOperator::Plus => return self.expr(expr, mode, d),
                op => return Err(unsupported(&format!("the operator {op}"))),
            },
            A::BinaryOp { left, op, right } => {
                use ast::BinaryOperator as B;
                let (l, r) = (sub(self, left)?, sub(self, right)?);
                match op {
                    B::Plus => Expr::Arith(Arith::Add, l, r),
                    B::Minus => Expr::Arith(Arith::Sub, l, r),
                    B::Multiply => Expr::Arith(Arith::Mul, l, r),
                    B::Divide => Expr::Arith(Arith::Div, l, r),
                    B::Modulo => Expr::Arith(Arith::Rem, l, r),
                    B::StringConcat => Expr::Concat(l, r),
                    B::Eq => Expr::Cmp(Cmp::Eq, l, r),
                    B::NotEq => Expr::Cmp(Cmp::Ne, l, r),
                    B::Lt => Expr::Cmp(Cmp::Lt, l, r),
                    B::LtEq => Expr::Cmp(Cmp::Le, l, r),
                    B::Gt => Expr::Cmp(Cmp::Gt, l, r),
                    B::GtEq => Expr::Cmp(Cmp::Ge, l, r),
                    B::And => Expr::And(l, r),
                    B::Or => Expr::Or(l, r),
                    op => return Err(unsupported(&format!("the operator {op}"))),
                }
            }
            A::IsNull(e) => Expr::IsNull(sub(self, e)?, false),
            A::IsNotNull(e) => Expr::IsNull(sub(self, e)?, true),
            A::IsTrue(e) => Expr::IsBool { expr: sub(self, e)?, value: true, negated: false },
            A::IsNotTrue(e) => Expr::IsBool { expr: sub(self, e)?, value: true, negated: true },
            A::IsFalse(e) => Expr::IsBool { expr: sub(self, e)?, value: false, negated: false },
            A::IsNotFalse(e) => Expr::IsBool { expr: sub(self, e)?, value: false, negated: true },
            A::IsDistinctFrom(a, b) => Expr::IsDistinct { a: sub(self, a)?, b: sub(self, b)?, negated: false },
            A::IsNotDistinctFrom(a, b) => Expr::IsDistinct { a: sub(self, a)?, b: sub(self, b)?, negated: true },
            A::Like { negated, any, expr, pattern, escape_char } | A::ILike { negated, any, expr, pattern, escape_char } => {
                if *any {
                    return Err(unsupported("LIKE ANY"));
                }
                let ci = matches!(e, A::ILike { .. });
                let escape = match escape_char.as_deref() {
                    None => None,
                    Some(A::Value(v)) => match &v.value {
                        ast::Value::SingleQuotedString(s) if s.chars().count() == 1 => s.chars().next(),
                        _ => return Err("ESCAPE takes one character in quotes".into()),
                    },
                    Some(_) => return Err("ESCAPE takes one character in quotes".into()),
                };
                let pattern = sub(self, pattern)?;
                let like = match pattern.as_ref() {
                    Expr::Lit(Value::Text(p)) => {
                        self.likes.push(Like::new(p, escape, ci, like::TABLE_BYTES_MAX)?);
                        Some(self.likes.len() - 1)
                    }
                    _ => None,
                };
                Expr::Like { expr: sub(self, expr)?, pattern, escape, negated: *negated, ci, like }
            }
            A::InList { expr, list, negated } => Expr::In {
                expr: sub(self, expr)?,
                list: list.iter().map(|x| self.expr(x, mode, d)).collect::<Result<_, _>>()?,
                negated: *negated,
            },
            A::Between { expr, negated, low, high } => {
                Expr::Between { expr: sub(self, expr)?, low: sub(self, low)?, high: sub(self, high)?, negated: *negated }
            }
            A::Cast { kind, expr, data_type, format } => {
                if format.is_some() || !matches!(kind, ast::CastKind::Cast | ast::CastKind::DoubleColon) {
                    return Err(unsupported("TRY_CAST, SAFE_CAST or CAST ... FORMAT"));
                }
                Expr::Cast(sub(self, expr)?, sql_type(data_type)?)
            }
            A::Case { operand, conditions, else_result, .. } => Expr::Case {
                operand: operand.as_deref().map(|o| sub(self, o)).transpose()?,
                whens: conditions
                    .iter()
                    .map(|w| Ok((self.expr(&w.condition, mode, d)?, self.expr(&w.result, mode, d)?)))
                    .collect::<Result<_, String>>()?,
                otherwise: else_result.as_deref().map(|o| sub(self, o)).transpose()?,
            },
            A::Substring { expr, substring_from, substring_for, .. } => {
                let mut args = vec![self.expr(expr, mode, d)?];
                args.push(match substring_from {
                    Some(f) => self.expr(f, mode, d)?,
                    None => Expr::Lit(Value::Int(1)),
                });
                if let Some(f) = substring_for {
                    args.push(self.expr(f, mode, d)?);
                }
                Expr::Func(Func::Substring, args)
            }
            A::Trim { trim_where, trim_what, expr, trim_characters } => {
                if trim_characters.is_some() {
                    return Err(unsupported("TRIM with a list of characters"));
                }
                let (leading, trailing) = match trim_where {
                    None | Some(ast::TrimWhereField::Both) => (true, true),
                    Some(ast::TrimWhereField::Leading) => (true, false),
                    Some(ast::TrimWhereField::Trailing) => (false, true),
                };
                let mut args = vec![self.expr(expr, mode, d)?];
                if let Some(w) = trim_what {
                    args.push(self.expr(w, mode, d)?);
                }
                Expr::Func(Func::Trim { leading, trailing }, args)
            }
            A::Function(f) => return self.function(f, mode, d),
            other => return Err(unsupported(&format!("the expression {other}"))),
        })
    }

    fn function(&mut self, f: &ast::Function, mode: Mode, d: usize) -> Result<Expr, String> {
        let name = f.name.to_string().to_uppercase();
        if f.over.is_some() || f.filter.is_some() || f.null_treatment.is_some() || !f.within_group.is_empty() || f.uses_odbc_syntax {
            return Err(unsupported(&format!("{name} with OVER, FILTER or WITHIN GROUP")));
        }
        if !matches!(f.parameters, ast::FunctionArguments::None) {
            return Err(unsupported(&format!("parameters of {name}")));
        }
        let list = match &f.args {
            ast::FunctionArguments::None => Vec::new(),
            ast::FunctionArguments::Subquery(_) => return Err(unsupported("a subquery")),
            ast::FunctionArguments::List(l) => {
                if !l.clauses.is_empty() {
                    return Err(unsupported(&format!("clauses in {name}()")));
                }
                if matches!(l.duplicate_treatment, Some(ast::DuplicateTreatment::Distinct)) {
                    return Err(unsupported(&format!("{name}(DISTINCT ...)")));
                }
                l.args.iter().collect()
            }
        };
        let agg = match name.as_str() {
            "COUNT" => Some(AggFunc::Count),
            "SUM" => Some(AggFunc::Sum),
            "AVG" => Some(AggFunc::Avg),
            "MIN" => Some(AggFunc::Min),
            "MAX" => Some(AggFunc::Max),
            _ => None,
        };
        if let Some(func) = agg {
            if mode == Mode::Row {
                return Err(format!("the aggregate {name} cannot be used in WHERE, GROUP BY or inside another aggregate"));
            }
            let arg = match &list[..] {
                [ast::FunctionArg::Unnamed(ast::FunctionArgExpr::Wildcard)] if func == AggFunc::Count => None,
                [ast::FunctionArg::Unnamed(ast::FunctionArgExpr::Expr(e))] => Some(self.expr(e, Mode::Row, d)?),
                _ => return Err(format!("{name} takes one argument{}", if func == AggFunc::Count { " or *" } else { "" })),
            };
            let spec = AggSpec { func, arg };
            let i = match self.aggs.iter().position(|a| *a == spec) {
                Some(i) => i,
                None => {
                    self.aggs.push(spec);
                    self.aggs.len() - 1
                }
            };
            return Ok(Expr::Agg(i));
        }
        let mut args = Vec::new();
        for a in &list {
            match a {
                ast::FunctionArg::Unnamed(ast::FunctionArgExpr::Expr(e)) => args.push(self.expr(e, mode, d)?),
                _ => return Err(format!("{name}: only plain arguments are supported")),
            }
        }
        let (func, lo, hi) = match name.as_str() {
            "LOWER" | "LCASE" => (Func::Lower, 1, 1),
            "UPPER" | "UCASE" => (Func::Upper, 1, 1),
            "LENGTH" | "CHAR_LENGTH" | "CHARACTER_LENGTH" => (Func::Length, 1, 1),
            "ABS" => (Func::Abs, 1, 1),
            "COALESCE" => (Func::Coalesce, 1, usize::MAX),
            "NULLIF" => (Func::NullIf, 2, 2),
            "SUBSTR" | "SUBSTRING" => (Func::Substring, 2, 3),
            "TRIM" => (Func::Trim { leading: true, trailing: true }, 1, 1),
            "LTRIM" => (Func::Trim { leading: true, trailing: false }, 1, 1),
            "RTRIM" => (Func::Trim { leading: false, trailing: true }, 1, 1),
            _ => return Err(format!("unknown function {name}")),
        };
        if args.len() < lo || args.len() > hi {
            return Err(format!(
                "{name} takes {} arguments, not {}",
                if lo == hi { lo.to_string() } else { format!("{lo} or more") },
                args.len()
            ));
        }
        Ok(Expr::Func(func, args))
    }
}

/// Whether a name matches another by the identifier rule: an unquoted name ignoring
/// (ASCII) case, a quoted one exactly.
pub fn name_matches(name: &str, quoted: bool, other: &str) -> bool {
    if quoted {
        name == other
    } else {
        name.eq_ignore_ascii_case(other)
    }
}

/// Whether two references name the same field whenever both name exactly one: two
/// quoted names if equal, otherwise if equal ignoring case (an unquoted name matches
/// one field ignoring case, so a quoted name matching that field is the same field).
fn same_column(a: &ColRef, b: &ColRef) -> bool {
    let same = |x: &str, xq: bool, y: &str, yq: bool| if xq && yq { x == y } else { x.eq_ignore_ascii_case(y) };
    a.position == b.position
        && same(&a.name, a.quoted, &b.name, b.quoted)
        && a.path.len() == b.path.len()
        && a.path.iter().zip(&b.path).all(|((x, xq), (y, yq))| same(x, *xq, y, *yq))
}

fn not_grouped(e: &ast::Expr) -> String {
    format!("the column {e} must appear in GROUP BY or be used in an aggregate")
}

/// The name of an output column: its alias, else the column's name, else the expression
/// as written (as SQLite names it).
fn column_name(e: &ast::Expr) -> String {
    match e {
        ast::Expr::Identifier(i) => i.value.clone(),
        ast::Expr::CompoundIdentifier(ids) => ids.last().map(|i| i.value.clone()).unwrap_or_default(),
        e => e.to_string(),
    }
}

fn has_aggregate(e: &ast::Expr) -> bool {
    use ast::Expr as A;
    match e {
        A::Function(f) => {
            let n = f.name.to_string().to_uppercase();
            matches!(n.as_str(), "COUNT" | "SUM" | "AVG" | "MIN" | "MAX")
                || match &f.args {
                    ast::FunctionArguments::List(l) => l.args.iter().any(|a| match a {
                        ast::FunctionArg::Unnamed(ast::FunctionArgExpr::Expr(e)) => has_aggregate(e),
                        _ => false,
                    }),
                    _ => false,
                }
        }
        A::Nested(e)
        | A::UnaryOp { expr: e, .. }
        | A::IsNull(e)
        | A::IsNotNull(e)
        | A::IsTrue(e)
        | A::IsNotTrue(e)
        | A::IsFalse(e)
        | A::IsNotFalse(e) => has_aggregate(e),
        A::Cast { expr, .. } => has_aggregate(expr),
        A::BinaryOp { left, right, .. } | A::IsDistinctFrom(left, right) | A::IsNotDistinctFrom(left, right) => {
            has_aggregate(left) || has_aggregate(right)
        }
        A::Like { expr, pattern, .. } | A::ILike { expr, pattern, .. } => has_aggregate(expr) || has_aggregate(pattern),
        A::InList { expr, list, .. } => has_aggregate(expr) || list.iter().any(has_aggregate),
        A::Between { expr, low, high, .. } => has_aggregate(expr) || has_aggregate(low) || has_aggregate(high),
        A::Case { operand, conditions, else_result, .. } => {
            operand.as_deref().is_some_and(has_aggregate)
                || conditions.iter().any(|w| has_aggregate(&w.condition) || has_aggregate(&w.result))
                || else_result.as_deref().is_some_and(has_aggregate)
        }
        A::Substring { expr, substring_from, substring_for, .. } => {
            has_aggregate(expr)
                || substring_from.as_deref().is_some_and(has_aggregate)
                || substring_for.as_deref().is_some_and(has_aggregate)
        }
        A::Trim { expr, trim_what, .. } => has_aggregate(expr) || trim_what.as_deref().is_some_and(has_aggregate),
        _ => false,
    }
}

fn literal(v: &ast::Value) -> Result<Value<'static>, String> {
    Ok(match v {
        ast::Value::Number(n, _) => match n.parse::<i64>() {
            Ok(i) => Value::Int(i),
            Err(_) => Value::Float(n.parse::<f64>().map_err(|_| format!("the number {n}"))?),
        },
        ast::Value::SingleQuotedString(s) => Value::Text(Cow::Owned(s.clone())),
        ast::Value::Boolean(b) => Value::Bool(*b),
        ast::Value::Null => Value::Null,
        other => return Err(unsupported(&format!("the literal {other}"))),
    })
}

fn sql_type(t: &ast::DataType) -> Result<SqlType, String> {
    use ast::DataType as D;
    Ok(match t {
        D::Int(_)
        | D::Integer(_)
        | D::BigInt(_)
        | D::SmallInt(_)
        | D::TinyInt(_)
        | D::Int2(_)
        | D::Int4(_)
        | D::Int8(_)
        | D::Int64
        | D::Signed => SqlType::Int,
        D::Float(_)
        | D::Real
        | D::Double(_)
        | D::DoublePrecision
        | D::Float4
        | D::Float8
        | D::Float64
        | D::Decimal(_)
        | D::Numeric(_)
        | D::Dec(_) => SqlType::Float,
        D::Varchar(_) | D::Char(_) | D::Text | D::String(_) => SqlType::Text,
        D::Bool | D::Boolean => SqlType::Bool,
        other => return Err(unsupported(&format!("CAST to {other}"))),
    })
}

fn count(e: &ast::Expr, what: &str) -> Result<u64, String> {
    match e {
        ast::Expr::Value(v) => match &v.value {
            ast::Value::Number(n, _) => n.parse().map_err(|_| format!("{what} {n}: not a count")),
            _ => Err(format!("{what} takes a number")),
        },
        _ => Err(format!("{what} takes a number")),
    }
}

/// Why an evaluation failed: the data (a message naming the value; the caller adds the
/// record's number), or the command must stop (out of memory, cancelled, out of time).
#[derive(Debug)]
pub enum Fail {
    Data(String),
    Stop(ComputeError),
}

impl From<String> for Fail {
    fn from(m: String) -> Fail {
        Fail::Data(m)
    }
}

/// What evaluation spends: work, counted on the command's meter (so that long work on
/// one record notices cancellation and the deadline), and memory: every string an
/// expression makes is charged to the command's account before it is made, and stays
/// charged until the record (or group) is done ([`Work::record_done`]), a bound on all
/// the strings alive at once.
pub struct Work {
    pub meter: Meter,
    pub account: Account,
    /// Bytes charged for the strings of the record being evaluated.
    made: usize,
}

impl Work {
    pub fn new(op: &'static str, ctx: &Context) -> Work {
        Work { meter: ctx.stop.meter(), account: Account::new(op, ctx), made: 0 }
    }

    /// Charges a string of `bytes` about to be made by `what`.
    pub fn make(&mut self, bytes: usize, what: &str) -> Result<(), Fail> {
        self.meter.work(bytes as u64).map_err(Fail::Stop)?;
        self.account.charge(bytes, || format!("{what} of {bytes} bytes, with the strings made for one record")).map_err(Fail::Stop)?;
        self.made += bytes;
        Ok(())
    }

    /// A value copied: charged if it holds its own text.
    fn copy<'a>(&mut self, v: &Value<'a>) -> Result<Value<'a>, Fail> {
        if let Value::Text(Cow::Owned(t)) = v {
            self.make(t.len(), "a copy of a value")?;
        }
        Ok(v.clone())
    }

    /// The strings made for the last record or group are gone: their bytes are given back.
    pub fn record_done(&mut self) {
        self.account.release(self.made);
        self.made = 0;
    }
}

impl Plan {
    /// Evaluates an expression, counting its work and charging the strings it makes on
    /// `w`.
    pub fn eval<'a>(&self, e: &Expr, s: &Scope<'_, 'a>, w: &mut Work) -> Result<Value<'a>, Fail> {
        w.meter.work(1).map_err(Fail::Stop)?;
        Ok(match e {
            Expr::Lit(v) => w.copy(v)?,
            Expr::Col(i) => w.copy(&s.cols[*i])?,
            Expr::Key(i) => w.copy(&s.keys[*i])?,
            Expr::Agg(i) => w.copy(&s.aggs[*i])?,
            Expr::Output(i) => w.copy(&s.outputs[*i])?,
            Expr::Neg(x) => value::negate(&self.eval(x, s, w)?)?,
            Expr::Not(x) => opt_bool(self.eval(x, s, w)?.truth()?.map(|b| !b)),
            Expr::And(a, b) => {
                let a = self.eval(a, s, w)?.truth()?;
                if a == Some(false) {
                    return Ok(Value::Bool(false));
                }
                match (a, self.eval(b, s, w)?.truth()?) {
                    (_, Some(false)) => Value::Bool(false),
                    (Some(true), Some(true)) => Value::Bool(true),
                    _ => Value::Null,
                }
            }
            Expr::Or(a, b) => {
                let a = self.eval(a, s, w)?.truth()?;
                if a == Some(true) {
                    return Ok(Value::Bool(true));
                }
                match (a, self.eval(b, s, w)?.truth()?) {
                    (_, Some(true)) => Value::Bool(true),
                    (Some(false), Some(false)) => Value::Bool(false),
                    _ => Value::Null,
                }
            }
            Expr::Cmp(op, a, b) => {
                let (a, b) = (self.eval(a, s, w)?, self.eval(b, s, w)?);
                opt_bool(value::compare(&a, &b).map(|o| match op {
                    Cmp::Eq => o == Ordering::Equal,
                    Cmp::Ne => o != Ordering::Equal,
                    Cmp::Lt => o == Ordering::Less,
                    Cmp::Le => o != Ordering::Greater,
                    Cmp::Gt => o == Ordering::Greater,
                    Cmp::Ge => o != Ordering::Less,
                }))
            }
            Expr::Arith(op, a, b) => value::arith(*op, &self.eval(a, s, w)?, &self.eval(b, s, w)?)?,
            Expr::Concat(a, b) => {
                let (a, b) = (self.eval(a, s, w)?, self.eval(b, s, w)?);
                if a.is_null() || b.is_null() {
                    Value::Null
                } else {
                    let (a, b) = (a.text(), b.text());
                    w.make(a.len() + b.len(), "||")?;
                    let mut t = String::with_capacity(a.len() + b.len());
                    t.push_str(&a);
                    t.push_str(&b);
                    Value::Text(Cow::Owned(t))
                }
            }
            Expr::IsNull(x, negated) => Value::Bool(self.eval(x, s, w)?.is_null() != *negated),
            Expr::IsBool { expr, value, negated } => Value::Bool((self.eval(expr, s, w)?.truth()? == Some(*value)) != *negated),
            Expr::IsDistinct { a, b, negated } => {
                let (a, b) = (self.eval(a, s, w)?, self.eval(b, s, w)?);
                Value::Bool(value::same_group(&a, &b) == *negated)
            }
            Expr::Like { expr, pattern, escape, negated, ci, like } => {
                let v = self.eval(expr, s, w)?;
                if v.is_null() {
                    return Ok(Value::Null);
                }
                let t = v.text();
                let m = match like {
                    Some(l) => self.likes[*l].matches(&t, &mut w.meter).map_err(Fail::Stop)?,
                    None => {
                        // A pattern from the data: compiled for this record, its tables
                        // charged first.
                        let p = self.eval(pattern, s, w)?;
                        if p.is_null() {
                            return Ok(Value::Null);
                        }
                        let p = p.text();
                        w.make(like::table_bytes(&p, *escape), "a LIKE pattern's tables")?;
                        Like::new(&p, *escape, *ci, like::TABLE_BYTES_MAX)?.matches(&t, &mut w.meter).map_err(Fail::Stop)?
                    }
                };
                Value::Bool(m != *negated)
            }
            Expr::In { expr, list, negated } => {
                let v = self.eval(expr, s, w)?;
                if v.is_null() {
                    return Ok(Value::Null);
                }
                let mut unknown = false;
                for x in list {
                    match value::compare(&v, &self.eval(x, s, w)?) {
                        Some(Ordering::Equal) => return Ok(Value::Bool(!negated)),
                        None => unknown = true,
                        _ => {}
                    }
                }
                if unknown {
                    Value::Null
                } else {
                    Value::Bool(*negated)
                }
            }
            Expr::Between { expr, low, high, negated } => {
                let v = self.eval(expr, s, w)?;
                let ge = value::compare(&v, &self.eval(low, s, w)?).map(|o| o != Ordering::Less);
                let le = value::compare(&v, &self.eval(high, s, w)?).map(|o| o != Ordering::Greater);
                let r = match (ge, le) {
                    (Some(false), _) | (_, Some(false)) => Some(false),
                    (Some(true), Some(true)) => Some(true),
                    _ => None,
                };
                opt_bool(r.map(|b| b != *negated))
            }
            Expr::Cast(x, t) => value::cast(self.eval(x, s, w)?, *t)?,
            Expr::Case { operand, whens, otherwise } => {
                let op = operand.as_deref().map(|o| self.eval(o, s, w)).transpose()?;
                for (when, r) in whens {
                    let when = self.eval(when, s, w)?;
                    let hit = match &op {
                        Some(o) => value::compare(o, &when) == Some(Ordering::Equal),
                        None => when.truth()? == Some(true),
                    };
                    if hit {
                        return self.eval(r, s, w);
                    }
                }
                match otherwise {
                    Some(o) => self.eval(o, s, w)?,
                    None => Value::Null,
                }
            }
            Expr::Func(f, args) => {
                let mut v = Vec::with_capacity(args.len());
                for a in args {
                    v.push(self.eval(a, s, w)?);
                }
                function(*f, v, w)?
            }
        })
    }
}

fn opt_bool(b: Option<bool>) -> Value<'static> {
    b.map(Value::Bool).unwrap_or(Value::Null)
}

fn int_arg(v: &Value, what: &str) -> Result<i64, String> {
    match value::cast(v.clone(), SqlType::Int) {
        Ok(Value::Int(i)) => Ok(i),
        _ => Err(format!("{what} must be an integer, not {}", v.describe())),
    }
}

fn function<'a>(f: Func, mut args: Vec<Value<'a>>, w: &mut Work) -> Result<Value<'a>, Fail> {
    if f == Func::Coalesce {
        return Ok(args.into_iter().find(|v| !v.is_null()).unwrap_or(Value::Null));
    }
    if f == Func::NullIf {
        let b = args.pop().expect("two arguments");
        let a = args.pop().expect("two arguments");
        return Ok(if value::compare(&a, &b) == Some(Ordering::Equal) { Value::Null } else { a });
    }
    if args.iter().any(Value::is_null) {
        return Ok(Value::Null);
    }
    let owned = |s: String| Value::Text(Cow::Owned(s));
    // Case mappings make at most three bytes of one (U+0390 is 2 bytes, its uppercase 6).
    let len = args[0].text().len();
    Ok(match f {
        Func::Lower => {
            w.make(3 * len, "LOWER")?;
            owned(args[0].text().to_lowercase())
        }
        Func::Upper => {
            w.make(3 * len, "UPPER")?;
            owned(args[0].text().to_uppercase())
        }
        Func::Length => Value::Int(args[0].text().chars().count() as i64),
        Func::Abs => match &args[0] {
            Value::Int(i) => i.checked_abs().map(Value::Int).unwrap_or(Value::Float((*i as f64).abs())),
            Value::Float(x) => Value::Float(x.abs()),
            Value::Bool(b) => Value::Int(*b as i64),
            v => return Err(format!("ABS({}): not a number", v.describe()).into()),
        },
        Func::Substring => {
            // SQL's definition: the characters at positions [start, start + len), of
            // those the string has (positions from 1).
            let start = int_arg(&args[1], "SUBSTRING's start")?;
            let end = match args.get(2) {
                Some(l) => {
                    let l = int_arg(l, "SUBSTRING's length")?;
                    if l < 0 {
                        return Err(format!("SUBSTRING's length is negative ({l})").into());
                    }
                    start.saturating_add(l)
                }
                None => i64::MAX,
            };
            let (from, to) = (start.max(1) as usize - 1, end.max(1) as usize - 1);
            w.make(len, "SUBSTRING")?;
            owned(args[0].text().chars().skip(from).take(to.saturating_sub(from)).collect())
        }
        Func::Trim { leading, trailing } => {
            w.make(len, "TRIM")?;
            let t = args[0].text();
            let what: Vec<char> = match args.get(1) {
                Some(w) => w.text().chars().collect(),
                None => vec![' '],
            };
            let mut s: &str = &t;
            if leading {
                s = s.trim_start_matches(|c| what.contains(&c));
            }
            if trailing {
                s = s.trim_end_matches(|c| what.contains(&c));
            }
            owned(s.to_string())
        }
        Func::Coalesce | Func::NullIf => unreachable!("handled above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(q: &str) -> String {
        parse(q).expect_err(q)
    }

    #[test]
    fn refuses_what_it_cannot_do_by_name() {
        assert!(err("SELECT * FROM a JOIN b ON a.x = b.x").contains("JOIN"));
        assert!(err("SELECT DISTINCT x FROM t").contains("DISTINCT"));
        assert!(err("SELECT x FROM t UNION SELECT y FROM t").contains("UNION"));
        assert!(err("SELECT x FROM t WHERE COUNT(*) > 1").contains("aggregate COUNT"));
        assert!(err("SELECT x, COUNT(*) FROM t").contains("column x must appear in GROUP BY"));
        assert!(err("SELECT y FROM t GROUP BY x").contains("column y"));
        assert!(err("SELECT FOO(x) FROM t").contains("unknown function FOO"));
        assert!(err("SELECT x FROM t; SELECT y FROM t").contains("one SELECT"));
        assert!(err("DELETE FROM t").contains("one SELECT"));
        assert!(err("SELECT x FROM").contains("Expected"));
        assert!(err("SELECT FROM t").contains("SELECT names nothing"));
        assert!(err("SELECT x FROM t ORDER BY 3").contains("ORDER BY 3"));
        assert!(err("SELECT x FROM t LIMIT x").contains("LIMIT takes a number"));
        assert!(err("SELECT SUM(x, y) FROM t").contains("SUM takes one argument"));
        assert!(err("SELECT COUNT(DISTINCT x) FROM t").contains("DISTINCT"));
        assert!(err("SELECT * FROM (SELECT 1)").contains("subquery"));
        assert!(err("SELECT CAST(x AS DATE) FROM t").contains("CAST to DATE"));
        assert!(err(&format!("SELECT {} FROM t", "1+".repeat(100) + "1")).contains("deeper"));
        assert!(err(&format!("SELECT {} FROM t", "(".repeat(100) + "1" + &")".repeat(100))).contains("recursion"));
        assert!(err(&format!("SELECT '{}' FROM t", "x".repeat(QUERY_BYTES_MAX))).contains("bytes"));
    }

    #[test]
    fn group_keys_and_aggregates_are_shared() {
        let p =
            parse("SELECT lower(g) AS k, SUM(n), SUM(n) + 1 FROM s3object s WHERE s.n > 0 GROUP BY lower(g) HAVING SUM(n) > 2 ORDER BY k")
                .unwrap();
        let g = p.group.as_ref().unwrap();
        assert_eq!(g.keys.len(), 1);
        assert_eq!(g.aggs.len(), 1, "one SUM(n)");
        assert!(matches!(&p.items[0], Item::Expr { expr: Expr::Key(0), name } if name == "k"));
        assert!(matches!(p.order[0].expr, Expr::Output(0)));
        // n (through the alias s) and g: two columns.
        assert_eq!(p.refs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["g", "n"]);
    }
}
