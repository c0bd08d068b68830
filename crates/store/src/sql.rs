//! Small helpers shared by the record modules: time as Unix milliseconds, a query builder for
//! the few dynamic queries (numbered `$n` placeholders work on both SQLite and PostgreSQL), and
//! typed column reads.

use sqlx::any::{AnyArguments, AnyRow};
use sqlx::query::Query;
use sqlx::{Any, Row};
use time::OffsetDateTime;

use crate::{Result, StoreError};

pub(crate) fn now_ms() -> i64 {
    ms(OffsetDateTime::now_utc())
}

pub(crate) fn ms(t: OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

pub(crate) fn from_ms(ms: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

pub(crate) fn get<'r, T>(row: &'r AnyRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, Any> + sqlx::Type<Any>,
{
    row.try_get(column).map_err(StoreError::Database)
}

pub(crate) fn time(row: &AnyRow, column: &str) -> Result<OffsetDateTime> {
    Ok(from_ms(get::<i64>(row, column)?))
}

pub(crate) fn opt_time(row: &AnyRow, column: &str) -> Result<Option<OffsetDateTime>> {
    Ok(get::<Option<i64>>(row, column)?.map(from_ms))
}

pub(crate) fn flag(row: &AnyRow, column: &str) -> Result<bool> {
    Ok(get::<i64>(row, column)? != 0)
}

pub(crate) fn json<T: serde::de::DeserializeOwned>(row: &AnyRow, column: &str) -> Result<T> {
    let text: String = get(row, column)?;
    serde_json::from_str(&text).map_err(|_| StoreError::Malformed(column.to_owned()))
}

pub(crate) fn opt_json<T: serde::de::DeserializeOwned>(
    row: &AnyRow,
    column: &str,
) -> Result<Option<T>> {
    match get::<Option<String>>(row, column)? {
        None => Ok(None),
        Some(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|_| StoreError::Malformed(column.to_owned())),
    }
}

pub(crate) fn to_json<T: serde::Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| StoreError::InvalidArgument(e.to_string()))
}

/// One bound value of a dynamic query.
#[derive(Clone, Debug)]
pub(crate) enum Arg {
    Int(i64),
    Text(String),
}

/// A dynamic query: SQL text plus its arguments in placeholder order.
#[derive(Default)]
pub(crate) struct Sql {
    pub text: String,
    args: Vec<Arg>,
}

impl Sql {
    pub fn new(text: &str) -> Sql {
        Sql {
            text: text.to_owned(),
            args: Vec::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> &mut Sql {
        self.text.push_str(text);
        self
    }

    /// Appends a placeholder bound to `arg`.
    pub fn arg(&mut self, arg: Arg) -> &mut Sql {
        self.args.push(arg);
        let n = self.args.len();
        self.text.push_str(&format!("${n}"));
        self
    }

    pub fn int(&mut self, v: i64) -> &mut Sql {
        self.arg(Arg::Int(v))
    }

    pub fn text(&mut self, v: &str) -> &mut Sql {
        self.arg(Arg::Text(v.to_owned()))
    }

    pub fn query(&self) -> Query<'_, Any, AnyArguments<'_>> {
        let mut query = sqlx::query(&self.text);
        for arg in &self.args {
            query = match arg {
                Arg::Int(v) => query.bind(*v),
                Arg::Text(v) => query.bind(v.clone()),
            };
        }
        query
    }
}
