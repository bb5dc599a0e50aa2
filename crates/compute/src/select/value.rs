//! SQL values and what SQL does with them: three-valued comparisons, arithmetic that
//! widens to floating point on overflow, casts, LIKE.
//!
//! The reference is SQLite with columns of NUMERIC affinity (what the tests compare
//! with): a CSV field that reads as an integer is an integer, one that reads as a decimal
//! number is a float, an empty one is NULL, anything else is text. Where SQLite quietly
//! turns bad text into 0 (CAST('abc' AS INT), 'abc' + 1), we refuse with an error that
//! names the value, as PostgreSQL and S3 Select do.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::hash::{Hash, Hasher};

#[derive(Clone, Debug, PartialEq)]
pub enum Value<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(Cow<'a, str>),
}

/// A number, for arithmetic and comparison; booleans count as 0 and 1.
#[derive(Clone, Copy)]
enum Num {
    I(i64),
    F(f64),
}

impl Num {
    fn f(self) -> f64 {
        match self {
            Num::I(i) => i as f64,
            Num::F(f) => f,
        }
    }
}

/// The types CAST converts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SqlType {
    Int,
    Float,
    Text,
    Bool,
}

impl<'a> Value<'a> {
    /// A CSV field: empty is NULL, an integer literal is an integer, a decimal literal a
    /// float, anything else text. No white space is trimmed.
    pub fn infer(s: Cow<'a, str>) -> Value<'a> {
        let b = s.as_bytes();
        let Some(&first) = b.first() else { return Value::Null };
        if first.is_ascii_digit() || matches!(first, b'-' | b'+' | b'.') {
            if let Ok(i) = s.parse::<i64>() {
                return Value::Int(i);
            }
            if let Some(f) = parse_decimal(&s) {
                return Value::Float(f);
            }
        }
        Value::Text(s)
    }

    pub fn from_json(v: &'a serde_json::Value) -> Value<'a> {
        match v {
            serde_json::Value::Null => Value::Null,
            serde_json::Value::Bool(b) => Value::Bool(*b),
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(i) => Value::Int(i),
                None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            serde_json::Value::String(s) => Value::Text(Cow::Borrowed(s)),
            other => Value::Text(Cow::Owned(other.to_string())),
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => (*b).into(),
            Value::Int(i) => (*i).into(),
            // JSON has no infinities or NaN: they travel as text, as SQLite prints them.
            Value::Float(f) => serde_json::Number::from_f64(*f).map(serde_json::Value::Number).unwrap_or_else(|| float_text(*f).into()),
            Value::Text(s) => serde_json::Value::String(s.to_string()),
        }
    }

    pub fn into_owned(self) -> Value<'static> {
        match self {
            Value::Null => Value::Null,
            Value::Bool(b) => Value::Bool(b),
            Value::Int(i) => Value::Int(i),
            Value::Float(f) => Value::Float(f),
            Value::Text(s) => Value::Text(Cow::Owned(s.into_owned())),
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    /// Bytes the value holds once owned ([`Value::into_owned`]), for the memory bound.
    pub fn owned_footprint(&self) -> usize {
        std::mem::size_of::<Self>()
            + match self {
                Value::Text(Cow::Owned(s)) => s.capacity(),
                Value::Text(s) => s.len(),
                _ => 0,
            }
    }

    fn num(&self) -> Option<Num> {
        match self {
            Value::Bool(b) => Some(Num::I(*b as i64)),
            Value::Int(i) => Some(Num::I(*i)),
            Value::Float(f) => Some(Num::F(*f)),
            _ => None,
        }
    }

    /// For messages: the value as SQL would write it.
    pub fn describe(&self) -> String {
        match self {
            Value::Text(s) => {
                let s: String = s.chars().take(40).collect();
                format!("'{}'", s.replace('\'', "''"))
            }
            v => v.text().into_owned(),
        }
    }

    /// The value as text: what `||`, CAST(... AS TEXT) and the CSV output write.
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            Value::Null => Cow::Borrowed(""),
            Value::Bool(b) => Cow::Borrowed(if *b { "true" } else { "false" }),
            Value::Int(i) => Cow::Owned(i.to_string()),
            Value::Float(f) => Cow::Owned(float_text(*f)),
            Value::Text(s) => Cow::Borrowed(s),
        }
    }

    /// The truth of a WHERE, HAVING, AND, OR, NOT or CASE condition: NULL is unknown;
    /// numbers are true when not zero; text is an error.
    pub fn truth(&self) -> Result<Option<bool>, String> {
        match self {
            Value::Null => Ok(None),
            Value::Bool(b) => Ok(Some(*b)),
            Value::Int(i) => Ok(Some(*i != 0)),
            Value::Float(f) => Ok(Some(*f != 0.0)),
            Value::Text(_) => Err(format!("a condition is the text {}, not a boolean", self.describe())),
        }
    }

    /// Hash for GROUP BY, consistent with [`same_group`]: 3 and 3.0 are one group.
    pub fn hash_into(&self, h: &mut impl Hasher) {
        match self {
            Value::Null => 0u8.hash(h),
            Value::Text(s) => {
                1u8.hash(h);
                s.hash(h);
            }
            v => {
                let n = v.num().expect("a number");
                match n {
                    Num::I(i) => {
                        2u8.hash(h);
                        i.hash(h)
                    }
                    Num::F(f) if f.fract() == 0.0 && f >= i64::MIN as f64 && f < i64::MAX as f64 => {
                        2u8.hash(h);
                        (f as i64).hash(h)
                    }
                    Num::F(f) => {
                        3u8.hash(h);
                        f.to_bits().hash(h)
                    }
                }
            }
        }
    }
}

/// Float text: shortest round-trip digits, always with a point or exponent so it reads
/// back as a float.
pub fn float_text(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{f:?}")
    }
}

/// A decimal literal: digits with optional sign, point and exponent; not "inf" or "nan".
pub fn parse_decimal(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    if b.is_empty() || !b.iter().all(|c| c.is_ascii_digit() || matches!(c, b'+' | b'-' | b'.' | b'e' | b'E')) {
        return None;
    }
    if !b.iter().any(u8::is_ascii_digit) {
        return None;
    }
    s.parse::<f64>().ok()
}

/// SQL comparison of two values: None when either is NULL. Numbers compare by value
/// (an integer and a float too); text by its UTF-8 bytes; a number is less than any text.
pub fn compare(a: &Value, b: &Value) -> Option<Ordering> {
    if a.is_null() || b.is_null() {
        return None;
    }
    Some(order(a, b))
}

/// The total order of ORDER BY, MIN and MAX: NULL first, then numbers, then text.
pub fn order(a: &Value, b: &Value) -> Ordering {
    match (a, b) {
        (Value::Null, Value::Null) => Ordering::Equal,
        (Value::Null, _) => Ordering::Less,
        (_, Value::Null) => Ordering::Greater,
        (Value::Text(x), Value::Text(y)) => x.as_bytes().cmp(y.as_bytes()),
        (Value::Text(_), _) => Ordering::Greater,
        (_, Value::Text(_)) => Ordering::Less,
        _ => match (a.num().expect("number"), b.num().expect("number")) {
            (Num::I(x), Num::I(y)) => x.cmp(&y),
            (x, y) => x.f().partial_cmp(&y.f()).unwrap_or_else(|| x.f().total_cmp(&y.f())),
        },
    }
}

/// Whether two GROUP BY values fall in one group: NULLs do, equal numbers do.
pub fn same_group(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::Null, _) | (_, Value::Null) => false,
        _ => order(a, b) == Ordering::Equal,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arith {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
}

impl Arith {
    fn symbol(self) -> &'static str {
        match self {
            Arith::Add => "+",
            Arith::Sub => "-",
            Arith::Mul => "*",
            Arith::Div => "/",
            Arith::Rem => "%",
        }
    }
}

/// Arithmetic as SQLite does it: NULL in, NULL out; integers stay integers and widen to
/// floating point on overflow; integer division truncates; division by zero is NULL.
pub fn arith(op: Arith, a: &Value, b: &Value) -> Result<Value<'static>, String> {
    if a.is_null() || b.is_null() {
        return Ok(Value::Null);
    }
    let (Some(x), Some(y)) = (a.num(), b.num()) else {
        let t = if a.num().is_none() { a } else { b };
        return Err(format!("{} {} {}: {} is not a number", a.describe(), op.symbol(), b.describe(), t.describe()));
    };
    Ok(match (x, y) {
        (Num::I(x), Num::I(y)) => {
            let r = match op {
                Arith::Add => x.checked_add(y),
                Arith::Sub => x.checked_sub(y),
                Arith::Mul => x.checked_mul(y),
                Arith::Div if y == 0 => return Ok(Value::Null),
                Arith::Rem if y == 0 => return Ok(Value::Null),
                // i64::MIN / -1 overflows: SQLite gives the float.
                Arith::Div => x.checked_div(y),
                Arith::Rem => Some(x.checked_rem(y).unwrap_or(0)),
            };
            match r {
                Some(r) => Value::Int(r),
                None => Value::Float(float_op(op, x as f64, y as f64)),
            }
        }
        (x, y) => {
            if matches!(op, Arith::Div | Arith::Rem) && y.f() == 0.0 {
                return Ok(Value::Null);
            }
            Value::Float(float_op(op, x.f(), y.f()))
        }
    })
}

fn float_op(op: Arith, x: f64, y: f64) -> f64 {
    match op {
        Arith::Add => x + y,
        Arith::Sub => x - y,
        Arith::Mul => x * y,
        Arith::Div => x / y,
        Arith::Rem => x % y,
    }
}

pub fn negate(v: &Value) -> Result<Value<'static>, String> {
    match v {
        Value::Null => Ok(Value::Null),
        Value::Int(i) => Ok(i.checked_neg().map(Value::Int).unwrap_or(Value::Float(-(*i as f64)))),
        Value::Float(f) => Ok(Value::Float(-f)),
        Value::Bool(b) => Ok(Value::Int(-(*b as i64))),
        Value::Text(_) => Err(format!("-{}: not a number", v.describe())),
    }
}

/// CAST: NULL stays NULL; a float to an integer truncates toward zero; text must read as
/// the type (surrounding white space allowed), or the cast fails naming the value.
pub fn cast<'a>(v: Value<'a>, to: SqlType) -> Result<Value<'a>, String> {
    let fail = |v: &Value| Err(format!("CAST({} AS {to:?}): not a valid {to:?}", v.describe()));
    Ok(match (v, to) {
        (Value::Null, _) => Value::Null,
        (Value::Text(s), SqlType::Text) => Value::Text(s),
        (v, SqlType::Text) => Value::Text(Cow::Owned(v.text().into_owned())),
        (Value::Bool(b), SqlType::Int) => Value::Int(b as i64),
        (Value::Int(i), SqlType::Int) => Value::Int(i),
        (Value::Float(f), SqlType::Int) => {
            let t = f.trunc();
            if !(t >= i64::MIN as f64 && t < i64::MAX as f64) {
                return fail(&Value::Float(f));
            }
            Value::Int(t as i64)
        }
        (Value::Text(s), SqlType::Int) => {
            let t = s.trim();
            match t.parse::<i64>() {
                Ok(i) => Value::Int(i),
                Err(_) => match parse_decimal(t) {
                    Some(f) => return cast(Value::Float(f), SqlType::Int),
                    None => return fail(&Value::Text(s)),
                },
            }
        }
        (Value::Bool(b), SqlType::Float) => Value::Float(b as i64 as f64),
        (Value::Int(i), SqlType::Float) => Value::Float(i as f64),
        (Value::Float(f), SqlType::Float) => Value::Float(f),
        (Value::Text(s), SqlType::Float) => match parse_decimal(s.trim()) {
            Some(f) => Value::Float(f),
            None => return fail(&Value::Text(s)),
        },
        (Value::Bool(b), SqlType::Bool) => Value::Bool(b),
        (Value::Int(i), SqlType::Bool) => Value::Bool(i != 0),
        (Value::Float(f), SqlType::Bool) => Value::Bool(f != 0.0),
        (Value::Text(s), SqlType::Bool) => match s.trim().to_ascii_lowercase().as_str() {
            "true" | "t" | "1" => Value::Bool(true),
            "false" | "f" | "0" => Value::Bool(false),
            _ => return fail(&Value::Text(s)),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Value<'_> {
        Value::Text(Cow::Borrowed(s))
    }

    #[test]
    fn fields_infer_their_type() {
        assert_eq!(Value::infer("".into()), Value::Null);
        assert_eq!(Value::infer("42".into()), Value::Int(42));
        assert_eq!(Value::infer("-7".into()), Value::Int(-7));
        assert_eq!(Value::infer("2.5".into()), Value::Float(2.5));
        assert_eq!(Value::infer("1e3".into()), Value::Float(1000.0));
        assert_eq!(Value::infer("99999999999999999999".into()), Value::Float(1e20));
        for s in ["abc", " 42", "42 ", "inf", "NaN", "0x10", "1-2", "-", "."] {
            assert_eq!(Value::infer(s.into()), t(s), "{s}");
        }
    }

    #[test]
    fn comparisons_are_three_valued_and_typed() {
        assert_eq!(compare(&Value::Int(3), &Value::Float(3.0)), Some(Ordering::Equal));
        assert_eq!(compare(&Value::Int(3), &Value::Null), None);
        assert_eq!(compare(&t("b"), &t("a")), Some(Ordering::Greater));
        assert_eq!(compare(&Value::Int(1000), &t("1")), Some(Ordering::Less));
        assert_eq!(order(&Value::Null, &Value::Int(i64::MIN)), Ordering::Less);
        assert!(same_group(&Value::Null, &Value::Null));
        assert!(same_group(&Value::Int(2), &Value::Float(2.0)));
    }

    #[test]
    fn arithmetic_follows_sqlite() {
        assert_eq!(arith(Arith::Div, &Value::Int(7), &Value::Int(2)), Ok(Value::Int(3)));
        assert_eq!(arith(Arith::Div, &Value::Int(7), &Value::Int(0)), Ok(Value::Null));
        assert_eq!(arith(Arith::Div, &Value::Float(7.0), &Value::Int(2)), Ok(Value::Float(3.5)));
        assert_eq!(arith(Arith::Add, &Value::Int(i64::MAX), &Value::Int(1)), Ok(Value::Float(i64::MAX as f64 + 1.0)));
        assert_eq!(arith(Arith::Rem, &Value::Int(i64::MIN), &Value::Int(-1)), Ok(Value::Int(0)));
        assert_eq!(arith(Arith::Add, &Value::Null, &Value::Int(1)), Ok(Value::Null));
        assert!(arith(Arith::Add, &t("x"), &Value::Int(1)).unwrap_err().contains("'x' is not a number"));
    }

    #[test]
    fn casts() {
        assert_eq!(cast(Value::Float(-2.7), SqlType::Int), Ok(Value::Int(-2)));
        assert_eq!(cast(t(" 12 "), SqlType::Int), Ok(Value::Int(12)));
        assert_eq!(cast(t("2.5"), SqlType::Int), Ok(Value::Int(2)));
        assert_eq!(cast(Value::Int(5), SqlType::Text), Ok(t("5")));
        assert_eq!(cast(Value::Float(5.0), SqlType::Text), Ok(t("5.0")));
        assert_eq!(cast(Value::Null, SqlType::Int), Ok(Value::Null));
        assert!(cast(t("12abc"), SqlType::Int).unwrap_err().contains("'12abc'"));
        assert!(cast(Value::Float(1e300), SqlType::Int).is_err());
    }
}
