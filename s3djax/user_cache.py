"""The user's cache folder, and the JSON tables of measurements kept in it (one entry per machine and setting).

`$S3DJAX_CACHE`, else `$XDG_CACHE_HOME/s3djax`, else `~/.cache/s3djax`. A table that cannot be read is ignored
with one line (it is measured again); one that cannot be written says so and is measured again next time.
"""

from __future__ import annotations

import json
import os
import sys


def path(*parts: str) -> str:
    root = os.environ.get("S3DJAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "s3djax")
    return os.path.join(root, *parts)


def read_table(name: str, valid) -> dict:
    """The table `name` ({key: entry}), each entry checked by `valid(entry)`; {} where there is none or it is bad."""
    file = path(name)
    try:
        with open(file) as f:
            table = json.load(f)
        if not isinstance(table, dict) or not all(isinstance(v, dict) and valid(v) for v in table.values()):
            raise ValueError("not a table this version wrote")
        return table
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"note: ignoring {file} ({e}); measuring again", file=sys.stderr)
        return {}


def write_json(file: str, obj) -> None:
    """`obj` as JSON at `file`, written whole or not at all (a temporary file renamed over the old one)."""
    os.makedirs(os.path.dirname(file), exist_ok=True)
    tmp = f"{file}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, file)


def write_table(name: str, table: dict) -> None:
    """Written whole or not at all; a cache that cannot be written says so."""
    file = path(name)
    try:
        write_json(file, table)
    except OSError as e:
        print(f"note: cannot save {file} ({e.strerror}); measuring again next time", file=sys.stderr)
