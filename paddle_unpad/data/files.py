"""Users' data files: text classification tables (jsonl, csv, tsv) and pre-training documents
(plain text or jsonl).

Every error names the file, the line and the column it is about (``DataFileError``, a
``ValueError``); a byte that is not UTF-8 is named by its line and its offset in the file. A
UTF-8 byte-order mark (what Excel's "CSV UTF-8" writes first) is read as one, not as part of
the first column's name. Labels may be integers (class ids as they are) or strings (names mapped to
ids in sorted order; the names by id are returned, to be saved with the model).
"""

import codecs
import contextlib
import csv
import json
import os
import re

__all__ = [
    "DataFileError",
    "TABLE_FORMATS",
    "read_table",
    "classification_rows",
    "label_names_of",
    "read_documents",
    "utf8_text",
]

TABLE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}
_INT = re.compile(r"^[+-]?\d+$")


@contextlib.contextmanager
def wide_csv_fields():
    """csv's field limit raised to 1 GiB while a file is read (a document is one field; the
    default 128 KiB refuses long ones), then put back: the limit is process-wide and the
    user's own csv code keeps its own."""
    old = csv.field_size_limit(1 << 30)
    try:
        yield
    finally:
        csv.field_size_limit(old)


class DataFileError(ValueError):
    """A data file that cannot be read as asked: the message names file, line and column."""


def table_format(path):
    """``jsonl``, ``csv`` or ``tsv`` from the file's extension."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in TABLE_FORMATS:
        raise DataFileError(
            f"paddle_unpad.data: {path}: unknown table format {ext or '(no extension)'!r}; use one of {', '.join(sorted(TABLE_FORMATS))}"
        )
    return TABLE_FORMATS[ext]


def _check_exists(path):
    if not os.path.isfile(path):
        raise DataFileError(f"paddle_unpad.data: {path}: no such file")


@contextlib.contextmanager
def utf8_text(path, newline=None):
    """``path`` opened as UTF-8 text, a leading byte-order mark dropped; a byte that is not UTF-8,
    met while the caller reads, is a :class:`DataFileError` naming its line and offset."""
    try:
        with open(path, encoding="utf-8-sig", newline=newline) as f:
            yield f
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _not_utf8(path):
    """The error for the first byte of ``path`` that is not UTF-8 (the file read again, as bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = skip + e.start
        line, col = data.count(b"\n", 0, at) + 1, at - (data.rfind(b"\n", 0, at) + 1) + 1
        return DataFileError(
            f"paddle_unpad.data: {path}: line {line}: byte {data[at]:#04x} at offset {at} of the file (byte {col} of the line) is not UTF-8 ({e.reason}); save the file as UTF-8"
        )
    return DataFileError(f"paddle_unpad.data: {path}: not UTF-8; save the file as UTF-8")  # it changed meanwhile


def read_table(path):
    """``[(line number, row dict)]`` of a jsonl, csv or tsv file in UTF-8 (csv/tsv: the first line
    names the columns; blank lines are skipped)."""
    _check_exists(path)
    fmt = table_format(path)
    with utf8_text(path, newline="") as f:
        return _read_jsonl(path, f) if fmt == "jsonl" else _read_delimited(path, f, "," if fmt == "csv" else "\t")


def _read_jsonl(path, f):
    rows = []
    for n, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.rstrip("\r\n"))  # without the line end, an error at the end is on this line
        except json.JSONDecodeError as e:
            raise DataFileError(
                f"paddle_unpad.data: {path}: line {n}: not JSON ({e.msg} at column {e.colno})"
            ) from None
        if not isinstance(row, dict):
            raise DataFileError(
                f"paddle_unpad.data: {path}: line {n}: a JSON object with named columns expected, got {type(row).__name__}"
            )
        rows.append((n, row))
    return rows


def _read_delimited(path, f, delimiter):
    with wide_csv_fields():
        return _delimited_rows(path, f, delimiter)


def _delimited_rows(path, f, delimiter):
    reader = csv.reader(f, delimiter=delimiter)
    header = next(reader, None)
    if not header:
        raise DataFileError(f"paddle_unpad.data: {path}: line 1: empty; the first line must name the columns")
    rows = []
    for fields in reader:
        n = reader.line_num
        if not any(x.strip() for x in fields):
            continue
        if len(fields) != len(header):
            raise DataFileError(
                f"paddle_unpad.data: {path}: line {n}: {len(fields)} fields, the header names {len(header)} ({', '.join(header)})"
            )
        rows.append((n, dict(zip(header, fields))))
    return rows


def _cell(path, n, row, column, what):
    if column not in row:
        raise DataFileError(
            f"paddle_unpad.data: {path}: line {n}: no column {column!r} ({what}); columns: {', '.join(map(str, row))}"
        )
    value = row[column]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataFileError(f"paddle_unpad.data: {path}: line {n}: column {column!r} ({what}) is empty")
    return value


def _text(path, n, row, column, what):
    value = _cell(path, n, row, column, what)
    if not isinstance(value, str):
        raise DataFileError(
            f"paddle_unpad.data: {path}: line {n}: column {column!r} ({what}) must be text, got {value!r}"
        )
    return value


def _label_key(path, n, value, column):
    """A label as read: an int (class id) or a str (class name)."""
    if isinstance(value, bool) or isinstance(value, (float, list, dict)):
        raise DataFileError(
            f"paddle_unpad.data: {path}: line {n}: column {column!r} (label) must be an integer or a name, got {value!r}"
        )
    if isinstance(value, int):
        return value
    value = value.strip()
    return int(value) if _INT.match(value) else value


def label_names_of(labels):
    """Class names by id for labels as read: integers are ids (names ``"0"``, ``"1"``, ...); names
    are sorted and numbered."""
    if all(isinstance(x, int) for x in labels):
        return [str(i) for i in range(max(labels) + 1)] if labels else []
    return sorted({str(x) for x in labels})


def classification_rows(path, text_column="text", label_column="label", text_pair_column="", label_names=None):
    """``(rows, label_names)`` of a text classification file: rows ``{"text", "label"}`` (and
    ``"text_pair"`` with ``text_pair_column``), label ids by ``label_names`` (given: the training
    file's, which an evaluation file must keep to; None: built from this file)."""
    table = read_table(path)
    if not table:
        raise DataFileError(f"paddle_unpad.data: {path}: no rows")
    read = []
    for n, row in table:
        item = {"text": _text(path, n, row, text_column, "text")}
        if text_pair_column:
            item["text_pair"] = _text(path, n, row, text_pair_column, "text pair")
        read.append((n, item, _label_key(path, n, _cell(path, n, row, label_column, "label"), label_column)))
    if label_names is None:
        label_names = _names_of_file(path, label_column, read)
    return [dict(item, label=_label_id(path, n, key, label_column, label_names)) for n, item, key in read], list(
        label_names
    )


def _names_of_file(path, column, read):
    keys = [k for _, _, k in read]
    for n, _, k in read:
        if isinstance(k, int) and k < 0 and all(isinstance(x, int) for x in keys):
            raise DataFileError(
                f"paddle_unpad.data: {path}: line {n}: column {column!r} (label): class ids must be >= 0, got {k}"
            )
    return label_names_of(keys)


def _label_id(path, n, key, column, names):
    ids = {name: i for i, name in enumerate(names)}
    if str(key) in ids:
        return ids[str(key)]
    raise DataFileError(
        f"paddle_unpad.data: {path}: line {n}: column {column!r} (label): {key!r} is not one of the training labels ({', '.join(names)})"
    )


def read_documents(path, text_column="text"):
    """Pre-training documents of a file: jsonl (one document a line, its text in ``text_column``) or
    plain text (documents separated by blank lines, or, without blank lines, one document a line)."""
    _check_exists(path)
    if os.path.splitext(path)[1].lower() in (".jsonl", ".json"):
        docs = [_text(path, n, row, text_column, "text") for n, row in _read_jsonl_file(path)]
    else:
        with utf8_text(path) as f:
            text = f.read()
        blocks = [b.strip() for b in re.split(r"\n\s*\n", text.strip())]
        docs = [b for b in blocks if b] if len(blocks) > 1 else [x.strip() for x in text.splitlines() if x.strip()]
    if not docs:
        raise DataFileError(f"paddle_unpad.data: {path}: no documents")
    return docs


def _read_jsonl_file(path):
    with utf8_text(path) as f:
        return _read_jsonl(path, f)
