"""Local data files as the command line names them: comma-separated files, globs and directories,
resolved to one ordered list of files, each with the `datasets` builder that reads it."""

from __future__ import annotations

import glob
import os

EXTENSION_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_VALID = f"files, globs or directories of {', '.join(EXTENSION_BUILDERS)} files, comma-separated"


class DataError(ValueError):
    """Bad data input; message is one line naming the bad value and what would be valid."""


def one_line(error: BaseException, limit: int = 200) -> str:
    """A short one-line reason from an exception, for DataError messages."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def builder_of(path: str, flag: str = "train_file") -> str:
    """The `datasets` builder ("text", "json", "parquet") that reads `path`, by its extension."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSION_BUILDERS:
        raise DataError(
            f"{flag} {path!r} has extension {ext or '(none)'!r}; "
            f"valid extensions are {', '.join(EXTENSION_BUILDERS)}"
        )
    return EXTENSION_BUILDERS[ext]


def _directory_files(directory: str) -> list[str]:
    """The data files under `directory` (recursively, other extensions ignored), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        found += [
            os.path.join(dirpath, f)
            for f in filenames
            if os.path.splitext(f)[1].lower() in EXTENSION_BUILDERS
        ]
    return sorted(found)


def _entry_files(entry: str, flag: str) -> list[str]:
    """The files one comma-separated entry names; empty files found by a glob or a directory are
    skipped (an empty shard is harmless), an empty file named alone is an error."""
    if glob.has_magic(entry):
        matched = [p for p in sorted(glob.glob(entry, recursive=True)) if os.path.isfile(p)]
        if not matched:
            raise DataError(f"{flag} {entry!r} matches no file; give {_VALID}")
        for path in matched:
            builder_of(path, flag)
    elif os.path.isdir(entry):
        matched = _directory_files(entry)
        if not matched:
            raise DataError(f"{flag} {entry!r} is a directory without data files; give {_VALID}")
    elif os.path.isfile(entry):
        builder_of(entry, flag)
        if os.path.getsize(entry) == 0:  # the json builder would fail with a bare StopIteration
            raise DataError(f"{flag} {entry!r} is empty")
        return [entry]
    else:
        raise DataError(f"{flag} {entry!r} does not exist; give {_VALID}")
    files = [p for p in matched if os.path.getsize(p) > 0]
    if not files:
        raise DataError(f"{flag} {entry!r} names only empty files")
    return files


def resolve_files(spec: str, flag: str = "train_file") -> list[str]:
    """Every file `spec` names, in the order given (globs and directories sorted), once each."""
    entries = [e.strip() for e in spec.split(",")]
    if not all(entries):
        raise DataError(f"{flag} {spec!r} has an empty entry; give {_VALID}")
    files: dict[str, None] = {}  # ordered and deduplicated
    for entry in entries:
        files.update(dict.fromkeys(_entry_files(entry, flag)))
    return list(files)


def builder_groups(files: list[str]) -> list[tuple[str, list[str]]]:
    """Consecutive files read by the same builder, as (builder, files), in order."""
    groups: list[tuple[str, list[str]]] = []
    for path in files:
        builder = builder_of(path)
        if groups and groups[-1][0] == builder:
            groups[-1][1].append(path)
        else:
            groups.append((builder, [path]))
    return groups
