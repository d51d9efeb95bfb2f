//! Parquet, through the `arrow` reader.
//!
//! Only the mapped top-level columns are read. Each record batch is converted column by
//! column into JSON values (strings, numbers, booleans, lists, structs, dictionaries),
//! and each row then goes through the same [`FieldMapping`] as a JSONL line, so both
//! formats accept the same shapes and report the same messages.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type,
    UInt64Type,
};
use arrow_array::{Array, OffsetSizeTrait};
use arrow_schema::DataType;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::errors::ParquetError;
use serde_json::{Map, Number, Value};

use super::Collector;
use super::mapping::FieldMapping;
use crate::dataset::Record;
use crate::error::{Error, Location, Result};

/// Rows decoded per record batch: large enough to amortise decoding, small enough
/// that the JSON staging of one batch stays a few megabytes.
const BATCH_ROWS: usize = 4096;

/// [`read`], with a panic of the `parquet` crate turned into an error naming the
/// file: on some malformed footers (a column chunk with a negative offset, say) it
/// asserts instead of returning an error, and a bad file must not take the process
/// down.
pub(super) fn read_guarded(path: &Path, fields: &FieldMapping, out: &mut Collector) -> Result<u64> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(path, fields, out))) {
        Ok(result) => result,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".to_owned());
            Err(Error::Parquet {
                path: path.to_owned(),
                source: ParquetError::General(format!("the reader failed on malformed data ({what})")),
            })
        }
    }
}

/// Reads one file; returns how many record ids (rows) it used.
fn read(path: &Path, fields: &FieldMapping, out: &mut Collector) -> Result<u64> {
    let parquet = |source| Error::Parquet { path: path.to_owned(), source };
    let file = File::open(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
    let size = file.metadata().map_err(|source| Error::Io { path: path.to_owned(), source })?.len();
    if size == 0 {
        return Err(Error::EmptyFile { path: path.to_owned() });
    }
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(parquet)?;
    let schema = builder.parquet_schema();
    let roots: Vec<String> = schema.root_schema().get_fields().iter().map(|f| f.name().to_owned()).collect();
    let mut projection = BTreeSet::new();
    for field in fields.fields() {
        // A dotted field reads a nested struct column unless a column has the literal name.
        let root =
            if roots.iter().any(|r| r == field) { field } else { field.split('.').next().unwrap_or(field) };
        match roots.iter().position(|r| r == root) {
            Some(index) => projection.insert(index),
            None => {
                return Err(Error::MissingColumn {
                    path: path.to_owned(),
                    field: field.to_owned(),
                    columns: roots.join(", "),
                });
            }
        };
    }
    let mask = ProjectionMask::roots(schema, projection);
    let reader = builder.with_projection(mask).with_batch_size(BATCH_ROWS).build().map_err(parquet)?;

    let mut row = 0u64;
    for batch in reader {
        let batch = batch.map_err(|e| parquet(ParquetError::from(e)))?;
        let batch_schema = batch.schema();
        let mut columns = Vec::with_capacity(batch.num_columns());
        for (field, column) in batch_schema.fields().iter().zip(batch.columns()) {
            let values = column_values(column.as_ref()).map_err(|data_type| Error::UnsupportedColumn {
                path: path.to_owned(),
                field: field.name().clone(),
                data_type,
            })?;
            columns.push((field.name().clone(), values));
        }
        for i in 0..batch.num_rows() {
            let mut object = Map::with_capacity(columns.len());
            for (name, values) in &mut columns {
                object.insert(name.clone(), std::mem::take(&mut values[i]));
            }
            let id = out.id(row);
            row += 1;
            let location = Location::Row(row);
            match fields.apply(&Value::Object(object)) {
                Ok(m) => out.keep(
                    Record { id, content: m.content, reference: m.reference, metadata: m.metadata },
                    location,
                ),
                Err(e) => out.bad(Error::BadRecord {
                    path: path.to_owned(),
                    location,
                    field: e.field,
                    reason: e.reason,
                })?,
            }
        }
    }
    Ok(row)
}

/// Every value of `array` as JSON, nulls as `Value::Null`; `Err` carries the name of
/// an unsupported data type.
fn column_values(array: &dyn Array) -> std::result::Result<Vec<Value>, String> {
    macro_rules! primitive {
        ($t:ty) => {
            array.as_primitive::<$t>().iter().map(|v| v.map_or(Value::Null, Value::from)).collect()
        };
    }
    let float = |v: Option<f64>| match v {
        None => Value::Null,
        // JSON has no NaN or infinity; keep them readable as text.
        Some(x) => Number::from_f64(x).map_or_else(|| Value::String(x.to_string()), Value::Number),
    };
    let text = |v: Option<&str>| v.map_or(Value::Null, |s| Value::String(s.to_owned()));
    Ok(match array.data_type() {
        DataType::Null => vec![Value::Null; array.len()],
        DataType::Boolean => array.as_boolean().iter().map(|v| v.map_or(Value::Null, Value::Bool)).collect(),
        DataType::Int8 => primitive!(Int8Type),
        DataType::Int16 => primitive!(Int16Type),
        DataType::Int32 => primitive!(Int32Type),
        DataType::Int64 => primitive!(Int64Type),
        DataType::UInt8 => primitive!(UInt8Type),
        DataType::UInt16 => primitive!(UInt16Type),
        DataType::UInt32 => primitive!(UInt32Type),
        DataType::UInt64 => primitive!(UInt64Type),
        DataType::Float32 => {
            array.as_primitive::<Float32Type>().iter().map(|v| float(v.map(f64::from))).collect()
        }
        DataType::Float64 => array.as_primitive::<Float64Type>().iter().map(float).collect(),
        DataType::Utf8 => array.as_string::<i32>().iter().map(text).collect(),
        DataType::LargeUtf8 => array.as_string::<i64>().iter().map(text).collect(),
        DataType::Utf8View => array.as_string_view().iter().map(text).collect(),
        DataType::List(_) => list_values(array.as_list::<i32>())?,
        DataType::LargeList(_) => list_values(array.as_list::<i64>())?,
        DataType::FixedSizeList(_, _) => {
            let list = array.as_fixed_size_list();
            let child = column_values(list.values().as_ref())?;
            let width = list.value_length() as usize;
            (0..list.len())
                .map(|i| {
                    if list.is_null(i) {
                        Value::Null
                    } else {
                        let start = list.value_offset_at(i);
                        Value::Array(child[start..start + width].to_vec())
                    }
                })
                .collect()
        }
        DataType::Struct(fields) => {
            let array = array.as_struct();
            let children = array
                .columns()
                .iter()
                .map(|c| column_values(c.as_ref()))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            (0..array.len())
                .map(|i| {
                    if array.is_null(i) {
                        return Value::Null;
                    }
                    let object =
                        fields.iter().zip(&children).map(|(f, c)| (f.name().clone(), c[i].clone())).collect();
                    Value::Object(object)
                })
                .collect()
        }
        DataType::Dictionary(_, _) => {
            let dictionary = array.as_any_dictionary();
            let values = column_values(dictionary.values().as_ref())?;
            if values.is_empty() {
                vec![Value::Null; array.len()]
            } else {
                let keys = dictionary.normalized_keys();
                (0..array.len())
                    .map(|i| if array.is_null(i) { Value::Null } else { values[keys[i]].clone() })
                    .collect()
            }
        }
        other => return Err(other.to_string()),
    })
}

fn list_values<O: OffsetSizeTrait>(
    list: &arrow_array::GenericListArray<O>,
) -> std::result::Result<Vec<Value>, String> {
    let child = column_values(list.values().as_ref())?;
    let offsets = list.value_offsets();
    Ok((0..list.len())
        .map(|i| {
            if list.is_null(i) {
                Value::Null
            } else {
                Value::Array(child[offsets[i].as_usize()..offsets[i + 1].as_usize()].to_vec())
            }
        })
        .collect())
}
